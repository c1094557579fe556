"""Lab 06's explorer (distributed): a strategy and a world size -> the run's losses and its
communication beside the earlier runs.

Each run is ``distributed.launch`` of a :class:`~lab_utils.distributed.DistConfig`: real
ranks on this machine (gloo on CPU, NCCL on GPUs), the last step profiled; the collectives
of rank 0 come from its trace.  A combination the strategy cannot form (a world size its
mesh does not divide, a single-process strategy on two ranks) says why.

By default it runs the lab's own step: the model, batch, image and text sizes, steps,
checkpointing and backend of the lab's parameters (``DistributedExplorer(rec)`` reads them
from the lab's recorder; ``for_lab(cfg, rec)`` from its config), and its world sizes are the
lab's (on a GPU machine the GPU set's, ``auto`` resolved to the visible GPUs).  Every timing
carries its verdict (``timing.judge_samples``): the step time over rank 0's steps after the
first, the communication time of the one profiled step (one sample: never stable).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from typing import ClassVar

import pandas as pd

from lab_utils.core.config import ConfigError
from lab_utils.core.timing import judge_samples
from lab_utils.distributed import STRATEGIES, DistConfig, DistRunError, launch
from lab_utils.model.train import artifacts_dir
from lab_utils.studies.distributed import overlap_bars
from lab_utils.studies.explore.base import Control, Explorer, Progress, Result, Unavailable, explored_scatter

STEPS = 3
WORLD_SIZES = (1, 2, 4)
#: the lab's parameters that set the step a run trains (``DistConfig`` fields)
STEP_PARAMS = ("preset", "batch_size", "height", "width", "txt_len", "steps", "activation_checkpoint", "backend")


def lab_step(params: dict) -> dict:
    """The lab's step (``STEP_PARAMS``) from its parameters; the explorer's defaults elsewhere."""
    return {k: params[k] for k in STEP_PARAMS if k in params}


def world_size_controls(params: dict) -> tuple[Control, ...]:
    """The strategy, the lab's world sizes beside 1, 2, 4 (the largest the lab runs by default), bf16."""
    lab_sizes = [int(w) for w in params.get("world_sizes", ()) if isinstance(w, int) or str(w).isdigit()]
    sizes = tuple(sorted({*WORLD_SIZES, *lab_sizes}))
    default = max(lab_sizes) if lab_sizes and max(lab_sizes) > 1 else 2
    return (
        Control("strategy", STRATEGIES, "ddp"),
        Control("world_size", sizes, default, "world size"),
        Control("mixed_precision", (), False, "bf16 compute (FSDP)"),
    )


@dataclass
class DistributedExplorer(Explorer):
    """``DistributedExplorer(rec).show()``: the lab's step, from the lab's recorder's parameters."""

    #: the lab's parameters (``cfg.to_dict()``); default: the recorder's
    params: dict | None = None

    lab: ClassVar[str] = "06_distributed"
    title: ClassVar[str] = "Explore: a parallelism strategy on local ranks"
    live_help: ClassVar[str] = "pick strategy and world size: the ranks train a few steps, losses and collectives land"
    controls: ClassVar[tuple[Control, ...]] = world_size_controls({})

    @classmethod
    def for_lab(cls, cfg, rec=None) -> DistributedExplorer:
        """The explorer on the lab's step and world sizes (``cfg``: the lab's DistributedLabConfig)."""
        return cls(rec=rec, params=cfg.to_dict())

    def __post_init__(self):
        if self.params is None:
            self.params = dict(self.rec.params) if self.rec is not None else {}
        self.step = lab_step(self.params)
        self.controls = world_size_controls(self.params)  # per instance: the lab's world sizes
        super().__post_init__()

    def dist_config(self, cfg: dict) -> DistConfig:
        return DistConfig(
            **{"steps": STEPS, **self.step},
            strategy=cfg["strategy"],
            world_size=cfg["world_size"],
            mixed_precision=cfg["mixed_precision"],
            keep_grads=False,
        )

    def why_not(self, cfg: dict) -> str | None:
        try:
            self.dist_config(cfg)
        except ConfigError as e:
            return str(e)
        return None

    def measure(self, cfg: dict, progress: Progress) -> Result:
        dc = self.dist_config(cfg)
        progress(0, 1, f"{dc.world_size} ranks, {dc.strategy}, {dc.steps} steps")
        out = artifacts_dir() / "explore_distributed"
        out.mkdir(parents=True, exist_ok=True)
        try:
            res = launch(dc, tempfile.mkdtemp(prefix=f"{dc.strategy}-w{dc.world_size}-", dir=out), progress=False)
        except DistRunError as e:
            raise Unavailable(f"the run ended early ({e.kind}): {e}") from None
        progress(1, 1, "done")
        label = self.label(cfg)
        coll = res.collectives(0)
        comm_ms = sum(c.dur_us for c in coll) / 1e3
        comm_mb = sum(c.bytes for c in coll) / 1e6
        steps_ms = [float(v) for k, v in sorted(res.ranks[0].get("step_ms", {}).items(), key=lambda kv: int(kv[0]))]
        step_v, comm_v = judge_samples(steps_ms[1:]), judge_samples([comm_ms])  # step 1 warms up
        kw = dict(shape=f"w{dc.world_size}", strategy=dc.strategy, world_size=dc.world_size)
        for i, loss in enumerate(res.losses):
            self.rec.add("explore", label, "loss", loss, "", statistic=f"step{i + 1}", **kw)
        step_med = float(pd.Series(steps_ms[1:]).median()) if len(steps_ms) > 1 else math.nan
        self.rec.add(
            "explore", label, "step_time", step_med, "ms", statistic="median", samples=steps_ms[1:],
            stable=step_v.stable, stability=step_v.reason, rank=0, **kw,
        )  # fmt: skip
        self.rec.add(
            "explore", label, "comm_time", comm_ms, "ms", statistic="sum", rank=0,
            stable=comm_v.stable, stability=comm_v.reason, **kw,
        )  # fmt: skip
        self.rec.add("explore", label, "comm_bytes", comm_mb, "MB", statistic="sum", rank=0, **kw)
        row = dict(
            strategy=dc.strategy,
            world_size=dc.world_size,
            mixed_precision=dc.mixed_precision,
            final_loss=res.losses[-1] if res.losses else math.nan,
            collectives=len(coll),
            comm_mb=comm_mb,
            step_ms=step_med,
            step_stability=str(step_v),
            comm_ms=comm_ms,
            comm_stability=str(comm_v),
            stable=step_v.stable,
            wall_s=res.wall_s,
        )
        ov = [{**r["overlap"], "rank": r.get("rank", i)} for i, r in enumerate(res.ranks) if r.get("overlap")]
        return Result(0, cfg, row, data=dict(losses=list(res.losses), overlap=ov))

    def figures(self, results: list[Result]) -> list:
        runs = [f"#{r.index} {self.label(r.config)}" for r in results]
        loss = pd.DataFrame(
            [dict(run=n, step=i + 1, loss=v) for n, r in zip(runs, results) for i, v in enumerate(r.data["losses"])],
            columns=["run", "step", "loss"],
        )
        curves = explored_scatter(
            loss,
            "step",
            ["loss", "run"],
            color="run",
            cmap="Category10",
            size=8,
            framewise=True,
            title="Loss per step of each run (same data and seed)",
        )
        ov = pd.DataFrame(
            [dict(run=n, **o) for n, r in zip(runs, results) for o in r.data.get("overlap", [])],
            columns=["run", "rank", "compute_ms", "exposed_ms", "idle_ms"],
        )
        if ov.empty:  # the same kind of figure before any profiled step (a live figure keeps its kind)
            ov = pd.DataFrame([dict(run="no profiled step yet", rank=0, compute_ms=0.0, exposed_ms=0.0, idle_ms=0.0)])
        bars = overlap_bars(ov)  # the lab's own figure of its runs, here of the explored ones
        return [curves, bars]
