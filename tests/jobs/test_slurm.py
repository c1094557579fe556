"""Suites as SLURM jobs against a real cluster started on this machine (tests/slurm_cluster.py): munge,
slurmctld and two slurmd, without accounting ("plain", as on many small clusters) and with slurmdbd
("accounting", MariaDB-backed, two fake GPUs per node).  Every job outcome is read from what SLURM
says: a lab that fails, a job killed by SIGKILL, one cancelled while pending or at once, one out of
time, Ctrl-C, a preempted lab requeued, bad options refused before anything is submitted, GPU
binding, lab 06 across both nodes, and ``perflab trace FOLDER --executor slurm`` as a job array.

Skipped, with the reason, where the daemons cannot run (not root, packages missing: ``.ci/run``
installs them).  The labs are tiny notebooks (tests/job_notebooks.py) and lab 06 at its cheapest."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import job_notebooks as J
import pytest
import slurm_cluster as SC
import unit.run.test_trace_cli_figures as T

from lab_utils.core.records import load_records
from lab_utils.distributed.launch import local_world_sizes
from lab_utils.distributed.rendezvous import srun_line
from lab_utils.distributed.spec import DistConfig
from lab_utils.run import cli, parallel, runner
from lab_utils.run.cluster import cluster_options, resolve_site
from lab_utils.run.compare.baselines import timing_free
from lab_utils.run.executors import Task, run_tasks

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
KINDS = ["plain", "accounting"]
# a run that waits on a job that has left the queue runs into this (PERFLAB_SLURM_RUN_TIMEOUT: shorter,
# to watch an older tree hang without waiting long)
RUN_TIMEOUT_S = float(os.environ.get("PERFLAB_SLURM_RUN_TIMEOUT", 420))
_CLUSTERS: dict[str, SC.Cluster] = {}


@pytest.fixture(scope="session")
def clusters():
    """One cluster of each kind for the session, started on first use, stopped at the end."""
    why = SC.missing()
    if why:
        pytest.skip(why)

    def get(kind: str) -> SC.Cluster:
        if kind not in _CLUSTERS:
            if kind == "accounting" and SC.missing_accounting():
                pytest.skip(SC.missing_accounting())
            _CLUSTERS[kind] = SC.start(accounting=kind == "accounting")
        return _CLUSTERS[kind]

    yield get
    for c in _CLUSTERS.values():
        c.stop()
    _CLUSTERS.clear()


def _settle(c: SC.Cluster, timeout: float = 60) -> list[str]:
    """Until no job runs or waits; the jobs that were still there (then cancelled)."""
    deadline, left = time.monotonic() + timeout, c.jobs()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = c.jobs()
    if left:
        c.run("scancel", "--user=root", check=False)
        c.wait_idle()
    return left


def _site(kind, clusters, monkeypatch, tmp_path) -> SC.Cluster:
    c = clusters(kind)
    c.wait_idle()
    monkeypatch.setenv("SLURM_CONF", str(c.conf))
    monkeypatch.chdir(tmp_path)  # perflab.slurm.yaml is read from the working folder
    return c


@pytest.fixture(params=KINDS)
def site(request, clusters, monkeypatch, tmp_path):
    c = _site(request.param, clusters, monkeypatch, tmp_path)
    yield c
    assert not _settle(c), "the test left jobs on the cluster"


@pytest.fixture
def plain(clusters, monkeypatch, tmp_path):
    c = _site("plain", clusters, monkeypatch, tmp_path)
    yield c
    assert not _settle(c), "the test left jobs on the cluster"


@pytest.fixture
def accounting(clusters, monkeypatch, tmp_path):
    c = _site("accounting", clusters, monkeypatch, tmp_path)
    yield c
    assert not _settle(c), "the test left jobs on the cluster"


def _env(c: SC.Cluster, pdir: Path) -> dict:
    return {**os.environ, **c.env, "PERFLAB_PARAMETERIZED": str(pdir), "TQDM_DISABLE": "1"}


def perflab(args: list[str], c: SC.Cluster, pdir: Path, cwd: Path, timeout: float = RUN_TIMEOUT_S):
    """``perflab ARGS`` as a user runs it (a process of its own, on the cluster's SLURM_CONF)."""
    cmd = [sys.executable, "-m", "lab_utils.run.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=_env(c, pdir), capture_output=True, text=True, timeout=timeout)


def perflab_bg(args: list[str], c: SC.Cluster, pdir: Path, cwd: Path) -> subprocess.Popen:
    """``perflab ARGS`` started, not waited for."""
    cmd = [sys.executable, "-m", "lab_utils.run.cli", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=_env(c, pdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@contextlib.contextmanager
def _at_most(seconds: float, what: str):
    """Fail, instead of hanging, when the block (a run that waits on a job that has left) takes longer."""

    def late(_s, _f):
        raise TimeoutError(f"{what} still waiting after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, late)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# a job its own deadline cannot stop (a rank stuck in C with its signals blocked, as in an NCCL hang):
# SLURM ends it at the limit (SIGTERM, then SIGKILL after KillWait); builtins.exec, importable in the job
HUNG = (
    "import signal, time\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGUSR2})\n"
    "time.sleep(600)"
)


def _status(report: Path) -> dict:
    return {s["notebook"]: s for s in json.loads((report / "status.json").read_text())}


def _squeue_all(c: SC.Cluster, fmt: str = "%i|%j|%T|%P|%l") -> list[list[str]]:
    return [ln.split("|") for ln in c.run("squeue", "-h", "-r", "--states=all", "-o", fmt).stdout.splitlines()]


def _job_ids(c: SC.Cluster) -> set[str]:
    return {row[0] for row in _squeue_all(c)}


def _new_jobs(c: SC.Cluster, before: set[str], fmt: str = "%i|%j|%T|%r") -> dict[str, list[str]]:
    """The jobs submitted since ``before`` (slurmctld still lists earlier tests' jobs), by name."""
    return {row[1]: row for row in _squeue_all(c, fmt) if row[0] not in before}


def _nothing_left(out: Path) -> None:
    assert not list(out.glob(".tmp-*")), list(out.glob(".tmp-*"))
    assert not J.procs_naming(str(out)), J.procs_naming(str(out))


# ----------------------------------------------------------------------------- the cluster itself
def test_cluster_starts_two_idle_nodes_and_stops_leaving_nothing():
    if SC.missing():
        pytest.skip(SC.missing())
    c = SC.start()
    try:
        assert c.idle_nodes() == ["n1", "n2"]
        parts = c.run("sinfo", "-h", "-o", "%P %D %l").stdout.split()
        assert parts[:3] == ["debug*", "2", "10:00"], parts
    finally:
        c.stop()
    assert not c.root.exists() and not SC._pids_naming(str(c.root))
    # a session killed before it could stop its cluster (at its timeout) leaves nothing either
    code = (f"import sys, time; sys.path.insert(0, {str(Path(__file__).parents[1])!r}); import slurm_cluster as SC; "
            "c = SC.start(); print(c.root, flush=True); time.sleep(600)")  # fmt: skip
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        root = Path(owner.stdout.readline().strip() or "/nonexistent")
        assert root.is_dir() and len(SC._pids_naming(str(root))) >= 4, "the cluster did not start"
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 60
    while (root.exists() or SC._pids_naming(str(root))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not root.exists() and not SC._pids_naming(str(root)), SC._pids_naming(str(root))


# ----------------------------------------------------------------------------- outcomes
@pytest.mark.parametrize("kind", KINDS)
def test_every_job_outcome_ends_its_row_with_the_state_slurm_gives(kind, clusters, monkeypatch, tmp_path):
    """Five labs as jobs with a 1-minute limit (1 CPU each, from perflab.slurm.yaml): two that
    record, one whose notebook raises, one whose job is SIGKILLed under its notebook, one that
    sleeps past its limit.  Without accounting no row waits on a job that has left the queue
    (sacct does not exist there); the limit reads as "timed out" and left the lab its minute
    less the grace (it was alive 10 s in: SLURM's early USR2 does not kill it at start); the two that
    recorded equal a sequential local run's timing-free rows; every failed row links its job log,
    kept in the report; nothing is left (no .tmp folder, no process, no job).  Meanwhile a job
    its own deadline cannot stop (its signals blocked) is ended by SLURM at the limit: "timed
    out", in SLURM's words (TIMEOUT)."""
    c = _site(kind, clusters, monkeypatch, tmp_path)
    pdir = J.make_suites(tmp_path, {"outcomes": ["acc", "acc7", "bad", "die", "limit"], "two": ["acc", "acc7"]})
    acct = f"account: {SC.ACCOUNT}\n" if c.accounting else ""
    (tmp_path / "perflab.slurm.yaml").write_text(f"partition: {SC.PARTITION}\ncpus_per_task: 1\n{acct}")
    out = tmp_path / "reports"
    proc = perflab_bg(["run", "outcomes", "--executor", "slurm", "--time-limit", "1", "--out", str(out)], c, pdir,
                      tmp_path)  # fmt: skip
    try:
        account = SC.ACCOUNT if c.accounting else None
        opts = resolve_site(cluster_options("slurm", partition=SC.PARTITION, account=account, timeout_min=1))
        with _at_most(RUN_TIMEOUT_S, "the job SLURM ended at its limit"):
            hung = run_tasks([Task("hung", exec, (HUNG,), cpus=1)], opts, tmp_path / "hung", progress=False)["hung"]
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert hung.state == "timed out", (hung.state, hung.error)
    assert hung.error.startswith(f"SLURM ended job {hung.job_id} on n"), hung.error
    assert "at its time limit of 1 min (SLURM: TIMEOUT" in hung.error, hung.error
    assert proc.returncode == 1, stdout + stderr
    assert "Bypassing sacct" not in stderr and "3 notebook(s) failed" in stderr, stderr
    rep = (out / "latest").resolve()
    st, index = _status(rep), (rep / "index.html").read_text()
    for lab in ("acc", "acc7"):
        assert st[lab]["status"] == "ok", st[lab]
        assert st[lab]["ran_on"].startswith(("n1: 1 CPU (slurm job ", "n2: 1 CPU (slurm job ")), st[lab]["ran_on"]
    monkeypatch.setenv("PERFLAB_PARAMETERIZED", str(pdir))
    seq = runner.run_suite("two", out_dir=tmp_path / "seq", progress=False)
    assert J.key(timing_free(load_records(seq.path))) == J.key(timing_free(load_records(rep)))
    assert "deliberate failure" in st["bad"]["error"]
    die, lim = st["die"]["error"], st["limit"]["error"]
    assert die.startswith("job failed: job ") and "ended FAILED on n" in die, die
    assert "a task was killed by SIGKILL (the OOM killer's way, or kill -9)" in die, die
    assert lim.startswith("job timed out: its 1-minute time limit less 10 s kept to end it"), lim
    assert (rep / "artifacts" / "limit" / "alive.json").exists(), "the 1-minute limit ended the lab at its start"
    assert "job timed out: its 1-minute" in index and "job failed: job " in index
    for lab in ("bad", "die", "limit"):
        assert st[lab]["log"] == f"logs/{lab}.job.log" and (rep / st[lab]["log"]).is_file()
        assert f'href="logs/{lab}.job.log"' in index
        assert ".tmp-" not in st[lab]["error"] and "You can check full logs" not in st[lab]["error"]
    _nothing_left(out)
    assert not _settle(c)


@pytest.mark.parametrize("kind", KINDS)
def test_jobs_cancelled_pending_or_at_once_end_with_slurms_reason(kind, clusters, monkeypatch, tmp_path):
    """Both nodes held by another job: the first lab's job is scancelled the moment it appears,
    the second after it has pended for Resources; then the nodes are freed and the third is
    scancelled in its first second of running.  Each row says it was cancelled, before it started
    or while it ran, as SLURM says, and the run ends without waiting on any of them."""
    c = _site(kind, clusters, monkeypatch, tmp_path)
    pdir = J.make_suites(tmp_path, {"three": ["acc", "acc7", "slow"]})
    acct = ["--account", SC.ACCOUNT] if c.accounting else []
    before = _job_ids(c)
    hold = c.run("sbatch", "--parsable", "-N", "2", "-c", str(SC.NODE_CPUS), *acct, "-o", "/dev/null",
                 "--wrap", "sleep 300").stdout.strip()  # fmt: skip
    out = tmp_path / "reports"
    cmd = [sys.executable, "-m", "lab_utils.run.cli", "run", "three", "--executor", "slurm", "--out", str(out), *acct]
    cmd += ["--partition", SC.PARTITION]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=_env(c, pdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        cancelled: dict[str, str] = {}
        deadline = time.monotonic() + 180
        pend_seen = 0
        while len(cancelled) < 3 and time.monotonic() < deadline:
            jobs = _new_jobs(c, before)
            if "acc" in jobs and "acc" not in cancelled:
                c.run("scancel", jobs["acc"][0])  # at once: as soon as it is there
                cancelled["acc"] = jobs["acc"][0]
            if "acc7" in jobs and "acc7" not in cancelled and jobs["acc7"][3] == "Resources":
                pend_seen += 1
                if pend_seen >= 2:
                    c.run("scancel", jobs["acc7"][0])
                    cancelled["acc7"] = jobs["acc7"][0]
                    c.run("scancel", hold)  # frees the nodes: the third starts
            if "slow" in jobs and "slow" not in cancelled and jobs["slow"][2] == "RUNNING":
                c.run("scancel", jobs["slow"][0])
                cancelled["slow"] = jobs["slow"][0]
            time.sleep(0.2)
        try:
            stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run waited on {cancelled} after they left: {_new_jobs(c, before)}\n{c.tail('slurmctld')}")
    finally:
        if proc.poll() is None:
            proc.kill()
        c.run("scancel", hold, check=False)
    assert set(cancelled) == {"acc", "acc7", "slow"}, (cancelled, stderr)
    assert proc.returncode == 1, stdout + stderr
    st = _status((out / "latest").resolve())
    for lab in ("acc", "acc7"):
        err = st[lab]["error"]
        assert err.startswith(f"job cancelled: job {cancelled[lab]} was cancelled before it started"), err
        assert "SLURM: CANCELLED" in err, err
    err = st["slow"]["error"]
    assert err.startswith(f"job cancelled: job {cancelled['slow']} was cancelled while it ran on n"), err
    _nothing_left(out)


def test_a_job_that_can_never_start_is_cancelled_and_its_row_says_why(site, tmp_path):
    """Both nodes held: the lab's job (its time limit the partition's 10 minutes) pends for Resources
    until an administrator lowers the partition's MaxTime below it (scontrol update); SLURM then keeps
    it PENDING for PartitionTimeLimit, which no waiting resolves: perflab cancels it and the row says
    why."""
    pdir = J.make_suites(tmp_path, {"one": ["acc"]})
    acct = ["--account", SC.ACCOUNT] if site.accounting else []
    before = _job_ids(site)
    hold = site.run("sbatch", "--parsable", "-N", "2", "-c", str(SC.NODE_CPUS), *acct, "-o", "/dev/null",
                    "--wrap", "sleep 300").stdout.strip()  # fmt: skip
    out = tmp_path / "reports"
    args = ["run", "one", "--executor", "slurm", "--partition", SC.PARTITION, "--out", str(out), *acct]
    proc = perflab_bg(args, site, pdir, tmp_path)
    try:
        deadline, job = time.monotonic() + 120, None
        while time.monotonic() < deadline and job is None:
            row = _new_jobs(site, before).get("acc")
            job = row[0] if row and row[2] == "PENDING" else None
            time.sleep(0.3)
        assert job, _new_jobs(site, before)
        site.run("scontrol", "update", f"PartitionName={SC.PARTITION}", "MaxTime=1")
        try:
            stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run waited on a job that cannot start: {_new_jobs(site, before)}")
    finally:
        site.run("scontrol", "update", f"PartitionName={SC.PARTITION}", f"MaxTime={SC.MAX_TIME_MIN}", check=False)
        if proc.poll() is None:
            proc.kill()
        site.run("scancel", hold, check=False)
    assert proc.returncode == 1, stdout + stderr
    err = _status((out / "latest").resolve())["acc"]["error"]
    assert err.startswith(f"job failed: job {job} cannot start as submitted: SLURM keeps it PENDING (Partition"), err
    assert _new_jobs(site, before)["acc"][2] == "CANCELLED"
    _nothing_left(out)


def _sigint_as_in_a_terminal() -> None:
    """The child's SIGINT as a terminal leaves it: a test session started in the background (a
    script's ``&``) ignores SIGINT, and its children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_cancels_every_job_and_keeps_the_finished_lab(site, tmp_path):
    """SIGINT to the perflab process while one lab is running and one has finished: exit 130, the
    running job leaves the queue (scancel), its processes and kernel end, the finished lab is kept
    in <run-id>-interrupted and `latest` is not made."""
    pdir = J.make_suites(tmp_path, {"two": ["acc", "slow"]})
    (tmp_path / "perflab.slurm.yaml").write_text("cpus_per_task: 1\n")
    out, before = tmp_path / "reports", _job_ids(site)
    cmd = [sys.executable, "-m", "lab_utils.run.cli", "run", "two", "--executor", "slurm", "--out", str(out)]
    cmd += ["--partition", SC.PARTITION]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=_env(site, pdir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_as_in_a_terminal,
    )
    try:
        deadline, started = time.monotonic() + 180, None
        while time.monotonic() < deadline and proc.poll() is None:
            states = {name: row[2] for name, row in _new_jobs(site, before).items()}
            found = list(out.glob(".tmp-*/artifacts/slow/started.json"))
            if found and states.get("acc") == "COMPLETED" and states.get("slow") == "RUNNING":
                started = json.loads(found[0].read_text())
                time.sleep(3)  # perflab reads the finished job's result (it polls every 0.5 s)
                break
            time.sleep(0.3)
        assert started, ("the slow lab never started beside a finished one", states, proc.poll())
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stdout + stderr
    assert "interrupted" in stderr and "acc" in stderr, stderr
    kept = list(out.glob("*-interrupted"))
    assert len(kept) == 1 and _status(kept[0]).keys() == {"acc"} and not (out / "latest").exists()
    assert not J.wait_gone(list(started.values()))
    assert _new_jobs(site, before)["slow"][2] == "CANCELLED"
    _nothing_left(out)


def test_a_preempted_lab_is_requeued_and_its_second_run_is_the_row(site, tmp_path):
    """A job of the `urgent` partition (a higher priority tier, PreemptMode=REQUEUE) takes the
    lab's node: SLURM requeues the lab's job, which perflab keeps following (it does not end as
    cancelled); released, the job runs the notebook again, which records: the row is ok and says
    the job was requeued."""
    pdir = J.make_suites(tmp_path, {"one": ["preempt"]})
    out, before = tmp_path / "reports", _job_ids(site)
    cmd = [sys.executable, "-m", "lab_utils.run.cli", "run", "one", "--executor", "slurm", "--out", str(out)]
    cmd += ["--partition", SC.PARTITION]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=_env(site, pdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not list(out.glob(".tmp-*/artifacts/preempt/started.json")):
            time.sleep(0.3)
        job = _new_jobs(site, before)["preempt"]
        node = site.run("squeue", "-h", "-j", job[0], "-o", "%N").stdout.strip()
        urgent = ["-p", SC.URGENT, "-w", node, "-c", str(SC.NODE_CPUS), "-o", "/dev/null"]
        site.run("sbatch", *urgent, "--wrap", "sleep 1")
        while time.monotonic() < deadline:
            info = site.run("scontrol", "show", "job", "-o", job[0]).stdout
            if "JobState=PENDING" in info and "Restarts=1" in info:
                break
            time.sleep(0.3)
        assert "Restarts=1" in info, info
        site.run("scontrol", "update", f"JobId={job[0]}", "StartTime=now")  # not the 2-minute requeue delay
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout + stderr
    rep = (out / "latest").resolve()
    st = _status(rep)["preempt"]
    assert st["status"] == "ok" and "requeued 1x" in st["ran_on"], st
    assert sorted(p.name for p in (rep / "artifacts" / "preempt").glob("attempt-*")) == ["attempt-1", "attempt-2"]
    assert len(load_records(rep)) == 2
    _nothing_left(out)


# ----------------------------------------------------------------------------- refused before submission
def _refused(args: list[str], c: SC.Cluster, capsys, tmp_path) -> str:
    before = _job_ids(c)
    out = tmp_path / "never"
    assert cli.main([*args, "--out", str(out)] if args[0] == "run" else args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not out.exists() and _job_ids(c) == before, "something was written or submitted"
    return err


def test_bad_options_are_refused_against_the_site_before_anything_is_submitted(site, tmp_path, capsys, monkeypatch):
    """Partition, account, GPUs, time limit, nodes and a lab's device, checked against sinfo /
    scontrol / sacctmgr: one line naming the option, exit 2, no job, nothing on disk."""
    pdir = J.make_suites(tmp_path, {"two": ["acc", "acc7"]})
    monkeypatch.setenv("PERFLAB_PARAMETERIZED", str(pdir))
    run = ["run", "two", "--executor", "slurm"]
    no = "is not allowed: expected"
    cases = [
        ([*run, "--partition", "nosuch"], f"'--partition' = 'nosuch' {no} one of debug, urgent"),
        ([*run, "--time-limit", "11"], f"'--time-limit' = 11 {no} at most 10 minutes (debug's MaxTime)"),
        ([*run, "--nodes", "3"], f"'--nodes' = 3 {no} at most 2 (partition debug has 2 nodes)"),
        ([*run, "--nodes", "4"], f"'--nodes' = 4 {no} at most 2"),
        (["trace", str(tmp_path), "--executor", "slurm", "--partition", "nosuch"], "'--partition' = 'nosuch'"),
    ]
    if site.accounting:
        cases += [
            ([*run, "--account", "nosuch"], f"'--account' = 'nosuch' {no} one of root's accounts: proj1, root"),
            ([*run, "--gpus-per-node", "3"], f"'--gpus-per-node' = 3 {no} at most 2: debug's nodes have 2 per node"),
            (["trace", str(tmp_path), "--executor", "slurm", "--account", "nosuch"], "'--account' = 'nosuch'"),
        ]
    else:
        no_gpu = "the jobs on partition debug (GRES (null)) have no GPU"
        cases += [
            ([*run, "--gpus-per-node", "1"], f"'--gpus-per-node' = 1 {no} at most 0: debug's nodes have none"),
            ([*run, "--param", "device=cuda"], f"'device' = 'cuda' {no} 'auto' or 'cpu' ({no_gpu})"),
        ]
    for args, msg in cases:
        err = _refused(args, site, capsys, tmp_path)
        assert msg in err, (args, err)


def test_device_parameters_are_checked_against_the_partitions_gpus(accounting, tmp_path, monkeypatch):
    """From a login node without a GPU: the GPU suite's labs whose parameters depend on the device
    (device cuda; lab 06's `world_sizes: [1, auto]`) and a lab set to device cuda are accepted for a
    partition whose nodes have GPUs (auto = a node's 2, lab 06 one job of 2 GPUs), and refused here."""
    gpu = runner.load_suite(ROOT / "parameterized" / "gpu.yaml")
    labs = ["00_ceilings", "05_memory", "06_distributed"]
    with pytest.raises(runner.ConfigError, match="no CUDA device is visible here"):
        runner.plan(gpu, only=labs)
    prep = parallel.prepare(executor="slurm", cluster={"account": SC.ACCOUNT})
    assert prep.cluster.gpus_per_node == SC.FAKE_GPUS and prep.cluster.partition == SC.PARTITION
    with runner.validating_for(prep.target()):
        planned = runner.plan(gpu, only=labs)
    jp = parallel.plan_jobs(planned, runner.JOB_HOOKS, prep)
    tasks = parallel._tasks(planned, jp, tmp_path, tmp_path / "final", 600, {})
    assert {t.key: t.devices for t in tasks} == {"00_ceilings": 1, "05_memory": 1, "06_distributed": SC.FAKE_GPUS}
    pdir = J.make_suites(tmp_path, {"cuda": [("cuda", {"device": "cuda"})]})
    monkeypatch.setenv("PERFLAB_PARAMETERIZED", str(pdir))
    suite = runner.load_suite("cuda")
    with pytest.raises(runner.ConfigError, match="no CUDA device is visible here"):
        runner.plan(suite)
    with runner.validating_for(prep.target()):
        runner.plan(suite)
        assert local_world_sizes([1, "auto"]) == [1, SC.FAKE_GPUS]


# ----------------------------------------------------------------------------- what the jobs get
# what a job sees (a stdlib call: the job imports its function, and this test module is not importable there)
ENV_OF_JOB = ["sh", "-c", 'echo "${CUDA_VISIBLE_DEVICES-none}|$SLURM_JOB_GPUS|$SLURM_CPUS_PER_TASK"']


def _env_of(o) -> dict:
    cuda, gpus, cpus = o.value.decode().strip().split("|")
    cuda = None if cuda == "none" else cuda
    return {"CUDA_VISIBLE_DEVICES": cuda, "SLURM_JOB_GPUS": gpus, "SLURM_CPUS_PER_TASK": cpus}


def _sbatch_text(folder: Path) -> str:
    return "\n".join(p.read_text() for p in folder.rglob("*_submission.sh"))


def test_gpus_are_bound_per_job_and_cpus_follow_the_gpu_share(accounting, tmp_path):
    """Nodes with two (fake) GPUs each: jobs asking one GPU get one device each and half a node's
    CPUs; one asking two gets both and all its CPUs; a CPU job asks no GPU (no --gpus-per-node line)
    and the whole node's CPUs; no job carries a wckey."""
    opts = resolve_site(cluster_options("slurm", partition=SC.PARTITION, account=SC.ACCOUNT, timeout_min=1))
    call = subprocess.check_output
    tasks = [Task("g1a", call, (ENV_OF_JOB,), gpus=1), Task("g1b", call, (ENV_OF_JOB,), gpus=1),
             Task("g2", call, (ENV_OF_JOB,), gpus=2), Task("cpu", call, (ENV_OF_JOB,))]  # fmt: skip
    done = run_tasks(tasks, opts, tmp_path / "jobs", progress=False)
    assert all(o.ok for o in done.values()), {k: o.error for k, o in done.items()}
    got = {k: _env_of(o) for k, o in done.items()}
    for k in ("g1a", "g1b"):
        assert got[k]["CUDA_VISIBLE_DEVICES"] in ("0", "1") and got[k]["SLURM_CPUS_PER_TASK"] == "1", got[k]
    assert got["g2"]["CUDA_VISIBLE_DEVICES"] == "0,1" and got["g2"]["SLURM_CPUS_PER_TASK"] == "2", got["g2"]
    assert got["cpu"]["CUDA_VISIBLE_DEVICES"] is None and got["cpu"]["SLURM_CPUS_PER_TASK"] == "2", got["cpu"]
    assert done["g2"].resources == "2 GPUs, 2 CPUs" and done["cpu"].resources == "2 CPUs"
    cpu = _sbatch_text(tmp_path / "jobs" / "cpu")
    assert "--gpus-per-node" not in cpu and "--wckey" not in cpu and "#SBATCH --cpus-per-task=2" in cpu, cpu
    assert "#SBATCH --time=1\n" in cpu and "#SBATCH --signal=USR2@10\n" in cpu and "trap" in cpu, cpu
    assert "#SBATCH --gpus-per-node=2" in _sbatch_text(tmp_path / "jobs" / "g2")


def test_lab06_across_both_nodes_matches_one_process(plain, tmp_path):
    """`--nodes 2`: lab 06 itself and its first strategy across n1 and n2 (srun, one torchrun per
    node meeting through the c10d rendezvous at the first node's NodeAddr), checked against the
    single-process run."""
    small = dict(world_sizes=[1], strategies=["ddp"], steps=1, sweep_reps=1, fault_demo=False, backend="gloo")
    small.update(batch_size=2, txt_len=4, height=32, width=32)
    pdir = tmp_path / "parameterized"
    pdir.mkdir()
    nb = {"notebook": str(ROOT / "labs" / "06_distributed.ipynb"), "params": small}
    (pdir / "six.yaml").write_text(json.dumps({"description": "lab 06, tiny", "notebooks": [nb]}))
    out = tmp_path / "reports"
    args = ["run", "six", "--executor", "slurm", "--partition", SC.PARTITION, "--nodes", "2", "--out", str(out)]
    p = perflab(args, plain, pdir, tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    st = _status((out / "latest").resolve())
    multi = st["06_distributed@2nodes"]
    assert multi["status"] == "ok" and multi["ran_on"].startswith("n[1-2]: 2 nodes x "), multi
    agreement = json.loads((out / "latest" / "context.json").read_text())["notebooks"][1]["params"]["agreement"]
    assert agreement["ok"] and agreement["world_size"] == 2, agreement
    _nothing_left(out)


def test_the_documented_srun_line_gives_each_node_its_own_folder(plain, tmp_path):
    """docs/cluster.md's by-hand launch in an sbatch script: each node's torchrun writes into its
    own `node$SLURM_NODEID` (expanded on the node), node 0 hosts the rendezvous, both ranks report."""
    cfg = DistConfig(
        strategy="ddp", world_size=2, steps=1, profile=False, backend="gloo", timeout_s=900.0, hang_timeout_s=300.0
    )
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps([json.loads(cfg.to_json())]))
    port = SC.free_ports(1)[0]
    line = srun_line(str(spec), str(tmp_path / "runs"), nodes=2, gpus_per_node=1, port=port, python=sys.executable)
    script = tmp_path / "by_hand.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH -o {tmp_path}/by_hand.out\ncd {ROOT}\n{line}\n")
    job = plain.run("sbatch", "--parsable", str(script)).stdout.strip()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and job in {r[0] for r in _squeue_all(plain, "%i|%T") if r[1] != "COMPLETED"}:
        time.sleep(1)
    log = (tmp_path / "by_hand.out").read_text() if (tmp_path / "by_hand.out").exists() else ""
    ranks = {n: sorted(p.name for p in (tmp_path / "runs" / f"node{n}").glob("result-rank*.json")) for n in (0, 1)}
    assert sorted(ranks[0] + ranks[1]) == ["result-rank0.json", "result-rank1.json"], (ranks, log)
    assert len(ranks[0]) == len(ranks[1]) == 1, ranks  # one rank per node, each in its own folder
    for n in (0, 1):  # torchrun's own logs there too, not in a torchelastic_* folder left in the node's /tmp
        assert list((tmp_path / "runs" / f"node{n}" / "torchelastic").iterdir()), n
    assert {r[0]: r[1] for r in _squeue_all(plain, "%i|%T")}[job] == "COMPLETED", log


# ----------------------------------------------------------------------------- perflab trace
def test_trace_folder_on_slurm_is_one_job_array_with_the_sites_options(site, tmp_path):
    """`perflab trace FOLDER --executor slurm --json`: the ranks are one job array in the partition
    and time limit perflab.slurm.yaml and --time-limit give (with accounting, in the --account given);
    stdout is the JSON alone (submitit's warnings are not on it); its job files were under the
    output's folder (no /tmp), and are gone; the figures equal a process pool's."""
    folder = tmp_path / "job"
    folder.mkdir()
    T.job(folder / "worker0.pt.trace.json", rank=0, world=2)
    T.job(folder / "worker1.pt.trace.json", rank=1, world=2, gemm_us=300.0)
    (tmp_path / "perflab.slurm.yaml").write_text(f"partition: {SC.URGENT}\n")
    before = _job_ids(site)
    args = ["trace", str(folder), "--json", "--time-limit", "5", "--out", str(tmp_path / "o")]
    acct = ["--account", SC.ACCOUNT] if site.accounting else []
    p = perflab([*args, "--executor", "slurm", *acct], site, tmp_path, tmp_path)
    assert p.returncode == 0, p.stderr
    fig = json.loads(p.stdout)
    rows = [r for r in _squeue_all(site) if r[0] not in before]
    assert sorted(r[0].split("_")[1] for r in rows) == ["0", "1"] and len({r[0].split("_")[0] for r in rows}) == 1
    assert {(r[3], r[4]) for r in rows} == {(SC.URGENT, "5:00")}, rows
    if site.accounting:  # --account reached sbatch
        accounts = {r[0]: r[1] for r in _squeue_all(site, "%i|%a")}
        assert {accounts[r[0]] for r in rows} == {SC.ACCOUNT}, accounts
    for r in rows:  # each task's log was beside --out (a path the nodes share), not in a /tmp of its own
        shown = site.run("scontrol", "show", "job", "-o", r[0]).stdout.split()
        info = dict(kv.split("=", 1) for kv in shown if "=" in kv)
        assert info["StdOut"].startswith(f"{tmp_path}/.jobs-trace-"), info["StdOut"]
    assert not list(tmp_path.glob(".jobs-*")) and not list(tmp_path.glob("o/.jobs-*"))
    pool = perflab(["trace", str(folder), "--json", "--out", str(tmp_path / "p")], site, tmp_path, tmp_path)
    assert json.loads(pool.stdout)["temporal"] == fig["temporal"]
