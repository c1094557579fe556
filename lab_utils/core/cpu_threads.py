"""The intra-op thread count CPU timing uses, chosen from the cores that are free.

On a machine whose cores are busy with other processes, a parallel region with one thread
per core waits for whichever thread the scheduler took away: a 0.4 ms op then reads as a
32 ms scheduler quantum.  :func:`choose_cpu_threads` leaves the busy cores alone (or takes
the count from ``PERFLAB_TIMING_THREADS`` / an argument) and says why; ``lab_utils.core.timing``
times with it (``cpu_threads(n)`` sets it there) and records the choice.  No torch here: a run's
context records the choice without it.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

THREADS_ENV = "PERFLAB_TIMING_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op thread count used for CPU timing, and why."""

    threads: int
    policy: str  # "auto" | "PERFLAB_TIMING_THREADS" | "argument"
    cores: int  # cores this process may run on (affinity)
    busy: float  # runnable tasks of other processes when probed
    reason: str

    def as_dict(self) -> dict:
        return dict(threads=self.threads, policy=self.policy, cores=self.cores, busy=self.busy, reason=self.reason)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _procs_running() -> int | None:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _own_running() -> int:
    """Threads of this process in the running state (they count in procs_running too)."""
    n = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] == "R":
                n += 1
    except OSError:
        return 1
    return max(n, 1)


def busy_cores(probes: int = 8, interval_s: float = 0.002) -> float | None:
    """How many cores other processes keep busy right now: the mean, over a few quick
    probes, of runnable tasks (``/proc/stat`` procs_running) not belonging to this process.
    ``None`` where ``/proc`` does not tell (then the 1-minute load average is used)."""
    vals = []
    for i in range(probes):
        total = _procs_running()
        if total is None:
            break
        vals.append(max(0, total - _own_running()))
        if i + 1 < probes:
            time.sleep(interval_s)
    if vals:
        return sum(vals) / len(vals)
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def choose_cpu_threads(requested: int | str | None = None) -> ThreadChoice:
    """The thread count for CPU timing: ``requested`` (an argument), else the environment
    variable ``PERFLAB_TIMING_THREADS`` (``perflab run --timing-threads``), else "auto":
    the cores this process may use minus those other processes keep busy, at least one.
    Leaving the busy cores alone keeps a parallel region from waiting on a thread the
    scheduler has descheduled for a whole quantum."""
    cores = usable_cores()
    policy = "argument"
    if requested is None:
        requested = os.environ.get(THREADS_ENV) or "auto"
        policy = THREADS_ENV if requested != "auto" else "auto"
    if requested != "auto":
        try:
            n = int(requested)
        except (TypeError, ValueError):
            n = 0
        if n < 1 or str(requested).strip() != str(n):
            raise ValueError(
                f"parameter 'timing_threads' = {requested!r} is not allowed: expected 'auto' or an integer >= 1"
            )
        share = os.environ.get("PERFLAB_THREAD_SHARE")  # perflab run --parallel: labs share the budget
        why = f"{n} thread(s), set by {policy} ({cores} usable cores)" + (f"; {share}" if share else "")
        return ThreadChoice(n, policy, cores, math.nan, why)
    busy = busy_cores()
    if busy is None:
        return ThreadChoice(cores, "auto", cores, math.nan, f"{cores} thread(s): all usable cores (load unknown)")
    free = max(1, min(cores, cores - int(math.floor(busy + 0.5))))
    return ThreadChoice(
        free,
        "auto",
        cores,
        round(busy, 2),
        f"{free} thread(s): {cores} usable core(s), {busy:.1f} kept busy by other processes when probed",
    )
