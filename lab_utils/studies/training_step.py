"""Lab 01 (``labs/01_training_step.ipynb``): its parameters, tables and plots.

The lab profiles its step (the ``step`` parameter: perflab's MMDiT trainer by default, built from
the lab's parameters; any model through the step contract): the measuring is
:func:`lab_utils.profiling.profiler.profile_step`'s, the plots here read a
:class:`~lab_utils.profiling.profiler.ProfileReport`'s tables and never measure.  The checked
facts about the MMDiT (its presets, its faithfulness to diffusers' FLUX blocks, its FLOP formula,
its config's refusals) ask for the MMDiT's capabilities: the notebook runs them under ``%%needs``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import holoviews as hv
import pandas as pd
import torch

from lab_utils.core.ceilings import get_ceilings
from lab_utils.core.config import ConfigError, check_bool, check_int
from lab_utils.core.device import DeviceInfo, datasheet_for
from lab_utils.core.records import Recorder
from lab_utils.model import (
    PRESETS,
    MMDiTConfig,
    analytic_param_count,
    build_model,
    diffusers_block_errors,
    forward_flops,
    num_params,
)
from lab_utils.model.encoders import Encoders
from lab_utils.model.train import PHASES, TrainConfig, fit_fixed_batch, synthetic_batch
from lab_utils.profiling.profiler import (
    PERIODIC_RULE,
    ProfileReport,
    periodic_note,
    training_step_flops,
)
from lab_utils.profiling.profiler import profile_step as profile_run
from lab_utils.step.contract import StepFactory
from lab_utils.step.load import DEFAULT_STEP, check_step_spec
from lab_utils.step.mmdit import trainer_step
from lab_utils.studies.headline import Figure, fmt, fmt_bytes, register, rows, unscoped, verdict


@dataclass(frozen=True)
class TrainingStepLabConfig(TrainConfig):
    """Parameters of ``labs/01_training_step.ipynb``: the step's plus the profile schedule."""

    warmup_steps: int = 1  # profiled but not analysed (compile, first-call effects)
    steps: int = 6  # active, analysed steps: each figure's samples (its noise is judged from them)
    quick_ceilings: bool = True
    step: str = DEFAULT_STEP  # your training step, "package.module:function" (the README's "Your model")

    def __post_init__(self):
        super().__post_init__()
        check_int("warmup_steps", self.warmup_steps, min=0)
        check_int("steps", self.steps, min=1)
        check_bool("quick_ceilings", self.quick_ceilings)
        check_step_spec(self.step)  # its form; imported, built and checked once by the lab's first cell


def recorder(cfg: TrainingStepLabConfig, info: DeviceInfo, lab: str = "01_training_step") -> Recorder:
    """The lab's recorder (the ceilings join it when the profile measures them)."""
    return Recorder(lab=lab, params=cfg.to_dict(), device=info.torch_device)


PHASE_COLORS = dict(zip(PHASES, ("#8c8c8c", "#e377c2", "#bcbd22", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")))


def phase_bars(report: ProfileReport):
    """Stacked bar of phases per profiled step (hover shows ms)."""
    df = report.analysis.phases.copy()
    df["step"] = df.step.astype(str)
    return hv.Bars(df, ["step", "phase"], "ms").opts(
        stacked=True,
        cmap=PHASE_COLORS,
        tools=["hover"],
        xlabel="profiled step",
        ylabel="ms",
        title="Phases per step (stacked)",
        legend_position="right",
        width=760,
    )


def phase_table(report: ProfileReport) -> pd.DataFrame:
    """Each phase's time per step with its samples' verdict; a checkpoint every N steps counts
    as its cost per save / N (:data:`lab_utils.profiling.profiler.PERIODIC_RULE`), its full cost beside it."""
    rows = [
        dict(
            phase=f.phase,
            ms_per_step=_sig(f.ms),
            every_n_steps=f.every,
            ms_per_event=_sig(f.per_event_ms),
            samples=len(f.samples),
            verdict=str(f.verdict).split(":")[0],
        )
        for f in report.phase_figures()
    ]
    for f in report.nested_phase_figures():  # a factory's own phases, inside the one that holds them
        rows.append(
            dict(
                phase=f"{f.phase} (in {f.within})",
                ms_per_step=_sig(f.ms),
                every_n_steps=1,
                ms_per_event=_sig(f.ms),
                samples=len(f.samples),
                verdict=str(f.verdict).split(":")[0],
            )
        )
    return pd.DataFrame(rows, columns=["phase", "ms_per_step", "every_n_steps", "ms_per_event", "samples", "verdict"])


def phase_summary_bars(report: ProfileReport):
    """Time per step by phase (median over the profiled steps), periodic phases amortised;
    the rule and each periodic phase's full cost are stated on the figure (its x label)."""
    figs = report.phase_figures()
    df = pd.DataFrame(
        [dict(phase=f.phase, ms=f.ms, ms_per_event=f.per_event_ms, every=f.every) for f in figs],
        columns=["phase", "ms", "ms_per_event", "every"],
    )
    note = periodic_note(figs)
    return hv.Bars(df, "phase", ["ms", "ms_per_event", "every"]).opts(
        color="phase",
        cmap=PHASE_COLORS,
        tools=["hover"],
        ylabel="ms per step",
        xlabel=f"phase · {note} ({PERIODIC_RULE})" if note else "phase",
        title=f"Time per step by phase (median of {len(report.analysis.steps)} profiled steps)",
        width=760,
        show_legend=False,
    )


def category_map(report: ProfileReport):
    """Time per kernel category, for all steps together and per step (HoloMap slider)."""
    a = report.analysis
    frames = {"all": a.categories[["category", "ms"]]}
    for k, g in a.categories_by_step.groupby("step"):
        frames[f"step {k}"] = g[["category", "ms"]]
    els = {
        k: hv.Bars(v, "category", "ms").opts(
            tools=["hover"], xrotation=35, width=760, title=f"Where the time goes ({a.source})"
        )
        for k, v in frames.items()
    }
    return hv.HoloMap(els, kdims=["steps"])


def top_ops_table(report: ProfileReport):
    """The top operators with their full names (a styled HTML table: a bokeh table cuts long
    names at its column width): total ms over the profiled steps, median ms per step, share."""
    a = report.analysis
    t = a.top_ops.copy()
    if a.top_ops_by_step is not None and len(t):
        t["ms_per_step"] = t.name.map(a.top_ops_by_step.groupby("name").ms.median())
    t = t.rename(columns={"ms": "ms_total"})
    cols = [c for c in ("name", "category", "calls", "ms_total", "ms_per_step", "pct_of_step") if c in t]
    fmt = {"ms_total": "{:.4g}", "ms_per_step": "{:.4g}", "pct_of_step": "{:.2f}"}
    return (
        t[cols]
        .style.hide(axis="index")
        .format({k: v for k, v in fmt.items() if k in cols})
        .set_table_styles([dict(selector="td", props="white-space: nowrap; text-align: left")])
    )


def memory_curve(report: ProfileReport):
    a = report.analysis
    what = "allocated (CUDA caching allocator)" if a.device_kind == "cuda" else "allocated since profiling began (CPU)"
    curve = hv.Curve(a.memory, "t_ms", "allocated_mb").opts(
        tools=["hover"], width=760, xlabel="ms since first step", ylabel="MiB", title=f"Memory: {what}"
    )
    # dotted lines at step boundaries (the memory clock starts at the first step's start)
    bounds = [0.0, *a.steps.step_ms.cumsum().tolist()]
    lines = [hv.VLine(t).opts(color="gray", line_dash="dotted") for t in bounds]
    return hv.Overlay([curve, *lines])


def mfu_bars(mfu: pd.DataFrame):
    df = mfu[mfu.pct.notna()].copy()
    if not len(df):
        if (mfu.quantity != "achieved").any():  # peaks, but no rate to set against them
            return hv.Div("<p>MFU n/a: the profiled steps took no time, so they have no rate.</p>")
        return hv.Div("<p>No peak to compare with on this device.</p>")
    df["pct"] = df.pct.astype(float)
    return hv.Bars(df, "quantity", ["pct", "tflops"]).opts(
        tools=["hover"], ylabel="% of peak", width=500, title="MFU: achieved / peak"
    )


def mfu_dtype(train_cfg, step: StepFactory | None = None) -> str:
    """The matmul dtype the step runs in, for MFU's peak: the trainer's (autocast bf16 or bf16
    weights) on perflab's MMDiT, else the step's parameters' (bf16, fp16 or fp32)."""
    if step is not None and not step.has("train_config"):
        p = next(step.model.parameters(), None)
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(p.dtype if p is not None else None, "fp32")
    return "bf16" if train_cfg.autocast == "bf16" or train_cfg.dtype == "bfloat16" else "fp32"


def _sig(v, digits: int = 4):
    """Round to significant digits (tiny CPU throughputs must not print as 0.0)."""
    try:
        return float(f"{float(v):.{digits}g}")
    except (TypeError, ValueError):
        return v


def _figure_text(v) -> str:
    """A figure to 3 significant digits, "n/a" where it is not a finite number."""
    try:
        v = float(v)
    except (TypeError, ValueError):
        return "n/a"
    return f"{v:.3g}" if math.isfinite(v) else "n/a"


def steps_frame(report: ProfileReport) -> pd.DataFrame:
    """Per profiled step: time (as profiled, and with periodic phases amortised), phase
    coverage, busy/idle, FLOPs and TFLOP/s (4 significant digits)."""
    df = report.steps
    for c in ("step_ms", "amortised_ms", "phase_sum_ms", "coverage", "busy_ms", "idle_ms", "tflops"):
        df[c] = df[c].map(_sig)
    return df


def mfu_table(mfu: pd.DataFrame):
    """The MFU rows as text: an undefined figure (no rate: steps of no time) reads "n/a"; the
    achieved row has no % of a peak ("")."""
    t = mfu.copy()
    t["tflops"] = t.tflops.map(_figure_text)
    t["pct"] = [
        "" if q == "achieved" else _figure_text(v) for q, v in zip(t.quantity, t.pct.astype(float), strict=True)
    ]
    return hv.Table(t, "quantity", ["dtype", "tflops", "pct", "reference"]).opts(width=700, height=150)


# --------------------------------------------------------------------------------------
# The lab's checked facts (deterministic text; each check asserts)
# --------------------------------------------------------------------------------------


# Published sizes (model cards): FLUX.1 [dev]/[schnell] transformers "12 billion" (11.9 B
# counted), T5-XXL v1.1 encoder 4.76 B, CLIP ViT-L/14 text encoder 123 M, FLUX VAE 83.8 M.
PUBLIC_PARAMS_B = {"flux-dev": 11.9, "flux-schnell": 11.9, "t5": 4.76, "clip": 0.123, "vae": 0.0838}


def preset_lines() -> list[str]:
    """One line per preset (built on meta: nothing allocated), parameter counts checked
    against the analytic count, plus flux-dev's encoders."""
    lines = []
    for name in PRESETS:
        m = build_model(name, device="meta")
        c = m.cfg
        n = num_params(m)
        assert n == analytic_param_count(c), f"{name}: built {n:,d} != analytic {analytic_param_count(c):,d}"
        lines.append(
            f"{name:13s} {c.depth_double:2d}+{c.depth_single:2d} blocks  width {c.hidden_size:4d}"
            f"  heads {c.num_heads:2d}  params {n:>14,d} ({n / 1e9:.3f} B)"
        )
        public = PUBLIC_PARAMS_B.get(name)
        assert public is None or abs(n / 1e9 - public) < 0.05, f"{name}: {n / 1e9:.3f} B, public figure {public} B"
    enc = Encoders("flux-dev", device="meta").param_counts()
    for k, v in enc.items():
        assert abs(v / 1e9 / PUBLIC_PARAMS_B[k] - 1) < 0.01, (
            f"encoder {k}: {v / 1e9:.3f} B, public {PUBLIC_PARAMS_B[k]} B"
        )
    lines.append("flux-dev encoders: " + ", ".join(f"{k} {v / 1e9:.3f} B" for k, v in enc.items()))
    return lines


def faithfulness_lines(seed: int = 0) -> list[str]:
    """The model against diffusers' FLUX blocks, and a tiny model that must learn a fixed batch."""
    errs = diffusers_block_errors(seed=seed)
    same = {k: v < 1e-5 for k, v in errs.items()}
    torch.manual_seed(seed)
    tiny = build_model("tiny", seed=seed).train()
    fixed = synthetic_batch("tiny", 2, height=64, width=48, txt_len=9, generator=torch.Generator().manual_seed(3))
    losses = fit_fixed_batch(tiny, fixed, 30, lr=1e-3)
    learns = losses[-1] < 0.3 * losses[0]
    assert all(same.values()), f"the MMDiT differs from diffusers' FLUX blocks: {errs}"
    assert learns, f"loss did not fall on a fixed batch: {losses[0]:.4g} -> {losses[-1]:.4g}"
    return [
        f"diffusers equality at float32, relative error < 1e-5: {same}",
        f"loss decreased over 30 steps on a fixed batch (last < 0.3 x first): {learns}",
    ]


def step_flops_by_hand(cfg: MMDiTConfig, batch: int, img: int, txt: int) -> int:
    """A step by hand: each matmul's backward costs twice its forward (the input's and the
    weight's gradient), attention's too (the model convention), except the input gradient of
    the linears fed by the batch itself (img_in, txt_in, the first linear of each embedder)."""
    d = cfg.hidden_size
    no_input_grad = 2 * batch * d * (img * cfg.in_channels + txt * cfg.context_dim + 256 + cfg.pooled_dim)
    no_input_grad += 2 * batch * d * 256 * cfg.guidance_embed
    return int(3 * forward_flops(cfg, batch, img, txt)["total"]) - no_input_grad


def forward_flops_from_modules(preset: str, batch: int, img: int, txt: int) -> float:
    """A forward from the built model's own linears (2 FLOPs per weight per row: image
    stream rows, text stream rows, joint rows in single blocks, one row per sample for the
    modulation and embedder MLPs) plus 4 * L^2 * width per block for QK^T and PV."""
    model = build_model(preset, device="meta")
    total = 0.0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            leaf = name.split(".")[2 if "blocks" in name else 0]
            rows = {"img_in": img, "txt_in": txt, "img_attn": img, "img_mlp": img, "txt_attn": txt, "txt_mlp": txt}
            rows |= {"linear1": img + txt, "linear2": img + txt, "final_layer": img if name.endswith(".linear") else 1}
            total += 2.0 * batch * rows.get(leaf, 1) * mod.in_features * mod.out_features
    blocks = model.cfg.depth_double + model.cfg.depth_single
    return total + blocks * 4.0 * batch * (img + txt) ** 2 * model.cfg.hidden_size


def flop_lines() -> list[str]:
    """A tiny step's counted FLOPs against the analytic forward, and flux-dev's forward at
    1024 px; each held to a derivation by hand (raises when one differs)."""
    tc = MMDiTConfig.from_preset("tiny")
    step_flops = training_step_flops(tc, 2, (4, 4), 16)
    fwd = forward_flops(tc, 2, 16, 16)["total"]
    fd = MMDiTConfig.from_preset("flux-dev")
    flux = forward_flops(fd, 1, 4096, 512)["total"]
    if step_flops != step_flops_by_hand(tc, 2, 16, 16):
        raise AssertionError(f"tiny step: counted {step_flops:,d} != by hand {step_flops_by_hand(tc, 2, 16, 16):,d}")
    by_modules = forward_flops_from_modules("flux-dev", 1, 4096, 512)
    if flux != by_modules:
        raise AssertionError(f"flux-dev forward: {flux:.6g} != from its modules {by_modules:.6g}")
    return [
        f"tiny, batch 2, 64x64 px (16 image tokens), 16 text tokens: {step_flops:,d} FLOPs per step "
        f"= {step_flops / fwd:.3f} x the forward's {int(fwd):,d}",
        f"flux-dev forward, batch 1, 1024x1024 px (4096 image tokens) + 512 text tokens: {flux / 1e12:.1f} TFLOP",
    ]


def bad_input_lines() -> list[str]:
    """What a bad parameter is told (each must be refused before any work starts)."""
    out = []
    for make in (
        lambda: TrainConfig(preset="flux-ultra"),
        lambda: TrainConfig(buckets=[[64, 72]]),
        lambda: TrainConfig(batch_size=0),
        lambda: MMDiTConfig.from_preset("tiny", num_heads=128),
    ):
        try:
            make()
        except ConfigError as e:
            out.append(str(e))
        else:
            raise AssertionError("a bad parameter was accepted")
    return out


@dataclass
class StepProfile:
    """One profiled configuration of the step: the report, its records and the MFU dtype."""

    report: ProfileReport
    rec: Recorder
    seams: dict
    mfu_dtype: str
    mfu: pd.DataFrame


def profile_step(
    cfg: TrainingStepLabConfig,
    info: DeviceInfo,
    *,
    lab: str = "01_training_step",
    step: StepFactory | None = None,
    rec: Recorder | None = None,
) -> StepProfile:
    """Profile the lab's ``step`` (``cfg.steps`` after ``cfg.warmup_steps``) and record every number
    into ``rec`` (with the ceilings, measured here).  Without a step: perflab's MMDiT trainer built
    from ``cfg`` (the explorer's configurations), closed when profiled."""
    own = step is None
    step = trainer_step(cfg) if own else step
    seams = dict(getattr(step.model, "seams", None) or {})
    try:
        report = profile_run(step, active=cfg.steps, warmup=cfg.warmup_steps)
    finally:
        if own and step.close is not None:
            step.close()
    ceilings = get_ceilings(info.torch_device, quick=cfg.quick_ceilings)
    rec = rec if rec is not None else recorder(cfg, info, lab)
    rec.ceilings = ceilings
    mdt = mfu_dtype(cfg, step)
    sheet = datasheet_for(info)
    report.record(rec, ceilings=ceilings, datasheet=sheet, dtype=mdt, shape=f"b{cfg.batch_size}")
    return StepProfile(report, rec, seams, mdt, report.mfu(ceilings, sheet, mdt))


def artifact_lines(p: StepProfile) -> list[str]:
    r = p.report
    lines = [f"trace: {r.trace_path}"]
    if r.memory_html_path is not None:
        lines.append(f"CUDA memory history: {r.memory_html_path}")
    lines += [f"note: {n}" for n in r.notes]
    return lines


# --------------------------------------------------------------------------------------
# The takeaway (from records only: the report's index builds the same line)
# --------------------------------------------------------------------------------------


@register("01_training_step")
def headline(df: pd.DataFrame) -> list[Figure]:
    """Step time, MFU against the measured matmul ceiling, peak memory and the largest phase."""
    figs = []
    st = rows(df, experiment="step", metric="step_time", statistic="median")
    step_ms = float(st.value.iloc[0]) if len(st) else math.nan
    if len(st):
        figs.append(Figure("step time", fmt(step_ms, "ms"), verdict(st.iloc[0]) or "median, checkpoint amortised"))
    sheet = rows(df, metric="pct_of_peak", experiment="mfu")
    sheet = sheet[sheet.variant.map(unscoped).str.startswith("datasheet peak")]
    gpu = "device_kind" in df and (df["device_kind"].astype(str) == "cuda").any()
    m = rows(df, experiment="mfu", variant="measured matmul ceiling", metric="pct_of_peak")
    if gpu and len(sheet):  # on a GPU the datasheet's peak, the figure MFU is quoted against
        figs.append(Figure("MFU", fmt(sheet.value.iloc[0], "%"), "of the datasheet peak"))
    elif len(m):
        figs.append(Figure("MFU", fmt(m.value.iloc[0], "%"), "of the measured matmul ceiling"))
    elif {"experiment", "metric"} <= set(df.columns) and (df.experiment.eq("mfu") & df.metric.eq("pct_of_peak")).any():
        figs.append(Figure("MFU", fmt(math.nan, "%"), "no rate: the profiled steps took no time"))
    mem = rows(df, experiment="memory", metric="cuda_max_allocated")
    mem = mem if len(mem) else rows(df, experiment="memory", metric="peak_allocated")
    if len(mem):
        figs.append(Figure("peak memory", fmt_bytes(mem.value.iloc[0] * 2**20), mem.metric.iloc[0]))  # recorded in MiB
    ph = rows(df, experiment="phases", metric="time")
    if "extra" in ph:  # a phase inside another is counted there: not a phase of its own
        ph = ph[~ph.extra.astype(str).str.contains('"within"')]
    if len(ph) and step_ms > 0:
        top = ph.loc[ph.value.idxmax()]
        figs.append(Figure("largest phase", f"{unscoped(top.variant)} {100 * top.value / step_ms:.0f}% of the step"))
    return figs
