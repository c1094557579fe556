"""Lab 07 (numerical stability): its config, experiments, tables, plots and record helpers.

Every experiment is a set of :class:`~lab_utils.stability.training.RunSpec` runs that differ from a
baseline in one setting only (same seed, initialisation, batches, noise and timesteps), with
telemetry on.  The library is :mod:`lab_utils.stability.telemetry` and :mod:`lab_utils.stability.training`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import holoviews as hv
import pandas as pd
import torch
from tqdm.auto import tqdm

from lab_utils.core.config import (
    ConfigError,
    LabConfig,
    check_bool,
    check_choice,
    check_choices,
    check_float,
    check_int,
)
from lab_utils.core.device import pick_device
from lab_utils.core.records import Recorder
from lab_utils.model.config import PRESETS, MMDiTConfig
from lab_utils.precision.quantized import RECIPES
from lab_utils.stability.numdiff import NumericsDiff, numerics_diff
from lab_utils.stability.telemetry import NAN_PHASES
from lab_utils.stability.training import PROVOKE, SPIKE_POLICIES, RunResult, RunSpec, clip_lines, train_run
from lab_utils.step.load import DEFAULT_STEP, check_step_spec
from lab_utils.step.skip import default_step_only, default_step_only_in, hand_on_skipped
from lab_utils.studies.headline import Figure, register, rows

LAB = "07_stability"
PRECISION_RUNS = ("fp32", "bf16", "bf16_master", "bf16_sr")
# act_rms is left out: the residual stream dominates a block's output RMS and hides a block's own error
DRIFT_STATS = ("act_max", "logit_max", "grad_norm")
MMDIT_QK = "QK-norm on and off acts on the MMDiT's qk_norm_rope seam (your step's logit max is in its telemetry)"
MMDIT_LOOP = "this experiment trains the MMDiT in its own loop (train_run at its presets and blocks)"


@dataclass(frozen=True)
class StabilityLabConfig(LabConfig):
    device: str = "auto"
    cpu_threads: int = 1
    preset: str = "tiny"
    steps: int = 24
    batch_size: int = 2
    resolution: int = 64
    txt_len: int = 8
    seed: int = 0
    step: str = DEFAULT_STEP  # your training step, "package.module:function" (the README's "Your model")
    telemetry_every: int = 1
    head_groups: int = 2
    qk_lr: float = 1e-2
    qk_steps: int = 30
    precision_lr: float = 1e-4
    adam_lr: float = 3e-3
    adam_grid: tuple = ((1e-8, 0.999, 1.0), (1e-8, 0.95, 1.0), (1e-6, 0.999, 0.0))
    recipes: tuple = ("fp8_tensor", "mxfp8")
    recipe_lr: float = 1e-3
    recipe_steps: int = 12
    drift_tol: float = 0.02
    loss_scale_init: float = 65536.0
    loss_scale_interval: int = 5
    spike_policies: tuple = ("none", "skip", "clip", "rewind")
    spike_lr: float = 1e-3
    spike_grad_clip: float = 1.0  # the global clip of the spike runs (production's); 0 = off
    provoke: str = "batch"
    provoke_step: int = 12
    poison_scale: float = 30.0
    lr_jump: float = 30.0
    spike_window: int = 16
    spike_threshold: float = 6.0
    nan_checks: tuple = (("double_blocks.1", "forward"), ("single_blocks.0", "backward"), ("double_blocks.0", "weight"))
    progress: bool = True

    def __post_init__(self):
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        check_int("cpu_threads", self.cpu_threads, min=0)
        check_choice("preset", self.preset, PRESETS)
        for name in ("steps", "batch_size", "qk_steps", "recipe_steps", "loss_scale_interval"):
            check_int(name, getattr(self, name), min=1)
        check_int("telemetry_every", self.telemetry_every, min=1)
        check_int("seed", self.seed, min=0)
        check_step_spec(self.step)  # imports and is callable; its first step is checked by your_step.load
        for name in ("qk_lr", "precision_lr", "adam_lr", "recipe_lr", "spike_lr", "drift_tol", "poison_scale"):
            check_float(name, getattr(self, name), min=0, min_exclusive=True)
        check_float("loss_scale_init", self.loss_scale_init, min=1)
        check_float("lr_jump", self.lr_jump, min=0, min_exclusive=True)
        check_float("spike_grad_clip", self.spike_grad_clip, min=0)
        check_choices("recipes", list(self.recipes), [r for r in RECIPES if r != "bf16"])
        check_choices("spike_policies", list(self.spike_policies), SPIKE_POLICIES)
        check_choice("provoke", self.provoke, [p for p in PROVOKE if p != "none"])
        check_int("provoke_step", self.provoke_step, min=1, max=self.steps - 2)
        mcfg = MMDiTConfig.from_preset(self.preset)
        mcfg.check_resolution(self.resolution, self.resolution, param="resolution")
        check_int("head_groups", self.head_groups, min=1)
        if mcfg.num_heads % self.head_groups:
            raise ConfigError("head_groups", self.head_groups, f"a positive divisor of num_heads = {mcfg.num_heads}")
        grid = [list(g) for g in self.adam_grid] if isinstance(self.adam_grid, (list, tuple)) else None
        if not grid or any(len(g) != 3 for g in grid):
            raise ConfigError("adam_grid", self.adam_grid, "a non-empty list of [eps, beta2, grad_clip] triples")
        for eps, beta2, clip in grid:
            check_float("adam_grid", eps, min=0, min_exclusive=True)
            check_float("adam_grid", beta2, min=0, max=0.999999)
            check_float("adam_grid", clip, min=0)
        blocks = {f"double_blocks.{i}" for i in range(mcfg.depth_double)}
        blocks |= {f"single_blocks.{i}" for i in range(mcfg.depth_single)}
        for chk in self.nan_checks:
            if not isinstance(chk, (list, tuple)) or len(chk) != 2 or chk[0] not in blocks:
                raise ConfigError("nan_checks", self.nan_checks, f"[block, phase] pairs, block one of {sorted(blocks)}")
            check_choice("nan_checks", chk[1], NAN_PHASES)
        check_bool("progress", self.progress)

    def spec(self, name: str, **kw) -> RunSpec:
        dev = pick_device(self.device)
        base = dict(
            name=name,
            preset=self.preset,
            device=str(dev),
            steps=self.steps,
            batch_size=self.batch_size,
            resolution=self.resolution,
            txt_len=self.txt_len,
            seed=self.seed,
            telemetry_every=self.telemetry_every,
            head_groups=self.head_groups,
        )
        return RunSpec(**{**base, **kw})


def setup(cfg: StabilityLabConfig) -> None:
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)


def _run_all(cfg: StabilityLabConfig, specs: list[RunSpec], desc: str) -> dict[str, RunResult]:
    out = {}
    # progress on: a bar unless the environment turns bars off (TQDM_DISABLE=1, as headless runs
    # do), so the smoke suite's run is the run at the lab's defaults and is not made twice
    bar = {} if cfg.progress else {"disable": True}
    for s in tqdm(specs, desc=desc, **bar):
        out[s.name] = train_run(s)
    return out


# ------------------------------------------------------------------------------ experiments
@default_step_only(MMDIT_QK)
def run_qk_norm(cfg: StabilityLabConfig) -> dict[str, RunResult]:
    """QK-norm on vs off at a high learning rate, no clipping."""
    kw = dict(lr=cfg.qk_lr, steps=cfg.qk_steps, grad_clip=0.0)
    return _run_all(cfg, [cfg.spec("qk_norm on", **kw), cfg.spec("qk_norm off", qk_norm=False, **kw)], "QK-norm")


def run_precision(cfg: StabilityLabConfig) -> dict[str, RunResult]:
    """fp32 baseline; bf16 parameters with round-to-nearest updates, with fp32 master weights,
    with stochastic rounding."""
    return _run_all(cfg, [cfg.spec(p, precision=p, lr=cfg.precision_lr) for p in PRECISION_RUNS], "bf16 updates")


def adam_name(eps: float, beta2: float, clip: float) -> str:
    return f"eps={eps:g} beta2={beta2:g} clip={clip:g}" if clip else f"eps={eps:g} beta2={beta2:g} no clip"


def run_adam(cfg: StabilityLabConfig) -> dict[str, RunResult]:
    specs = [
        cfg.spec(adam_name(e, b2, c), lr=cfg.adam_lr, eps=e, beta2=b2, grad_clip=c, spike_window=cfg.spike_window)
        for e, b2, c in cfg.adam_grid
    ]
    return _run_all(cfg, specs, "AdamW settings")


def run_recipes(cfg: StabilityLabConfig) -> dict[str, RunResult]:
    """bf16 autocast baseline and each low-precision recipe (lab 04's), same seed and data."""
    kw = dict(lr=cfg.recipe_lr, steps=cfg.recipe_steps, precision="bf16_autocast")
    specs = [cfg.spec("bf16", **kw)] + [cfg.spec(r, recipe=r, **kw) for r in cfg.recipes]
    return _run_all(cfg, specs, "recipes")


def recipe_diffs(runs: dict[str, RunResult], tol: float) -> dict[str, NumericsDiff]:
    base = runs["bf16"].telemetry
    return {name: numerics_diff(base, r.telemetry, tol) for name, r in runs.items() if name != "bf16"}


def run_loss_scaling(cfg: StabilityLabConfig) -> dict[str, RunResult]:
    kw = dict(loss_scale_init=cfg.loss_scale_init, loss_scale_interval=cfg.loss_scale_interval)
    specs = [
        cfg.spec("bf16", precision="bf16_autocast"),
        cfg.spec("fp16 + loss scaling", precision="fp16_scaled", **kw),
    ]
    return _run_all(cfg, specs, "fp16 vs bf16")


def run_spikes(cfg: StabilityLabConfig) -> dict[str, RunResult]:
    """A clean run, then the provoked spike under each policy, all with ``spike_grad_clip`` as the
    global clip (the clip policy's two cases: :mod:`lab_utils.stability.training`'s note)."""
    kw = dict(
        lr=cfg.spike_lr,
        grad_clip=cfg.spike_grad_clip,
        spike_window=cfg.spike_window,
        spike_threshold=cfg.spike_threshold,
        poison_scale=cfg.poison_scale,
        lr_jump=cfg.lr_jump,
        provoke_step=cfg.provoke_step,
    )
    specs = [cfg.spec("clean", **kw)]
    specs += [
        cfg.spec(f"{cfg.provoke} spike, {p}", provoke=cfg.provoke, spike_policy=p, **kw) for p in cfg.spike_policies
    ]
    return _run_all(cfg, specs, "spikes")


_INJECTED = {"forward": "forward NaN", "backward": "backward NaN", "weight": "weight-gradient Inf"}


def nan_locator_lines(cfg: StabilityLabConfig) -> list[str]:
    """Inject a NaN into each chosen block at step 2 of a short run (forward: into its output;
    backward: into the gradient flowing back through it; weight: an Inf into its first
    parameter's gradient alone); the step's one-step replay must name that block.  Raises
    when it does not, or when the non-finite step is not located at all."""
    lines = []
    for block, phase in cfg.nan_checks:
        res = train_run(cfg.spec(f"nan {block} {phase}", steps=4, nan_module=block, nan_phase=phase, nan_step=2))
        events = [(i, e) for i, e in res.nonfinite if e is not None]
        expect = "forward" if phase == "forward" else "backward"
        if not events or events[0][1].block != block or events[0][1].phase != expect:
            raise AssertionError(f"{_INJECTED[phase]} injected into {block} was located as {res.nonfinite}")
        i, e = events[0]
        skipped = int((res.steps.action == "non-finite: skipped").sum())
        lines.append(
            f"injected {_INJECTED[phase]} in {block}: step {i}, located in {e.module} ({e.tensor}); skipped {skipped}"
        )
    return lines


# ------------------------------------------------------------------------------ tables
def _tel(r: RunResult, stat: str) -> pd.DataFrame:
    t = r.telemetry
    return t[t.stat == stat]


def logit_max_series(r: RunResult) -> pd.Series:
    return _tel(r, "logit_max").groupby("step")["value"].max()


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


def _asserted(lines: list[str], expected: list[bool], what: str) -> list[str]:
    """The verdict lines, raising when one's trailing True/False is not the lab's claim."""
    off = [ln for ln, e in zip(lines, expected, strict=True) if not ln.endswith(f": {e}")]
    if off:
        raise AssertionError(f"{what}: the lab's claim does not hold: " + "; ".join(off))
    return lines


def qk_verdict_lines(runs: dict[str, RunResult], growth: float = 5.0) -> list[str]:
    """Deterministic verdicts: without QK-norm the logit max grows more than ``growth`` x;
    with it, less (raises when a run says otherwise)."""
    out = []
    for name, r in runs.items():
        lm = logit_max_series(r)
        out.append(
            f"{name}: logit max grows more than {growth:g}x over the run: {bool(lm.max() > growth * lm.iloc[0])}"
        )
    return _asserted(out, [name.endswith("off") for name in runs], "QK-norm")


def precision_table(runs: dict[str, RunResult]) -> pd.DataFrame:
    base = runs["fp32"].final_loss()
    rows = []
    for name, r in runs.items():
        rows.append(
            dict(
                run=name,
                final_loss=r.final_loss(),
                loss_gap_vs_fp32=r.final_loss() - base,
                lost_update_frac=_tel(r, "lost_update_frac")["value"].mean(),
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
    return _asserted(lines, [True] * 3, "precision")


def adam_table(runs: dict[str, RunResult]) -> pd.DataFrame:
    rows = []
    for name, r in runs.items():
        ur = _tel(r, "update_ratio").groupby("step")["value"].median()
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


def spike_table(runs: dict[str, RunResult]) -> pd.DataFrame:
    rows = []
    for name, r in runs.items():
        st = r.steps
        rows.append(
            dict(
                run=name,
                spikes_at=list(st.step[st.spike.fillna(False).astype(bool)]),
                actions=sorted(set(st.action) - {"step"}),
                final_loss=r.final_loss(),
                replayed_steps=r.replayed_steps,
            )
        )
    return pd.DataFrame(rows).set_index("run")


def spike_verdict_lines(runs: dict[str, RunResult], provoke_step: int) -> list[str]:
    clean = runs["clean"].steps
    out = [f"clean run: spikes detected: {int(clean.spike.sum())}"]
    for name, r in runs.items():
        if name == "clean":
            continue
        st = r.steps
        first = st.step[st.spike.fillna(False).astype(bool)]
        out.append(
            f"{name}: first spike at the provoked step (or the next): "
            f"{bool(len(first) and provoke_step <= first.iloc[0] <= provoke_step + 1)}"
        )
    if int(clean.spike.sum()):
        raise AssertionError(f"spikes: the lab's claim does not hold: {out[0]} (a clean run has none)")
    return [out[0], *_asserted(out[1:], [True] * (len(out) - 1), "spikes")]


def _policy_runs(runs: dict[str, RunResult]) -> dict[str, RunResult]:
    """{policy: run} of the provoked runs."""
    return {r.spec.spike_policy: r for r in runs.values() if r.spec.provoke != "none"}


_SAME_ACTION = {("spike: skipped", "rewound: batch skipped")}


def _same(x: float, y: float) -> bool:
    return bool(x == y or (math.isnan(x) and math.isnan(y)))


def rewind_matches_skip(skip: RunResult, rewind: RunResult) -> tuple[bool, int]:
    """Whether ``rewind`` computes exactly the losses and gradient norms of ``skip`` up to the
    step where their actions part (a rewound batch counts as a skipped one: they part where
    ``rewind`` has used up its rewinds and applies a spike that ``skip`` skips), and that
    step.  A rewind restores the weights, moments, detector window and loss scale of its
    checkpoint and replays the same batches and noise: anything but equality is state
    leaking through the checkpoint."""
    a, b = skip.steps.set_index("step"), rewind.steps.set_index("step")
    part = int(min(a.index.max(), b.index.max()))
    for k in a.index.intersection(b.index):
        if a.action[k] != b.action[k] and (a.action[k], b.action[k]) not in _SAME_ACTION:
            part = int(k)
            break
    ok = True
    for k in a.index.intersection(b.index):
        if k > part or b.action[k] == "rewound: batch skipped":
            continue
        ok &= _same(a.loss[k], b.loss[k]) and _same(a.grad_norm[k], b.grad_norm[k])
    return ok, part


def policy_check_lines(runs: dict[str, RunResult]) -> list[str]:
    """Checks of the policies against each other: ``clip`` must change the trajectory of
    ``none`` and clip each spike to its rule's norm, saying which case applied (``clip_lines``),
    and ``rewind`` must replay exactly the ``skip`` policy's losses until their actions part
    (each raises when it does not hold)."""
    pol = _policy_runs(runs)
    out = []
    if "clip" in pol and "none" in pol:
        clip, none = pol["clip"].steps, pol["none"].steps
        n = min(len(clip), len(none))
        changed = not all(_same(x, y) for x, y in zip(clip.loss.to_numpy()[:n], none.loss.to_numpy()[:n]))
        if not changed:
            raise AssertionError(f"the clip policy left the trajectory of 'none' unchanged: {sorted(set(clip.action))}")
        clipped = int((clip.action == "spike: clipped").sum())
        out.append(f"clip changes the trajectory of none: {changed} ({clipped} step(s) clipped)")
        out += clip_lines(pol["clip"])
    if "skip" in pol and "rewind" in pol:
        ok, upto = rewind_matches_skip(pol["skip"], pol["rewind"])
        if not ok:
            raise AssertionError(f"rewind does not replay the skip policy's losses before step {upto}")
        out.append(f"rewind replays exactly the skip policy's losses until their actions part: {ok}")
    return out


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


# ------------------------------------------------------------------------------ plots
def _curves(frames: dict[str, pd.Series], ylabel: str, title: str, logy: bool = False):
    curves = [hv.Curve((s.index.to_numpy(), s.to_numpy()), "step", ylabel, label=name) for name, s in frames.items()]
    return hv.Overlay(curves).opts(title=title, logy=logy, legend_position="top_left", width=700, height=360)


def logit_max_plot(runs: dict[str, RunResult]):
    return _curves(
        {n: logit_max_series(r) for n, r in runs.items()}, "logit max", "attention logit max (all blocks)", logy=True
    )


def loss_plot(runs: dict[str, RunResult], title: str = "loss", logy: bool = False):
    return _curves({n: r.steps.set_index("step")["loss"] for n, r in runs.items()}, "loss", title, logy=logy)


def update_ratio_plot(runs: dict[str, RunResult]):
    frames = {n: _tel(r, "update_ratio").groupby("step")["value"].median() for n, r in runs.items()}
    return _curves(frames, "||ΔW||/||W||", "update-to-weight ratio (median over blocks)", logy=True)


def lost_update_plot(runs: dict[str, RunResult]):
    frames = {n: _tel(r, "lost_update_frac").groupby("step")["value"].mean() for n, r in runs.items()}
    return _curves(frames, "fraction", "updates lost to rounding (mean over blocks)")


def block_heatmap(r: RunResult, stat: str, title: str | None = None):
    t = _tel(r, stat).groupby(["step", "block"], as_index=False)["value"].max()
    return hv.HeatMap(t, ["step", "block"], "value").opts(
        title=title or f"{stat} per block, {r.spec.name}", colorbar=True, tools=["hover"], width=700, height=300
    )


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


def spike_plot(runs: dict[str, RunResult], provoke_step: int):
    return (loss_plot(runs, "loss with a provoked spike, per policy", logy=True) * hv.VLine(provoke_step)).opts(
        legend_position="top_right"
    )


# ------------------------------------------------------------------------------ records
def record_runs(rec: Recorder, experiment: str, runs: dict[str, RunResult], *, telemetry: bool = False) -> None:
    """Per-step loss / grad norm rows (finite ones), one final-loss row per run, and, with
    ``telemetry``, every telemetry row, non-finite values included (experiment "telemetry",
    what ``perflab numdiff`` reads)."""
    for name, r in runs.items():
        shape = (r.spec.batch_size, r.spec.resolution, r.spec.resolution)
        for row in r.steps.itertuples():
            for metric in ("loss", "grad_norm"):
                v = getattr(row, metric)
                if math.isfinite(v):
                    rec.add(experiment, name, metric, v, "", shape=shape, step=int(row.step), action=row.action)
        rec.add(experiment, name, "final_loss", r.final_loss(), "", shape=shape, statistic="mean_last_quarter")
        if telemetry:  # non-finite values too (NaN, +-Inf): where a run went non-finite is the point
            for t in r.telemetry.itertuples():
                rec.add(
                    "telemetry",
                    name,
                    t.stat,
                    t.value,
                    "",
                    shape=shape,
                    step=int(t.step),
                    block=t.block,
                    stream=t.stream,
                    source=experiment,
                )


def record_table(rec: Recorder, experiment: str, table: pd.DataFrame) -> None:
    """Numeric columns of a summary table, one row per (index, column)."""
    for idx, row in table.iterrows():
        for col, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                rec.add(experiment, str(idx), str(col), float(v), "")


def record_drift(rec: Recorder, table: pd.DataFrame) -> None:
    for r in table.itertuples():
        rec.add("recipe_drift", r.recipe, f"first_step_{r.stat}", r.at_step, "step", block=r.drift_starts_in)


# on another step the experiments return one Skipped line and what reads them hands it on (see "Your step")
default_step_only_in(globals(), MMDIT_LOOP, "run_precision run_adam run_recipes run_loss_scaling run_spikes")
default_step_only_in(globals(), MMDIT_LOOP, "nan_locator_lines")
hand_on_skipped(
    globals(),
    "recipe_diffs qk_table qk_verdict_lines precision_table precision_verdict_lines adam_table "
    "drift_table loss_scaling_table spike_table spike_verdict_lines policy_check_lines closing_lines "
    "logit_max_plot loss_plot update_ratio_plot lost_update_plot block_heatmap diff_heatmaps "
    "loss_scale_plot spike_plot record_runs record_table record_drift",
)
# --------------------------------------------------------------------------------------
# The takeaway (from records only: the report's index builds the same line)
# --------------------------------------------------------------------------------------


@register(LAB)
def headline(df: pd.DataFrame) -> list[Figure]:
    """The largest loss gap to fp32, the spikes seen, the steps the spike policies replayed."""
    figs = []
    gap = rows(df, experiment="precision_summary", metric="loss_gap_vs_fp32")
    if len(gap):
        w = gap.loc[gap.value.abs().idxmax()]
        figs.append(Figure("largest loss gap vs fp32", f"{w.variant} {w.value:+.3g}"))
    sp = rows(df, experiment="adamw_summary", metric="spikes")
    if len(sp):
        figs.append(Figure("loss spikes (AdamW runs)", f"{int(sp.value.sum())}", f"{len(sp)} runs"))
    rp = rows(df, experiment="spike_summary", metric="replayed_steps")
    if len(rp):
        figs.append(Figure("steps replayed by spike policies", f"{int(rp.value.sum())}"))
    return figs
