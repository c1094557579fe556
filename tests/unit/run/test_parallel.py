"""Unit pins of lab_utils/run/parallel.py: the job options read from the CLI, the CPU thread
environment and lab 06's multinode spec, without running a job."""

import json
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

from lab_utils.core.config import ConfigError
from lab_utils.run import parallel
from lab_utils.run.parallel import job_options, multinode_spec, parse_devices, thread_env
from lab_utils.run.runner import NotebookStatus

NONE = dict(
    executor=None,
    parallel=None,
    devices=None,
    partition=None,
    account=None,
    time_limit=None,
    gpus_per_node=None,
    nodes=None,
    cluster_config=None,
)


def test_job_options_none_when_no_job_option_given():
    assert job_options(Namespace(**NONE)) is None


@pytest.mark.parametrize("name,value", [(k, 2) for k in NONE])
def test_job_options_any_single_option_gives_the_jobs_argument(name, value):
    got = job_options(Namespace(**{**NONE, name: value}))
    assert got is not None
    flat = {**{k: v for k, v in got.items() if k != "cluster"}, **got["cluster"]}
    assert value in flat.values()
    assert sorted(got) == ["cluster", "devices", "executor", "parallel"]


def test_thread_env_is_empty_without_a_per_lab_share():
    plan = SimpleNamespace(threads_per_lab=None, thread_budget=None, parallel=1)
    assert thread_env(plan, [object()]) == {}


class _Lab:
    strategies = ("ddp", "fsdp")
    seen: list = []

    @classmethod
    def from_params(cls, params):
        lab = cls()
        lab.params = params
        return lab

    def dist_config(self, strategy, world):
        _Lab.seen.append((strategy, world, self.params["world_sizes"]))
        return SimpleNamespace(mesh=(world,), world=world)


@pytest.mark.parametrize("nodes,per_node", [(1, 1), (2, 4), (3, 8)])
def test_multinode_spec_spans_nodes_times_ranks_per_node(nodes, per_node):
    _Lab.seen.clear()
    p = SimpleNamespace(entry=SimpleNamespace(notebook=Path("labs/06_x.ipynb")), resolved={"world_sizes": [8]})
    cfg = multinode_spec(p, nodes, per_node, lambda nb: _Lab)
    assert cfg is not None and cfg.world == nodes * per_node
    assert _Lab.seen == [("ddp", nodes * per_node, [1])]


@pytest.mark.parametrize(
    "text,want",
    [(None, None), ("0", (0,)), ("0,1,3", (0, 1, 3)), ("3,1", (3, 1)), (" 2 , 0 ", (2, 0)), ("0,", (0,))],
)
def test_parse_devices_reads_distinct_indices(text, want):
    assert parse_devices(text) == want


@pytest.mark.parametrize("text", ["", ",", "a", "1,1", "-1", "2,-1", "0,0,1"])
def test_parse_devices_rejects_naming_the_option(text):
    with pytest.raises(ConfigError, match="--devices"):
        parse_devices(text)


@pytest.mark.parametrize("devices,ok", [("0,1", True), ("1", True), ("2", False), ("0,2", False), ("1,0,3", False)])
def test_prepare_accepts_only_indices_below_the_visible_gpu_count(monkeypatch, devices, ok):
    monkeypatch.setattr(parallel, "visible_gpus", lambda: 2)
    if ok:
        assert parallel.prepare(devices=devices).devices == parse_devices(devices)
    else:
        with pytest.raises(ConfigError, match="indices below 2"):
            parallel.prepare(devices=devices)


def test_prepare_without_devices_takes_every_visible_gpu(monkeypatch):
    monkeypatch.setattr(parallel, "visible_gpus", lambda: 3)
    assert tuple(parallel.prepare().devices) == (0, 1, 2)


def _planned(stem, **resolved):
    return SimpleNamespace(entry=SimpleNamespace(stem=stem, notebook=Path(f"labs/{stem}.ipynb")), resolved=resolved)


@pytest.mark.parametrize("parallel_n,labs", [(1, 3), (2, 3), (4, 2), (3, 3)])
def test_plan_jobs_splits_the_thread_budget_over_the_labs_running_at_once(monkeypatch, parallel_n, labs):
    monkeypatch.setattr(parallel, "visible_gpus", lambda: 0)
    planned = [_planned(f"0{i}_x") for i in range(labs)]
    plan = parallel.plan_jobs(planned, None, parallel.prepare(parallel=parallel_n), timing_threads=12)
    at_once = min(parallel_n, labs)
    assert plan.thread_budget == 12
    assert plan.threads_per_lab == 12 // at_once


# ------------------------------------------------------------------ devices a lab needs, checked
def _lab(stem, **resolved):
    return SimpleNamespace(entry=SimpleNamespace(stem=stem, notebook=Path(f"labs/{stem}.ipynb")), resolved=resolved)


@pytest.mark.parametrize(
    "stem, resolved, ndev, need",
    [
        ("01_x", {}, 0, 0),  # on CPU no lab takes a device
        ("01_x", {}, 4, 1),
        ("01_x", {"device": "cpu"}, 4, 0),
        ("01_x", {"device": "cuda"}, 1, 1),
        ("06_distributed", {"world_sizes": [2, 4]}, 8, 4),  # its largest world size
        ("06_distributed", {"world_sizes": [1, "auto"]}, 8, 8),  # "auto": every device
        ("06_distributed", {"world_sizes": [1, "auto"]}, 0, 0),
        ("06_distributed", {}, 8, 1),
        ("06_distributed", {"world_sizes": [4], "backend": "gloo"}, 8, 0),  # gloo ranks run on the CPU
        ("06_distributed", {"world_sizes": [4], "device": "cpu"}, 8, 0),
    ],
)
def test_lab_devices(stem, resolved, ndev, need):
    assert parallel.lab_devices(_lab(stem, **resolved), ndev) == need


def _prep(executor="local", devices=(), parallel_n=1, **cluster):
    return parallel.JobOptions(parallel.ClusterOptions(executor=executor, **cluster), parallel_n, devices)


@pytest.mark.parametrize("ndev, ok", [(3, False), (4, True), (5, True)])
def test_local_jobs_need_as_many_devices_as_the_largest_lab_asks(ndev, ok):
    planned = [_lab("01_x"), _lab("06_distributed", world_sizes=[2, 4])]
    prep = _prep(devices=tuple(range(ndev)))
    if ok:
        plan = parallel.plan_jobs(planned, None, prep)
        assert plan.devices == tuple(range(ndev)) and plan.threads_per_lab is None and plan.thread_budget is None
    else:
        with pytest.raises(ConfigError, match=r"at least 4 devices \(06_distributed asks for 4\)") as e:
            parallel.plan_jobs(planned, None, prep)
        assert e.value.param == "--devices" and e.value.value == "0,1,2"


@pytest.mark.parametrize("gpus, ok", [(2, False), (4, True), (8, True)])
def test_slurm_jobs_hold_at_most_a_nodes_gpus_as_ranks(gpus, ok):
    planned = [_lab("06_distributed", world_sizes=[1, 4])]
    prep = _prep("slurm", None, gpus_per_node=gpus)
    if ok:
        assert parallel.plan_jobs(planned, None, prep).cluster.gpus == gpus
    else:
        with pytest.raises(ConfigError, match=rf"at most {gpus} ranks in one job: a node has {gpus} GPUs") as e:
            parallel.plan_jobs(planned, None, prep)
        assert e.value.param == "world_sizes" and "(in 06_distributed)" in str(e.value)


def test_nodes_need_the_distributed_lab():
    with pytest.raises(ConfigError, match="the suite has no 06_distributed lab") as e:
        parallel.plan_jobs([_lab("01_x")], None, _prep("slurm", None, gpus_per_node=2, nodes=2))
    assert e.value.param == "--nodes"
    plan = parallel.plan_jobs([_lab("06_distributed")], None, _prep("slurm", None, gpus_per_node=2, nodes=2))
    assert plan.cluster.nodes == 2


@pytest.mark.parametrize("budget, parallel_n, labs, per_lab", [(3, 4, 5, 1), (1, 2, 2, 1), (7, 2, 5, 3), (8, 8, 1, 8)])
def test_each_cpu_lab_gets_its_share_of_the_threads_and_at_least_one(budget, parallel_n, labs, per_lab):
    plan = parallel.plan_jobs([_lab(f"0{i}_x") for i in range(labs)], None, _prep(parallel_n=parallel_n),
                              timing_threads=budget)  # fmt: skip
    assert (plan.thread_budget, plan.threads_per_lab, plan.parallel) == (budget, per_lab, parallel_n)
    env = thread_env(plan, [None] * labs)
    at_once = min(parallel_n, labs)
    assert env == {
        parallel.THREADS_ENV: str(per_lab),
        parallel.SHARE_ENV: f"{budget} timing threads shared by up to {at_once} labs running at once: {per_lab} each",
    }


def test_prepare_refuses_before_anything_runs(monkeypatch):
    monkeypatch.setattr(parallel, "visible_gpus", lambda: 0)
    with pytest.raises(ConfigError, match="--executor"):
        parallel.prepare(executor="ray")
    for kw in ({"parallel": 2}, {"devices": "0"}):
        with pytest.raises(ConfigError, match="no value with --executor slurm") as e:
            parallel.prepare(executor="slurm", **kw)
        assert e.value.param == f"--{next(iter(kw))}"
    with pytest.raises(ConfigError, match="--parallel"):
        parallel.prepare(parallel=0)
    with pytest.raises(ConfigError, match="no visible GPU"):
        parallel.prepare(devices="0")
    got = parallel.prepare(parallel=3)
    assert got.parallel == 3 and got.devices == () and got.cluster.executor == "local"
    assert parallel.prepare().parallel == 1 and got.target() is None


def test_the_target_of_slurm_jobs_is_the_partitions_nodes():
    part = SimpleNamespace(name="gpu", node_gpus=8, gres="gpu:h100:8")
    site = SimpleNamespace(partitions={"gpu": part})
    c = parallel.ClusterOptions(executor="slurm", partition="gpu", gpus_per_node=8, site=site)
    assert parallel.JobOptions(c).target() == parallel.DeviceTarget(8, "the jobs on partition gpu (GRES gpu:h100:8)")
    c2 = parallel.ClusterOptions(executor="slurm", partition="gpu", gpus_per_node=2, site=site)
    t = parallel.JobOptions(c2).target()
    assert t.gpus == 2 and t.where == "the jobs on partition gpu (GRES gpu:h100:8, --gpus-per-node 2)"
    assert parallel.JobOptions(parallel.ClusterOptions(executor="slurm", gpus_per_node=2)).target() is None


# ------------------------------------------------------------------ what a job's row says
def _o(**kw):
    return parallel.Outcome(**{"key": "k", "state": "ok", **kw})


def _plan(executor="local", threads=None, budget=None, devices=(), gpus=None, nodes=1, hooks=None):
    c = parallel.ClusterOptions(executor=executor, gpus_per_node=gpus, nodes=nodes)
    return parallel.JobPlan(c, hooks, 1, devices, threads, budget)


@pytest.mark.parametrize(
    "o, plan, text",
    [
        (_o(job_id="123", nodes="n1", resources="1 GPU, 8 CPUs", restarts=1), _plan("slurm"),
         "n1: 1 GPU, 8 CPUs (slurm job 123, requeued 1x)"),
        (_o(job_id="9", resources="8 CPUs"), _plan("slurm"), "8 CPUs (slurm job 9)"),
        (_o(job_id="9", nodes="n[1-2]"), _plan("slurm"), "n[1-2] (slurm job 9)"),
        (_o(job_id="9"), _plan("slurm"), "slurm job 9"),
        (_o(job_id="7", devices=(0, 2)), _plan(threads=4, budget=12), "cuda:0,2 (local job 7)"),
        (_o(job_id="7"), _plan(threads=4, budget=12), "cpu, 4 of 12 timing threads (local job 7)"),
        (_o(), _plan(threads=4, budget=12), "cpu, 4 of 12 timing threads (local)"),
        (_o(job_id="7"), _plan(), "local job 7"),
    ],
)  # fmt: skip
def test_ran_on(o, plan, text):
    assert parallel._ran_on(o, plan) == text


TRACE = 'Traceback (most recent call last):\n  File "x.py", line 1\n    boom()\nValueError: boom\n'


@pytest.mark.parametrize(
    "error, line",
    [
        (TRACE, "ValueError: boom"),
        ("lab_utils.run.guard.JobEnded: timed out: its 1-minute limit less 10 s", "its 1-minute limit less 10 s"),
        ("JobEnded: cancelled: signal SIGTERM", "signal SIGTERM"),
        ("SLURM ended job 5 at its time limit", "SLURM ended job 5 at its time limit"),
        ("", ""),
        ("   \n\n", ""),
        ("x" * 500, "x" * 400),
    ],
)
def test_reason_line(error, line):
    assert parallel.reason_line(_o(state="failed", error=error)) == line


def test_log_tail_leaves_submitits_notes_and_job_folder_lines_to_the_full_log(tmp_path):
    jobs = tmp_path / "jobs"
    log = f"submitit INFO (x) - starting\nfirst\nresult in {jobs}/a_result.pkl\nsecond\n"
    assert parallel._log_tail(log, jobs) == "first\nsecond"
    assert parallel._log_tail("ab" * 1500, jobs) == ("ab" * 1500)[-2000:] and parallel._log_tail("", jobs) == ""


_Status = NotebookStatus  # the runner's row, as the runner hands it to parallel's hooks


def _report(tmp_path):
    tmp, final = tmp_path / ".tmp-r", tmp_path / "r"
    for sub in ("notebooks", "html", "records", "artifacts"):
        (tmp / sub).mkdir(parents=True)
    return tmp, final


def test_a_failed_job_is_a_failed_row_with_its_reason_traceback_and_half_run_notebook(tmp_path, monkeypatch):
    tmp, final = _report(tmp_path)
    monkeypatch.setattr("lab_utils.run.report.export_html", lambda nb, out, **kw: out.write_text(nb.read_text()))
    (tmp / "notebooks" / "a.ipynb").write_text(f'{{"printed": "{tmp}/artifacts/a/t.json"}}')
    p = _lab("a", reps=3)
    o = _o(key="a", state="failed", error=TRACE, log="log line\n", seconds=4.5)
    st = parallel._failed_status(p, o, tmp, final, "a", _Status)
    assert st.status == "failed" and st.seconds == 4.5 and st.params == {"reps": 3} and st.path == "labs/a.ipynb"
    assert st.error == "job failed: ValueError: boom\n" + TRACE  # a traceback: no log tail under it
    assert st.ipynb == "notebooks/a.ipynb" and st.html == "html/a.html"
    page = (tmp / "html" / "a.html").read_text()
    assert f"{final}/artifacts/a/t.json" in page and str(tmp) not in page  # paths name the final folder
    # no traceback: the reason, then the log's end
    o = _o(key="b", state="timed out", error="SLURM ended job 5 at its time limit", log="l1\nsubmitit INFO x\nl2")
    st = parallel._failed_status(None, o, tmp, final, "b", _Status)
    assert st.error == "job timed out: SLURM ended job 5 at its time limit\nl1\nl2"
    assert st.ipynb is None and st.html is None and st.path == "b" and st.params == {}


def test_a_half_run_notebook_that_does_not_export_keeps_its_row(tmp_path, monkeypatch):
    tmp, final = _report(tmp_path)

    def broken(*a, **kw):
        raise ValueError("truncated notebook")

    monkeypatch.setattr("lab_utils.run.report.export_html", broken)
    (tmp / "notebooks" / "a.ipynb").write_text("{")
    st = parallel._failed_status(_lab("a"), _o(key="a", state="failed", error="x"), tmp, final, "a", _Status)
    assert st.status == "failed" and st.ipynb == "notebooks/a.ipynb" and st.html is None and st.error == "job failed: x"


class _Cfg:
    def __init__(self, world):
        self.world, self.mesh = world, (world,)

    def to_json(self):
        return json.dumps({"world": self.world})


class _Dist:
    strategies = ("ddp",)

    @classmethod
    def from_params(cls, params):
        return cls()

    def dist_config(self, strategy, world):
        return _Cfg(world)


@pytest.mark.parametrize("executor, gpus, per_node", [("slurm", 4, 4), ("slurm", None, 1), ("local", 4, 1)])
def test_tasks_one_per_lab_and_lab06_across_nodes(tmp_path, executor, gpus, per_node):
    hooks = parallel.RunnerHooks(run_one=lambda *a: None, status=_Status, config_class=lambda nb: _Dist)
    plan = _plan(executor, devices=(0, 1, 2, 3) if executor == "local" else (), gpus=gpus, nodes=2, hooks=hooks)
    planned = [_lab("01_x"), _lab("06_distributed", world_sizes=[2])]
    tmp, final = _report(tmp_path)
    tasks = parallel._tasks(planned, plan, tmp, final, 60, {"E": "1"})
    assert [t.key for t in tasks] == ["01_x", "06_distributed", "06_distributed@2nodes"]
    assert [t.devices for t in tasks] == [
        1 if (executor == "local" or gpus) else 0,
        2 if (executor == "local" or gpus) else 0,
        0,
    ]
    assert tasks[0].fn is parallel.run_lab and tasks[0].args[1:] == (planned[0], tmp, final, 60, {"E": "1"})
    multi = tasks[2]
    assert multi.nodes == 2 and multi.gpus == plan.cluster.gpus and multi.fn is parallel.run_multinode
    spec_json, out, rec, pn, port, key = multi.args
    assert json.loads(spec_json) == {"world": 2 * per_node} and pn == per_node and key == "06_distributed@2nodes"
    assert out == tmp / "artifacts" / key and rec == tmp / "records" / key and rec.is_dir()
    assert json.loads((out / "spec.json").read_text()) == [{"world": 2 * per_node}]
    assert (port is None) == (executor == "slurm") and (port is None or 0 < port < 65536)


def test_one_node_is_no_multinode_task(tmp_path):
    hooks = parallel.RunnerHooks(run_one=None, status=_Status, config_class=lambda nb: _Dist)
    tasks = parallel._tasks([_lab("06_distributed")], _plan("slurm", gpus=2, hooks=hooks), *_report(tmp_path), 60, {})
    assert [t.key for t in tasks] == ["06_distributed"]


def test_run_jobs_rows_in_suite_order_with_logs_and_where_they_ran(tmp_path, monkeypatch):
    hooks = parallel.RunnerHooks(run_one=None, status=_Status, config_class=lambda nb: _Dist)
    plan = _plan(threads=2, budget=4, hooks=hooks)
    planned = [_lab("a"), _lab("b"), _lab("c")]
    tmp, final = _report(tmp_path)
    seen = {}

    def fake_run_tasks(tasks, cluster, folder, *, max_running, devices, progress, desc, on_done):
        seen.update(keys=[t.key for t in tasks], max_running=max_running, desc=desc, env=tasks[0].args[-1])
        folder.mkdir(parents=True)
        on_done(_o(key="c", value=_Status("c", "labs/c.ipynb", status="ok"), job_id="3"))  # ends first
        on_done(_o(key="a", state="failed", error="RuntimeError: x", job_id="1"))
        on_done(_o(key="b", value=_Status("b", "labs/b.ipynb", status="ok"), log="b's log", job_id="2"))

    monkeypatch.setattr(parallel, "run_tasks", fake_run_tasks)
    monkeypatch.setenv("PERFLAB_RUN_ID", "rid")
    statuses = []
    parallel.run_jobs(planned, plan, tmp, final, 60, False, statuses)
    assert [s.notebook for s in statuses] == ["a", "b", "c"]
    assert [s.status for s in statuses] == ["failed", "ok", "ok"] and statuses[0].error == "job failed: RuntimeError: x"
    assert seen["max_running"] == 1 and seen["desc"] == "perflab jobs (local)"
    assert seen["env"] == {"TQDM_DISABLE": "1", "PERFLAB_RUN_ID": "rid", **thread_env(plan, planned)}
    assert (
        statuses[0].log == "logs/a.job.log" and (tmp / "logs" / "a.job.log").read_text() == "(the job wrote no log)\n"
    )
    assert statuses[1].log == "logs/b.job.log" and (tmp / "logs" / "b.job.log").read_text() == "b's log"
    assert statuses[2].log is None and not (tmp / "logs" / "c.job.log").exists()
    assert [s.ran_on for s in statuses] == [f"cpu, 2 of 4 timing threads (local job {i})" for i in "123"]
    assert not (tmp / "jobs").exists()


def test_a_multinode_check_that_passed_is_a_row_of_its_own(tmp_path):
    plan = _plan("slurm", hooks=parallel.RunnerHooks(None, _Status, None))
    task = parallel.Task("06_distributed@2nodes", None)
    o = _o(key=task.key, value={"node": 0, "agreement": {"ok": True}}, seconds=12.0, job_id="5")
    (st,) = parallel._statuses([task], {task.key: o}, {}, plan, *_report(tmp_path))
    assert (st.notebook, st.status, st.seconds, st.path) == (task.key, "ok", 12.0, "06_distributed across nodes")
    assert st.params == {"agreement": {"ok": True}} and st.ran_on == "slurm job 5"


def test_ctrl_c_keeps_the_finished_labs_and_removes_the_rest(tmp_path, monkeypatch):
    plan = _plan(hooks=parallel.RunnerHooks(None, _Status, None))
    planned = [_lab("a"), _lab("b"), _lab("c")]
    tmp, final = _report(tmp_path)
    for s in "abc":
        (tmp / "notebooks" / f"{s}.ipynb").write_text("{}")
        (tmp / "records" / s).mkdir()
        (tmp / "html" / f"{s}.html").write_text("")
        (tmp / "artifacts" / s).mkdir()

    def fake_run_tasks(tasks, cluster, folder, *, on_done, **kw):
        folder.mkdir(parents=True)
        on_done(_o(key="b", value=_Status("b", "labs/b.ipynb", status="ok")))
        on_done(_o(key="c", state="cancelled", error="JobEnded: cancelled: signal SIGINT"))
        raise KeyboardInterrupt

    monkeypatch.setattr(parallel, "run_tasks", fake_run_tasks)
    statuses = []
    with pytest.raises(KeyboardInterrupt):
        parallel.run_jobs(planned, plan, tmp, final, 60, False, statuses)
    assert [s.notebook for s in statuses] == ["b"] and not (tmp / "jobs").exists()
    left = {p.relative_to(tmp).as_posix() for p in tmp.rglob("*")}
    assert {"notebooks/b.ipynb", "records/b", "html/b.html", "artifacts/b"} <= left
    assert not any(
        x in left for s in "ac" for x in (f"notebooks/{s}.ipynb", f"records/{s}", f"html/{s}.html", f"artifacts/{s}")
    )


def test_visible_gpus_is_the_count_torch_sees_and_zero_without_cuda():
    import torch  # noqa: PLC0415 - heavy; only this test compares with its count

    n = parallel.visible_gpus()
    assert type(n) is int and n == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert parallel.prepare().devices == tuple(range(n))  # no --devices: every visible GPU (none here: ())


def _node(monkeypatch, tmp_path, *, rank, job_id, executor, agree=True):
    """One node's task of lab 06 across nodes, with submitit's job environment and the
    rendezvous faked (no torchrun): what it asks the rendezvous for, and what it returns."""
    import submitit  # noqa: PLC0415 - heavy; only the in-job function needs it

    from lab_utils.distributed import rendezvous  # noqa: PLC0415 - heavy (torch.distributed)
    from lab_utils.distributed.spec import DistConfig  # noqa: PLC0415 - heavy (torch)

    env = SimpleNamespace(global_rank=rank, num_tasks=2, hostnames=["gpu-a", "gpu-b"], job_id=job_id)
    monkeypatch.setattr(submitit, "JobEnvironment", lambda: env)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", executor)
    asked = {}
    monkeypatch.setattr(rendezvous, "node_address", lambda name: f"addr-of-{name}")
    monkeypatch.setattr(rendezvous, "run_node", lambda spec, out, **kw: asked.update(kw, spec=spec, out=out) or 0)
    ranks = [SimpleNamespace(rank=i) for i in range(4)]
    monkeypatch.setattr(
        rendezvous, "gather", lambda cfg, dirs, out: asked.update(dirs=dirs) or SimpleNamespace(ranks=ranks)
    )
    a = SimpleNamespace(ok=agree, loss_rel=1e-7, grad_rel_all=2e-7)
    monkeypatch.setattr(rendezvous, "check_against_single_process", lambda res, ref: a)
    spec = DistConfig(strategy="ddp", world_size=4).to_json()
    rec = tmp_path / "rec"
    rec.mkdir(exist_ok=True)
    got = parallel.run_multinode(spec, tmp_path / "out", rec, 2, None, "06_distributed@2nodes")
    return got, asked, rec


@pytest.mark.parametrize("job_id, port", [("12345_0", 32345), ("45000", 25000), ("7", 20007), ("20000", 20000)])
def test_a_slurm_nodes_rendezvous_port_follows_the_job_id(monkeypatch, tmp_path, job_id, port):
    got, asked, _ = _node(monkeypatch, tmp_path, rank=1, job_id=job_id, executor="slurm")
    assert got == {"node": 1, "code": 0} and "dirs" not in asked  # only node 0 gathers
    assert asked["endpoint"] == f"addr-of-gpu-a:{port}" and asked["rdzv_id"] == f"perflab-{job_id}"
    assert asked["node"] == 1 and asked["nnodes"] == 2 and asked["nproc_per_node"] == 2
    assert asked["out"] == tmp_path / "out" / "node1" and asked["spec"] == tmp_path / "out" / "spec.json"


def test_node_zero_gathers_checks_and_records(monkeypatch, tmp_path):
    import pandas as pd  # noqa: PLC0415 - only this test reads the records

    from lab_utils.core.records import load_records  # noqa: PLC0415 - pulls in pandas

    got, asked, rec = _node(monkeypatch, tmp_path, rank=0, job_id="3", executor="local")
    assert asked["endpoint"] == "127.0.0.1:20003"  # local: the "nodes" are tasks on this machine
    assert asked["dirs"] == [tmp_path / "out" / "node0", tmp_path / "out" / "node1"]
    assert got["node"] == 0 and got["agreement"]["ok"]
    df = load_records(rec / "records.json")
    assert isinstance(df, pd.DataFrame) and list(df["metric"]) == ["loss_rel_err", "grad_rel_err", "ranks"]
    assert list(df["value"]) == [1e-7, 2e-7, 4.0] and set(df["shape"]) == {"2x2"} and set(df["variant"]) == {"ddp"}
    with pytest.raises(RuntimeError, match="the 2-node run does not reproduce the single-process run"):
        _node(monkeypatch, tmp_path, rank=0, job_id="3", executor="local", agree=False)
