"""Lab 05 (memory): where a step's memory goes, what each activation-checkpointing policy
buys, and what fits.  The lab's config, its tables and sweeps (each writes its records),
and its plots (which read records).

Every section measures the lab's step (the ``step`` parameter: perflab's MMDiT by default, at
the lab's preset, batch, resolution and text length; :mod:`lab_utils.studies.page`): its state,
its saved activations by region and op, its policies, its timeline, what fits the device.  The
sections that need the MMDiT's analytic formula (hooks against the formula, bytes per token, the
presets' accounting, the what-fits projection to large shapes, FSDP) ask for its
``memory_formula`` capability, and the notebook runs them under ``%%needs``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import holoviews as hv
import pandas as pd
import torch
import yaml

from lab_utils import memory as mem
from lab_utils.core.config import (
    ConfigError,
    LabConfig,
    built_from,
    check_choice,
    check_choices,
    check_int,
    check_int_list,
)
from lab_utils.core.device import cuda_devices, no_cuda_reason, pick_device
from lab_utils.core.plots import init
from lab_utils.core.records import Recorder
from lab_utils.model import ACTIVATION_CHECKPOINTS, PRESETS, MMDiTConfig
from lab_utils.model.train import artifacts_dir
from lab_utils.step.contract import StepFactory, blocks
from lab_utils.step.load import DEFAULT_STEP, check_step_spec
from lab_utils.studies.headline import Figure, fmt_bytes, register, rows, unscoped

LAB = "05_memory"
GB = 1e9
MIB = 2**20


@dataclass(frozen=True)
class MemoryLabConfig(LabConfig):
    # renamed parameters, accepted under their former names for one release
    RENAMED = {
        "policies": "activation_checkpoints",
        "step_policies": "activation_checkpoints",
        "step_fit_max_batch": "fit_max_batch",
    }

    device: str = "auto"
    preset: str = "tiny"  # the model whose step is measured
    dtype: str = "float32"
    batch_size: int = 4
    resolution: int = 128  # square image, pixels
    txt_len: int = 8
    # the activation-checkpointing policies compared: every one but compile_budget, which compiles
    # every block (slow on a CPU; the gpu set adds it)
    activation_checkpoints: tuple = tuple(p for p in ACTIVATION_CHECKPOINTS if p != "compile_budget")
    account_presets: tuple = ("tiny", "small", "medium", "flux-dev")
    account_dtypes: tuple = ("float32", "bfloat16")
    account_resolution: int = 1024  # the step shape the accounting table projects to
    account_txt_len: int = 512
    inspect_block: str = "single_blocks.0"  # block whose saved tensors are listed op by op
    # the device what fits is asked for: GB, a GPU name ("H100", "H200", "B200", ...), or 0: this GPU, else an H200
    device_memory_gb: float | str = 0.0
    fit_resolutions: tuple = (256, 512, 768, 1024, 1536, 2048)
    fsdp_world_sizes: tuple = (2, 3)  # one spawn; 3 ranks do not divide the tiny model's rows
    fsdp_preset: str = "tiny"
    fsdp_gpus: tuple = (1, 2, 4, 8, 16, 32)
    confirm_fit: bool = False  # on CUDA: bisect a real step to the OOM edge
    reps: int = 3
    seed: int = 0
    step: str = DEFAULT_STEP  # your training step, "package.module:function" (the README's "Your model")
    fit_max_batch: int = 16  # largest batch the what-fits bisection on real steps tries
    #: the measured model's config, built once from ``preset`` (not a parameter itself)
    model: MMDiTConfig = built_from(MMDiTConfig.from_preset, ("preset",))

    def __post_init__(self):
        super().__post_init__()  # builds .model (checks preset)
        cfg = self.model
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        check_choice("dtype", self.dtype, mem.MEMORY_DTYPES)
        check_int("batch_size", self.batch_size, min=1)
        check_int("txt_len", self.txt_len, min=1)
        check_choices("activation_checkpoints", list(self.activation_checkpoints), ACTIVATION_CHECKPOINTS)
        check_choices("account_presets", list(self.account_presets), PRESETS)
        check_choices("account_dtypes", list(self.account_dtypes), mem.MEMORY_DTYPES)
        check_int("account_txt_len", self.account_txt_len, min=1)
        cfg.check_resolution(self.resolution, self.resolution, "resolution")
        cfg.check_resolution(self.account_resolution, self.account_resolution, "account_resolution")
        if self.step == DEFAULT_STEP:  # the MMDiT's block names; another step's are checked against it (check_step)
            mem.check_block(cfg, self.inspect_block, "inspect_block")
        mem.device_memory(self.device_memory_gb)  # a number of GB >= 0 or a GPU name
        check_int_list("fit_resolutions", list(self.fit_resolutions), min=16)
        for r in self.fit_resolutions:
            cfg.check_resolution(r, r, "fit_resolutions")
        check_int_list("fsdp_world_sizes", list(self.fsdp_world_sizes), min=1)
        if max(self.fsdp_world_sizes) > 8:
            raise ConfigError("fsdp_world_sizes", self.fsdp_world_sizes, "world sizes of at most 8 (gloo on CPU)")
        check_choice("fsdp_preset", self.fsdp_preset, ("tiny", "small"))
        check_int_list("fsdp_gpus", list(self.fsdp_gpus), min=1)
        check_int("reps", self.reps, min=3)
        check_int("seed", self.seed, min=0)
        check_int("fit_max_batch", self.fit_max_batch, min=1)
        check_step_spec(self.step)  # its form; imported, built and checked once by the lab's first cell
        if self.device == "cuda" and not cuda_devices():
            raise ConfigError("device", self.device, f"'auto' or 'cpu' ({no_cuda_reason()})")

    @property
    def device_bytes(self) -> int:
        return mem.device_memory(self.device_memory_gb)[0]

    @property
    def device_label(self) -> str:
        return mem.device_memory(self.device_memory_gb)[1]

    def step_shape(self) -> mem.StepShape:
        return mem.step_shape(self.model, self.batch_size, self.resolution, self.resolution, self.txt_len)

    def check_step(self, step: StepFactory) -> None:
        """The parameters that name parts of the step: ``inspect_block`` is one of its blocks (its
        default names the MMDiT's: another step's first block stands in), and the step takes the
        policies of ``activation_checkpoints`` (the MMDiT's own are left out on another step)."""
        names = [n for n, _ in blocks(step)]
        default = type(self).__dataclass_fields__["inspect_block"].default
        if self.inspect_block not in names and not (self.inspect_block == default and names):
            raise ConfigError("inspect_block", self.inspect_block, f"a block of the step: {', '.join(names) or 'none'}")


def recorder(cfg: MemoryLabConfig) -> Recorder:
    return Recorder(lab=LAB, params=cfg.to_dict(), device=pick_device(cfg.device))


def inspected_block(cfg: MemoryLabConfig, step: StepFactory) -> str:
    """``inspect_block``, or on a step without it (the default names the MMDiT's) its first block."""
    names = [n for n, _ in blocks(step)]
    return cfg.inspect_block if cfg.inspect_block in names else names[0]


def lab_policies(cfg: MemoryLabConfig, step: StepFactory) -> list[str]:
    """The policies of ``activation_checkpoints`` the step takes (its own seam's, else the generic ones)."""
    takes = mem.policies_of(step)
    return [p for p in cfg.activation_checkpoints if p in takes]


def mib(v) -> float:
    return round(float(v) / MIB, 3)


# --------------------------------------------------------------------------------------
# 1. Where the bytes go: state, saved activations by region and op
# --------------------------------------------------------------------------------------


def state_table(step: StepFactory, rec: Recorder) -> pd.DataFrame:
    """Parameters, gradients and the optimizer's state of the step (from its tensors), recorded."""
    state = mem.step_state(step)
    for k, v in state.items():
        rec.add("step_memory", k, "bytes", v, "B")
    return pd.DataFrame([dict(what=k, MiB=mib(v), bytes=v) for k, v in state.items()])


def saved_table(step: StepFactory, rec: Recorder, top: int = 15) -> pd.DataFrame:
    """What the forward keeps for the backward, by region (recorded) and, for the largest, op."""
    rep = mem.measure_saved(step, "none")
    for region, v in rep.by_region().items():
        rec.add("step_saved", region, "bytes", v, "B")
    df = rep.frame().groupby(["region", "op"], as_index=False, sort=False)["bytes"].agg(["sum", "count"])
    df = df.rename(columns={"sum": "bytes", "count": "tensors"}).sort_values("bytes", ascending=False).head(top)
    df.insert(2, "MiB", df.bytes.map(mib))
    df.attrs["total"] = rep.total
    return df.reset_index(drop=True)


# --------------------------------------------------------------------------------------
# 1. Accounting: state and saved activations per class, block and op
# --------------------------------------------------------------------------------------


def block_ops(cfg: MemoryLabConfig, step: StepFactory, rec: Recorder) -> pd.DataFrame:
    """Saved bytes of ``inspect_block`` (:func:`inspected_block`) by the op that made them (no
    checkpointing)."""
    block = inspected_block(cfg, step)
    sh = cfg.step_shape() if step.has("memory_formula") else None
    rep = mem.measure_saved(step, "none")
    df = pd.DataFrame(rep.rows())
    df = df[df.region == block].groupby(["op", "dtype"], as_index=False)["bytes"].agg(["sum", "count"])
    df = df.rename(columns={"sum": "bytes", "count": "tensors"}).sort_values("bytes", ascending=False)
    for r in df.itertuples():
        rec.add(
            "saved_by_op",
            r.op,
            "saved_bytes",
            r.bytes,
            "B",
            shape=sh_str(sh) if sh is not None else "",
            dtype=cfg.dtype,
            block=block,
            tensors=r.tensors,
        )
    return df.reset_index(drop=True)


def sh_str(sh: mem.StepShape) -> str:
    return f"{sh.batch}x({sh.img_tokens}+{sh.txt_tokens})"


# --------------------------------------------------------------------------------------
# 2. AC policies on the same step
# --------------------------------------------------------------------------------------


def compare(cfg: MemoryLabConfig, step: StepFactory, rec: Recorder) -> pd.DataFrame:
    """Every policy of ``activation_checkpoints`` the step takes, on one step: saved bytes (hooks,
    and the formula where the step has one), peak, recomputed FLOPs, time; gradients checked equal
    to no checkpointing (raises otherwise).  Sizes in MiB; records in bytes."""
    dev = step.device
    res = mem.compare_policies(step, lab_policies(cfg, step), reps=cfg.reps)
    base = next((r.flops for r in res if r.policy == "none"), None)
    formula = step.capabilities.get("memory_formula")
    sh = cfg.step_shape() if formula is not None else None
    kw = dict(shape=sh_str(sh), dtype=cfg.dtype, preset=cfg.preset) if sh is not None else dict(dtype=cfg.dtype)
    rows = []
    for r in res:
        fb = None
        if formula is not None and r.policy in mem.FORMULA_POLICIES:
            fb = sum(mem.saved_bytes_formula(formula.cfg, sh, formula.dtype, r.policy, device_type=dev.type).values())
        rec.add("policies", r.policy, "saved_bytes", r.saved_bytes, "B", method=saved_means(r.policy, dev), **kw)
        rec.add("policies", r.policy, "peak_bytes", r.peak_bytes, "B", method="allocator peak above start", **kw)
        rec.add("policies", r.policy, "step_flops", r.flops, "FLOP", method="FlopCounterMode", **kw)
        rec.add_timing("policies", r.policy, r.timing, **kw)
        recompute = r.flops - base if base is not None else float("nan")
        rec.add("policies", r.policy, "recomputed_flops", recompute, "FLOP", formula="flops - flops(none)", **kw)
        rows.append(
            dict(
                policy=r.policy,
                blocks=r.blocks,
                saved_MiB=mib(r.saved_bytes),
                formula_MiB=mib(fb) if fb is not None else None,
                peak_MiB=mib(r.peak_bytes),
                peak_bytes=r.peak_bytes,
                recomputed_flops=recompute,
                time_ms=getattr(r.timing, "median_ms", float("nan")),
                stable=bool(getattr(r.timing, "ok", False) and r.timing.stable),
                device=dev.type,
                acts_here=r.acts_here,
                grads_equal=r.grads_equal,
                saved_bytes_are=saved_means(r.policy, dev),
            )
        )
    df = pd.DataFrame(rows)
    return df if formula is not None else df.drop(columns="formula_MiB")


saved_means, acts_on = mem.saved_means, mem.acts_on  # what a policy's bytes mean, and where it acts


FRONT, BEHIND, UNSTABLE = "Pareto front", "behind the front", "unstable timing"
MARKS = {  # mark -> (colour, marker) of the Pareto plot
    FRONT: ("#1f77b4", "circle"),
    BEHIND: ("#7f7f7f", "circle"),
    UNSTABLE: ("#ff7f0e", "x"),
}
NOT_ACTING = ("#d62728", "triangle")


def not_acting(device_type: str) -> str:
    return f"does not act on {device_type}"


def pareto_front(df: pd.DataFrame, step: str | None = None) -> pd.DataFrame:
    """Each policy row (``policy``, ``time_ms``, ``peak_bytes``; ``stable``, ``device`` and
    ``shape`` when known) with its ``mark``: a policy that does not act on its device (CPU
    ``offload``), an unstable (or failed) timing and, when ``step`` is given, a row of another
    step shape are marked and left out; of the rest, a row no other row beats on both time
    and peak is on the front.  No eligible row: an empty front, never one drawn through noise."""
    d = df.copy()
    dev = d["device"] if "device" in d else pd.Series("", index=d.index)
    stable = d["stable"].fillna(False).astype(bool) if "stable" in d else pd.Series(True, index=d.index)
    d["mark"] = BEHIND
    other = (d["shape"] != step) if (step is not None and "shape" in d) else pd.Series(False, index=d.index)
    d.loc[other, "mark"] = "another step shape"
    d.loc[~stable & ~other, "mark"] = UNSTABLE
    d.loc[~d.time_ms.notna() & ~other, "mark"] = UNSTABLE
    for i in d.index:
        if dev[i] and not acts_on(d.at[i, "policy"], dev[i]):
            d.at[i, "mark"] = not_acting(dev[i])
    best = float("inf")
    for i in d[d.mark == BEHIND].sort_values(["time_ms", "peak_bytes"]).index:
        if d.at[i, "peak_bytes"] < best:
            d.at[i, "mark"], best = FRONT, d.at[i, "peak_bytes"]
    return d


def pareto_plot(df: pd.DataFrame, step: str | None = None, title: str = "AC policies: peak memory vs step time"):
    """Peak memory against step time per policy, each point marked (``pareto_front``): the
    front is drawn through stable timings of policies that act on the device only; when there
    is none, no front is drawn and the title says so."""
    init()
    d = pareto_front(df, step).assign(peak_mib=lambda x: x.peak_bytes / MIB).sort_values("time_ms")
    vd = ["peak_mib", "policy", "mark", *(c for c in ("saved_MiB", "saved_bytes", "recomputed_flops") if c in d)]
    layers = []
    for mark, g in d.groupby("mark", sort=False):
        colour, marker = MARKS.get(mark, NOT_ACTING if mark.startswith("does not act") else ("#bcbd22", "square"))
        layers.append(
            hv.Scatter(g, "time_ms", vd, label=mark).opts(tools=["hover"], size=11, color=colour, marker=marker)
        )
    top = d.peak_mib.max() if len(d) and d.peak_mib.notna().any() else 1.0
    layers.append(hv.Labels(d, ["time_ms", "peak_mib"], "policy").opts(yoffset=0.02 * top, text_font_size="8pt"))
    front = d[d.mark == FRONT]
    if len(front):
        layers.append(hv.Curve(front, "time_ms", "peak_mib", label=FRONT).opts(color="black", line_dash="dashed"))
        note = "dashed: Pareto front of the stable timings"
    else:
        note = "no stable timing of a policy that acts here: no Pareto front drawn"
    return hv.Overlay(layers).opts(
        title=f"{title} ({note})",
        xlabel="step time (ms, median)",
        ylabel="peak above start (MiB)",
        legend_position="right",  # beside the axes: inside, it covered points and their labels
        width=860,
    )


GPU_SET = Path(__file__).resolve().parents[2] / "parameterized" / "sets" / LAB / "gpu.yaml"


def gpu_set(path: Path = GPU_SET) -> dict:
    """The lab's GPU parameter set (``parameterized/sets/05_memory/gpu.yaml``) as a dict."""
    return yaml.safe_load(Path(path).read_text()) or {}


# --------------------------------------------------------------------------------------
# 3. Timeline and what is live at the peak
# --------------------------------------------------------------------------------------


def timeline(cfg: MemoryLabConfig, step: StepFactory, rec: Recorder) -> pd.DataFrame:
    """One step's categorized memory timeline (profiler on CPU, snapshot on CUDA), of a fresh build
    of the lab's step (its factory, resolved once: the same weights, an optimizer whose state the
    step makes); the full data goes to the artifacts, the per-category peaks to records."""
    fresh = step.rebuild()
    dev = fresh.device
    sh = cfg.step_shape() if step.has("memory_formula") else None
    kw = dict(shape=sh_str(sh)) if sh is not None else {}
    out = Path(artifacts_dir()) / "memory"
    try:
        if dev.type == "cuda":
            df = mem.cuda_timeline(fresh, out / "snapshot.pickle")
            df.to_csv(out / "timeline.csv", index=False)
            rec.add("timeline", "allocator", "reserved_bytes", torch.cuda.max_memory_reserved(dev), "B")
            rec.add(
                "timeline",
                "allocator",
                "allocated_bytes",
                torch.cuda.max_memory_allocated(dev),
                "B",
                expandable_segments="expandable_segments:True" in mem.alloc_conf(),
            )
        else:
            df = mem.cpu_timeline(fresh, out / "timeline.json")
    finally:
        if fresh.close is not None:
            fresh.close()
    for c in df.columns[1:]:
        rec.add("timeline", c, "peak_bytes", float(df[c].max()), "B", dtype=cfg.dtype, **kw)
    return df


def timeline_plot(df: pd.DataFrame, max_points: int = 1500):
    init()
    d = mem.downsample(df, max_points)
    d = d.groupby("time_ms", as_index=False, sort=True).last()  # events at one instant: the state after them
    cats = [c for c in d.columns if c != "time_ms" and d[c].max() > 0]
    area = hv.Area.stack(hv.Overlay([hv.Area((d.time_ms, d[c] / MIB), "time (ms)", "MiB", label=c) for c in cats]))
    return area.opts(
        title=f"Memory during one step, by category ({len(d)} of {len(df)} points)",
        legend_position="top_left",
        width=800,
    )


def peak_table(step: StepFactory, top: int = 10) -> pd.DataFrame:
    """The largest storages kept for the backward (end of the forward: where memory peaks),
    with the region, module and op that made them."""
    df = pd.DataFrame([dataclasses.asdict(t) for t in mem.largest_live(mem.measure_saved(step, "none"), top)])
    df.insert(df.columns.get_loc("nbytes") + 1, "MiB", df.nbytes.map(mib))
    return df


# --------------------------------------------------------------------------------------
# 4. What fits, FSDP
# --------------------------------------------------------------------------------------


def fits(cfg: MemoryLabConfig, step: StepFactory, rec: Recorder) -> pd.DataFrame:
    """The largest batch of the step whose predicted peak fits the device of ``device_memory_gb``
    (:func:`lab_utils.memory.fits_bisect`: real steps at batch 1..``fit_max_batch``, the largest
    fitting one checked against its whole step), with each batch tried; recorded.  Sizes in MiB."""
    f = mem.fits_bisect(step, cfg.device_bytes, max_batch=cfg.fit_max_batch)
    kw = dict(device_bytes=f.device_bytes, device=cfg.device_label.split(" (")[0], capped_at=f.max_batch)
    rec.add("step_fits", "largest_batch", "max_batch", f.batch, "samples", **kw)
    if f.extrapolated is not None:
        rec.add("step_fits", "largest_batch", "max_batch_extrapolated", f.extrapolated, "samples", **kw)
    rows = []
    for b, m in sorted(f.tried.items()):
        if m is not None:
            rec.add("step_fits", f"b{b}", "predicted_peak", m.peak, "B", phase=m.peak_phase, **kw)
        rows.append(
            dict(
                batch=b,
                fits=bool(m is not None and m.peak <= f.device_bytes),
                predicted_peak_MiB=mib(m.peak) if m else None,
                state_MiB=mib(m.state) if m else None,
                forward_backward_MiB=mib(m.forward_backward) if m else None,
                gradients_MiB=mib(m.gradients) if m else None,
                held_after_backward_MiB=mib(m.after_backward) if m else None,
                optimizer_step_MiB=mib(m.optimizer_step) if m else None,
                peaks_in=m.peak_phase if m else "out of memory",
            )
        )
    if f.whole is not None:
        rec.add("step_fits", f"b{f.batch}", "whole_step_peak", f.whole, "B", **kw)
    df = pd.DataFrame(rows)
    df.attrs.update(fit=f, device=cfg.device_label)
    return df


def fits_lines(df: pd.DataFrame) -> list[str]:
    """What fits, in words: the device, the largest batch measured (or extrapolated), the check."""
    f, device = df.attrs["fit"], df.attrs["device"]
    if f.batch == 0:
        return [f"{device}: not even batch 1 fits (its predicted peak is above the device's memory)"]
    m = f.tried[f.batch]
    out = [f"{device}: batch {f.batch} fits, predicted peak {fmt_bytes(m.peak)} (in the {m.peak_phase})"]
    if f.capped:
        more = f", about {f.extrapolated:,} by a line through the measured peaks" if f.extrapolated else ""
        out.append(f"every batch tried fits (up to fit_max_batch = {f.max_batch}){more}")
    out.append(f"check: {f.check}" if f.check else "check: not run")
    return out


# --------------------------------------------------------------------------------------
# The takeaway (from records only: the report's index builds the same line)
# --------------------------------------------------------------------------------------


def _extra(r) -> dict:
    return json.loads(r) if isinstance(r, str) and r else {}


@register(LAB)
def headline(df: pd.DataFrame) -> list[Figure]:
    """Measured peak without checkpointing, the lowest peak of a policy that acts here, what fits
    the device (measured on real steps) and, from the MMDiT's formula, what fits at 1024 px."""
    figs = []
    pk = rows(df, experiment="policies", metric="peak_bytes")
    if len(pk):
        pol = pk.variant.map(unscoped)
        saved = rows(df, experiment="policies", metric="saved_bytes")
        idle = {unscoped(r.variant) for r in saved.itertuples() if "moves nothing" in _extra(r.extra).get("method", "")}
        none = pk[pol == "none"]
        if len(none):
            figs.append(Figure("peak memory, no checkpointing", fmt_bytes(none.value.iloc[0]), "measured"))
        acting = pk[~pol.isin(idle)]
        if len(acting):
            b = acting.loc[acting.value.idxmin()]
            figs.append(Figure("lowest peak", f"{unscoped(b.variant)} {fmt_bytes(b.value)}"))
    got = rows(df, experiment="step_fits", metric="max_batch")
    if len(got):
        r = got.iloc[0]
        ex = _extra(r.extra)
        more = rows(df, experiment="step_fits", metric="max_batch_extrapolated")
        value = f"batch {int(r.value)}" + (f" (about {int(more.value.iloc[0]):,} extrapolated)" if len(more) else "")
        figs.append(Figure(f"what fits {ex.get('device', 'the device')}", value, "measured on real steps"))
    fit = rows(df, experiment="what_fits", metric="max_batch")
    if len(fit):
        px = fit["shape"].str.removesuffix("px").astype(float)
        at = fit[px == (1024.0 if (px == 1024.0).any() else px.max())]
        preset = at["extra"].map(lambda e: _extra(e).get("preset", ""))
        best = [at[preset == p].loc[at[preset == p].value.idxmax()] for p in dict.fromkeys(preset)]
        text = "; ".join(f"{p} batch {int(b.value)} ({b.variant})".strip() for p, b in zip(dict.fromkeys(preset), best))
        figs.append(Figure(f"what fits at {at['shape'].iloc[0]}", text, "best policy, bf16, predicted"))
    return figs


def oom_check(cfg: MemoryLabConfig, step: StepFactory, fits_df: pd.DataFrame, rec: Recorder) -> pd.DataFrame | None:
    """On CUDA, when the device asked for is this GPU: real steps bisected to the out-of-memory
    edge (up to twice the predicted batch), beside the prediction.  None (nothing shown) elsewhere."""
    f = fits_df.attrs["fit"]
    if step.device.type != "cuda" or f.device_bytes != mem.default_device_bytes():
        return None
    edge, ooms = mem.oom_edge(step, max(2 * f.batch, 2))
    rec.add("step_fits", "largest_batch", "max_batch_oom_edge", edge, "samples", ooms=ooms, device=cfg.device_label)
    return pd.DataFrame([dict(predicted=f.batch, runs_until_oom=edge, ooms=ooms)])
