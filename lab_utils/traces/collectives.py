"""Collectives read from GPU traces: size, algorithm, bus bandwidth, exposed time, cross-rank skew,
and the alpha-beta model (the one fit lab 06 uses too: ``lab_utils.distributed.comm`` imports it).

Per NCCL/RCCL kernel (one call):

* **name**: ``ncclKernel_AllReduce_RING_LL_Sum_float`` (NCCL < 2.19) and
  ``ncclDevKernel_AllReduce_Sum_f32_RING_LL`` (later) give collective, algorithm (RING, TREE,
  NVLS, COLLNET...), protocol (LL, LL128, SIMPLE), reduction and element type;
* **size**: the kernel's own arguments (``In msg nelems``/``Out msg nelems``, ``dtype``,
  ``Group size``: recorded since torch 2.3), else those of the host call that carries its
  ``External id`` (``record_param_comms``); NaN when neither recorded them.  Bytes moved per
  rank: the input for all-reduce, broadcast, reduce, reduce-scatter, all-to-all and send/recv,
  the output for all-gather;
* **bus bandwidth** (nccl-tests' convention): algbw = bytes / time; busbw = algbw x 2(n-1)/n for
  all-reduce, x (n-1)/n for all-gather, reduce-scatter and all-to-all, x 1 otherwise; n = group size;
* **exposed / hidden**: the part of the call that computation kernels (HTA's COMPUTATION) of
  the same rank overlap is hidden, the rest exposed.

Across the ranks of a folder (:func:`aligned`, :func:`skew`), the k-th call of each collective
(and process group) on every rank is one collective.  Clocks are taken as shared (absolute trace
time).  Its **wait** on a rank is the last arrival's start minus that rank's start (the time the
early kernel spins waiting), its **transfer** the median over ranks of end minus the last
arrival.  Bus bandwidth is then given twice: ``busbw_gbps`` over the kernel's whole duration
(what one rank's trace alone can say: the wait for late ranks included) and
``busbw_transfer_gbps`` over the transfer alone (the link's rate; TraceLens separates skew from
transfer the same way); a lone rank has only the first.

The **straggler** verdict names a rank that arrives last in at least half of the collectives
(and more often than 1.5 / n) while the median skew is at least 10 % of the median transfer;
otherwise there is none.  It says on how many ranks it rests: drawn from 2 traced ranks of a
128-rank job, any of the other 126 may arrive later still.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from lab_utils.traces.breakdown import union
from lab_utils.traces.reader import per_text

ALGORITHMS = ("RING", "TREE", "COLLNET", "COLLNETDIRECT", "COLLNETCHAIN", "NVLS", "NVLSTREE", "PAT")
PROTOCOLS = ("LL", "LL128", "SIMPLE")
REDOPS = ("Sum", "Prod", "Max", "Min", "PreMulSum", "SumPostDiv", "Avg")
ITEMSIZE = {
    "float": 4, "f32": 4, "float32": 4, "half": 2, "f16": 2, "float16": 2, "bfloat16": 2, "bf16": 2,
    "double": 8, "f64": 8, "float64": 8, "long": 8, "int64": 8, "i64": 8, "int": 4, "int32": 4, "i32": 4,
    "byte": 1, "char": 1, "int8": 1, "i8": 1, "uint8": 1, "u8": 1, "int8_t": 1, "uint8_t": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "f8e4m3": 1, "f8e5m2": 1,
}  # fmt: skip
KINDS = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "sendrecv": "send_recv",
    "send": "send_recv",
    "recv": "send_recv",
    "broadcast": "broadcast",
    "reduce": "reduce",
}
_BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}
_BUS |= {"reduce_scatter": _BUS["all_gather"], "all_to_all": _BUS["all_gather"]}
_NCCL = re.compile(r"^(nccl|rccl)(Dev)?Kernel_", re.IGNORECASE)


def parse_name(name: str) -> dict[str, str | None]:
    """collective (perflab kind), algorithm, protocol, redop, dtype of an NCCL/RCCL kernel name."""
    base = name.split("(", 1)[0]
    tokens = _NCCL.sub("", base).split("_")
    out: dict[str, str | None] = dict(collective=None, algorithm=None, protocol=None, redop=None, dtype=None)
    if not tokens or not tokens[0]:
        return out
    out["collective"] = KINDS.get(tokens[0].lower(), tokens[0].lower())
    rest = [t for t in tokens[1:] if t]
    for t in rest:
        if t.upper().replace("_", "") in ALGORITHMS and out["algorithm"] is None:
            out["algorithm"] = t.upper()
        elif t.upper() in PROTOCOLS and out["protocol"] is None:
            out["protocol"] = t.upper()
        elif t in REDOPS and out["redop"] is None:
            out["redop"] = t
    leftovers = [t for t in rest if t.upper() not in ALGORITHMS + PROTOCOLS and t not in REDOPS]
    joined = "_".join(leftovers)
    out["dtype"] = joined if joined.lower() in ITEMSIZE else (leftovers[0] if leftovers else None)
    return out


def _itemsize(dtype) -> float:
    if not isinstance(dtype, str):
        return float("nan")
    return float(ITEMSIZE.get(dtype.lower().replace("c10::", ""), np.nan))


def calls(kernels: pd.DataFrame, host: pd.DataFrame | None = None, world_size: int | None = None) -> pd.DataFrame:
    """One row per NCCL/RCCL kernel of an attributed table (see the module note)."""
    k = kernels[per_text(kernels["name"], lambda n: _NCCL.match(n) is not None, bool)].copy()
    cols = ["ts", "end", "dur", "stream", "step", "window", "external_id", "name"]
    out = k[cols].reset_index(drop=True)
    parsed = pd.DataFrame(
        [parse_name(n) for n in out["name"].astype(str)], index=out.index, columns=list(parse_name(""))
    )
    out = pd.concat([out, parsed], axis=1)
    args = {c: (k[src].to_numpy() if src in k else np.full(len(k), None)) for c, src in _ARGS.items()}
    if host is not None and "in_nelems" in host and len(k):  # the launching host call's record
        rec = host[host["in_nelems"].notna() & (host["external_id"] >= 0)].drop_duplicates("external_id")
        rec = rec.set_index("external_id")
        for c, src in _ARGS.items():
            if src in rec:
                fill = out["external_id"].map(rec[src]).to_numpy()
                args[c] = np.where(pd.isna(args[c]), fill, args[c])
    for c in _ARGS:
        out[c] = args[c]
    arg_kind = pd.Series(out["collective_arg"]).map(lambda s: KINDS.get(str(s).replace("_", "").lower()))
    out["collective"] = arg_kind.where(arg_kind.notna(), out["collective"])
    size = np.array([_itemsize(d) for d in out["dtype_arg"].where(out["dtype_arg"].notna(), out["dtype"])])
    n_in = pd.to_numeric(out["in_nelems"], errors="coerce").to_numpy(dtype=np.float64)
    n_out = pd.to_numeric(out["out_nelems"], errors="coerce").to_numpy(dtype=np.float64)
    out["bytes"] = np.where(out["collective"] == "all_gather", n_out, n_in) * size
    n = pd.to_numeric(out["group_size"], errors="coerce").fillna(world_size or np.nan).to_numpy(dtype=np.float64)
    factor = np.array([_BUS[c](g) if c in _BUS and g > 1 else 1.0 for c, g in zip(out["collective"], n)])
    out["group"] = n
    out["bus_factor"] = factor
    out["algbw_gbps"] = out["bytes"] / (out["dur"] * 1e3)
    out["busbw_gbps"] = out["algbw_gbps"] * factor
    comp = kernels[kernels["hta_type"] == "COMPUTATION"]
    out["hidden_us"] = _covered(out["ts"].to_numpy(), out["end"].to_numpy(), union(comp["ts"], comp["end"]))
    out["exposed_us"] = out["dur"] - out["hidden_us"]
    return out.drop(columns=["collective_arg", "dtype_arg"])


_BACKEND_RANGE = re.compile(r"^(gloo|mpi|ucc):")


def cpu_calls(kernels: pd.DataFrame, world_size: int | None = None, host: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per collective of a rank read by the CPU rule (:mod:`lab_utils.traces.cpu`), in
    :func:`calls`' columns.  The calls are the backend's ranges (``gloo:all_reduce``: the transfer
    on the backend's thread) when the trace has them, else the communication operators
    (``c10d::allreduce_``, ``record_param_comms``).  Kind from the name (or ``Collective name``);
    bytes from ``In msg nelems`` x ``dtype`` where recorded, on the call or on the
    ``record_param_comms`` inside it (same thread, ``host``), else the input tensors' recorded
    shapes and types (``record_shapes=True``; NaN without them); no algorithm or protocol."""
    comm = kernels[kernels["hta_type"] == "COMMUNICATION"]
    backend = comm["name"].astype(str).str.match(_BACKEND_RANGE.pattern)
    k = comm[backend] if backend.any() else comm
    out = k[["ts", "end", "dur", "stream", "step", "window", "external_id", "name"]].reset_index(drop=True)
    arg = k["collective"].to_numpy() if "collective" in k else np.full(len(k), None)
    get = {c: (k[c].to_numpy(dtype=object, copy=True) if c in k else np.full(len(k), None)) for c in _ARGS.values()}
    if host is not None and "in_nelems" in host:
        _args_from_inside(k, host, get)
    arg = np.where(pd.isna(arg), get["collective"], arg)
    out["collective"] = [_cpu_kind(str(n), a) for n, a in zip(out["name"], arg)]
    for c in ("algorithm", "protocol", "redop"):
        out[c] = None
    out["dtype"] = get["dtype"]
    out["in_nelems"], out["out_nelems"] = get["in_nelems"], get["out_nelems"]
    out["group_size"], out["pg_name"] = get["group_size"], get["pg_name"]
    n_in = pd.to_numeric(out["in_nelems"], errors="coerce").to_numpy(dtype=np.float64)
    by_arg = n_in * np.array([_itemsize(d) for d in out["dtype"]])
    dims = k["input_dims"].to_numpy() if "input_dims" in k else np.full(len(k), None)
    types = k["input_type"].to_numpy() if "input_type" in k else np.full(len(k), None)
    by_shape = np.array([_tensor_bytes(d, t) for d, t in zip(dims, types)], dtype=np.float64)
    out["bytes"] = np.where(np.isfinite(by_arg), by_arg, by_shape)
    n = pd.to_numeric(out["group_size"], errors="coerce").fillna(world_size or np.nan).to_numpy(dtype=np.float64)
    factor = np.array([_BUS[c](g) if c in _BUS and g > 1 else 1.0 for c, g in zip(out["collective"], n)])
    out["group"] = n
    out["bus_factor"] = factor
    out["algbw_gbps"] = out["bytes"] / (out["dur"] * 1e3)
    out["busbw_gbps"] = out["algbw_gbps"] * factor
    comp = kernels[kernels["hta_type"] == "COMPUTATION"]
    out["hidden_us"] = _covered(out["ts"].to_numpy(), out["end"].to_numpy(), union(comp["ts"], comp["end"]))
    out["exposed_us"] = out["dur"] - out["hidden_us"]
    return out


def _args_from_inside(k: pd.DataFrame, host: pd.DataFrame, get: dict) -> None:
    """Fill ``get``'s missing argument columns of each call from a sized record
    (``record_param_comms``) that the call encloses on its thread."""
    rec = host[host["in_nelems"].notna()]
    if not len(rec):
        return
    tids = rec["tid"].astype(str).to_numpy()
    for i, (ts, end, tid) in enumerate(zip(k["ts"], k["end"], k["tid"].astype(str))):
        if not pd.isna(get["in_nelems"][i]):
            continue
        inside = rec[(tids == tid) & (rec["ts"].to_numpy() >= ts) & (rec["end"].to_numpy() <= end)]
        if len(inside):
            first = inside.iloc[0]
            for src in get:
                if src in inside and pd.isna(get[src][i]):
                    get[src][i] = first[src]


def _cpu_kind(name: str, arg) -> str:
    """``gloo:all_reduce`` / ``c10d::allreduce_`` / a ``Collective name`` -> perflab's kind."""
    raw = str(arg) if isinstance(arg, str) and arg else name.split(":")[-1]
    key = raw.strip("_").replace("_", "").lower()
    return KINDS.get(key, raw.strip("_"))


def _tensor_bytes(dims, types) -> float:
    """Bytes of the recorded input tensors (``Input Dims``/``Input type`` as raw JSON), NaN if none."""
    if dims is None or types is None:
        return float("nan")
    try:
        d, t = json.loads(dims), json.loads(types)
    except (TypeError, ValueError):
        return float("nan")
    total = 0.0
    for shape, typ in zip(d, t):
        if isinstance(shape, list) and shape and all(isinstance(x, int) for x in shape):
            total += float(np.prod(shape)) * _itemsize(typ)
    return total if total > 0 else float("nan")


#: argument columns of a call and the reader's column each comes from
_ARGS = {
    "collective_arg": "collective",
    "in_nelems": "in_nelems",
    "out_nelems": "out_nelems",
    "dtype_arg": "dtype",
    "group_size": "group_size",
    "pg_name": "pg_name",
}


def _covered(ts: np.ndarray, end: np.ndarray, iv: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """For each [ts, end), the length that the disjoint sorted intervals ``iv`` cover."""
    starts, ends = iv
    if not len(starts):
        return np.zeros(len(ts))
    cum = np.concatenate([[0.0], np.cumsum(ends - starts)])

    def covered_before(t: np.ndarray) -> np.ndarray:  # covered length in (-inf, t)
        i = np.searchsorted(starts, t, side="right")  # intervals starting at or before t
        partial = np.clip(t - starts[np.clip(i - 1, 0, None)], 0, None)
        partial = np.minimum(partial, ends[np.clip(i - 1, 0, None)] - starts[np.clip(i - 1, 0, None)])
        return cum[np.clip(i - 1, 0, None)] + np.where(i > 0, partial, 0.0)

    return covered_before(end) - covered_before(ts)


def aligned(per_rank: dict[int, pd.DataFrame], offsets: dict[int, float]) -> pd.DataFrame:
    """Each rank's calls matched across the ranks (the k-th call of each collective and process group
    is one collective; those on every rank only): per rank and call, its ``wait_us`` for the last
    arrival, its ``transfer_us`` after it, and the bus bandwidth both with the wait (the kernel's
    whole duration: ``busbw_gbps``) and from the transfer alone (``busbw_transfer_gbps``), as
    TraceLens separates skew from transfer."""
    cols = ["rank", "row", "collective", "pg", "seq", "start_abs", "end_abs", "bytes", "bus_factor"]
    parts = []
    for r, c in per_rank.items():
        c = c.sort_values("ts").copy()
        c["row"] = c.index  # the call's row in its rank's table
        c["pg"] = c["pg_name"].fillna("").astype(str)
        c["seq"] = c.groupby(["collective", "pg"]).cumcount()
        c["rank"] = r
        c["start_abs"] = c["ts"] + offsets[r]
        c["end_abs"] = c["end"] + offsets[r]
        if "bus_factor" not in c:
            c["bus_factor"] = 1.0
        parts.append(c[cols])
    if len(parts) < 2:
        return pd.DataFrame(columns=cols + ["wait_us", "transfer_us", "busbw_gbps", "busbw_transfer_gbps"])
    df = pd.concat(parts, ignore_index=True)
    on_all = df.groupby(["collective", "pg", "seq"])["rank"].transform("nunique") == len(per_rank)
    df = df[on_all].copy()
    last = df.groupby(["collective", "pg", "seq"])["start_abs"].transform("max")
    df["wait_us"] = last - df["start_abs"]
    df["transfer_us"] = df["end_abs"] - last
    rate = lambda us: df["bytes"] / (us.where(us > 0) * 1e3) * df["bus_factor"]  # noqa: E731 - GB/s of a column
    df["busbw_gbps"] = rate(df["end_abs"] - df["start_abs"])
    df["busbw_transfer_gbps"] = rate(df["transfer_us"])
    return df.reset_index(drop=True)


def skew(per_rank: dict[int, pd.DataFrame], offsets: dict[int, float]) -> pd.DataFrame:
    """Across ranks: one row per (collective, process group, k-th call) present on every rank, with
    the median bus bandwidth over the ranks with the wait and from the transfer alone."""
    df = aligned(per_rank, offsets)
    if not len(df):
        return pd.DataFrame(columns=["collective", "pg", "seq", "skew_us", "transfer_us", "last_rank"])
    rows = []
    for (kind, pg, seq), g in df.groupby(["collective", "pg", "seq"]):
        last = g["start_abs"].max()
        transfer = float(np.median(g["end_abs"] - last))
        size, factor = float(g["bytes"].max()), float(g["bus_factor"].iloc[0])
        rows.append(
            {
                "collective": kind,
                "pg": pg,
                "seq": int(seq),
                "bytes": size,
                "skew_us": float(last - g["start_abs"].min()),
                "transfer_us": transfer,
                "last_rank": int(g.loc[g["start_abs"].idxmax(), "rank"]),
                "busbw_gbps": float(g["busbw_gbps"].median()),
                "busbw_transfer_gbps": size / (transfer * 1e3) * factor if transfer > 0 else float("nan"),
                **{f"wait_us_rank{int(r)}": float(last - s) for r, s in zip(g["rank"], g["start_abs"])},
            }
        )
    return pd.DataFrame(rows)


@dataclass
class Straggler:
    rank: int | None
    last_share: float  # share of collectives the rank arrived last in
    median_skew_us: float
    median_transfer_us: float
    verdict: str
    ranks: int = 0  # the ranks the verdict is drawn from (those in the traces)
    world_size: int | None = None  # the job's ranks, where the traces record it


def straggler(sk: pd.DataFrame, n_ranks: int, world_size: int | None = None) -> Straggler:
    """The straggler verdict over :func:`skew`'s rows (see the module note); ``world_size``: the
    job's ranks, when the traces are only some of them (the verdict then says on how many it rests)."""
    partial = world_size is not None and world_size > n_ranks
    rests = (
        f" (drawn from {n_ranks} of the job's {world_size} ranks: the other {world_size - n_ranks} are not in "
        f"the traces, and any of them may arrive later)"
        if partial
        else f" (all {n_ranks} ranks)"
    )
    if not len(sk):
        return Straggler(None, float("nan"), float("nan"), float("nan"), "no collective common to all ranks" + rests,
                         n_ranks, world_size)  # fmt: skip
    share = sk["last_rank"].value_counts(normalize=True)
    rank, top = int(share.index[0]), float(share.iloc[0])
    med_skew, med_tr = float(sk["skew_us"].median()), float(sk["transfer_us"].median())
    is_it = top >= 0.5 and top > 1.5 / n_ranks and med_skew >= 0.1 * max(med_tr, 1e-9)
    verdict = (
        f"rank {rank} is the straggler: last to arrive in {100 * top:.0f}% of {len(sk)} collectives, "
        f"median skew {med_skew / 1e3:.2f} ms vs transfer {med_tr / 1e3:.2f} ms"
        if is_it
        else f"no straggler: the most frequent last arrival (rank {rank}) is last in {100 * top:.0f}% "
        f"of {len(sk)} collectives, median skew {med_skew / 1e3:.2f} ms vs transfer {med_tr / 1e3:.2f} ms"
    )
    return Straggler(rank if is_it else None, top, med_skew, med_tr, verdict + rests, n_ranks, world_size)


# --------------------------------------------------------------------------------------
# The alpha-beta model (lab 06's fit, shared: lab_utils.distributed.comm re-exports it)
# --------------------------------------------------------------------------------------


@dataclass
class CollectiveEvent:
    kind: str
    bytes: int
    start_us: float
    dur_us: float


@dataclass
class AlphaBeta:
    kind: str
    alpha_us: float  # latency per call
    beta_us_per_byte: float
    n_events: int
    r2: float
    median_abs_err_pct: float  # of the fit on its own sweep

    @property
    def gbps(self) -> float:
        return 1e-3 / self.beta_us_per_byte if self.beta_us_per_byte > 0 else float("inf")

    def predict_us(self, nbytes: float) -> float:
        return self.alpha_us + self.beta_us_per_byte * nbytes


SWEEP_ALIAS = {
    "send": "send_recv",
    "recv": "send_recv",
    "_allgather_base": "all_gather",
    "allgather": "all_gather",
    "allreduce": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "alltoall": "all_to_all",
    "all_to_all_single": "all_to_all",
}


def fit_alpha_beta(events: list[CollectiveEvent]) -> dict[str, AlphaBeta]:
    """Least-squares ``dur = alpha + beta * bytes`` per kind over the median duration at each
    message size (medians, because a loaded machine adds stalls to single calls; alpha and
    beta clipped at 0).  ``send``/``recv`` fit as one ``send_recv`` kind; barriers carry no
    payload.  A kind needs at least three distinct sizes."""
    groups: dict[str, dict[int, list[float]]] = {}
    for e in events:
        k = SWEEP_ALIAS.get(e.kind, e.kind)
        if k == "barrier":
            continue
        groups.setdefault(k, {}).setdefault(e.bytes, []).append(e.dur_us)
    out = {}
    for k, by in sorted(groups.items()):
        if len(by) < 3:
            continue
        xs = np.array(sorted(by), dtype=float)
        ys = np.array([np.median(by[x]) for x in sorted(by)], dtype=float)
        beta, alpha = np.polyfit(xs, ys, 1, w=1 / np.maximum(ys, 1e-9))  # relative-error weighting
        alpha, beta = max(float(alpha), 0.0), max(float(beta), 0.0)
        pred = alpha + beta * xs
        ss = float(((ys - ys.mean()) ** 2).sum())
        r2 = 1 - float(((ys - pred) ** 2).sum()) / ss if ss > 0 else float("nan")
        err = float(np.median(np.abs(pred - ys) / np.maximum(ys, 1e-9))) * 100
        out[k] = AlphaBeta(k, alpha, beta, sum(len(v) for v in by.values()), r2, err)
    return out


def events_of(c: pd.DataFrame, duration: str = "dur") -> list[CollectiveEvent]:
    """The calls of :func:`calls` with a known size as fit inputs (``duration``: a column in us)."""
    ok = c[np.isfinite(c["bytes"].to_numpy(dtype=np.float64))]
    return [
        CollectiveEvent(str(k), int(b), float(t), float(d))
        for k, b, t, d in zip(ok["collective"], ok["bytes"], ok["ts"], ok[duration])
    ]
