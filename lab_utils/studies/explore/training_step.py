"""Lab 01's explorer: change the step's seams -> profile a few steps -> phase bars, MFU and
peak memory beside the earlier configurations (the A/B a performance engineer runs all day).

Every configuration is the lab's own :class:`~lab_utils.studies.training_step.TrainingStepLabConfig`
with the seams replaced (so it is validated like the parameters cell), profiled by
``studies.training_step.profile_step`` (``lab_utils.profiling.profiler.profile_training``).  Its records
join the lab's recorder as experiment ``explore`` with the configuration's label in front of each
variant (``<label> | <experiment>/<variant>``), so the configurations of one afternoon stay apart
in ``rec.save()`` and ``perflab compare``.  The lab's own configuration is not profiled again and
adds no rows: its records are the lab's.

The precision control picks the step's storage dtype and autocast; the recipe control
swaps the model's linear layers for a low-precision recipe of ``lab_utils.precision.quantized``.

Every timing carries its verdict (``timing.judge_samples`` of the profiled steps): the step
time's (which its TFLOP/s and MFU take) and each phase's, named in ``unstable_phases`` and in
the phase bars' hover.  On a GPU the batch and bucket choices include the lab's GPU set's
(``parameterized/sets/01_training_step/gpu.yaml``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import holoviews as hv
import pandas as pd
import torch
import yaml

from lab_utils.attention.attend import PATHS as ATTENTION_PATHS
from lab_utils.attention.attend import get_path
from lab_utils.core.config import ConfigError
from lab_utils.core.device import DeviceInfo, device_info
from lab_utils.core.records import EXPLORE
from lab_utils.model import CHECKPOINT_POLICIES
from lab_utils.model.train import PHASES
from lab_utils.precision.quantized import RECIPES
from lab_utils.profiling.profiler import PERIODIC_RULE, periodic_note
from lab_utils.step.skip import default_step_only
from lab_utils.studies.explore.base import Control, Explorer, Progress, Result
from lab_utils.studies.training_step import MMDIT_PROFILE, StepProfile, TrainingStepLabConfig, profile_step

#: precision choice -> (parameter storage dtype, autocast)
PRECISIONS = {"fp32": ("float32", "none"), "bf16 autocast": ("float32", "bf16"), "bf16 weights": ("bfloat16", "none")}
KERNELS = ("eager", "compile", "triton")
BATCHES = (1, 2, 4)
#: "lab": the lab's own aspect-ratio buckets (its parameters cell)
BUCKETS = ("lab", "48x80", "64x64", "64x96", "96x96", "128x128")
INTERPRETED = (
    "runs in Triton's interpreter on CPU: a profile would time the interpreter (correctness only, never timed)"
)


GPU_SET = Path(__file__).resolve().parents[3] / "parameterized" / "sets" / "01_training_step" / "gpu.yaml"


def _bucket(b) -> str:
    return f"{int(b[0])}x{int(b[1])}"


def gpu_sizes(path: Path = GPU_SET) -> tuple[tuple, tuple]:
    """The lab's GPU set's batch sizes and buckets ("HxW")."""
    s = yaml.safe_load(Path(path).read_text()) or {}
    batches = (int(s["batch_size"]),) if "batch_size" in s else ()
    return batches, tuple(_bucket(b) for b in s.get("buckets", ()))


def explorer_controls(device_type: str) -> tuple[Control, ...]:
    """The seams; on CUDA the batch and bucket choices gain the lab's GPU set's sizes."""
    batches, buckets = gpu_sizes() if device_type == "cuda" else ((), ())
    return (
        Control("activation_checkpoint", CHECKPOINT_POLICIES, "none", "checkpointing"),
        Control("compile", (), False, "torch.compile"),
        Control("kernels", KERNELS, "eager"),
        Control("attention_path", ATTENTION_PATHS, "sdpa", "attention path"),
        Control("precision", tuple(PRECISIONS), "fp32"),
        Control("recipe", tuple(RECIPES), "bf16", "recipe"),
        Control("batch", tuple(sorted({*BATCHES, *batches})), 2),
        Control("bucket", (*BUCKETS, *(b for b in buckets if b not in BUCKETS)), "64x64"),
    )


@dataclass
class TrainingStepExplorer(Explorer):
    """``TrainingStepExplorer.for_lab(cfg, info, rec).show()``: the lab's step with other seams."""

    base: TrainingStepLabConfig | None = None
    info: DeviceInfo | None = None
    #: the lab's own profile of ``base``: the default configuration is not profiled twice
    measured: StepProfile | None = None

    lab: ClassVar[str] = "01_training_step"
    title: ClassVar[str] = "Explore: the training step's seams (A/B)"
    live_help: ClassVar[str] = "change a seam: a few steps are profiled and land beside the earlier configurations"
    controls: ClassVar[tuple[Control, ...]] = explorer_controls("cpu")

    @classmethod
    @default_step_only(MMDIT_PROFILE, arg=1)  # on another step: one line saying why
    def for_lab(
        cls, cfg: TrainingStepLabConfig, info: DeviceInfo | None = None, rec=None, measured: StepProfile | None = None
    ) -> TrainingStepExplorer:
        """The explorer starting at the lab's own parameters; ``measured`` (the lab's profile
        of exactly those parameters) becomes the first result instead of a second profile."""
        precision = next((k for k, v in PRECISIONS.items() if v == (cfg.dtype, cfg.autocast)), "fp32")
        defaults = dict(
            activation_checkpoint=cfg.activation_checkpoint,
            compile=cfg.compile,
            kernels=cfg.kernels if cfg.kernels in KERNELS else "eager",
            attention_path=cfg.attention_path,
            precision=precision,
            recipe=cfg.recipe,
            batch=cfg.batch_size,
            bucket="lab",
        )
        return cls(rec=rec, defaults=defaults, base=cfg, info=info, measured=measured)

    def __post_init__(self):
        self.base = self.base or TrainingStepLabConfig(steps=2, warmup_steps=1)
        self.info = self.info or device_info(self.base.device)
        cuda = torch.device(self.info.torch_device).type == "cuda"
        ctl = list(explorer_controls("cuda" if cuda else "cpu"))  # per instance: the device's and the lab's sizes
        i = next(k for k, c in enumerate(ctl) if c.name == "batch")
        if self.base.batch_size not in ctl[i].options:
            ctl[i] = Control("batch", tuple(sorted({*ctl[i].options, self.base.batch_size})), 2)
        self.controls = tuple(ctl)
        super().__post_init__()

    def label(self, cfg: dict) -> str:
        return (
            f"ac={cfg['activation_checkpoint']} compile={int(cfg['compile'])} k={cfg['kernels']} "
            f"attn={cfg['attention_path']} {cfg['precision']} r={cfg['recipe']} b{cfg['batch']} {cfg['bucket']}"
        )

    def step_config(self, cfg: dict) -> TrainingStepLabConfig:
        dtype, autocast = PRECISIONS[cfg["precision"]]
        if cfg["bucket"] == "lab":
            buckets = [list(b) for b in self.base.buckets]
        else:
            buckets = [[int(s) for s in cfg["bucket"].split("x")]]
        return dataclasses.replace(
            self.base,
            activation_checkpoint=cfg["activation_checkpoint"],
            compile=cfg["compile"],
            kernels=cfg["kernels"],
            attention_path=cfg["attention_path"],
            dtype=dtype,
            autocast=autocast,
            recipe=cfg["recipe"],
            batch_size=cfg["batch"],
            num_samples=max(self.base.num_samples, cfg["batch"]),
            buckets=buckets,
        )

    def why_not(self, cfg: dict) -> str | None:
        try:
            sc = self.step_config(cfg)
        except ConfigError as e:
            return str(e)
        dev = self.info.torch_device
        cpu = torch.device(dev).type == "cpu"
        if cpu and cfg["kernels"] == "triton":
            return f"kernels='triton' {INTERPRETED}"
        if cpu and cfg["attention_path"] == "triton":
            return f"attention path 'triton' {INTERPRETED}"
        mc = sc.model_config()
        low = sc.autocast == "bf16" or sc.dtype == "bfloat16"
        return get_path(cfg["attention_path"]).why_not(
            device=dev,
            dtype=torch.bfloat16 if low else torch.float32,
            mask="custom",  # caption padding masks the joint attention
            head_dim=mc.head_dim,
            backward=True,
        )

    def measure(self, cfg: dict, progress: Progress) -> Result:
        sc = self.step_config(cfg)
        if self.measured is not None and sc == self.base:
            p = self.measured  # the lab profiled exactly this configuration already
        else:
            progress(0, 1, f"profiling {sc.warmup_steps} + {sc.steps} steps")
            p = profile_step(sc, self.info, lab=self.lab)
            progress(1, 1, "profiled")
        label = self.label(cfg)
        if p is not self.measured:  # the lab's own profile is in the lab's records already
            for r in list(p.rec.rows):  # a fresh recorder of this configuration alone (profile_step)
                self.rec.rows.append(
                    {**r, "experiment": EXPLORE, "variant": f"{label} | {r['experiment']}/{r['variant']}"}
                )
        rep = p.report
        steps = rep.steps
        mfu = p.mfu.set_index("quantity")
        pct = mfu.pct.get("measured matmul ceiling", math.nan)
        peak = rep.cuda_peak_bytes if rep.cuda_peak_bytes is not None else rep.analysis.peak_allocated_bytes
        # per step, a checkpoint every N steps amortised (profiler.PERIODIC_RULE), as in the lab's own figures
        figs = rep.phase_figures()
        phases = pd.Series({f.phase: f.ms for f in figs}).reindex(list(PHASES)).fillna(0.0)
        verdicts = {f.phase: f.verdict for f in figs if f.samples}
        step_v = rep.step_verdict  # TFLOP/s and MFU come from the step times: they take its verdict
        row = dict(
            config=label,
            stable=step_v.stable,
            step_stability=str(step_v),
            unstable_phases=", ".join(p for p, v in verdicts.items() if not v.stable) or "none",
            step_ms=float(steps.amortised_ms.median()),
            tflops=float(mfu.tflops.get("achieved", math.nan)),
            mfu_pct_of_measured=float(pct) if pct is not None else math.nan,
            peak_mib=float(peak) / 2**20 if peak is not None else math.nan,
            **{f"{k}_ms": float(v) for k, v in phases.items()},
        )
        verdict = {p: str(v) for p, v in verdicts.items()}
        note = periodic_note(figs)
        return Result(0, cfg, row, data=dict(phases=phases, verdicts=verdict, lab=p is self.measured, note=note))

    def figures(self, results: list[Result]) -> list:
        names = [f"#{r.index}" + (" lab" if r.data.get("lab") else "") for r in results]
        ph = pd.DataFrame(
            [
                dict(config=n, phase=k, ms=float(v), stability=r.data.get("verdicts", {}).get(k, "not run"))
                for n, r in zip(names, results)
                for k, v in r.data["phases"].items()
            ],
            columns=["config", "phase", "ms", "stability"],
        )
        notes = sorted({r.data.get("note", "") for r in results} - {""})
        # the lab's figure (studies.training_step.phase_summary_bars: time per step by phase, periodic
        # phases amortised) with one bar per configuration in each phase; "#1 lab" is the lab's own step
        bars = hv.Bars(ph, ["phase", "config"], ["ms", "stability"]).opts(
            color="config",
            cmap="Category10",
            tools=["hover"],
            xlabel="phase" + (f" · {'; '.join(notes)} ({PERIODIC_RULE})" if notes else ""),
            ylabel="ms per step",
            title="Time per step by phase: the lab's step and the explored configurations (# in the table)",
            legend_position="right",
            multi_level=True,
            width=760,
            framewise=True,
        )
        summary = pd.DataFrame(
            [
                dict(config=n, **{k: r.row[k] for k in ("mfu_pct_of_measured", "tflops", "peak_mib", "step_ms")})
                for n, r in zip(names, results)
            ],
            columns=["config", "mfu_pct_of_measured", "tflops", "peak_mib", "step_ms"],
        )
        mfu = hv.Bars(summary, "config", ["mfu_pct_of_measured", "tflops", "step_ms"]).opts(
            tools=["hover"], ylabel="% of measured matmul ceiling", title="MFU", framewise=True, width=500
        )
        mem = hv.Bars(summary, "config", ["peak_mib", "step_ms"]).opts(
            tools=["hover"], ylabel="MiB", title=self._memory_title(), framewise=True, width=500, color="#9467bd"
        )
        return [bars, mfu, mem]

    def _memory_title(self) -> str:
        cuda = torch.device(self.info.torch_device).type == "cuda" if self.info is not None else False
        return "Peak memory" + ("" if cuda else " (CPU: allocated while profiling)")
