"""Lab 07's experiments that need the MMDiT's ``stability_runs`` capability (its runs built from
the lab's specs: preset, precision, recipe, QK-norm): QK-norm on and off, bf16 updates with fp32
master weights or stochastic rounding, AdamW's epsilon / beta2 / clipping, low-precision recipes
and where their drift starts, fp16 with dynamic loss scaling; their tables, verdicts, plots and
the lab's closing lines.  On a step that does not declare it the notebook leaves them out."""

from __future__ import annotations

import math

import holoviews as hv
import pandas as pd

from lab_utils.core.records import Recorder
from lab_utils.stability.numdiff import NumericsDiff, numerics_diff
from lab_utils.stability.training import RunResult
from lab_utils.studies.stability import (
    DRIFT_STATS,
    PRECISION_RUNS,
    StabilityLabConfig,
    asserted,
    curves,
    run_all,
    tel_rows,
)


def run_qk_norm(cfg: StabilityLabConfig) -> dict[str, RunResult]:
    """QK-norm on vs off at a high learning rate, no clipping."""
    kw = dict(lr=cfg.qk_lr, steps=cfg.qk_steps, grad_clip=0.0)
    return run_all(cfg, [cfg.spec("qk_norm on", **kw), cfg.spec("qk_norm off", qk_norm=False, **kw)], "QK-norm")


def run_precision(cfg: StabilityLabConfig) -> dict[str, RunResult]:
    """fp32 baseline; bf16 parameters with round-to-nearest updates, with fp32 master weights,
    with stochastic rounding."""
    return run_all(cfg, [cfg.spec(p, precision=p, lr=cfg.precision_lr) for p in PRECISION_RUNS], "bf16 updates")


def adam_name(eps: float, beta2: float, clip: float) -> str:
    return f"eps={eps:g} beta2={beta2:g} clip={clip:g}" if clip else f"eps={eps:g} beta2={beta2:g} no clip"


def run_adam(cfg: StabilityLabConfig) -> dict[str, RunResult]:
    specs = [
        cfg.spec(adam_name(e, b2, c), lr=cfg.adam_lr, eps=e, beta2=b2, grad_clip=c, spike_window=cfg.spike_window)
        for e, b2, c in cfg.adam_grid
    ]
    return run_all(cfg, specs, "AdamW settings")


def run_recipes(cfg: StabilityLabConfig) -> dict[str, RunResult]:
    """bf16 autocast baseline and each low-precision recipe (lab 04's), same seed and data."""
    kw = dict(lr=cfg.recipe_lr, steps=cfg.recipe_steps, precision="bf16_autocast")
    specs = [cfg.spec("bf16", **kw)] + [cfg.spec(r, recipe=r, **kw) for r in cfg.recipes]
    return run_all(cfg, specs, "recipes")


def recipe_diffs(runs: dict[str, RunResult], tol: float) -> dict[str, NumericsDiff]:
    base = runs["bf16"].telemetry
    return {name: numerics_diff(base, r.telemetry, tol) for name, r in runs.items() if name != "bf16"}


def run_loss_scaling(cfg: StabilityLabConfig) -> dict[str, RunResult]:
    kw = dict(loss_scale_init=cfg.loss_scale_init, loss_scale_interval=cfg.loss_scale_interval)
    specs = [
        cfg.spec("bf16", precision="bf16_autocast"),
        cfg.spec("fp16 + loss scaling", precision="fp16_scaled", **kw),
    ]
    return run_all(cfg, specs, "fp16 vs bf16")


def logit_max_series(r: RunResult) -> pd.Series:
    return tel_rows(r, "logit_max").groupby("step")["value"].max()


def qk_table(runs: dict[str, RunResult]) -> pd.DataFrame:
    rows = []
    for name, r in runs.items():
        lm = logit_max_series(r)
        rows.append(
            dict(
                run=name,
                logit_max_first=lm.iloc[0],
                logit_max_last=lm.iloc[-1],
                logit_max_peak=lm.max(),
                final_loss=r.final_loss(),
            )
        )
    return pd.DataFrame(rows).set_index("run")


def qk_verdict_lines(runs: dict[str, RunResult], growth: float = 5.0) -> list[str]:
    """Deterministic verdicts: without QK-norm the logit max grows more than ``growth`` x;
    with it, less (raises when a run says otherwise)."""
    out = []
    for name, r in runs.items():
        lm = logit_max_series(r)
        out.append(
            f"{name}: logit max grows more than {growth:g}x over the run: {bool(lm.max() > growth * lm.iloc[0])}"
        )
    return asserted(out, [name.endswith("off") for name in runs], "QK-norm")


def precision_table(runs: dict[str, RunResult]) -> pd.DataFrame:
    base = runs["fp32"].final_loss()
    rows = []
    for name, r in runs.items():
        rows.append(
            dict(
                run=name,
                final_loss=r.final_loss(),
                loss_gap_vs_fp32=r.final_loss() - base,
                lost_update_frac=tel_rows(r, "lost_update_frac")["value"].mean(),
            )
        )
    return pd.DataFrame(rows).set_index("run")


def precision_verdict_lines(table: pd.DataFrame) -> list[str]:
    lost = table["lost_update_frac"]
    gap = table["loss_gap_vs_fp32"].abs()
    others = max(gap["bf16_master"], gap["bf16_sr"])
    lines = [
        f"bf16 without master weights loses most of its updates: {bool(lost['bf16'] > 0.5)}",
        f"fp32 master weights lose almost none (< 0.1%): {bool(lost['bf16_master'] < 1e-3)}",
        f"loss gap, bf16 > 10x master and > 10x stochastic rounding: {bool(gap['bf16'] > 10 * others)}",
    ]
    return asserted(lines, [True] * 3, "precision")


def adam_table(runs: dict[str, RunResult]) -> pd.DataFrame:
    rows = []
    for name, r in runs.items():
        ur = tel_rows(r, "update_ratio").groupby("step")["value"].median()
        rows.append(
            dict(
                setting=name,
                final_loss=r.final_loss(),
                update_ratio_median=ur.median(),
                update_ratio_max=ur.max(),
                spikes=int(r.steps.spike.sum()),
            )
        )
    return pd.DataFrame(rows).set_index("setting")


def drift_table(diffs: dict[str, NumericsDiff]) -> pd.DataFrame:
    rows = []
    for name, d in diffs.items():
        for stat in DRIFT_STATS:
            blk, step = d.origin.get(stat, ("none", -1))
            rows.append(dict(recipe=name, stat=stat, drift_starts_in=blk, at_step=step))
    return pd.DataFrame(rows)


def loss_scaling_table(runs: dict[str, RunResult]) -> pd.DataFrame:
    rows = []
    for name, r in runs.items():
        st = r.steps
        sc = st["loss_scale"] if "loss_scale" in st else pd.Series([math.nan])
        skipped = int(st.action.str.contains("skipped").sum())
        rows.append(
            dict(run=name, final_loss=r.final_loss(), skipped_steps=skipped, scale_min=sc.min(), scale_max=sc.max())
        )
    return pd.DataFrame(rows).set_index("run")


def closing_lines(qk, prec_t, drift_t, scale_t, spike_t) -> list[str]:
    """The measured effects, read from the tables above."""
    q = qk_table(qk)
    lines = [
        f"logit max peak: {q.loc['qk_norm on', 'logit_max_peak']:.2f} with QK-norm, "
        f"{q.loc['qk_norm off', 'logit_max_peak']:.2f} without",
        f"lost-update fraction: bf16 {prec_t.loc['bf16', 'lost_update_frac']:.3f}, with fp32 master weights "
        f"{prec_t.loc['bf16_master', 'lost_update_frac']:.3f}, with stochastic rounding "
        f"{prec_t.loc['bf16_sr', 'lost_update_frac']:.3f} (unbiased)",
        "loss gap vs fp32: " + ", ".join(f"{k} {v:+.4f}" for k, v in prec_t["loss_gap_vs_fp32"].items() if k != "fp32"),
    ]
    for r in drift_t.itertuples():
        where = f"in {r.drift_starts_in} at step {r.at_step}" if r.at_step >= 0 else "nowhere in this run"
        lines.append(f"{r.recipe}: {r.stat} first beyond tolerance {where}")
    for name, r in scale_t.iterrows():
        lines.append(f"{name}: {int(r.skipped_steps)} skipped steps, final loss {r.final_loss:.4f}")
    for name, r in spike_t.iterrows():
        lines.append(f"{name}: final loss {r.final_loss:.4f}, replayed {int(r.replayed_steps)} steps")
    return lines


def logit_max_plot(runs: dict[str, RunResult]):
    return curves(
        {n: logit_max_series(r) for n, r in runs.items()}, "logit max", "attention logit max (all blocks)", logy=True
    )


def update_ratio_plot(runs: dict[str, RunResult]):
    frames = {n: tel_rows(r, "update_ratio").groupby("step")["value"].median() for n, r in runs.items()}
    return curves(frames, "||ΔW||/||W||", "update-to-weight ratio (median over blocks)", logy=True)


def lost_update_plot(runs: dict[str, RunResult]):
    frames = {n: tel_rows(r, "lost_update_frac").groupby("step")["value"].mean() for n, r in runs.items()}
    return curves(frames, "fraction", "updates lost to rounding (mean over blocks)")


def diff_heatmap(d: NumericsDiff, stat: str, name: str):
    c = d.cells[d.cells.stat == stat]
    c = c[c.block.str.contains("blocks")]
    return hv.HeatMap(c, ["step", "block"], "rel_diff").opts(
        title=f"{name} vs bf16: relative difference of {stat} (tol {d.tol:g})",
        colorbar=True,
        cmap="viridis",
        tools=["hover"],
        width=700,
        height=300,
    )


def diff_heatmaps(diffs: dict[str, NumericsDiff], stat: str):
    return hv.Layout([diff_heatmap(d, stat, name) for name, d in diffs.items()]).cols(1)


def loss_scale_plot(r: RunResult):
    st = r.steps
    skipped = st[st.action.str.contains("skipped")]
    return (
        hv.Curve(st, "step", "loss_scale", label="loss scale")
        * hv.Scatter(skipped, "step", "loss_scale", label="skipped (overflow)").opts(color="red", size=9)
    ).opts(title="fp16 dynamic loss scale", logy=True, width=700, height=320)


def record_drift(rec: Recorder, table: pd.DataFrame) -> None:
    for r in table.itertuples():
        rec.add("recipe_drift", r.recipe, f"first_step_{r.stat}", r.at_step, "step", block=r.drift_starts_in)
