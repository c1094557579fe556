"""Launch statistics and the "host-bound" / "launch-bound" verdicts.

Per activity with a launch in the trace:

* ``queue_delay`` = GPU start - launch call start (us): how long the work waited after the host
  issued it (queued behind earlier work, or the launch latency when the queue was empty);
* ``queue_length`` at its launch: activities on the same stream launched before it and not yet
  finished (``#launched <= t - #finished <= t``);
* short: ``dur < short_us`` (default 10 us, where a launch's ~5-10 us host cost is of the order
  of the kernel itself);
* the **launch cost**: the median host time of the launch calls (``cudaLaunchKernel`` & co, as
  the trace records them).

Verdicts (:func:`launch_stats`), over the selection:

* **host-bound** (the GPU waits for the host) when idle is at least ``idle_min`` (20 %) of the
  span, the host-wait part of idle (:func:`lab_utils.traces.breakdown.idle_split`) is at least
  ``host_wait_min`` (50 %) of idle, and the median queue length at launch is at most
  ``queue_max`` (1): nothing is kept queued, the GPU waits for each piece of work;
* **launch-bound** when it is host-bound *and* what it waits for is launches: the launched
  kernels are short against the launch cost (median duration at most ``kernel_launches`` = 4
  launch costs: eager PyTorch spends a few launches' worth of host time per kernel on dispatch
  and Python, so a host doing nothing else cannot stay ahead of shorter kernels), and at least
  ``launch_gap_share`` (50 %) of the host wait is in gaps shorter than ``gap_launches`` = 100
  launch costs (the host was issuing one op after another).  A GPU that waits in long stalls
  (a data loader, a sync, Python work between steps) or between kernels far longer than a launch
  is host-bound but not launch-bound: CUDA graphs or fewer launches would not help it.

The reason says which test failed, with its figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from lab_utils.traces.breakdown import idle_gaps, temporal

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
    launch_us: float  # median host time of a launch call
    kernel_median_us: float  # median duration of the launched activities
    launch_gap_share: float  # share of the host wait in gaps shorter than gap_launches launches
    longest_host_wait_us: float
    host_bound: bool
    launch_bound: bool
    reason: str


def launch_stats(
    k: pd.DataFrame,
    *,
    short_us: float = SHORT_US,
    idle_min: float = 0.20,
    host_wait_min: float = 0.50,
    queue_max: float = 1.0,
    kernel_launches: float = 4.0,
    gap_launches: float = 100.0,
    launch_gap_share: float = 0.50,
) -> LaunchStats:
    """Launch statistics of a selection and the two verdicts (see the module note)."""
    launched = k[k["launch_ts"].notna()]
    q = queue_lengths(k)
    q = q[~np.isnan(q)]
    delay = (launched["ts"] - launched["launch_ts"]).to_numpy()
    t = temporal(k)
    gap_a, gap_b, host = idle_gaps(k)
    idle = float(np.sum(gap_b - gap_a))
    idle_share = t["idle"] / t["span"] if t["span"] > 0 else 0.0
    host_share = float(host.sum()) / idle if idle > 0 else 0.0
    q_med = float(np.median(q)) if len(q) else float("nan")
    cost = launched["launch_dur"].to_numpy(dtype=np.float64) if "launch_dur" in launched else np.zeros(0)
    cost = cost[np.isfinite(cost)]
    launch_us = float(np.median(cost)) if len(cost) else float("nan")
    kernel_us = float(np.median(launched["dur"])) if len(launched) else float("nan")
    short_gaps = float(host[(gap_b - gap_a) < gap_launches * launch_us].sum()) if np.isfinite(launch_us) else 0.0
    gap_share = short_gaps / float(host.sum()) if host.sum() > 0 else 0.0
    fails = []
    if idle_share < idle_min:
        fails.append(f"idle {100 * idle_share:.0f}% of the span < {100 * idle_min:.0f}%")
    if host_share < host_wait_min:
        fails.append(f"host wait {100 * host_share:.0f}% of idle < {100 * host_wait_min:.0f}%")
    if not (q_med <= queue_max):
        fails.append(f"median queue {q_med:g} > {queue_max:g}")
    host_bound = not fails
    waits = (f"idle {100 * idle_share:.0f}% of the span, {100 * host_share:.0f}% of it waiting for the host, "
             f"median queue {q_med:g}")  # fmt: skip
    why_not = []
    if host_bound:
        if not (kernel_us <= kernel_launches * launch_us):
            why_not.append(f"its kernels are long: median {kernel_us:.3g} us against a {launch_us:.3g} us launch "
                           f"(over {kernel_launches:g} launches)")  # fmt: skip
        if gap_share < launch_gap_share:
            why_not.append(f"{100 * (1 - gap_share):.0f}% of the host wait is in stalls longer than {gap_launches:g} "
                           f"launches (the longest {float(host.max()) / 1e3:.3g} ms): data loading, a sync or host "
                           "work, not launches")  # fmt: skip
    bound = host_bound and not why_not
    if bound:
        reason = (f"launch-bound: {waits}; kernels median {kernel_us:.3g} us against a {launch_us:.3g} us launch, "
                  f"{100 * gap_share:.0f}% of the wait between launches: the GPU waits for launches")  # fmt: skip
    elif host_bound:
        reason = f"host-bound, not launch-bound: {waits}, but " + "; and ".join(why_not)
    else:
        reason = "not launch-bound: " + "; ".join(fails)
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
        launch_us=launch_us,
        kernel_median_us=kernel_us,
        launch_gap_share=gap_share,
        longest_host_wait_us=float(host.max()) if len(host) else 0.0,
        host_bound=host_bound,
        launch_bound=bound,
        reason=reason,
    )
