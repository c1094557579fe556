"""What every job runs under (``guard``): the grace kept from its time limit, its own deadline, cancels,
the processes it started ended, and its age read from /proc."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from lab_utils.run import guard


def test_the_grace_kept_from_a_time_limit():
    """10 % of the limit, at least 10 s, at most 60 s, never more than half of it."""
    assert [guard.grace_s(m) for m in (0.25, 0.5, 1, 5, 10, 11, 600)] == [7.5, 10, 10, 30, 60, 60, 60]


def test_the_guard_outlasts_an_early_time_limit_warning_and_stops_at_its_own_deadline():
    """SIGUSR2 (SLURM's warning, up to 30 s early) does not end the job, nor kill the processes it
    started (they inherit it blocked); the job's own deadline ends it as timed out and them too."""
    with pytest.raises(guard.JobEnded, match="^timed out: the test's 3 s"):
        with guard.job_guard(3.0, limit="the test's 3 s"):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGUSR2)
            child.send_signal(signal.SIGUSR2)
            time.sleep(0.5)
            assert child.poll() is None, "the early warning killed the job's child"
            time.sleep(30)
    assert child.wait(timeout=10) == -signal.SIGKILL


def test_a_cancel_ends_the_job_for_slurm_to_report_and_a_local_one_reports_it(tmp_path, monkeypatch):
    with pytest.raises(guard.JobEnded, match="^cancelled: signal SIGTERM"):
        with guard.job_guard(60.0):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    with pytest.raises(SystemExit):  # no result: SLURM's state (CANCELLED, or pending again) is the outcome
        with guard.job_guard(60.0, scheduler=True):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    (tmp_path / guard.CANCEL_FILE).touch()  # cancelled before the job reached its guard
    monkeypatch.setenv("SUBMITIT_FOLDER", str(tmp_path))
    with pytest.raises(guard.JobEnded, match="^cancelled: the run cancelled it while it was starting"):
        with guard.job_guard(60.0):
            pytest.fail("the body ran")


def test_a_job_folder_without_the_cancel_file_runs_its_body(tmp_path, monkeypatch):
    monkeypatch.setenv("SUBMITIT_FOLDER", str(tmp_path))
    ran = []
    with guard.job_guard(60.0):
        ran.append(True)
    assert ran == [True]


def test_the_deadlines_message_counts_the_seconds_the_process_had_run_before():
    """Stopped at its 0.2 s deadline, a job whose process had run 100 s says it ran about 100 s."""
    with pytest.raises(
        guard.JobEnded, match=r"^timed out: the test's limit \(the job stopped itself after running 100 s\)"
    ):
        with guard.job_guard(0.2, limit="the test's limit", age_s=100.0):
            time.sleep(5)


def test_this_process_age_is_what_the_system_says_it_is():
    """Against psutil's start time (a second reading of the same clock): both in seconds."""
    age = guard.process_age_s()
    want = time.time() - psutil.Process().create_time()
    assert isinstance(age, float) and abs(age - want) < 1.0, (age, want)


def test_a_jobs_deadline_is_its_limit_less_the_grace_and_the_time_it_has_run(monkeypatch):
    monkeypatch.setattr(guard, "process_age_s", lambda: 5.0)
    assert guard.JobBody(10, "local").deadline_s() == 600 - 60 - 5  # 10 minutes, 60 s of grace
    assert guard.JobBody(2, "slurm").deadline_s() == 120 - 12 - 5  # 10 % of 120 s


def test_a_requeued_job_checkpoints_to_the_same_call():
    body = guard.JobBody(5, "slurm")
    again = body.checkpoint(print, "a", 1)
    assert again.function is body and again.args == (print, "a", 1)


def _stat_state(pid: int) -> str:
    """A process's state letter from /proc ("" when gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _wait_dead(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _stat_state(pid) in ("", "Z", "X"):
            return True
        time.sleep(0.05)
    return False


GRANDCHILD = (
    "import subprocess, sys, time\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(g.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def test_the_process_tree_remembers_and_kills_every_process_under_a_root():
    """A child leading its own session, with a grandchild: both seen, both alive, both ended, the
    grandchild through the child's process group."""
    child = subprocess.Popen(
        [sys.executable, "-c", GRANDCHILD], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        grandchild = int(child.stdout.readline())
        tree = guard.ProcessTree()
        tree.add(child.pid)
        assert set(tree.seen) == {child.pid, grandchild}
        assert sorted(tree.alive()) == sorted([child.pid, grandchild])
        guard.kill_tree([child.pid])  # the group leader only: its group goes with it
        assert child.wait(timeout=5) == -signal.SIGKILL
        assert _wait_dead(grandchild), "the grandchild outlived its process group's SIGKILL"
        assert tree.alive() == []
    finally:
        child.kill()
        child.wait()
    me = guard.ProcessTree()
    me.add(os.getpid())
    assert os.getpid() in me.seen and os.getpid() in me.alive()


def test_a_job_runs_its_body_under_its_own_deadline(monkeypatch):
    """10 minutes less 60 s of grace less the 5 s its process had already run: 535 s from now."""
    seen = {}

    @contextlib.contextmanager
    def record(deadline_s=None, **kw):
        seen.update(kw, deadline_s=deadline_s)
        yield

    monkeypatch.setattr(guard, "process_age_s", lambda: 5.0)
    monkeypatch.setattr(guard, "job_guard", record)
    assert guard.JobBody(10, "slurm")(lambda a, b: a + b, 2, 3) == 5
    assert seen == {
        "deadline_s": 600 - 60 - 5,
        "scheduler": True,
        "limit": "its 10-minute time limit less 60 s kept to end it",
        "age_s": 5.0,
    }
    guard.JobBody(0.5, "local")(print)
    assert seen["deadline_s"] == 30 - 10 - 5 and seen["scheduler"] is False


def test_sigusr2_within_45_s_of_the_deadline_is_the_time_limits_warning_and_earlier_a_preemption():
    """30 s before its deadline (SLURM's warning may come 30 s early): the job goes on; 100 s before
    it: a preemption notice, and a job with no checkpoint handler ends as preempted."""
    with guard.job_guard(30.0):
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.5)
    with pytest.raises(guard.JobEnded, match=r"^cancelled: preempted \(signal SIGUSR2\)"):
        with guard.job_guard(100.0):
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(5)
