"""Time series of a rank: the launch queue of each stream, and the bandwidth of its copies and fills.

**Queue length** (:func:`queue_series`, HolisticTraceAnalysis 0.5's ``get_queue_length_time_series``):
per stream, a step function that rises by one at each launch call (``cudaLaunchKernel``,
``cudaMemcpyAsync`` ... whose activity is in the trace) and falls by one when that activity starts:
the work the host has queued ahead of the GPU.  One point per change (ts, stream, queue_length).
:func:`queue_summary` gives, per stream, HTA's figures over the change points (count, mean, max)
beside the time-weighted mean and the time spent at ``max_queue`` or more (1024: CUDA's launch
queue is full and the host blocks in its next launch).

**Memory bandwidth** (:func:`memory_bw_series`, HTA's ``get_memory_bw_time_series``): per kind of
memory activity (``Memcpy HtoD``, ``Memcpy DtoH``, ``Memcpy DtoD``, ``Memset``: the first 11
characters of a memcpy's name), a step function of the GB/s in flight: each activity adds its
bandwidth while it runs: the ``memory bandwidth (GB/s)`` Kineto recorded (from the ns duration),
else its ``bytes`` / duration.
:func:`memory_bw_summary`: per kind, count, mean and max over the change points where it is above 0.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from lab_utils.traces.critical_path import LAUNCHES

MAX_QUEUE = 1024


def queue_series(k: pd.DataFrame) -> pd.DataFrame:
    """Queue length per stream at every change (see the module note): ts, stream, queue_length."""
    s = k[k["launch_name"].isin(LAUNCHES) & k["launch_ts"].notna()] if len(k) else k
    if not len(s):
        return pd.DataFrame(columns=["ts", "stream", "queue_length"])
    ev = pd.DataFrame({"ts": np.concatenate([s["launch_ts"].to_numpy(), s["ts"].to_numpy()]),
                       "stream": np.concatenate([s["stream"].to_numpy()] * 2),
                       "step": np.concatenate([np.ones(len(s)), -np.ones(len(s))])})  # fmt: skip
    ev = ev.sort_values(["stream", "ts", "step"], ascending=[True, True, False], kind="stable")
    ev["queue_length"] = ev.groupby("stream")["step"].cumsum()
    return ev[["ts", "stream", "queue_length"]].reset_index(drop=True)


def queue_summary(series: pd.DataFrame, max_queue: int = MAX_QUEUE) -> pd.DataFrame:
    """Per stream: count, mean and max over the change points (HTA's), time-weighted mean, us at ``max_queue``."""
    rows = []
    for stream, g in series.groupby("stream", sort=True):
        q, t = g["queue_length"].to_numpy(dtype=np.float64), g["ts"].to_numpy()
        held = np.diff(t)  # each value holds until the next change
        span = float(t[-1] - t[0]) if len(t) > 1 else 0.0
        rows.append({"stream": int(stream), "count": len(q), "mean": float(q.mean()), "max": float(q.max()),
                     "time_mean": float((q[:-1] * held).sum() / span) if span > 0 else float(q.mean()),
                     "at_max_us": float(held[q[:-1] >= max_queue].sum())})  # fmt: skip
    return pd.DataFrame(rows, columns=["stream", "count", "mean", "max", "time_mean", "at_max_us"])


def in_window(series: pd.DataFrame, key: str, value: str, lo: float, hi: float, max_points: int = 2000) -> pd.DataFrame:
    """A step-function series (``ts``, ``key``, ``value``: a value holds until the key's next change)
    on [lo, hi], per key: the value holding at ``lo`` first, then every change inside, at most
    ``max_points`` per key: past that, one point per bin of (hi - lo) / max_points holding the bin's
    largest value (a peak is never averaged away)."""
    cols = ["ts", key, value]
    parts = []
    for k, g in series.groupby(key, sort=True):
        t, v = g["ts"].to_numpy(dtype=np.float64), g[value].to_numpy(dtype=np.float64)
        before = np.searchsorted(t, lo, side="right") - 1
        inside = (t > lo) & (t <= hi)
        ts = np.concatenate([[lo], t[inside]]) if before >= 0 else t[inside]
        vs = np.concatenate([[v[before]], v[inside]]) if before >= 0 else v[inside]
        if len(ts) > max_points and hi > lo:
            b = np.minimum(((ts - lo) / (hi - lo) * max_points).astype(np.int64), max_points - 1)
            firsts = np.flatnonzero(np.r_[True, np.diff(b) > 0])
            ts, vs = lo + b[firsts] * (hi - lo) / max_points, np.maximum.reduceat(vs, firsts)
        if len(ts):
            parts.append(pd.DataFrame({"ts": ts, key: k, value: vs}))
    return pd.concat(parts, ignore_index=True)[cols] if parts else pd.DataFrame(columns=cols)


def memory_kind(name: str) -> str:
    """``Memcpy HtoD`` / ``Memcpy DtoH`` / ``Memcpy DtoD`` / ``Memset`` (HTA's names), from an activity's name."""
    if name[:6] == "Memset":
        return "Memset"
    return name[:11] if name[:6] == "Memcpy" else "Memcpy Unknown"


def memory_bw_series(k: pd.DataFrame) -> pd.DataFrame:
    """GB/s in flight per memory kind at every change (see the module note): ts, kind, gbps."""
    m = k[k["hta_type"] == "MEMORY"] if len(k) else k
    if not len(m) or "nbytes" not in m:
        return pd.DataFrame(columns=["ts", "kind", "gbps"])
    dur = m["dur"].to_numpy(dtype=np.float64)
    gbps = m["nbytes"].to_numpy(dtype=np.float64) / np.where(dur > 0, dur, 1.0) / 1e3
    if "memory_gbps" in m:
        recorded = m["memory_gbps"].to_numpy(dtype=np.float64)
        gbps = np.where(np.isnan(recorded), gbps, recorded)
    kinds = [memory_kind(n) for n in m["name"].astype(str)]
    ev = pd.DataFrame({"ts": np.concatenate([m["ts"].to_numpy(), m["ts"].to_numpy() + np.where(dur > 0, dur, 1.0)]),
                       "kind": kinds * 2, "delta": np.concatenate([gbps, -gbps])})  # fmt: skip
    ev = ev[np.isfinite(ev["delta"])].sort_values(["kind", "ts"], kind="stable")
    ev["gbps"] = ev.groupby("kind")["delta"].cumsum()
    return ev[["ts", "kind", "gbps"]].reset_index(drop=True)


def memory_bw_summary(series: pd.DataFrame) -> pd.DataFrame:
    """Per memory kind: count, mean and max GB/s over the change points above 0."""
    s = series[series["gbps"] > 1e-12]
    g = s.groupby("kind")["gbps"].agg(count="count", mean="mean", max="max")
    return g.reset_index()
