"""The CPU rule: how a trace recorded with CPU activity only is read as if it had kernels.

A ``torch.profiler`` trace recorded without ``ProfilerActivity.CUDA`` (a CPU run, gloo ranks)
has no kernel, ``gpu_memcpy`` or ``gpu_memset``: every figure of :class:`TraceAnalysis` would be
empty.  When a rank's trace has no GPU activity at all, its *device activity* is taken from the
host timeline instead, by this rule (applied per rank, never to a trace that has GPU activity):

* **activities**: the *leaf* operators: ``cpu_op`` events that enclose no other ``cpu_op`` on
  their thread (so no time is counted twice: a parent's time is its children's plus its own
  bookkeeping, which the rule leaves out as idle);
* **kernel-like operators are whole**: an operator of category communication (``c10d::*``,
  ``record_param_comms``), matmul (``aten::linear``, ``addmm``, ``mm``, ``bmm``), attention
  (``scaled_dot_product_attention``) or normalization (``layer_norm``) with no such operator around
  it stands as one activity, whatever it encloses (the operators inside it are not counted again):
  on CPU ``aten::addmm`` encloses ``expand``/``copy_`` calls, and leaves alone would put a
  matmul's own time nowhere.  Autograd's wrappers (``autograd::...``, ``AddmmBackward0``) are never
  whole: the operators they call are.  The backend's own ranges (``gloo:all_reduce``, ``mpi:...``, ``ucc:...``, a
  ``user_annotation`` on the backend's worker thread for as long as the transfer runs) are
  activities too: they are the transfer itself, where the ``c10d`` operator on the main thread is
  its enqueue (or its wait, for a blocking call);
* each activity is **launched by itself**: ``launch_ts`` = its start, ``launch_tid`` = its thread,
  ``op`` = its own name; step, window, user ranges and phase are then attributed by the same
  rules as a kernel's (:mod:`lab_utils.traces.attribute`): the ``ProfilerStep`` and the ranges
  enclosing its start;
* its **stream** is its thread (the thread id as a number; ``-1`` where the id is not one);
* **category** and **HTA type** come from the operator's name
  (:func:`lab_utils.traces.categories.operator_category` / ``operator_hta_type``): matmuls,
  ``linear``, SDPA ... are ``COMPUTATION``; copies, ``to``, ``cat`` ``MEMORY``; ``c10d``/``gloo``
  collectives ``COMMUNICATION``; views and allocations ``OTHER``.

Consequences, said where they are shown: queue delay is 0 and the launch-bound verdict does not
apply (:class:`~lab_utils.traces.analysis.TraceAnalysis` says so); idle is the time of the step not
under any leaf operator on any thread (Python, the autograd engine's bookkeeping, the parents' own
time); collectives' sizes are the ``In msg nelems``/``dtype`` of ``record_param_comms`` where
recorded, else the input tensors' ``Input Dims``/``Input type`` (``record_shapes=True``).
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from lab_utils.traces.categories import operator_category
from lab_utils.traces.reader import RankTrace

RULE = "cpu"  # the name TraceAnalysis shows for ranks read by this rule ("gpu": GPU activities)
RULE_TEXT = "CPU trace, read by the CPU rule: leaf CPU operators stand as kernels, one stream per thread"
BACKEND_RANGE = re.compile(r"^(gloo|mpi|ucc):")


def applies(trace: RankTrace) -> bool:
    """True when the rank's trace has no GPU activity (no kernel, memcpy or memset)."""
    return not len(trace.gpu)


WHOLE = ("communication", "matmul", "attention", "normalization")
_AUTOGRAD = re.compile(r"^(autograd::|torch::autograd::)|Backward\d+$")


def is_whole(name: str) -> bool:
    """An operator that stands whole under the CPU rule (see the module note)."""
    return operator_category(name) in WHOLE and not _AUTOGRAD.search(name)


def _selected(ts: np.ndarray, end: np.ndarray, whole: np.ndarray) -> np.ndarray:
    """For one thread's operators sorted by (ts, -dur): leaves outside any whole operator, and
    whole operators outside any other one (see the module note)."""
    n = len(ts)
    nxt = np.append(ts[1:], np.inf)
    leaf = nxt >= end  # the next operator starts after this one ends: it encloses nothing
    inside = np.zeros(n, dtype=bool)  # under a whole operator
    whole_end = -np.inf
    for i in range(n):  # a whole operator's descendants are the operators starting before its end
        if ts[i] < whole_end:
            inside[i] = True
        elif whole[i]:
            whole_end = end[i]
    return (leaf | whole) & ~inside


def activities(trace: RankTrace) -> pd.DataFrame:
    """The rank's activities under the CPU rule, in the reader's ``gpu`` table layout plus
    ``host_index`` (the row of ``trace.host`` each one is)."""
    host = trace.host
    cat = host["cat"].astype(str)
    names = host["name"].astype(str)
    ops = host[cat.eq("cpu_op")]
    keep: list[np.ndarray] = []
    for _, grp in ops.groupby(ops["tid"].astype(str)):
        g = grp.sort_values(["ts", "dur"], ascending=[True, False], kind="stable")
        whole = np.array([is_whole(n) for n in g["name"].astype(str)], dtype=bool)
        keep.append(g.index.to_numpy()[_selected(g["ts"].to_numpy(), g["end"].to_numpy(), whole)])
    ranges = host.index[cat.eq("user_annotation") & names.str.match(BACKEND_RANGE.pattern)].to_numpy()
    idx = np.sort(np.concatenate(keep + [ranges])) if keep or len(ranges) else np.zeros(0, dtype=np.int64)
    out = host.loc[idx].copy()
    out["host_index"] = idx
    out["stream"] = [_thread_number(t) for t in out["tid"].astype(str)]
    out["device"] = -1
    out["correlation"] = -1
    return out.reset_index(drop=True)


def _thread_number(tid: str) -> int:
    try:
        return int(tid)
    except ValueError:
        return -1


def launch_columns(k: pd.DataFrame) -> pd.DataFrame:
    """Each activity launched by itself: launch_ts = ts, launch_tid = its thread, op = its name."""
    k["launch_ts"] = k["ts"].to_numpy(dtype=np.float64)
    k["launch_dur"] = 0.0
    k["launch_tid"] = k["tid"].astype(str).to_numpy()
    k["launch_name"] = k["name"].astype(str).to_numpy()
    k["op_index"] = k["host_index"].to_numpy(dtype=np.int64)
    k["op"] = k["name"].astype(str).to_numpy().astype(object)
    return k.drop(columns="host_index")
