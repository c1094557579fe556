"""A Ctrl-C that arrives while a job is being submitted is held until the job is registered, then
stops the run whatever SIGINT's handler was (a Python one, the default action, or one installed
outside Python), unless SIGINT is ignored; the handler is restored either way.  A forked child
(``Forked``) sees this process as it is and sends its value back, or ``ChildFailed`` says why not."""

import contextlib
import io
import os
import signal
from dataclasses import replace
from types import SimpleNamespace

import pytest

from lab_utils.core.config import ConfigError
from lab_utils.run import executors, slurm
from lab_utils.run.cluster import ClusterOptions
from lab_utils.run.executors import MapOptions, Outcome, Task, _interrupt_after, map_jobs, run_tasks


@pytest.fixture
def sigint():
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)


def _ctrl_c_inside():
    registered = []
    with _interrupt_after():
        os.kill(os.getpid(), signal.SIGINT)
        registered.append("job")  # the submission goes on to its end
    return registered


@pytest.mark.parametrize("handler", [signal.default_int_handler, signal.SIG_DFL], ids=["python", "default"])
def test_a_ctrl_c_held_during_a_submission_stops_the_run_once_it_is_registered(sigint, handler):
    signal.signal(signal.SIGINT, handler)
    seen = []
    with pytest.raises(KeyboardInterrupt):
        with _interrupt_after():
            os.kill(os.getpid(), signal.SIGINT)
            seen.append("registered")
    assert seen == ["registered"]
    assert signal.getsignal(signal.SIGINT) == handler


def test_a_python_handler_is_called_with_the_held_signal(sigint):
    calls = []
    signal.signal(signal.SIGINT, lambda s, _f: calls.append(s))
    assert _ctrl_c_inside() == ["job"] and calls == [signal.SIGINT]


def test_an_ignored_sigint_stays_ignored(sigint):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    assert _ctrl_c_inside() == ["job"]
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_no_ctrl_c_no_interrupt(sigint):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with _interrupt_after():
        pass
    assert signal.getsignal(signal.SIGINT) == signal.default_int_handler


# ------------------------------------------------------------------ jobs followed on a fake clock
# The jobs below are fakes (no process, no sbatch): the executor submitit would give is replaced by
# one whose jobs end at a time set by the test, on a clock that moves only when the run waits.


class Clock:
    def __init__(self, t0: float = 1000.0):
        self.t = t0

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class FakeProc:
    def __init__(self, clock, ends_at, pid):
        self.clock, self.ends_at, self.pid, self.signals = clock, ends_at, pid, []

    def poll(self):
        return 0 if self.clock.t >= self.ends_at else None

    def send_signal(self, s):
        self.signals.append(s)
        self.ends_at = self.clock.t

    def wait(self, timeout=None):
        return 0


class FakeJob:
    """A job that ran ``fn(*args)`` at once; its process ends (and, for SLURM, its state turns
    terminal) ``plan[key]['s']`` seconds after submission; its result file appears
    ``plan[key].get('lag', 0)`` seconds after that, or never with ``'lost'``."""

    def __init__(self, world, key, fn, args, folder):
        import pickle

        self.world, self.key, self.job_id = world, key, str(100 + len(world.jobs))
        p = world.plan.get(key, {})
        self.ends_at = world.clock.t + p.get("s", 1.0)
        self.result_at = None if p.get("lost") else self.ends_at + p.get("lag", 0.0)
        folder.mkdir(parents=True, exist_ok=True)
        self.paths = SimpleNamespace(folder=folder, result_pickle=folder / f"{key}_result.pkl")
        try:
            self.result = ("success", fn(*args))
        except Exception as e:  # noqa: BLE001 - the fake job's own outcome
            self.result = ("error", f"Traceback ...\n{type(e).__name__}: {e}\n")
        self._pickle = pickle
        self.cancelled = False
        if world.local:
            self._process = FakeProc(world.clock, self.ends_at, 10**9 + len(world.jobs))
        world.jobs[key] = self

    def tick(self):
        if (
            self.result_at is not None
            and self.world.clock.t >= self.result_at
            and not self.paths.result_pickle.exists()
        ):
            self.paths.result_pickle.write_bytes(self._pickle.dumps(self.result))

    def stderr(self):
        return f"log of {self.key}"

    def stdout(self):
        return ""

    def cancel(self, check=True):
        self.cancelled = True


class FakeExecutor:
    def __init__(self, world, folder, kw):
        self.world, self.folder, self.kw, self.params = world, folder, kw, {}

    def update_parameters(self, **kw):
        self.params.update(kw)

    @contextlib.contextmanager
    def batch(self):
        self.world.batches.append(self)
        yield

    def submit(self, body, fn, *args):
        key = self.world.key_of(fn, args)
        if key in self.world.refuse:
            raise RuntimeError(f"  sbatch: error: {key} refused  ")
        self.world.started[key] = (self.world.clock.t, self.kw.get("visible", ()))
        self.world.executors[key] = self
        return FakeJob(self.world, key, fn, args, self.folder)


class FakeWatch:
    def __init__(self, world):
        self.world = world

    def poll(self, ids):
        self.world.polls.append(self.world.clock.t)
        out = {}
        for j in self.world.jobs.values():
            if j.job_id in ids:
                state = self.world.states.get(j.key) or ("COMPLETED" if self.world.clock.t >= j.ends_at else "RUNNING")
                state, reason = state if isinstance(state, tuple) else (state, "")
                out[j.job_id] = slurm.JobState(j.job_id, state, reason=reason, nodes="n1")
        return out

    def settle(self, jid, js):
        self.world.settled.append(jid)
        return slurm.JobState(jid, "COMPLETED", nodes="n7", restarts=2)


class World:
    def __init__(self, monkeypatch, local=True, plan=None, refuse=(), states=None):
        self.clock, self.local, self.plan, self.refuse = Clock(), local, plan or {}, set(refuse)
        self.states = states or {}
        self.jobs, self.started, self.executors, self.batches = {}, {}, {}, []
        self.polls, self.settled, self.trees = [], [], []
        world = self

        def wait(s):
            world.clock.sleep(s)
            if world.clock.t > 2000.0:  # every job here ends within 1000 s of fake time
                raise AssertionError("the run never ended")
            for j in world.jobs.values():
                j.tick()

        class Tree:
            def __init__(self):
                self.pids = set()
                world.trees.append(self)

            def add(self, pid):
                self.pids.add(pid)

            def kill_survivors(self):
                pass

        monkeypatch.setattr(executors, "time", self.clock)
        monkeypatch.setattr(executors, "_wait", wait)
        monkeypatch.setattr(executors, "ProcessTree", Tree)
        monkeypatch.setattr(executors, "make_executor", lambda opts, folder, **kw: FakeExecutor(self, folder, kw))
        monkeypatch.setattr(executors.slurm, "Watch", lambda accounting, **_: FakeWatch(self))

    @staticmethod
    def key_of(fn, args):
        return args[0]

    def opts(self, **kw):
        if self.local:
            return ClusterOptions(executor="local", timeout_min=10, **kw)
        site = slurm.Site(partitions={}, accounting=False)
        return ClusterOptions(executor="slurm", timeout_min=10, cpus_per_task=4, site=site, **kw)


def _echo(key, value=None):
    return value if value is not None else f"value of {key}"


def _fail(key, why):
    raise RuntimeError(why)


def _t(key, devices=0, fn=_echo, *more):
    return Task(key, fn, (key, *more), devices=devices)


def test_local_tasks_get_their_own_free_devices_and_wait_in_order_for_them(monkeypatch, tmp_path):
    """Devices 0..2; a and b ask 2 each, c one: b waits for a (only one device is free), and c,
    behind b in the queue, waits too (a big task is not starved); once a has ended its devices
    come back and b then c start at once, on distinct devices."""
    w = World(monkeypatch, plan={"a": {"s": 3.0}, "b": {"s": 1.0}, "c": {"s": 1.0}})
    tasks = [_t("a", 2), _t("b", 2), _t("c", 1)]
    seen = []
    done = run_tasks(tasks, w.opts(), tmp_path, devices=(0, 1, 2), progress=False, on_done=seen.append)
    assert [o.key for o in seen] == sorted(done, key=lambda k: [o.key for o in seen].index(k))
    assert len(seen) == 3 and {o.key for o in seen} == {"a", "b", "c"}
    (ta, va), (tb, vb), (tc, vc) = w.started["a"], w.started["b"], w.started["c"]
    assert ta == 1000.0 and va == (0, 1)
    assert tb >= ta + 3.0 and tc == tb, (ta, tb, tc)
    assert vb == (0, 1) and vc == (2,)
    for k in "abc":
        o = done[k]
        assert o.state == "ok" and o.ok and o.value == f"value of {k}" and o.error == ""
        assert o.devices == w.started[k][1] and o.job_id == w.jobs[k].job_id and o.log.endswith(f"log of {k}")
    # seconds from its submission to the poll that saw it end (polls every POLL_S)
    assert done["a"].seconds == pytest.approx(3.0, abs=executors.POLL_S + 1e-9) and done["a"].seconds >= 3.0


@pytest.mark.parametrize("max_running", [1, 2, None])
def test_at_most_max_running_local_jobs_at_once(monkeypatch, tmp_path, max_running):
    w = World(monkeypatch, plan={k: {"s": 2.0} for k in "abcd"})
    done = run_tasks([_t(k) for k in "abcd"], w.opts(), tmp_path, max_running=max_running, progress=False)
    assert all(o.ok for o in done.values()) and list(w.started) == list("abcd")
    starts = sorted(t for t, _ in w.started.values())
    cap = max_running or 4
    for i, t in enumerate(starts):  # how many were running when this one started
        overlapping = sum(s <= t < s + 2.0 for s in starts[:i])
        assert overlapping < cap, (starts, max_running)
    assert starts[cap - 1] == starts[0]  # and as many as allowed start together
    if cap < 4:
        assert starts[cap] >= starts[0] + 2.0


def test_a_failing_job_is_its_outcome_and_the_others_go_on(monkeypatch, tmp_path):
    w = World(monkeypatch, plan={"lost": {"s": 1.0, "lost": True}})
    tasks = [
        _t("ok"),
        Task("bad", _fail, ("bad", "deliberate failure")),
        Task("late", _fail, ("late", "JobEnded: timed out: its 10-minute limit")),
        Task("stop", _fail, ("stop", "JobEnded: cancelled: signal SIGTERM")),
        _t("lost"),
    ]
    done = run_tasks(tasks, w.opts(), tmp_path, progress=False)
    assert list(sorted(done)) == sorted(t.key for t in tasks)
    assert done["ok"].state == "ok"
    assert done["bad"].state == "failed" and not done["bad"].ok and done["bad"].value is None
    assert (
        done["bad"].error.endswith("RuntimeError: deliberate failure")
        and done["bad"].error == done["bad"].error.strip()
    )
    assert done["late"].state == "timed out" and done["stop"].state == "cancelled"
    lost = done["lost"]
    assert lost.state == "failed" and "ended without a result" in lost.error and lost.log.endswith("log of lost")
    # locally a job whose process ended (at 1 s, a poll saw it then) is given 2 s for its result
    # file before it counts as lost: its outcome comes at the poll 2 s later, not one after
    assert lost.seconds == pytest.approx(1.0 + 2.0)


def test_a_local_result_that_lags_under_two_seconds_is_still_read(monkeypatch, tmp_path):
    w = World(monkeypatch, plan={"a": {"s": 1.0, "lag": 1.5}})
    done = run_tasks([_t("a")], w.opts(), tmp_path, progress=False)
    assert done["a"].ok and done["a"].value == "value of a"


def test_a_refused_submission_is_a_failed_outcome_and_gives_its_devices_back(monkeypatch, tmp_path):
    w = World(monkeypatch, refuse={"a"})
    done = run_tasks([_t("a", 1), _t("b", 1)], w.opts(), tmp_path, devices=(5,), progress=False)
    assert done["a"].state == "failed" and done["a"].error == "the job was not submitted: sbatch: error: a refused"
    assert done["b"].ok and w.started["b"] == (1000.0, (5,))  # a's device was given back at once


def test_ctrl_c_cancels_every_running_job_and_re_raises(monkeypatch, tmp_path):
    w = World(monkeypatch, plan={"a": {"s": 100.0}, "b": {"s": 100.0}})
    calls = []

    def interrupted(s):
        calls.append(s)
        raise KeyboardInterrupt

    monkeypatch.setattr(executors, "_wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_tasks([_t("a"), _t("b")], w.opts(), tmp_path, progress=False)
    for k in "ab":
        job = w.jobs[k]
        assert job._process.signals == [signal.SIGTERM]
        assert (job.paths.folder / executors.CANCEL_FILE).exists()
    assert {p for t in w.trees for p in t.pids} == {w.jobs[k]._process.pid for k in "ab"}


def test_slurm_tasks_are_one_array_at_most_max_running_at_once(monkeypatch, tmp_path):
    w = World(monkeypatch, local=False, plan={k: {"s": 3.0} for k in "abc"})
    done = executors.run_array([_t(k) for k in "abc"], w.opts(), tmp_path, max_running=2, progress=False)
    assert all(o.ok for o in done.values()) and {o.value for o in done.values()} == {f"value of {k}" for k in "abc"}
    assert len(w.batches) == 1 and w.batches[0].params["array_parallelism"] == 2
    ex = w.executors["a"]
    assert ex.kw["cpus"] == 4 and ex.kw["name"] == "perflab-jobs" and ex.folder == tmp_path / "array"
    assert all(o.resources == "4 CPUs" for o in done.values())
    assert w.settled == []  # an array's tasks are not asked one by one
    # squeue is asked for all jobs every SLURM_POLL_S (a multiple of POLL_S here), not every POLL_S
    gaps = [b - a for a, b in zip(w.polls, w.polls[1:])]
    assert w.polls[0] == 1000.0 and gaps and gaps == [pytest.approx(executors.SLURM_POLL_S)] * len(gaps), w.polls


def test_an_array_of_more_tasks_than_max_running_runs_them_all_at_once_when_fewer(monkeypatch, tmp_path):
    w = World(monkeypatch, local=False)
    executors.run_array([_t("a")], w.opts(), tmp_path, max_running=8, progress=False)
    assert w.batches[0].params["array_parallelism"] == 1


def test_a_slurm_job_gets_its_own_folder_and_its_requeues_from_scontrol(monkeypatch, tmp_path):
    w = World(monkeypatch, local=False, plan={"a": {"s": 1.0}})
    done = run_tasks([Task("a", _echo, ("a",), devices=2)], w.opts(), tmp_path, progress=False)
    o = done["a"]
    assert o.ok and o.restarts == 2 and o.nodes == "n7" and w.settled == [w.jobs["a"].job_id]
    assert w.executors["a"].folder == tmp_path / "a" and w.executors["a"].kw["gpus"] == 2
    assert o.resources == "2 GPUs, 4 CPUs" and w.batches == []


def test_a_slurm_result_lagging_under_result_wait_is_read_and_one_never_written_is_slurms_state(monkeypatch, tmp_path):
    lag = executors.RESULT_WAIT_S - 1.0
    w = World(monkeypatch, local=False, plan={"a": {"s": 1.0, "lag": lag}, "b": {"s": 1.0, "lost": True}},
              states={"b": "TIMEOUT"})  # fmt: skip
    done = run_tasks([_t("a"), _t("b")], w.opts(), tmp_path, progress=False)
    assert done["a"].ok
    b = done["b"]
    assert b.state == "timed out" and "time limit of 10 min" in b.error and b.nodes == "n1"
    # squeue said TIMEOUT at the first poll: its result file is waited for RESULT_WAIT_S, not a poll more
    assert b.seconds == pytest.approx(executors.RESULT_WAIT_S)


def test_a_slurm_job_that_can_never_start_is_cancelled_with_the_reason(monkeypatch, tmp_path):
    w = World(monkeypatch, local=False, plan={"a": {"s": 100.0}}, states={"a": ("PENDING", "PartitionTimeLimit")})
    done = run_tasks([_t("a"), _t("b")], w.opts(), tmp_path, progress=False)
    assert w.jobs["a"].cancelled and done["a"].state == "failed"
    assert "cannot start as submitted" in done["a"].error and "PartitionTimeLimit" in done["a"].error
    assert done["b"].ok and w.clock.t < 1000.0 + 100.0


# ------------------------------------------------------------------ the small rules, hand-derived
@pytest.mark.parametrize(
    "error, state",
    [
        ("RuntimeError: x", "failed"),
        ("JobEnded: timed out: its 5-minute limit", "timed out"),
        ("submitit: not requeued because: timed-out", "timed out"),
        ("JobEnded: cancelled: signal SIGTERM", "cancelled"),
        ("", "failed"),
    ],
)
def test_error_state(error, state):
    assert executors._error_state(error) == state


@pytest.mark.parametrize("gb, text", [(4.0, "4GB"), (1, "1GB"), (0.5, "512MB"), (1.5, "1536MB"), (0.25, "256MB")])
def test_memory_as_sbatch_reads_it(gb, text):
    assert executors._mem(gb) == text


@pytest.mark.parametrize(
    "gpus, cpus, nodes, text",
    [
        (1, 8, 1, "1 GPU, 8 CPUs"),
        (2, 1, 1, "2 GPUs, 1 CPU"),
        (0, 16, 1, "16 CPUs"),
        (0, None, 1, ""),
        (4, 32, 2, "2 nodes x 4 GPUs, 32 CPUs"),
        (1, None, 3, "3 nodes x 1 GPU"),
        (0, None, 2, ""),
    ],
)
def test_resources_line(gpus, cpus, nodes, text):
    assert executors._resources(gpus, cpus, nodes) == text


def test_slots_hand_out_the_lowest_free_devices_and_take_them_back():
    s = executors._Slots((3, 1, 2, 0))
    assert s.take(5) is None and sorted(s.free) == [0, 1, 2, 3]  # nothing taken when not enough
    a = s.take(2)
    assert len(a) == 2 and s.take(3) is None
    b = s.take(2)
    assert sorted(a + b) == [0, 1, 2, 3] and s.take(1) is None and s.take(0) == ()
    s.give(b)
    s.give(a)
    assert s.free == [0, 1, 2, 3] and s.take(1) == (0,)


@pytest.mark.parametrize(
    "timeout_min, time_limit, grace", [(1.5, 2, 10), (2.0, 2, 12), (5.0, 5, 30), (30.0, 30, 60), (0.5, 1, 10)]
)
def test_slurm_executor_parameters(tmp_path, timeout_min, time_limit, grace):
    """sbatch's --time is whole minutes rounded up; the grace kept for ending cleanly is 10 % of the
    limit within [10, 60] s; no GPU asked is no --gpus-per-node at all."""
    opts = ClusterOptions(executor="slurm", partition="p", account="acc", timeout_min=timeout_min, mem_gb=0.5)
    ex = executors.make_executor(opts, tmp_path, name="job", gpus=0, nodes=2, cpus=3)
    p = ex.parameters
    assert p["time"] == time_limit and p["signal_delay_s"] == grace and p["gpus_per_node"] is None
    assert p["mem"] == "512MB" and p["nodes"] == 2 and p["ntasks_per_node"] == 1 and p["cpus_per_task"] == 3
    assert p["job_name"] == "job" and p["partition"] == "p" and p["account"] == "acc" and p["wckey"] is None
    ex = executors.make_executor(replace(opts, mem_gb=None), tmp_path, name="job", gpus=2)
    assert ex.parameters["gpus_per_node"] == 2 and ex.parameters["mem"] is None


def test_local_executor_parameters(tmp_path):
    opts = ClusterOptions(executor="local", timeout_min=5.0)
    ex = executors.make_executor(opts, tmp_path, name="job", gpus=1, nodes=2, visible=[3])
    p = ex.parameters
    assert p["timeout_min"] == 5.0 and p["tasks_per_node"] == 2 and p["gpus_per_node"] == 1
    assert tuple(p["visible_gpus"]) == (3,) and p["signal_delay_s"] == 30


@pytest.mark.parametrize("gb, limit", [(1.5, 1610612736), (4, 4294967296), (None, None), (0, None)])
def test_a_worker_address_space_may_grow_by_mem_gb(monkeypatch, gb, limit):
    calls = []
    monkeypatch.setattr(executors.resource, "setrlimit", lambda what, lim: calls.append((what, lim)))
    monkeypatch.setattr(executors, "_mapped_bytes", lambda: 3 * 2**30)
    executors._limit_memory(gb)
    want = [] if limit is None else [(executors.resource.RLIMIT_AS, (3 * 2**30 + limit,) * 2)]
    assert calls == want


def test_the_mapped_bytes_are_the_kernels_vmsize():
    kb = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmSize:"))
    assert abs(executors._mapped_bytes() - kb * 1024) < 64 * 2**20  # the read itself maps a little


@pytest.mark.parametrize(
    "status", [OSError("no /proc"), "Name:\tpython\nVmRSS:\t 1024 kB\n"], ids=["no-proc", "no-vmsize"]
)
def test_where_the_mapped_bytes_cannot_be_read_they_are_zero_and_the_bound_is_mem_gb(monkeypatch, status):
    """No /proc (not Linux), or a status without VmSize: 0 mapped bytes, so a worker's address
    space is bounded by ``mem_gb`` itself (1.5 GB: 1.5 * 2**30 bytes)."""

    def fake_open(path, *a, **kw):
        if isinstance(status, OSError):
            raise status
        return io.StringIO(status)

    monkeypatch.setattr(executors, "open", fake_open, raising=False)
    assert executors._mapped_bytes() == 0
    calls = []
    monkeypatch.setattr(executors.resource, "setrlimit", lambda what, lim: calls.append((what, lim)))
    executors._limit_memory(1.5)
    assert calls == [(executors.resource.RLIMIT_AS, (1610612736, 1610612736))]


def test_the_mapped_bytes_read_vmsize_in_kibibytes(monkeypatch):
    """``VmSize:`` is in kB of 1024 bytes: 3 kB is 3072 bytes, the first VmSize line counts."""
    status = "Name:\tpython\nVmPeak:\t 9 kB\nVmSize:\t 3 kB\nVmSize:\t 5 kB\n"
    monkeypatch.setattr(executors, "open", lambda path, *a, **kw: io.StringIO(status), raising=False)
    assert executors._mapped_bytes() == 3072


def _allocate_mb(mb):
    return len(bytearray(mb * 2**20))


def test_a_pool_worker_of_a_process_with_a_large_address_space_still_runs_within_its_bound(tmp_path):
    """A pool worker forked from a process that maps more than ``mem_gb`` (as one that has loaded
    torch does) runs a small item, and an item that allocates past the bound fails with the bound
    named while the batch goes on."""
    import mmap

    reserved = mmap.mmap(-1, 3 * 2**30)  # 3 GiB of address space, never touched
    try:
        opts = MapOptions(workers=1, mem_gb=1.0)
        outs = map_jobs(_allocate_mb, [16, 2048, 32], opts, tmp_path / "m", progress=False)
    finally:
        reserved.close()
    assert [o.value for o in outs] == [16 * 2**20, None, 32 * 2**20], [o.error for o in outs]
    assert outs[1].error == "MemoryError: over the worker's bound mem_gb=1.0"


def _square(x):
    if x < 0:
        raise ValueError(f"negative {x}")
    return x * x


def test_map_jobs_in_a_pool_keeps_item_order_and_failures(tmp_path):
    outs = map_jobs(_square, [3, -1, 0, 5], MapOptions(workers=2, mem_gb=None), tmp_path / "m", progress=False)
    assert [o.key for o in outs] == ["0", "1", "2", "3"]
    assert [o.value for o in outs] == [9, None, 0, 25] and [o.ok for o in outs] == [True, False, True, True]
    assert outs[1].state == "failed" and outs[1].error == "ValueError: negative -1"


_MEANWHILE = "PERFLAB_TEST_MEANWHILE"


def _env_seen(_item):
    """What a pool worker inherited of the parent's environment when it was forked."""
    return os.environ.get(_MEANWHILE)


def test_meanwhile_runs_once_in_the_parent_after_the_pool_workers_are_forked(tmp_path, monkeypatch):
    """The caller's work overlaps the workers': they were forked before it (they do not see what
    it did to the parent), it is done once, and every item still runs."""
    monkeypatch.delenv(_MEANWHILE, raising=False)
    calls = []

    def meanwhile():
        calls.append(os.getpid())
        os.environ[_MEANWHILE] = "set by meanwhile"

    outs = map_jobs(_env_seen, list(range(4)), MapOptions(workers=2, mem_gb=None), tmp_path / "m", progress=False,
                    meanwhile=meanwhile)  # fmt: skip
    assert calls == [os.getpid()] and os.environ[_MEANWHILE] == "set by meanwhile"
    assert [o.ok for o in outs] == [True] * 4 and [o.value for o in outs] == [None] * 4


def test_meanwhile_on_submitit_runs_before_the_jobs_are_submitted(monkeypatch, tmp_path):
    order = []

    def fake_run_array(tasks, cluster, folder, *, max_running, progress, desc):
        order.append("submitted")
        return {t.key: Outcome(t.key, "ok", value=t.fn(*t.args)) for t in tasks}

    monkeypatch.setattr(executors, "run_array", fake_run_array)
    monkeypatch.setattr(executors.resource, "setrlimit", lambda *a: None)
    outs = map_jobs(_square, [2, 3], MapOptions(executor="local", mem_gb=1.0), tmp_path / "j", progress=False,
                    meanwhile=lambda: order.append("meanwhile"))  # fmt: skip
    assert order == ["meanwhile", "submitted"] and [o.value for o in outs] == [4, 9]


@pytest.mark.parametrize(
    "opts, name",
    [
        (MapOptions(executor="ray"), "executor"),
        (MapOptions(workers=0), "workers"),
        (MapOptions(mem_gb=0), "mem_gb"),
        (MapOptions(mem_gb=-1.0), "mem_gb"),
    ],
)
def test_map_jobs_refuses_bad_options_before_running(tmp_path, opts, name):
    with pytest.raises(ConfigError) as e:
        map_jobs(_square, [1], opts, tmp_path, progress=False)
    assert name in str(e.value)


def test_map_jobs_on_submitit_is_one_array_of_workers_with_the_memory_bound(monkeypatch, tmp_path):
    seen = {}

    def fake_run_array(tasks, cluster, folder, *, max_running, progress, desc):
        seen.update(tasks=tasks, cluster=cluster, max_running=max_running)
        return {t.key: Outcome(t.key, "ok", value=t.fn(*t.args)) for t in reversed(tasks)}

    def fake_site(cluster, gpus, nodes):
        seen.update(site=(gpus, nodes))
        return replace(cluster, site=slurm.Site(partitions={}, accounting=False))

    monkeypatch.setattr(executors, "run_array", fake_run_array)
    monkeypatch.setattr(executors, "resolve_site", fake_site)
    monkeypatch.setattr(executors.resource, "setrlimit", lambda *a: None)
    folder = tmp_path / "jobs"
    folder.mkdir()
    outs = map_jobs(_square, [2, 3, 4], MapOptions(executor="slurm", workers=3, mem_gb=2.5), folder, progress=False)
    assert [o.value for o in outs] == [4, 9, 16] and not folder.exists()
    assert seen["max_running"] == 3 and seen["site"] == (0, 1)
    assert seen["cluster"].executor == "slurm" and seen["cluster"].mem_gb == 2.5
    assert all(t.cpus == 1 and t.gpus == 0 for t in seen["tasks"]) and [t.key for t in seen["tasks"]] == ["0", "1", "2"]
    assert [t.args[1] for t in seen["tasks"]] == [2, 3, 4] and seen["tasks"][0].args[2] == 2.5
    seen.clear()
    cluster = ClusterOptions(cpus_per_task=6, mem_gb=1.0)
    map_jobs(_square, [1], MapOptions(executor="local", mem_gb=2.5, cluster=cluster), folder, progress=False)
    assert "site" not in seen and seen["tasks"][0].cpus == 6 and seen["cluster"].mem_gb == 1.0


def test_ctrl_c_on_slurm_scancels_every_job_and_waits_until_squeue_says_they_ended(monkeypatch, tmp_path):
    w = World(monkeypatch, local=False, plan={"a": {"s": 100.0}, "b": {"s": 100.0}})
    waits = []

    def interrupted(s):
        waits.append(s)
        raise KeyboardInterrupt

    monkeypatch.setattr(executors, "_wait", interrupted)
    polls_before = []

    def ends_when_cancelled(ids):  # squeue: a cancelled job has left by the second look
        polls_before.append(w.clock.t)
        states = {}
        for j in w.jobs.values():
            if j.job_id in ids:
                gone = j.cancelled and len(polls_before) > 2
                states[j.job_id] = slurm.JobState(j.job_id, "CANCELLED" if gone else "RUNNING")
        return states

    with pytest.raises(KeyboardInterrupt):
        monkeypatch.setattr(FakeWatch, "poll", lambda self, ids: ends_when_cancelled(ids))
        run_tasks([_t("a"), _t("b")], w.opts(), tmp_path, progress=False)
    assert w.jobs["a"].cancelled and w.jobs["b"].cancelled
    assert all((j.paths.folder / executors.CANCEL_FILE).exists() for j in w.jobs.values())
    assert len(polls_before) == 3  # one poll of the run, then squeue until both had left


def _oom(x):
    raise MemoryError


def test_a_pool_worker_over_its_memory_bound_is_a_failed_outcome_naming_the_bound(tmp_path):
    (o,) = map_jobs(_oom, [1], MapOptions(workers=1, mem_gb=None), tmp_path / "m", progress=False)
    assert o.state == "failed" and o.error == "MemoryError: over the worker's bound mem_gb=None"


# ------------------------------------------------------------------------------ Forked
_SEEN_BY_THE_CHILD = {"rows": None}


def test_a_forked_child_sees_this_process_as_it_is_and_sends_its_value_back():
    """The child reads a table made here after this module was imported (copy-on-write, nothing
    pickled on the way in), runs in another process, and its changes stay its own."""
    _SEEN_BY_THE_CHILD["rows"] = list(range(1000))

    def work():
        rows = _SEEN_BY_THE_CHILD["rows"]
        _SEEN_BY_THE_CHILD["rows"] = None  # the child's copy only
        return os.getpid(), sum(rows), {"nested": [1.5, "x"]}

    pid, total, extra = executors.Forked(work).result()
    assert pid != os.getpid() and total == 999 * 1000 // 2 and extra == {"nested": [1.5, "x"]}
    assert _SEEN_BY_THE_CHILD["rows"] == list(range(1000))


@pytest.mark.parametrize(
    ("work", "why"),
    [
        (lambda: 1 / 0, "ZeroDivisionError: division by zero"),
        (lambda: lambda: None, "Can't pickle"),  # a value that cannot come back
        (lambda: os._exit(3), "ended without a result"),  # the child dies before writing
    ],
    ids=["raises", "unpicklable", "dies"],
)
def test_whatever_goes_wrong_in_the_child_is_child_failed_with_the_reason(work, why):
    with pytest.raises(executors.ChildFailed, match=why):
        executors.Forked(work).result()
