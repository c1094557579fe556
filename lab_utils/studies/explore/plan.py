"""Lab 08's explorer (plan): pick levers -> the predicted plan at once -> run it to see the
measured step beside the prediction.

The choices are the lever settings the lab measured (``PlanResult.effects``: one dropdown per
lever, "off" or a setting measured above); the prediction is ``planner.compose`` of the measured
step with those effects (no measurement, instant), with its low-high band and predicted peak.
"measure it" profiles the plan's step through the same Trainer and profiler the lab uses
(``planner.measure_step`` at the lab's steps and warm-up), asserts the run's seams are the
plan's configuration, and shows the measured step with its timing verdict
(``timing.judge_samples`` of the profiled steps) and the prediction's error.  Every timing the
table shows carries a verdict: a predicted step the verdict of the measured step it is
composed on (``PlanResult.base``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import holoviews as hv
import pandas as pd
import torch

from lab_utils.core.config import ConfigError
from lab_utils.core.timing import judge_samples
from lab_utils.plan.planner import (
    Plan,
    PlanResult,
    StepProfile,
    compose,
    judge,
    measure_step,
    peak_tflops_for,
    with_levers,
)
from lab_utils.studies.explore.base import Control, Explorer, Progress, Result, Unavailable
from lab_utils.studies.plan import PREDICTION_COLORS, PlanLabConfig

OFF = "off"
RUN = "run"


def lever_controls(res: PlanResult) -> tuple[Control, ...]:
    """One dropdown per lever the lab measured ("off" or a measured setting), then "measure it"."""
    by_lever: dict[str, list] = {}
    for e in res.effects:
        by_lever.setdefault(e.lever, []).append(e.value)
    return (
        *(Control(lv, (OFF, *vals), OFF, lv) for lv, vals in by_lever.items()),
        Control(RUN, (), False, "measure it"),
    )


def verdict_of(p: StepProfile):
    """The timing verdict of a profile's steps (``judge_samples``), or None without samples."""
    return judge_samples(list(p.step_samples)) if p.step_samples else None


@dataclass
class PlanExplorer(Explorer):
    """``PlanExplorer.for_lab(cfg, res, rec).show()``."""

    res: PlanResult | None = None
    steps: int = 3
    warmup: int = 1
    statistic: str = "median"
    #: profiles one TrainConfig (default ``planner.measure_step``; tests pass a synthetic one)
    measure_fn: Callable | None = None

    lab: ClassVar[str] = "08_plan"
    title: ClassVar[str] = "Explore: pick levers, see the predicted plan, run it"
    live_help: ClassVar[str] = (
        "each choice shows the predicted step at once; tick 'measure it' to profile the plan and see "
        "the measured step (with its stability verdict) beside the prediction"
    )

    @classmethod
    def for_lab(cls, cfg: PlanLabConfig, res: PlanResult, rec=None, **kw) -> PlanExplorer:
        """The explorer on the lab's measured step and lever effects, measuring as the lab does."""
        return cls(rec=rec, res=res, steps=cfg.steps, warmup=cfg.warmup_steps, statistic=cfg.statistic, **kw)

    def __post_init__(self):
        if self.res is None:
            raise ConfigError("res", None, "the lab's PlanResult (study.run(cfg, rec))")
        self.controls = lever_controls(self.res)  # per instance: the levers this lab measured
        self.peak_tflops = peak_tflops_for(torch.device(self.res.device))
        super().__post_init__()

    def label(self, cfg: dict) -> str:
        return self.plan(cfg).name + (" (measured)" if cfg[RUN] else "")

    def plan(self, cfg: dict) -> Plan:
        """The plan of ``cfg``'s lever choices, its prediction composed on the lab's measured step."""
        chosen = [e for e in self.res.effects if cfg.get(e.lever, OFF) != OFF and e.value == cfg[e.lever]]
        choices = {e.lever: e.value for e in chosen}
        config = with_levers(self.res.base_cfg, **choices)  # a refused combination raises ConfigError
        return Plan(choices, config, compose(self.res.base, chosen, peak_tflops=self.peak_tflops), tuple(chosen))

    def why_not(self, cfg: dict) -> str | None:
        try:
            self.plan(cfg)
        except ConfigError as e:
            return f"this combination is refused: {e}"
        return None

    def measure(self, cfg: dict, progress: Progress) -> Result:
        plan = self.plan(cfg)
        pred, base_verdict = plan.prediction, verdict_of(self.res.base)
        row = dict(
            plan=plan.name,
            predicted_ms=pred.total_ms,
            low_ms=pred.low_ms,
            high_ms=pred.high_ms,
            predicted_peak_mib=pred.peak_mib,
            measured_ms=math.nan,
            error_pct=math.nan,
            stable=bool(base_verdict and base_verdict.stable),
            stability=f"predicted from the measured step: {base_verdict or 'no samples'}",
        )
        kw = dict(shape=self.lab_step(), plan=plan.name, levers=plan.choices)
        measured = None
        if cfg[RUN]:
            progress(0, 1, f"profiling {self.warmup} + {self.steps} steps of {plan.name}")
            measured = self._measure_plan(plan)
            progress(1, 1, "measured")
            v = judge(plan, measured)
            if not v.seams_match:
                raise Unavailable(f"the run's seams {measured.seams} are not the plan's {plan.config.to_dict()}")
        self.rec.add("explore", plan.name, "predicted_step", pred.total_ms, "ms", statistic="predicted", **kw)
        if measured is not None:
            tv = verdict_of(measured)
            row.update(
                measured_ms=measured.total_ms,
                error_pct=v.error_pct,
                stable=bool(tv and tv.stable),
                stability=str(tv) if tv else "no samples",
            )
            self.rec.add(
                "explore",
                plan.name,
                "step_time",
                measured.total_ms,
                "ms",
                statistic="median",
                samples=measured.step_samples,
                stable=tv.stable if tv else None,
                stability=tv.reason if tv else "",
                **kw,
            )
            self.rec.add("explore", plan.name, "prediction_error", v.error_pct, "%", statistic="value", **kw)
        return Result(0, cfg, row, data=dict(prediction=pred, measured=measured))

    def _measure_plan(self, plan: Plan) -> StepProfile:
        if self.measure_fn is not None:
            return self.measure_fn(plan.config)
        return measure_step(plan.config, steps=self.steps, warmup=self.warmup, statistic=self.statistic)

    def lab_step(self) -> str:
        c = getattr(self.res.base_cfg, "train", None) or self.res.base_cfg  # a step setup's trainer config
        return f"{c.preset} b{c.batch_size} " + ",".join(f"{h}x{w}" for h, w in c.buckets)

    def figures(self, results: list[Result]) -> list:
        rows = [
            dict(config=f"#{r.index}", plan=r.row["plan"], which=w, ms=r.row[f"{w}_ms"], low=lo, high=hi)
            for r in results
            for w, lo, hi in (("predicted", r.row["low_ms"], r.row["high_ms"]), ("measured", math.nan, math.nan))
            if math.isfinite(r.row[f"{w}_ms"])
        ]
        df = pd.DataFrame(rows, columns=["config", "plan", "which", "ms", "low", "high"])
        base = self.res.base.total_ms
        bars = hv.Bars(df, ["config", "which"], ["ms", "plan", "low", "high"]).opts(
            color="which",
            cmap=PREDICTION_COLORS,
            show_legend=True,
            legend_position="right",
            tools=["hover"],
            multi_level=False,
            ylabel="ms per step",
            xlabel="explored plan (# in the table; hover: the prediction's low-high band)",
            title=f"Predicted and measured step per plan; dashed: the lab's measured step ({base:.3g} ms)",
            width=760,
            height=340,
            framewise=True,
        )
        return [bars * hv.HLine(base).opts(color="#555", line_dash="dashed")]
