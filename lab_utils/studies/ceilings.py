"""Reference ops for the ceilings lab: copy, elementwise ops and matmul, placed on the roofline.

Bytes and FLOPs are counted, never inferred from time:

| op     | bytes (fewest that must move)          | FLOPs          |
|--------|----------------------------------------|----------------|
| copy   | 2·N·s   (read N, write N)              | 0              |
| add    | 3·N·s   (read 2N, write N)             | N              |
| gelu   | 2·N·s                                  | 9·N (tanh form: `lab_utils.core.flops.GELU_TANH_FLOPS`) |
| matmul | 3·n²·s  (read A and B, write C)        | 2·n³           |

N elements, s bytes per element, n×n matrices.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from lab_utils.core.ceilings import Ceilings, get_ceilings
from lab_utils.core.config import (
    ConfigError,
    LabConfig,
    check_bool,
    check_choice,
    check_choices,
    check_int,
    check_int_list,
)
from lab_utils.core.device import DATASHEET, cuda_devices, no_cuda_reason, pick_device
from lab_utils.core.dtypes import DTYPES, LAB_DTYPES
from lab_utils.core.flops import GELU_TANH_FLOPS, matmul_flops
from lab_utils.core.plots import init, roofline_plot
from lab_utils.core.records import Recorder
from lab_utils.core.roofline import roofline
from lab_utils.core.timing import try_bench
from lab_utils.studies.headline import Figure, fmt, register, rows, verdict

OPS = ("copy", "add", "gelu", "matmul")


@dataclass(frozen=True)
class CeilingsLabConfig(LabConfig):
    device: str = "auto"
    ops: tuple = ("copy", "add", "gelu", "matmul")
    dtypes: tuple = ("float32", "bfloat16")
    elementwise_sizes: tuple = (1 << 16, 1 << 18, 1 << 20, 1 << 22)
    matmul_sizes: tuple = (64, 128, 256, 512)
    reps: int = 15
    quick_ceilings: bool = True
    force_ceilings: bool = False

    def __post_init__(self):
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        check_choices("ops", list(self.ops), OPS)
        check_choices("dtypes", list(self.dtypes), LAB_DTYPES)
        check_int_list("elementwise_sizes", list(self.elementwise_sizes), min=1)
        check_int_list("matmul_sizes", list(self.matmul_sizes), min=1)
        check_int("reps", self.reps, min=3, max=10_000)
        check_bool("quick_ceilings", self.quick_ceilings)
        check_bool("force_ceilings", self.force_ceilings)
        if self.device == "cuda" and not cuda_devices():
            raise ConfigError("device", self.device, f"'auto' or 'cpu' ({no_cuda_reason()})")


def op_cost(op: str, size: int, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes, flops) an op must move / do; see the module table."""
    s = torch.empty((), dtype=dtype).element_size()
    if op == "copy":
        return 2 * size * s, 0
    if op == "add":
        return 3 * size * s, size
    if op == "gelu":
        return 2 * size * s, GELU_TANH_FLOPS * size
    if op == "matmul":
        return 3 * size * size * s, int(matmul_flops(size, size, size))
    raise ValueError(f"op={op!r} is not one of {OPS}")


def make_op(op: str, size: int, dtype: torch.dtype, device: torch.device, generator: torch.Generator | None = None):
    """A zero-argument callable running one op on fresh random inputs (never zeros)."""
    kw = dict(device=device, dtype=dtype)
    if op == "matmul":
        a = torch.randn(size, size, generator=generator, device="cpu").to(**kw)
        b = torch.randn(size, size, generator=generator, device="cpu").to(**kw)
        return lambda: torch.mm(a, b)
    x = torch.randn(size, generator=generator, device="cpu").to(**kw)
    if op == "copy":
        y = torch.empty_like(x)
        return lambda: y.copy_(x)
    if op == "add":
        z = torch.randn(size, generator=generator, device="cpu").to(**kw)
        return lambda: torch.add(x, z)
    if op == "gelu":
        return lambda: torch.nn.functional.gelu(x, approximate="tanh")
    raise ValueError(f"op={op!r} is not one of {OPS}")


def sweep_plan(cfg: CeilingsLabConfig) -> list[tuple[str, str, int]]:
    plan = []
    for op in cfg.ops:
        for dt in cfg.dtypes:
            sizes = cfg.matmul_sizes if op == "matmul" else cfg.elementwise_sizes
            for n in sizes:
                plan.append((op, dt, int(n)))
    return plan


def measured_table(points: pd.DataFrame) -> pd.DataFrame:
    """The successful points with their times, throughputs and % of the binding ceiling."""
    cols = ["op", "dtype", "shape", "time_ms", "p20_ms", "p80_ms", "gbs", "tflops", "bound", "pct_of_ceiling"]
    return points[points.ok][cols].round(4)


def run_sweep(cfg: CeilingsLabConfig, rec: Recorder, ceilings: Ceilings, progress: bool = True) -> pd.DataFrame:
    """Time every (op, dtype, size); record rows; return one roofline point per measurement."""
    dev = pick_device(cfg.device)
    gen = torch.Generator().manual_seed(0)
    pts = []
    for op, dt, n in tqdm(sweep_plan(cfg), desc="reference ops", disable=not progress):
        dtype = DTYPES[dt]
        nbytes, flops = op_cost(op, n, dtype)
        shape = (n, n) if op == "matmul" else (n,)
        t = try_bench(
            make_op(op, n, dtype, dev, gen),
            name=f"{op}-{dt}-{n}",
            device=dev,
            reps=cfg.reps,
            budget_s=30,
            check_finite=True,
        )
        rec.add_timing("reference_ops", op, t, shape=shape, dtype=dtype, bytes=nbytes, flops=flops, ceilings=ceilings)
        if not t.ok:
            pts.append(dict(op=op, dtype=dt, size=n, shape="x".join(map(str, shape)), ok=False, error=t.reason))
            continue
        p = roofline(t, bytes=nbytes, flops=flops, ceilings=ceilings, dtype=dtype)
        pts.append(
            dict(
                op=op,
                dtype=dt,
                size=n,
                shape="x".join(map(str, shape)),
                ok=True,
                error="",
                time_ms=t.median_ms,
                p20_ms=t.p20_ms,
                p80_ms=t.p80_ms,
                bytes=nbytes,
                flops=flops,
                intensity=p.intensity,
                tflops=p.tflops,
                gbs=p.gbs,
                pct_of_ceiling=p.pct_of_ceiling,
                bound=p.bound,
                floor_ms=p.floor_ms,
            )
        )
    return pd.DataFrame(pts)


def record_ceilings(rec: Recorder, ceilings: Ceilings) -> None:
    """The measured ceilings as records (copy bandwidth, one matmul throughput per dtype)."""
    rec.add("ceilings", "copy", "bandwidth", ceilings.copy_gbs, "GB/s", statistic="median", bytes=ceilings.copy_bytes)
    for k, v in ceilings.matmul_tflops.items():
        rec.add("ceilings", f"matmul-{k}", "throughput", v, "TFLOP/s", statistic="median", n=ceilings.matmul_n[k])


def op_cost_lines(cfg: CeilingsLabConfig) -> list[str]:
    """Bytes, FLOPs and arithmetic intensity of each reference op at a fixed size (the
    roofline's x axis), and how many points the sweep will measure."""
    lines = []
    for op, n in [("copy", 1 << 20), ("add", 1 << 20), ("gelu", 1 << 20), ("matmul", 512)]:
        for dt in (torch.float32, torch.bfloat16):
            b, f = op_cost(op, n, dt)
            lines.append(
                f"{op:6s} n={n:<8d} {str(dt)[6:]:8s} bytes={b:<10d} flops={f:<10d} intensity={f / b:.3g} FLOP/B"
            )
    lines.append(f"sweep points: {len(sweep_plan(cfg))}")
    return lines


def ceilings_table(ceilings: Ceilings) -> pd.DataFrame:
    return pd.DataFrame(ceilings.summary_rows())


def datasheet_table() -> pd.DataFrame:
    return pd.DataFrame(
        [
            dict(
                gpu=p.name,
                bf16_tflops=p.bf16_tflops,
                fp8_tflops=p.fp8_tflops,
                fp4_tflops=p.fp4_tflops,
                tf32_tflops=p.tf32_tflops,
                hbm_gbs=p.hbm_gbs,
                memory_gib=p.memory_gib,
                source=p.source,
            )
            for p in DATASHEET.values()
        ]
    )


def load_ceilings(cfg: CeilingsLabConfig) -> Ceilings:
    return get_ceilings(
        cfg.device,
        force=cfg.force_ceilings,
        quick=cfg.quick_ceilings and pick_device(cfg.device).type == "cpu",
        progress=True,
    )


def roofline_map(points: pd.DataFrame, ceilings: Ceilings):
    """HoloMap over dtype: the roofline with every op's points (interactive in exported HTML).
    Ops that do no arithmetic (copy) have no place on a FLOP roofline: see ``bandwidth_map``."""
    hv = init()
    frames = {}
    for dt, g in points[points.ok & (points.flops > 0)].groupby("dtype", sort=False):
        frames[dt] = roofline_plot(
            g, ceilings, dtype=DTYPES[dt], label_col="op", title=f"Roofline · {ceilings.device_name} · {dt}"
        )
    return hv.HoloMap(frames, kdims=["dtype"])


def bandwidth_map(points: pd.DataFrame, ceilings: Ceilings):
    """HoloMap over dtype: achieved GB/s vs size per memory-bound op, the copy ceiling drawn."""
    hv = init()
    frames = {}
    ok = points[points.ok & (points.op != "matmul")]
    for dt, g in ok.groupby("dtype", sort=False):
        curves = [
            hv.Curve(gg.sort_values("size"), "size", ["gbs", "time_ms", "p20_ms", "p80_ms"], label=op).opts(
                logx=True, tools=["hover"]
            )
            * hv.Scatter(gg, "size", "gbs").opts(size=6)
            for op, gg in g.groupby("op", sort=False)
        ]
        ceil = hv.HLine(ceilings.copy_gbs).opts(color="black", line_dash="dashed")
        frames[dt] = hv.Overlay([*curves, ceil]).opts(
            title=f"Achieved bandwidth · {dt} (dashed: measured copy ceiling {ceilings.copy_gbs:.0f} GB/s)",
            xlabel="elements",
            ylabel="GB/s",
            logx=True,
            legend_position="bottom_right",
        )
    return hv.HoloMap(frames, kdims=["dtype"])


# --------------------------------------------------------------------------------------
# The takeaway (from records only: the report's index builds the same line)
# --------------------------------------------------------------------------------------


@register("00_ceilings")
def headline(df: pd.DataFrame) -> list[Figure]:
    """The measured copy and matmul ceilings, and the reference op farthest below its ceiling."""
    figs = []
    cp = rows(df, experiment="ceilings", variant="copy", metric="bandwidth")
    if len(cp):
        figs.append(Figure("copy ceiling", fmt(cp.value.iloc[0], "GB/s")))
    mm = rows(df, experiment="ceilings", metric="throughput")
    if len(mm):
        best = mm.loc[mm.value.idxmax()]
        figs.append(Figure("matmul ceiling", fmt(best.value, "TFLOP/s"), str(best.variant).removeprefix("matmul-")))
    pc = rows(df, experiment="reference_ops", metric="pct_of_ceiling")
    if len(pc):
        w = pc.loc[pc.value.idxmin()]
        figs.append(Figure("worst op vs ceiling", f"{w.variant} {fmt(w.value, '%')}", verdict(w) or str(w["shape"])))
    return figs
