"""Jobs on submitit executors: this machine's processes and a SLURM cluster behind one interface.

* Where jobs go (:class:`ClusterOptions`, ``perflab.slurm.yaml``, checked against the SLURM site)
  is :mod:`.cluster`; its names are importable from here too.
* :func:`run_tasks` submits :class:`Task` s (the local executor starts each as a process with its
  own ``CUDA_VISIBLE_DEVICES``; the SLURM one ``sbatch`` es it, a whole list as one job array with
  ``array=True``), at most ``max_running`` at once locally and each with the devices it asks for,
  follows them with a progress bar and returns one :class:`Outcome` per task: ok with its value,
  or failed / timed out / cancelled with the reason and the job's log.  A SLURM job is followed by
  ``squeue``/``scontrol``/``sacct`` (:class:`.slurm.Watch`), never by waiting for a result that a
  job which has left the queue will not write; one that sbatch refuses is a failed outcome.
  Ctrl-C (even in the middle of a submission) cancels every job it submitted, waits until they
  have ended (locally: every process they started) and re-raises.
* :func:`map_jobs` maps a function over many items (the per-rank analysis of a job's traces):
  a process pool here, or submitit jobs (on SLURM one array), each worker's address space bounded
  by ``mem_gb``; outcomes come back in item order, failures included, for the caller to reduce.
* :class:`Forked` runs one function in a child forked from this process beside it (one rank's
  page analyses beside its summary, when a lone file leaves a core free).
* What a job runs under (its time limit, cancels, preemption) is :mod:`.guard`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import math
import os
import pickle
import resource
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..core.config import ConfigError, check_choice, check_int
from . import slurm
from .cluster import DEFAULT_TIMEOUT_MIN, EXECUTORS, ClusterOptions, resolve_site
from .guard import CANCEL_FILE, SLURM_PYTHON, JobBody, ProcessTree, grace_s

MAP_EXECUTORS = ("pool", *EXECUTORS)
POLL_S = 0.5  # result files and local processes
SLURM_POLL_S = 2.0  # squeue, once for all jobs
RESULT_WAIT_S = 5.0  # a job that has ended: how long its result file may lag on a shared filesystem
CANCEL_WAIT_S = 20.0


def _submitit_logs_off_stdout() -> None:
    """submitit logs to stdout and stderr; on the submitting side only stderr (stdout may be JSON)."""
    log = logging.getLogger("submitit")
    for h in list(log.handlers):
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            log.removeHandler(h)


def make_executor(
    opts: ClusterOptions, folder: Path, *, name: str, gpus: int = 0, nodes: int = 1, cpus: int | None = None, visible=()
):
    """A submitit executor for one job: ``gpus`` per node (local: the devices ``visible``),
    ``nodes`` nodes with one task each (local: one task per node, all on this machine)."""
    import submitit  # noqa: PLC0415 - only runs that submit jobs need it

    _submitit_logs_off_stdout()
    grace = int(grace_s(opts.timeout_min))
    if opts.executor == "local":  # several "nodes" on this machine are several tasks of one job
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(
            timeout_min=opts.timeout_min, gpus_per_node=gpus, tasks_per_node=nodes, visible_gpus=tuple(visible),
            signal_delay_s=grace,
        )  # fmt: skip
        return ex
    ex = submitit.SlurmExecutor(folder=folder, python=SLURM_PYTHON)
    params = dict(
        job_name=name,
        partition=opts.partition,
        account=opts.account,
        time=int(math.ceil(opts.timeout_min)),
        nodes=nodes,
        ntasks_per_node=1,
        cpus_per_task=cpus,
        gpus_per_node=gpus or None,  # no GPU asked: no --gpus-per-node line at all
        mem=None if opts.mem_gb is None else _mem(opts.mem_gb),
        signal_delay_s=grace,
        wckey=None,  # submitit's default "submitit" is a wckey some sites refuse
    )
    ex.update_parameters(**params)
    return ex


def _mem(gb: float) -> str:
    return f"{int(gb)}GB" if gb == int(gb) else f"{int(gb * 1024)}MB"


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
    nodes: str = ""  # SLURM: the nodes it ran on
    restarts: int = 0  # SLURM: times it was requeued (preemption)
    resources: str = ""  # what it asked for ("1 GPU, 8 CPUs")

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
    cpus: int | None = None  # SLURM CPUs (default: ClusterOptions.cpus_for)


@dataclass
class _Running:
    task: Task
    job: Any
    ids: tuple[int, ...]
    t0: float
    folder: Path
    resources: str = ""
    ended_at: float | None = None  # when the job was first seen ended without its results
    state: slurm.JobState | None = None


def _job_log(job, limit: int = 6000) -> str:
    parts = []
    for what, get in (("stderr", job.stderr), ("stdout", job.stdout)):
        with contextlib.suppress(Exception):
            text = get() or ""
            if text.strip():
                parts.append(f"--- job {what} ---\n{text[-limit:]}")
    return "\n".join(parts)


def _results(job) -> list[tuple[str, Any]] | None:
    """Every task's (outcome, value) from its result file; None while one is missing."""
    from submitit.core.utils import pickle_load  # noqa: PLC0415 - submitit is imported once jobs run

    tasks = list(getattr(job, "_sub_jobs", None) or []) or [job]
    with contextlib.suppress(OSError):  # refresh a shared filesystem's view of the folder
        p = job.paths.folder
        p.chmod(p.stat().st_mode)
    out = []
    for t in tasks:
        path = t.paths.result_pickle
        if not path.exists():
            return out if out and out[0][0] == "error" else None  # task 0 failed: the others need not be waited on
        try:
            out.append(pickle_load(path))
        except (EOFError, OSError, ValueError):
            return None  # still being written
    return out


def _error_state(error: str) -> str:
    if "JobEnded: timed out" in error or "not requeued because: timed-out" in error:
        return "timed out"
    return "cancelled" if "JobEnded: cancelled" in error else "failed"


def _finish(r: _Running, opts: ClusterOptions, res: list | None) -> Outcome:
    """The outcome of an ended job: from its results, else from what the scheduler says."""
    base = dict(
        job_id=str(r.job.job_id), devices=r.ids, seconds=time.monotonic() - r.t0, log=_job_log(r.job),
        resources=r.resources, nodes=r.state.nodes if r.state else "", restarts=r.state.restarts if r.state else 0,
    )  # fmt: skip
    if res:
        errors = [v for kind, v in res if kind == "error"]
        if errors:
            return Outcome(r.task.key, _error_state(errors[0]), error=str(errors[0]).strip(), **base)
        return Outcome(r.task.key, "ok", value=res[0][1], **base)
    if r.state is not None:  # SLURM: the state it gives
        why = slurm.describe(r.state, opts.timeout_min)
        return Outcome(r.task.key, slurm.outcome_state(r.state), error=why, **base)
    return Outcome(r.task.key, "failed", error="the job's process ended without a result (its log below)", **base)


def _ended(r: _Running) -> bool:
    proc = getattr(r.job, "_process", None)
    if proc is not None:
        return proc.poll() is not None
    return r.state is not None and r.state.terminal


@contextlib.contextmanager
def _interrupt_after():
    """Ctrl-C during a submission takes effect once the job is registered (so that it is cancelled).
    The handler it held back is called then; where that handler was not Python's (the default
    action, or one a library installed in C, which ``signal.signal`` returns as None) the run stops
    with KeyboardInterrupt: a Ctrl-C always stops a run, unless SIGINT was ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hit: list[int] = []
    old = signal.signal(signal.SIGINT, lambda s, _f: hit.append(s))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old if old is not None else signal.default_int_handler)
        if hit and callable(old):
            old(signal.SIGINT, None)
        elif hit and old != signal.SIG_IGN:
            raise KeyboardInterrupt


def _wait(seconds: float) -> None:
    """Between polls of the running jobs (a test replaces it to interrupt a run mid-way)."""
    time.sleep(seconds)


def _proc(r: _Running):
    return getattr(r.job, "_process", None)  # a local job's controller process (SLURM: None)


def cancel_all(running: Sequence[_Running], opts: ClusterOptions, wait_s: float = CANCEL_WAIT_S) -> None:
    """Cancel every job and wait until it has ended.  Locally the job's controller gets SIGTERM
    (forwarded to its tasks, whose guard ends what they started) and, after ``wait_s``, every
    process of the job still alive is killed; on SLURM ``scancel``, then ``squeue`` until it has left."""
    tree = ProcessTree()
    for r in running:
        with contextlib.suppress(OSError):
            (r.folder / CANCEL_FILE).touch()  # a job still starting stops when it reaches its guard
        if _proc(r) is not None:
            tree.add(_proc(r).pid)
            with contextlib.suppress(ProcessLookupError):
                _proc(r).send_signal(signal.SIGTERM)
        else:
            with contextlib.suppress(Exception):
                r.job.cancel(check=False)
    deadline = time.monotonic() + wait_s
    watch = slurm.Watch(opts.site.accounting if opts.site else False)
    left = list(running)
    while left and time.monotonic() < deadline:
        for r in left:
            if _proc(r) is not None:
                tree.add(_proc(r).pid)
        states = watch.poll([str(r.job.job_id) for r in left if _proc(r) is None])
        gone = slurm.JobState("", slurm.GONE)
        left = [
            r
            for r in left
            if (_proc(r).poll() is None if _proc(r) is not None else not states.get(str(r.job.job_id), gone).terminal)
        ]
        if left:
            time.sleep(0.2)
    tree.kill_survivors()  # what outlived its job (a kernel in its own session) or did not end in time
    for r in running:
        if _proc(r) is not None:
            with contextlib.suppress(Exception):
                _proc(r).wait(timeout=5)


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


def _resources(gpus: int, cpus: int | None, nodes: int) -> str:
    parts = [f"{gpus} GPU{'s' if gpus != 1 else ''}"] if gpus else []
    parts += [f"{cpus} CPU{'s' if cpus != 1 else ''}"] if cpus else []
    text = ", ".join(parts)
    return f"{nodes} nodes x {text}" if nodes > 1 and text else text


def _submit(
    batch: list[Task], opts: ClusterOptions, folder: Path, ids: tuple[int, ...], array: int, name: str
) -> list[_Running]:
    """Submit one task (``ids``: its local devices), or ``batch`` as one sbatch array (``array``: how
    many of it run at once; its job name ``name``); raises when the submission is refused."""
    t = batch[0]
    gpus = t.gpus if t.gpus is not None else t.devices
    cpus = t.cpus if t.cpus is not None else opts.cpus_for(gpus) if opts.executor == "slurm" else None
    sub = folder / ("array" if array else t.key)
    ex = make_executor(opts, sub, name=name if array else t.key, gpus=gpus, nodes=t.nodes, cpus=cpus, visible=ids)
    body = JobBody(opts.timeout_min, opts.executor)
    res = _resources(gpus, cpus, t.nodes) if opts.executor == "slurm" else ""
    if not array:
        return [_Running(t, ex.submit(body, t.fn, *t.args), ids, time.monotonic(), sub, res)]
    ex.update_parameters(array_parallelism=array)
    with ex.batch():
        jobs = [ex.submit(body, a.fn, *a.args) for a in batch]
    return [_Running(a, j, (), time.monotonic(), sub, res) for a, j in zip(batch, jobs)]


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
    return _run(tasks, opts, folder, _How(max_running, tuple(devices), progress, desc, on_done, False))


def run_array(
    tasks: Sequence[Task], opts: ClusterOptions, folder: Path, *, max_running: int | None = None, **kw: Any
) -> dict[str, Outcome]:
    """:func:`run_tasks` for many alike tasks: on SLURM one job array, at most ``max_running`` of
    it running at once (``progress``, ``desc`` as there); locally the same as :func:`run_tasks`."""
    how = _How(max_running, (), kw.get("progress", True), kw.get("desc", "jobs"), None, True)
    return _run(tasks, opts, folder, how)


@dataclass(frozen=True)
class _How:
    max_running: int | None
    devices: tuple[int, ...]
    progress: bool
    desc: str
    on_done: Callable[[Outcome], None] | None
    array: bool


def _run(tasks: Sequence[Task], opts: ClusterOptions, folder: Path, how: _How) -> dict[str, Outcome]:
    max_running, devices, progress, desc, on_done, array = (
        how.max_running, how.devices, how.progress, how.desc, how.on_done, how.array
    )  # fmt: skip
    if opts.executor == "slurm" and opts.site is None:
        opts = resolve_site(opts)
    if opts.timeout_min is None:
        opts = replace(opts, timeout_min=DEFAULT_TIMEOUT_MIN)
    pending, running, done = list(tasks), {}, {}
    slots = _Slots(devices)
    local = opts.executor == "local"
    cap = max_running if local and max_running else len(tasks)
    watch = slurm.Watch(opts.site.accounting if opts.site else False)
    bar = tqdm(total=len(tasks), desc=desc, unit="job", disable=not progress, file=sys.stderr)
    shown, polled = "", 0.0

    def finish(out: Outcome) -> None:
        done[out.key] = out
        bar.update(1)
        if on_done is not None:
            on_done(out)

    try:
        while pending or running:
            while pending and len(running) < cap:
                ids = slots.take(pending[0].devices) if local else ()
                if ids is None:
                    break  # waits for its devices (in order: a big task is not starved)
                batch = pending[:] if (array and not local) else pending[:1]
                with _interrupt_after():  # registered before a Ctrl-C can stop us: so it is cancelled
                    del pending[: len(batch)]
                    try:
                        at_once = min(len(batch), max_running or len(batch)) if array and not local else 0
                        subs = _submit(batch, opts, folder, ids, at_once, f"perflab-{desc}".replace(" ", "-"))
                        running.update({r.task.key: r for r in subs})
                    except Exception as e:  # noqa: BLE001 - sbatch refused it: its outcome, the others go on
                        slots.give(ids)
                        for t in batch:
                            finish(Outcome(t.key, "failed", error=f"the job was not submitted: {str(e).strip()}"))
            if not local and time.monotonic() - polled >= SLURM_POLL_S:
                polled = time.monotonic()
                states = watch.poll([str(r.job.job_id) for r in running.values()])
                for r in running.values():
                    r.state = states.get(str(r.job.job_id), r.state)
            for key, r in list(running.items()):
                if r.state is not None and r.state.never_starts:  # would pend for ever: its row says why
                    with contextlib.suppress(Exception):
                        r.job.cancel(check=False)
                    del running[key]
                    slots.give(r.ids)
                    finish(_finish(r, opts, None))
                    continue
                res = _results(r.job)
                if (res is None or local) and not _ended(r):
                    continue  # locally the job's processes have exited before it counts as ended
                if res is None:  # ended without (yet) a result: the file may lag on a shared filesystem
                    r.ended_at = r.ended_at or time.monotonic()
                    if time.monotonic() - r.ended_at < (RESULT_WAIT_S if not local else 2.0):
                        continue
                if res and len(res) < len(getattr(r.job, "_sub_jobs", None) or [r.job]) and not _ended(r):
                    with contextlib.suppress(Exception):
                        r.job.cancel(check=False)  # task 0 failed first: end the job's other tasks
                del running[key]
                slots.give(r.ids)
                if res and not local and not array:  # how often SLURM requeued it, had a poll missed that
                    r.state = watch.settle(str(r.job.job_id), r.state)
                finish(_finish(r, opts, res))
            if shown != ", ".join(running):
                shown = ", ".join(running)
                bar.set_postfix_str(shown)
            if pending or running:
                _wait(POLL_S)
    except BaseException:  # Ctrl-C, or an error here: nothing submitted is left running
        cancel_all(list(running.values()), opts)
        raise
    finally:
        bar.close()
    return done


# ------------------------------------------------------------------------- map over items
def _mapped_bytes() -> int:
    """The address space this process already maps (Linux ``VmSize``; 0 where it cannot be read)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _limit_memory(mem_gb: float | None) -> None:
    """A worker may map ``mem_gb`` more than it maps when it starts (MemoryError beyond it).  The
    bound is on growth, not on the total: a pool worker forked from a process that has loaded torch
    (a notebook's kernel, a test session) starts with gigabytes of address space it never touches,
    and a bound below that would fail its first allocation."""
    if mem_gb:
        limit = _mapped_bytes() + int(mem_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _bounded_call(fn: Callable, item: Any, mem_gb: float | None) -> Any:
    """``fn(item)`` in a job, its address space allowed to grow by ``mem_gb`` (MemoryError beyond it)."""
    _limit_memory(mem_gb)
    return fn(item)


class Forked:
    """``fn()`` in a child forked from this process while this one goes on: the child sees this
    process's tables as they are (copy-on-write, nothing pickled on the way in) and sends its value
    back pickled through a pipe.  :meth:`result` waits for it; whatever went wrong in the child (an
    exception, a value that does not pickle, a child killed) is raised there as ``ChildFailed``
    with the reason, for the caller to do the work itself.  Fork only from a process without other
    threads at work (a pool worker, not a notebook kernel or the CLI's parent)."""

    def __init__(self, fn: Callable[[], Any]):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its value, or why not, then out without any exit handler of the parent's
            os.close(read)
            try:
                try:
                    data = pickle.dumps((True, fn()), protocol=pickle.HIGHEST_PROTOCOL)
                except BaseException as e:  # noqa: BLE001 - any failure is reported to the parent
                    data = pickle.dumps((False, f"{type(e).__name__}: {e}"))
                with os.fdopen(write, "wb") as fh:
                    fh.write(data)
            finally:
                os._exit(0)
        os.close(write)
        self.pid, self._fd = pid, read

    def result(self) -> Any:
        with os.fdopen(self._fd, "rb") as fh:
            data = fh.read()
        _, status = os.waitpid(self.pid, 0)
        if not data:
            raise ChildFailed(f"the forked child ended without a result (wait status {status})")
        try:
            ok, value = pickle.loads(data)
        except (pickle.UnpicklingError, EOFError, ValueError) as e:  # the child died while writing
            raise ChildFailed(f"the forked child's result is cut short ({e})") from None
        if not ok:
            raise ChildFailed(value)
        return value


class ChildFailed(RuntimeError):
    """A :class:`Forked` child's work did not come back (the message says why)."""


@dataclass
class MapOptions:
    """How :func:`map_jobs` runs: ``executor`` "pool" (processes here), "local" or "slurm"
    (submitit jobs), ``workers`` at once, ``mem_gb`` per worker."""

    executor: str = "pool"
    workers: int = 2
    mem_gb: float | None = 4.0
    cluster: ClusterOptions = field(default_factory=ClusterOptions)


def map_jobs(
    fn: Callable,
    items: Sequence,
    opts: MapOptions,
    folder: Path,
    *,
    progress: bool = True,
    desc: str = "map",
    meanwhile: Callable[[], object] | None = None,
) -> list[Outcome]:
    """``fn(item)`` for every item on ``opts.executor``; outcomes in item order (key = index).
    ``fn`` must be importable (a module-level function); ``folder`` holds the submitit jobs'
    files (on SLURM it must be on a filesystem the nodes share) and is removed at the end.
    SLURM jobs are one array, 1 CPU each unless the cluster options say otherwise.  Ctrl-C
    cancels everything and re-raises.  ``meanwhile()`` is called here once, while the pool's
    workers run (they are forked before it: what it imports is not theirs to load); with the
    submitit executors, before the jobs are submitted."""
    check_choice("executor", opts.executor, MAP_EXECUTORS)
    check_int("workers", opts.workers, min=1)
    if opts.mem_gb is not None and not opts.mem_gb > 0:
        raise ConfigError("mem_gb", opts.mem_gb, "a number of GB > 0, or None for no bound")
    if opts.executor == "pool":
        return _map_pool(fn, items, opts, progress, desc, meanwhile)
    if meanwhile is not None:
        meanwhile()
    cluster = replace(opts.cluster, executor=opts.executor)
    if opts.mem_gb is not None and cluster.mem_gb is None:
        cluster = replace(cluster, mem_gb=float(opts.mem_gb))
    if cluster.executor == "slurm" and cluster.site is None:
        cluster = resolve_site(cluster, gpus=0, nodes=1)
    cpus = cluster.cpus_per_task or 1
    tasks = [Task(str(i), _bounded_call, (fn, it, opts.mem_gb), gpus=0, cpus=cpus) for i, it in enumerate(items)]
    try:
        done = run_array(tasks, cluster, Path(folder), max_running=opts.workers, progress=progress, desc=desc)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return [done[str(i)] for i in range(len(items))]


def _map_pool(
    fn: Callable, items: Sequence, opts: MapOptions, progress: bool, desc: str, meanwhile: Callable | None = None
) -> list[Outcome]:
    outs: list[Outcome | None] = [None] * len(items)
    with cf.ProcessPoolExecutor(opts.workers, initializer=_limit_memory, initargs=(opts.mem_gb,)) as pool:
        futs = {pool.submit(fn, it): i for i, it in enumerate(items)}
        try:
            if meanwhile is not None:
                meanwhile()
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
