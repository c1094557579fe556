"""The critical path of one step: the chain of CPU operators, launches, kernels and waits that set its length.

The graph (the model of HolisticTraceAnalysis 0.5's ``CriticalPathAnalysis``, so that the two agree
on the test data; tests/unit/traces/test_counters_hta.py):

* **nodes**: the start and the end of every CPU operator and runtime/driver call (``cpu_op``,
  ``cuda_runtime``, ``cuda_driver``) that starts in the step window with a positive duration, and of
  every GPU activity whose launch call is one of those;
* **CPU edges**, per thread, walking its call stack (all of its events, user ranges included, nested
  by time) depth first: from each operator's start into its first child, child to child, last child
  to its end; the weight is the time between the two points, charged to the innermost event holding
  that time (an operator's own time to it, the time between two children to their parent).  The end
  of a call that blocks on the GPU (``cudaDeviceSynchronize``, ``cudaStreamSynchronize``,
  ``cudaEventSynchronize``, ``cudaEventQuery``, ``cudaMemcpy``, ``cudaMemcpyAsync``, and their
  ``hip`` twins) is reached with weight 0: its time is the GPU's, brought in by a sync edge.
  Consecutive outermost operators of a thread are chained by **dependency** edges of weight 0: a
  gap between them is nobody's work;
* **GPU edges**, per stream in start order: each activity's duration; before it either a **launch
  delay** (its launch call's start to its start) when the stream held nothing else when it was
  launched and had finished the previous activity by then, or else a **kernel gap** (the previous
  activity's end on the stream to its start);
* **sync edges** (weight 0): a ``Context Sync`` from every stream's last activity, a ``Stream Sync``
  from its stream's last, to the end of the blocking call; an ``Event Sync`` from the activity
  launched on the event's stream just before its ``cudaEventRecord``; a ``Stream Wait Event`` from
  that activity to the next activity launched on the waiting stream from the same thread.

The **critical path** is the longest path of this DAG by weight (negative weights, a few ns from
rounding, count 0).  Each of its edges is one kind: ``cpu`` (an operator's or range's time),
``gpu`` (an activity's), ``launch delay``, ``kernel gap``, ``dependency``/``sync`` (0); HTA's
``bound_by`` names them ``cpu_bound``, ``gpu_compute_bound``, ``gpu_communication_bound`` (an NCCL
kernel), ``gpu_kernel_launch_overhead`` and ``gpu_kernel_kernel_overhead``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import pandas as pd

from lab_utils.core.config import ConfigError
from lab_utils.traces.attribute import Attributed
from lab_utils.traces.reader import RankTrace, texts
from lab_utils.traces.timeline import representative_step

NODE_CATS = ("cpu_op", "cuda_runtime", "cuda_driver")
BLOCKING = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventQuery", "cudaEventSynchronize", "cudaMemcpy",
            "cudaMemcpyAsync", "hipDeviceSynchronize", "hipStreamSynchronize", "hipEventQuery", "hipEventSynchronize",
            "hipMemcpy", "hipMemcpyAsync")  # fmt: skip
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaMemcpyAsync", "cudaMemsetAsync",
            "hipLaunchKernel", "hipExtModuleLaunchKernel", "hipMemsetAsync", "hipMemcpyAsync", "hipMemcpyWithStream",
            "runFunction - job_prep_and_submit_for_execution")  # fmt: skip
KINDS = ("cpu", "gpu", "launch delay", "kernel gap", "dependency", "sync")
BOUND = {"launch delay": "gpu_kernel_launch_overhead", "kernel gap": "gpu_kernel_kernel_overhead"}


@dataclass
class CriticalPath:
    """One step's critical path (see the module note); times in us."""

    rank: int
    step: int
    window_us: float  # the step's host duration (or the trace's span without steps)
    length_us: float
    edges: pd.DataFrame  # the path's edges in order: kind, weight, event name, where, category, bound_by, stream
    nodes: int
    graph_edges: int

    def by_bound(self) -> dict[str, float]:
        """HTA's ``bound_by`` -> percent of the path's length (the 0-weight edges left out)."""
        e = self.edges[self.edges["weight"] > 0]
        g = e.groupby("bound_by")["weight"].sum()
        return {k: 100.0 * float(v) / self.length_us for k, v in g.items()} if self.length_us > 0 else {}

    def by_category(self) -> pd.DataFrame:
        """Per part of the path (a kernel category, ``CPU``, ``launch delay``, ``kernel gap``): us, share."""
        e = self.edges[self.edges["weight"] > 0]
        g = e.groupby("category")["weight"].agg(us="sum", edges="count").sort_values("us", ascending=False)
        g["pct"] = 100.0 * g["us"] / self.length_us if self.length_us > 0 else 0.0
        return g.reset_index()

    def by_event(self, n: int = 20) -> pd.DataFrame:
        """The events the path's time is charged to (a kernel gap to the kernel before it, as HTA
        does), most first: name, us, pct."""
        e = self.edges[self.edges["weight"] > 0]
        g = e.groupby("name")["weight"].sum().sort_values(ascending=False).head(n)
        out = g.rename("us").reset_index()
        out["pct"] = 100.0 * out["us"] / self.length_us if self.length_us > 0 else 0.0
        return out

    def items(self, n: int = 20) -> pd.DataFrame:
        """The operators and kernels on the path with the most time on it: kind, name, count, us, pct."""
        e = self.edges[self.edges["kind"].isin(["cpu", "gpu"]) & (self.edges["weight"] > 0)]
        g = e.groupby(["kind", "name"], observed=True)["weight"].agg(us="sum", count="count")
        g = g.sort_values("us", ascending=False).head(n).reset_index()
        g["pct"] = 100.0 * g["us"] / self.length_us if self.length_us > 0 else 0.0
        return g


def _window(att: Attributed, trace: RankTrace, step: int | None) -> tuple[int, float, float]:
    if not att.has_steps:  # the trace's span (its window's end lies one float past it, to be exclusive)
        lo = float(att.steps["ts"].iloc[0])
        return 0, lo, lo + float(att.steps["dur"].iloc[0])
    if step is None:
        step = representative_step(att)
    w = att.steps[att.steps["step"] == step]
    if not len(w):
        raise ConfigError("step", step, f"a step of rank {att.rank}: {att.steps['step'].tolist()}")
    return int(step), float(w["ts"].iloc[0]), float(w["end"].iloc[0])


class _Graph:
    """Nodes (a time, the event they begin or end) and weighted, typed, attributed edges."""

    def __init__(self) -> None:
        self.ts: list[float] = []
        self.node_event: list[int] = []  # >= 0: a host row; <= -2: kernel row -2 - i
        self.is_start: list[bool] = []
        self.src: list[int] = []
        self.dst: list[int] = []
        self.w: list[float] = []
        self.kind: list[int] = []
        self.event: list[int] = []  # the event an edge's time is charged to (-1: none)

    def pairs(self, events: np.ndarray, ts: np.ndarray, end: np.ndarray) -> np.ndarray:
        """A start and an end node for each event: their (start, end) nodes, one row per event."""
        n0, m = len(self.ts), len(events)
        t = np.empty(2 * m)
        t[0::2], t[1::2] = ts, end
        self.ts += t.tolist()
        self.node_event += np.repeat(np.asarray(events, dtype=np.int64), 2).tolist()
        self.is_start += [True, False] * m
        return n0 + np.arange(2 * m, dtype=np.int64).reshape(m, 2)

    def edge(self, u: int, v: int, kind: str, event: int = -1, zero: bool = False) -> None:
        w = 0.0 if zero or kind in ("dependency", "sync") else self.ts[v] - self.ts[u]
        self.src.append(u)
        self.dst.append(v)
        self.w.append(max(w, 0.0))
        self.kind.append(KINDS.index(kind))
        self.event.append(event)

    def edges(self, u: np.ndarray, v: np.ndarray, w: np.ndarray, kind: np.ndarray, event: np.ndarray) -> None:
        """:meth:`edge` for many edges at once, in order; ``w`` already final (>= 0)."""
        self.src += u.tolist()
        self.dst += v.tolist()
        self.w += w.tolist()
        self.kind += kind.tolist()
        self.event += event.tolist()


def _tour(ts: np.ndarray, end: np.ndarray, dur: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One thread's call stack, nested by time (starts and ends in time order; at one time ends
    before starts, longer starts first, shorter ends first; an end closes whatever is open on top,
    and what is still open at the end closes innermost first): the parent of each event (a position,
    -1 at the top) and the depth-first walk of the stack, entering position p as p and leaving it
    as ~p."""
    n = len(ts)
    t = np.concatenate([ts, end])
    typ = np.concatenate([np.ones(n, np.int8), np.zeros(n, np.int8)])
    third = np.concatenate([-dur, dur])
    fourth = np.concatenate([idx, -idx])
    order = np.lexsort((fourth, third, typ, t))
    is_start = (order < n).tolist()
    pos = (order % n).tolist() if n else []
    parent = [-1] * n
    walk: list[int] = []
    stack: list[int] = []
    for start, p in zip(is_start, pos):
        if start:
            parent[p] = stack[-1] if stack else -1
            stack.append(p)
            walk.append(p)
        elif stack:
            walk.append(~stack.pop())
    walk += [~p for p in reversed(stack)]
    return np.asarray(parent, dtype=np.int64), np.asarray(walk, dtype=np.int64)


def _cpu_edges(g: _Graph, hc: dict[str, np.ndarray], rows: np.ndarray, nodes: np.ndarray) -> None:
    """The CPU edges of every thread (see the module note), walking each call stack depth first.
    ``hc``: the host columns of :class:`PathInputs`; ``rows``: the step's positions in them, in
    order; ``nodes``: per host row, its (start, end) node, -1 for a row that is no node."""
    labels, tids, nodes = hc["label"][rows], hc["tid"][rows], nodes[rows]
    ts, end, dur, blocking = hc["ts"][rows], hc["end"][rows], hc["dur"][rows], hc["blocking"][rows]
    gts = np.asarray(g.ts)
    cpu, dep = KINDS.index("cpu"), KINDS.index("dependency")
    threads, first = np.unique(tids, return_index=True)
    for t in threads[np.argsort(first)]:  # in the order each thread first appears, as the events lie
        mine = np.flatnonzero(tids == t)
        parent, walk = _tour(ts[mine], end[mine], dur[mine], labels[mine])
        leave = walk < 0
        pos = np.where(leave, ~walk, walk)
        keep = nodes[mine[pos], 0] >= 0
        leave, pos = leave[keep], mine[pos[keep]]
        if len(pos) < 2:
            continue
        point = nodes[pos, np.where(leave, 1, 0)]
        depth = np.cumsum(np.where(leave, -1, 1))
        u, v = point[:-1], point[1:]
        to_top = leave[:-1] & (depth[:-1] == 0)  # a top-level operator ended: a dependency into the next
        up = parent[np.searchsorted(mine, pos[:-1])]
        charged = np.where(~leave[:-1], labels[pos[:-1]], np.where(leave[1:], labels[pos[1:]],
                           np.where(up >= 0, labels[mine[np.maximum(up, 0)]], -1)))  # fmt: skip
        zero = to_top | (leave[1:] & blocking[pos[1:]])
        w = np.where(zero, 0.0, np.maximum(gts[v] - gts[u], 0.0))
        g.edges(u, v, w, np.where(to_top, dep, cpu), np.where(to_top, -1, charged))


def _queues(k: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per activity, its stream's queue right after its launch and right after its start: launches
    (by a launch call, :data:`LAUNCHES`) up to then minus activities started up to then; NaN for an
    activity not launched by one."""
    at_launch, at_start = np.full(len(k), np.nan), np.full(len(k), np.nan)
    ok = k["launch_name"].isin(LAUNCHES).to_numpy() & k["launch_ts"].notna().to_numpy()
    streams = k["stream"].to_numpy()
    for s in np.unique(streams[ok]):
        sel = np.flatnonzero(ok & (streams == s))
        lt = np.sort(k["launch_ts"].to_numpy()[sel])
        st = np.sort(k["ts"].to_numpy()[sel])
        for t_col, out in (("launch_ts", at_launch), ("ts", at_start)):
            t = k[t_col].to_numpy()[sel]
            out[sel] = np.searchsorted(lt, t, side="right") - np.searchsorted(st, t, side="right")
    return at_launch, at_start


def _event_sources(trace: RankTrace, k: pd.DataFrame) -> tuple[dict[int, int], dict[int, int]]:
    """For ``Event Sync`` / ``Stream Wait Event`` (by the sync's correlation): the activity (row of
    ``k``) launched on the event's stream just before its ``cudaEventRecord``; for a ``Stream Wait
    Event`` also the next activity launched on the waiting stream from the wait call's thread."""
    sync = trace.sync
    if not len(sync) or "wait_record" not in sync:
        return {}, {}
    host = trace.host
    calls = host[host["correlation"] >= 0].drop_duplicates("correlation")
    call_ts = dict(zip(calls["correlation"].astype(int), calls["ts"]))
    call_tid = dict(zip(calls["correlation"].astype(int), calls["tid"].astype(str)))
    launched = k[k["launch_name"].isin(LAUNCHES) & k["launch_ts"].notna()].sort_values("launch_ts", kind="stable")
    by_stream = {int(st): (g["launch_ts"].to_numpy(), g.index.to_numpy()) for st, g in launched.groupby("stream")}
    by_thread = {(int(st), str(t)): (g["launch_ts"].to_numpy(), g.index.to_numpy())
                 for (st, t), g in launched.groupby(["stream", "launch_tid"])}  # fmt: skip
    src, dst = {}, {}
    for row in sync[sync["wait_record"].notna()].itertuples(index=False):
        rec, corr = int(row.wait_record), int(row.correlation)
        ts, rows = by_stream.get(int(row.wait_stream), (np.zeros(0), np.zeros(0, dtype=np.int64)))
        i = np.searchsorted(ts, call_ts.get(rec, -np.inf), side="right") - 1  # the last launch at or before it
        if rec not in call_ts or i < 0:
            continue
        src[corr] = int(rows[i])
        if row.name == "Stream Wait Event" and corr in call_ts:
            ts, rows = by_thread.get((int(row.stream), call_tid[corr]), (np.zeros(0), np.zeros(0, dtype=np.int64)))
            j = np.searchsorted(ts, call_ts[corr], side="right")  # the first launch after the wait call
            if j < len(ts):
                dst[corr] = int(rows[j])
    return src, dst


@dataclass
class PathInputs:
    """What the critical path of every step of one rank shares, computed once (:func:`path_inputs`):
    per activity its stream's queues (:func:`_queues`), the event syncs' sources and targets
    (:func:`_event_sources`), and the columns the graph reads."""

    host: dict[str, np.ndarray]  # label, ts, end, dur, tid (codes), node, blocking, correlation
    queue_at_launch: np.ndarray | None = None  # the GPU part: None on a trace without GPU activity
    queue_at_start: np.ndarray | None = None
    event_source: dict[int, int] | None = None  # sync correlation -> the activity its event recorded
    event_target: dict[int, int] | None = None  # Stream Wait Event correlation -> the activity that waits
    kernels: dict[str, np.ndarray] | None = None  # ts, end, stream, launch_ts, correlation; launched
    sync: dict[str, np.ndarray] | None = None  # correlation, name, stream, end


def path_inputs(trace: RankTrace, att: Attributed) -> PathInputs:
    """The step-independent part of :func:`critical_path` for one rank (see :class:`PathInputs`)."""
    host = trace.host
    hc = {"label": host.index.to_numpy(dtype=np.int64), "ts": host["ts"].to_numpy(float),
          "end": host["end"].to_numpy(float), "dur": host["dur"].to_numpy(float),
          "tid": pd.factorize(texts(host["tid"]), sort=False)[0],
          "node": host["cat"].isin(NODE_CATS).to_numpy(),
          "blocking": host["name"].isin(BLOCKING).to_numpy(),
          "correlation": host["correlation"].to_numpy()}  # fmt: skip
    k = att.kernels
    if not len(k) or att.rule != "gpu":
        return PathInputs(hc)
    qlr, qlk = _queues(k)
    src_of, dst_of = _event_sources(trace, k)
    cols = {c: k[c].to_numpy() for c in ("ts", "end", "stream", "launch_ts", "correlation")}
    cols["launched"] = k["launch_ts"].notna().to_numpy()
    sync = trace.sync
    scols = {"correlation": sync["correlation"].to_numpy(), "name": texts(sync["name"]),
             "stream": sync["stream"].to_numpy(), "end": sync["end"].to_numpy()}  # fmt: skip
    return PathInputs(hc, qlr, qlk, src_of, dst_of, cols, scols)


def _gpu_edges(g: _Graph, k: pd.DataFrame, sel: np.ndarray, host_nodes: dict, rt_row: dict, pin: PathInputs) -> None:
    """Per stream, each selected activity's duration and the launch delay or kernel gap before it;
    the sync edges (see the module note).  ``rt_row``: correlation -> host row of its runtime call."""
    qlr, qlk, src_of, dst_of = pin.queue_at_launch, pin.queue_at_start, pin.event_source, pin.event_target
    kc = pin.kernels
    ts, end, stream, launch, corr = kc["ts"], kc["end"], kc["stream"], kc["launch_ts"], kc["correlation"]
    chosen = np.flatnonzero(sel)
    pairs = g.pairs(-2 - chosen, ts[chosen].astype(float), end[chosen].astype(float))
    knodes = dict(zip(chosen.tolist(), map(tuple, pairs.tolist())))
    wait_for: dict[int, int] = {dst_of[c]: src_of[c] for c in dst_of if c in src_of}
    rows = [(float(t), 1, i) for t, i in zip(ts[chosen].tolist(), chosen.tolist())]
    sc = pin.sync
    s_corr, s_name, s_stream = sc["correlation"], sc["name"], sc["stream"]
    mine = np.flatnonzero(np.isin(s_corr, np.fromiter(rt_row, dtype=np.int64, count=len(rt_row))))
    rows += [(float(e), 0, j) for e, j in zip(sc["end"][mine].tolist(), mine.tolist())]
    rows.sort()
    last: dict[int, int] = {}
    for _, is_kernel, i in rows:
        if not is_kernel:
            c = int(s_corr[i])
            end_node = host_nodes[rt_row[c]][1]
            if s_name[i] in ("Context Sync", "Stream Sync"):
                froms = list(last.values()) if s_name[i] == "Context Sync" else [last.get(int(s_stream[i]))]
                for f in froms:
                    if f is not None:
                        g.edge(f, end_node, "sync")
            elif s_name[i] == "Event Sync" and src_of.get(c) in knodes:
                g.edge(knodes[src_of[c]][1], end_node, "sync")
            continue
        start, stop = knodes[i]
        g.edge(start, stop, "gpu", -2 - i)
        sync_end = None
        if wait_for.get(i) in knodes:
            sync_end = knodes[wait_for.pop(i)][1]
            g.edge(sync_end, start, "sync")
        prev = last.get(int(stream[i]))
        empty = qlr[i] == 1 and qlk[i] == 0  # nothing else queued on the stream at its launch
        after = (prev is None or g.ts[prev] < launch[i]) and (sync_end is None or g.ts[sync_end] < launch[i])
        if empty and after:
            g.edge(host_nodes[rt_row[int(corr[i])]][0], start, "launch delay")
        elif prev is not None and (sync_end is None or g.ts[sync_end] < g.ts[prev]):
            g.edge(prev, start, "kernel gap", g.node_event[prev])
        last[int(stream[i])] = stop


def _longest(g: _Graph) -> tuple[list[int], float]:
    """Edge indices of the longest path by weight (Kahn's order; an edge closing a cycle is dropped)."""
    n = len(g.ts)
    if not n:
        return [], 0.0
    src = np.asarray(g.src, dtype=np.int64)
    order = np.argsort(src, kind="stable")  # each node's out-edges, in the order they were added
    starts = np.searchsorted(src[order], np.arange(n + 1)).tolist()
    order = order.tolist()
    indeg = np.bincount(np.asarray(g.dst, dtype=np.int64), minlength=n).tolist()
    dst, w = g.dst, g.w
    dist = [0.0] * n
    via = [-1] * n
    queue = deque(u for u in range(n) if indeg[u] == 0)
    while queue:
        u = queue.popleft()
        du = dist[u]
        for e in order[starts[u] : starts[u + 1]]:
            v = dst[e]
            d = du + w[e]
            if d > dist[v] or via[v] < 0 and d >= dist[v]:
                dist[v], via[v] = d, e
            indeg[v] -= 1
            if indeg[v] == 0:
                queue.append(v)
    best = max(dist)
    end = dist.index(best)
    path = []
    while via[end] >= 0:
        path.append(via[end])
        end = g.src[via[end]]
    return path[::-1], float(best)


def critical_path(
    trace: RankTrace, att: Attributed, step: int | None = None, *, hta: bool = False, inputs: PathInputs | None = None
) -> CriticalPath:
    """The critical path of ``step`` (default: the median-duration step,
    :func:`lab_utils.traces.timeline.representative_step`; a trace without steps: its one window).

    ``hta=True`` keeps only one activity per launch call, its last, as HolisticTraceAnalysis 0.5
    does (a ``cudaGraphLaunch`` runs many kernels under one correlation id; HTA links the call to
    one of them and leaves the others out of the graph): for checking the two against each other.
    ``inputs``: :func:`path_inputs` of this rank, when many steps' paths are drawn."""
    step, lo, hi = _window(att, trace, step)
    pin = inputs if inputs is not None else path_inputs(trace, att)
    hc = pin.host
    rows = np.flatnonzero((hc["ts"] >= lo) & (hc["ts"] <= hi) & (hc["dur"] > 0))
    g = _Graph()
    is_node = hc["node"][rows]
    node_rows = rows[is_node]
    labels = hc["label"][node_rows]
    pairs = g.pairs(labels, hc["ts"][node_rows], hc["end"][node_rows])
    host_nodes = dict(zip(labels.tolist(), map(tuple, pairs.tolist())))
    nodes = np.full((len(hc["ts"]), 2), -1, dtype=np.int64)
    nodes[node_rows] = pairs
    _cpu_edges(g, hc, rows, nodes)
    corr = hc["correlation"][node_rows]
    has = corr >= 0
    rt_row = dict(zip(corr[has].astype(int).tolist(), labels[has].tolist()))
    k = att.kernels
    if pin.kernels is not None:
        wanted = np.fromiter(rt_row, dtype=np.int64, count=len(rt_row))
        sel = np.isin(pin.kernels["correlation"], wanted) & pin.kernels["launched"]
        if hta:
            last = k.loc[sel].sort_values("ts", kind="stable").drop_duplicates("correlation", keep="last").index
            sel = k.index.isin(last)
        _gpu_edges(g, k, sel, host_nodes, rt_row, pin)
    path, length = _longest(g)
    return CriticalPath(att.rank, step, hi - lo, length, _edges_table(g, path, trace.host, k), len(g.ts), len(g.src))


def _edges_table(g: _Graph, path: list[int], host: pd.DataFrame, k: pd.DataFrame) -> pd.DataFrame:
    """The path's edges as a table (see :class:`CriticalPath`), built column by column."""
    e = np.asarray(path, dtype=np.int64)
    kind = np.asarray(KINDS, dtype=object)[np.asarray(g.kind, dtype=np.int64)[e]] if len(e) else np.zeros(0, object)
    ev = np.asarray(g.event, dtype=np.int64)[e] if len(e) else np.zeros(0, np.int64)
    ts = np.asarray(g.ts)
    out = pd.DataFrame({"kind": pd.Series(kind, dtype=object), "weight": np.asarray(g.w)[e] if len(e) else np.zeros(0),
                        "name": "", "where": "", "category": kind.copy(), "bound_by": [BOUND.get(x, "") for x in kind],
                        "stream": -1, "start_us": ts[np.asarray(g.src)[e]] if len(e) else np.zeros(0),
                        "end_us": ts[np.asarray(g.dst)[e]] if len(e) else np.zeros(0)})  # fmt: skip
    on_host, on_gpu = ev >= 0, ev <= -2
    name, where = np.full(len(e), "", dtype=object), np.full(len(e), "", dtype=object)
    category, bound = out["category"].to_numpy(dtype=object), out["bound_by"].to_numpy(dtype=object)
    stream = np.full(len(e), -1, dtype=np.int64)
    if on_host.any():
        at = host.index.get_indexer(ev[on_host])  # two columns of the path's rows, not every column of all
        name[on_host] = texts(host["name"].take(at))
        where[on_host] = ["thread " + t for t in texts(host["tid"].take(at))]
        category[on_host], bound[on_host] = "CPU", "cpu_bound"
    if on_gpu.any():
        pos = -2 - ev[on_gpu]
        name[on_gpu] = texts(k["name"].iloc[pos])
        streams = k["stream"].to_numpy()[pos]
        stream[on_gpu] = streams
        where[on_gpu] = [f"stream {x}" for x in streams]
        gpu = on_gpu & (kind == "gpu")
        gpos = -2 - ev[gpu]
        category[gpu] = texts(k["category"].iloc[gpos])
        comm = k["hta_type"].iloc[gpos].to_numpy() == "COMMUNICATION"
        bound[gpu] = np.where(comm, "gpu_communication_bound", "gpu_compute_bound")
    out["stream"] = stream
    for key, col in (("name", name), ("where", where), ("category", category), ("bound_by", bound)):
        out[key] = pd.Series(col, index=out.index, dtype=object)  # kept as Python text: no Arrow copy
    return out
