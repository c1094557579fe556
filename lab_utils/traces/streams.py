"""Per stream: idle time split into HTA's three kinds, and the launches that took too long.

**Idle per stream** (:func:`stream_idle`, HolisticTraceAnalysis 0.5's ``get_idle_time_breakdown``
rule, so the two agree on the test data): on each stream, activities in start order; the gap
before each one (its start minus the previous one's end) is

* ``host_wait`` when its launch call started after the previous activity had ended: nothing was
  queued, the stream waited for the host;
* else ``kernel_wait`` when the gap is shorter than ``kernel_wait_us`` (default 30 us): the usual
  cost of running kernels back to back, the overhead of many small kernels;
* else ``other``: queued work waiting on something else (an event from another stream, a
  collective's peer).

This is per stream; :func:`lab_utils.traces.breakdown.idle_split` splits the idle time of the
union of all streams.

**Launch outliers** (:func:`launch_outliers`, HTA's ``get_cuda_kernel_launch_stats``): per
activity launched by ``cudaLaunchKernel``, ``cudaLaunchKernelExC``, ``cudaMemcpyAsync`` or
``cudaMemsetAsync`` (and their ``hip`` twins), its launch call's duration (``cpu_us``), its own
(``gpu_us``) and the **launch delay** from the call's end to its start (``max(0, ...)``); outliers
are calls longer than ``runtime_cutoff_us`` (50), delays longer than ``delay_cutoff_us`` (100), and
activities shorter than their own launch call (the host cannot keep such a stream fed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

KINDS = ("host_wait", "kernel_wait", "other")
KERNEL_WAIT_US = 30.0
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaMemsetAsync", "hipLaunchKernel",
                "hipExtModuleLaunchKernel", "hipMemcpyAsync", "hipMemsetAsync")  # fmt: skip


def stream_idle(k: pd.DataFrame, kernel_wait_us: float = KERNEL_WAIT_US) -> pd.DataFrame:
    """Per stream: idle us of each kind, their sum and each kind's share (see the module note)."""
    rows = []
    for stream, g in k.groupby("stream", sort=True):
        g = g.sort_values("ts", kind="stable")
        prev_end = g["end"].shift(1).to_numpy()
        gap = g["ts"].to_numpy() - prev_end
        host = g["launch_ts"].to_numpy() > prev_end  # NaN compares False: no launch, not a host wait
        kind = np.where(host, "host_wait", np.where(gap < kernel_wait_us, "kernel_wait", "other"))
        ok = ~np.isnan(gap)
        row = {"stream": int(stream), "activities": len(g)}
        row |= {kd: float(gap[ok & (kind == kd)].sum()) for kd in KINDS}
        row["idle"] = sum(row[kd] for kd in KINDS)
        row |= {f"{kd}_pct": (100.0 * row[kd] / row["idle"] if row["idle"] else 0.0) for kd in KINDS}
        rows.append(row)
    cols = ["stream", "activities", *KINDS, "idle", *(f"{kd}_pct" for kd in KINDS)]
    return pd.DataFrame(rows, columns=cols)


@dataclass
class LaunchOutliers:
    launches: int
    cpu_us: float  # summed launch-call time
    gpu_us: float
    delay_us: float  # summed launch delay
    runtime_outliers: int
    delay_outliers: int
    gpu_shorter_than_cpu: int
    table: pd.DataFrame  # per launch: name, op, stream, cpu_us, gpu_us, delay_us, outlier (why)


def launch_outliers(k: pd.DataFrame, runtime_cutoff_us: float = 50.0, delay_cutoff_us: float = 100.0) -> LaunchOutliers:
    """HTA's launch statistics of ``k`` (see the module note)."""
    ok = k["launch_name"].isin(LAUNCH_CALLS).to_numpy() & k["launch_ts"].notna().to_numpy() if len(k) else []
    s = k[ok] if len(k) else k
    cpu = s["launch_dur"].to_numpy(dtype=np.float64) if len(s) else np.zeros(0)
    gpu = s["dur"].to_numpy(dtype=np.float64) if len(s) else np.zeros(0)
    delay = np.clip(s["ts"].to_numpy() - s["launch_ts"].to_numpy() - cpu, 0, None) if len(s) else np.zeros(0)
    why = np.where(cpu > runtime_cutoff_us, "slow launch call",
                   np.where(delay > delay_cutoff_us, "long launch delay", ""))  # fmt: skip
    table = pd.DataFrame({"name": s["name"].astype(str).to_numpy() if len(s) else [],
                          "op": s["op"].to_numpy() if len(s) else [],
                          "stream": s["stream"].to_numpy() if len(s) else [],
                          "step": s["step"].to_numpy() if len(s) else [], "cpu_us": cpu, "gpu_us": gpu,
                          "delay_us": delay, "outlier": why})  # fmt: skip
    return LaunchOutliers(
        launches=len(s),
        cpu_us=float(cpu.sum()),
        gpu_us=float(gpu.sum()),
        delay_us=float(delay.sum()),
        runtime_outliers=int((cpu > runtime_cutoff_us).sum()),
        delay_outliers=int((delay > delay_cutoff_us).sum()),
        gpu_shorter_than_cpu=int((gpu < cpu).sum()),
        table=table,
    )
