"""Where GPU time went, from GPU events only: temporal breakdown, shares, top kernels, overlap, idle.

All functions take an attributed kernel table (:func:`lab_utils.traces.attribute.attribute`) or a
selection of it (one step, one window) and work in microseconds.

* **span**: first activity start to last activity end of the selection.
* **busy**: the union of the activities' intervals over all streams; **idle** = span - busy.
* **temporal** (exclusive, sums to the span): ``compute`` = union of HTA-``COMPUTATION`` kernels;
  ``communication`` = union of ``COMMUNICATION`` kernels not under compute (exposed comm);
  ``memory`` = union of ``MEMORY`` activities under neither; ``other`` = the rest of busy;
  ``idle``.  HolisticTraceAnalysis's ``non_compute`` is ``span - idle - compute``.
* **shares**: each HTA type's summed kernel time over the selection's summed kernel time.
* **overlap**: the share of the communication union that computation covers (HTA's
  ``comp_comm_overlap``), NaN without communication.
* **idle split**: each gap of the busy union ends with an activity; if that activity was
  launched inside the gap, the part of the gap before its launch is ``host_wait`` (nothing was
  queued: the GPU waited for the host), the rest ``other_wait`` (queued work waiting on a
  dependency, an event or the launch latency).  Activities without a launch count as queued.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from lab_utils.traces.categories import HTA_TYPES


def union(ts: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge intervals [ts, end) into disjoint sorted intervals."""
    if not len(ts):
        return np.zeros(0), np.zeros(0)
    o = np.argsort(ts, kind="stable")
    s, e = np.asarray(ts, dtype=np.float64)[o], np.asarray(end, dtype=np.float64)[o]
    run_end = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > run_end[:-1]
    starts = s[new]
    idx = np.flatnonzero(new)
    ends = np.maximum.reduceat(e, idx) if len(idx) else np.zeros(0)
    return starts, ends


def length(iv: tuple[np.ndarray, np.ndarray]) -> float:
    return float(np.sum(iv[1] - iv[0]))


def intersection(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """Total length covered by both disjoint interval sets ``a`` and ``b``."""
    if not len(a[0]) or not len(b[0]):
        return 0.0
    pts = np.concatenate([a[0], a[1], b[0], b[1]])
    delta = np.concatenate([np.ones(len(a[0])), -np.ones(len(a[0])), 2 * np.ones(len(b[0])), -2 * np.ones(len(b[0]))])
    o = np.lexsort((delta, pts))  # at equal times the ends (negative) come first
    pts, delta = pts[o], delta[o]
    running = np.cumsum(delta)
    widths = np.diff(pts)
    return float(np.sum(widths[running[:-1] == 3]))


def _typed(k: pd.DataFrame, kind: str) -> tuple[np.ndarray, np.ndarray]:
    sel = k[k["hta_type"] == kind]
    return union(sel["ts"].to_numpy(), sel["end"].to_numpy())


def temporal(k: pd.DataFrame) -> dict[str, float]:
    """Span, busy, idle and the exclusive split of one selection (see the module note)."""
    typ = k["hta_type"].to_numpy(dtype=object)
    typed = {t: typ == t for t in ("COMPUTATION", "COMMUNICATION", "MEMORY")}
    return _temporal(*(k[c].to_numpy(dtype=np.float64) for c in ("ts", "end", "dur")), typed)


def _temporal(ts: np.ndarray, end: np.ndarray, dur: np.ndarray, typed: dict[str, np.ndarray]) -> dict[str, float]:
    """:func:`temporal` of columns; ``typed``: each HTA type's row mask."""
    if not len(ts):
        return dict.fromkeys(
            ("span", "busy", "idle", "compute", "communication", "memory", "other", "non_compute", "kernel_time"), 0.0
        )
    busy_iv = union(ts, end)
    span = float(busy_iv[1][-1] - busy_iv[0][0])
    busy = length(busy_iv)
    comp, comm, mem = (union(ts[typed[t]], end[typed[t]]) for t in ("COMPUTATION", "COMMUNICATION", "MEMORY"))
    c = length(comp)
    comm_len = length(comm)
    comm_excl = comm_len - intersection(comm, comp)
    cc = union(np.concatenate([comp[0], comm[0]]), np.concatenate([comp[1], comm[1]]))
    mem_excl = length(mem) - intersection(mem, cc)
    return {
        "span": span,
        "busy": busy,
        "idle": span - busy,
        "compute": c,
        "communication": comm_excl,
        "memory": mem_excl,
        "other": busy - c - comm_excl - mem_excl,
        "non_compute": span - (span - busy) - c,
        "kernel_time": float(dur.sum()),
    }


def shares(k: pd.DataFrame) -> dict[str, float]:
    """Per HTA type: percent of the selection's summed kernel time (0 when empty)."""
    total = float(k["dur"].sum())
    by = k.groupby("hta_type")["dur"].sum()
    return {t: (100.0 * float(by.get(t, 0.0)) / total if total > 0 else 0.0) for t in HTA_TYPES}


def overlap_pct(k: pd.DataFrame) -> float:
    """Percent of communication time that computation overlaps (GPU events only; NaN without comm)."""
    comm, comp = _typed(k, "COMMUNICATION"), _typed(k, "COMPUTATION")
    total = length(comm)
    return 100.0 * intersection(comm, comp) / total if total > 0 else float("nan")


def top_kernels(k: pd.DataFrame, n: int = 10) -> pd.DataFrame:
    """The ``n`` names with the largest summed time: name, category, hta_type, count, total, mean, min, max (us)."""
    g = k.groupby(k["name"].astype(str), observed=True)
    out = g["dur"].agg(count="count", total="sum", mean="mean", min="min", max="max")
    out["category"] = g["category"].first()
    out["hta_type"] = g["hta_type"].first()
    out = out.reset_index().sort_values(["total", "name"], ascending=[False, True]).head(n).reset_index(drop=True)
    out["pct"] = 100.0 * out["total"] / float(k["dur"].sum()) if len(k) else 0.0
    return out[["name", "category", "hta_type", "count", "total", "mean", "min", "max", "pct"]]


def idle_gaps(k: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gaps of the selection's busy union: (start, end, host_wait) per gap (see the module note)."""
    return _gaps(*(k[c].to_numpy(dtype=np.float64) for c in ("ts", "end", "launch_ts")))


def _gaps(ts: np.ndarray, end: np.ndarray, launch_ts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if len(ts) < 2:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    starts, ends = union(ts, end)
    gap_a, gap_b = ends[:-1], starts[1:]
    # the earliest launch among activities starting exactly at a gap's end (no launch sorts last)
    o = np.lexsort((launch_ts, ts))
    ts_o, launch_o = ts[o], launch_ts[o]
    at = np.searchsorted(ts_o, gap_b, side="left")
    hit = at < len(ts_o)
    hit[hit] = ts_o[at[hit]] == gap_b[hit]
    launch = np.full(len(gap_b), np.nan)
    launch[hit] = launch_o[at[hit]]
    launch = np.where(np.isnan(launch), gap_a, launch)  # no launch recorded: counted as queued
    return gap_a, gap_b, np.clip(launch, gap_a, gap_b) - gap_a


def idle_split(k: pd.DataFrame) -> dict[str, float]:
    """``host_wait`` and ``other_wait`` of the selection's idle time (see the module note)."""
    gap_a, gap_b, host = idle_gaps(k)
    idle = float(np.sum(gap_b - gap_a))
    return {"idle": idle, "host_wait": float(host.sum()), "other_wait": idle - float(host.sum())}


def by_category(k: pd.DataFrame) -> pd.DataFrame:
    """Summed time and count per perflab category, with each one's percent of kernel time."""
    out = k.groupby("category")["dur"].agg(count="count", total="sum").sort_values("total", ascending=False)
    out["pct"] = 100.0 * out["total"] / float(k["dur"].sum()) if len(k) else 0.0
    return out.reset_index()


def per_step(k: pd.DataFrame) -> pd.DataFrame:
    """One row per step of the ``window == "step"`` activities: temporal figures, shares, overlap, idle split.

    The figures are those of :func:`temporal`, :func:`shares`, :func:`overlap_pct` and
    :func:`idle_split` on each step's rows; the table is sliced once into numeric columns sorted by
    step, so a trace of many steps costs one sort, not a table filter per step."""
    sel = k[k["window"] == "step"]
    if not len(sel):
        return pd.DataFrame()
    step = sel["step"].to_numpy()
    order = np.argsort(step, kind="stable")
    cols = {c: sel[c].to_numpy(dtype=np.float64)[order] for c in ("ts", "end", "dur", "launch_ts")}
    types = sel["hta_type"].to_numpy(dtype=object)[order]
    step = step[order]
    bounds = np.flatnonzero(np.diff(step)) + 1
    starts, stops = np.concatenate([[0], bounds]), np.concatenate([bounds, [len(step)]])
    type_of = {t: types == t for t in ("COMPUTATION", "COMMUNICATION", "MEMORY")}
    rows = []
    for a, b in zip(starts, stops):
        ts, end, dur, launch = (cols[c][a:b] for c in ("ts", "end", "dur", "launch_ts"))
        typed = {t: m[a:b] for t, m in type_of.items()}
        row = {"step": int(step[a]), **_temporal(ts, end, dur, typed)}
        total = float(dur.sum())
        for t in HTA_TYPES:
            part = float(dur[types[a:b] == t].sum()) if t not in typed else float(dur[typed[t]].sum())
            row[f"share_{t.lower()}"] = 100.0 * part / total if total > 0 else 0.0
        comm = union(ts[typed["COMMUNICATION"]], end[typed["COMMUNICATION"]])
        comp = union(ts[typed["COMPUTATION"]], end[typed["COMPUTATION"]])
        comm_len = length(comm)
        row["overlap_pct"] = 100.0 * intersection(comm, comp) / comm_len if comm_len > 0 else float("nan")
        gap_a, gap_b, host = _gaps(ts, end, launch)
        row["host_wait"], row["other_wait"] = float(host.sum()), float(np.sum(gap_b - gap_a)) - float(host.sum())
        rows.append(row)
    return pd.DataFrame(rows)
