"""Lab 05's explorer (memory): an activation-checkpointing policy and a step's shape -> a point
on the lab's own memory/time Pareto plot (peak above start against step time).

By default it measures the lab's own step (its preset, dtype, batch, resolution and text
length: ``MemoryExplorer.for_lab(cfg, rec, measured=pol)``), and the lab's measured policies
stand on the plot beside the explored points.  Each point is ``memory.compare_policies`` for one
policy: saved activations measured by the saved-tensor hooks (and the analytic formula where
one exists), the step's peak above the state before it, counted FLOPs, the step time (the
lab's one timing primitive) with its stability verdict, and gradients checked against no
checkpointing (a mismatch raises).  The front is drawn through stable timings of the lab's
step shape only (``studies.memory.pareto_front``).  On a GPU the choices include the lab's GPU
set sizes (``parameterized/sets/05_memory/gpu.yaml``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pandas as pd

from lab_utils.core.device import pick_device
from lab_utils.memory import FORMULA_POLICIES, MEMORY_DTYPES, compare_policies, saved_bytes_formula, step_shape
from lab_utils.model import CHECKPOINT_POLICIES, MMDiTConfig
from lab_utils.model import PRESETS as MODEL_PRESETS
from lab_utils.step.mmdit import synthetic_step
from lab_utils.studies.explore.base import Control, Explorer, Progress, Result
from lab_utils.studies.memory import MemoryLabConfig, acts_on, gpu_set, pareto_plot, sh_str

PRESETS = ("tiny", "small")
BATCHES = (1, 2, 4)
RESOLUTIONS = (64, 128)
TXT_LENS = (8, 16)


def _with(options: tuple, *values) -> tuple:
    return tuple(sorted(set(options) | {v for v in values if v is not None}, key=options_key))


def options_key(v):
    return (0, v) if isinstance(v, (int, float)) else (1, str(v))


def explorer_controls(device_type: str, base: MemoryLabConfig | None = None) -> tuple[Control, ...]:
    """The explorer's controls: small CPU choices, the lab's own step (``base``) and, on CUDA,
    the lab's GPU set sizes (preset, dtype, batch, resolution, text length)."""
    base = base or MemoryLabConfig(device="cpu")
    gpu = gpu_set() if device_type == "cuda" else {}
    wanted = {*PRESETS, base.preset, gpu.get("preset")}
    presets = tuple(p for p in MODEL_PRESETS if p in wanted)  # the model's order: smallest first
    return (
        Control("policy", CHECKPOINT_POLICIES, "none", "checkpointing"),
        Control("preset", presets, base.preset),
        Control("dtype", MEMORY_DTYPES, base.dtype),
        Control("batch", _with(BATCHES, base.batch_size, gpu.get("batch_size")), base.batch_size),
        Control("resolution", _with(RESOLUTIONS, base.resolution, gpu.get("resolution")), base.resolution, "px"),
        Control("txt_len", _with(TXT_LENS, base.txt_len, gpu.get("txt_len")), base.txt_len, "text tokens"),
    )


@dataclass
class MemoryExplorer(Explorer):
    """``MemoryExplorer.for_lab(cfg, rec, measured=pol).show()``."""

    device: str = "auto"
    reps: int = 3
    base: MemoryLabConfig | None = None
    #: the lab's own policy table (``study.compare``): drawn on the plot beside the explored points
    measured: pd.DataFrame | None = None

    lab: ClassVar[str] = "05_memory"
    title: ClassVar[str] = "Explore: activation checkpointing on the lab's memory/time Pareto plot"
    live_help: ClassVar[str] = (
        "pick a policy and a step's shape: its peak and step time (with the timing's stability verdict) "
        "land on the lab's Pareto plot"
    )
    controls: ClassVar[tuple[Control, ...]] = explorer_controls("cpu")

    @classmethod
    def for_lab(cls, cfg: MemoryLabConfig, rec=None, measured: pd.DataFrame | None = None) -> MemoryExplorer:
        """The explorer at the lab's own step (preset, dtype, batch, resolution, text length)."""
        return cls(rec=rec, device=cfg.device, reps=cfg.reps, base=cfg, measured=measured)

    def __post_init__(self):
        self.dev = pick_device(self.device)
        self.base = self.base or MemoryLabConfig(device="cpu")
        self.controls = explorer_controls(self.dev.type, self.base)  # per instance: the lab's and the device's sizes
        super().__post_init__()

    def lab_step(self) -> str:
        return sh_str(self.base.step_shape())

    def why_not(self, cfg: dict) -> str | None:
        if not acts_on(cfg["policy"], self.dev.type):
            return "offload moves saved activations to host memory: on a CPU device there is nowhere to offload to"
        mcfg = MMDiTConfig.from_preset(cfg["preset"])
        try:
            mcfg.check_resolution(cfg["resolution"], cfg["resolution"], "resolution")
        except ValueError as e:
            return str(e)
        return None

    def measure(self, cfg: dict, progress: Progress) -> Result:
        mcfg = MMDiTConfig.from_preset(cfg["preset"])
        sh = step_shape(mcfg, cfg["batch"], cfg["resolution"], cfg["resolution"], cfg["txt_len"])
        progress(0, 1, f"policy {cfg['policy']}: saved tensors, peak, FLOPs, time, gradients")
        res = cfg["resolution"]
        step = synthetic_step(
            mcfg, batch_size=cfg["batch"], height=res, width=res, txt_len=cfg["txt_len"], device=self.dev,
            dtype=cfg["dtype"], seed=self.base.seed,
        )  # fmt: skip
        (r,) = compare_policies(step, [cfg["policy"]], reps=self.reps, progress=False)
        formula = (
            sum(saved_bytes_formula(mcfg, sh, cfg["dtype"], r.policy, device_type=self.dev.type).values())
            if r.policy in FORMULA_POLICIES
            else None
        )
        progress(1, 1, "measured")
        label = self.label(cfg)
        shape = sh_str(sh)
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
            formula_mib=formula / 2**20 if formula is not None else math.nan,
            peak_mib=r.peak_bytes / 2**20,
            time_ms=r.timing.median_ms if ok else math.nan,
            stable=bool(ok and r.timing.stable),
            stability=str(r.timing.stability) if ok else f"failed: {r.timing.reason}",
            gflops=r.flops / 1e9,
            grads_equal=r.grads_equal,
        )
        return Result(0, cfg, row, data=dict(peak_bytes=r.peak_bytes, device=self.dev.type))

    def points(self, results: list[Result]) -> pd.DataFrame:
        """The rows of the Pareto plot: the lab's policies (when given), then the explored points."""
        cols = ["policy", "time_ms", "peak_bytes", "stable", "device", "shape"]
        lab = []
        if self.measured is not None and len(self.measured):
            m = self.measured
            lab = [
                dict(
                    policy=f"lab {r.policy}",
                    time_ms=r.time_ms,
                    peak_bytes=r.peak_bytes,
                    stable=getattr(r, "stable", False),
                    device=getattr(r, "device", self.dev.type),
                    shape=self.lab_step(),
                )
                for r in m.itertuples()
            ]
        explored = [
            dict(
                policy=f"#{r.index} {r.config['policy']}",
                time_ms=r.row["time_ms"],
                peak_bytes=r.data["peak_bytes"],
                stable=r.row["stable"],
                device=r.data["device"],
                shape=r.row["shape"],
            )
            for r in results
        ]
        return pd.DataFrame(lab + explored, columns=cols)

    def figures(self, results: list[Result]) -> list:
        title = f"Lab step {self.lab_step()} and the explored points: peak vs step time"
        return [pareto_plot(self.points(results), step=self.lab_step(), title=title).opts(framewise=True)]
