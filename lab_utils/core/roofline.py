"""Roofline: where a measurement sits against this device's measured ceilings.

floor time = max(bytes / copy_bandwidth, flops / matmul_throughput)
achieved GB/s = bytes / time, achieved TFLOP/s = flops / time
ridge point (FLOP/byte) = matmul_throughput / copy_bandwidth
The bound is "memory" when the op's intensity (flops / bytes) is under the ridge
point, else "compute".  Bytes are the fewest an op must move (each input read once,
each output written once); FLOPs are counted, not inferred from time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from lab_utils.core.samples import Timing

if TYPE_CHECKING:  # the measured ceilings; this module only reads their figures (no torch here)
    from lab_utils.core.ceilings import Ceilings


@dataclass(frozen=True)
class RooflinePoint:
    time_ms: float
    bytes: float
    flops: float
    intensity: float  # FLOP / byte
    floor_ms: float  # the fastest this op can run at the measured ceilings
    gbs: float  # achieved
    tflops: float  # achieved
    bound: str  # "memory" | "compute"
    pct_of_ceiling: float  # achieved / ceiling of the binding resource, in %
    ceiling_gbs: float
    ceiling_tflops: float
    ridge: float

    def as_dict(self) -> dict:
        return asdict(self)


def roofline(time: float | Timing, *, bytes: float, flops: float, ceilings: Ceilings, dtype="fp32") -> RooflinePoint:
    """Place one measurement (median ms, or a Timing) on the roofline."""
    t_ms = time.median_ms if isinstance(time, Timing) else float(time)
    if t_ms <= 0:
        raise ValueError(f"time must be > 0 ms, got {t_ms}")
    if bytes < 0 or flops < 0:
        raise ValueError(f"bytes and flops must be >= 0 (got bytes={bytes}, flops={flops})")
    bw = ceilings.copy_gbs
    peak = ceilings.matmul(dtype) or ceilings.matmul("fp32")
    t_mem = bytes / (bw * 1e9) * 1e3
    t_cmp = flops / (peak * 1e12) * 1e3 if flops else 0.0
    ridge = peak * 1e12 / (bw * 1e9)
    intensity = flops / bytes if bytes else float("inf")
    bound = "memory" if intensity < ridge else "compute"
    gbs = bytes / (t_ms * 1e-3) / 1e9
    tflops = flops / (t_ms * 1e-3) / 1e12
    pct = 100 * (gbs / bw if bound == "memory" else tflops / peak)
    return RooflinePoint(t_ms, bytes, flops, intensity, max(t_mem, t_cmp), gbs, tflops, bound, pct, bw, peak, ridge)


def roofline_curve(ceilings: Ceilings, dtype="fp32", lo: float = 1e-2, hi: float = 1e4, n: int = 64):
    """Points (intensity, attainable TFLOP/s) of the roofline for plotting."""
    bw = ceilings.copy_gbs
    peak = ceilings.matmul(dtype) or ceilings.matmul("fp32")
    x = np.logspace(np.log10(lo), np.log10(hi), n)
    return x, np.minimum(peak, x * bw * 1e9 / 1e12)
