"""Suites as jobs on this machine: side by side (--parallel), through submitit's local executor (the path
a SLURM run takes; the real cluster is tests/jobs/test_slurm.py), Ctrl-C (also in the middle of a
submission), bad options, time limits, and lab 06 across two torchrun launches on localhost."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from job_notebooks import alive as _alive
from job_notebooks import key as _key
from job_notebooks import make_suites
from job_notebooks import procs_naming as _procs_naming

from lab_utils.core.config import ConfigError
from lab_utils.core.records import load_records
from lab_utils.distributed.launch import DistRunError
from lab_utils.distributed.rendezvous import gather, srun_line, torchrun_command
from lab_utils.distributed.spec import DistConfig
from lab_utils.distributed.verify import TOLERANCES
from lab_utils.run import cli, executors, parallel, runner
from lab_utils.run.cluster import ClusterOptions, cluster_options
from lab_utils.run.compare.baselines import timing_free
from lab_utils.run.executors import MapOptions, Task, map_jobs, run_tasks
from lab_utils.run.runner import RunInterrupted, run_suite

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def suites(tmp_path, monkeypatch):
    pdir = make_suites(
        tmp_path,
        {"two": ["acc", "acc7"], "mixed": ["acc", "acc7", "bad", "die"], "slow": ["slow"], "slow2": ["slow", "slow2"]},
    )
    monkeypatch.setenv("PERFLAB_PARAMETERIZED", str(pdir))
    return tmp_path


def test_labs_side_by_side_record_what_a_sequential_run_records_and_failed_jobs_show(suites, capsys):
    """`perflab run --parallel 2` (submitit's local executor, the path a SLURM run takes): the labs
    that ran record the same timing-free rows as one after the other, each with its thread share in
    its context and what ran it in the index; a notebook that raises is a failed notebook, a job that
    dies (its process killed, OOM-killer style) a failed row with its log and half-run notebook; no
    process of the run is left."""
    seq = run_suite("two", out_dir=suites / "seq", progress=False)
    assert seq.ok, seq.statuses
    out = suites / "par"
    assert cli.main(["run", "mixed", "--parallel", "2", "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "2 notebook(s) failed" in err
    par = (out / "latest").resolve()
    # the run's own context records the labs' share (as each lab's does): a split asked for with
    # --parallel is not reported as threads a busy machine cut
    run_threads = json.loads((par / "context.json").read_text())["timing"]["cpu_threads"]
    assert run_threads["policy"] == "PERFLAB_TIMING_THREADS" and "shared by up to 2 labs" in run_threads["reason"]
    assert "THREADS CUT" not in err and 'id="threads-cut"' not in (par / "index.html").read_text()
    a, b = load_records(seq.path), load_records(par)
    assert len(a) == len(b) == 4 and (a["metric"] == "time").sum() == 2
    ta, tb = timing_free(a), timing_free(b)
    assert len(ta) == 2 and "time" not in set(ta["metric"]), ta  # the timing rows are what is left out
    assert _key(ta) == _key(tb)
    assert all(0 < v < 1e-5 for v in tb["value"]), tb  # float32 matmul against float64
    status = {s["notebook"]: s for s in json.loads((par / "status.json").read_text())}
    index = (par / "index.html").read_text()
    assert list(status) == ["acc", "acc7", "bad", "die"] and "2 of 4 FAILED" in index
    for lab in ("acc", "acc7"):
        assert status[lab]["status"] == "ok" and status[lab]["ran_on"].startswith("cpu, ")
        assert "local job" in status[lab]["ran_on"] and status[lab]["ran_on"] in index
        ctx = json.loads((par / "records" / lab / "records.json").read_text())["context"]
        threads = ctx["timing"]["cpu_threads"]
        assert threads["policy"] == "PERFLAB_TIMING_THREADS" and "shared by up to 2 labs" in threads["reason"]
    assert status["bad"]["status"] == "failed" and "deliberate failure" in status["bad"]["error"]
    die = status["die"]
    assert die["status"] == "failed" and die["error"].startswith("job failed: "), die["error"]
    assert "the job's process ended without a result" in die["error"] and "job failed" in index
    assert die["log"] == "logs/die.job.log" and 'href="logs/die.job.log"' in index
    assert (par / "logs" / "die.job.log").is_file() and die["html"] == "html/die.html"
    pids = json.loads((par / "artifacts" / "die" / "started.json").read_text())
    deadline = time.monotonic() + 20  # the dead job's kernel notices its parent is gone
    while _alive(pids["kernel"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(pids["kernel"]) and not _alive(pids["job"])
    assert not _procs_naming(str(out)) and not list(out.glob(".tmp-*")) and not (par / "jobs").exists()


def test_ctrl_c_cancels_the_jobs_and_leaves_nothing_behind(suites, monkeypatch):
    """Ctrl-C while the jobs run: they are cancelled, their kernels and processes end, no folder
    is left (nothing had finished), and the CLI says so in one line with exit code 130."""
    out = suites / "r"
    seen = {}

    def interrupt_when_running(seconds):
        for f in out.glob(".tmp-*/artifacts/*/started.json"):
            seen[f.parent.name] = json.loads(f.read_text())
        if seen:
            raise KeyboardInterrupt
        time.sleep(seconds)

    monkeypatch.setattr(executors, "_wait", interrupt_when_running)
    with pytest.raises(RunInterrupted, match="nothing was kept"):
        run_suite("slow", out_dir=out, progress=False, jobs={"executor": "local"})
    assert seen, "the job never started its notebook"
    deadline = time.monotonic() + 10
    pids = [p for v in seen.values() for p in v.values()]
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(_alive, pids)), pids
    assert not _procs_naming(str(out)), _procs_naming(str(out))
    assert not [p for p in out.iterdir() if p.name != "latest"]


def test_bad_job_options_are_refused_before_anything_is_submitted(suites, tmp_path, capsys, monkeypatch):
    never = suites / "never"
    cases = [
        ({"executor": "pbs"}, "'--executor' = 'pbs'"),
        ({"parallel": 0}, "'--parallel' = 0"),
        ({"executor": "slurm", "parallel": 2, "cluster": {"partition": "gpu"}}, "'--parallel' = 2"),
        ({"cluster": {"partition": "gpu"}}, "'--partition' = 'gpu'"),
        ({"cluster": {"nodes": 2}}, "no 06_distributed lab"),
        ({"cluster": {"timeout_min": 0}}, "'--time-limit' = 0"),
        ({"devices": "0,0"}, "'--devices' = '0,0'"),
    ]
    if parallel.visible_gpus() == 0:
        cases.append(({"devices": "0"}, "no visible GPU"))
    for jobs, msg in cases:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
            run_suite("two", out_dir=never, jobs=jobs)
    cfg = tmp_path / "perflab.slurm.yaml"
    cfg.write_text("partition: gpu\nqueue: fast\n")
    with pytest.raises(ConfigError, match="'perflab.slurm.yaml: queue' = 'fast'.*partition"):
        run_suite("two", out_dir=never, jobs={"executor": "slurm", "cluster": {"config": str(cfg)}})
    assert not never.exists()
    # no SLURM here (no sbatch, or no controller it can reach): refused, naming the executor
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-such-slurm.conf"))
    assert cli.main(["run", "two", "--out", str(never), "--executor", "slurm"]) == 2
    err = capsys.readouterr().err
    assert "'--executor' = 'slurm' is not allowed" in err and len(err.strip().splitlines()) == 1 and not never.exists()


def test_a_ctrl_c_during_a_submission_reaches_the_job_being_started(suites, monkeypatch):
    """Ctrl-C while the second lab's job is being started (its process exists, the submission has
    not returned) and the first runs its notebook: both jobs, both notebooks' kernels and every
    process of the run end, and nothing is kept."""
    import submitit.local.local as L

    out, real, started, first = suites / "r", L.start_controller, [], {}

    def start_then_ctrl_c(*a, **k):
        if started:  # the second job: once the first runs its notebook
            deadline = time.monotonic() + 120
            while not list(out.glob(".tmp-*/artifacts/slow/started.json")) and time.monotonic() < deadline:
                time.sleep(0.2)
            first.update(json.loads(next(out.glob(".tmp-*/artifacts/slow/started.json")).read_text()))
        proc = real(*a, **k)
        started.append(proc.pid)
        if len(started) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, before the submission returns
            time.sleep(1.0)
        return proc

    monkeypatch.setattr(L, "start_controller", start_then_ctrl_c)
    # SIGINT as a terminal leaves it (a session started in the background, a script's `&`, ignores it)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(RunInterrupted, match="nothing was kept"):
            run_suite("slow2", out_dir=out, progress=False, jobs={"executor": "local", "parallel": 2})
    finally:
        signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)
    assert len(started) == 2 and first, "the first job never ran its notebook"
    pids = [*started, *first.values()]  # both jobs' controllers, the first's job process and kernel
    deadline = time.monotonic() + 30
    while (_procs_naming(str(out)) or any(map(_alive, pids))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _procs_naming(str(out)), _procs_naming(str(out))
    assert not [p for p in pids if _alive(p)], [p for p in pids if _alive(p)]
    assert not [p for p in out.iterdir() if p.name != "latest"]


def test_devices_are_pinned_and_a_big_lab_waits_for_its_devices(tmp_path):
    """Each job sees only its devices (CUDA_VISIBLE_DEVICES); the 2-device job starts only when the
    1-device job ahead of it has freed its device."""
    sh = ["sh", "-c", 'date +%s.%N; echo "$CUDA_VISIBLE_DEVICES"; sleep 1; date +%s.%N']
    tasks = [
        Task("a", subprocess.check_output, (sh,), devices=1),
        Task("big", subprocess.check_output, (sh,), devices=2),
        Task("b", subprocess.check_output, (sh,), devices=1),
    ]
    done = run_tasks(tasks, cluster_options("local"), tmp_path, max_running=2, devices=[0, 1], progress=False)
    got = {k: o.value.decode().split() for k, o in done.items()}
    assert {k: got[k][1] for k in got} == {"a": "0", "big": "0,1", "b": "0"}
    assert {k: o.devices for k, o in done.items()} == {"a": (0,), "big": (0, 1), "b": (0,)}
    assert float(got["big"][0]) >= float(got["a"][2]) and float(got["b"][0]) >= float(got["big"][2])


def test_a_job_out_of_time_is_timed_out_and_ends_what_it_started(tmp_path):
    """A job stops itself at its limit less the grace (30 s less 10 s here; the CLI allows >= 1 min):
    "timed out", naming the limit, and the sleeping child it started is gone too."""
    opts = ClusterOptions(executor="local", timeout_min=0.5)
    sh = ["sh", "-c", "echo $$ > " + str(tmp_path / "child.pid") + "; exec sleep 600"]
    task = Task("slow", executors._bounded_call, (subprocess.check_output, sh, None))
    o = run_tasks([task], opts, tmp_path / "jobs", progress=False)["slow"]
    assert o.state == "timed out", (o.state, o.error)
    assert "JobEnded: timed out: its 0.5-minute time limit less 10 s kept to end it" in o.error, o.error
    child = int((tmp_path / "child.pid").read_text())
    assert not _alive(child)


def _grab(n: int) -> int:
    return len(bytearray(n << 20))


def test_map_jobs_keeps_order_reports_failures_and_bounds_memory(tmp_path):
    """The map perflab trace's rank jobs go through: outcomes in item order; an item over the worker's
    memory bound fails alone (MemoryError), the others are results."""
    outs = map_jobs(_grab, [1, 3000, 2], MapOptions("pool", workers=2, mem_gb=2.0), tmp_path, progress=False)
    assert [o.state for o in outs] == ["ok", "failed", "ok"] and [outs[0].value, outs[2].value] == [2**20, 2 << 20]
    assert "mem_gb=2.0" in outs[1].error
    outs = map_jobs(abs, [-3, 4], MapOptions("local", workers=2, mem_gb=2.0), tmp_path / "jobs", progress=False)
    assert [o.value for o in outs] == [3, 4] and not (tmp_path / "jobs").exists()
    with pytest.raises(ConfigError, match="'executor' = 'ray'"):
        map_jobs(abs, [1], MapOptions("ray"), tmp_path)


TINY = dict(strategy="ddp", world_size=2, steps=2, profile=False, backend="gloo", timeout_s=900.0, hang_timeout_s=300.0)


def test_lab06_across_two_nodes_two_torchrun_launches_rendezvous_on_localhost(tmp_path):
    """--nodes 2 with the local executor: one job, two tasks, each a torchrun launch (one rank) that
    meets the other through the c10d rendezvous on 127.0.0.1; task 0 gathers the nodes' results,
    checks them against the single-process run as lab 06 does and records the agreement."""
    cfg = DistConfig(**TINY)
    opts = cluster_options("local", timeout_min=10)
    task = parallel.multinode_task(cfg, 2, 1, tmp_path, opts)
    assert (task.key, task.nodes) == ("06_distributed@2nodes", 2)
    o = run_tasks([task], opts, tmp_path / "jobs", progress=False)[task.key]
    assert o.ok, o.error + o.log
    a = o.value["agreement"]
    assert a["ok"] and a["world_size"] == 2 and a["loss_rel"] <= TOLERANCES["float32"][0], a
    out = tmp_path / "artifacts" / task.key
    for node in ("node0", "node1"):
        assert "--rdzv-backend=c10d" not in (out / node / "torchrun.log").read_text()  # a log, not an echo
        assert json.loads((out / node / "exit.json").read_text())["code"] == 0
    ranks = [json.loads((out / "gathered" / f"result-rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["losses"] == ranks[1]["losses"]
    rows = json.loads((tmp_path / "records" / task.key / "records.json").read_text())["rows"]
    got = {r["metric"]: r["value"] for r in rows}
    assert got["ranks"] == 2 and got["loss_rel_err"] == a["loss_rel"], got
    with pytest.raises(DistRunError, match=r"ranks \[2, 3\] of 4 wrote no result"):
        gather(DistConfig(**{**TINY, "world_size": 4}), [out / "node0", out / "node1"], tmp_path / "g")


def test_nodes_option_plans_lab06s_first_strategy_across_the_nodes(tmp_path):
    planned = runner.plan(runner.load_suite(ROOT / "parameterized" / "smoke.yaml"), only=["06_distributed"])
    jp = parallel.plan_jobs(planned, runner.JOB_HOOKS, executor="local", cluster={"nodes": 2})
    tasks = parallel._tasks(planned, jp, tmp_path, tmp_path / "final", 600, {})
    assert [(t.key, t.nodes) for t in tasks] == [("06_distributed", 1), ("06_distributed@2nodes", 2)]
    spec = json.loads((tmp_path / "artifacts" / "06_distributed@2nodes" / "spec.json").read_text())[0]
    assert spec["world_size"] == 2 and spec["strategy"] == planned[0].resolved["strategies"][0]


def test_launch_lines_name_the_rendezvous():
    cmd = torchrun_command(
        Path("s.json"), Path("o"), nnodes=2, nproc_per_node=8, endpoint="h:29500", rdzv_id="j1", is_host=False
    )
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    for part in ("--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29500", "--rdzv-id=j1"):
        assert part in cmd
    lines = srun_line("spec.json", "runs", nodes=4, gpus_per_node=8).splitlines()
    assert lines[2].startswith("srun --nodes=4 --ntasks-per-node=1 bash -c ") and "--rdzv-backend=c10d" in lines[2]
    # the node's own id is left for the shell srun starts on each node (the batch shell would
    # expand it once, and every node would write into the same folder)
    assert "--out runs/node\\$SLURM_NODEID" in lines[2] and "is_host=\\$((SLURM_NODEID == 0))" in lines[2]
    assert "NodeAddr" in lines[1] and "--rdzv-endpoint=$ADDR:29500" in lines[2]
    log_dir = next(p for p in cmd if p.startswith("--log-dir="))  # torchrun's logs stay in the node's folder
    assert log_dir == f"--log-dir={Path('o') / 'torchelastic'}"
    # docs/cluster.md shows this very launch (tests/jobs/test_slurm.py runs it on the test cluster)
    assert srun_line("spec.json", "runs", nodes=2, gpus_per_node=8) in (ROOT / "docs" / "cluster.md").read_text()


def test_the_ran_on_column_reads_as_docs_cluster_md_shows_it():
    """Each example of the index's time column in docs/cluster.md is what a job of that kind gives."""
    doc = (ROOT / "docs" / "cluster.md").read_text()
    local = parallel.JobPlan(ClusterOptions("local"), runner.JOB_HOOKS)
    cpu = parallel.JobPlan(ClusterOptions("local"), runner.JOB_HOOKS, threads_per_lab=1, thread_budget=2)
    slurm = parallel.JobPlan(ClusterOptions("slurm"), runner.JOB_HOOKS)
    rows = [
        (executors.Outcome("a", "ok", job_id="4711", devices=(2,)), local, "cuda:2 (local job 4711)"),
        (executors.Outcome("a", "ok", job_id="4712"), cpu, "cpu, 1 of 2 timing threads (local job 4712)"),
        (executors.Outcome("a", "ok", job_id="123456", nodes="gpu-07", resources=executors._resources(1, 16, 1)),
         slurm, "gpu-07: 1 GPU, 16 CPUs (slurm job 123456)"),
        (executors.Outcome("a", "ok", job_id="123457", nodes="n[1-2]", resources=executors._resources(8, 64, 2)),
         slurm, "n[1-2]: 2 nodes x 8 GPUs, 64 CPUs (slurm job 123457)"),
        (executors.Outcome("a", "ok", job_id="9", nodes="n1", resources="1 CPU", restarts=1), slurm,
         "n1: 1 CPU (slurm job 9, requeued 1x)"),
    ]  # fmt: skip
    for outcome, plan, text in rows:
        assert parallel._ran_on(outcome, plan) == text
        assert f"`{text}`" in doc or text.startswith("n1: 1 CPU"), text
