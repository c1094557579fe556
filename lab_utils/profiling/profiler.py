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
  (``lab_utils.core.ceilings``) and the datasheet peak (``lab_utils.core.device``).
* noise: every figure is kept per profiled step (the ``samples`` of its record) and judged
  like any timing (:func:`lab_utils.core.timing.judge_samples`), so ``perflab compare`` calls a
  disturbed figure noisy instead of slower or faster.
* periodic phases (a checkpoint saved every N steps): one rule, :func:`phase_figure`, for
  every lab: the phase's cost per step is the median cost of one occurrence (over the
  profiled steps that ran it) divided by N, shown beside that full per-event cost; its
  samples are the occurrences.  The step time is amortised the same way (each profiled
  step without its periodic phases, plus their amortised cost).
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch.cuda._memory_viz import trace_plot
from torch.profiler import ProfilerActivity, profile, schedule

from lab_utils.core.config import ConfigError
from lab_utils.core.noise import quiet_stderr_fd
from lab_utils.core.records import REPORTED, SHARE, TOP_N
from lab_utils.core.timing import Stability, judge_samples
from lab_utils.model.accounting import count_flops, training_step_flops
from lab_utils.model.train import PHASES, Trainer, artifacts_dir
from lab_utils.profiling.traces import CATEGORIES, IDLE, TraceAnalysis, analyse_trace, categorize
from lab_utils.step.contract import STEP_PHASES, StepFactory, run_step, skeleton

# --------------------------------------------------------------------------------------
# Phases that run every N steps: one rule for every lab
# --------------------------------------------------------------------------------------

PERIODIC_RULE = "a phase run every N steps counts as its median cost per occurrence / N per step"


@dataclass(frozen=True)
class PhaseFigure:
    """One phase's time per step, with the samples and the verdict it is judged by.

    ``every`` = 1: ``samples`` are the phase's time in each profiled step and ``ms`` their
    median (or minimum).  ``every`` = N > 1 (a checkpoint every N steps): ``samples`` are the
    occurrences' costs, ``per_event_ms`` their median and ``ms`` = ``per_event_ms`` / N, the
    cost amortised per step (:data:`PERIODIC_RULE`)."""

    phase: str
    ms: float  # per step (amortised when every > 1)
    every: int
    per_event_ms: float  # the full cost of one occurrence (NaN: none in the profiled steps)
    events: int  # occurrences in the profiled steps
    samples: tuple
    verdict: Stability

    @property
    def periodic(self) -> bool:
        return self.every > 1

    @property
    def note(self) -> str:
        """The rule, in words, with this phase's numbers (empty for a phase run every step)."""
        if not self.periodic:
            return ""
        if not self.events:
            return f"{self.phase} every {self.every} steps: none in the profiled steps, counted as 0 ms per step"
        return (
            f"{self.phase} every {self.every} steps: {self.per_event_ms:.4g} ms per {self.phase} "
            f"(median of {self.events}), amortised as {self.ms:.4g} ms per step"
        )


def phase_figure(phase: str, per_step_ms: Sequence[float], every: int = 1, *, statistic: str = "median") -> PhaseFigure:
    """A phase's figure per step from its time in each profiled step (0 where it did not
    run); ``every`` = N > 1 applies :data:`PERIODIC_RULE`.  ``statistic``: "median" or "min"."""
    x = np.asarray([float(v) for v in per_step_ms], dtype=float)
    every = max(int(every or 1), 1)
    pick = np.min if statistic == "min" else np.median
    samples = x[x > 0] if every > 1 else x
    mid = float(pick(samples)) if samples.size else (math.nan if every > 1 else 0.0)
    per_step = (mid / every if samples.size else 0.0) if every > 1 else mid
    return PhaseFigure(phase, per_step, every, mid, int((x > 0).sum()), tuple(samples.tolist()), judge_samples(samples))


def periodic_note(figures: Sequence[PhaseFigure]) -> str:
    """What a figure of phases per step states about its periodic phases ("" if none)."""
    notes = [f.note for f in figures if f.periodic]
    return "; ".join(notes)


# --------------------------------------------------------------------------------------
# Profiling a trainer
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NestedPhase:
    """A phase inside another: its time per step (median), samples and verdict, and its holder."""

    phase: str
    within: str
    ms: float
    samples: tuple
    verdict: Stability


@dataclass
class ProfileReport:
    analysis: TraceAnalysis
    trace_path: Path
    step_flops: list[int]
    memory_snapshot_path: Path | None = None
    memory_html_path: Path | None = None
    cuda_peak_bytes: float | None = None
    notes: list[str] = field(default_factory=list)
    periods: dict = field(default_factory=dict)  # phase -> N: runs every N steps (a checkpoint)
    flops_source: str = "FlopCounterMode fwd+bwd on meta"
    tokens: list = field(default_factory=list)  # tokens of each active step, where the step counts them

    def phase_frame(self) -> pd.DataFrame:
        """ms of each phase (columns, in ``PHASES`` order) in each profiled step (rows), 0 where
        a phase did not run in a step."""
        a = self.analysis
        steps = list(a.steps.step)
        if not len(a.phases):
            return pd.DataFrame(index=pd.Index(steps, name="step"))
        wide = a.phases.pivot_table(index="step", columns="phase", values="ms", aggfunc="sum", sort=False)
        wide = wide.reindex(steps).fillna(0.0)
        return wide[[p for p in PHASES if p in wide.columns] + [p for p in wide.columns if p not in PHASES]]

    def phase_figures(self, statistic: str = "median") -> list[PhaseFigure]:
        """Each phase's figure per step (:func:`phase_figure`; periodic phases amortised)."""
        wide = self.phase_frame()
        return [phase_figure(p, wide[p], self.periods.get(p, 1), statistic=statistic) for p in wide.columns]

    def nested_phase_figures(self, statistic: str = "median") -> list[NestedPhase]:
        """The figure per step of each phase that runs inside another (a factory's own: "noising"
        inside "forward"), with the phase that holds it; counted within that one, never twice."""
        a, steps = self.analysis, list(self.analysis.steps.step)
        out = []
        for (phase, within), g in a.nested_phases.groupby(["phase", "within"], sort=False):
            per = g.groupby("step").ms.sum().reindex(steps).fillna(0.0)
            f = phase_figure(phase, per, statistic=statistic)
            out.append(NestedPhase(phase, within, f.ms, f.samples, f.verdict))
        return out

    @property
    def amortised_step_ms(self) -> np.ndarray:
        """Each profiled step's time with its periodic phases replaced by their amortised cost
        (:data:`PERIODIC_RULE`): the per-step samples of the step time."""
        ms = self.analysis.steps.step_ms.to_numpy(float).copy()
        wide = self.phase_frame()
        for f in self.phase_figures():
            if f.periodic:
                ms += f.ms - wide[f.phase].to_numpy(float)
        return ms

    @property
    def steps(self) -> pd.DataFrame:
        df = self.analysis.steps.copy()
        df["amortised_ms"] = self.amortised_step_ms
        df["flops"] = self.step_flops[: len(df)]
        # a step of no time has no rate: NaN, never an infinite TFLOP/s
        df["tflops"] = df.flops / (df.amortised_ms.where(df.amortised_ms > 0) * 1e-3) / 1e12
        return df

    @property
    def step_verdict(self) -> Stability:
        """The stability verdict of the (amortised) step times; the figures computed from
        them (TFLOP/s, MFU) take it."""
        return judge_samples(self.amortised_step_ms)

    def mfu(self, ceilings=None, datasheet=None, dtype: str = "fp32") -> pd.DataFrame:
        """Achieved TFLOP/s over the profiled steps (total FLOPs / total amortised step time)
        and its share of the measured matmul ceiling and of the datasheet peak; ``samples``:
        the same figure per profiled step.  Profiled steps of no time give no rate: NaN."""
        st = self.steps
        total_ms = float(st.amortised_ms.sum())
        achieved = float(st.flops.sum()) / (total_ms * 1e-3) / 1e12 if total_ms > 0 else math.nan
        per_step = st.tflops.to_numpy(float)
        rows = [dict(quantity="achieved", dtype=dtype, tflops=achieved, pct=None, reference="", samples=per_step)]
        peak_meas = ceilings.matmul(dtype) if ceilings is not None else None
        if peak_meas:
            rows.append(
                dict(
                    quantity="measured matmul ceiling",
                    dtype=dtype,
                    tflops=peak_meas,
                    pct=100 * achieved / peak_meas,
                    reference="lab_utils.core.ceilings",
                    samples=100 * per_step / peak_meas,
                )
            )
        if datasheet is not None:
            # fp32 matmuls run with TF32 off here (lab_utils.core.ceilings measures "fp32" that way),
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
                        samples=100 * per_step / ds,
                    )
                )
        return pd.DataFrame(rows)

    def record(
        self, rec, *, variant: str = "profile", ceilings=None, datasheet=None, dtype: str = "fp32", shape: str = ""
    ) -> None:
        """Write the report's numbers as records (one row per number, plus the trace path).
        Every time figure keeps its per-step ``samples`` and their stability verdict."""
        self._record_steps(rec, variant, shape)
        self._record_phases(rec, shape)
        step_total = float(self.steps.step_ms.median())
        self._record_categories(rec, shape, step_total)
        self._record_top_ops(rec, shape, step_total)
        self._record_mfu(rec, variant, shape, ceilings, datasheet, dtype)
        self._record_memory_and_files(rec, variant, shape)

    def _record_steps(self, rec, variant: str, shape: str) -> None:
        """Per step: phase coverage and FLOPs; the step time with its per-step samples."""
        st = self.steps
        for r in st.itertuples():
            rec.add("step", variant, "phase_coverage", 100 * r.coverage, "%", shape=shape, statistic=f"step{r.step}")
            rec.add(
                "step",
                variant,
                "flops",
                r.flops,
                "FLOP",
                shape=shape,
                statistic=f"step{r.step}",
                method=self.flops_source,
            )
        step_v = self.step_verdict
        rec.add(
            "step",
            variant,
            "step_time",
            float(st.amortised_ms.median()),
            "ms",
            shape=shape,
            statistic="median",
            source="torch.profiler ProfilerStep range",
            **_judged(st.amortised_ms, step_v),
            **({"rule": PERIODIC_RULE, "periods": self.periods} if self.periods else {}),
        )

    def _record_phases(self, rec, shape: str) -> None:
        """Each phase's time (and, for a periodic phase, its time per event)."""
        for f in self.phase_figures():
            extra = dict(every=f.every, per_event_ms=f.per_event_ms, events=f.events, rule=PERIODIC_RULE)
            rec.add(
                "phases",
                f.phase,
                "time",
                f.ms,
                "ms",
                shape=shape,
                statistic="median",
                **_judged(f.samples, f.verdict),
                **(extra if f.periodic else {}),
            )
            if f.periodic:
                rec.add(
                    "phases",
                    f.phase,
                    "time_per_event",
                    f.per_event_ms,
                    "ms",
                    shape=shape,
                    statistic="median",
                    samples=list(f.samples) if f.events else None,
                    every=f.every,
                )
        for f in self.nested_phase_figures():
            rec.add(
                "phases", f.phase, "time", f.ms, "ms", shape=shape, statistic="median", within=f.within,
                **_judged(f.samples, f.verdict),
            )  # fmt: skip

    def _record_categories(self, rec, shape: str, step_total: float) -> None:
        """Each category's time per step (median over steps) and its share of the step."""
        a, st = self.analysis, self.steps
        by_step = a.categories_by_step.pivot_table(index="step", columns="category", values="ms", aggfunc="sum")
        for c in a.categories.category:
            x = by_step[c].to_numpy(float) if c in by_step else np.zeros(len(st))
            med = float(np.median(x)) if len(x) else 0.0
            rec.add(
                "categories",
                c,
                "time",
                med,
                "ms",
                shape=shape,
                statistic="median",
                pct_of_step=100 * med / step_total if step_total > 0 else math.nan,
                source=a.source,
                **_judged(x),
                # the step's idle time moves with everything else (an op made faster can raise it)
                **({REPORTED: True} if c == IDLE else {}),
            )

    def _record_top_ops(self, rec, shape: str, step_total: float) -> None:
        """The top ops' time per step, calls per step and share of the step.  Which ops make the
        list is a result: each row says it is one of a top-N list (``top_n``, ``share``)."""
        a, st = self.analysis, self.steps
        ops = a.top_ops_by_step
        for r in a.top_ops.itertuples():
            x = ops[ops.name == r.name].ms.to_numpy(float) if ops is not None else np.asarray([r.ms / len(st)])
            med = float(np.median(x))
            rec.add(
                "top_ops",
                r.name,
                "time",
                med,
                "ms",
                shape=shape,
                statistic="median",
                calls_per_step=r.calls / len(st),
                category=r.category,
                pct_of_step=100 * med / step_total if step_total > 0 else math.nan,
                **_judged(x),
                **{TOP_N: a.top_n, SHARE: med / step_total if step_total > 0 else math.nan},
            )

    def _record_mfu(self, rec, variant: str, shape: str, ceilings, datasheet, dtype: str) -> None:
        """Achieved TFLOP/s and % of each peak, their samples judged as the step time's."""
        step_v = self.step_verdict
        for r in self.mfu(ceilings, datasheet, dtype).itertuples():
            judged = dict(
                samples=list(r.samples), stable=step_v.stable, stability=f"from the step time's: {step_v.reason}"
            )
            value = r.tflops if r.quantity == "achieved" else r.pct
            if not math.isfinite(value):  # no rate (steps of no time): no samples, no verdict
                judged = {}
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
                    formula="sum(flops) / sum(amortised step time)",
                    **judged,
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
                    **judged,
                )

    def _record_memory_and_files(self, rec, variant: str, shape: str) -> None:
        """Peak memory (profiler events, and CUDA's own counter) and the trace / memory files."""
        a = self.analysis
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


def _judged(samples: Sequence[float], verdict: Stability | None = None) -> dict:
    """``samples`` / ``stable`` / ``stability`` of a time figure: its per-step samples judged by
    the timing module's rule.  A figure that is 0 in every step (a category nothing ran in,
    a periodic phase that did not occur) is no timing: no samples, no verdict."""
    x = [float(v) for v in samples]
    if not any(v > 0 for v in x):
        return {}
    v = verdict or judge_samples(x)
    return dict(samples=x, stable=v.stable, stability=v.reason)


def _record_artifact(rec, variant: str, metric: str, path: Path, fmt: str) -> None:
    """A file the profile wrote, as a record of its size with its path and format."""
    rec.add("artifacts", variant, metric, path.stat().st_size, "bytes", statistic="file", path=str(path), format=fmt)


def step_flops(step: StepFactory, batches: list) -> tuple[list[int], str]:
    """FLOPs of one forward + backward for each of ``batches`` and where the figure comes from:
    the step's own ``flops(batch)`` (perflab's MMDiT: counted on a meta copy at each batch's
    shape), else ``FlopCounterMode`` over one real forward + backward of the step's batch 1 (the
    step's shape taken as fixed)."""
    if step.flops is not None:
        return [int(step.flops(b)) for b in batches], getattr(step.flops, "method", "the step's flops(batch)")
    batch = step.make_batch(1)
    step.optimizer.zero_grad(set_to_none=True)
    total, _ = count_flops(lambda: step.loss(step.model, batch).backward())
    step.optimizer.zero_grad(set_to_none=True)
    return [int(total)] * len(batches), "FlopCounterMode over one forward + backward"


def step_phase_names(step: StepFactory) -> tuple[str, ...]:
    """The named ranges of a step's profile: the contract's phases, the factory's own, its periodic ones."""
    return tuple(dict.fromkeys([*STEP_PHASES, *step.phases, *(p.name for p in step.periodic)]))


def profile_step(
    step: StepFactory,
    *,
    active: int = 3,
    warmup: int = 1,
    start: int = 0,
    out_dir: str | Path | None = None,
    name: str = "01_training_step",
    memory: bool = True,
    record_shapes: bool = False,
) -> ProfileReport:
    """Profile ``warmup + active`` steps of ``step`` (:func:`lab_utils.step.contract.run_step`
    on batches ``start``, ``start + 1``, ...: from batch 0, as a run starts) and analyse the active
    ones (``record_shapes``: operators' input shapes in the trace, for lab 09's per-op roofline)."""
    check_schedule(active, warmup)
    out = Path(out_dir) if out_dir is not None else artifacts_dir() / "traces"
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    trace_path = out / f"{name}-{stamp}.trace.json"
    dev = step.device
    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    notes, batches = [], []

    def on_ready(prof):
        prof.export_chrome_trace(str(trace_path))

    if cuda and memory:
        torch.cuda.reset_peak_memory_stats(dev)
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        with (
            quiet_stderr_fd(),  # kineto's profiler_start/stop markers, on every profiled region
            profile(
                activities=acts,
                schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
                profile_memory=memory,
                record_shapes=record_shapes,
                on_trace_ready=on_ready,
            ) as prof,
        ):
            for k in range(start, start + warmup + active):
                batches.append(skeleton(run_step(step, k).batch))  # shapes only: nothing kept alive
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
            peak = float(torch.cuda.max_memory_allocated(dev))
    analysis = analyse_trace(trace_path, "cuda" if cuda else "cpu", phases=step_phase_names(step))
    flops, source = step_flops(step, batches[-active:])
    periods = {p.name: p.every for p in step.periodic if p.every > 1}
    count = step.capabilities.get("tokens")
    tokens = [float(count(b)) for b in batches[-active:]] if count is not None else []
    return ProfileReport(
        analysis, trace_path, flops, snap_path, html_path, peak, notes, periods, flops_source=source, tokens=tokens
    )


def check_schedule(active, warmup) -> None:
    """The profiled steps (``steps`` >= 1) and the warm-up (``warmup_steps`` >= 0), as the labs name them."""
    for p, v in (("steps", active), ("warmup_steps", warmup)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if p == "steps" else 0):
            raise ConfigError(p, v, "an integer >= " + ("1" if p == "steps" else "0"))


def profile_training(trainer: Trainer, **kwargs) -> ProfileReport:
    """:func:`profile_step` on a trainer's step (:meth:`~lab_utils.model.train.Trainer.as_step`), from
    its next step on; the trainer counts the steps profiled."""
    check_schedule(kwargs.get("active", 3), kwargs.get("warmup", 1))
    kwargs.setdefault("start", trainer.step_index)
    rep = profile_step(trainer.as_step(), **kwargs)
    trainer.step_index += kwargs.get("warmup", 1) + kwargs.get("active", 3)
    return rep


__all__ = [
    "CATEGORIES",
    "IDLE",
    "PERIODIC_RULE",
    "PhaseFigure",
    "ProfileReport",
    "TraceAnalysis",
    "analyse_trace",
    "categorize",
    "count_flops",
    "periodic_note",
    "phase_figure",
    "profile_step",
    "profile_training",
    "step_flops",
    "step_phase_names",
    "training_step_flops",
]
