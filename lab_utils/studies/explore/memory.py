"""Lab 05's explorer (memory): an activation-checkpointing policy and a step's shape -> a point
of the memory/time Pareto front beside the earlier policies.

Each point is ``memory.compare_policies`` for one policy: saved activations measured by the
saved-tensor hooks (and the analytic formula where one exists), the step's peak above the
state before it, counted FLOPs, the step time (the lab's one timing primitive), and
gradients checked against no checkpointing (a mismatch raises).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pandas as pd

from ...device import pick_device
from ...memory import MEMORY_DTYPES, compare_policies, step_shape
from ...model import CHECKPOINT_POLICIES, MMDiTConfig
from .base import Control, Explorer, Progress, Result, explored_scatter

TXT_LEN = 16


@dataclass
class MemoryExplorer(Explorer):
    """``MemoryExplorer(rec).show()``."""

    device: str = "auto"
    reps: int = 3

    lab: ClassVar[str] = "05_memory"
    title: ClassVar[str] = "Explore: activation checkpointing on the memory/time front"
    live_help: ClassVar[str] = "pick a policy and a step's shape: saved bytes, peak and step time land on the front"
    controls: ClassVar[tuple[Control, ...]] = (
        Control("policy", CHECKPOINT_POLICIES, "none", "checkpointing"),
        Control("preset", ("tiny", "small"), "tiny"),
        Control("dtype", MEMORY_DTYPES, "float32"),
        Control("batch", (1, 2, 4), 2),
        Control("resolution", (64, 128), 64, "resolution (px)"),
    )

    def __post_init__(self):
        super().__post_init__()
        self.dev = pick_device(self.device)

    def why_not(self, cfg: dict) -> str | None:
        if cfg["policy"] == "offload" and self.dev.type == "cpu":
            return "offload moves saved activations to host memory: on a CPU device there is nowhere to offload to"
        return None

    def measure(self, cfg: dict, progress: Progress) -> Result:
        mcfg = MMDiTConfig.from_preset(cfg["preset"])
        sh = step_shape(mcfg, cfg["batch"], cfg["resolution"], cfg["resolution"], TXT_LEN)
        progress(0, 1, f"policy {cfg['policy']}: saved tensors, peak, FLOPs, time, gradients")
        (r,) = compare_policies(
            mcfg, sh, cfg["dtype"], [cfg["policy"]], device=self.dev, reps=self.reps, progress=False
        )
        progress(1, 1, "measured")
        label = self.label(cfg)
        shape = f"b{sh.batch}x{sh.img_tokens}+{sh.txt_tokens}"
        kw = dict(shape=shape, dtype=cfg["dtype"], policy=cfg["policy"], preset=cfg["preset"])
        self.rec.add("explore", label, "saved_activations", r.saved_bytes / 2**20, "MiB", statistic="value", **kw)
        self.rec.add("explore", label, "peak", r.peak_bytes / 2**20, "MiB", statistic="max", **kw)
        self.rec.add("explore", label, "flops", r.flops, "FLOP", statistic="value", **kw)
        self.rec.add_timing("explore", label, r.timing, flops=r.flops, **kw)
        ok = getattr(r.timing, "ok", False)
        row = dict(
            policy=cfg["policy"],
            preset=cfg["preset"],
            dtype=cfg["dtype"],
            shape=shape,
            saved_mib=r.saved_bytes / 2**20,
            formula_mib=r.formula_bytes / 2**20 if r.formula_bytes is not None else math.nan,
            peak_mib=r.peak_bytes / 2**20,
            time_ms=r.timing.median_ms if ok else math.nan,
            gflops=r.flops / 1e9,
            grads_equal=r.grads_equal,
        )
        return Result(0, cfg, row)

    def figures(self, results: list[Result]) -> list:
        df = pd.DataFrame(
            [dict(label=f"#{r.index} {self.label(r.config)}", **r.row) for r in results],
            columns=["label", "time_ms", "saved_mib", "peak_mib", "policy"],
        )
        pts = explored_scatter(
            df,
            "time_ms",
            ["saved_mib", "label", "peak_mib", "policy"],
            xlabel="step time (ms)",
            ylabel="saved activations (MiB)",
            title="Memory/time front of the explored policies (lower left is better)",
            framewise=True,
        )
        return [pts]
