"""Lab 05 (memory): where a step's memory goes, what each activation-checkpointing policy
buys, and what fits.  The lab's config, its tables and sweeps (each writes its records),
and its plots (which read records)."""

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
    check_float,
    check_int,
    check_int_list,
)
from lab_utils.core.device import cuda_devices, no_cuda_reason, pick_device
from lab_utils.core.dtypes import parse_dtype
from lab_utils.core.plots import init
from lab_utils.core.records import Recorder
from lab_utils.model import ACTIVATION_CHECKPOINTS, PRESETS, MMDiTConfig, build_model, resolve_config
from lab_utils.model.train import artifacts_dir
from lab_utils.step.load import DEFAULT_STEP, check_step_spec
from lab_utils.step.policies import STEP_POLICIES
from lab_utils.step.skip import default_step_only, passes_skipped
from lab_utils.studies.headline import Figure, fmt, register, rows

LAB = "05_memory"
GB = 1e9
#: Why sections 1-4 run on perflab's MMDiT only (on another ``step`` each returns one line saying so).
MMDIT_ONLY = "the formula and FSDP projection are MMDiT-only"
mmdit_only = default_step_only(MMDIT_ONLY)


@dataclass(frozen=True)
class MemoryLabConfig(LabConfig):
    # renamed parameters, accepted under their former names for one release
    RENAMED = {"policies": "activation_checkpoints"}

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
    device_memory_gb: float = 0.0  # 0: the current GPU's memory, or an H200's 141 GB
    fit_resolutions: tuple = (256, 512, 768, 1024, 1536, 2048)
    fsdp_world_sizes: tuple = (2, 3)  # one spawn; 3 ranks do not divide the tiny model's rows
    fsdp_preset: str = "tiny"
    fsdp_gpus: tuple = (1, 2, 4, 8, 16, 32)
    confirm_fit: bool = False  # on CUDA: bisect a real step to the OOM edge
    reps: int = 3
    seed: int = 0
    step: str = DEFAULT_STEP  # your training step, "package.module:function" (the README's "Your model")
    step_policies: tuple = STEP_POLICIES  # the checkpointing policies applied to your step's blocks
    step_fit_max_batch: int = 16  # largest batch the what-fits bisection on your step tries
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
        mem.check_block(cfg, self.inspect_block, "inspect_block")
        check_float("device_memory_gb", self.device_memory_gb, min=0)
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
        check_choices("step_policies", list(self.step_policies), STEP_POLICIES)
        check_int("step_fit_max_batch", self.step_fit_max_batch, min=1)
        check_step_spec(self.step)  # imports and is callable; its first step is checked by your_step.load
        if self.device == "cuda" and not cuda_devices():
            raise ConfigError("device", self.device, f"'auto' or 'cpu' ({no_cuda_reason()})")

    @property
    def device_bytes(self) -> int:
        return int(self.device_memory_gb * GB) if self.device_memory_gb > 0 else mem.default_device_bytes()

    def step_shape(self) -> mem.StepShape:
        return mem.step_shape(self.model, self.batch_size, self.resolution, self.resolution, self.txt_len)


def recorder(cfg: MemoryLabConfig) -> Recorder:
    return Recorder(lab=LAB, params=cfg.to_dict(), device=pick_device(cfg.device))


# --------------------------------------------------------------------------------------
# 1. Accounting: state and saved activations per class, block and op
# --------------------------------------------------------------------------------------


@mmdit_only
def formula_check(cfg: MemoryLabConfig) -> pd.DataFrame:
    """Hooks against the analytic model for every formula policy at the lab's step (CPU); a
    mismatch raises.  One row per policy."""
    mcfg, sh = cfg.model, cfg.step_shape()
    rows = []
    for pol in mem.FORMULA_POLICIES:
        meas = mem.measure_saved(mcfg, sh, cfg.dtype, pol, seed=cfg.seed)
        form = mem.saved_bytes_formula(mcfg, sh, cfg.dtype, pol)
        if meas.by_region() != form:
            raise AssertionError(f"policy {pol!r}: hooks {meas.by_region()} != formula {form}")
        rows.append(
            dict(policy=pol, saved_tensors=len(meas.tensors), hooks_bytes=meas.total, formula_bytes=sum(form.values()))
        )
    return pd.DataFrame(rows)


@mmdit_only
def block_ops(cfg: MemoryLabConfig, rec: Recorder) -> pd.DataFrame:
    """Saved bytes of ``inspect_block`` by the op that made them (no checkpointing)."""
    mcfg, sh = cfg.model, cfg.step_shape()
    rep = mem.measure_saved(mcfg, sh, cfg.dtype, "none", seed=cfg.seed)
    df = pd.DataFrame(rep.rows())
    df = df[df.region == cfg.inspect_block].groupby(["op", "dtype"], as_index=False)["bytes"].agg(["sum", "count"])
    df = df.rename(columns={"sum": "bytes", "count": "tensors"}).sort_values("bytes", ascending=False)
    for r in df.itertuples():
        rec.add(
            "saved_by_op",
            r.op,
            "saved_bytes",
            r.bytes,
            "B",
            shape=sh_str(sh),
            dtype=cfg.dtype,
            block=cfg.inspect_block,
            tensors=r.tensors,
        )
    return df.reset_index(drop=True)


def sh_str(sh: mem.StepShape) -> str:
    return f"{sh.batch}x({sh.img_tokens}+{sh.txt_tokens})"


@mmdit_only
def accounting(cfg: MemoryLabConfig, rec: Recorder) -> pd.DataFrame:
    """Per preset x dtype x policy: bytes per class at ``account_resolution`` (state from the
    model on meta, activations from the formula, transient from its model), batch 1."""
    rows = []
    for preset in cfg.account_presets:
        mcfg = resolve_config(preset)
        sh = mem.step_shape(mcfg, 1, cfg.account_resolution, cfg.account_resolution, cfg.account_txt_len)
        for dt in cfg.account_dtypes:
            st = mem.state_totals(mcfg, dt)
            for pol in mem.FORMULA_POLICIES:
                peak = mem.predicted_peak(mcfg, sh, dt, pol, state=st)
                row = dict(
                    preset=preset, dtype=dt, policy=pol, **{k: peak[k] for k in mem.CLASSES}, total=peak["total"]
                )
                rows.append(row)
                for k in (*mem.CLASSES, "total"):
                    rec.add("accounting", pol, f"{k}_bytes", peak[k], "B", shape=sh_str(sh), dtype=dt, preset=preset)
    return pd.DataFrame(rows)


@mmdit_only
def per_token_table(cfg: MemoryLabConfig, rec: Recorder) -> pd.DataFrame:
    """Bytes per token per block at ``account_resolution`` (image tokens) + ``account_txt_len``
    (text tokens), batch 1, no checkpointing, CUDA's float32 LayerNorm statistics."""
    rows = []
    for preset in cfg.account_presets:
        mcfg = resolve_config(preset)
        sh = mem.step_shape(mcfg, 1, cfg.account_resolution, cfg.account_resolution, cfg.account_txt_len)
        for dt in cfg.account_dtypes:
            for kind in ("double", "single"):
                v = mem.bytes_per_token_per_block(mcfg, dt, kind, sh.img_tokens, sh.txt_tokens, device_type="cuda")
                rows.append(dict(preset=preset, dtype=dt, block=kind, bytes_per_token=round(v, 1)))
                rec.add(
                    "per_token",
                    kind,
                    "bytes_per_token_per_block",
                    v,
                    "B/token",
                    dtype=dt,
                    preset=preset,
                    tokens=f"{sh.img_tokens}+{sh.txt_tokens}",
                    layernorm_stats="float32 (CUDA)",
                )
    return pd.DataFrame(rows)


@mmdit_only
def block_state_table(cfg: MemoryLabConfig, rec: Recorder) -> pd.DataFrame:
    """Parameter/gradient/optimizer bytes per region of the lab's preset (built on meta)."""
    model = build_model(cfg.preset, device="meta", dtype=parse_dtype("dtype", cfg.dtype))
    df = pd.DataFrame([dict(region=k, **v) for k, v in mem.state_bytes(model).items()])
    for r in df.itertuples():
        rec.add("state", r.region, "parameters_bytes", r.parameters, "B", dtype=cfg.dtype, preset=cfg.preset)
    return df


# --------------------------------------------------------------------------------------
# 2. AC policies on the same step
# --------------------------------------------------------------------------------------


@mmdit_only
def compare(cfg: MemoryLabConfig, rec: Recorder) -> pd.DataFrame:
    """Every policy on one step: saved bytes (hooks, formula), peak, FLOPs, time; gradients
    checked equal to no checkpointing (raises otherwise)."""
    mcfg, sh = cfg.model, cfg.step_shape()
    dev = pick_device(cfg.device)
    acs = cfg.activation_checkpoints
    res = mem.compare_policies(mcfg, sh, cfg.dtype, acs, device=dev, seed=cfg.seed, reps=cfg.reps)
    base = next((r.flops for r in res if r.policy == "none"), None)
    rows = []
    for r in res:
        kw = dict(shape=sh_str(sh), dtype=cfg.dtype, preset=cfg.preset)
        rec.add("policies", r.policy, "saved_bytes", r.saved_bytes, "B", method=saved_means(r.policy, dev), **kw)
        rec.add("policies", r.policy, "peak_bytes", r.peak_bytes, "B", method="allocator peak above start", **kw)
        rec.add("policies", r.policy, "step_flops", r.flops, "FLOP", method="FlopCounterMode", **kw)
        rec.add_timing("policies", r.policy, r.timing, **kw)
        recompute = r.flops - base if base is not None else float("nan")
        rec.add("policies", r.policy, "recomputed_flops", recompute, "FLOP", formula="flops - flops(none)", **kw)
        rows.append(
            dict(
                policy=r.policy,
                saved_bytes=r.saved_bytes,
                formula_bytes=r.formula_bytes,
                peak_bytes=r.peak_bytes,
                recomputed_flops=recompute,
                time_ms=getattr(r.timing, "median_ms", float("nan")),
                stable=bool(getattr(r.timing, "ok", False) and r.timing.stable),
                device=dev.type,
                grads_equal=r.grads_equal,
                saved_bytes_are=saved_means(r.policy, dev),
            )
        )
    return pd.DataFrame(rows)


def saved_means(policy: str, dev: torch.device) -> str:
    """What a policy's saved bytes are: kept for the backward; under ``offload`` the bytes
    left on the device, and on a CPU (where ``save_on_cpu`` moves nothing, so neither the
    memory nor the peak drops) the device bytes it would keep on a GPU."""
    if policy != "offload":
        return "kept for the backward (saved_tensors_hooks)"
    if dev.type == "cpu":
        return "device bytes it would keep on a GPU (on CPU save_on_cpu moves nothing: no memory is freed here)"
    return "kept on the device (the rest is in host memory)"


def acts_on(policy: str, device_type: str) -> bool:
    """Whether a policy does what it is for on this device: ``offload`` (``save_on_cpu``)
    moves saved activations to host memory, so on a CPU it moves nothing."""
    return not (policy == "offload" and device_type == "cpu")


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


@passes_skipped
def pareto_plot(df: pd.DataFrame, step: str | None = None, title: str = "AC policies: peak memory vs step time"):
    """Peak memory against step time per policy, each point marked (``pareto_front``): the
    front is drawn through stable timings of policies that act on the device only; when there
    is none, no front is drawn and the title says so."""
    init()
    d = pareto_front(df, step).assign(peak_mb=lambda x: x.peak_bytes / 1e6).sort_values("time_ms")
    vd = ["peak_mb", "policy", "mark", *(c for c in ("saved_bytes", "recomputed_flops") if c in d)]
    layers = []
    for mark, g in d.groupby("mark", sort=False):
        colour, marker = MARKS.get(mark, NOT_ACTING if mark.startswith("does not act") else ("#bcbd22", "square"))
        layers.append(
            hv.Scatter(g, "time_ms", vd, label=mark).opts(tools=["hover"], size=11, color=colour, marker=marker)
        )
    top = d.peak_mb.max() if len(d) and d.peak_mb.notna().any() else 1.0
    layers.append(hv.Labels(d, ["time_ms", "peak_mb"], "policy").opts(yoffset=0.02 * top, text_font_size="8pt"))
    front = d[d.mark == FRONT]
    if len(front):
        layers.append(hv.Curve(front, "time_ms", "peak_mb", label=FRONT).opts(color="black", line_dash="dashed"))
        note = "dashed: Pareto front of the stable timings"
    else:
        note = "no stable timing of a policy that acts here: no Pareto front drawn"
    return hv.Overlay(layers).opts(
        title=f"{title} ({note})",
        xlabel="step time (ms, median)",
        ylabel="peak above start (MB)",
        legend_position="right",  # beside the axes: inside, it covered points and their labels
        width=860,
    )


GPU_SET = Path(__file__).resolve().parents[2] / "parameterized" / "sets" / LAB / "gpu.yaml"


def gpu_set(path: Path = GPU_SET) -> dict:
    """The lab's GPU parameter set (``parameterized/sets/05_memory/gpu.yaml``) as a dict."""
    return yaml.safe_load(Path(path).read_text()) or {}


@passes_skipped
def class_bars(df: pd.DataFrame, dtype: str = "bfloat16"):
    """Stacked bytes per class for each preset x policy (GB), one frame per preset."""
    init()
    frames = {}
    for preset, g in df[df.dtype == dtype].groupby("preset", sort=False):
        long = g.melt(id_vars=["policy"], value_vars=list(mem.CLASSES), var_name="class", value_name="bytes")
        long["GB"] = long.bytes / GB
        frames[preset] = hv.Bars(long, ["policy", "class"], "GB").opts(
            stacked=True,
            xrotation=45,
            title=f"{preset} · {dtype} · batch 1: bytes per class",
            tools=["hover"],
            legend_position="right",  # beside the axes: inside, it covered the tallest stacks
            width=760,
        )
    return hv.HoloMap(frames, kdims=["preset"])


# --------------------------------------------------------------------------------------
# 3. Timeline and what is live at the peak
# --------------------------------------------------------------------------------------


@mmdit_only
def timeline(cfg: MemoryLabConfig, rec: Recorder) -> pd.DataFrame:
    """One AdamW step's categorized memory timeline (profiler on CPU, snapshot on CUDA); the
    full data goes to the artifacts, the per-category peaks to records."""
    dev = pick_device(cfg.device)
    dt = parse_dtype("dtype", cfg.dtype)
    mcfg, sh = cfg.model, cfg.step_shape()
    model = build_model(mcfg, device=dev, dtype=dt, seed=cfg.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = mem.batch_for(mcfg, sh, dt, dev, torch.Generator().manual_seed(cfg.seed))
    out = Path(artifacts_dir()) / "memory"
    if dev.type == "cuda":
        df = mem.cuda_timeline(model, batch, opt, out / "snapshot.pickle", seed=cfg.seed)
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
        df = mem.cpu_timeline(model, batch, opt, out / "timeline.json", seed=cfg.seed)
    for c in df.columns[1:]:
        rec.add("timeline", c, "peak_bytes", float(df[c].max()), "B", shape=sh_str(sh), dtype=cfg.dtype)
    return df


@passes_skipped
def timeline_plot(df: pd.DataFrame, max_points: int = 1500):
    init()
    d = mem.downsample(df, max_points)
    cats = [c for c in d.columns if c != "time_ms" and d[c].max() > 0]
    area = hv.Area.stack(hv.Overlay([hv.Area((d.time_ms, d[c] / 1e6), "time (ms)", "MB", label=c) for c in cats]))
    return area.opts(
        title=f"Memory during one step, by category ({len(d)} of {len(df)} points)",
        legend_position="top_left",
        width=800,
    )


@mmdit_only
def peak_table(cfg: MemoryLabConfig, top: int = 10) -> pd.DataFrame:
    """The largest storages kept for the backward (end of the forward: where memory peaks),
    with the region and op that made them."""
    mcfg, sh = cfg.model, cfg.step_shape()
    rep = mem.measure_saved(mcfg, sh, cfg.dtype, "none", seed=cfg.seed)
    return pd.DataFrame([dataclasses.asdict(t) for t in mem.largest_live(rep, top)])


# --------------------------------------------------------------------------------------
# 4. What fits, FSDP
# --------------------------------------------------------------------------------------


@mmdit_only
def fits(cfg: MemoryLabConfig, rec: Recorder, presets=("medium", "flux-dev"), dtype="bfloat16") -> pd.DataFrame:
    """Largest batch per square resolution that the predicted peak fits in ``device_bytes``."""
    rows = []
    for preset in presets:
        mcfg = resolve_config(preset)
        for pol in mem.FORMULA_POLICIES:
            for r in mem.what_fits(mcfg, dtype, pol, cfg.device_bytes, cfg.fit_resolutions, cfg.account_txt_len):
                rows.append(r)
                rec.add(
                    "what_fits",
                    pol,
                    "max_batch",
                    r["max_batch"],
                    "samples",
                    shape=f"{r['resolution']}px",
                    dtype=dtype,
                    preset=preset,
                    device_bytes=cfg.device_bytes,
                )
    return pd.DataFrame(rows)


@passes_skipped
def fits_table(df: pd.DataFrame) -> pd.DataFrame:
    return df.pivot_table(index=["preset", "policy"], columns="resolution", values="max_batch").astype(int)


@mmdit_only
def fsdp_projection(cfg: MemoryLabConfig, rec: Recorder, preset: str = "flux-dev", dtype: str = "bfloat16"):
    """Per-rank predicted peak at 1024 px, batch 1, for N GPUs (state sharded as ``fully_shard``
    allocates it on the fullest rank, padding included; activations not sharded), and the
    fewest GPUs each policy needs."""
    mcfg = resolve_config(preset)
    sh = mem.step_shape(mcfg, 1, cfg.account_resolution, cfg.account_resolution, cfg.account_txt_len)
    rows = []
    for pol in mem.FORMULA_POLICIES:
        need = mem.gpus_needed(mcfg, sh, dtype, pol, cfg.device_bytes)
        row = dict(policy=pol, gpus_needed=need)
        for n in cfg.fsdp_gpus:
            row[f"{n} GPUs (GB)"] = round(mem.predicted_peak(mcfg, sh, dtype, pol, shards=n)["total"] / GB, 1)
        rows.append(row)
        rec.add(
            "fsdp",
            pol,
            "gpus_needed",
            need if need else float("nan"),
            "GPUs",
            shape=sh_str(sh),
            dtype=dtype,
            preset=preset,
            device_bytes=cfg.device_bytes,
        )
    return pd.DataFrame(rows)


@mmdit_only
def fsdp_check(cfg: MemoryLabConfig, rec: Recorder) -> pd.DataFrame:
    """Real fully_shard AdamW steps on gloo at every world size (one spawn): per-rank bytes
    fully_shard allocates (padded parameter and gradient shards), the bytes each rank holds,
    and every parameter's shard against the projection (a mismatch raises)."""
    rows = mem.run_fsdp(cfg.fsdp_preset, cfg.fsdp_world_sizes)
    for r in rows:
        ws = r["world_size"]
        bad = mem.fsdp_mismatches(r)
        if bad:
            raise AssertionError(f"world_size={ws} rank {r['rank']}: " + "; ".join(bad[:5]))
        for k in mem.FSDP_FIGURES:
            rec.add("fsdp_check", f"ws{ws}-rank{r['rank']}", f"{k}_bytes", r[k], "B", preset=cfg.fsdp_preset)
    return pd.DataFrame(rows).drop(columns=["params", "projected_params"])


@mmdit_only
def confirm_fits(cfg: MemoryLabConfig, rec: Recorder, preset: str = "medium", resolution: int = 1024) -> pd.DataFrame:
    """On CUDA: bisect the batch of a real step to the OOM edge per policy (an OOM is caught,
    recorded, and the search goes on); beside it the prediction.  The step holds the state the
    prediction counts (bf16 weights and gradients, fp32 master weights and AdamW moments:
    ``state_bytes``, equal to the predicted state).  Empty on CPU."""
    if not (cfg.confirm_fit and torch.cuda.is_available()):
        return pd.DataFrame()
    rows = []
    mcfg = resolve_config(preset)
    for pol in ("none", "full", "selective"):
        pred = mem.what_fits(mcfg, "bfloat16", pol, cfg.device_bytes, (resolution,), cfg.account_txt_len)[0]
        fit = mem.bisect_fit(mcfg, pol, resolution, cfg.account_txt_len, hi=max(2 * pred["max_batch"], 2))
        rows.append(
            dict(
                policy=pol,
                predicted=pred["max_batch"],
                measured=fit.edge,
                ooms=fit.ooms,
                state_bytes=sum(fit.state.values()),
                predicted_state_bytes=sum(mem.state_totals(mcfg, "bfloat16").values()),
            )
        )
        rec.add(
            "what_fits",
            pol,
            "max_batch_measured",
            fit.edge,
            "samples",
            shape=f"{resolution}px",
            preset=preset,
            ooms=fit.ooms,
            optimizer="AdamW, fp32 master weights and moments (MasterAdamW)",
        )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------
# The takeaway (from records only: the report's index builds the same line)
# --------------------------------------------------------------------------------------


@register(LAB)
def headline(df: pd.DataFrame) -> list[Figure]:
    """Measured peak without checkpointing, the policy that saves most, and what fits."""
    figs = []
    pk = rows(df, experiment="policies", metric="peak_bytes")
    if len(pk):
        none = pk[pk.variant == "none"]
        if len(none):
            figs.append(Figure("peak memory, no checkpointing", fmt(none.value.iloc[0] / 2**20, "MiB"), "measured"))
        b = pk.loc[pk.value.idxmin()]
        figs.append(Figure("lowest peak", f"{b.variant} {fmt(b.value / 2**20, 'MiB')}"))
    fit = rows(df, experiment="what_fits", metric="max_batch")
    if len(fit):
        px = fit["shape"].str.removesuffix("px").astype(float)
        at = fit[px == (1024.0 if (px == 1024.0).any() else px.max())]
        preset = at["extra"].map(lambda e: json.loads(e).get("preset", "") if e else "")
        best = [at[preset == p].loc[at[preset == p].value.idxmax()] for p in dict.fromkeys(preset)]
        text = "; ".join(f"{p} batch {int(b.value)} ({b.variant})".strip() for p, b in zip(dict.fromkeys(preset), best))
        figs.append(Figure(f"what fits at {at['shape'].iloc[0]}", text, "best policy, bf16, predicted"))
    return figs
