"""The plan's records (every measured phase, effect, ranked plan and verification, the
prediction error a metric ``perflab compare`` tracks) and the short plan-and-verify summary of
``benchmarks/gpu_check.py`` (no plotting package)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from lab_utils.core.timing import judge_samples
from lab_utils.model.train import TrainConfig
from lab_utils.plan.levers import LEVERS
from lab_utils.plan.planner import PlanResult, StepProfile, build_plan, compose, verify


def plan_and_verify(
    base_cfg: TrainConfig | None = None,
    levers: Sequence[str] | None = None,
    *,
    steps: int = 3,
    warmup: int = 1,
    top: int = 2,
    measure: Callable[[TrainConfig], StepProfile] | None = None,
) -> dict:
    """A short plan-and-verify for ``benchmarks/gpu_check.py``: a small summary dict
    (imports no plotting package). Default: the ``small`` preset on CUDA, every lever."""
    if base_cfg is None:
        base_cfg = TrainConfig(preset="small", device="auto", batch_size=2, buckets=[[256, 256]], num_samples=8)
    levers = list(levers) if levers is not None else [n for n in LEVERS if n != "distributed"]
    res = build_plan(base_cfg, levers, steps=steps, warmup=warmup, measure=measure)
    ver = verify(res, top=top, steps=steps, warmup=warmup, measure=measure)
    return dict(
        device=res.device,
        measured_ms=round(res.base.total_ms, 3),
        base_stability=res.base.stability,
        effects={e.key: round(compose(res.base, [e]).total_ms, 3) for e in res.effects},
        excluded=[f"{x.lever}={x.value}: {x.reason}" for x in res.excluded],
        verified=[
            dict(
                plan=v.plan.name,
                predicted_ms=round(v.plan.prediction.total_ms, 3),
                measured_ms=round(v.measured.total_ms, 3),
                error_pct=round(v.error_pct, 2),
                step_drift_pct=round(v.drift_pct, 2),
                rebased_predicted_ms=round(v.rebased_ms, 3),
                rebased_error_pct=round(v.rebased_error_pct, 2),
                seams_match=v.seams_match,
                stability=v.measured.stability,
                broken=v.broken,
            )
            for v in ver
        ],
    )


def record_plan(rec, result: PlanResult, *, shape: str = "") -> None:
    """Rows for the measured step, each lever's effect, the ranked plans and the
    verifications (the prediction error is a metric, so ``perflab compare`` tracks it)."""
    b = result.base
    for p, ms in b.phases.items():
        x = [float(v) for v in b.phase_samples.get(p, ())]
        v = judge_samples(x) if any(x) else None  # a phase that never ran is no timing
        judged = dict(samples=x, stable=v.stable, stability=v.reason) if v else {}
        rec.add("base", p, "time", ms, "ms", shape=shape, statistic="median", rel_spread=b.spread[p], **judged)
    rec.add(
        "base",
        "step",
        "time",
        b.total_ms,
        "ms",
        shape=shape,
        statistic="sum of phase medians",
        samples=list(b.step_samples),
        stable=b.stability.startswith("stable"),
        stability=b.stability,
    )
    rec.add("base", "step", "peak_memory", b.peak_mib, "MiB", shape=shape, statistic="max")
    for e in result.effects:
        alone = compose(b, [e])
        rec.add(
            "effects",
            e.key,
            "step_time",
            alone.total_ms,
            "ms",
            shape=shape,
            statistic="predicted alone",
            ratios=e.ratios,
            stability=e.profile.stability if e.profile else "",
        )
        rec.add(
            "effects",
            e.key,
            "peak_memory",
            b.peak_mib + e.peak_delta_mib,
            "MiB",
            shape=shape,
            statistic="max",
            delta=e.peak_delta_mib,
        )
    for x in result.excluded:
        rec.add("excluded", f"{x.lever}={x.value}", "excluded", 1, "", reason=x.reason)
    # which plans rank best (and so are verified) is a result: their rows say they are a top-N list
    for rank, p in enumerate(result.plans[:10], 1):
        q = p.prediction
        rec.add(
            "plans",
            p.name,
            "step_time",
            q.total_ms,
            "ms",
            shape=shape,
            statistic="predicted",
            rank=rank,
            top_n=10,
            low=q.low_ms,
            high=q.high_ms,
            amdahl=q.amdahl_ms,
        )
    record_verifications(rec, result, shape=shape)


def record_verifications(rec, result: PlanResult, *, shape: str = "") -> None:
    """The verified plans' step time and prediction errors (the best plans: a ranked list, ``top_n``)."""
    verified = dict(top_n=max(len(result.verifications), 1))
    for v in result.verifications:
        rec.add(
            "verify",
            v.plan.name,
            "step_time",
            v.measured.total_ms,
            "ms",
            shape=shape,
            statistic="measured",
            samples=list(v.measured.step_samples),
            stable=v.measured.stability.startswith("stable"),
            stability=v.measured.stability,
            predicted=v.plan.prediction.total_ms,
            **verified,
        )
        rec.add(
            "verify",
            v.plan.name,
            "prediction_error",
            abs(v.error_pct),
            "%",
            shape=shape,
            statistic="|measured - predicted| / predicted",
            signed=v.error_pct,
            broken=v.broken,
            **verified,
        )
        if math.isfinite(v.rebased_error_pct):
            rec.add(
                "verify",
                v.plan.name,
                "rebased_prediction_error",
                abs(v.rebased_error_pct),
                "%",
                shape=shape,
                statistic="|measured - predicted on the step re-measured just before| / predicted",
                signed=v.rebased_error_pct,
                step_drift_pct=v.drift_pct,
                **verified,
            )
