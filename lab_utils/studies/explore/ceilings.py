"""Lab 00's explorer: pick an op, a dtype and a size -> a new point on the roofline.

Bytes and FLOPs are the lab's (``studies.ceilings.op_cost``), the timing is the lab's one
primitive (``timing.try_bench``), the point is ``roofline.roofline`` against the measured
ceilings.  Copy does no arithmetic: it has no place on a FLOP roofline and shows in the
bandwidth bars only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import holoviews as hv
import pandas as pd
import torch

from lab_utils.core.ceilings import Ceilings
from lab_utils.core.device import pick_device
from lab_utils.core.dtypes import DTYPES, LAB_DTYPES
from lab_utils.core.plots import roofline_plot
from lab_utils.core.roofline import roofline
from lab_utils.core.timing import try_bench
from lab_utils.studies.ceilings import OPS, make_op, op_cost
from lab_utils.studies.explore.base import Control, Explorer, Progress, Result, Unavailable, explored_scatter

#: elements of an elementwise op, or n of an n x n matmul
SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 16384, 65536, 262144, 1048576, 4194304)
MATMUL_MAX_N = 2048  # an n x n matmul beyond this takes seconds per call on a CPU


@dataclass
class CeilingsExplorer(Explorer):
    """``CeilingsExplorer(rec, ceilings=ceilings).show()``: roofline point per choice."""

    ceilings: Ceilings | None = None
    device: Any = "auto"
    reps: int = 10

    lab: ClassVar[str] = "00_ceilings"
    title: ClassVar[str] = "Explore: one op on the roofline"
    live_help: ClassVar[str] = "pick op, dtype and size: the op is timed and lands on the roofline"
    controls: ClassVar[tuple[Control, ...]] = (
        Control("op", OPS, "gelu"),
        Control("dtype", LAB_DTYPES, "float32"),
        Control("size", SIZES, 65536, "size (elements; n of n x n for matmul)"),
    )

    def __post_init__(self):
        super().__post_init__()
        if self.ceilings is None:
            raise Unavailable("the explorer needs the lab's measured ceilings (ceilings=...)")
        self.dev = pick_device(self.device)

    def why_not(self, cfg: dict) -> str | None:
        if cfg["op"] == "matmul" and cfg["size"] > MATMUL_MAX_N:
            return (
                f"a {cfg['size']} x {cfg['size']} matmul is too large to explore here "
                f"(n <= {MATMUL_MAX_N}; size is n of an n x n matmul)"
            )
        if cfg["dtype"] == "float16" and cfg["op"] == "matmul" and self.dev.type == "cpu":
            return "float16 matmul on CPU has no fast kernel (a scalar fallback, not a ceiling); pick bfloat16"
        return None

    def measure(self, cfg: dict, progress: Progress) -> Result:
        op, dt, n = cfg["op"], cfg["dtype"], int(cfg["size"])
        dtype = DTYPES[dt]
        progress(0, 1, f"timing {op} {dt} {n}")
        nbytes, flops = op_cost(op, n, dtype)
        shape = (n, n) if op == "matmul" else (n,)
        fn = make_op(op, n, dtype, self.dev, torch.Generator().manual_seed(0))
        t = try_bench(fn, name=f"{op}-{dt}-{n}", device=self.dev, reps=self.reps, budget_s=10, check_finite=True)
        self.rec.add_timing(
            "explore", op, t, shape=shape, dtype=dtype, bytes=nbytes, flops=flops, ceilings=self.ceilings
        )
        progress(1, 1, "timed")
        if not t.ok:
            raise Unavailable(f"the timing failed: {t.reason}")
        p = roofline(t, bytes=nbytes, flops=flops, ceilings=self.ceilings, dtype=dtype)
        row = dict(
            op=op,
            dtype=dt,
            shape="x".join(map(str, shape)),
            time_ms=t.median_ms,
            gbs=p.gbs,
            tflops=p.tflops,
            intensity=p.intensity,
            bound=p.bound,
            pct_of_ceiling=p.pct_of_ceiling,
            stable=t.stability.stable,
        )
        return Result(0, cfg, row)

    def figures(self, results: list[Result]) -> list:
        cols = ["label", "op", "dtype", "shape", "time_ms", "gbs", "tflops", "intensity", "pct_of_ceiling"]
        rows = pd.DataFrame(
            [{"label": f"#{r.index} {r.row['op']} {r.row['dtype']}", **r.row} for r in results], columns=cols
        )
        on_roof = rows[rows.tflops.astype(float) > 0]
        last = results[-1].row["dtype"] if results else "float32"
        peak = self.ceilings.matmul(DTYPES[last]) or self.ceilings.matmul("fp32")
        title = f"Explored points · roof {self.ceilings.copy_gbs:.0f} GB/s, {peak:.3g} TFLOP/s ({last})"
        roof = roofline_plot(on_roof.iloc[0:0], self.ceilings, dtype=DTYPES[last], title=title)
        # fixed layer labels (the numbers are in the title): a live redraw keeps the overlay's keys
        roof = hv.Overlay([el.relabel(label=f"roof{i}").opts(framewise=True) for i, el in enumerate(roof)]).opts(
            **roof.opts.get().kwargs
        )
        # one Scatter coloured by point, so that a live redraw keeps the overlay's structure
        pts = explored_scatter(
            on_roof,
            "intensity",
            ["tflops", "label", "gbs", "time_ms", "shape", "pct_of_ceiling"],
            logx=True,
            logy=True,
            framewise=True,
        )
        bars = hv.Bars(rows, "label", ["gbs", "op", "dtype", "shape", "time_ms"]).opts(
            tools=["hover"], xrotation=30, ylabel="GB/s", xlabel="", title="Achieved bandwidth (dashed: copy ceiling)"
        )
        top = max([self.ceilings.copy_gbs, *rows.gbs.astype(float)])
        bars = bars.opts(framewise=True, ylim=(0, 1.15 * top))  # the copy ceiling stays in view
        ceil = hv.HLine(self.ceilings.copy_gbs).opts(color="black", line_dash="dashed")
        return [(roof * pts).opts(framewise=True, show_legend=False), (bars * ceil).opts(framewise=True)]
