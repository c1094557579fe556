"""Jobs on submitit executors: this machine's processes and a SLURM cluster behind one interface.

* :func:`cluster_options` validates where jobs go (``executor`` "local" or "slurm", partition,
  account, time limit, GPUs per node, nodes, memory) from options and an optional
  ``perflab.slurm.yaml``; a bad value raises :class:`ConfigError` naming it, before anything
  is submitted.
* :func:`run_tasks` submits :class:`Task` s through ``submitit.AutoExecutor`` (the local
  executor starts each as a process with its own ``CUDA_VISIBLE_DEVICES``; the SLURM one
  ``sbatch`` es it), at most ``max_running`` at once and each with the devices it asks for
  (a task asking for more waits until enough are free), follows them with a progress bar and
  returns one :class:`Outcome` per task: ok with its value, or failed / timed out / cancelled
  with the reason and the job's log.  Ctrl-C cancels every job it submitted, waits until they
  have ended and re-raises.
* :func:`map_jobs` maps a function over many items (the per-rank analysis of a job's traces):
  a process pool here, or one submitit job per item, each worker's address space bounded
  by ``mem_gb``; outcomes come back in item order, failures included, for the caller to reduce.
* :func:`job_guard` is what a job runs under: on a cancel (SIGINT / SIGTERM) or the time-limit
  signal (SIGUSR2) it ends every process the job started (a notebook's kernel lives in its own
  session and would otherwise outlive it) and the job ends with :class:`JobEnded` saying which.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import resource
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from ..core.config import ConfigError, check_choice, check_int

EXECUTORS = ("local", "slurm")
MAP_EXECUTORS = ("pool", *EXECUTORS)
CONFIG_FILE = "perflab.slurm.yaml"
POLL_S = 0.5
CANCEL_WAIT_S = 20.0


class JobStopped(KeyboardInterrupt):
    """Raised inside a job by the signal that cancels it or ends its time (a KeyboardInterrupt, so
    that no ``except Exception`` on the way swallows it); :func:`job_guard` turns it into
    :class:`JobEnded` for submitit to report."""


class JobEnded(RuntimeError):
    """A job cancelled or out of time: "cancelled (signal SIGTERM)", "timed out (signal SIGUSR2)"."""


@dataclass(frozen=True)
class ClusterOptions:
    """Where jobs run.  ``gpus_per_node``: the GPUs one node of the partition has (a lab gets one,
    lab 06 as many as its world size asks for, at most these); ``nodes``: lab 06's node count."""

    executor: str = "local"
    partition: str | None = None
    account: str | None = None
    timeout_min: int = 60
    gpus_per_node: int = 0
    nodes: int = 1
    mem_gb: float | None = None
    cpus_per_task: int | None = None

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items() if v not in (None, ""))


def load_cluster_config(path: str | Path) -> dict:
    """``perflab.slurm.yaml``: a mapping of :class:`ClusterOptions` fields; unknown keys are refused."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--cluster-config", str(path), "an existing YAML file (see docs/cluster.md)")
    data = yaml.safe_load(p.read_text()) or {}
    known = [f.name for f in fields(ClusterOptions)]
    if not isinstance(data, dict):
        raise ConfigError("--cluster-config", str(path), f"a YAML mapping with keys among {', '.join(known)}")
    for k in data:
        if k not in known:
            raise ConfigError(f"{p.name}: {k}", data[k], f"a key among {', '.join(known)}")
    return data


def cluster_options(executor: str, config: str | Path | None = None, **given: Any) -> ClusterOptions:
    """Options from ``config`` (a YAML file; ``./perflab.slurm.yaml`` when it exists and none is
    named), then ``given`` (command-line values; None = not given), validated."""
    if config is None and Path(CONFIG_FILE).is_file():
        config = CONFIG_FILE
    values = load_cluster_config(config) if config is not None else {}
    values.update({k: v for k, v in given.items() if v is not None})
    values["executor"] = executor
    check_choice("--executor", executor, EXECUTORS)
    opts = ClusterOptions(**values)
    check_int("--time-limit", opts.timeout_min, min=1)
    check_int("--gpus-per-node", opts.gpus_per_node, min=0)
    check_int("--nodes", opts.nodes, min=1)
    if opts.cpus_per_task is not None:
        check_int("cpus_per_task", opts.cpus_per_task, min=1)
    if opts.mem_gb is not None and not (isinstance(opts.mem_gb, (int, float)) and opts.mem_gb > 0):
        raise ConfigError("mem_gb", opts.mem_gb, "a number of GB > 0")
    for name in ("partition", "account"):
        v = getattr(opts, name)
        if v is not None and (not isinstance(v, str) or not v.strip() or any(c.isspace() for c in v)):
            raise ConfigError(f"--{name}", v, "a SLURM name (no spaces)")
        if v is not None and executor != "slurm":
            raise ConfigError(f"--{name}", v, "no value with --executor local (a SLURM setting)")
    if executor == "slurm" and not opts.partition:
        raise ConfigError("--partition", None, f"a SLURM partition with --executor slurm (option or {CONFIG_FILE})")
    return opts


def make_executor(opts: ClusterOptions, folder: Path, *, name: str, gpus: int = 0, nodes: int = 1, visible=()):
    """A ``submitit.AutoExecutor`` for one job: ``gpus`` per node (local: the devices ``visible``),
    ``nodes`` nodes with one task each (local: one task per node, all on this machine)."""
    import submitit  # noqa: PLC0415 - only runs that submit jobs need it

    common = dict(timeout_min=opts.timeout_min, gpus_per_node=gpus)
    if opts.executor == "local":  # several "nodes" on this machine are several tasks of one job
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(**common, tasks_per_node=nodes, visible_gpus=tuple(visible), signal_delay_s=5)
        return ex
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    ex.update_parameters(
        **common,
        name=name,
        nodes=nodes,
        tasks_per_node=1,
        mem_gb=opts.mem_gb,
        cpus_per_task=opts.cpus_per_task,
        slurm_partition=opts.partition,
        slurm_account=opts.account,
        slurm_signal_delay_s=60,
    )
    return ex


@dataclass
class Outcome:
    """What became of one job: ``state`` "ok", "failed", "timed out" or "cancelled"."""

    key: str
    state: str
    value: Any = None
    error: str = ""
    log: str = ""
    job_id: str = ""
    devices: tuple[int, ...] = ()
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.state == "ok"


@dataclass
class Task:
    """One job: ``fn(*args)`` with ``devices`` devices (local executor) and ``nodes`` nodes."""

    key: str
    fn: Callable
    args: tuple = ()
    devices: int = 0
    nodes: int = 1
    gpus: int | None = None  # SLURM GPUs per node (default: ``devices``)


def _job_log(job, limit: int = 6000) -> str:
    parts = []
    for what, get in (("stderr", job.stderr), ("stdout", job.stdout)):
        with contextlib.suppress(Exception):
            text = get() or ""
            if text.strip():
                parts.append(f"--- job {what} ---\n{text[-limit:]}")
    return "\n".join(parts)


def _state_of(job, error: str) -> str:
    """failed / timed out / cancelled, from what the job raised and what the scheduler says."""
    sched = str(getattr(job, "state", "") or "").upper()
    if "JobEnded: timed out" in error or "not requeued because: timed-out" in error or "TIMEOUT" in sched:
        return "timed out"
    if "JobEnded: cancelled" in error or sched.startswith("CANCELLED") or sched == "INTERRUPTED":
        return "cancelled"
    return "failed"


def outcome_of(job, key: str) -> Outcome:
    """The :class:`Outcome` of a finished job (value, or reason and log)."""
    if getattr(job, "_process", None) is not None:
        job._results_timeout_s = 2  # a local job that died leaves no result: say so without waiting
    try:
        values = job.results()
    except Exception as e:  # noqa: BLE001 - a job's failure is its outcome
        error = str(e).strip()
        return Outcome(key, _state_of(job, error), error=error, log=_job_log(job), job_id=str(job.job_id))
    return Outcome(key, "ok", value=values[0], log=_job_log(job), job_id=str(job.job_id))


def _wait_ended(jobs: Sequence, wait_s: float) -> None:
    """Until every job has ended (local: its process has exited, SIGKILL after ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    for job in jobs:
        proc = getattr(job, "_process", None)
        if proc is not None:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except Exception:  # noqa: BLE001 - still running: end it
                proc.kill()
                proc.wait()
            continue
        while time.monotonic() < deadline and not job.done(force_check=True):
            time.sleep(POLL_S)


def cancel_all(jobs: Sequence, wait_s: float = CANCEL_WAIT_S) -> None:
    """Cancel every job not yet done and wait until they have ended."""
    live = [j for j in jobs if not j.done()]
    for job in live:
        with contextlib.suppress(Exception):
            job.cancel(check=False)
    _wait_ended(live, wait_s)


def _wait(seconds: float) -> None:
    """Between polls of the running jobs (a test replaces it to interrupt a run mid-way)."""
    time.sleep(seconds)


class _Slots:
    """Device ids handed to tasks: a task waits until as many as it asks for are free."""

    def __init__(self, devices: Sequence[int]):
        self.free = list(devices)

    def take(self, n: int) -> tuple[int, ...] | None:
        if n > len(self.free):
            return None
        got, self.free = tuple(self.free[:n]), self.free[n:]
        return got

    def give(self, ids: tuple[int, ...]) -> None:
        self.free = sorted(self.free + list(ids))


def run_tasks(
    tasks: Sequence[Task],
    opts: ClusterOptions,
    folder: Path,
    *,
    max_running: int | None = None,
    devices: Sequence[int] = (),
    progress: bool = True,
    desc: str = "jobs",
    on_done: Callable[[Outcome], None] | None = None,
) -> dict[str, Outcome]:
    """Submit ``tasks`` in order (local: at most ``max_running`` at once, each with its devices;
    SLURM: all at once, the scheduler places them), follow them, return their outcomes by key.
    ``on_done`` is called as each ends.  Ctrl-C cancels what was submitted, then re-raises."""
    pending, running, done = list(tasks), {}, {}
    slots = _Slots(devices)
    cap = max_running if opts.executor == "local" and max_running else len(tasks)
    bar = tqdm(total=len(tasks), desc=desc, unit="job", disable=not progress, file=sys.stderr)
    shown = ""
    try:
        while pending or running:
            while pending and len(running) < cap:
                t = pending[0]
                ids = slots.take(t.devices) if opts.executor == "local" else ()
                if ids is None:
                    break  # waits for its devices (in order: a big task is not starved)
                pending.pop(0)
                gpus = t.gpus if t.gpus is not None else t.devices
                ex = make_executor(opts, folder / t.key, name=t.key, gpus=gpus, nodes=t.nodes, visible=ids)
                running[t.key] = (ex.submit(t.fn, *t.args), ids, time.monotonic())
            for key, (job, ids, t0) in list(running.items()):
                if job.done():
                    out = replace(outcome_of(job, key), devices=ids, seconds=time.monotonic() - t0)
                    if out.state == "failed" and out.seconds >= 60 * opts.timeout_min:  # ended by the limit
                        out.state, out.error = "timed out", f"ran past timeout_min={opts.timeout_min}\n{out.error}"
                    done[key] = out
                    del running[key]
                    slots.give(ids)
                    bar.update(1)
                    if on_done is not None:
                        on_done(out)
            if shown != ", ".join(running):
                shown = ", ".join(running)
                bar.set_postfix_str(shown)
            if pending or running:
                _wait(POLL_S)
    except BaseException:  # Ctrl-C, or an error here: nothing submitted is left running
        cancel_all([job for job, _, _ in running.values()])
        raise
    finally:
        bar.close()
    return done


# ------------------------------------------------------------------------- inside a job
def _children_of(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc), parents before children."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
                parent[int(d)] = int(stat[stat.rfind(")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parent.items() if p in frontier]
        out += kids
        frontier = kids
    return out


def end_children() -> list[int]:
    """SIGKILL every process this one started (and their process groups); their pids."""
    kids = _children_of(os.getpid())
    for pid in kids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return kids


@contextlib.contextmanager
def job_guard() -> Iterator[None]:
    """Run a job's body so that a cancel or its time limit ends what it started (see module note)."""
    reasons = {signal.SIGINT: "cancelled", signal.SIGTERM: "cancelled", signal.SIGUSR2: "timed out"}

    def stop(signum, _frame):
        end_children()
        raise JobStopped(f"{reasons[signal.Signals(signum)]} (signal {signal.Signals(signum).name})")

    old = {s: signal.signal(s, stop) for s in reasons}
    try:
        yield
    except JobStopped as e:  # an Exception, so that submitit writes it as the job's error
        raise JobEnded(str(e)) from None
    finally:
        end_children()
        for s, h in old.items():
            signal.signal(s, h)


# ------------------------------------------------------------------------- map over items
def _limit_memory(mem_gb: float | None) -> None:
    if mem_gb:
        limit = int(mem_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _bounded_call(fn: Callable, item: Any, mem_gb: float | None) -> Any:
    """``fn(item)`` in a job, its address space limited to ``mem_gb`` (MemoryError beyond it)."""
    _limit_memory(mem_gb)
    with job_guard():
        return fn(item)


@dataclass
class MapOptions:
    """How :func:`map_jobs` runs: ``executor`` "pool" (processes here), "local" or "slurm"
    (submitit jobs), ``workers`` at once (pool and local), ``mem_gb`` per worker."""

    executor: str = "pool"
    workers: int = 2
    mem_gb: float | None = 4.0
    cluster: ClusterOptions = field(default_factory=ClusterOptions)


def map_jobs(
    fn: Callable, items: Sequence, opts: MapOptions, folder: Path, *, progress: bool = True, desc: str = "map"
) -> list[Outcome]:
    """``fn(item)`` for every item on ``opts.executor``; outcomes in item order (key = index).
    ``fn`` must be importable (a module-level function); ``folder`` holds the submitit jobs'
    files and is removed at the end.  Ctrl-C cancels everything and re-raises."""
    check_choice("executor", opts.executor, MAP_EXECUTORS)
    check_int("workers", opts.workers, min=1)
    if opts.mem_gb is not None and not opts.mem_gb > 0:
        raise ConfigError("mem_gb", opts.mem_gb, "a number of GB > 0, or None for no bound")
    if opts.executor == "pool":
        return _map_pool(fn, items, opts, progress, desc)
    cluster = replace(opts.cluster, executor=opts.executor)
    if opts.mem_gb is not None and cluster.mem_gb is None:
        cluster = replace(cluster, mem_gb=float(opts.mem_gb))
    tasks = [Task(str(i), _bounded_call, (fn, it, opts.mem_gb)) for i, it in enumerate(items)]
    try:
        done = run_tasks(tasks, cluster, Path(folder), max_running=opts.workers, progress=progress, desc=desc)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return [done[str(i)] for i in range(len(items))]


def _map_pool(fn: Callable, items: Sequence, opts: MapOptions, progress: bool, desc: str) -> list[Outcome]:
    outs: list[Outcome | None] = [None] * len(items)
    with cf.ProcessPoolExecutor(opts.workers, initializer=_limit_memory, initargs=(opts.mem_gb,)) as pool:
        futs = {pool.submit(fn, it): i for i, it in enumerate(items)}
        try:
            for fut in tqdm(cf.as_completed(futs), total=len(futs), desc=desc, disable=not progress, file=sys.stderr):
                i = futs[fut]
                try:
                    outs[i] = Outcome(str(i), "ok", value=fut.result())
                except MemoryError:
                    outs[i] = Outcome(
                        str(i), "failed", error=f"MemoryError: over the worker's bound mem_gb={opts.mem_gb}"
                    )
                except Exception as e:  # noqa: BLE001 - one item's failure is its outcome
                    outs[i] = Outcome(str(i), "failed", error=f"{type(e).__name__}: {e}")
        except KeyboardInterrupt:
            for f in futs:
                f.cancel()
            for p in list(getattr(pool, "_processes", {}).values()):
                p.kill()
            raise
    return [o for o in outs if o is not None]
