"""Lab 09's explorer: pick a rank, a step and a phase of a trace -> where its time went.

Nothing is measured: each choice selects the attributed activities of the trace the lab read
(:meth:`lab_utils.traces.TraceAnalysis.kernels`) and sums them per category, so a selection
lands beside the earlier ones in the same bars.  The controls' options are the trace's own
ranks, steps and phases (``"all"`` for no selection on that axis).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import holoviews as hv
import pandas as pd

from lab_utils.studies.explore.base import Control, Explorer, Progress, Result, Unavailable
from lab_utils.traces import TraceAnalysis

ALL = "all"
NO_PHASE = "(none)"


@dataclass
class TracesExplorer(Explorer):
    """``TracesExplorer(rec, analysis=ta, trace="step").show()``."""

    analysis: TraceAnalysis | None = None
    trace: str = "trace"  # the trace's name in the lab (the records' experiment)
    scope: str = "steps"

    lab: ClassVar[str] = "09_traces"
    title: ClassVar[str] = "Explore: one rank, step and phase of the trace"
    live_help: ClassVar[str] = "pick a rank, a step and a phase: its activities per category land beside the others"

    def __post_init__(self):
        if self.analysis is None:
            raise Unavailable("the explorer needs the lab's trace analysis (analysis=...)")
        ta = self.analysis
        steps = sorted({int(s) for r in ta.ranks for s in ta.kernels(r, self.scope)["step"]})
        phases = sorted({p for r in ta.ranks for p in ta.kernels(r, self.scope)["phase"].fillna(NO_PHASE)})
        self.controls = (  # the trace's own ranks, steps and phases: instance controls
            Control("rank", tuple(ta.ranks), ta.ranks[0]),
            Control("step", (ALL, *steps), ALL),
            Control("phase", (ALL, *phases), ALL),
        )
        super().__post_init__()

    def select(self, cfg: dict) -> pd.DataFrame:
        k = self.analysis.kernels(cfg["rank"], self.scope)
        if cfg["step"] != ALL:
            k = k[k["step"] == cfg["step"]]
        if cfg["phase"] != ALL:
            k = k[k["phase"].fillna(NO_PHASE) == cfg["phase"]]
        return k

    def measure(self, cfg: dict, progress: Progress) -> Result:
        progress(0, 1, "selecting")
        k = self.select(cfg)
        if not len(k):
            raise Unavailable(f"no activity in rank {cfg['rank']}, step {cfg['step']}, phase {cfg['phase']}")
        label = self.label(cfg)
        by_cat = k.groupby("category")["dur"].sum().div(1e3).rename("ms").reset_index()
        top = k.groupby(k["name"].astype(str))["dur"].sum().sort_values(ascending=False)
        total_ms = float(k["dur"].sum()) / 1e3
        self.rec.add("explore", label, "activity_time", total_ms, "ms", statistic="sum", trace=self.trace, **cfg)
        row = dict(**cfg, activities=len(k), total_ms=round(total_ms, 3), top=str(top.index[0])[:60])
        progress(1, 1, "selected")
        return Result(0, cfg, row, data=by_cat)

    def figures(self, results: list[Result]) -> list:
        parts = [r.data.assign(selection=f"#{r.index} {self.label(r.config)}") for r in results]
        df = pd.concat(parts) if parts else pd.DataFrame(columns=["selection", "category", "ms"])
        bars = hv.Bars(df, ["selection", "category"], "ms").opts(
            stacked=True, tools=["hover"], title="Activity time per category of each selection", width=720,
            legend_position="right", xrotation=20, framewise=True,
        )  # fmt: skip
        return [bars]
