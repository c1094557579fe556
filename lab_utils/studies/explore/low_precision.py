"""Lab 04's explorer: format, scaling, block size, Hadamard rotation and distribution -> how the
tensor fills the format's grid and its SQNR; a precision recipe -> a short convergence run
against bf16.

The tensor is ``numerics.make_tensor`` (fixed seed), the error figures
``numerics.error_stats``, the grid histogram ``numerics.format_grid_histogram`` (of the
rotated tensor when a Hadamard block is chosen: what the quantizer sees), the rotation
``lab_kernels.quant.hadamard_transform``; the convergence run is
``precision.run_convergence`` on ``precision.mlp_task`` (one seed, a few steps: a first
look, not the lab's multi-seed verdict).  A combination a format does not define (an MX
block other than 32, a per-row scale for a block format) says why.

By default it quantizes the lab's own tensor: the lab's tensor shape and first distribution
(``LowPrecisionExplorer(rec)`` reads them from the lab's recorder's parameters); on a GPU the
shapes include the lab's GPU set's (``parameterized/sets/04_low_precision/gpu.yaml``).  Nothing
here is a timing (SQNR and the short convergence's losses are computed, not timed), so no
stability verdict applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import holoviews as hv
import pandas as pd
import torch
import yaml

from lab_kernels.quant import FORMATS, SCALE_RULES, hadamard_transform
from lab_utils.core.device import pick_device
from lab_utils.precision.numerics import DISTRIBUTIONS, error_stats, format_grid_histogram, make_tensor
from lab_utils.precision.quantized import RECIPES, mlp_task, run_convergence
from lab_utils.studies.explore.base import Control, Explorer, Progress, Result, Unavailable, explored_scatter
from lab_utils.studies.low_precision import sqnr_heatmap

SCALINGS = ("tensor", "row", "block")
BLOCKS = ("default", 16, 32, 128)
HADAMARD = ("off", 16, 128)
RECIPE_CHOICES = ("none", *(r for r in RECIPES if r != "bf16"))
SHAPE = (128, 256)
CONVERGENCE_STEPS = 10
GPU_SET = Path(__file__).resolve().parents[3] / "parameterized" / "sets" / "04_low_precision" / "gpu.yaml"


def _shape(s) -> str:
    return "x".join(str(int(n)) for n in s)


def explorer_controls(params: dict, device_type: str = "cpu") -> tuple[Control, ...]:
    """The format's controls, the distribution (the lab's first by default) and the tensor's shape:
    the lab's (default), 128x256 and, on CUDA, the GPU set's."""
    lab_shape = _shape(params.get("tensor_shape") or SHAPE)
    gpu = (yaml.safe_load(GPU_SET.read_text()) or {}).get("tensor_shape") if device_type == "cuda" else None
    shapes = tuple(dict.fromkeys([_shape(SHAPE), lab_shape, *([_shape(gpu)] if gpu else [])]))
    dists = [d for d in params.get("distributions") or () if d in DISTRIBUTIONS]
    return (
        Control("fmt", tuple(FORMATS), "mxfp8_e4m3", "format"),
        Control("scaling", SCALINGS, "block"),
        Control("block_size", BLOCKS, "default", "block size"),
        Control("scale_rule", SCALE_RULES, "floor", "scale rule"),
        Control("hadamard", HADAMARD, "off", "Hadamard block"),
        Control("dist", DISTRIBUTIONS, dists[0] if dists else "outlier_channels", "distribution"),
        Control("shape", shapes, lab_shape, "tensor shape"),
        Control("recipe", RECIPE_CHOICES, "none", "recipe vs bf16"),
    )


@dataclass
class LowPrecisionExplorer(Explorer):
    """``LowPrecisionExplorer(rec).show()``: the lab's tensor, from the lab's recorder's parameters."""

    #: the lab's parameters (``cfg.to_dict()``); default: the recorder's
    params: dict | None = None

    lab: ClassVar[str] = "04_low_precision"
    title: ClassVar[str] = "Explore: a format on a tensor, a recipe against bf16"
    live_help: ClassVar[str] = (
        "pick format, scaling, block, Hadamard and distribution; a recipe runs a short convergence"
    )
    controls: ClassVar[tuple[Control, ...]] = explorer_controls({})

    def __post_init__(self):
        if self.params is None:
            self.params = dict(self.rec.params) if self.rec is not None else {}
        dev = pick_device(self.params.get("device", "auto")) if self.params else torch.device("cpu")
        self.controls = explorer_controls(self.params, dev.type)  # per instance: the lab's and the device's
        super().__post_init__()

    def quant_kw(self, cfg: dict) -> dict:
        kw = dict(scale_rule=cfg["scale_rule"])
        if FORMATS[cfg["fmt"]].family == "fp8" or cfg["scaling"] != "block":
            kw["granularity"] = cfg["scaling"]
        if cfg["block_size"] != "default":
            kw["block_size"] = int(cfg["block_size"])
        return kw

    def label(self, cfg: dict) -> str:
        h = "" if cfg["hadamard"] == "off" else f" H{cfg['hadamard']}"
        b = "" if cfg["block_size"] == "default" else f"/{cfg['block_size']}"
        r = "" if cfg["recipe"] == "none" else f" +{cfg['recipe']}"
        return f"{cfg['fmt']} {cfg['scaling']}{b} {cfg['scale_rule']}{h} {cfg['dist']} {cfg['shape']}{r}"

    def measure(self, cfg: dict, progress: Progress) -> Result:
        fmt, kw = cfg["fmt"], self.quant_kw(cfg)
        had = None if cfg["hadamard"] == "off" else int(cfg["hadamard"])
        total = 2 if cfg["recipe"] == "none" else 3
        progress(0, total, f"quantizing a {cfg['dist']} tensor to {fmt}")
        dims = tuple(int(n) for n in cfg["shape"].split("x"))
        x = make_tensor(cfg["dist"], dims, seed=0)
        try:
            st = error_stats(x, fmt, hadamard=had, **kw)
            seen = hadamard_transform(x, had, seed=0) if had else x
            hist = format_grid_histogram(seen, fmt, **kw)
        except ValueError as e:
            raise Unavailable(str(e)) from None
        shape = cfg["shape"]
        variant = self.label({**cfg, "recipe": "none"})
        extra = dict(fmt=fmt, dist=cfg["dist"], hadamard=had or 0, seed=0, **kw)
        self.rec.add("explore", variant, "sqnr", st.sqnr_db, "dB", shape=shape, statistic="value", **extra)
        self.rec.add("explore", variant, "rel_fro_error", st.rel_fro, "", shape=shape, statistic="value", **extra)
        self.rec.add("explore", variant, "flushed_to_zero", 100 * st.flushed_frac, "%", shape=shape, **extra)
        row = dict(
            fmt=fmt,
            scaling=cfg["scaling"],
            block=cfg["block_size"],
            scale_rule=cfg["scale_rule"],
            hadamard=cfg["hadamard"],
            dist=cfg["dist"],
            shape=cfg["shape"],
            sqnr_db=round(st.sqnr_db, 2),
            flushed_pct=round(100 * st.flushed_frac, 3),
            recipe=cfg["recipe"],
            gap_vs_bf16=math.nan,
        )
        progress(1, total, "histogram")
        curves = None
        if cfg["recipe"] != "none":
            progress(2, total, f"convergence of {cfg['recipe']} against bf16 ({CONVERGENCE_STEPS} steps, seed 0)")
            conv = run_convergence(
                mlp_task(hidden=128, batch_size=16), [cfg["recipe"]], steps=CONVERGENCE_STEPS, seeds=(0,)
            )
            gap = conv.gaps.set_index("recipe").gap.get(cfg["recipe"], math.nan)
            row["gap_vs_bf16"] = float(gap)
            curves = conv.curves
            self.rec.add(
                "explore_convergence",
                cfg["recipe"],
                "final_loss_gap",
                float(gap),
                "",
                statistic="mean",
                baseline=conv.baseline,
                steps=CONVERGENCE_STEPS,
                seeds=[0],
            )
        progress(total, total, "done")
        return Result(0, cfg, row, data=dict(hist=hist, curves=curves))

    def sqnr_map(self, results: list[Result]):
        """The lab's SQNR heat map (``studies.low_precision.sqnr_heatmap``: tensor x variant) of the
        explored configurations: the distribution and shape across, the format's settings down."""
        s = pd.DataFrame(
            [
                dict(
                    tensor=f"{r.config['dist']} {r.config['shape']}",
                    variant=self.label({**r.config, "dist": "", "shape": "", "recipe": "none"}).strip(),
                    sqnr_db=r.row["sqnr_db"],
                )
                for r in results
            ],
            columns=["tensor", "variant", "sqnr_db"],
        )
        return sqnr_heatmap(s).opts(hv.opts.HeatMap(framewise=True, width=380, title="SQNR (dB), as in the lab's map"))

    def figures(self, results: list[Result]) -> list:
        if results:
            last = results[-1]
            h = last.data["hist"]
            h = h.assign(grid=[f"{v:.4g}" for v in h.value])
            title = f"#{last.index} {self.label(last.config)}: elements per grid value (SQNR {last.row['sqnr_db']} dB)"
        else:
            h, title = pd.DataFrame(columns=["grid", "frac", "count"]), "grid"
        hist = hv.Bars(h, "grid", ["frac", "count"]).opts(
            tools=["hover"], xrotation=90, xlabel="grid value (units of the group scale)", ylabel="share", title=title
        )
        hist = hist.opts(framewise=True, width=760)
        sq = self.sqnr_map(results)
        c = [r.data["curves"].assign(run=f"#{r.index}") for r in results if r.data["curves"] is not None]
        curves = pd.concat(c) if c else pd.DataFrame(columns=["step", "loss", "recipe", "run"])
        conv = explored_scatter(
            curves,
            "step",
            ["loss", "recipe", "run"],
            color="recipe",
            cmap="Category10",
            size=4,
            title=f"Loss of each recipe against bf16 ({CONVERGENCE_STEPS} steps, seed 0)",
            framewise=True,
            width=380,
        )
        return [hist, sq, conv]
