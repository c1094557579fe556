"""Lab 08 (``labs/08_plan.ipynb``): the optimization plan's parameters, tables, plots and
plain-language recommendations.

The plan is made on the lab's step (the ``step`` parameter: perflab's MMDiT trainer by default,
whose levers are its config's fields; any model through the step contract, whose levers are the
generic ones: :mod:`lab_utils.plan.setup`).  The measuring, composing and verifying are
:mod:`lab_utils.plan.planner`'s; the plots here read its results and never measure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import holoviews as hv
import pandas as pd

from lab_utils.core.config import ConfigError, built_from, check_choice, check_int
from lab_utils.core.device import pick_device
from lab_utils.core.records import Recorder
from lab_utils.model.train import TrainConfig, TrainParams
from lab_utils.plan.levers import LEVERS, check_levers
from lab_utils.plan.planner import (
    ALL_PHASES,
    STATISTICS,
    Effect,
    PlanResult,
    StepProfile,
    build_plan,
    compose,
    verify,
    waterfall,
)
from lab_utils.plan.setup import StepSetup, auto_levers, step_candidates
from lab_utils.plan.summary import record_plan
from lab_utils.profiling.profiler import PERIODIC_RULE
from lab_utils.step.contract import StepFactory
from lab_utils.step.load import DEFAULT_STEP, check_step_spec
from lab_utils.studies.headline import Figure, fmt, register, rows, unscoped, verdict

LAB = "08_plan"
#: perflab's MMDiT trainer's levers a CPU measures in seconds (the lab's "auto" on it).
CPU_LEVERS = ("attention_path", "activation_checkpoint", "encoders", "num_workers", "ckpt_format")


@dataclass(frozen=True)
class PlanLabConfig(TrainParams):
    """Parameters of ``labs/08_plan.ipynb``: the measured step's plus the plan's.

    The step's parameters are checked once, by the :class:`TrainConfig` built from them and held
    as :attr:`train` (the planner varies that config lever by lever)."""

    levers: tuple | str = "auto"  # "auto" (the step's own: levers_of) or lever names (lab_utils.plan.levers.LEVERS)
    steps: int = 6  # profiled steps per measurement
    warmup_steps: int = 2
    verify_top: int = 2  # plans run again to check the prediction
    statistic: str = "median"  # per-phase figure over the profiled steps: "median" | "min"
    step: str = DEFAULT_STEP  # your training step, "package.module:function" (the README's "Your model")
    #: the measured step's config, built once from the step's parameters (not a parameter itself)
    train: TrainConfig = built_from(TrainConfig, TrainParams.param_names())

    def __post_init__(self):
        super().__post_init__()  # builds .train: the step's parameters checked once, by TrainConfig
        if self.levers != "auto":
            names = list(self.levers) if self.levers else self.levers
            object.__setattr__(self, "levers", check_levers("levers", names))
        check_int("steps", self.steps, min=1)
        check_int("warmup_steps", self.warmup_steps, min=0)
        check_int("verify_top", self.verify_top, min=1, max=5)
        check_choice("statistic", self.statistic, STATISTICS)
        check_step_spec(self.step)  # its form; imported, built and checked once by the lab's first cell
        if self.statistic == "min" and self.steps < 2:
            raise ConfigError("steps", self.steps, "at least 2 when statistic is 'min'")


def recorder(cfg: PlanLabConfig) -> Recorder:
    return Recorder(lab=LAB, params=cfg.to_dict(), device=pick_device(cfg.device))


def levers_of(cfg: PlanLabConfig, step: StepFactory) -> tuple:
    """The levers the lab pulls: ``levers``, or for "auto" the step's own (perflab's MMDiT: its
    trainer's :data:`CPU_LEVERS`; another step: the generic ones this device times)."""
    return auto_levers(step, step.device, CPU_LEVERS) if cfg.levers == "auto" else tuple(cfg.levers)


# ------------------------------------------------------------------------------- checked facts
def lever_table(cfg: PlanLabConfig, step: StepFactory) -> pd.DataFrame:
    """Each lever's settings to measure here, and those excluded with their reason."""
    setup, rows = StepSetup.of(step), []
    for lv in levers_of(cfg, step):
        ok, out = step_candidates(lv, setup, step.device)
        rows += [dict(lever=lv, setting=str(v), status="measured", reason="") for v in ok]
        rows += [dict(lever=x.lever, setting=str(x.value), status="excluded", reason=x.reason) for x in out]
    return pd.DataFrame(rows, columns=["lever", "setting", "status", "reason"])


def composition_check() -> pd.DataFrame:
    """The composition on a synthetic profile with known answers (raises when it is off):
    forward 40 ms and backward 60 ms both halved by one lever and cut by 25% by another,
    encoding 30 ms removed, the rest untouched."""
    phases = dict.fromkeys(ALL_PHASES, 0.0) | dict(text_encoding=30.0, forward=40.0, backward=60.0, optimizer=20.0)
    base = StepProfile(phases, dict.fromkeys(phases, 0.0), 100.0, 1e12, 1000.0)
    a = Effect("compile", True, dict(forward=0.5, backward=0.5), -10.0, {})
    b = Effect("attention_path", "math", dict(forward=0.75, backward=0.75), 0.0, {})
    c = Effect("encoders", "precomputed", dict(data_loading=1.0, text_encoding=0.0, image_encoding=1.0), -5.0, {})
    rows = []
    for effects, total, peak, amdahl in (
        ([], 150.0, 100.0, 150.0),
        ([a], 100.0, 90.0, 50.0),
        ([a, b], 87.5, 90.0, 50.0),
        ([a, b, c], 57.5, 85.0, 20.0),
    ):
        p = compose(base, effects)
        ok = math.isclose(p.total_ms, total) and math.isclose(p.peak_mib, peak) and math.isclose(p.amdahl_ms, amdahl)
        assert ok, f"composition of {[e.key for e in effects]}: {p.total_ms}, {p.peak_mib}, {p.amdahl_ms}"
        rows.append(
            dict(
                levers=" + ".join(e.key for e in effects) or "none",
                predicted=round(p.total_ms, 6),
                expected=total,
                amdahl_floor=round(p.amdahl_ms, 6),
                peak=round(p.peak_mib, 6),
            )
        )
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------- measuring
def run(cfg: PlanLabConfig, step: StepFactory, rec: Recorder, progress=None) -> PlanResult:
    """Measure the step (the lab's loaded one, as it is) and each lever setting, rank every combination."""
    res = build_plan(
        StepSetup.of(step),
        levers_of(cfg, step),
        steps=cfg.steps,
        warmup=cfg.warmup_steps,
        progress=progress,
        statistic=cfg.statistic,
        own=step,
    )
    if not res.plans:
        raise AssertionError("no plan could be composed: every combination was excluded")
    return res


def check(cfg: PlanLabConfig, step: StepFactory, res: PlanResult, rec: Recorder) -> pd.DataFrame:
    """Run the top plans again through the same step and profiler (asserting their seams are the
    predicted ones), record everything, return predicted vs measured."""
    verify(res, top=cfg.verify_top, steps=cfg.steps, warmup=cfg.warmup_steps, statistic=cfg.statistic, own=step)
    record_plan(rec, res, shape=_shape(cfg, step))
    return verify_table(res)


def _shape(cfg: PlanLabConfig, step: StepFactory) -> str:
    if step.has("train_config"):
        return f"{cfg.preset} b{cfg.batch_size} {'x'.join(str(x) for x in cfg.train.buckets[0])}"
    return f"b{StepSetup.of(step).batch_size}"


def seams_verdict(res: PlanResult) -> str:
    """Checked text: how many plans were verified, and that each ran its predicted seams
    (``verify`` asserts it; which levers the best plans pull depends on the measurement)."""
    match = all(v.seams_match for v in res.verifications)
    return f"verified plans: {len(res.verifications)}; each ran exactly its predicted seams: {match}"


# ------------------------------------------------------------------------------- tables
def base_table(res: PlanResult) -> pd.DataFrame:
    """The measured step per phase: ms per step (a checkpoint every N steps amortised: its cost
    per save / N, ``lab_utils.profiling.profiler.PERIODIC_RULE``, as lab 01 counts it), beside the full
    cost of one occurrence."""
    b = res.base
    rows = []
    for p, ms in b.phases.items():
        if ms <= 0:
            continue
        every, per_event = b.periodic.get(p, (1, ms))
        rows.append(
            dict(
                phase=p,
                ms_per_step=round(ms, 2),
                every_n_steps=every,
                ms_per_event=round(per_event, 2),
                rel_spread=round(b.spread[p], 3),
            )
        )
    df = pd.DataFrame(rows, columns=["phase", "ms_per_step", "every_n_steps", "ms_per_event", "rel_spread"])
    df.attrs["stability"] = b.stability
    return df


def periodic_line(res: PlanResult) -> str:
    """The rule for phases that run every N steps, with the measured step's numbers."""
    parts = [
        f"{p} every {n} steps: {ev:.4g} ms per {p}, amortised as {res.base.phases[p]:.4g} ms per step"
        for p, (n, ev) in res.base.periodic.items()
    ]
    return f"{PERIODIC_RULE}" + (": " + "; ".join(parts) if parts else " (none here)")


def effects_table(res: PlanResult, batch_size: int | None = None) -> pd.DataFrame:
    """Each measured lever setting alone: its phase ratios, step time, gain and peak-memory
    change; where it frees memory, about how many more samples per batch that buys (freed
    bytes over the measured step's peak per sample, a lower bound since the peak includes state)."""
    rows = []
    bs = batch_size or res.base_cfg.batch_size
    per_sample = res.base.peak_mib / bs if bs else math.nan
    for e in res.effects:
        alone = compose(res.base, [e])
        rows.append(
            dict(
                lever=e.key,
                phases=", ".join(f"{p} x{r:.2f}" for p, r in e.ratios.items()),
                step_ms=round(alone.total_ms, 2),
                gain_pct=round(100 * (1 - alone.total_ms / res.base.total_ms), 1),
                peak_delta_mib=round(e.peak_delta_mib, 2),
                buys=f"+{int(-e.peak_delta_mib // per_sample)} samples/batch"
                if e.peak_delta_mib < 0 and per_sample > 0
                else "",
                stability=e.profile.stability.split(":")[0] if e.profile else "",
            )
        )
    return pd.DataFrame(rows)


def plans_table(res: PlanResult, n: int = 10) -> pd.DataFrame:
    rows = []
    for rank, p in enumerate(res.plans[:n], 1):
        q = p.prediction
        rows.append(
            dict(
                rank=rank,
                plan=p.name,
                step_ms=round(q.total_ms, 2),
                interval=f"{q.low_ms:.1f}..{q.high_ms:.1f}",
                amdahl_floor_ms=round(q.amdahl_ms, 2),
                peak_mib=round(q.peak_mib, 2),
                tokens_per_s=round(q.tokens_per_s, 1),
                tflops=round(q.tflops, 4),
                mfu_pct=None if math.isnan(q.mfu_pct) else round(q.mfu_pct, 1),
            )
        )
    return pd.DataFrame(rows)


def verify_table(res: PlanResult) -> pd.DataFrame:
    """One row per verified plan: predicted and measured step, the errors, the verdict on
    the measured samples and, where the error is large, which assumption broke."""
    rows = [
        dict(
            plan=i,
            name=v.plan.name,
            predicted_ms=round(v.plan.prediction.total_ms, 2),
            measured_ms=round(v.measured.total_ms, 2),
            error_pct=round(v.error_pct, 1),
            step_drift_pct=round(v.drift_pct, 1),
            rebased_predicted_ms=round(v.rebased_ms, 2),
            rebased_error_pct=round(v.rebased_error_pct, 1),
            stability=v.measured.stability.split(":")[0],
            broken=v.broken or "-",
        )
        for i, v in enumerate(res.verifications, 1)
    ]
    df = pd.DataFrame(rows)
    return df.dropna(axis=1, how="all")  # no rebase: no drift columns, rather than columns of NaN


def verify_phases(res: PlanResult) -> pd.DataFrame:
    """Predicted vs measured ms per phase (and the total) of each verified plan."""
    rows = []
    for i, v in enumerate(res.verifications, 1):
        for p, (pred, meas) in v.phase_errors.items():
            if pred > 0 or meas > 0:
                rows.append(dict(plan=i, phase=p, predicted_ms=round(pred, 2), measured_ms=round(meas, 2)))
        total = (v.plan.prediction.total_ms, v.measured.total_ms)
        rows.append(dict(plan=i, phase="TOTAL", predicted_ms=round(total[0], 2), measured_ms=round(total[1], 2)))
    return pd.DataFrame(rows, columns=["plan", "phase", "predicted_ms", "measured_ms"])


# ------------------------------------------------------------------------------- plots
def waterfall_plot(res: PlanResult):
    """From the measured step to the best plan, each bar a lever's step-time change."""
    best = next((p for p in res.plans if p.choices), res.plans[0])
    df = pd.DataFrame(waterfall(res.base, best))
    df["lo"], df["hi"] = df[["start", "end"]].min(axis=1), df[["start", "end"]].max(axis=1)
    df["kind"] = [
        "total" if b in ("measured step", "plan") else ("gain" if d < 0 else "loss") for b, d in zip(df.bar, df.delta)
    ]
    df["x"] = range(len(df))
    colors = {"total": "#1f77b4", "gain": "#2ca02c", "loss": "#d62728"}
    segs = hv.Segments(df, ["x", "lo", "x", "hi"], ["bar", "delta", "kind"]).opts(
        color="kind", cmap=colors, line_width=38, tools=["hover"]
    )
    ticks = list(zip(df.x, df.bar))
    return segs.opts(
        xticks=ticks,
        xrotation=20,
        width=760,
        height=380,
        ylabel="step ms",
        xlabel="",
        title="Waterfall: measured step to the best plan (green: a lever's gain)",
    )


PREDICTION_COLORS = {"predicted": "#1f77b4", "measured": "#ff7f0e"}


def _phase_ticks(plot, element) -> None:
    """The phase names (the outer level of the grouped bars) as the readable ticks."""
    ax = plot.state.xaxis[0]
    ax.group_text_font_size = "10pt"
    ax.group_label_orientation = 0.5  # radians: long phase names do not collide


def prediction_plot(res: PlanResult):
    """Predicted vs measured per phase and total for each verified plan: grouped bars, the
    phase names as ticks and a legend for predicted / measured."""
    df = verify_phases(res)
    if not len(df):
        return hv.Div("<p>No plan verified.</p>")
    long = df.melt(id_vars=["plan", "phase"], value_vars=["predicted_ms", "measured_ms"], var_name="which")
    long["which"] = long.which.str.removesuffix("_ms")
    names = {i: v.plan.name for i, v in enumerate(res.verifications, 1)}
    bars = [
        hv.Bars(g, ["phase", "which"], "value").opts(
            title=f"Plan {k} ({names[k]}): predicted vs measured",
            multi_level=False,
            color="which",
            cmap=PREDICTION_COLORS,
            show_legend=True,
            legend_position="top_left",
            tools=["hover"],
            hooks=[_phase_ticks],
            fontsize={"yticks": "10pt", "title": "11pt"},
            width=760,
            height=360,
            ylabel="ms per step",
            xlabel="phase",
        )
        for k, g in long.groupby("plan")
    ]
    return hv.Layout(bars).cols(1)


# ------------------------------------------------------------------------------- words
def recommendations(res: PlanResult, n: int = 3) -> str:
    """Plain-language top ``n``: each lever of the best plans with its measured gain and risk."""
    scored = sorted(res.effects, key=lambda e: compose(res.base, [e]).total_ms)
    lines = []
    for e in scored:
        gain = 100 * (1 - compose(res.base, [e]).total_ms / res.base.total_ms)
        if gain <= 0 or any(e.lever == x.split("=")[0] for x in lines):
            continue
        lv = LEVERS[e.lever]
        mem = f"peak memory {e.peak_delta_mib:+.1f} MiB"
        stab = "" if not e.profile or e.profile.stability.startswith("stable") else " (noisy measurement)"
        lines.append(
            f"{e.key}: {lv.what}, measured {gain:.0f}% shorter step{stab}; risk: numerical {lv.numerical}; "
            f"{mem}; effort {lv.effort}"
        )
        if len(lines) == n:
            break
    if not lines:
        return "No lever shortened the measured step here."
    v = res.verifications[0] if res.verifications else None
    tail = ""
    if v is not None:
        tail = (
            f"\nBest plan ({v.plan.name}): predicted {v.plan.prediction.total_ms:.1f} ms, "
            f"measured {v.measured.total_ms:.1f} ms ({v.error_pct:+.1f}%; {v.measured.stability.split(':')[0]})"
        )
        if math.isfinite(v.rebased_error_pct):
            tail += (
                f"; the step re-measured just before it moved {v.drift_pct:+.1f}%, and the plan composed on that "
                f"step predicted {v.rebased_ms:.1f} ms ({v.rebased_error_pct:+.1f}%)"
            )
        if v.broken:
            tail += f"; {v.broken}"
    return "\n".join(f"{i}. {s}" for i, s in enumerate(lines, 1)) + tail


__all__ = [
    "CPU_LEVERS",
    "levers_of",
    "headline",
    "PlanLabConfig",
    "base_table",
    "check",
    "composition_check",
    "effects_table",
    "lever_table",
    "periodic_line",
    "plans_table",
    "prediction_plot",
    "recommendations",
    "recorder",
    "run",
    "seams_verdict",
    "verify_phases",
    "verify_table",
    "waterfall_plot",
]


# ------------------------------------------------------------------------------- takeaway
@register(LAB)
def headline(df: pd.DataFrame) -> list[Figure]:
    """The measured step, the best plan with its predicted and measured gain, the prediction error."""
    figs = []
    base = rows(df, experiment="base", variant="step", metric="time")
    b = float(base.value.iloc[0]) if len(base) else math.nan
    if len(base):
        figs.append(Figure("measured step", fmt(b, "ms"), verdict(base.iloc[0])))
    best = rows(df, experiment="plans", metric="step_time")
    best = best[best.variant.map(unscoped) != "measured step"]
    if len(best) and b > 0:
        p = best.loc[best.value.idxmin()]
        name = unscoped(p.variant)
        figs.append(Figure("best plan", name, f"predicted {100 * (1 - p.value / b):+.0f}% step time"))
        v = rows(df, experiment="verify", variant=name, metric="step_time")
        if len(v):
            gain = 100 * (1 - float(v.value.iloc[0]) / b)
            figs.append(Figure("measured gain", f"{gain:+.0f}%", verdict(v.iloc[0]) or "verified"))
    err = rows(df, experiment="verify", metric="prediction_error")
    if len(err):
        figs.append(Figure("prediction error", fmt(err.value.max(), "%"), "worst verified plan"))
    return figs
