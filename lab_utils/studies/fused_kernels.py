"""Lab 02 (``labs/02_fused_kernels.ipynb``): the memory-bound ops around the matmuls.

The lab's parameters (:class:`FusedKernelsConfig`), the steps its cells call, and the views
its plots read.  The reusable machinery (inputs, float64 checks, provider × sweep timing,
block cases) is ``lab_utils.fused.ops``; FLOP and byte counts are ``lab_utils.core.flops``.

Every step that checks something raises when the check fails, so a headless run of the lab
is marked failed: the correctness table of ``op``, every (op, variant) the sweep times
(checked against float64 before it is timed, on any device), and the block agreement.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch

import lab_kernels
from lab_kernels import get_variant, variants
from lab_utils.core import config, plots
from lab_utils.core.ceilings import Ceilings, get_ceilings
from lab_utils.core.config import LabConfig
from lab_utils.core.device import pick_device
from lab_utils.core.records import Recorder
from lab_utils.core.roofline import roofline as roofline_point
from lab_utils.core.session import Session
from lab_utils.fused import blocks as fused_blocks
from lab_utils.fused import ops as fused
from lab_utils.model import PRESETS
from lab_utils.studies.headline import Figure, fmt, register, rows

LAB = "02_fused_kernels"
# Largest |block output - eager block output| accepted per block dtype: the blocks share
# weights and inputs, so only the fused ops' rounding differs.
BLOCK_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1, "float16": 0.02}


class CheckFailed(AssertionError):
    """A correctness check of the lab failed (the message holds the table that shows it)."""


@dataclass(frozen=True)
class FusedKernelsConfig(LabConfig):
    """Parameters of ``labs/02_fused_kernels.ipynb``; defaults are the small CPU set."""

    device: str = "auto"
    op: str = "rms_norm"  # the op of the correctness table and roofline
    dtype: str = "float32"  # the sweep's dtype
    directions: tuple = ("fwd", "fwd+bwd")
    check_dtypes: tuple = ("float32", "bfloat16", "float16")
    check_tokens: int = 37  # correctness problem: irregular on purpose
    check_hidden: int = 781
    check_head_dim: int = 62
    check_variants: tuple = ("eager", "triton", "torch", "liger")  # "compile" adds one compile per dtype
    sweep_ops: tuple = ("rms_norm", "gelu_tanh")
    sweep_variants: tuple = ("eager", "torch", "liger")  # plus "compile", "triton"; Triton kinds timed on GPU only
    preset: str = "small"  # hidden sizes (and MLP width) from the model preset
    tokens: tuple = (128, 1024)
    batch: int = 1
    reps: int = 5
    budget_s: float = 5.0
    block_preset: str = "tiny"
    block_kinds: tuple = ("double", "single")
    block_providers: tuple = ("eager", "triton", "liger", "diffusers", "diffusers+fused_qkv")
    block_img_tokens: int = 64
    block_txt_tokens: int = 16
    block_dtype: str = "float32"
    compare_compile: bool = True  # eager vs torch.compile of `op`, forward, largest size
    seed: int = 0
    quick_ceilings: bool = True

    def __post_init__(self):
        config.check_choice("device", self.device, ("auto", "cpu", "cuda"))
        config.check_choice("op", self.op, fused.OP_NAMES)
        config.check_choice("dtype", self.dtype, tuple(fused.DTYPES))
        config.check_choices("directions", self.directions, fused.DIRECTIONS)
        config.check_choices("check_dtypes", self.check_dtypes, tuple(fused.DTYPES))
        config.check_int("check_tokens", self.check_tokens, min=1)
        config.check_int("check_hidden", self.check_hidden, min=2)
        config.check_int("check_head_dim", self.check_head_dim, min=2)
        if self.check_head_dim % 2:
            raise config.ConfigError("check_head_dim", self.check_head_dim, "an even integer (rope rotates pairs)")
        config.check_choices("sweep_ops", self.sweep_ops, fused.OP_NAMES)
        config.check_choice("preset", self.preset, tuple(PRESETS))
        config.check_int_list("tokens", self.tokens, min=1)
        config.check_int("batch", self.batch, min=1)
        config.check_int("reps", self.reps, min=3)
        config.check_float("budget_s", self.budget_s, min=0, min_exclusive=True)
        config.check_choice("block_preset", self.block_preset, tuple(PRESETS))
        config.check_choices("block_kinds", self.block_kinds, ("double", "single"))
        config.check_choices("block_providers", self.block_providers, tuple(fused_blocks.BLOCK_PROVIDERS))
        config.check_int("block_img_tokens", self.block_img_tokens, min=1)
        config.check_int("block_txt_tokens", self.block_txt_tokens, min=1)
        config.check_choice("block_dtype", self.block_dtype, tuple(fused.DTYPES))
        config.check_int("seed", self.seed, min=0)
        config.check_bool("quick_ceilings", self.quick_ceilings)
        config.check_bool("compare_compile", self.compare_compile)
        known = set()
        for op in fused.OP_NAMES:
            known |= {v.name for v in variants(op, include_unavailable=True)}
        config.check_choices("check_variants", self.check_variants, sorted(known - {"reference"}))
        config.check_choices("sweep_variants", self.sweep_variants, sorted(known - {"reference"}))

    @property
    def check_problem(self) -> fused.Problem:
        return fused.Problem(1, self.check_tokens, self.check_hidden, self.check_head_dim)

    def problems(self) -> list[fused.Problem]:
        return fused.problems_for([self.preset], self.tokens, batch=self.batch)


# ---------------------------------------------------------------------------------------------
# The lab's steps, one per cell


@dataclass
class Lab:
    """One run of the lab: its parameters, device, measured ceilings and records."""

    cfg: FusedKernelsConfig
    device: torch.device
    ceilings: Ceilings
    rec: Recorder

    def header(self) -> str:
        return (
            f"device {self.device}; Triton interpreted: {lab_kernels.TRITON_INTERPRETED}; "
            f"copy ceiling {self.ceilings.copy_gbs:.1f} GB/s"
        )


def start(params) -> Lab:
    """Validate the parameters (a notebook's ``globals()``), pick the device, load the ceilings."""
    cfg = FusedKernelsConfig.from_params(params)
    dev = pick_device(cfg.device)
    ceil = get_ceilings(dev, quick=cfg.quick_ceilings)
    return Lab(cfg, dev, ceil, Recorder(lab=LAB, params=cfg.to_dict(), device=dev, ceilings=ceil))


def variants_here(lab: Lab) -> str:
    """Every variant of ``op`` with whether it runs here (or why not), which are timed, and
    one capability refusal (a row wider than the Triton kernel's single pass)."""
    cfg, dev = lab.cfg, lab.device
    kw = fused.spec(cfg.op).problem_kw(cfg.check_problem)
    lines = []
    for v in variants(cfg.op, include_unavailable=True):
        why = v.why_not(dev, fused.as_dtype(cfg.dtype), **kw)
        lines.append(f"{v.name:10s} {v.kind:9s} {'runs here' if why is None else 'not here: ' + why}")
    timed = [v.name for v in variants(cfg.op, device=dev) if v.timeable(dev) and v.kind != "reference"]
    lines.append(f"timed here: {timed}")
    wide = fused.spec("rms_norm").problem_kw(fused.Problem(1, 4, 100_000))
    why = get_variant("rms_norm", "triton").why_not(dev, torch.float32, **wide)
    lines.append(f"rms_norm/triton on rows of 100000: {why}")
    return "\n".join(lines)


def peers_text() -> str:
    """The peer library's kernels: which ops Liger-Kernel serves here (and how, in the variant's
    description), what the interpreter needed to run them, and the Liger ops left out with why."""
    from lab_kernels import liger  # noqa: PLC0415  (the package imports it; named here for its tables)

    lines = [f"liger-kernel {liger.LIGER_VERSION or 'not installed'}"]
    for op in fused.OP_NAMES:
        for v in variants(op, include_unavailable=True):
            if v.extra.get("library"):
                lines.append(f"  {op}/{v.name}: {v.description}")
    if lab_kernels.TRITON_INTERPRETED and liger.LIGER_VERSION:
        liger.interpreter_why_not()
        lines.append(f"interpreter: {liger.interpreter_note() or 'no shim needed'}")
        lines.append(f"interpreter and bfloat16: {liger.interpreter_bf16_why_not() or 'right'}")
    lines.append("not used, with why:")
    lines += [f"  {name}: {why}" for name, why in liger.EXCLUDED.items()]
    return "\n".join(lines)


def correctness(lab: Lab) -> str:
    """Every variant of ``op`` in ``check_variants`` × ``check_dtypes``, forward and every
    gradient against float64, recorded; raises :class:`CheckFailed` (with the table) if any fails."""
    cfg = lab.cfg
    kw = fused.spec(cfg.op).problem_kw(cfg.check_problem)
    table = fused.correctness_table(
        cfg.op, cfg.check_dtypes, cfg.check_problem, device=lab.device, seed=cfg.seed, variant_names=cfg.check_variants
    )
    for r in table.itertuples():
        lab.rec.add(
            "correctness", r.variant, "max_abs_error", r.max_abs, "", shape=kw["shape"], dtype=r.dtype,
            verdict=r.verdict, worst=r.worst, tolerance=r.bound,
        )  # fmt: skip
    show = table.assign(
        max_abs=table.max_abs.map(lambda x: f"{x:.3g}"), max_rel=table.max_rel.map(lambda x: f"{x:.3g}")
    )
    text = f"{cfg.op} on {'x'.join(map(str, kw['shape']))}, seed {cfg.seed}\n" + show[
        ["variant", "dtype", "verdict", "worst", "max_abs", "n_bad", "note"]
    ].to_string(index=False)
    if (table.verdict == "FAIL").any():
        raise CheckFailed(f"a variant of {cfg.op} disagrees with float64:\n{text}")
    return text


def run_sweep(lab: Lab) -> str:
    """Providers × sizes × directions of ``sweep_ops``; every (op, variant) is checked against
    float64 before it is timed (the sweep raises if one fails)."""
    cfg = lab.cfg
    problems = cfg.problems()
    checked = fused.sweep(
        fused.OpGrid(cfg.sweep_ops, problems, [cfg.dtype], cfg.directions, cfg.sweep_variants),
        Session(lab.device, lab.rec, seed=cfg.seed),
        reps=cfg.reps, budget_s=cfg.budget_s, progress=True, check=cfg.check_problem,
    )  # fmt: skip
    sw = sweep_frame(lab.rec.frame())
    return (
        f"{len(checked)} (op, variant) pairs checked against float64 before timing; "
        f"{len(sw)} timed (op, variant, size, direction) points over {len(problems)} sizes"
    )


def compile_vs_eager(lab: Lab) -> pd.DataFrame:
    """Eager vs ``torch.compile`` of ``op``, forward, at the largest size (checked first)."""
    cfg = lab.cfg
    if not cfg.compare_compile:
        return pd.DataFrame()
    fused.sweep(
        fused.OpGrid([cfg.op], cfg.problems()[-1:], [cfg.dtype], ["fwd"], ["eager", "compile"]),
        Session(lab.device, lab.rec, seed=cfg.seed),
        reps=cfg.reps, budget_s=max(cfg.budget_s, 60), experiment="compile_vs_eager", check=cfg.check_problem,
    )  # fmt: skip
    cc = lab.rec.frame()
    cc = cc[
        (cc.experiment == "compile_vs_eager")
        & (cc.statistic == "median")
        & cc.metric.isin(["time", "bandwidth", "speedup_vs_eager"])
    ]
    return cc.pivot_table(index="variant", columns="metric", values="value").round(3)


def roofline(lab: Lab):
    """The sweep's points on the roofline of the measured ceilings."""
    pts = roofline_points(lab.rec.frame(), lab.ceilings)
    if not len(pts):
        return plots.init().Div("no timed points")
    return plots.roofline_plot(pts, lab.ceilings, dtype=lab.cfg.dtype, title=f"fused ops on {lab.ceilings.device_name}")


def block_cases(lab: Lab) -> list[fused_blocks.BlockCase]:
    cfg = lab.cfg
    return fused_blocks.block_cases(
        cfg.block_preset, kinds=cfg.block_kinds, providers=cfg.block_providers, batch=1,
        img_tokens=cfg.block_img_tokens, txt_tokens=cfg.block_txt_tokens, dtype=fused.as_dtype(cfg.block_dtype),
        device=lab.device, seed=cfg.seed,
    )  # fmt: skip


def block_agreement(lab: Lab, cases: Sequence[fused_blocks.BlockCase]) -> str:
    """Each provider's block outputs against the eager block's (same weights and inputs),
    recorded; raises :class:`CheckFailed` when one differs by more than :data:`BLOCK_TOLERANCE`."""
    tol = BLOCK_TOLERANCE[lab.cfg.block_dtype]
    lines, bad = [], []
    for r in fused_blocks.block_agreement(cases):
        ok = r["max_abs_diff"] <= tol
        lab.rec.add(
            "block_agreement", r["provider"], "max_abs_diff_vs_eager", r["max_abs_diff"], kind=r["kind"], tolerance=tol
        )
        lines.append(f"{r['kind']:6s} {r['provider']:15s} same outputs as eager (max abs diff <= {tol:g}): {ok}")
        if not ok:
            bad.append(f"{r['kind']}/{r['provider']}: max abs diff {r['max_abs_diff']:.3g} > {tol:g}")
    text = "\n".join(lines)
    if bad:
        raise CheckFailed("blocks disagree with the eager block: " + "; ".join(bad) + "\n" + text)
    return text


def block_timings(lab: Lab, cases: Sequence[fused_blocks.BlockCase]):
    """Forward + backward of each block provider (Triton on CPU: checked above, never timed)."""
    cfg = lab.cfg
    fused_blocks.block_compare(
        lab.rec, cases, device=lab.device, dtype=fused.as_dtype(cfg.block_dtype), reps=cfg.reps,
        budget_s=max(cfg.budget_s, 30),
    )  # fmt: skip
    return block_bars(lab.rec.frame())


def block_table(lab: Lab) -> pd.DataFrame:
    bl = lab.rec.frame()
    keep = (bl.experiment == "block") & bl.statistic.isin(["median", "value", "failed"])
    return bl[keep][["variant", "metric", "value", "unit", "shape", "extra"]]


def save(lab: Lab) -> str:
    lab.rec.save()
    return "records saved"


# ---------------------------------------------------------------------------------------------
# Views of the rows for the lab's plots (plots read records; they never measure)


def sweep_frame(df, experiment: str | None = "op_sweep"):
    """Median GB/s rows of a sweep with their size columns unpacked (for plots)."""
    d = df[(df.metric == "bandwidth") & (df.statistic == "median")].copy()
    if experiment is not None:
        d = d[d.experiment == experiment]
    if d.empty:
        return pd.DataFrame(columns=["op", "variant", "dtype", "direction", "tokens", "hidden", "bytes", "gbs"])
    ex = d["extra"].map(json.loads)
    for k in ("op", "direction", "tokens", "hidden", "bytes", "kind"):
        d[k] = ex.map(lambda e, k=k: e.get(k))
    d["gbs"] = d["value"]
    d["MB"] = d["bytes"] / 1e6
    return d[["op", "variant", "kind", "dtype", "direction", "tokens", "hidden", "shape", "bytes", "MB", "gbs"]]


def roofline_points(df, ceilings):
    """One roofline point per (op, variant, direction, dtype, shape) from a sweep's median time rows."""
    d = df[(df.metric == "time") & (df.statistic == "median") & (df.experiment == "op_sweep")]
    pts = []
    for _, r in d.iterrows():
        e = json.loads(r["extra"])
        p = fused.Problem(e["batch"], e["tokens"], e["hidden"], e["head_dim"])
        b, f = fused.bytes_moved(e["op"], p, r["dtype"], e["direction"]), fused.flops(e["op"], p, e["direction"])
        pt = roofline_point(r["value"], bytes=b, flops=f, ceilings=ceilings, dtype=r["dtype"])
        pts.append(
            dict(
                op=e["op"],
                variant=f"{e['op']}/{r['variant']} {e['direction']}",
                dtype=r["dtype"],
                shape=r["shape"],
                intensity=pt.intensity,
                tflops=pt.tflops,
                gbs=pt.gbs,
                time_ms=pt.time_ms,
                pct_of_ceiling=pt.pct_of_ceiling,
            )
        )
    return pd.DataFrame(pts)


def bandwidth_holomap(df, ceilings):
    """GB/s vs bytes moved per variant, the measured copy ceiling drawn; one frame per
    (op, dtype, direction)."""
    hv = plots.init()
    d = sweep_frame(df)
    frames = {}
    for (op, dt, dr), g in d.groupby(["op", "dtype", "direction"], sort=True):
        layers = [hv.HLine(ceilings.copy_gbs).opts(color="black", line_dash="dashed", line_width=2)]
        layers.append(
            hv.Text(
                float(g["MB"].min()),
                ceilings.copy_gbs * 1.03,
                f"copy ceiling {ceilings.copy_gbs:.0f} GB/s",
                halign="left",
                fontsize=9,
            )
        )
        for v, gv in g.groupby("variant", sort=True):
            gv = gv.sort_values("MB")
            layers.append(
                hv.Curve(gv, "MB", ["gbs", "shape"], label=v) * hv.Scatter(gv, "MB", ["gbs", "shape"], label=v)
            )
        frames[(op, dt, dr)] = hv.Overlay(layers).opts(
            logx=True,
            xlabel="MB moved per call",
            ylabel="GB/s",
            legend_position="bottom_right",
            title=f"{op} {dt} {dr}: achieved bandwidth",
        )
    if not frames:
        return hv.Div("<p>no timed rows (nothing timeable on this device)</p>")
    return hv.HoloMap(frames, kdims=["op", "dtype", "direction"])


def speedup_table(df, experiment: str = "op_sweep"):
    """op × shape × direction rows, one column per variant: median speedup over eager."""
    sp = df[(df.metric == "speedup_vs_eager") & (df.experiment == experiment)].copy()
    if sp.empty:
        return sp
    ex = sp["extra"].map(json.loads)
    sp["op"], sp["direction"] = ex.map(lambda e: e["op"]), ex.map(lambda e: e["direction"])
    return sp.pivot_table(index=["op", "shape", "dtype", "direction"], columns="variant", values="value").round(2)


def block_bars(df):
    """Forward + backward time of each block provider (median with p20/p80 in the hover)."""
    hv = plots.init()
    d = df[(df.experiment == "block") & (df.metric == "time") & (df.statistic == "median")].copy()
    if d.empty:
        return hv.Div("<p>no block timings</p>")
    d["kind"] = d["extra"].map(lambda e: json.loads(e)["kind"])
    d["ms"] = d["value"]
    return hv.Bars(d, ["kind", "variant"], ["ms", "shape"]).opts(
        title="MMDiT block forward + backward (median)", ylabel="ms", xlabel="block / provider", multi_level=True
    )


__all__ = [
    "BLOCK_TOLERANCE",
    "LAB",
    "CheckFailed",
    "FusedKernelsConfig",
    "Lab",
    "bandwidth_holomap",
    "block_agreement",
    "block_bars",
    "block_cases",
    "block_table",
    "block_timings",
    "compile_vs_eager",
    "correctness",
    "roofline",
    "roofline_points",
    "run_sweep",
    "save",
    "speedup_table",
    "start",
    "sweep_frame",
    "variants_here",
]


# --------------------------------------------------------------------------------------
# The takeaway (from records only: the report's index builds the same line)
# --------------------------------------------------------------------------------------


@register(LAB)
def headline(df: pd.DataFrame) -> list[Figure]:
    """The best speed-up over eager and the kernel farthest below its ceiling (stable timings only)."""
    figs = []
    sp = rows(df, metric="speedup_vs_eager")
    sp = sp[(sp.variant != "eager") & (sp.stable != False)]  # noqa: E712 - True/False/None column
    if len(sp):
        b = sp.loc[sp.value.idxmax()]
        figs.append(Figure("best speed-up vs eager", f"{b.variant} x{b.value:.2f}", f"{b.experiment} {b['shape']}"))
    pc = rows(df, metric="pct_of_ceiling", statistic="median")
    pc = pc[pc.stable != False]  # noqa: E712
    if len(pc):
        w = pc.loc[pc.value.idxmin()]
        figs.append(
            Figure("worst kernel vs ceiling", f"{w.variant} {fmt(w.value, '%')}", f"{w.experiment} {w['shape']}")
        )
    return figs
