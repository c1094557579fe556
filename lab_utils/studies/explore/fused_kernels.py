"""Lab 02's explorer: op, variant, dtype, direction and shape -> correctness verdict, GB/s and
% of the measured copy ceiling, added to a bandwidth plot beside the earlier choices.

Correctness is ``fused.check_variant`` (forward and, when the direction has one, every
gradient against float64); timing is ``fused.bench_variant`` (the lab's one primitive);
bytes are ``fused.bytes_moved``.  Triton variants on CPU run in Triton's interpreter:
checked for correctness, never timed (the row says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import holoviews as hv
import pandas as pd

from lab_kernels import get_variant, variant_names
from lab_utils.core.ceilings import Ceilings
from lab_utils.core.device import pick_device
from lab_utils.core.dtypes import LAB_DTYPES
from lab_utils.fused import ops as fused
from lab_utils.studies.explore.base import Control, Explorer, Progress, Result, explored_scatter

VARIANTS = ("eager", "compile", "triton", "torch", "liger")  # liger: Liger-Kernel (lab_kernels.liger)
TOKENS = (61, 256, 1024, 4096)
HIDDEN = (96, 768, 3072)
HEAD_DIMS = (32, 64, 128)
CHECK_TOKENS_INTERPRETED = 61  # the interpreter runs one Python call per program: keep its check small
NOT_TIMED = "Triton on CPU runs in the interpreter: correctness only, never timed"


@dataclass
class FusedExplorer(Explorer):
    """``FusedExplorer(rec, ceilings=ceilings).show()``."""

    ceilings: Ceilings | None = None
    device: str = "auto"
    reps: int = 10

    lab: ClassVar[str] = "02_fused_kernels"
    title: ClassVar[str] = "Explore: one fused op"
    live_help: ClassVar[str] = "pick op, variant, dtype, direction and shape: checked against float64, then timed"
    controls: ClassVar[tuple[Control, ...]] = (
        Control("op", fused.OP_NAMES, "rms_norm"),
        Control("variant", VARIANTS, "eager"),
        Control("dtype", LAB_DTYPES, "float32"),
        Control("direction", fused.DIRECTIONS, "fwd"),
        Control("tokens", TOKENS, 256),
        Control("hidden", HIDDEN, 768),
        Control("head_dim", HEAD_DIMS, 64, "head dim"),
    )

    def __post_init__(self):
        super().__post_init__()
        self.dev = pick_device(self.device)

    def problem(self, cfg: dict, tokens: int | None = None) -> fused.Problem:
        return fused.Problem(1, tokens or cfg["tokens"], cfg["hidden"], cfg["head_dim"])

    def why_not(self, cfg: dict) -> str | None:
        op, name = cfg["op"], cfg["variant"]
        names = variant_names(op)
        if name not in names:
            return f"{op} has no variant {name!r} (it has {', '.join(n for n in names if n != 'reference')})"
        if op in ("rope", "qk_norm_rope") and cfg["hidden"] % cfg["head_dim"]:
            return f"{op} splits hidden={cfg['hidden']} into heads of head_dim={cfg['head_dim']}: not a divisor"
        p = self.problem(cfg)
        return get_variant(op, name).why_not(self.dev, fused.as_dtype(cfg["dtype"]), **fused.spec(op).problem_kw(p))

    def measure(self, cfg: dict, progress: Progress) -> Result:
        op, name, dt, direction = cfg["op"], cfg["variant"], cfg["dtype"], cfg["direction"]
        v = get_variant(op, name)
        timeable = v.timeable(self.dev)
        p = self.problem(cfg)
        where = p if timeable else self.problem(cfg, min(cfg["tokens"], CHECK_TOKENS_INTERPRETED))
        progress(0, 2, f"checking {op}/{name} against float64")
        checks = fused.check_variant(op, name, dt, where, device=self.dev, seed=0, grads=direction != "fwd")
        bad = [c for c in checks if not c.ok]
        worst = max((c.max_abs for c in checks), default=math.nan)
        largest = max(checks, key=lambda c: c.max_abs, default=None)  # its bound is the figure's tolerance
        shape = "x".join(map(str, fused.spec(op).problem_kw(p)["shape"]))
        extra = dict(op=op, direction=direction, checked_shape=checks[0].shape if checks else "", seed=0)
        self.rec.add("explore", name, "check_ok", float(not bad), "bool", shape=shape, dtype=dt, **extra)
        tol = dict(tolerance=largest.bound) if largest is not None else {}
        self.rec.add(
            "explore", name, "max_abs_error", worst, "", shape=shape, dtype=dt, statistic="max", **tol, **extra
        )
        verdict = "ok" if not bad else f"FAIL: {bad[0].tensor}: {bad[0].message}"
        row = dict(op=op, variant=name, dtype=dt, direction=direction, shape=shape, check=verdict, max_abs_err=worst)
        row.update(time_ms=math.nan, gbs=math.nan, pct_of_copy=math.nan, note="")
        nbytes = fused.bytes_moved(op, p, dt, direction)
        if not timeable:
            row["note"] = f"{NOT_TIMED} (checked at {checks[0].shape})" if checks else NOT_TIMED
            return Result(0, cfg, row, data=dict(bytes=nbytes))
        progress(1, 2, f"timing {op}/{name} {direction}")
        t, _mem = fused.bench_variant(op, name, p, dt, direction, device=self.dev, reps=self.reps, budget_s=10)
        self.rec.add_timing(
            "explore",
            name,
            t,
            shape=shape,
            dtype=fused.as_dtype(dt),
            bytes=nbytes,
            flops=fused.flops(op, p, direction),
            ceilings=self.ceilings,
            **extra,
        )
        progress(2, 2, "timed")
        if getattr(t, "ok", False):
            gbs = nbytes / (t.median_ms * 1e-3) / 1e9
            pct = 100 * gbs / self.ceilings.copy_gbs if self.ceilings is not None else math.nan
            row.update(time_ms=t.median_ms, gbs=gbs, pct_of_copy=pct, note="" if t.stability.stable else "unstable")
        else:
            row["note"] = f"not timed: {t.reason}"
        return Result(0, cfg, row, data=dict(bytes=nbytes))

    def figures(self, results: list[Result]) -> list:
        cols = ["label", "mb", "gbs", "pct_of_copy", "time_ms", "check", "shape"]
        df = pd.DataFrame(
            [
                dict(
                    label=f"#{r.index} {r.row['op']}/{r.row['variant']} {r.row['dtype']} {r.row['direction']}",
                    mb=r.data["bytes"] / 1e6,
                    **{k: r.row[k] for k in cols[2:]},
                )
                for r in results
                if not math.isnan(r.row["gbs"])
            ],
            columns=cols,
        )
        pts = explored_scatter(
            df,
            "mb",
            ["gbs", "label", "pct_of_copy", "time_ms", "check", "shape"],
            logx=True,
            xlabel="MB moved per call",
            ylabel="GB/s",
        )
        top = max([self.ceilings.copy_gbs if self.ceilings is not None else 0.0, *df.gbs.astype(float)]) or 1.0
        pts = pts.opts(framewise=True, ylim=(0, 1.15 * top))  # the ceiling stays in view
        layers = [pts]
        if self.ceilings is not None:
            layers.append(hv.HLine(self.ceilings.copy_gbs).opts(color="black", line_dash="dashed"))
        title = "Explored fused ops: achieved bandwidth" + (
            f" (dashed: copy ceiling {self.ceilings.copy_gbs:.0f} GB/s)" if self.ceilings is not None else ""
        )
        return [hv.Overlay(layers).opts(title=title, framewise=True)]
