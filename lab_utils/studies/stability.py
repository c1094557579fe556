"""Lab 07 (numerical stability): its config, experiments, tables, plots and record helpers.

Every experiment is a set of :class:`~lab_utils.stability.training.RunSpec` runs that differ from a
baseline in one setting only (same seed, initialisation, batches, noise and timesteps), with
telemetry on.  The library is :mod:`lab_utils.stability.telemetry` and :mod:`lab_utils.stability.training`.

The runs train the lab's step (the ``step`` parameter): perflab's MMDiT built from each spec (its
``stability_runs`` capability: preset, precision, recipe, QK-norm), or a fresh build of any other
step from its factory for each run (same weights, same batches).  The NaN locator and the spike
policies run on any step; QK-norm, bf16 updates, AdamW settings, recipes and fp16 loss scaling need
``stability_runs``, and the notebook runs them under ``%%needs``.
"""

from __future__ import annotations

import json
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
from lab_utils.stability.telemetry import NAN_PHASES
from lab_utils.stability.training import PROVOKE, SPIKE_POLICIES, RunResult, RunSpec, clip_lines, train_run
from lab_utils.step.contract import StepFactory, blocks
from lab_utils.step.load import DEFAULT_STEP, check_step_spec
from lab_utils.studies.headline import Figure, register, rows, unscoped

LAB = "07_stability"
PRECISION_RUNS = ("fp32", "bf16", "bf16_master", "bf16_sr")
# act_rms is left out: the residual stream dominates a block's output RMS and hides a block's own error
DRIFT_STATS = ("act_max", "logit_max", "grad_norm")


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
        check_step_spec(self.step)  # its form; imported, built and checked once by the lab's first cell
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

    def check_step(self, step: StepFactory) -> None:
        """``nan_checks`` name modules of the step (their default names the MMDiT's: another step
        gets its own, :func:`nan_checks_of`)."""
        names = dict(step.model.named_modules())
        default = type(self).__dataclass_fields__["nan_checks"].default
        missing = [m for m, _ in self.nan_checks if m not in names]
        if missing and tuple(map(tuple, self.nan_checks)) != tuple(map(tuple, default)):
            raise ConfigError(
                "nan_checks",
                self.nan_checks,
                f"[module, phase] pairs naming modules of the step ({missing[0]!r} is not one)",
            )

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


def run_all(
    cfg: StabilityLabConfig, specs: list[RunSpec], desc: str, step: StepFactory | None = None, *, bar: bool = True
) -> dict[str, RunResult]:
    """Each spec's run: perflab's MMDiT built from the spec, or, on a ``step`` without
    ``stability_runs``, a fresh build of that step (its factory, resolved once)."""
    out = {}
    fresh = step is not None and not step.has("stability_runs")
    # progress on: a bar unless the environment turns bars off (TQDM_DISABLE=1, as headless runs
    # do), so the smoke suite's run is the run at the lab's defaults and is not made twice
    bar = {} if cfg.progress and bar else {"disable": True}
    for s in tqdm(specs, desc=desc, **bar):
        built = step.rebuild() if fresh else None
        try:
            out[s.name] = train_run(s, step=built)
        finally:
            if built is not None and built.close is not None:
                built.close()
    return out


def nan_checks_of(cfg: StabilityLabConfig, step: StepFactory) -> list[tuple[str, str]]:
    """The (module, phase) pairs the locator is checked on: ``nan_checks`` where the step has those
    modules, else its first block forward, the first linear layer of its last block backward (a
    last block's first output may not reach the loss) and its first block's weight gradient."""
    names = dict(step.model.named_modules())
    if all(m in names for m, _ in cfg.nan_checks):
        return [tuple(c) for c in cfg.nan_checks]
    bl = blocks(step)
    if not bl:
        raise ConfigError("step", step.name, "a model with repeated blocks (none detected; give block_class)")
    last, mod = bl[-1]
    lin = next((f"{last}.{n}" for n, m in mod.named_modules() if isinstance(m, torch.nn.Linear)), last)
    return [(bl[0][0], "forward"), (lin, "backward"), (bl[0][0], "weight")]


# ------------------------------------------------------------------------------ experiments
def run_spikes(cfg: StabilityLabConfig, step: StepFactory | None = None) -> dict[str, RunResult]:
    """A clean run, then the provoked spike under each policy, all with ``spike_grad_clip`` as the
    global clip (the clip policy's two cases: :mod:`lab_utils.stability.training`'s note).
    On a step without ``stability_runs`` each run is a fresh build of it (its own learning rate)."""
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
    return run_all(cfg, specs, "spikes", step)


_INJECTED = {"forward": "forward NaN", "backward": "backward NaN", "weight": "weight-gradient Inf"}


def nan_locator_lines(
    cfg: StabilityLabConfig, step: StepFactory | None = None, rec: Recorder | None = None
) -> list[str]:
    """Inject a NaN into each chosen module (:func:`nan_checks_of`) at step 2 of a short run
    (forward: into its output; backward: into the gradient flowing back through it; weight: an
    Inf into its first parameter's gradient alone); the step's one-step replay must name that
    module (or one inside it).  Raises when it does not, or when the non-finite step is not
    located at all.  ``rec``: each located module, recorded."""
    lines = []
    checks = nan_checks_of(cfg, step) if step is not None else [tuple(c) for c in cfg.nan_checks]
    for module, phase in checks:
        spec = cfg.spec(f"nan {module} {phase}", steps=4, nan_module=module, nan_phase=phase, nan_step=2)
        res = run_all(cfg, [spec], "NaN locator", step, bar=False)[spec.name]  # a checked cell: no bar
        events = [(i, e) for i, e in res.nonfinite if e is not None]
        expect = "forward" if phase == "forward" else "backward"
        found = events[0][1] if events else None
        if (
            found is None
            or found.phase != expect
            or not (found.module == module or found.module.startswith(module + "."))
        ):
            raise AssertionError(f"{_INJECTED[phase]} injected into {module} was located as {res.nonfinite}")
        i, e = events[0]
        skipped = int((res.steps.action == "non-finite: skipped").sum())
        if rec is not None:
            rec.add("nan_locator", f"{module} {phase}", "located_step", i, "step", module=e.module, tensor=e.tensor)
        lines.append(
            f"injected {_INJECTED[phase]} in {module}: step {i}, located in {e.module} ({e.tensor}); skipped {skipped}"
        )
    return lines


# ------------------------------------------------------------------------------ tables
def tel_rows(r: RunResult, stat: str) -> pd.DataFrame:
    t = r.telemetry
    return t[t.stat == stat]


def asserted(lines: list[str], expected: list[bool], what: str) -> list[str]:
    """The verdict lines, raising when one's trailing True/False is not the lab's claim."""
    off = [ln for ln, e in zip(lines, expected, strict=True) if not ln.endswith(f": {e}")]
    if off:
        raise AssertionError(f"{what}: the lab's claim does not hold: " + "; ".join(off))
    return lines


def spike_table(runs: dict[str, RunResult]) -> pd.DataFrame:
    rows = []
    for name, r in runs.items():
        st = r.steps
        at = list(st.step[st.spike.fillna(False).astype(bool)])
        rows.append(
            dict(
                run=name,
                spikes=len(at),
                spikes_at=at,
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
    return [out[0], *asserted(out[1:], [True] * (len(out) - 1), "spikes")]


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


# ------------------------------------------------------------------------------ plots
def curves(frames: dict[str, pd.Series], ylabel: str, title: str, logy: bool = False):
    curves = [hv.Curve((s.index.to_numpy(), s.to_numpy()), "step", ylabel, label=name) for name, s in frames.items()]
    return hv.Overlay(curves).opts(title=title, logy=logy, legend_position="top_left", width=700, height=360)


def loss_plot(runs: dict[str, RunResult], title: str = "loss", logy: bool = False):
    return curves({n: r.steps.set_index("step")["loss"] for n, r in runs.items()}, "loss", title, logy=logy)


def block_heatmap(r: RunResult, stat: str, title: str | None = None):
    t = tel_rows(r, stat).groupby(["step", "block"], as_index=False)["value"].max()
    return hv.HeatMap(t, ["step", "block"], "value").opts(
        title=title or f"{stat} per block, {r.spec.name}", colorbar=True, tools=["hover"], width=700, height=300
    )


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


# --------------------------------------------------------------------------------------
# The takeaway (from records only: the report's index builds the same line)
# --------------------------------------------------------------------------------------


@register(LAB)
def headline(df: pd.DataFrame) -> list[Figure]:
    """Where an injected NaN was located, the largest loss gap to fp32, the spikes seen, the
    provoked spike caught and the steps the spike policies replayed."""
    figs = []
    nan = rows(df, experiment="nan_locator", metric="located_step")
    if len(nan):
        where = sorted({json.loads(e).get("module", "") for e in nan.extra if e})
        figs.append(Figure("NaN located in", ", ".join(where), f"{len(nan)} injected, each found"))
    gap = rows(df, experiment="precision_summary", metric="loss_gap_vs_fp32")
    if len(gap):
        w = gap.loc[gap.value.abs().idxmax()]
        figs.append(Figure("largest loss gap vs fp32", f"{unscoped(w.variant)} {w.value:+.3g}"))
    sp = rows(df, experiment="adamw_summary", metric="spikes")
    if len(sp):
        figs.append(Figure("loss spikes (AdamW runs)", f"{int(sp.value.sum())}", f"{len(sp)} runs"))
    found = rows(df, experiment="spike_summary", metric="spikes")
    found = found[found.variant.map(unscoped) != "clean"]
    if len(found):
        caught = int((found.value > 0).sum())
        figs.append(Figure("provoked spike", f"detected in {caught} of {len(found)} runs", "robust z-score"))
    rp = rows(df, experiment="spike_summary", metric="replayed_steps")
    if len(rp):
        figs.append(Figure("steps replayed by spike policies", f"{int(rp.value.sum())}"))
    return figs
