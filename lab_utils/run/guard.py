"""What a job runs under, on this machine or a SLURM node: its time limit, cancels and preemption.

Every job :func:`lab_utils.run.executors.run_tasks` submits is ``JobBody(timeout_min, executor)(fn, *args)``:

* **time limit**: the job stops itself at ``timeout_min`` minus :func:`grace_s` (10 % of the limit,
  at least 10 s, at most 60 s) from its own clock, ends every process it started and reports
  "timed out".  SLURM's warning (``--signal=USR2@grace``) may come up to 30 s early (slurmctld checks
  limits every 30 s); the job keeps running until its own deadline instead of losing that time.
  The job's interpreter starts with SIGUSR2 ignored (``SLURM_PYTHON``), so a warning sent before
  any handler exists cannot kill it; the job then blocks it (a thread takes it), so that the
  processes it starts inherit it blocked: SLURM signals every process of the step, and a notebook's
  kernel or a torchrun rank would die of it.
* **cancel** (SIGINT, SIGTERM: ``scancel``, Ctrl-C on the submitting side): every process the job
  started ends (a notebook's kernel lives in its own session and would otherwise outlive it).
  Under SLURM the job then exits without a result, so the state SLURM gives (CANCELLED, TIMEOUT, or
  PENDING again after a preemption that requeues it) is the job's outcome; on this machine it
  reports "cancelled".  A cancel that came before the handlers were set (the submitting side
  also leaves :data:`CANCEL_FILE` in the job's folder) ends the job as soon as it reaches them.
* **preemption notice** (SIGUSR2 long before the deadline, on sites with
  ``PreemptParameters=send_user_signal``): the job ends what it started and hands the signal to
  submitit's own handler, which checkpoints (:meth:`JobBody.checkpoint`: the same call again)
  and requeues it.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

CANCEL_FILE = "perflab-cancel"
GRACE_MIN_S, GRACE_MAX_S, GRACE_SHARE = 10.0, 60.0, 0.1
EARLY_S = 45.0  # how early SLURM's time-limit warning can come (its 30 s check period, and some slack)
#: the interpreter command SLURM jobs start: SIGUSR2 ignored until the job sets its handler
SLURM_PYTHON = f'sh -c \'trap "" USR2; exec "$0" "$@"\' {shlex.quote(sys.executable)}'


class JobStopped(KeyboardInterrupt):
    """Raised inside a job by the signal that cancels it or ends its time (a KeyboardInterrupt, so
    that no ``except Exception`` on the way swallows it); :func:`job_guard` turns it into the job's end."""

    def __init__(self, reason: str, final: bool):
        super().__init__(reason)
        self.final = final  # the job reports it (else it exits and the scheduler's state says)


class JobEnded(RuntimeError):
    """A job cancelled or out of time: "cancelled: signal SIGTERM", "timed out: ..."."""


def grace_s(timeout_min: float) -> float:
    """Seconds of a job's time limit kept for ending it cleanly (see the module note)."""
    limit = 60.0 * timeout_min
    return min(max(GRACE_MIN_S, GRACE_SHARE * limit), GRACE_MAX_S, limit / 2)


def process_age_s() -> float:
    """Seconds since this process started (``/proc``), 0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


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


def _start_time(pid: int) -> int | None:
    """A live process's start time (clock ticks since boot; None when gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return None if rest[0] == "Z" else int(rest[19])
    except (OSError, ValueError, IndexError):
        return None


class ProcessTree:
    """Every process seen under some roots (pid and start time), so that the survivors can be
    killed even once their parents are gone (an orphan is no longer anyone's descendant)."""

    def __init__(self):
        self.seen: dict[int, int] = {}

    def add(self, root: int) -> None:
        for pid in [root, *_children_of(root)]:
            if pid not in self.seen:
                start = _start_time(pid)
                if start is not None:
                    self.seen[pid] = start

    def alive(self) -> list[int]:
        return [pid for pid, start in self.seen.items() if _start_time(pid) == start]

    def kill_survivors(self) -> list[int]:
        pids = self.alive()
        kill_tree(pids)
        return pids


def kill_tree(pids: list[int]) -> None:
    """SIGKILL ``pids`` and the process groups they lead."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def end_children() -> list[int]:
    """SIGKILL every process this one started (and their process groups); their pids."""
    kids = _children_of(os.getpid())
    kill_tree(kids)
    return kids


def _usr2_to_main() -> None:
    """SIGUSR2 is blocked in the job (so that the processes it starts inherit it blocked: SLURM
    signals every process of a job step, and a notebook's kernel would die of it); this thread
    takes it and hands it to the main thread's handler."""
    while True:
        signal.sigwait({signal.SIGUSR2})
        _thread.interrupt_main(signal.SIGUSR2)


_USR2_THREAD: list[threading.Thread] = []


def _cancel_marker() -> Path | None:
    folder = os.environ.get("SUBMITIT_FOLDER")
    return Path(folder) / CANCEL_FILE if folder else None


@contextlib.contextmanager
def job_guard(
    deadline_s: float | None = None, *, scheduler: bool = False, limit: str = "", age_s: float = 0.0
) -> Iterator[None]:
    """Run a job's body under its time limit, cancels and preemption (see the module note).
    ``deadline_s``: seconds from now until the job stops itself (``limit``: the limit in words);
    ``scheduler``: a SLURM job (a cancel leaves the outcome to SLURM's state); ``age_s``: how long
    the job's process had run before (for the message)."""
    start = time.monotonic()
    deadline = None if deadline_s is None else start + deadline_s
    previous: dict[int, Any] = {}
    names = {signal.SIGINT: "cancelled", signal.SIGTERM: "cancelled"}

    def stop(reason: str, final: bool):
        end_children()
        raise JobStopped(reason, final)

    def on_cancel(signum, _frame):
        stop(f"cancelled: signal {signal.Signals(signum).name}", final=not scheduler)

    def on_deadline(_signum, _frame):
        ran = time.monotonic() - start + age_s
        stop(f"timed out: {limit or 'its deadline'} (the job stopped itself after running {ran:.0f} s)", final=True)

    def on_usr2(signum, frame):
        now = time.monotonic()
        if deadline is not None and now >= deadline - EARLY_S:  # the time-limit warning
            if now >= deadline - 1:
                on_deadline(signum, frame)
            return  # early: the job's own deadline stops it
        end_children()  # a preemption notice: submitit's handler checkpoints and requeues
        handler = previous.get(signum)
        if callable(handler):
            handler(signum, frame)
        else:
            raise JobStopped("cancelled: preempted (signal SIGUSR2)", final=not scheduler)

    for s in names:
        previous[s] = signal.signal(s, on_cancel)
    previous[signal.SIGUSR2] = signal.signal(signal.SIGUSR2, on_usr2)
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, on_deadline)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    if not _USR2_THREAD:
        _USR2_THREAD.append(threading.Thread(target=_usr2_to_main, name="perflab-sigusr2", daemon=True))
        _USR2_THREAD[0].start()
    try:
        marker = _cancel_marker()
        if marker is not None and marker.exists():
            raise JobStopped("cancelled: the run cancelled it while it was starting", final=True)
        if deadline_s is not None:
            signal.setitimer(signal.ITIMER_REAL, max(deadline_s, 0.01))
        yield
    except JobStopped as e:  # an Exception, so that submitit writes it as the job's error
        if not e.final:
            raise SystemExit(128 + signal.SIGTERM) from None  # no result: SLURM's state is the outcome
        raise JobEnded(str(e)) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        end_children()
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class JobBody:
    """``fn(*args)`` under :func:`job_guard` with the job's deadline: what every submitted job runs.
    submitit requeues it after a preemption notice through :meth:`checkpoint` (the same call)."""

    def __init__(self, timeout_min: float, executor: str):
        self.timeout_min = timeout_min
        self.executor = executor

    def deadline_s(self) -> float:
        """Seconds left until the job stops itself: the limit less the grace, counted from the
        moment this job's process started."""
        return 60.0 * self.timeout_min - grace_s(self.timeout_min) - process_age_s()

    def __call__(self, fn: Callable, *args: Any) -> Any:
        limit = f"its {self.timeout_min:g}-minute time limit less {grace_s(self.timeout_min):.0f} s kept to end it"
        age = process_age_s()
        deadline = 60.0 * self.timeout_min - grace_s(self.timeout_min) - age
        with job_guard(deadline, scheduler=self.executor == "slurm", limit=limit, age_s=age):
            return fn(*args)

    def checkpoint(self, fn: Callable, *args: Any):
        from submitit.helpers import DelayedSubmission  # noqa: PLC0415 - only inside a job being requeued

        return DelayedSubmission(self, fn, *args)
