"""The optimization plan: from a measured step, predict what each lever buys, then run
the best plans and check the prediction.

Design note
-----------
* A **step profile** (:class:`StepProfile`) is lab 01's profiler run on one
  :class:`~lab_utils.model.train.TrainConfig`: per phase the median over the profiled
  steps (a checkpoint saved every N steps: its median cost per save / N, the one rule of
  :func:`lab_utils.profiling.profiler.phase_figure` that lab 01 uses too), the unattributed rest as
  phase ``other``, peak memory, FLOPs and tokens per step.
* A lever's **effect** is measured at the step's own shapes by profiling the same step
  with only that seam changed: a ratio per phase the lever declares
  (:data:`lab_utils.plan.levers.LEVERS`) and a peak-memory delta.
* **Composition** (:func:`compose`) assumes the levers independent: each phase is the
  base phase times the product of the ratios of the plan's levers that act on it; the
  phases run one after another (the Trainer synchronises at phase ends on CUDA, and CPU
  phases do not overlap), so the step is their sum. The Amdahl bound is the step with
  every phase a plan touches at zero time. Peak memory adds the levers' deltas. The
  interval adds, in quadrature, each phase's relative spread (p20..p80 over the steps).
* **Verification** (:func:`verify`) builds the plan's TrainConfig, runs it through the same
  Trainer and profiler, asserts that the run's seams are the predicted ones, and reports
  the error per phase and in total; a large error names the levers that act on the same
  phase (their independence was the assumption that broke).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lab_utils.core.config import ConfigError
from lab_utils.core.device import datasheet_for, device_info, pick_device
from lab_utils.core.timing import choose_cpu_threads, cpu_threads, judge_samples
from lab_utils.model.train import PHASES, TrainConfig, Trainer
from lab_utils.plan.levers import LEVERS, Excluded, candidates, check_levers
from lab_utils.profiling.profiler import ProfileReport, phase_figure, profile_training

OTHER = "other"
ALL_PHASES = (*PHASES, OTHER)
#: how a phase's per-step times become one figure: "median", or "min" (the least disturbed
#: step, for a shared CPU where other processes stall some steps)
STATISTICS = ("median", "min")
LARGE_ERROR_PCT = 15.0


@dataclass(frozen=True)
class StepProfile:
    phases: dict  # phase -> ms per step (ALL_PHASES)
    spread: dict  # phase -> relative spread (p80 - p20) / median
    peak_mib: float
    flops: float  # per step
    tokens: float  # image tokens per step
    step_samples: tuple = ()  # ms of each profiled step
    stability: str = ""
    seams: dict = field(default_factory=dict)
    threads: int = 0  # CPU intra-op threads of the measurement
    periodic: dict = field(default_factory=dict)  # phase -> (N, ms per occurrence): run every N steps
    phase_samples: dict = field(default_factory=dict)  # phase -> ms per profiled step (per occurrence if periodic)

    @property
    def total_ms(self) -> float:
        return float(sum(self.phases.values()))


def profile_from_report(
    report: ProfileReport, cfg: TrainConfig, trainer: Trainer | None = None, *, statistic: str = "median"
) -> StepProfile:
    """A :class:`StepProfile` from lab 01's report of ``cfg``'s step."""
    if statistic not in STATISTICS:
        raise ConfigError("statistic", statistic, "one of " + ", ".join(STATISTICS))
    a = report.analysis
    steps = list(a.steps.step)
    wide = report.phase_frame()
    st = a.steps.set_index("step").reindex(steps)
    wide[OTHER] = (st.step_ms - st.phase_sum_ms).clip(lower=0.0).to_numpy()
    phases, spread, periodic, samples_of = {}, {}, {}, {}
    for p in ALL_PHASES:
        f = phase_figure(
            p, wide[p] if p in wide else np.zeros(len(steps)), report.periods.get(p, 1), statistic=statistic
        )
        phases[p] = f.ms  # a checkpoint every N steps: its cost per save / N (profiler.PERIODIC_RULE)
        samples_of[p] = f.samples
        lo, hi = np.quantile(f.samples, [0.2, 0.8]) if f.samples else (0.0, 0.0)
        spread[p] = float((hi - lo) / f.per_event_ms) if f.per_event_ms > 0 else 0.0
        if f.periodic:
            periodic[p] = (f.every, f.per_event_ms)
    hist = trainer.history[-len(steps) :] if trainer is not None else []
    tokens = float(np.mean([cfg.batch_size * r.grid[0] * r.grid[1] for r in hist])) if hist else math.nan
    peak = a.peak_allocated_bytes if report.cuda_peak_bytes is None else report.cuda_peak_bytes
    samples = tuple(float(s) for s in report.amortised_step_ms)
    return StepProfile(
        phases=phases,
        spread=spread,
        peak_mib=float(peak) / 2**20,
        flops=float(np.mean(report.step_flops[: len(steps)])) if report.step_flops else math.nan,
        tokens=tokens,
        step_samples=samples,
        stability=str(judge_samples(samples)),
        seams=cfg.to_dict(),
        periodic=periodic,
        phase_samples=samples_of,
    )


def measure_step(
    cfg: TrainConfig,
    *,
    steps: int = 3,
    warmup: int = 1,
    statistic: str = "median",
    out_dir=None,
    keep_trace: bool = False,
) -> StepProfile:
    """Profile ``cfg``'s step with lab 01's profiler (``warmup`` + ``steps`` steps); on CPU
    with the timing primitive's thread choice (recorded in the profile's seams).  A plan
    profiles the step once per lever setting: the trace files (tens of MB each) are removed
    once analysed unless ``keep_trace``; the numbers stay in the profile and its records."""
    threads = choose_cpu_threads().threads if pick_device(cfg.device).type == "cpu" else torch.get_num_threads()
    with cpu_threads(threads):
        tr = Trainer(cfg)
        try:
            rep = profile_training(tr, active=steps, warmup=warmup, out_dir=out_dir, name="08_plan")
            prof = profile_from_report(rep, tr.cfg, tr, statistic=statistic)
        finally:
            tr.close()
    if not keep_trace:
        for path in (rep.trace_path, rep.memory_snapshot_path, rep.memory_html_path):
            if path is not None:
                Path(path).unlink(missing_ok=True)
    return dataclasses.replace(prof, threads=threads)


def merge_profiles(a: StepProfile, b: StepProfile, *, statistic: str = "median") -> StepProfile:
    """Two measurements of the same step as one: per phase the mean (``median``) or the
    smaller (``min``) of both, the larger spread, the smaller peak (on CPU the peak counts from
    the profiler's start, and the first run in a process carries one-time allocations), both
    runs' samples."""
    pick = min if statistic == "min" else (lambda x, y: 0.5 * (x + y))
    samples = a.step_samples + b.step_samples
    return dataclasses.replace(
        a,
        phases={p: pick(a.phases[p], b.phases.get(p, a.phases[p])) for p in a.phases},
        spread={p: max(a.spread[p], b.spread.get(p, 0.0)) for p in a.spread},
        peak_mib=min(a.peak_mib, b.peak_mib),
        periodic={p: (n, n * pick(a.phases[p], b.phases.get(p, a.phases[p]))) for p, (n, _) in a.periodic.items()},
        step_samples=samples,
        stability=str(judge_samples(samples)),
        phase_samples={p: tuple(x) + tuple(b.phase_samples.get(p, ())) for p, x in a.phase_samples.items()},
    )


# ------------------------------------------------------------------------------- effects
@dataclass(frozen=True)
class Effect:
    lever: str
    value: object
    ratios: dict  # phase -> measured / base, on the lever's phases
    peak_delta_mib: float
    spread: dict  # phase -> relative spread of the lever's measurement
    profile: StepProfile | None = None

    @property
    def key(self) -> str:
        return f"{self.lever}={self.value}"


def effect_of(lever: str, value, base: StepProfile, measured: StepProfile) -> Effect:
    """The lever's effect: measured / base on the phases it declares (a phase absent from
    both stays at ratio 1)."""
    ratios = {}
    for p in LEVERS[lever].phases:
        b, m = base.phases.get(p, 0.0), measured.phases.get(p, 0.0)
        ratios[p] = m / b if b > 0 else 1.0
    return Effect(
        lever,
        value,
        ratios,
        measured.peak_mib - base.peak_mib,
        {p: measured.spread.get(p, 0.0) for p in ratios},
        measured,
    )


# ------------------------------------------------------------------------------- composition
@dataclass(frozen=True)
class Prediction:
    phases: dict
    total_ms: float
    low_ms: float
    high_ms: float
    amdahl_ms: float  # the step with every phase the plan touches at zero
    peak_mib: float
    tokens_per_s: float
    tflops: float
    mfu_pct: float  # of the datasheet bf16 peak; NaN where there is none (CPUs)


def compose(base: StepProfile, effects: Sequence[Effect], *, peak_tflops: float | None = None) -> Prediction:
    """Predict the step with all ``effects`` applied (see the module note)."""
    phases, touched = dict(base.phases), set()
    var = {p: base.spread.get(p, 0.0) ** 2 for p in phases}
    for e in effects:
        for p, r in e.ratios.items():
            phases[p] = phases.get(p, 0.0) * r
            var[p] = var.get(p, 0.0) + e.spread.get(p, 0.0) ** 2
            touched.add(p)
    total = float(sum(phases.values()))
    half = 0.5 * math.sqrt(sum((phases[p] * math.sqrt(v)) ** 2 for p, v in var.items() if p in phases))
    amdahl = float(sum(v for p, v in base.phases.items() if p not in touched))
    tps = base.tokens / (total * 1e-3) if total > 0 else math.nan
    tflops = base.flops / (total * 1e-3) / 1e12 if total > 0 else math.nan
    return Prediction(
        phases=phases,
        total_ms=total,
        low_ms=max(total - half, 0.0),
        high_ms=total + half,
        amdahl_ms=amdahl,
        peak_mib=base.peak_mib + sum(e.peak_delta_mib for e in effects),
        tokens_per_s=tps,
        tflops=tflops,
        mfu_pct=100 * tflops / peak_tflops if peak_tflops else math.nan,
    )


@dataclass(frozen=True)
class Plan:
    choices: dict  # lever -> value (the levers the plan pulls)
    config: TrainConfig
    prediction: Prediction
    effects: tuple = ()

    @property
    def name(self) -> str:
        return " + ".join(f"{k}={v}" for k, v in self.choices.items()) or "measured step"


def enumerate_plans(
    base_cfg: TrainConfig, base: StepProfile, effects: Iterable[Effect], *, peak_tflops: float | None = None
) -> tuple[list[Plan], list[Excluded]]:
    """Every combination of at most one setting per lever, ranked by predicted step time.
    A combination the TrainConfig refuses is excluded with its reason; the rest go on."""
    by_lever: dict[str, list[Effect]] = {}
    for e in effects:
        by_lever.setdefault(e.lever, []).append(e)
    names = list(by_lever)
    plans, excluded = [], []
    for pick in itertools.product(*[[None, *by_lever[n]] for n in names]):
        chosen = [e for e in pick if e is not None]
        choices = {e.lever: e.value for e in chosen}
        try:
            cfg = dataclasses.replace(base_cfg, **choices)
        except ConfigError as err:
            excluded.append(Excluded("+".join(choices), choices, str(err)))
            continue
        plans.append(Plan(choices, cfg, compose(base, chosen, peak_tflops=peak_tflops), tuple(chosen)))
    plans.sort(key=lambda p: (p.prediction.total_ms, len(p.choices)))
    return plans, excluded


def waterfall(base: StepProfile, plan: Plan) -> list[dict]:
    """Bars from the measured step to ``plan``: each lever's step-time change when it is
    added to the levers before it (largest gain first); the last bar is the plan."""
    order = sorted(plan.effects, key=lambda e: compose(base, [e]).total_ms)
    rows = [dict(bar="measured step", start=0.0, end=base.total_ms, delta=base.total_ms)]
    prev, applied = base.total_ms, []
    for e in order:
        applied.append(e)
        now = compose(base, applied).total_ms
        rows.append(dict(bar=e.key, start=prev, end=now, delta=now - prev))
        prev = now
    rows.append(dict(bar="plan", start=0.0, end=prev, delta=prev))
    return rows


# ------------------------------------------------------------------------------- the whole plan
@dataclass
class PlanResult:
    base_cfg: TrainConfig
    base: StepProfile
    effects: list[Effect]
    excluded: list[Excluded]
    plans: list[Plan]
    verifications: list = field(default_factory=list)
    device: str = "cpu"


def peak_tflops_for(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    ds = datasheet_for(device_info(device))
    return ds.bf16_tflops if ds else None


def build_plan(
    base_cfg: TrainConfig,
    levers: Sequence[str],
    *,
    steps: int = 3,
    warmup: int = 1,
    progress: Callable[[Iterable], Iterable] | None = None,
    world_size: int = 1,
    measure: Callable[[TrainConfig], StepProfile] | None = None,
    statistic: str = "median",
) -> PlanResult:
    """Measure the step, each lever setting that can run here, and rank every combination.
    ``measure`` (default: :func:`measure_step`) profiles one TrainConfig.  The step is measured
    again after the levers and both runs merged (drift on a shared machine then weighs on the
    base as on the levers)."""
    levers = check_levers("levers", list(levers))
    measure = measure or (lambda c: measure_step(c, steps=steps, warmup=warmup, statistic=statistic))
    device = pick_device(base_cfg.device)
    todo, excluded = [], []
    for lv in levers:
        ok, out = candidates(lv, base_cfg, device, world_size=world_size)
        todo += [(lv, v) for v in ok]
        excluded += out
    base = measure(base_cfg)
    effects = []
    measured = []
    for lv, v in progress(todo) if progress else todo:
        try:
            cfg = dataclasses.replace(base_cfg, **{lv: v})
        except ConfigError as err:
            excluded.append(Excluded(lv, v, str(err)))
            continue
        try:
            measured.append((lv, v, measure(cfg)))
        except (RuntimeError, NotImplementedError) as err:
            excluded.append(Excluded(lv, v, f"failed to run: {type(err).__name__}: {str(err)[:160]}"))
    if measured:
        base = merge_profiles(base, measure(base_cfg), statistic=statistic)
    effects = [effect_of(lv, v, base, m) for lv, v, m in measured]
    plans, bad = enumerate_plans(base_cfg, base, effects, peak_tflops=peak_tflops_for(device))
    return PlanResult(base_cfg, base, effects, excluded + bad, plans, device=device.type)


# ------------------------------------------------------------------------------- verification
@dataclass(frozen=True)
class Verification:
    plan: Plan
    measured: StepProfile
    seams_match: bool
    error_pct: float  # (measured - predicted) / predicted, total
    phase_errors: dict  # phase -> (predicted ms, measured ms)
    broken: str  # which assumption broke, where the error is large; "" otherwise
    # the step measured again just before the plan, and the plan composed on it: what the
    # prediction would have been on the machine as it was at verification time
    drift_pct: float = math.nan  # (re-measured step - measured step) / measured step
    rebased_ms: float = math.nan
    rebased_error_pct: float = math.nan


def interacting(plan: Plan) -> list[tuple[str, str, str]]:
    """Pairs of the plan's levers that act on the same phase (lever, lever, phase)."""
    out = []
    for a, b in itertools.combinations(plan.effects, 2):
        for p in a.ratios:
            if p in b.ratios and (a.ratios[p] != 1.0 or b.ratios[p] != 1.0):
                out.append((a.key, b.key, p))
                break
    return out


def judge(plan: Plan, measured: StepProfile, *, large_pct: float = LARGE_ERROR_PCT) -> Verification:
    """Compare ``plan``'s prediction with its measured step (the seams must match)."""
    expected = plan.config.to_dict()
    seams_match = measured.seams == expected
    pred = plan.prediction
    err = 100 * (measured.total_ms - pred.total_ms) / pred.total_ms if pred.total_ms > 0 else math.nan
    phase_errors = {p: (pred.phases.get(p, 0.0), measured.phases.get(p, 0.0)) for p in ALL_PHASES}
    broken = ""
    if not math.isfinite(err) or abs(err) > large_pct:
        worst = max(phase_errors, key=lambda p: abs(phase_errors[p][1] - phase_errors[p][0]))
        pairs = [f"{a} with {b} (both act on {p})" for a, b, p in interacting(plan) if p == worst]
        if pairs:
            broken = f"phase {worst!r} is off most; levers that interact there: " + "; ".join(pairs)
        elif any(worst in e.ratios for e in plan.effects):
            broken = f"phase {worst!r} is off most: its lever's effect did not hold at verification (noise or drift)"
        else:
            broken = f"phase {worst!r} is off most and no lever touches it: the machine drifted between runs"
    return Verification(plan, measured, seams_match, err, phase_errors, broken)


def verify(
    result: PlanResult,
    *,
    top: int = 2,
    steps: int = 3,
    warmup: int = 1,
    measure: Callable[[TrainConfig], StepProfile] | None = None,
    statistic: str = "median",
    rebase: bool = True,
) -> list[Verification]:
    """Run the ``top`` best plans that change something through the same Trainer and
    profiler; assert each run's seams are the plan's configuration. ``rebase``: measure
    the step again just before each plan and compose the plan's levers on it too, so a
    machine that drifted since the plan was built (a shared CPU) shows as drift, apart
    from the composition's own error."""
    measure = measure or (lambda c: measure_step(c, steps=steps, warmup=warmup, statistic=statistic))
    chosen = [p for p in result.plans if p.choices][:top]
    out = []
    for p in chosen:
        fresh = measure(result.base_cfg) if rebase else None
        v = judge(p, measure(p.config))
        assert v.seams_match, f"verification ran {v.measured.seams}, not the predicted {p.config.to_dict()}"
        if fresh is not None:
            again = compose(fresh, p.effects).total_ms
            v = dataclasses.replace(
                v,
                drift_pct=100 * (fresh.total_ms / result.base.total_ms - 1),
                rebased_ms=again,
                rebased_error_pct=100 * (v.measured.total_ms - again) / again,
            )
        out.append(v)
    result.verifications = out
    return out


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


__all__ = [
    "ALL_PHASES",
    "Effect",
    "Plan",
    "PlanResult",
    "Prediction",
    "StepProfile",
    "Verification",
    "build_plan",
    "compose",
    "effect_of",
    "enumerate_plans",
    "interacting",
    "judge",
    "measure_step",
    "plan_and_verify",
    "profile_from_report",
    "record_plan",
    "record_verifications",
    "verify",
    "waterfall",
]
