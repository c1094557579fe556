"""Where a training step's time and memory go: torch.profiler over K steps, analysed.

Design note
-----------
:func:`profile_training` runs a :class:`lab_utils.model.train.Trainer` under
``torch.profiler`` with a wait / warm-up / active schedule, exports the active steps
as a Chrome/Perfetto trace JSON (under ``PERFLAB_ARTIFACTS_DIR``), and then analyses
*that file*: the numbers a report shows are the numbers anyone can re-derive from
the trace it links.

* steps: ``ProfilerStep#k`` ranges; phases: the ``record_function`` ranges the
  trainer opens (``train.PHASES``), summed per step.  The phases cover the step up to
  Python between them, and a test holds them within 5% of the step time.
* categories (matmul, attention, normalization, elementwise/activation, reduction,
  copy/cast, communication, optimizer, other): on CUDA from device kernels (kernel
  name, else the op that launched it); on CPU from operators' *self* time (nesting
  removed, so nothing is counted twice).  ``idle/gap`` is step time not covered by
  any kernel (CUDA) or any operator (CPU: Python, waiting for data, ...).
* top operators by self time (CPU) or by the device time of the kernels they launch
  (CUDA), with their share of the profiled step time.
* FLOPs per step: ``torch.utils.flop_counter.FlopCounterMode`` over the model's
  forward + backward for each profiled step's shape, counted on a ``meta`` copy (no
  compute; model FLOPs, so activation recompute is not counted).  Achieved TFLOP/s =
  FLOPs / profiled step time; MFU against the measured matmul ceiling
  (``lab_utils.ceilings``) and the datasheet peak (``lab_utils.device``).
* memory: the profiler's allocation events give "allocated bytes" over time (on CPU
  this counts allocations made while profiling, relative to its start; on CUDA it is
  the caching allocator's total).  On CUDA the allocator's history is also recorded
  and written as a snapshot pickle plus torch's HTML viewer.
"""

from __future__ import annotations

import math
import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from torch.cuda._memory_viz import trace_plot
from torch.profiler import ProfilerActivity, profile, schedule
from torch.utils.flop_counter import FlopCounterMode

from .config import ConfigError
from .model import build_model
from .model.train import Trainer, artifacts_dir, rf_loss, synthetic_batch
from .traces import CATEGORIES, IDLE, TraceAnalysis, analyse_trace, categorize

# --------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------


def _cpu_sdpa_flop_mapping() -> dict:
    """FlopCounterMode has formulas for CUDA's SDPA kernels but not for the CPU flash
    kernel; count it the same way (QKᵀ and PV: 4·B·H·Lq·Lk·Dh forward, 2x backward)."""
    aten = torch.ops.aten
    out = {}

    def fwd(q_shape, k_shape, v_shape):
        b, h, lq, d = q_shape
        lk = k_shape[-2]
        return 2 * b * h * lq * lk * d + 2 * b * h * lq * lk * v_shape[-1]

    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        # FlopCounterMode hands formulas the shapes of tensor arguments
        def f(query, key, value, *args, out_shape=None, **kw):
            return fwd(query, key, value)

        def b(grad_out, query, key, value, *args, out_shape=None, **kw):
            return 2 * fwd(query, key, value)

        out[aten._scaled_dot_product_flash_attention_for_cpu] = f
        if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
            out[aten._scaled_dot_product_flash_attention_for_cpu_backward] = b
    return out


def count_flops(fn, *, device_kind: str = "meta") -> tuple[int, dict[str, int]]:
    """FLOPs of ``fn()`` by ``torch.utils.flop_counter``; returns (total, per-op)."""
    with FlopCounterMode(display=False, custom_mapping=_cpu_sdpa_flop_mapping()) as fc:
        fn()
    per_op = {str(k): int(v) for k, v in fc.get_flop_counts().get("Global", {}).items()}
    return int(fc.get_total_flops()), per_op


_FLOP_CACHE: dict[tuple, int] = {}


def training_step_flops(model_cfg, batch_size: int, grid: tuple[int, int], txt_len: int) -> int:
    """Model FLOPs of one training step (forward + backward of the MMDiT) at this shape,
    counted on a meta-device copy (nothing is computed or allocated)."""
    cfg = model_cfg.replace(kernels="eager", attention_path="sdpa", checkpoint="none", recipe="bf16")
    key = (cfg, batch_size, tuple(grid), txt_len)
    if key not in _FLOP_CACHE:
        model = build_model(cfg, device="meta").train()
        h, w = grid
        ppt = cfg.pixels_per_token
        batch = synthetic_batch(cfg, batch_size, height=h * ppt, width=w * ppt, txt_len=txt_len, device="meta")
        total, _ = count_flops(lambda: rf_loss(model, batch).backward())
        _FLOP_CACHE[key] = total
    return _FLOP_CACHE[key]


# --------------------------------------------------------------------------------------
# Profiling a trainer
# --------------------------------------------------------------------------------------


@dataclass
class ProfileReport:
    analysis: TraceAnalysis
    trace_path: Path
    step_flops: list[int]
    memory_snapshot_path: Path | None = None
    memory_html_path: Path | None = None
    cuda_peak_bytes: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def steps(self) -> pd.DataFrame:
        df = self.analysis.steps.copy()
        df["flops"] = self.step_flops[: len(df)]
        df["tflops"] = df.flops / (df.step_ms * 1e-3) / 1e12
        return df

    def mfu(self, ceilings=None, datasheet=None, dtype: str = "fp32") -> pd.DataFrame:
        """Achieved TFLOP/s over the profiled steps (total FLOPs / total step time) and
        its share of the measured matmul ceiling and of the datasheet peak."""
        st = self.steps
        achieved = float(st.flops.sum() / (st.step_ms.sum() * 1e-3) / 1e12)
        rows = [dict(quantity="achieved", dtype=dtype, tflops=achieved, pct=None, reference="")]
        peak_meas = ceilings.matmul(dtype) if ceilings is not None else None
        if peak_meas:
            rows.append(
                dict(
                    quantity="measured matmul ceiling",
                    dtype=dtype,
                    tflops=peak_meas,
                    pct=100 * achieved / peak_meas,
                    reference="lab_utils.ceilings",
                )
            )
        if datasheet is not None:
            # fp32 matmuls run with TF32 off here (lab_utils.ceilings measures "fp32" that way),
            # so their peak is the CUDA-core fp32 figure, not the TF32 tensor-core one.
            ds = {
                "bf16": datasheet.bf16_tflops,
                "fp16": datasheet.bf16_tflops,
                "tf32": datasheet.tf32_tflops,
                "fp32": datasheet.fp32_tflops,
            }.get(dtype)
            if ds:
                rows.append(
                    dict(
                        quantity="datasheet peak" + (" (fp32, TF32 off)" if dtype == "fp32" else ""),
                        dtype=dtype,
                        tflops=ds,
                        pct=100 * achieved / ds,
                        reference=datasheet.source,
                    )
                )
        return pd.DataFrame(rows)

    def record(
        self, rec, *, variant: str = "profile", ceilings=None, datasheet=None, dtype: str = "fp32", shape: str = ""
    ) -> None:
        """Write the report's numbers as records (one row per number, plus the trace path)."""
        a = self.analysis
        st = self.steps
        for r in st.itertuples():
            rec.add(
                "step",
                variant,
                "step_time",
                r.step_ms,
                "ms",
                shape=shape,
                statistic=f"step{r.step}",
                source="torch.profiler ProfilerStep range",
            )
            rec.add("step", variant, "phase_coverage", 100 * r.coverage, "%", shape=shape, statistic=f"step{r.step}")
            rec.add(
                "step",
                variant,
                "flops",
                r.flops,
                "FLOP",
                shape=shape,
                statistic=f"step{r.step}",
                method="FlopCounterMode fwd+bwd on meta",
            )
        rec.add(
            "step",
            variant,
            "step_time",
            float(st.step_ms.median()),
            "ms",
            shape=shape,
            statistic="median",
            samples=list(st.step_ms),
        )
        for r in a.phases.groupby("phase", sort=False).ms.median().items():
            rec.add("phases", r[0], "time", r[1], "ms", shape=shape, statistic="median")
        for r in a.categories.itertuples():
            rec.add(
                "categories",
                r.category,
                "time",
                r.ms,
                "ms",
                shape=shape,
                statistic="sum",
                pct_of_step=r.pct_of_step,
                source=a.source,
            )
        for r in a.top_ops.itertuples():
            rec.add(
                "top_ops",
                r.name,
                "time",
                r.ms,
                "ms",
                shape=shape,
                statistic="sum",
                calls=r.calls,
                category=r.category,
                pct_of_step=r.pct_of_step,
            )
        for r in self.mfu(ceilings, datasheet, dtype).itertuples():
            if r.quantity == "achieved":
                rec.add(
                    "mfu",
                    variant,
                    "throughput",
                    r.tflops,
                    "TFLOP/s",
                    shape=shape,
                    dtype=dtype,
                    statistic="total",
                    formula="sum(flops) / sum(step time)",
                )
            else:
                rec.add(
                    "mfu",
                    r.quantity,
                    "pct_of_peak",
                    r.pct,
                    "%",
                    shape=shape,
                    dtype=dtype,
                    statistic="total",
                    peak_tflops=r.tflops,
                    reference=r.reference,
                )
        if not math.isnan(a.peak_allocated_bytes):
            rec.add(
                "memory",
                variant,
                "peak_allocated",
                a.peak_allocated_bytes / 2**20,
                "MiB",
                shape=shape,
                statistic="max",
                source="profiler [memory] events" + (" (relative to profiler start)" if a.device_kind == "cpu" else ""),
            )
        if self.cuda_peak_bytes is not None:
            rec.add(
                "memory",
                variant,
                "cuda_max_allocated",
                self.cuda_peak_bytes / 2**20,
                "MiB",
                shape=shape,
                statistic="max",
                source="torch.cuda.max_memory_allocated",
            )
        _record_artifact(rec, variant, "trace_file", self.trace_path, "chrome-trace-json")
        if self.memory_html_path is not None:
            _record_artifact(rec, variant, "memory_html", self.memory_html_path, "html")


def _record_artifact(rec, variant: str, metric: str, path: Path, fmt: str) -> None:
    """A file the profile wrote, as a record of its size with its path and format."""
    rec.add("artifacts", variant, metric, path.stat().st_size, "bytes", statistic="file", path=str(path), format=fmt)


def profile_training(
    trainer: Trainer,
    *,
    active: int = 3,
    warmup: int = 1,
    wait: int = 0,
    out_dir: str | Path | None = None,
    name: str = "01_training_step",
    memory: bool = True,
) -> ProfileReport:
    """Profile ``wait + warmup + active`` trainer steps; analyse the active ones."""
    for p, v in (("steps", active), ("warmup_steps", warmup)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if p == "steps" else 0):
            raise ConfigError(p, v, "an integer >= " + ("1" if p == "steps" else "0"))
    out = Path(out_dir) if out_dir is not None else artifacts_dir() / "traces"
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    trace_path = out / f"{name}-{stamp}.trace.json"
    cuda = trainer.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    notes = []

    def on_ready(prof):
        prof.export_chrome_trace(str(trace_path))

    if cuda and memory:
        torch.cuda.reset_peak_memory_stats(trainer.device)
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        with profile(
            activities=acts,
            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            profile_memory=memory,
            record_shapes=False,
            on_trace_ready=on_ready,
        ) as prof:
            for _ in range(wait + warmup + active):
                trainer.step()
                prof.step()
    finally:
        snap_path = html_path = None
        peak = None
        if cuda and memory:
            try:
                snap = torch.cuda.memory._snapshot()
                snap_path = out / f"{name}-{stamp}.memory_snapshot.pickle"
                snap_path.write_bytes(pickle.dumps(snap))
                html_path = out / f"{name}-{stamp}.memory.html"
                html_path.write_text(trace_plot(snap))
                notes.append("memory.html is torch's MemoryViz; it loads its viewer script from the web")
            except Exception as e:  # noqa: BLE001 - the snapshot is an extra; the profile stands without it
                notes.append(f"CUDA memory snapshot not written: {type(e).__name__}: {e}")
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
            peak = float(torch.cuda.max_memory_allocated(trainer.device))
    analysis = analyse_trace(trace_path, "cuda" if cuda else "cpu")
    hist = trainer.history[-active:]
    flops = [training_step_flops(trainer.model_cfg, trainer.cfg.batch_size, r.grid, r.txt_len) for r in hist]
    return ProfileReport(analysis, trace_path, flops, snap_path, html_path, peak, notes)


__all__ = [
    "CATEGORIES",
    "IDLE",
    "ProfileReport",
    "TraceAnalysis",
    "analyse_trace",
    "categorize",
    "count_flops",
    "profile_training",
    "training_step_flops",
]
