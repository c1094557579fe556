"""Communication read from profiler traces: collectives, overlap, and an alpha-beta model.

Design note
-----------
A rank's chrome trace (``torch.profiler`` export) holds its collectives as events on
the backend's worker threads (``gloo:all_reduce`` ...; on GPUs the ``nccl`` kernels)
and its compute as the operators on the main thread (on GPUs: the other kernels).
From them, per rank and step:

* each collective's kind, payload bytes (the event's input tensors) and duration;
* ``comm_ms`` = the union of collective intervals, ``hidden_ms`` = the part of it that
  overlaps compute, ``exposed_ms`` = the rest; ``idle_ms`` = the step window covered
  by neither; ``overlap_fraction`` = hidden / comm.

The alpha-beta model (its fit lives in :mod:`lab_utils.traces.collectives`, shared with the
trace analysis of real GPU jobs) fits ``time = alpha + beta * bytes`` per collective kind to events
measured in a sweep of message sizes (same extraction, so fit and prediction agree on
what "bytes" means); a step's communication is predicted by summing the model over the
step's collectives and compared with the measured durations.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lab_utils.traces.collectives import SWEEP_ALIAS, AlphaBeta, CollectiveEvent, fit_alpha_beta
from lab_utils.traces.reader import events as trace_events

#: re-exported: lab 06 and its tests take the collective record and the fit from here
__all__ = ["AlphaBeta", "CollectiveEvent", "fit_alpha_beta", "load_trace", "collectives", "overlap", "predict_comm_ms"]

ITEMSIZE = {
    "float": 4,
    "double": 8,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "long int": 8,
    "int": 4,
    "bool": 1,
    "unsigned char": 1,
    "signed char": 1,
    "short int": 2,
}
COMM_PREFIXES = ("gloo:", "nccl:")
STEP_MARK = "perflab_dist_step"


@dataclass
class OverlapSummary:
    step_ms: float
    compute_ms: float
    comm_ms: float
    hidden_ms: float
    exposed_ms: float
    idle_ms: float
    overlap_fraction: float  # hidden / comm (NaN without communication)
    collectives: int
    comm_bytes: int


def _nbytes(args: dict) -> int:
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    total = 0
    for d, t in zip(dims, types):
        if isinstance(d, list) and all(isinstance(x, int) for x in d):
            total += int(np.prod(d, dtype=np.int64)) * ITEMSIZE.get(t, 4) if d else ITEMSIZE.get(t, 4)
    return total


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _measure(iv: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in iv)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            tot += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def load_trace(path: str | Path) -> list[dict]:
    """The complete events of a rank's trace (``.json`` or ``.json.gz``), read by :mod:`lab_utils.traces.reader`."""
    return trace_events(path)


def _is_comm(e: dict) -> bool:
    name = e.get("name", "")
    return name.startswith(COMM_PREFIXES) or (e.get("cat") == "kernel" and "nccl" in name.lower())


def collectives(events: list[dict]) -> list[CollectiveEvent]:
    out = []
    for e in events:
        if _is_comm(e):
            name = e["name"]
            kind = name.split(":", 1)[1] if ":" in name else name
            out.append(CollectiveEvent(kind, _nbytes(e.get("args", {})), float(e["ts"]), float(e.get("dur", 0.0))))
    return out


def overlap(events: list[dict]) -> OverlapSummary:
    """Compute / communication / idle split of one profiled step (see the module note)."""
    marks = [e for e in events if e.get("name") == STEP_MARK]
    if marks:
        w0, w1 = float(marks[0]["ts"]), float(marks[0]["ts"]) + float(marks[0]["dur"])
    else:
        w0 = min(float(e["ts"]) for e in events)
        w1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in events)
    gpu = any(e.get("cat") == "kernel" for e in events)
    main_tid = marks[0].get("tid") if marks else None
    comp, comm = [], []
    coll = collectives(events)
    for c in coll:
        comm.append((max(c.start_us, w0), min(c.start_us + c.dur_us, w1)))
    for e in events:
        name = e.get("name", "")
        if _is_comm(e):
            continue
        if gpu:
            ok = e.get("cat") == "kernel"
        else:
            ok = (
                e.get("cat") == "cpu_op"
                and (main_tid is None or e.get("tid") == main_tid)
                and not any(x in name for x in ("c10d", "wait", "record_param_comms", "_c10d_functional"))
            )
        if ok:
            s = float(e["ts"])
            comp.append((max(s, w0), min(s + float(e.get("dur", 0)), w1)))
    comp = _union([iv for iv in comp if iv[1] > iv[0]])
    comm = _union([iv for iv in comm if iv[1] > iv[0]])
    c_ms, m_ms = _measure(comp) / 1e3, _measure(comm) / 1e3
    hid = _intersect(comp, comm) / 1e3
    step = (w1 - w0) / 1e3
    busy = c_ms + m_ms - hid
    return OverlapSummary(
        step_ms=step,
        compute_ms=c_ms,
        comm_ms=m_ms,
        hidden_ms=hid,
        exposed_ms=m_ms - hid,
        idle_ms=max(step - busy, 0.0),
        overlap_fraction=hid / m_ms if m_ms > 0 else float("nan"),
        collectives=len(coll),
        comm_bytes=sum(c.bytes for c in coll),
    )


# --------------------------------------------------------------------------------------
# Alpha-beta model
# --------------------------------------------------------------------------------------

SWEEP_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def predict_comm_ms(events: list[CollectiveEvent], model: dict[str, AlphaBeta]) -> tuple[float, float, int]:
    """(predicted ms, measured ms, events without a model) summed over ``events`` that have a model."""
    pred = meas = 0.0
    missing = 0
    for e in events:
        m = model.get(SWEEP_ALIAS.get(e.kind, e.kind))
        if m is None:
            missing += 1
            continue
        pred += m.predict_us(e.bytes)
        meas += e.dur_us
    return pred / 1e3, meas / 1e3, missing


def sweep_collectives(sizes_bytes: list[int], reps: int, device: torch.device, group=None) -> None:
    """Run every sweep kind at every size ``reps`` times (every rank of ``group`` calls it;
    profile around it and read the events with :func:`collectives`).  Fixed repetition
    counts keep the ranks in step; a barrier before each call removes arrival skew."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    for size in sizes_bytes:
        numel = max(size // 4, n) // n * n
        x = torch.randn(numel, device=device)
        out_ag = torch.empty(numel * n, device=device)
        out_rs = torch.empty(numel // n, device=device)
        out_a2a = torch.empty_like(x)
        recv = torch.empty_like(x)
        for _ in range(reps):
            dist.barrier(group)
            dist.all_reduce(x, group=group)
            dist.barrier(group)
            dist.all_gather_into_tensor(out_ag, x, group=group)
            dist.barrier(group)
            dist.reduce_scatter_tensor(out_rs, x, group=group)
            dist.barrier(group)
            dist.all_to_all_single(out_a2a, x, group=group)
            if n > 1:
                dist.barrier(group)
                nxt = dist.get_global_rank(group, (me + 1) % n) if group is not None else (me + 1) % n
                prv = dist.get_global_rank(group, (me - 1) % n) if group is not None else (me - 1) % n
                ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
        x.zero_()  # all_reduce grows x; keep magnitudes bounded between sizes


def summary_dict(s: OverlapSummary) -> dict:
    return asdict(s)
