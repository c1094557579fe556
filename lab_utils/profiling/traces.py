"""Reading a torch.profiler Chrome trace: steps, phases, kernel categories, top
operators and the allocation curve (what :mod:`lab_utils.profiling.profiler` reports).

* steps: ``ProfilerStep#k`` ranges; phases: the named ranges the trainer opens
  (``lab_utils.model.train.PHASES``), summed per step, from the host timeline only
  (CUDA traces repeat them as ``gpu_user_annotation``).
* categories: on CUDA from device kernels (kernel name, else the op that launched it);
  on CPU from operators' *self* time (nesting removed, so nothing is counted twice).  Names are
  categorised by the operator table of :mod:`lab_utils.traces.categories` (``OPERATOR_RULES``, the
  table lab 09's CPU rule uses too), into this module's coarser :data:`CATEGORIES`.
  ``idle/gap`` is step time not covered by any kernel (CUDA) or operator (CPU).
* every figure is also kept per profiled step (``phases``, ``categories_by_step``,
  ``top_ops_by_step``): the samples a figure's noise is judged from.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lab_utils.model.train import PHASES
from lab_utils.traces.attribute import attribute
from lab_utils.traces.categories import operator_category
from lab_utils.traces.reader import read_rank

CATEGORIES = (
    "matmul",
    "attention",
    "normalization",
    "elementwise/activation",
    "reduction",
    "copy/cast",
    "communication",
    "optimizer",
    "other",
)
IDLE = "idle/gap"

_AUTOGRAD = re.compile(r"^(autograd::|torch::autograd::)|Backward\d+$")


def categorize(name: str, op: str = "", under_optimizer: bool = False) -> str:
    """Kernel-category of a kernel or operator name (``op``: the operator that launched a
    kernel, used when the kernel's own name says nothing)."""
    if under_optimizer:
        return "optimizer"
    if _AUTOGRAD.search(name):
        return "other"  # autograd-engine wrappers: their self time is bookkeeping
    for text in (name, op):
        if not text:
            continue
        cat = operator_category(text)  # the one operator table, in lab_utils.traces.categories
        if cat != "other":
            return cat
    return "other"


# --------------------------------------------------------------------------------------
# Trace parsing
# --------------------------------------------------------------------------------------


@dataclass
class _Ev:
    name: str
    cat: str
    ts: float
    dur: float
    tid: Any
    ext: Any = None
    child: float = 0.0
    opt: bool = False
    phase: str | None = None
    parent_op: str = ""

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def self_us(self) -> float:
        return max(self.dur - self.child, 0.0)


def _nest(events: list[_Ev]) -> None:
    """Per thread: direct-children time, optimizer ancestry, enclosing phase, launching op."""
    by_tid: dict[Any, list[_Ev]] = defaultdict(list)
    for e in events:
        by_tid[e.tid].append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e.ts, -e.dur))
        stack: list[_Ev] = []
        for e in evs:
            while stack and stack[-1].end <= e.ts + 1e-3:
                stack.pop()
            if stack:
                p = stack[-1]
                p.child += e.dur
                e.opt = p.opt
                e.phase = p.phase
                e.parent_op = p.parent_op if p.cat != "cpu_op" else (p.parent_op or p.name)
            if e.name.startswith("Optimizer.step") or e.name.startswith("Optimizer.zero_grad"):
                e.opt = True
            if e.name in PHASES:
                e.phase = e.name
            stack.append(e)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


@dataclass
class TraceAnalysis:
    device_kind: str  # "cuda" | "cpu"
    source: str  # "cuda kernels" | "cpu operators (self time)"
    steps: pd.DataFrame  # step, step_ms, phase_sum_ms, coverage, busy_ms, idle_ms
    phases: pd.DataFrame  # step, phase, ms
    categories: pd.DataFrame  # category, ms, pct_of_step
    top_ops: pd.DataFrame  # name, category, calls, ms, pct_of_step
    memory: pd.DataFrame  # t_ms, allocated_mb
    peak_allocated_bytes: float
    categories_by_step: pd.DataFrame  # step, category, ms
    top_ops_by_step: pd.DataFrame | None = None  # step, name, ms (the top operators, 0 where absent)
    top_n: int = 15  # how many operators top_ops keeps (fewer: the step ran no more)


def _read(path: str | Path, device_kind: str | None):
    """Host events (nested), GPU activities with their launching op and step, step windows.

    Reading, launch attribution and step windows come from :mod:`lab_utils.traces` (``.json``
    and ``.json.gz``; a trace without ``ProfilerStep`` ranges is one window, step 0).  A kernel
    is charged to the step that launched it; one whose launch the trace lacks, to the step it ran in."""
    rt = read_rank(path)
    host_df = rt.host[rt.host["cat"].astype(str).isin(("cpu_op", "user_annotation", "python_function"))]
    host = [
        _Ev(str(n), str(c), float(ts), float(d), str(t), int(x) if x >= 0 else None)
        for n, c, ts, d, t, x in zip(
            host_df["name"], host_df["cat"], host_df["ts"], host_df["dur"], host_df["tid"], host_df["external_id"]
        )
    ]
    by_index = dict(zip(host_df.index, host))
    _nest(host)
    att = attribute(rt)
    windows = [(int(r.step), float(r.ts), float(r.end)) for r in att.steps.itertuples()]
    if device_kind is None:
        device_kind = "cuda" if len(rt.gpu) else "cpu"
    kernels = []
    for k in att.kernels.itertuples():
        op = by_index.get(k.op_index)
        step = int(k.step) if k.window == "step" else _step_of(windows, float(k.ts)) if np.isnan(k.launch_ts) else None
        kernels.append((str(k.name), op, float(k.ts), float(k.dur), step))
    return rt, host, kernels, windows, device_kind


def _step_of(windows: list[tuple[int, float, float]], ts: float) -> int | None:
    for k, s, t in windows:
        if s <= ts < t:
            return k
    return None


#: one work item of a step: (name, launching op or its own name, category, duration us, start, end, step)
_Item = tuple[str, str, str, float, float, float, "int | None"]


def analyse_trace(path: str | Path, device_kind: str | None = None, *, top: int = 15) -> TraceAnalysis:
    """Analyse a Chrome trace written by ``torch.profiler`` (see the module note)."""
    rt, host, kernels, windows, device_kind = _read(path, device_kind)
    phases = _phases(host, windows)
    items, source = _items(host, kernels, windows, device_kind)
    steps = _steps(items, windows, phases, device_kind)
    in_steps = [it for it in items if it[6] is not None]
    categories, categories_by_step = _categories(in_steps, steps, windows)
    top_ops, top_by_step = _top_ops(in_steps, windows, float(steps.step_ms.sum()), top)
    memory, peak = _memory(rt, windows, device_kind)
    return TraceAnalysis(
        device_kind, source, steps, phases, categories, top_ops, memory, peak, categories_by_step, top_by_step, top
    )


def _phases(host: list[_Ev], windows) -> pd.DataFrame:
    """The trainer's named ranges, summed per step (step, phase, ms)."""
    prow = []
    for e in host:
        if e.cat == "user_annotation" and e.name in PHASES:
            k = _step_of(windows, e.ts)
            if k is not None:
                prow.append(dict(step=k, phase=e.name, ms=e.dur / 1e3))
    phases = pd.DataFrame(prow, columns=["step", "phase", "ms"])
    if len(phases):
        phases = phases.groupby(["step", "phase"], as_index=False, sort=False)["ms"].sum()
    return phases


def _items(host: list[_Ev], kernels, windows, device_kind: str) -> tuple[list[_Item], str]:
    """The work a step's time is split into: device kernels on CUDA, operators' self time on CPU."""
    items = []
    if device_kind == "cuda":
        for name, op, ts, dur, step in kernels:
            opname = op.name if op is not None else ""
            cat = categorize(name, opname, bool(op and op.opt))
            items.append((name, opname or name, cat, dur, ts, ts + dur, step))
        return items, "cuda kernels"
    for e in host:
        if e.cat != "cpu_op":
            continue
        cat = categorize(e.name, e.parent_op, e.opt)
        items.append((e.name, e.name, cat, e.self_us, e.ts, e.end, _step_of(windows, e.ts)))
    return items, "cpu operators (self time)"


def _steps(items: list[_Item], windows, phases: pd.DataFrame, device_kind: str) -> pd.DataFrame:
    """Per step: its time, the phases' sum and coverage, busy (the union of its items) and idle."""
    srow = []
    for k, s, t in windows:
        step_us = t - s
        mine = [it for it in items if it[6] == k]
        if device_kind == "cuda":
            busy = _union_us([(max(it[4], s), min(it[5], t)) for it in mine])
        else:
            busy = _union_us([(it[4], min(it[5], t)) for it in mine])
        ph = phases[phases.step == k].ms.sum() if len(phases) else 0.0
        srow.append(
            dict(
                step=k,
                step_ms=step_us / 1e3,
                phase_sum_ms=ph,
                coverage=ph / (step_us / 1e3),
                busy_ms=busy / 1e3,
                idle_ms=max(step_us - busy, 0.0) / 1e3,
            )
        )
    return pd.DataFrame(srow)


def _categories(in_steps: list[_Item], steps: pd.DataFrame, windows) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Time per category (with idle) over the steps, and per step."""
    cat_ms = defaultdict(float)
    per_step = defaultdict(float)
    for it in in_steps:
        cat_ms[it[2]] += it[3] / 1e3
        per_step[(it[6], it[2])] += it[3] / 1e3
    by_step = [dict(step=k, category=c, ms=per_step.get((k, c), 0.0)) for k, _, _ in windows for c in CATEGORIES]
    by_step += [dict(step=r.step, category=IDLE, ms=r.idle_ms) for r in steps.itertuples()]
    crow = [dict(category=c, ms=cat_ms.get(c, 0.0)) for c in CATEGORIES]
    crow.append(dict(category=IDLE, ms=float(steps.idle_ms.sum())))
    categories = pd.DataFrame(crow)
    categories["pct_of_step"] = 100 * categories.ms / float(steps.step_ms.sum())
    return categories, pd.DataFrame(by_step)


def _top_ops(in_steps: list[_Item], windows, total_step_ms: float, top: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ``top`` operators by time (calls, ms, % of step), and each one's time per step."""
    agg: dict[str, list] = {}
    for it in in_steps:
        a = agg.setdefault(it[1], [it[2], 0, 0.0])
        a[1] += 1
        a[2] += it[3] / 1e3
    top_ops = pd.DataFrame(
        [dict(name=n, category=c, calls=cnt, ms=ms) for n, (c, cnt, ms) in agg.items()],
        columns=["name", "category", "calls", "ms"],
    )
    top_ops = top_ops.sort_values("ms", ascending=False).head(top).reset_index(drop=True)
    top_ops["pct_of_step"] = 100 * top_ops.ms / total_step_ms
    op_step = defaultdict(float)
    for it in in_steps:
        op_step[(it[6], it[1])] += it[3] / 1e3
    top_by_step = pd.DataFrame(
        [dict(step=k, name=n, ms=op_step.get((k, n), 0.0)) for k, _, _ in windows for n in top_ops.name],
        columns=["step", "name", "ms"],
    )
    return top_ops, top_by_step


def _memory(rt, windows, device_kind: str) -> tuple[pd.DataFrame, float]:
    """The allocation curve from the first step's start (binned to its running max past 3000
    points, so plots stay light and peaks are kept) and the peak allocated bytes."""
    want = 1 if device_kind == "cuda" else 0
    t0 = windows[0][1]
    m = rt.memory[rt.memory["device_type"] == want].sort_values("ts")
    mrow = list(zip(m["ts"].astype(float), m["allocated"].astype(float)))
    memory = pd.DataFrame(
        [dict(t_ms=(ts - t0) / 1e3, allocated_mb=b / 2**20) for ts, b in mrow], columns=["t_ms", "allocated_mb"]
    )
    peak = max((b for _, b in mrow), default=float("nan"))
    if len(memory) > 3000:
        memory["bin"] = (memory.t_ms / (memory.t_ms.max() / 1500 + 1e-9)).astype(int)
        memory = memory.groupby("bin", as_index=False).agg(t_ms=("t_ms", "first"), allocated_mb=("allocated_mb", "max"))
        memory = memory.drop(columns="bin")
    return memory, peak
