"""Lab 04 (``labs/04_low_precision.ipynb``): its parameters, checks, tables and plots.

Formats and their exact emulation are ``lab_kernels.quant``'s; error analysis and the
matmul sweeps are :mod:`lab_utils.precision.numerics`'; recipes, the convergence runner and the
Amdahl bound are :mod:`lab_utils.precision.quantized`'s.  This module runs them with the lab's
parameters (on the MMDiT of :mod:`lab_utils.model`), writes the records and draws what
the records say (plots never measure).

The Amdahl table uses the matmul share of step time *measured* by a short profile of
the lab's preset (``lab_utils.profiling.profiler.profile_training``); the constant shares of the
``matmul_shares`` parameter are only what-ifs and are labelled so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import holoviews as hv
import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from lab_kernels import quant as Q
from lab_kernels.lowp_matmul import ACCUMULATIONS
from lab_utils.core.config import (
    ConfigError,
    LabConfig,
    check_bool,
    check_choice,
    check_choices,
    check_float,
    check_int,
    check_int_list,
)
from lab_utils.core.device import DeviceInfo, device_info, pick_device
from lab_utils.core.records import Recorder
from lab_utils.core.session import Session
from lab_utils.model import LARGE_PRESETS, PRESETS, build_model, image_ids, patchify, resolve_config, text_ids
from lab_utils.model.train import TrainConfig, Trainer
from lab_utils.precision import numerics as N
from lab_utils.precision import peers
from lab_utils.precision import quantized as P
from lab_utils.profiling.profiler import profile_training
from lab_utils.studies.headline import Figure, register, rows

#: the matmul speed-ups of the Amdahl table: 1.5x, FP8 vs bf16 dense peak (2x), FP4 vs bf16 (4x)
SPEEDUPS = (1.5, 2.0, 4.0)


@dataclass(frozen=True)
class LowPrecisionLabConfig(LabConfig):
    """Parameters of ``labs/04_low_precision.ipynb`` (names = the notebook's parameters)."""

    device: str = "auto"
    cpu_threads: int = 1
    format_variants: list = field(
        default_factory=lambda: [
            "fp8_e4m3/tensor",
            "fp8_e4m3/row",
            "fp8_e4m3/block128",
            "fp8_e5m2/tensor",
            "mxfp8_e4m3/floor",
            "mxfp8_e4m3/rceil",
            "mxfp4/floor",
            "mxfp4/floor+hadamard32",
            "nvfp4",
            "nvfp4+hadamard16",
        ]
    )
    distributions: list = field(default_factory=lambda: ["gaussian", "laplace", "student_t", "outlier_channels"])
    tensor_shape: list = field(default_factory=lambda: [128, 256])
    explorer_tensor: str = "outlier_channels"
    capture_preset: str = "tiny"
    capture_modules: int = 6
    matmul_shapes: list = field(default_factory=lambda: [[128, 256, 128], [256, 512, 256]])
    matmul_formats: list = field(default_factory=lambda: ["fp8_e4m3", "mxfp8_e4m3", "mxfp4", "nvfp4"])
    accum_ks: list = field(default_factory=lambda: [256, 1024, 4096])
    accumulations: list = field(default_factory=lambda: ["fp32", "bf16", "fp8_fast", "fp8_fast_promote128"])
    reps: int = 5
    matmul_shares: list = field(default_factory=lambda: [0.3, 0.6, 0.8])  # what-if shares beside the measured one
    profile_steps: int = 2  # profiled training steps of `preset` that measure the matmul share
    preset: str = "tiny"
    recipes: list = field(
        default_factory=lambda: ["fp8_tensor", "mxfp8", "torchao_float8_tensorwise", "torchao_float8_rowwise"]
    )
    steps: int = 10
    seeds: list = field(default_factory=lambda: [0, 1])
    batch_size: int = 4
    lr: float = 1e-3
    autocast: bool = True

    def __post_init__(self):
        small = [p for p in PRESETS if p not in LARGE_PRESETS]
        check_choice("device", self.device, ["auto", "cpu", "cuda"])
        check_int("cpu_threads", self.cpu_threads, min=0)
        check_choices("format_variants", self.format_variants, list(N.FORMAT_VARIANTS))
        check_choices("distributions", self.distributions, list(N.DISTRIBUTIONS))
        check_int_list("tensor_shape", self.tensor_shape, min=1)
        if len(self.tensor_shape) != 2:
            raise ConfigError("tensor_shape", self.tensor_shape, "[rows, cols]")
        check_choice("explorer_tensor", self.explorer_tensor, list(N.DISTRIBUTIONS))
        check_choice("capture_preset", self.capture_preset, small)
        check_int("capture_modules", self.capture_modules, min=1)
        if not isinstance(self.matmul_shapes, (list, tuple)) or not self.matmul_shapes:
            raise ConfigError("matmul_shapes", self.matmul_shapes, "a non-empty list of [M, K, N]")
        for s in self.matmul_shapes:
            if (
                not isinstance(s, (list, tuple))
                or len(s) != 3
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in s)
            ):
                raise ConfigError("matmul_shapes", self.matmul_shapes, "a list of [M, K, N] positive integers")
        check_choices("matmul_formats", self.matmul_formats, list(Q.FORMATS))
        check_int_list("accum_ks", self.accum_ks, min=1)
        check_choices("accumulations", self.accumulations, list(ACCUMULATIONS))
        check_int("reps", self.reps, min=1)
        if (
            not isinstance(self.matmul_shares, (list, tuple))
            or not self.matmul_shares
            or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1 for v in self.matmul_shares
            )
        ):
            raise ConfigError("matmul_shares", self.matmul_shares, "a non-empty list of fractions in [0, 1]")
        check_int("profile_steps", self.profile_steps, min=1)
        check_choice("preset", self.preset, small)
        check_choices("recipes", self.recipes, [r for r in P.RECIPES if r != "bf16"])
        check_int("steps", self.steps, min=2)
        check_int_list("seeds", self.seeds, min=0)
        check_int("batch_size", self.batch_size, min=1)
        check_float("lr", self.lr, min=0, min_exclusive=True)
        check_bool("autocast", self.autocast)


def start(cfg: LowPrecisionLabConfig) -> DeviceInfo:
    """Pick the device and, on CPU, the thread count the parameters ask for; describe it."""
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    info = device_info(pick_device(cfg.device))
    print(f"{info.name} · torch {torch.__version__} · threads {torch.get_num_threads()}")
    return info


# --------------------------------------------------------------------------- the MMDiT task
def mmdit_task(
    preset: str = "tiny",
    *,
    batch_size: int = 8,
    latent_hw: int = 8,
    txt_len: int = 8,
    n_examples: int = 32,
    device: str | torch.device = "cpu",
) -> P.TrainTask:
    """Rectified-flow training of the MMDiT on a small fixed synthetic dataset.

    Data: ``n_examples`` smooth latents (low-frequency sinusoids, fixed seed 1234) each
    paired with a caption embedding; a batch draws examples, noise ``x1`` and
    ``t ~ sigmoid(N(0,1))`` from a generator seeded by (seed, step), ``x_t = (1-t) x0 + t x1``,
    target ``x1 - x0``; per-sample MSE (FLUX's objective)."""
    cfg = resolve_config(preset)
    C, p = cfg.latent_channels, cfg.patch_size
    g = torch.Generator().manual_seed(1234)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, latent_hw), torch.linspace(0, 1, latent_hw), indexing="ij")
    freqs = torch.randint(1, 3, (n_examples, C, 2), generator=g).float()
    phase = torch.rand(n_examples, C, 1, 1, generator=g) * 6.28
    amp = 0.5 + torch.rand(n_examples, C, 1, 1, generator=g)
    lat = amp * torch.sin(6.28 * (freqs[..., 0, None, None] * yy + freqs[..., 1, None, None] * xx) + phase)
    data = patchify(lat, p)  # (n, L, C p p)
    caps = torch.randn(n_examples, txt_len, cfg.context_dim, generator=g)
    pooled = torch.randn(n_examples, cfg.pooled_dim, generator=g)
    h = w = latent_hw // p
    dev = torch.device(device)
    img_ids, txt_ids = image_ids(h, w).to(dev), text_ids(txt_len).to(dev)
    data, caps, pooled = data.to(dev), caps.to(dev), pooled.to(dev)

    def make_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return build_model(cfg, device="cpu", dtype=torch.float32).to(dev)

    def loss(model, step, seed):
        bg = torch.Generator().manual_seed(seed * 100_003 + step)
        idx = torch.randint(0, n_examples, (batch_size,), generator=bg)
        x0 = data[idx.to(dev)]
        x1 = torch.randn(x0.shape, generator=bg).to(dev)
        t = torch.sigmoid(torch.randn(batch_size, generator=bg)).to(dev)
        xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * x1
        kw = dict(guidance=torch.full((batch_size,), 3.5, device=dev)) if cfg.guidance_embed else {}
        v = model(xt, img_ids, caps[idx.to(dev)], txt_ids, t, pooled[idx.to(dev)], **kw)
        per = ((v.float() - (x1 - x0)) ** 2).mean(dim=(1, 2))
        return per, t

    return P.TrainTask(f"mmdit-{preset}", make_model, loss)


# --------------------------------------------------------------------------- exact emulation
def emulation_proof() -> None:
    """Every element format's grid, then reference == Triton == torchao, bit for bit, on one
    fixed tensor with a zero block and an fp32-subnormal block.  Raises when any differs."""
    for e, f in Q.ELEM_FORMATS.items():
        v = Q.representable_values(e, positive_only=True)
        print(
            f"{e}: {len(v) - 1:3d} positive values, max {f.max:g}, min normal 2^{f.emin}, "
            f"min subnormal 2^{f.emin - f.mbits}"
        )
    x = N.make_tensor("student_t", (32, 256), seed=0)
    x[0, :32] = 0.0
    x[1, :64] *= 1e-36
    differ = []
    for fmt in Q.FORMATS:
        if fmt.startswith("fp8"):
            cases = [("tensor", "floor"), ("row", "floor"), ("block", "floor")]
        elif fmt.startswith("mx"):
            cases = [(None, "floor"), (None, "rceil")]
        else:
            cases = [(None, "floor")]
        for gran, rule in cases:
            ref = Q.fake_quantize(x, fmt, granularity=gran, scale_rule=rule)
            tri = Q.fake_quantize(x, fmt, granularity=gran, scale_rule=rule, backend="triton")
            same_tri = torch.equal(ref.view(torch.int32), tri.view(torch.int32))
            ao = "n/a"
            if gran != "block":
                ao = torch.equal(
                    ref.view(torch.int32),
                    Q.torchao_fake_quantize(x, fmt, granularity=gran, scale_rule=rule).view(torch.int32),
                )
            print(f"{fmt:11s} {(gran or rule):7s} reference == triton: {same_tri}   == torchao: {ao}")
            if not same_tri or ao is False:
                differ.append(f"{fmt}/{gran or rule}")
    if differ:
        raise AssertionError(f"the emulation is not bit-exact for {differ}")


# --------------------------------------------------------------------------- error across formats
def format_explorer(cfg: LowPrecisionLabConfig):
    x = N.make_tensor(cfg.explorer_tensor, tuple(cfg.tensor_shape), seed=0)
    return grid_histogram_map(x, {k: N.FORMAT_VARIANTS[k] for k in cfg.format_variants if "hadamard" not in k})


def sqnr_synthetic(cfg: LowPrecisionLabConfig, rec: Recorder) -> pd.DataFrame:
    """Every format variant on every fixed-seed synthetic distribution; recorded."""
    tensors = {d: N.make_tensor(d, tuple(cfg.tensor_shape), seed=0) for d in cfg.distributions}
    sq = N.sqnr_table(tensors, cfg.format_variants)
    check_sqnr(sq, tensors)
    metrics = {"sqnr_db": "dB", "rel_fro": "", "flushed_frac": "", "saturated_frac": ""}
    record_table(rec, "sqnr", sq, metrics, shape=cfg.tensor_shape)
    return sq


def sqnr_band_db(mbits: int) -> tuple[float, float]:
    """The SQNR band of round-to-nearest with ``mbits`` mantissa bits.  Low: an element in
    the normal range is off by at most half an ulp, 2^-(m+1) of its value, so 20*log10(2^(m+1)).
    High: the rounding error of an element has mean square ulp^2/12 whatever its value, which
    is below 2^(m+1) ulp, so 10*log10(12 * 4^(m+1)); +1.5 dB for the group maxima that land on
    the grid exactly (no error: a row of outlier channels is mostly such elements)."""
    return 20 * math.log10(2.0 ** (mbits + 1)), 10 * math.log10(12 * 4.0 ** (mbits + 1)) + 1.5


def check_sqnr(sq: pd.DataFrame, tensors: Mapping[str, torch.Tensor]) -> None:
    """Each row's SQNR and flushed fraction recomputed in float64 from the fake-quantized
    tensor (whose rounding the emulation proof holds to torchao), and held to the format's band."""
    bad = []
    for r in sq.itertuples():
        x = tensors[r.tensor].double()
        kw = dict(N.FORMAT_VARIANTS[r.variant])
        q = Q.fake_quantize(x.float(), kw.pop("fmt"), **kw).double()
        db = 10 * math.log10(float((x * x).sum()) / float(((q - x) ** 2).sum()))
        flushed = float(((q == 0) & (x != 0)).double().mean())
        lo, hi = sqnr_band_db(Q.FORMATS[r.fmt].elem_format.mbits)
        if abs(db - r.sqnr_db) > 1e-6 or abs(flushed - r.flushed_frac) > 1e-9 or not lo <= r.sqnr_db <= hi:
            bad.append(f"{r.variant}/{r.tensor}: {r.sqnr_db:.3f} dB (recount {db:.3f}, band {lo:.1f}..{hi:.1f})")
    if bad:
        raise AssertionError("SQNR table off its independent derivation: " + "; ".join(bad))


def print_sqnr(sq: pd.DataFrame, variants) -> None:
    print("SQNR (dB)")
    print(sq.pivot(index="variant", columns="tensor", values="sqnr_db").reindex(variants).round(1).to_string())
    print("\nflushed to zero (%)")
    flushed = 100 * sq.pivot(index="variant", columns="tensor", values="flushed_frac")
    print(flushed.reindex(variants).round(2).to_string())


def sqnr_real(cfg: LowPrecisionLabConfig, device, rec: Recorder) -> pd.DataFrame:
    """Weights, activations and gradients of the first converted linear layers of a fresh
    MMDiT (one rectified-flow step), every format variant; recorded."""
    task = mmdit_task(cfg.capture_preset, batch_size=cfg.batch_size, device=device)
    model = task.make_model(0)
    keep = P.RECIPES["mxfp8"]
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not keep.keeps(n)]
    cap = N.capture_linear_tensors(model, lambda: task.loss(model, 0, 0)[0].mean(), names=names[: cfg.capture_modules])
    real = {k.replace("double_blocks.", "d").replace("single_blocks.", "s"): v for k, v in cap.tensors.items()}
    sq = N.sqnr_table(real, cfg.format_variants)
    sq["kind"] = sq["tensor"].str.split(":").str[0]
    record_table(rec, "sqnr_real", sq, {"sqnr_db": "dB", "flushed_frac": "", "saturated_frac": ""})
    return sq


def real_summary(sq_real: pd.DataFrame, variants) -> pd.DataFrame:
    """Median SQNR over the captured layers per variant and tensor kind."""
    return sq_real.groupby(["variant", "kind"])["sqnr_db"].median().unstack("kind").reindex(variants).round(1)


def record_table(
    rec,
    experiment: str,
    df: pd.DataFrame,
    metrics: Mapping[str, str],
    *,
    variant_col: str = "variant",
    dtype_col: str = "fmt",
    shape="",
    extra_cols=("tensor",),
) -> int:
    """Write one record row per (table row, metric); non-finite values (an exact SQNR of
    inf, a saturated fraction that is not defined under a Hadamard rotation) are left
    out of the records and stay visible in the table.  Returns the number of rows written."""
    n = 0
    for row in df.to_dict("records"):
        for metric, unit in metrics.items():
            v = row.get(metric)
            if v is None or not math.isfinite(float(v)):
                continue
            extra = {c: row[c] for c in extra_cols if c in row}
            rec.add(
                experiment, row[variant_col], metric, float(v), unit, shape=shape, dtype=row.get(dtype_col, ""), **extra
            )
            n += 1
    return n


def grid_histogram_map(x: torch.Tensor, variants: Mapping[str, dict]):
    """HoloMap over format variants: fraction of elements on each grid value (log2 axis)."""
    frames = {}
    for name, kw in variants.items():
        kw = dict(kw)
        fmt = kw.pop("fmt")
        kw.pop("hadamard", None)
        h = N.format_grid_histogram(x, fmt, **kw)
        h = h.assign(label=[f"{v:g}" for v in h["value"]])
        frames[name] = hv.Bars(h, kdims=["label"], vdims=["frac", "count", "value"]).opts(
            xrotation=90,
            tools=["hover"],
            xlabel="grid value (units of the group scale)",
            ylabel="fraction",
            title=f"{name}: where the scaled elements land",
        )
    return hv.HoloMap(frames, kdims=["format"])


def sqnr_heatmap(
    df: pd.DataFrame, *, x: str = "tensor", y: str = "variant", value: str = "sqnr_db", labels: bool = True
):
    """Heat map of ``value`` over ``x`` x ``y`` (an exact SQNR of inf is drawn as 99 dB)."""
    d = df[[x, y, value]].copy()
    d[value] = d[value].replace([math.inf], 99.0).round(1)
    hm = hv.HeatMap(d, kdims=[x, y], vdims=[value])
    return (hm * hv.Labels(d, kdims=[x, y], vdims=[value]) if labels else hm).opts(
        hv.opts.HeatMap(
            cmap="viridis", colorbar=True, tools=["hover"], xrotation=30, title=f"{value} (higher is better)"
        )
    )


# --------------------------------------------------------------------------- matmuls
def run_matmuls(cfg: LowPrecisionLabConfig, device, rec: Recorder) -> pd.DataFrame:
    shapes = [tuple(s) for s in cfg.matmul_shapes]
    return N.matmul_sweep(shapes, cfg.matmul_formats, Session(device, rec), reps=cfg.reps)


def matmul_table(mm: pd.DataFrame) -> pd.DataFrame:
    return mm[["shape", "path", "fmt", "sqnr_db", "rel_fro", "time_ms"]].round(3)


def matmul_plot(mm: pd.DataFrame, info: DeviceInfo):
    mml = mm.assign(label=mm.path + " " + mm.fmt)
    where = info.name + (" (emulation on CPU)" if info.kind == "cpu" else "")
    return (
        hv.Bars(mml, kdims=["shape", "label"], vdims=["sqnr_db"]).opts(
            tools=["hover"], xrotation=60, width=900, height=380, title="matmul SQNR vs float64 (dB)"
        )
        + hv.Bars(mml, kdims=["shape", "label"], vdims=["time_ms"]).opts(
            tools=["hover"], xrotation=60, width=900, height=380, title=f"median time (ms) on {where}"
        )
    ).cols(1)


def run_accumulation(cfg: LowPrecisionLabConfig, rec: Recorder) -> pd.DataFrame:
    """Relative error vs K of each accumulation model (fixed seed, same FP8 operands); recorded."""
    acc = N.accumulation_sweep(cfg.accum_ks, cfg.accumulations)
    for r in acc.itertuples():
        # the plain fp32 model is the machine's own fp32 product (its BLAS picks the summation order):
        # its error is float32 rounding over K terms, which differs between machines; the others are
        # emulated with explicit rounding, the same everywhere
        machine = ACCUMULATIONS[r.accumulation].acc_bits is None
        noise = {"roundoff_dtype": "float32", "reduction": int(r.K)} if machine else {}
        shape = f"64x{r.K}x64"
        rec.add("accumulation", r.accumulation, "rel_error", r.rel_error, "", shape=shape, dtype="fp8_e4m3", **noise)
    return acc


def accumulation_plot(acc: pd.DataFrame):
    return (
        hv.Curve(acc, kdims=["K"], vdims=["rel_error", "accumulation"])
        .groupby("accumulation")
        .overlay()
        .opts(logx=True, logy=True, tools=["hover"], width=600, title="relative error vs K (float64 reference)")
    )


# --------------------------------------------------------------------------- Amdahl
@dataclass(frozen=True)
class MatmulShare:
    """The matmul category's share of a profiled training step, and where it comes from."""

    share: float
    source: str


def measured_matmul_share(cfg: LowPrecisionLabConfig, device, rec: Recorder | None = None) -> MatmulShare:
    """Profile ``profile_steps`` training steps of the lab's preset (after one warm-up step;
    precomputed encoder outputs, the lab's batch size and autocast) and return the matmul
    category's share of step time (``precision.matmul_share_from_analysis``)."""
    dev = torch.device(device)
    tcfg = TrainConfig(
        preset=cfg.preset,
        device=dev.type,
        batch_size=cfg.batch_size,
        encoders="precomputed",
        num_samples=max(8, cfg.batch_size),
        autocast="bf16" if cfg.autocast else "none",
    )
    report = profile_training(
        Trainer(tcfg), active=cfg.profile_steps, warmup=1, name="04_low_precision_share", memory=False
    )
    share = P.matmul_share_from_analysis(report)
    source = f"measured: {cfg.profile_steps}-step profile of {cfg.preset} on {dev.type}"
    if rec is not None:
        rec.add(
            "amdahl",
            "measured",
            "matmul_share",
            share,
            "fraction",
            preset=cfg.preset,
            steps=cfg.profile_steps,
            batch_size=cfg.batch_size,
        )
    return MatmulShare(share, source)


def amdahl_table(measured: MatmulShare, what_if_shares, speedups=SPEEDUPS) -> pd.DataFrame:
    """Step speed-up bound for each matmul speed-up: first the measured share, then each
    what-if share, labelled so (``share_source``)."""
    rows = []
    shares = [(measured.share, measured.source)] + [(float(s), "what-if") for s in what_if_shares]
    for share, source in shares:
        for k in speedups:
            rows.append(
                dict(
                    share_source=source,
                    matmul_share=round(share, 3),
                    matmul_speedup=k,
                    step_speedup_bound=P.amdahl_speedup(share, k),
                )
            )
    return pd.DataFrame(rows)


def record_amdahl(rec: Recorder, amd: pd.DataFrame) -> None:
    for r in amd.itertuples():
        # the measured share is a result (extra, and its own row); a what-if share is a parameter
        measured = r.share_source.startswith("measured")
        rec.add(
            "amdahl",
            "measured share" if measured else f"what-if share={r.matmul_share}",
            "speedup_bound",
            r.step_speedup_bound,
            "x",
            matmul_speedup=r.matmul_speedup,
            share_source=r.share_source,
            matmul_share=float(r.matmul_share),
        )


def amdahl_view(amd: pd.DataFrame) -> pd.DataFrame:
    return amd.pivot_table(
        index=["share_source", "matmul_share"], columns="matmul_speedup", values="step_speedup_bound", sort=False
    ).round(2)


# --------------------------------------------------------------------------- recipes and convergence
def recipe_tables(recipes) -> pd.DataFrame:
    return pd.concat({r: P.RECIPES[r].table().set_index("matmul") for r in recipes})


def recipe_sources(recipes, device) -> pd.DataFrame:
    """Whose each recipe is, how it runs here or why not (``lab_utils.precision.peers``)."""
    return peers.recipe_sources(recipes, device)


def run_convergence(cfg: LowPrecisionLabConfig, device, rec: Recorder) -> P.ConvergenceResult:
    """bf16 and every recipe from the same initialisation and batches; recorded; the
    divergences are printed."""
    task = mmdit_task(cfg.preset, batch_size=cfg.batch_size, device=device)
    refused = {r: peers.recipe_why_not(r, device) for r in cfg.recipes}
    for r, why in refused.items():
        if why:
            print(f"{r}: not run here: {why}")
    res = P.run_convergence(
        task,
        [r for r in cfg.recipes if not refused[r]],
        steps=cfg.steps,
        seeds=cfg.seeds,
        lr=cfg.lr,
        autocast_dtype=torch.bfloat16 if cfg.autocast else None,
        progress=lambda runs: tqdm(runs, desc="convergence runs (recipe, seed)"),
    )
    record_convergence(rec, res)
    print("divergences:", "none" if res.divergences.empty else "")
    if not res.divergences.empty:
        print(res.divergences.to_string(index=False))
    return res


def record_convergence(rec, res: P.ConvergenceResult) -> None:
    """Loss rows per (recipe, seed, step), the final gaps with their intervals, the
    per-bucket losses and the divergences (finite values only; a diverged recipe's gap
    row carries ``diverged=True`` and no value)."""
    for r in res.curves.itertuples():
        if math.isfinite(r.loss):
            rec.add("convergence", r.recipe, "loss", r.loss, "loss", statistic="value", step=r.step, seed=r.seed)
    for r in res.gaps.itertuples():
        if math.isfinite(r.gap):
            extra = dict(ci_low=r.ci_low, ci_high=r.ci_high) if math.isfinite(r.ci_low) else {}
            rec.add(
                "convergence",
                r.recipe,
                "final_gap_vs_" + res.baseline,
                r.gap,
                "loss",
                statistic="mean",
                n_seeds=r.n_seeds,
                window=res.window,
                **extra,
            )
        else:
            rec.add("convergence", r.recipe, "diverged", 1.0, "", statistic="count")
    for r in res.buckets.itertuples():
        rec.add("convergence", r.recipe, "loss_by_t", r.loss, "loss", statistic="mean", bucket=r.bucket, seed=r.seed)
    for r in res.divergences.itertuples():
        rec.add("convergence", r.recipe, "divergence_step", float(r.step), "step", seed=r.seed, reason=r.reason)


def convergence_plot(res: P.ConvergenceResult, smooth: int = 3):
    """Mean loss per recipe with its 95% band over seeds (overlay)."""
    b = res.band(smooth=smooth)
    layers = []
    for name, d in b.groupby("recipe", sort=False):
        layers.append(hv.Area(d, kdims=["step"], vdims=["low", "high"], label=name).opts(alpha=0.2))
        layers.append(hv.Curve(d, kdims=["step"], vdims=["mean"], label=name).opts(tools=["hover"]))
    return hv.Overlay(layers).opts(
        legend_position="top_right",
        ylabel="RF loss (mean over seeds)",
        title=f"loss curves, {smooth}-step smoothed, 95% t-band over seeds",
    )


def bucket_plot(res: P.ConvergenceResult):
    d = res.buckets.groupby(["bucket", "recipe"], as_index=False)["loss"].mean()
    return hv.Bars(d, kdims=["bucket", "recipe"], vdims=["loss"]).opts(
        tools=["hover"], xrotation=30, title=f"loss by timestep bucket (last {res.window} steps)"
    )


# --------------------------------------------------------------------------------------
# The takeaway (from records only: the report's index builds the same line)
# --------------------------------------------------------------------------------------


@register("04_low_precision")
def headline(df: pd.DataFrame) -> list[Figure]:
    """The lowest matmul SQNR, the largest loss gap to bf16, and the matmul share (Amdahl)."""
    figs = []
    sq = rows(df, experiment="matmul", metric="sqnr")
    if len(sq):
        w = sq.loc[sq.value.idxmin()]
        figs.append(Figure("lowest matmul SQNR", f"{w.variant} {w.value:.3g} dB", str(w["shape"])))
    gap = rows(df, experiment="convergence", metric="final_gap_vs_bf16")
    if len(gap):
        w = gap.loc[gap.value.abs().idxmax()]
        figs.append(Figure("largest loss gap vs bf16", f"{w.variant} {w.value:+.3g}"))
    am = rows(df, experiment="amdahl", metric="matmul_share")
    if len(am):
        share = f"{100 * am.value.iloc[0]:.0f}%"
        figs.append(Figure("matmul share of the step", share, "what low precision can speed up"))
    return figs
