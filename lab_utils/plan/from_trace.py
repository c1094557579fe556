"""A measured step for lab 08's planner from a real profiler trace.

:func:`profile_from_trace` turns one rank of a trace (:class:`lab_utils.traces.TraceAnalysis`)
into the :class:`lab_utils.plan.planner.StepProfile` the planner plans from:

* each ``ProfilerStep`` is one sample; its length is the host-side step window;
* a phase's time per step is the GPU time of the activities *launched* inside that phase's
  ranges in that step (``TraceAnalysis.phases``), the trace's phases mapped to the planner's by
  :data:`TRACE_TO_PLAN` (a trace names one ``encoders`` phase: it goes to ``text_encoding``, the
  planner's first encoder phase; communication has no lever here and stays in ``other``);
* ``other`` is the rest of the step window (host time, idle, unattributed kernels), so the
  phases sum to the step;
* the figure per phase is the median (or min) over the steps, its spread ``(p80 - p20) / figure``.

FLOPs, tokens and peak memory are not in a trace's phase times: pass them when known, else
they are NaN and the planner's figures that need them say so.
"""

from __future__ import annotations

import math

import numpy as np

from lab_utils.core.config import ConfigError
from lab_utils.core.timing import judge_samples
from lab_utils.plan.planner import ALL_PHASES, OTHER, STATISTICS, StepProfile
from lab_utils.traces import TraceAnalysis

#: trace phase (lab_utils.traces.phases.PHASES) -> planner phase (lab_utils.model.train.PHASES)
TRACE_TO_PLAN = {
    "data": "data_loading",
    "encoders": "text_encoding",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
    "checkpoint": "checkpoint",
}


def profile_from_trace(
    trace,
    *,
    rank: int | None = None,
    statistic: str = "median",
    flops: float = math.nan,
    tokens: float = math.nan,
    peak_mib: float = math.nan,
) -> StepProfile:
    """``trace``: a path (file or folder) or a :class:`TraceAnalysis`; ``rank``: default the first."""
    if statistic not in STATISTICS:
        raise ConfigError("statistic", statistic, "one of " + ", ".join(STATISTICS))
    ta = trace if isinstance(trace, TraceAnalysis) else TraceAnalysis(trace)
    rank = ta.ranks[0] if rank is None else rank
    if rank not in ta.ranks:
        raise ConfigError("rank", rank, f"one of the trace's ranks {ta.ranks}")
    if not ta.attributed(rank).has_steps:
        raise ConfigError("trace", ta.path, "a trace with ProfilerStep ranges (the planner plans per step)")
    steps = ta.steps(rank)
    step_ms = steps.set_index("step")["dur"].astype(float) / 1e3
    ph = ta.phases().query("rank == @rank")
    per = {p: np.zeros(len(step_ms)) for p in ALL_PHASES}
    for (trace_phase, s), grp in ph.groupby(["phase", "step"]):
        plan_phase = TRACE_TO_PLAN.get(trace_phase)
        if plan_phase is not None and s in step_ms.index:
            per[plan_phase][step_ms.index.get_loc(s)] += float(grp["gpu_us"].sum()) / 1e3
    named = sum(v for p, v in per.items() if p != OTHER)
    per[OTHER] = np.clip(step_ms.to_numpy() - named, 0.0, None)
    pick = np.median if statistic == "median" else np.min
    phases, spread = {}, {}
    for p, v in per.items():
        phases[p] = float(pick(v))
        lo, hi = np.quantile(v, [0.2, 0.8])
        spread[p] = float((hi - lo) / phases[p]) if phases[p] > 0 else 0.0
    samples = tuple(float(x) for x in step_ms)
    return StepProfile(
        phases=phases,
        spread=spread,
        peak_mib=float(peak_mib),
        flops=float(flops),
        tokens=float(tokens),
        step_samples=samples,
        stability=str(judge_samples(samples)),
        seams={"trace": ta.path, "rank": rank},
        phase_samples={p: [float(x) for x in v] for p, v in per.items()},
    )
