"""Launch statistics and the "launch-bound" verdict.

Per activity with a launch in the trace:

* ``queue_delay`` = GPU start - launch call start (us): how long the work waited after the host
  issued it (queued behind earlier work, or the launch latency when the queue was empty);
* ``queue_length`` at its launch: activities on the same stream launched before it and not yet
  finished (``#launched <= t - #finished <= t``);
* short: ``dur < short_us`` (default 10 us, where a launch's ~5-10 us host cost is of the order
  of the kernel itself).

Verdict (:func:`launch_bound`): the GPU is **launch-bound** when all three hold over the
selection: idle is at least ``idle_min`` (20 %) of the span, the host-wait part of idle
(:func:`lab_utils.traces.breakdown.idle_split`) is at least ``host_wait_min`` (50 %) of idle, and
the median queue length at launch is at most ``queue_max`` (1): the host is not keeping work
queued, so the GPU waits for it.  Otherwise it is not, and the reason says which test failed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from lab_utils.traces.breakdown import idle_split, temporal

SHORT_US = 10.0


def queue_lengths(k: pd.DataFrame) -> np.ndarray:
    """Queue length on the activity's stream at each activity's launch (NaN without a launch)."""
    out = np.full(len(k), np.nan)
    launch = k["launch_ts"].to_numpy(dtype=np.float64)
    streams = k["stream"].to_numpy()
    ends = k["end"].to_numpy()
    for s in np.unique(streams):
        idx = np.flatnonzero((streams == s) & ~np.isnan(launch))
        if not len(idx):
            continue
        lt = np.sort(launch[idx])
        et = np.sort(ends[idx])
        t = launch[idx]
        out[idx] = np.searchsorted(lt, t, side="left") - np.searchsorted(et, t, side="right")
    return np.clip(out, 0, None)


@dataclass
class LaunchStats:
    activities: int
    launched: int
    short_share: float  # share of launched activities shorter than short_us
    queue_delay_median_us: float
    queue_delay_p90_us: float
    queue_length_median: float
    queue_length_max: float
    idle_share: float
    host_wait_share_of_idle: float
    launch_bound: bool
    reason: str


def launch_stats(
    k: pd.DataFrame,
    *,
    short_us: float = SHORT_US,
    idle_min: float = 0.20,
    host_wait_min: float = 0.50,
    queue_max: float = 1.0,
) -> LaunchStats:
    """Launch statistics of a selection and the launch-bound verdict (see the module note)."""
    launched = k[k["launch_ts"].notna()]
    q = queue_lengths(k)
    q = q[~np.isnan(q)]
    delay = (launched["ts"] - launched["launch_ts"]).to_numpy()
    t = temporal(k)
    split = idle_split(k)
    idle_share = t["idle"] / t["span"] if t["span"] > 0 else 0.0
    host_share = split["host_wait"] / split["idle"] if split["idle"] > 0 else 0.0
    q_med = float(np.median(q)) if len(q) else float("nan")
    fails = []
    if idle_share < idle_min:
        fails.append(f"idle {100 * idle_share:.0f}% of the span < {100 * idle_min:.0f}%")
    if host_share < host_wait_min:
        fails.append(f"host wait {100 * host_share:.0f}% of idle < {100 * host_wait_min:.0f}%")
    if not (q_med <= queue_max):
        fails.append(f"median queue {q_med:g} > {queue_max:g}")
    bound = not fails
    reason = (
        f"idle {100 * idle_share:.0f}% of the span, {100 * host_share:.0f}% of it waiting for the host, "
        f"median queue {q_med:g}: the GPU waits for launches"
        if bound
        else "not launch-bound: " + "; ".join(fails)
    )
    return LaunchStats(
        activities=len(k),
        launched=len(launched),
        short_share=float((launched["dur"] < short_us).mean()) if len(launched) else float("nan"),
        queue_delay_median_us=float(np.median(delay)) if len(delay) else float("nan"),
        queue_delay_p90_us=float(np.percentile(delay, 90)) if len(delay) else float("nan"),
        queue_length_median=q_med,
        queue_length_max=float(q.max()) if len(q) else float("nan"),
        idle_share=idle_share,
        host_wait_share_of_idle=host_share,
        launch_bound=bound,
        reason=reason,
    )
