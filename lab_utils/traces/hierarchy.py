"""GPU time up the host's call tree: user ranges and nn.Module ranges -> operators -> kernels.

The tree (TraceLens' "tree perf" view) of one rank, from its host events:

* **nodes**: the user ranges (``user_annotation``: ``## forward ##``, ``record_function``), the
  Python frames (``python_function``: ``nn.Module: Linear_0`` when the profiler recorded modules)
  and the CPU operators (``cpu_op``), each thread's nested by time (a node's parent is the
  innermost event enclosing it on its thread); ``ProfilerStep#N`` is named ``ProfilerStep``, so the
  steps add up;
* **other threads** (autograd's backward thread, a data-loader thread): an outermost node of
  another thread hangs under the innermost range or frame of the *main* thread (the one holding
  the steps) enclosing its start, the rule :mod:`lab_utils.traces.attribute` gives user ranges, so
  the backward's operators appear under ``## backward ##``;
* **kernels** are leaves: each activity under the operator that launched it (its ``op_index``),
  else under the innermost node enclosing its launch on the launch thread, else under ``(no
  host event)`` at the top.

Per node: ``gpu_self_us`` is the time of the activities hung directly under it, ``gpu_total_us``
that of its whole subtree, ``cpu_us`` its own host duration.  :func:`tree` adds the nodes up by
*path* (the names from the top down), so 48 calls of ``aten::linear`` under one range are one row
with ``count`` 48; kernels are leaf rows under their node, added up by name.  Invariants
(tests/unit/traces/test_hierarchy_rules.py): a node's ``gpu_total_us`` is the sum of its children's, kernel
leaves included; its ``gpu_self_us`` that of its kernel leaves; the top rows add up to the
selection's kernel time.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from lab_utils.traces.attribute import Attributed
from lab_utils.traces.reader import RankTrace, texts

NODE_CATS = ("user_annotation", "python_function", "cpu_op")
SEP = " > "
NO_HOST = "(no host event)"
_STEP = re.compile(r"^ProfilerStep\s*#\s*\d+$")
_KIND = {"user_annotation": "range", "python_function": "module", "cpu_op": "op"}


def _parents(nodes: pd.DataFrame) -> np.ndarray:
    """Parent row (or -1) of every node within its thread, nested by (ts, -dur): the innermost
    node still open at its start (a stack per thread, walked once over all threads in order)."""
    n = len(nodes)
    parent = np.full(n, -1, dtype=np.int64)
    if not n:
        return parent
    tid = pd.factorize(texts(nodes["tid"]))[0]
    ts, end = nodes["ts"].to_numpy(dtype=np.float64), nodes["end"].to_numpy(dtype=np.float64)
    order = np.lexsort((-nodes["dur"].to_numpy(dtype=np.float64), ts, tid))  # by thread, start, longest first
    out = [-1] * n
    ends: list[float] = []
    rows: list[int] = []
    last = -1
    for i, (t, a, b, row) in enumerate(zip(tid[order].tolist(), ts[order].tolist(), end[order].tolist(),
                                           order.tolist())):  # fmt: skip
        if t != last:
            ends.clear()
            rows.clear()
            last = t
        while ends and ends[-1] <= a:
            ends.pop()
            rows.pop()
        if rows:
            out[i] = rows[-1]
        ends.append(b)
        rows.append(row)
    parent[order] = out
    return parent


def _innermost(times: np.ndarray, cand: pd.DataFrame, positions: np.ndarray) -> np.ndarray:
    """For each time, the position (in ``positions``) of the shortest ``cand`` interval holding it, or -1."""
    out = np.full(len(times), -1, dtype=np.int64)
    if not len(cand) or not len(times):
        return out
    order = np.argsort(times, kind="stable")
    st = times[order]
    by_len = np.argsort(-cand["dur"].to_numpy(), kind="stable")  # outermost first, inner ones overwrite
    lo = np.searchsorted(st, cand["ts"].to_numpy()[by_len], side="left")
    hi = np.searchsorted(st, cand["end"].to_numpy()[by_len], side="left")
    for a, b, p in zip(lo, hi, positions[by_len]):
        if b > a:
            out[order[a:b]] = p
    return out


def _node_arrays(trace: RankTrace, att: Attributed, k: pd.DataFrame) -> dict[str, np.ndarray]:
    """:func:`node_table`'s columns as arrays."""
    host = trace.host
    cat = texts(host["cat"])
    keep = np.isin(cat, NODE_CATS) & (host["dur"].to_numpy() >= 0)
    nodes = host[keep]
    cat = cat[keep]
    parent = _parents(nodes)
    names = texts(nodes["name"])
    inv, distinct = pd.factorize(names)  # codes into the distinct names (hashing: no sort of the texts)
    steps = np.array([bool(_STEP.match(n)) for n in distinct], dtype=bool)
    names[steps[inv]] = "ProfilerStep"
    cat_inv, cats = pd.factorize(cat)
    kinds = np.array([_KIND[c] for c in cats], dtype=object)[cat_inv]
    tids = texts(nodes["tid"])
    if att.main_tid is not None:  # other threads' outermost nodes under the main thread's ranges
        main = (tids == att.main_tid) & (kinds != "op")
        graft = np.flatnonzero((parent < 0) & (tids != att.main_tid))
        inner = _innermost(nodes["ts"].to_numpy()[graft], nodes[main], np.flatnonzero(main))
        parent[graft] = inner
    pos = pd.Series(np.arange(len(nodes)), index=nodes.index)
    # each activity: under its operator, else the innermost node around its launch on its thread
    op_pos = k["op_index"].map(pos).to_numpy(dtype=np.float64) if len(k) else np.zeros(0)
    kp = np.where(np.isnan(op_pos), -1, op_pos).astype(np.int64)
    missing = np.flatnonzero((kp < 0) & k["launch_ts"].notna().to_numpy())
    for tid in pd.unique(k["launch_tid"].to_numpy()[missing]) if len(missing) else []:
        sel = missing[k["launch_tid"].to_numpy()[missing] == tid]
        mine = tids == str(tid)
        kp[sel] = _innermost(k["launch_ts"].to_numpy()[sel], nodes[mine], np.flatnonzero(mine))
    n = len(nodes)
    out = {"name": np.concatenate([names, texts(k["name"])]),
           "kind": np.concatenate([kinds, np.full(len(k), "kernel", dtype=object)]),
           "parent": np.concatenate([parent, kp]),
           "cpu_us": np.concatenate([nodes["dur"].to_numpy(), np.zeros(len(k))]),
           "gpu_us": np.concatenate([np.zeros(n), k["dur"].to_numpy()])}  # fmt: skip
    orphan = np.flatnonzero((out["parent"] < 0) & (out["kind"] == "kernel"))
    if len(orphan):
        for key, v in (("name", NO_HOST), ("kind", "range"), ("parent", -1), ("cpu_us", 0.0), ("gpu_us", 0.0)):
            out[key] = np.append(out[key], np.array([v], dtype=out[key].dtype))
        out["parent"][orphan] = len(out["parent"]) - 1
    return out


def node_table(trace: RankTrace, att: Attributed, k: pd.DataFrame) -> pd.DataFrame:
    """One row per host node and per activity of ``k``: name, kind, parent (row), cpu_us, gpu_us
    (see the module note)."""
    return pd.DataFrame(_node_arrays(trace, att, k))


def tree(trace: RankTrace, att: Attributed, k: pd.DataFrame) -> pd.DataFrame:
    """The call tree of ``k``'s activities added up by path (see the module note): path, depth,
    name, kind, parent (its parent's path), count, gpu_total_us, gpu_self_us, cpu_us, kernels,
    gpu_pct (of the selection's kernel time); only paths holding GPU time, in depth-first order,
    the largest first among siblings."""
    t = _node_arrays(trace, att, k)
    parent = t["parent"]
    n = len(parent)
    depth = _depths(parent)
    levels = [np.flatnonzero(depth == d) for d in range(int(depth.max()) + 1)] if n else []
    total = t["gpu_us"].copy()
    kernels = (t["kind"] == "kernel").astype(np.int64)
    for lvl in levels[:0:-1]:  # the deepest first: children before parents
        np.add.at(total, parent[lvl], total[lvl])
        np.add.at(kernels, parent[lvl], kernels[lvl])
    self_gpu = np.zeros(n)
    is_k = t["kind"] == "kernel"
    np.add.at(self_gpu, parent[is_k & (parent >= 0)], t["gpu_us"][is_k & (parent >= 0)])
    held = total > 0  # a node holding GPU time: its ancestors hold it too, so their paths are built
    path, paths = _path_ids(t["name"], parent, levels, held)
    h = np.flatnonzero(held)
    kind_code, kinds = pd.factorize(t["kind"][h])
    # one row per (path, kind), numbered in the order the nodes first appear
    row, first = pd.factorize(path[h] * max(len(kinds), 1) + kind_code)
    g = pd.DataFrame({"row": row, "count": np.ones(len(h), dtype=np.int64), "gpu_total_us": total[h],
                      "gpu_self_us": np.where(is_k, t["gpu_us"], self_gpu)[h], "cpu_us": t["cpu_us"][h],
                      "kernels": kernels[h]}).groupby("row", sort=True).sum()  # fmt: skip
    pid = first // max(len(kinds), 1)
    g.insert(0, "path", paths["path"][pid])
    g.insert(1, "name", paths["name"][pid])
    g.insert(2, "kind", np.asarray(kinds, dtype=object)[first % max(len(kinds), 1)])
    g["depth"] = paths["depth"][pid]
    g["parent"] = paths["parent"][pid]
    g = g.reset_index(drop=True)
    all_k = float(k["dur"].sum())
    g["gpu_pct"] = 100.0 * g["gpu_total_us"] / all_k if all_k > 0 else 0.0
    return _dfs_order(g)[["path", "depth", "name", "kind", "parent", "count", "gpu_total_us", "gpu_self_us",
                          "cpu_us", "kernels", "gpu_pct"]]  # fmt: skip


def _path_ids(names: np.ndarray, parent: np.ndarray, levels: list[np.ndarray], held: np.ndarray):
    """Each held node's path as an id (its parent's path and its own name, level by level), and
    per id its text, name, depth and parent's text."""
    code, distinct = pd.factorize(names)
    width = max(len(distinct), 1)
    path = np.full(len(names), -1, dtype=np.int64)
    up, own, depth = [], [], []
    for d, lvl in enumerate(levels):
        lvl = lvl[held[lvl]]
        above = path[parent[lvl]] if d else np.full(len(lvl), -1, dtype=np.int64)
        u, inv = np.unique((above + 1) * width + code[lvl], return_inverse=True)
        path[lvl] = sum(len(x) for x in up) + inv
        up.append(u // width - 1)
        own.append(u % width)
        depth.append(np.full(len(u), d, dtype=np.int64))
    up_ = np.concatenate(up) if up else np.zeros(0, dtype=np.int64)
    name = np.asarray(distinct, dtype=object)[np.concatenate(own)] if own else np.zeros(0, dtype=object)
    text = np.empty(len(up_), dtype=object)
    for i in range(len(up_)):  # parents have smaller ids than their children
        text[i] = name[i] if up_[i] < 0 else text[up_[i]] + SEP + name[i]
    above = np.where(up_ >= 0, text[np.clip(up_, 0, None)] if len(up_) else text, "")
    return path, {"path": text, "name": name, "depth": np.concatenate(depth) if depth else up_, "parent": above}


def _depths(parent: np.ndarray) -> np.ndarray:
    """Each node's depth (0: no parent), following the parent links one level at a time."""
    depth = np.zeros(len(parent), dtype=np.int64)
    up = parent.copy()
    while True:
        live = np.flatnonzero(up >= 0)
        if not len(live):
            return depth
        depth[live] += 1
        up[live] = parent[up[live]]


def _dfs_order(g: pd.DataFrame) -> pd.DataFrame:
    kids: dict[str, list[int]] = {}
    for i, p in enumerate(g["parent"]):
        kids.setdefault(p, []).append(i)
    tot = g["gpu_total_us"].to_numpy()
    paths = g["path"].to_numpy(dtype=object)
    out, todo = [], sorted(kids.get("", []), key=lambda i: tot[i])
    while todo:
        i = todo.pop()
        out.append(i)
        todo += sorted(kids.get(paths[i], []), key=lambda j: tot[j])
    return g.iloc[out].reset_index(drop=True)


def top_levels(t: pd.DataFrame, depth: int = 3, min_pct: float = 1.0) -> pd.DataFrame:
    """The tree's rows down to ``depth`` holding at least ``min_pct`` % of the GPU time."""
    return t[(t["depth"] < depth) & (t["gpu_pct"] >= min_pct)]
