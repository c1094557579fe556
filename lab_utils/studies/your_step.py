"""Your own training step in labs 01, 05, 07 and 08: the section each of those labs runs on the
step its ``step`` parameter names (``"package.module:function"``, see the README's "Your model";
default perflab's MMDiT).  The step is loaded and its first step checked right after the
lab's config, before the lab measures anything (:func:`load`); each lab then calls its one
function here, which measures, records (every row keyed by the step's identity) and returns
the tables and plots.  The measurements live in :mod:`lab_utils.step`."""

from __future__ import annotations

import holoviews as hv
import pandas as pd

from lab_utils.core.device import pick_device
from lab_utils.core.dtypes import parse_dtype
from lab_utils.core.records import Recorder
from lab_utils.step import levers as step_levers
from lab_utils.step import memory as step_memory
from lab_utils.step import stability as step_stability
from lab_utils.step.contract import StepFactory, blocks, identity
from lab_utils.step.load import DEFAULT_STEP, build_step, check_step_spec, load_step
from lab_utils.step.memory import FORMULA_NOTE
from lab_utils.step.profile import GenericProfile, profile_step, record_profile

#: Largest batch the what-fits bisection tries (a step of each size it tries is run).
FIT_MAX_BATCH = 16
#: Steps of each spike run and the step whose loss is scaled to provoke a spike.
SPIKE_STEPS, SPIKE_AT = 12, 8

__all__ = ["DEFAULT_STEP", "FORMULA_NOTE", "check_step_spec"]


def _kwargs(cfg) -> dict:
    dtype = getattr(cfg, "dtype", "float32")
    return dict(
        device=pick_device(cfg.device),
        dtype=parse_dtype("dtype", dtype) if isinstance(dtype, str) else dtype,
        batch_size=getattr(cfg, "batch_size", None),
        seed=getattr(cfg, "seed", 0),
    )


def load(cfg, rec: Recorder | None = None) -> StepFactory:
    """The lab's step (``cfg.step``), built on the lab's device, dtype and batch size, its first
    step run and checked (a bad factory is refused here, with the reason); ``rec``'s parameters
    get the step's identity, so ``perflab compare`` says when two runs measured two builds."""
    step = load_step(cfg.step, **_kwargs(cfg))
    if rec is not None:
        rec.params["step_identity"] = identity(step).as_dict()
    return step


def step_lines(step: StepFactory) -> list[str]:
    bl = blocks(step)
    kinds = sorted({type(m).__name__ for _, m in bl})
    return [
        f"step: {identity(step)}",
        f"blocks: {len(bl)} ({', '.join(kinds) or 'none detected'})"
        + ("" if step.block_class is None else " (given by the factory)"),
        "phases: data_loading, forward, backward, optimizer" + "".join(f", {p}" for p in step.phases),
    ]


def _extra(step: StepFactory, rec: Recorder | None = None) -> dict:
    """The identity fields each generic row carries (and, given ``rec``, its parameters)."""
    i = identity(step)
    if rec is not None:
        rec.params["step_identity"] = i.as_dict()
    return dict(model_class=i.model_class, parameters=i.parameters, config=i.config_hash)


# ----------------------------------------------------------------------------- lab 01
def profile(cfg, step: StepFactory, rec: Recorder, datasheet=None, dtype: str = "fp32") -> GenericProfile:
    """Lab 01's profile of the step (``cfg.steps`` profiled after ``cfg.warmup_steps``), recorded."""
    _extra(step, rec)
    prof = profile_step(step, steps=cfg.steps, warmup=cfg.warmup_steps)
    record_profile(rec, prof, datasheet=datasheet, dtype=dtype)
    return prof


def phase_bars(prof: GenericProfile):
    t = prof.phase_table()
    t["label"] = [p if w == "" else f"{p} (in {w})" for p, w in zip(t.phase, t.within)]
    return hv.Bars(t, "label", ["ms", "pct_of_step"]).opts(
        title=f"{prof.ident.key}: median ms per phase", xrotation=30, tools=["hover"], ylabel="ms"
    )


# ----------------------------------------------------------------------------- lab 05
def record_state(rec: Recorder, step: StepFactory) -> dict[str, int]:
    """Parameters, gradients and optimizer state of the step, recorded under its identity."""
    key, ex = identity(step).key, _extra(step, rec)
    state = step_memory.state_bytes(step)
    for k, v in state.items():
        rec.add("step_memory", f"{key} · {k}", "bytes", v, "B", **ex)
    return state


def memory(cfg, step: StepFactory, rec: Recorder, *, progress: bool = True) -> dict:
    """Lab 05 on the step: state from the optimizer, saved bytes by region and op, every
    generic policy (gradients checked), what fits ``cfg.device_bytes`` by bisection."""
    key, ex = identity(step).key, _extra(step, rec)
    state = record_state(rec, step)
    saved = step_memory.measure_saved(step, "none")
    for region, v in saved.by("region").items():
        rec.add("step_saved", f"{key} · {region}", "bytes", v, "B", **ex)
    policies = getattr(cfg, "step_policies", step_memory.STEP_POLICIES)
    pol = step_memory.compare_policies(step, policies, reps=getattr(cfg, "reps", 3), progress=progress)
    for r in pol.itertuples():
        rec.add("step_policies", f"{key} · {r.policy}", "saved", r.saved_bytes, "B", **ex)
        rec.add("step_policies", f"{key} · {r.policy}", "peak", r.peak_bytes, "B", **ex)
        rec.add_timing("step_policies", f"{key} · {r.policy}", r.timing, **ex)
    cap = getattr(cfg, "step_fit_max_batch", FIT_MAX_BATCH)
    fit = step_memory.fits_bisect(
        lambda b: build_step(cfg.step, **{**_kwargs(cfg), "batch_size": b}), cfg.device_bytes, max_batch=cap
    )
    fit["capped_at"] = cap
    rec.add(
        "step_fits", key, "max_batch", fit["batch"], "samples", device_bytes=fit["device_bytes"], capped_at=cap, **ex
    )
    return dict(state=state, saved=saved, policies=pol, fits=fit)


def memory_tables(res: dict) -> dict[str, pd.DataFrame]:
    st = pd.DataFrame([dict(what=k, MiB=v / 2**20) for k, v in res["state"].items()])
    sv = res["saved"].frame().groupby(["region", "op"], as_index=False, sort=False)["bytes"].sum()
    sv = sv.sort_values("bytes", ascending=False).head(15)
    pol = res["policies"].drop(columns="timing")
    f = res["fits"]
    tried = ", ".join(
        f"{b}: {v / 2**20:.1f} MiB" if v is not None else f"{b}: OOM" for b, v in sorted(f["tried"].items())
    )
    fits = pd.DataFrame(
        [
            dict(
                device_GB=f["device_bytes"] / 1e9,
                largest_batch=f["batch"],
                capped_at=f.get("capped_at", FIT_MAX_BATCH),
                tried=tried,
            )
        ]
    )
    return dict(state=st, saved=sv, policies=pol, fits=fits)


def policy_plot(pol: pd.DataFrame):
    pts = hv.Points(pol.drop(columns="timing"), ["time_ms", "peak_bytes"], ["policy", "saved_bytes", "stable"])
    labels = hv.Labels(pol.drop(columns="timing"), ["time_ms", "peak_bytes"], "policy")
    return (pts.opts(size=9, tools=["hover"]) * labels.opts(yoffset=0, text_font_size="8pt")).opts(
        title="your step: peak vs step time per checkpointing policy (gradients equal to no checkpointing)",
        xlabel="step time (ms; a shared CPU's times are context)",
        ylabel="peak bytes of forward + backward",
    )


# ----------------------------------------------------------------------------- lab 07
def stability(cfg, rec: Recorder, *, progress: bool = True) -> dict:
    """Lab 07 on the step: the NaN locator (a NaN injected into the first block and into a
    layer of the last, forward and backward), telemetry, and a provoked spike under each
    policy (each run on a fresh build of the step: same weights, same batches)."""
    step = build_step(cfg.step, **_kwargs(cfg))
    key, ex = identity(step).key, _extra(step, rec)
    lines = step_stability.locator_lines(step)
    runs, tel = {}, None
    for pol in ("none", "skip", "clip", "rewind"):
        s = build_step(cfg.step, **_kwargs(cfg))
        df, t, _ = step_stability.run(s, SPIKE_STEPS, spike_policy=pol, provoke_step=SPIKE_AT, progress=progress)
        runs[pol] = df
        tel = t if pol == "none" else tel
        for r in df.itertuples():
            rec.add(
                "step_spikes", f"{key} · {pol}", "loss", r.loss, "", statistic=f"step{r.step}", action=r.action, **ex
            )
    checks = step_stability.spike_check_lines(runs, SPIKE_AT)
    for r in tel.itertuples():
        rec.add("step_telemetry", f"{key} · {r.block} {r.stream}".rstrip(), r.stat, r.value, "",
                statistic=f"step{r.step}", **ex)  # fmt: skip
    return dict(locator=lines, spikes=runs, telemetry=tel, checks=checks)


def telemetry_heatmap(tel: pd.DataFrame, stat: str = "act_rms"):
    d = tel[tel.stat == stat].groupby(["step", "block"], as_index=False)["value"].mean()
    return hv.HeatMap(d, ["step", "block"], "value").opts(
        title=f"your step: {stat} per block and step", colorbar=True, tools=["hover"]
    )


def spike_plot(runs: dict[str, pd.DataFrame]):
    curves = [hv.Curve(df, "step", "loss", label=p) for p, df in runs.items()]
    return hv.Overlay(curves).opts(title=f"your step: loss with a spike provoked at step {SPIKE_AT}", logy=True)


# ----------------------------------------------------------------------------- lab 08
def levers(cfg, rec: Recorder, *, progress: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Lab 08's generic levers on the step at its own shapes; the excluded ones with reasons."""
    kw = _kwargs(cfg)
    df, excluded = step_levers.measure_levers(cfg.step, step_kwargs=kw, progress=progress)
    step = build_step(cfg.step, **kw)
    key, ex = identity(step).key, _extra(step, rec)
    for r in df.itertuples():
        rec.add_timing("step_levers", f"{key} · {r.lever}={r.setting}", r.timing, batch=r.batch, **ex)
    return df.drop(columns="timing"), step_levers.excluded_frame(excluded)
