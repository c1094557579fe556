"""A suite's labs as jobs: side by side on a node's devices, or on a SLURM cluster.

``perflab run SUITE --parallel N [--devices 0,1,...]`` and ``--executor local|slurm``
(:mod:`lab_utils.run.executors`) end here.  :func:`plan_jobs` validates the options before
anything is submitted; :func:`run_jobs` submits one job per lab and returns the same
:class:`~lab_utils.run.runner.NotebookStatus` rows a sequential run writes, so the runner
assembles the one report as usual.

* Each lab is pinned to its devices (``CUDA_VISIBLE_DEVICES`` in its job, so in its kernel):
  one, and lab 06 as many as its largest world size asks for; it waits until they are free.
* On CPU the timing thread budget (``--timing-threads``, else the cores free now) is divided
  between the labs that run at once: each job gets ``PERFLAB_TIMING_THREADS`` = budget // N,
  which every timing then records (policy ``PERFLAB_TIMING_THREADS``) together with
  ``PERFLAB_THREAD_SHARE``, the sentence saying it was shared.
* A job that failed, timed out or was cancelled becomes a failed row with the job's log
  (``logs/<lab>.job.log``, the tail in the error); a notebook it left half-run is exported too.
* ``--nodes N`` (N > 1) adds a job for lab 06's first strategy on N nodes x GPUs per node through
  ``srun`` + torchrun's c10d rendezvous (:mod:`lab_utils.distributed.rendezvous`; with the local
  executor the N "nodes" are N tasks of one job on this machine), checked against the
  single-process run; its row is ``06_distributed@Nnodes``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lab_utils.core.config import ConfigError, DeviceTarget, check_int
from lab_utils.core.cpu_threads import THREADS_ENV, choose_cpu_threads
from lab_utils.run.cluster import EXECUTORS, ClusterOptions, cluster_options, resolve_site
from lab_utils.run.executors import Outcome, Task, run_tasks

SHARE_ENV = "PERFLAB_THREAD_SHARE"
DIST_LAB = "06_distributed"


@dataclass(frozen=True)
class RunnerHooks:
    """What the jobs take from the runner (``runner.JOB_HOOKS``; passed in, so that this module,
    which the runner imports, does not import it back)."""

    run_one: Callable  # execute one planned notebook into the report folder -> its status
    status: type  # the status row class
    config_class: Callable  # a notebook's LabConfig class


@dataclass(frozen=True)
class JobOptions:
    """The job options, validated (against the SLURM site with ``--executor slurm``) before the labs are."""

    cluster: ClusterOptions
    parallel: int = 1
    devices: tuple[int, ...] | None = None  # local: the GPUs given (None: all visible)

    def target(self) -> DeviceTarget | None:
        """Where the labs' device-dependent parameters are checked: a SLURM partition's nodes (None:
        this machine, where local jobs run)."""
        c = self.cluster
        if c.executor != "slurm" or c.site is None:
            return None
        p = c.site.partitions[c.partition]
        asked = f", --gpus-per-node {c.gpus}" if c.gpus != p.node_gpus else ""
        return DeviceTarget(c.gpus, f"the jobs on partition {p.name} (GRES {p.gres}{asked})")


@dataclass(frozen=True)
class JobPlan:
    """How a suite's labs run as jobs (validated by :func:`plan_jobs`)."""

    cluster: ClusterOptions
    hooks: RunnerHooks
    parallel: int = 1
    devices: tuple[int, ...] = ()
    threads_per_lab: int | None = None  # CPU: each job's timing threads
    thread_budget: int | None = None


def parse_devices(text: str | None) -> tuple[int, ...] | None:
    """``"0,1,3"`` -> (0, 1, 3); ConfigError naming ``--devices`` otherwise."""
    if text is None:
        return None
    try:
        ids = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        ids = ()
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
        raise ConfigError("--devices", text, "distinct GPU indices >= 0, comma-separated (e.g. 0,1,2,3)")
    return ids


def visible_gpus() -> int:
    import torch  # noqa: PLC0415

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def lab_devices(p, ndev: int) -> int:
    """Devices one planned lab needs where the suite has ``ndev`` per lab's node (0 on CPU): none for
    a lab set to ``device: cpu``, one, and lab 06 its largest world size ("auto" = all of them;
    backend gloo runs its ranks on the CPU)."""
    if ndev == 0 or p.resolved.get("device") == "cpu":
        return 0
    if p.entry.stem != DIST_LAB:
        return 1
    if p.resolved.get("backend") == "gloo":
        return 0
    sizes = [ndev if isinstance(w, str) else int(w) for w in p.resolved.get("world_sizes", [1])]
    return max(sizes)


def prepare(executor=None, parallel=None, devices=None, cluster=None) -> JobOptions:
    """Validate the job options that do not depend on the labs; ``cluster``:
    :func:`.cluster.cluster_options` keyword values (partition, account, timeout_min,
    gpus_per_node, nodes, config).  With SLURM they are checked against the site here."""
    cluster = dict(cluster or {})
    executor = executor or "local"
    if executor not in EXECUTORS:
        raise ConfigError("--executor", executor, "one of " + ", ".join(map(repr, EXECUTORS)))
    if executor == "slurm":
        for name, v in (("--parallel", parallel), ("--devices", devices)):
            if v is not None:
                raise ConfigError(name, v, "no value with --executor slurm (the scheduler places the jobs)")
    opts = resolve_site(cluster_options(executor, cluster.pop("config", None), **cluster))
    parallel = 1 if parallel is None else parallel
    check_int("--parallel", parallel, min=1)
    ids = parse_devices(devices) if isinstance(devices, str) or devices is None else tuple(devices)
    if executor == "local":
        n = visible_gpus()
        if ids is not None and n == 0:
            raise ConfigError("--devices", devices, "no value: this machine has no visible GPU")
        if ids is not None and max(ids) >= n:
            raise ConfigError("--devices", devices, f"indices below {n} (the visible GPUs)")
        ids = ids if ids is not None else tuple(range(n))
    return JobOptions(opts, parallel, ids)


def plan_jobs(planned, hooks: RunnerHooks, prep: JobOptions | None = None, *, timing_threads=None, **jobs) -> JobPlan:
    """Check the job options against the suite (``prep`` from :func:`prepare`, else ``jobs`` its options)."""
    prep = prep or prepare(**jobs)
    opts, ids = prep.cluster, tuple(prep.devices or ())
    for p in planned:
        if opts.executor == "local":
            need = lab_devices(p, len(ids))
            if need > len(ids):
                raise ConfigError("--devices", ",".join(map(str, ids)) or None,
                                  f"at least {need} devices ({p.entry.stem} asks for {need})")  # fmt: skip
        elif lab_devices(p, opts.gpus) > opts.gpus:
            why = f"at most {opts.gpus} ranks in one job: a node has {opts.gpus} GPUs (--nodes N: lab 06 on N nodes)"
            raise ConfigError("world_sizes", p.resolved.get("world_sizes"), f"{why} (in {p.entry.stem})")
    if opts.nodes > 1 and DIST_LAB not in {p.entry.stem for p in planned}:
        raise ConfigError("--nodes", opts.nodes, f"1: the suite has no {DIST_LAB} lab to run across nodes")
    budget = per_lab = None
    if opts.executor == "local" and not ids:
        budget = choose_cpu_threads(timing_threads).threads
        per_lab = max(1, budget // min(prep.parallel, len(planned)))
    return JobPlan(opts, hooks, prep.parallel, ids, per_lab, budget)


def multinode_spec(p, nodes: int, per_node: int, config_class: Callable):
    """Lab 06's first strategy on ``nodes`` x ``per_node`` ranks, validated (mesh, batch) here."""
    cls = config_class(p.entry.notebook)
    lab = cls.from_params({**p.resolved, "world_sizes": [1]})
    cfg = lab.dist_config(lab.strategies[0], nodes * per_node)
    cfg.mesh  # noqa: B018 - validates the world size against the strategy and batch
    return cfg


# ----------------------------------------------------------------------------- in the job
def run_lab(run_one: Callable, p, tmp: Path, final: Path, timeout_s: int, env: dict):
    """One lab's job: the runner's notebook execution with this job's environment."""
    os.environ.update(env)
    return run_one(p, tmp, final, timeout_s)


def run_multinode(spec_json: str, out: Path, rec_dir: Path, per_node: int, port: int | None, lab: str):
    """One node's task of lab 06 across nodes; task 0 also gathers, checks and records."""
    import submitit  # noqa: PLC0415

    from lab_utils.core.records import Recorder  # noqa: PLC0415
    from lab_utils.distributed import rendezvous  # noqa: PLC0415
    from lab_utils.distributed.spec import DistConfig  # noqa: PLC0415

    env = submitit.JobEnvironment()
    node, nnodes = env.global_rank, env.num_tasks
    local = os.environ.get("SUBMITIT_EXECUTOR") == "local"
    host = "127.0.0.1" if local else rendezvous.node_address(env.hostnames[0])
    port = port or 20000 + int(str(env.job_id).split("_")[0]) % 20000
    cfg = DistConfig(**json.loads(spec_json))
    code = rendezvous.run_node(
        out / "spec.json",
        out / f"node{node}",
        node=node,
        nnodes=nnodes,
        nproc_per_node=per_node,
        endpoint=f"{host}:{port}",
        rdzv_id=f"perflab-{env.job_id}",
        timeout_s=cfg.timeout_s,
    )
    if node != 0:
        return {"node": node, "code": code}
    res = rendezvous.gather(cfg, [out / f"node{i}" for i in range(nnodes)], out / "gathered")
    a = rendezvous.check_against_single_process(res, out / "reference")
    rec = Recorder(lab, params={"nodes": nnodes, "per_node": per_node, "strategy": cfg.strategy})
    shape = f"{nnodes}x{per_node}"
    rec.add("multinode", cfg.strategy, "loss_rel_err", a.loss_rel, shape=shape)
    rec.add("multinode", cfg.strategy, "grad_rel_err", a.grad_rel_all, shape=shape)
    rec.add("multinode", cfg.strategy, "ranks", float(len(res.ranks)), "count", shape=shape)
    rec.save(rec_dir / "records.json")
    if not a.ok:
        raise RuntimeError(f"the {nnodes}-node run does not reproduce the single-process run: {a}")
    return {"node": 0, "code": code, "agreement": vars(a)}


# ----------------------------------------------------------------------------- the suite
def _ran_on(o: Outcome, plan: JobPlan) -> str:
    if plan.cluster.executor == "slurm":  # "n1: 1 GPU, 8 CPUs (slurm job 123, requeued 1x)"
        where = f"slurm job {o.job_id}" + (f", requeued {o.restarts}x" if o.restarts else "")
        what = ": ".join(x for x in (o.nodes, o.resources) if x)
        return f"{what} ({where})" if what else where
    where = f"{plan.cluster.executor} job {o.job_id}" if o.job_id else plan.cluster.executor
    if o.devices:
        return f"cuda:{','.join(map(str, o.devices))} ({where})"
    if plan.threads_per_lab:
        return f"cpu, {plan.threads_per_lab} of {plan.thread_budget} timing threads ({where})"
    return where


def reason_line(o: Outcome) -> str:
    """The one line that says why a job ended without a status: SLURM's reason, else the error it raised."""
    lines = [ln for ln in o.error.splitlines() if ln.strip()]
    raised = next((ln for ln in reversed(lines) if not ln.startswith(("-", " ", "Traceback"))), "")
    line = raised or (lines[0] if lines else "")
    if "JobEnded: " in line:  # "...guard.JobEnded: timed out: its 1-minute limit ..." -> "its 1-minute limit ..."
        line = line.split("JobEnded: ", 1)[1].split(": ", 1)[-1]
    return line[:400]


def _log_tail(log: str, jobs: Path, limit: int = 2000) -> str:
    """The end of a job's log for its row: submitit's own notes (which name files in the job folder,
    removed when the run ends) left to the full log, kept as logs/<lab>.job.log."""
    keep = [ln for ln in (log or "").splitlines() if not ln.startswith("submitit INFO") and str(jobs) not in ln]
    return "\n".join(keep)[-limit:]


def _failed_status(p, o: Outcome, tmp: Path, final: Path, stem: str, status_cls: type):
    """A job that did not return a status: a failed row, its log, and the half-run notebook if any."""
    from lab_utils.run import report  # noqa: PLC0415

    path = str(p.entry.notebook) if p is not None else stem
    st = status_cls(notebook=stem, path=path, status="failed", params=p.resolved if p is not None else {})
    why = reason_line(o)
    body = o.error[-3000:] if o.error.strip() != why else ""  # a traceback: kept below the reason
    tail = _log_tail(o.log, tmp / "jobs") if "Traceback" not in o.error else ""  # no traceback: the log's end
    st.error = "\n".join(x for x in (f"job {o.state}: {why}", body, tail) if x)
    st.seconds = o.seconds
    nb = tmp / "notebooks" / f"{stem}.ipynb"
    if nb.exists():
        st.ipynb = f"notebooks/{stem}.ipynb"
        try:
            report.relocate_file(nb, tmp, final)
            report.export_html(nb, tmp / "html" / f"{stem}.html", title=stem)
            st.html = f"html/{stem}.html"
        except Exception:  # noqa: BLE001, S110 - a half-written notebook may not export; the log says why
            pass
    return st


def _tasks(planned, plan: JobPlan, tmp: Path, final: Path, timeout_s: int, env: dict) -> list[Task]:
    gpus = plan.cluster.gpus
    tasks = []
    for p in planned:
        need = lab_devices(p, len(plan.devices) if plan.cluster.executor == "local" else gpus)
        tasks.append(Task(p.entry.stem, run_lab, (plan.hooks.run_one, p, tmp, final, timeout_s, env), devices=need))
    nodes = plan.cluster.nodes
    dist = next((p for p in planned if p.entry.stem == DIST_LAB), None)
    if nodes > 1 and dist is not None:
        per_node = max(gpus, 1) if plan.cluster.executor == "slurm" else 1
        cfg = multinode_spec(dist, nodes, per_node, plan.hooks.config_class)
        tasks.append(multinode_task(cfg, nodes, per_node, tmp, plan.cluster))
    return tasks


def multinode_task(cfg, nodes: int, per_node: int, tmp: Path, cluster: ClusterOptions) -> Task:
    """The job of lab 06 across ``nodes`` nodes: its spec written under ``tmp/artifacts/<key>``,
    its records to ``tmp/records/<key>``; locally, the rendezvous port is chosen here."""
    key = f"{DIST_LAB}@{nodes}nodes"
    out, rec = tmp / "artifacts" / key, tmp / "records" / key
    out.mkdir(parents=True, exist_ok=True)
    rec.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps([json.loads(cfg.to_json())]))
    port = None
    if cluster.executor == "local":
        from lab_utils.distributed.launch import free_port  # noqa: PLC0415

        port = free_port()
    args = (cfg.to_json(), out, rec, per_node, port, key)
    return Task(key, run_multinode, args, devices=0, nodes=nodes, gpus=cluster.gpus)


def thread_env(plan: JobPlan, planned) -> dict[str, str]:
    """On CPU: the environment that gives each lab its share of the timing-thread budget and says
    why in its recorded thread choice (empty on GPUs, where labs get devices instead)."""
    if not plan.threads_per_lab:
        return {}
    share = (
        f"{plan.thread_budget} timing threads shared by up to {min(plan.parallel, len(planned))} labs "
        f"running at once: {plan.threads_per_lab} each"
    )
    return {THREADS_ENV: str(plan.threads_per_lab), SHARE_ENV: share}


def run_jobs(planned, plan: JobPlan, tmp: Path, final: Path, timeout_s: int, progress: bool, statuses: list) -> None:
    """Run the suite's labs as jobs; append each lab's status to ``statuses`` in suite order once
    all have ended.  Ctrl-C: the jobs are cancelled and ended, the unfinished labs' partial files
    and the job folder removed, finished labs' statuses appended; then KeyboardInterrupt."""
    env = {"TQDM_DISABLE": "1", "PERFLAB_RUN_ID": os.environ.get("PERFLAB_RUN_ID", ""), **thread_env(plan, planned)}
    jobs_dir = tmp / "jobs"
    tasks = _tasks(planned, plan, tmp, final, timeout_s, env)
    by_stem = {p.entry.stem: p for p in planned}
    done: dict[str, Outcome] = {}
    try:
        run_tasks(
            tasks,
            plan.cluster,
            jobs_dir,
            max_running=plan.parallel,
            devices=plan.devices,
            progress=progress,
            desc=f"perflab jobs ({plan.cluster.executor})",
            on_done=lambda o: done.__setitem__(o.key, o),
        )
    except KeyboardInterrupt:
        for t in tasks:
            if t.key not in done or not done[t.key].ok:
                done.pop(t.key, None)
                for part in ("notebooks/{}.ipynb", "html/{}.html", "records/{}", "artifacts/{}"):
                    f = tmp / part.format(t.key)
                    shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink(missing_ok=True)
        statuses.extend(_statuses(tasks, done, by_stem, plan, tmp, final))
        raise
    finally:
        shutil.rmtree(jobs_dir, ignore_errors=True)
    statuses.extend(_statuses(tasks, done, by_stem, plan, tmp, final))


def _statuses(tasks, done, by_stem, plan: JobPlan, tmp, final) -> list:
    status_cls = plan.hooks.status
    out = []
    for t in tasks:
        o = done.get(t.key)
        if o is None:
            continue
        p = by_stem.get(t.key)
        if o.ok and isinstance(o.value, status_cls):
            st = o.value
        elif o.ok:  # the multi-node check: a row of its own
            st = status_cls(notebook=t.key, path=f"{DIST_LAB} across nodes", status="ok", seconds=o.seconds)
            st.params = {"agreement": (o.value or {}).get("agreement")}
        else:
            st = _failed_status(p, o, tmp, final, t.key, status_cls)
        if o.log or not o.ok:  # kept in the report, linked from its row
            (tmp / "logs").mkdir(exist_ok=True)
            (tmp / "logs" / f"{t.key}.job.log").write_text(o.log or "(the job wrote no log)\n", encoding="utf-8")
            st.log = f"logs/{t.key}.job.log"
        st.ran_on = _ran_on(o, plan)
        out.append(st)
    return out


# ----------------------------------------------------------------------------- command line
def add_job_options(r) -> None:
    """``perflab run``'s job options (docs/cluster.md)."""
    g = r.add_argument_group("jobs (docs/cluster.md)")
    g.add_argument("--parallel", type=int, default=None, metavar="N", help="run N labs at once on this machine")
    g.add_argument("--devices", default=None, metavar="0,1,...", help="GPUs the labs share (default: all visible)")
    g.add_argument("--executor", default=None, choices=EXECUTORS, help="each lab a submitit job: local or slurm")
    g.add_argument("--partition", default=None, help="SLURM partition (sbatch --partition)")
    g.add_argument("--account", default=None, help="SLURM account (sbatch --account)")
    g.add_argument("--time-limit", type=int, default=None, metavar="MIN", help="each job's limit (sbatch --time)")
    g.add_argument("--gpus-per-node", type=int, default=None, help="GPUs of a node (sbatch --gpus-per-node)")
    g.add_argument("--nodes", type=int, default=None, help="lab 06 also across N nodes (srun + torchrun rendezvous)")
    g.add_argument("--cluster-config", default=None, metavar="YAML", help="defaults for these (perflab.slurm.yaml)")


def job_options(a) -> dict | None:
    """The ``jobs`` argument of ``run_suite`` from parsed options; None when no job option was given."""
    cluster = dict(
        partition=a.partition,
        account=a.account,
        timeout_min=a.time_limit,
        gpus_per_node=a.gpus_per_node,
        nodes=a.nodes,
        config=a.cluster_config,
    )
    if a.executor is None and a.parallel is None and a.devices is None and all(v is None for v in cluster.values()):
        return None
    return dict(executor=a.executor, parallel=a.parallel, devices=a.devices, cluster=cluster)
