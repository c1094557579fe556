"""The one-command GPU check: correctness of every Triton kernel and the figures that matter, in minutes.

Run on a GPU machine that has little more than torch, triton and pandas (no Jupyter, papermill,
holoviews, diffusers, transformers or torchao are imported; the repository need not be installed):

    python3 benchmarks/gpu_check.py                       # every section, ~8 min on one H200
    python3 benchmarks/gpu_check.py --sections fused,fp8   # a subset
    python3 benchmarks/gpu_check.py --device cpu           # tiny sizes, Triton through the interpreter
    TRITON_INTERPRET=1 python3 benchmarks/gpu_check.py --device cpu   # the same on a GPU machine
    python3 benchmarks/gpu_check.py --from-records DIR --update-readme   # re-print / re-table a finished run

Sections (each guarded: one that raises is recorded as failed and the others still run):

* ``ceilings``: device-to-device copy (bytes read + written) and the bf16 / fp8 (``_scaled_mm``,
  e4m3, per-tensor scales) matmul throughput, measured now (``lab_utils.core.ceilings``).
* ``fused``: every Triton fused op of ``lab_kernels`` checked forward and backward against
  float64 at flux-dev widths with an irregular token count (4096 + 512 + 7), then timed (GB/s,
  % of the measured copy ceiling) beside eager and ``torch.compile`` (``lab_utils.fused.ops``);
  Liger-Kernel's variant of each op it implements is checked and timed beside them.
* ``attention``: the Triton flash attention checked forward and backward (full, causal, varlen)
  against float64 beside SDPA's flash and cuDNN backends, then each timed forward and backward
  at 4k / 8k / 16k tokens, 24 heads x 128 (TFLOP/s from ``lab_utils.attention.masks.attention_flops``,
  % of the measured bf16 matmul ceiling).
* ``fp8``: ``torch._scaled_mm`` (e4m3, per-tensor and row-wise scales) and the Triton FP8 GEMM
  (bf16 written by each kernel; precise and fast accumulation, each asked of both sides alike)
  checked against float64 of the dequantized operands within ``fp8_gemm_tolerance(K, mode)``, and
  timed beside bf16 at 4096^3, 8192^3.
* ``torchao``: torchao's float8 training (tensorwise, rowwise) on a FLUX-width MLP checked against
  float64, then timed beside bf16, each compiled (``benchmarks/gpu_check_peers.py``; refused with
  the reason where torchao is absent or the GPU has no float8 matmuls).
* ``train``: a few training steps of the ``medium`` MMDiT (synthetic batch: no encoder library)
  eager, compiled, and each replayed as one CUDA graph: phases (torch.profiler), step time,
  MFU and peak memory; where a CUDA graph cannot be captured the reason is recorded.

Budget (``--budget-s``): each section gets its share (``SHARES``; time a section leaves unspent
carries over to the next) and is checked between items: an item that starts in time runs to its
end, later ones are skipped and listed as such in the summary.  Each section runs every
correctness check first, outside the budget: only timings are skipped when time runs out.  The
fallback ceilings (``--sections`` without ``ceilings``) are measured before any section's clock
starts.  The plan section measures no compile lever and stops between two measurements.  Progress lines carry the time
since the start.

Method: every timing goes through ``lab_utils.core.timing`` (first call, i.e. compilation and
autotuning, outside the statistics; median with p20/p80; samples kept).  Triton is never
timed on CPU (the interpreter): such rows say "not timed: interpreted".  Checks draw their
inputs from ``--seed`` (printed; 0 unless given, so that recorded error figures compare
between runs) and fail the run: exit code 1 when any correctness check failed, 2 when a
section raised but no check failed, 0 otherwise.  Targets are benchmarks, not tests: a missed
target is reported as MISSED and does not change the exit code.

Output (``--out``, default ``benchmarks/results/gpu_check-<kind>-<date>``): ``records.json``
(+ ``records.parquet`` when pyarrow is present) in the layout of a ``perflab run`` report
(context columns on every row), ``context.json``, ``status.json`` (one entry per section),
``summary.txt``, all rewritten after every section (a run stopped at a time limit keeps what it
measured; exit code 130 on SIGTERM / Ctrl-C).  Profiler traces (several MB) are analysed and
deleted unless ``--traces DIR`` keeps them there: the result folder stays small.  ``perflab compare``
and ``perflab baseline refresh --report DIR`` read the folder; its device kind is
``cuda-<model>``, e.g. ``cuda-nvidia-h200`` (the baselines folder's name).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Runnable from a bare checkout (no `pip install -e .`): the repository root goes on the path.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, schedule  # noqa: E402

import lab_kernels  # noqa: E402  (sets TRITON_INTERPRET on a machine without a GPU, before Triton loads)
from benchmarks import gpu_check_peers as peers  # noqa: E402  (Liger and torchao beside perflab's own)
from lab_kernels import attention as KA  # noqa: E402
from lab_kernels import (  # noqa: E402
    get_variant,  # noqa: E402
    interpreter_note,
    interpreter_why_not,
    variant_names,
)
from lab_kernels import lowp_matmul as LM  # noqa: E402
from lab_utils.attention import attend as A  # noqa: E402
from lab_utils.attention import masks as MK  # noqa: E402
from lab_utils.core.ceilings import Ceilings, get_ceilings, measure_copy, measure_matmul  # noqa: E402
from lab_utils.core.checks import rel_error  # noqa: E402
from lab_utils.core.config import ConfigError  # noqa: E402
from lab_utils.core.device import annotate, datasheet_for, device_info, pick_device  # noqa: E402
from lab_utils.core.records import CONTEXT_COLUMNS, ROW_COLUMNS, Recorder, load_records  # noqa: E402
from lab_utils.core.session import Session  # noqa: E402
from lab_utils.core.timing import BenchError, try_bench  # noqa: E402
from lab_utils.fused import ops as F  # noqa: E402
from lab_utils.model import build_model, resolve_config  # noqa: E402
from lab_utils.model.train import TrainConfig, compile_blocks, rf_loss, synthetic_batch  # noqa: E402
from lab_utils.plan.planner import measure_step  # noqa: E402
from lab_utils.plan.summary import plan_and_verify  # noqa: E402
from lab_utils.profiling.profiler import analyse_trace, training_step_flops  # noqa: E402

LAB = "gpu_check"
SECTIONS = ("ceilings", "fused", "attention", "fp8", "torchao", "train", "plan")
#: Share of the whole budget each section is planned to take (seconds of 545; scaled to --budget-s):
#: compile time dominates `fused` (7 ops x 2 directions, and Liger's 4 ops) and `train` (the medium MMDiT's
#: blocks); `torchao` compiles three MLPs (bf16 and two float8 recipes).
SHARES = {"ceilings": 25, "fused": 140, "attention": 90, "fp8": 40, "torchao": 40, "train": 170, "plan": 40}
EXIT_OK, EXIT_CHECK_FAILED, EXIT_SECTION_FAILED = 0, 1, 2
EXIT_INTERRUPTED = 130  # SIGTERM / Ctrl-C: the records of the sections done (and of the one stopped) are on disk
README_BEGIN, README_END = "<!-- gpu_check:table:begin -->", "<!-- gpu_check:table:end -->"
INTERPRETED = "not timed: interpreted (Triton on CPU runs in its interpreter: correctness only)"


# ------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Plan:
    """Sizes of one run.  Token counts are irregular on purpose (4096 + 512 + 7)."""

    name: str
    budget_s: float
    reps: int
    item_budget_s: float  # per timed item (first call incl. compilation must fit)
    copy_bytes: int
    matmul_n: int
    matmul_n_fp8: int
    dtype: str  # fused ops and attention
    fused_check: tuple[int, int, int, int]  # batch, tokens, hidden, head_dim
    fused_time: tuple[int, int, int, int]
    fused_directions: tuple[str, ...]
    fused_variants: tuple[str, ...]  # timed beside triton
    attn_heads: int
    attn_head_dim: int
    attn_check_len: int
    attn_check_lengths: tuple[int, ...]  # packed (varlen) check
    attn_seq_lens: tuple[int, ...]
    attn_masks: tuple[str, ...]
    attn_paths: tuple[str, ...]
    attn_varlen_lengths: tuple[int, ...]
    fp8_shapes: tuple[tuple[int, int, int], ...]  # M, K, N
    fp8_fast_accum: tuple[bool, ...]  # accumulation modes, each the same on both sides (_scaled_mm, Triton)
    train_preset: str
    train_batch: int
    train_hw: tuple[int, int]  # pixels
    train_txt_len: int
    train_warmup: int
    train_active: int
    train_reps: int
    train_compile: bool
    skip_notes: dict = field(default_factory=dict)  # variant -> why it is not run with this plan


PLANS = {
    "cuda": Plan(
        name="cuda",
        budget_s=450.0,  # sections only: start-up, CUDA init and writing the records take the rest of 8 min
        reps=20,
        item_budget_s=60.0,
        copy_bytes=1 << 30,
        matmul_n=8192,
        matmul_n_fp8=8192,
        dtype="bfloat16",
        fused_check=(1, 4096 + 512 + 7, 3072, 128),
        fused_time=(4, 4096 + 512 + 7, 3072, 128),
        fused_directions=("fwd", "fwd+bwd"),
        fused_variants=("eager", "compile", "triton", "liger"),
        attn_heads=24,
        attn_head_dim=128,
        attn_check_len=4096 + 512 + 7,
        attn_check_lengths=(1031, 4096 + 512 + 7, 517),
        attn_seq_lens=(4096, 8192, 16384),
        attn_masks=("full", "causal"),
        attn_paths=("triton", "flash", "cudnn"),
        attn_varlen_lengths=(8192 + 7, 4096 + 512, 2048 + 1, 1024 + 3, 509),
        fp8_shapes=((4096, 4096, 4096), (8192, 8192, 8192)),
        fp8_fast_accum=(False, True),
        train_preset="medium",
        train_batch=2,
        train_hw=(1024, 1024),
        train_txt_len=512,
        train_warmup=2,
        train_active=3,
        train_reps=10,
        train_compile=True,
    ),
    "cpu": Plan(
        name="cpu",
        budget_s=200.0,  # 170 s before Liger's checks (interpreted, in the fused section) and torchao's
        reps=3,
        item_budget_s=10.0,
        copy_bytes=8 << 20,
        matmul_n=128,
        matmul_n_fp8=32,  # torch's CPU _scaled_mm with per-tensor scales is very slow
        dtype="bfloat16",
        fused_check=(1, 45, 192, 64),
        fused_time=(1, 45, 192, 64),
        fused_directions=("fwd", "fwd+bwd"),
        fused_variants=("eager", "triton", "liger"),
        attn_heads=2,
        attn_head_dim=64,
        attn_check_len=67,
        attn_check_lengths=(23, 41, 9),
        attn_seq_lens=(80,),
        attn_masks=("full", "causal"),
        attn_paths=("triton", "flash", "cudnn"),
        attn_varlen_lengths=(23, 41, 9),
        fp8_shapes=((72, 96, 40),),
        fp8_fast_accum=(False,),  # neither CPU _scaled_mm nor the interpreter has a fast mode
        train_preset="tiny",
        train_batch=1,
        train_hw=(64, 48),
        train_txt_len=7,
        train_warmup=1,
        train_active=2,
        train_reps=3,
        train_compile=False,
        skip_notes={
            "compile": "not run on cpu by this check: Inductor's C++ build would take most of its time budget",
        },
    ),
}


# ------------------------------------------------------------------------------- run state
class CheckFailed(AssertionError):
    """A correctness check failed (the section goes on; the exit code becomes 1)."""


@dataclass
class Run:
    dev: torch.device
    plan: Plan
    seed: int
    out: Path
    t0: float
    budget_s: float
    traces: Path | None = None  # where profiler traces are kept (None: analysed, then deleted)
    ceilings: Ceilings | None = None
    failures: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # what this machine's stack cannot run, with why
    checks: int = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {msg}", flush=True)


@dataclass
class Section:
    """What a section function gets: the run, its own recorder and its deadline."""

    run: Run
    name: str
    rec: Recorder
    deadline: float  # seconds since the run's start

    @property
    def dev(self) -> torch.device:
        return self.run.dev

    @property
    def plan(self) -> Plan:
        return self.run.plan

    def log(self, msg: str) -> None:
        self.run.log(f"{self.name}: {msg}")

    def over_budget(self, what: str) -> bool:
        """True (and the item recorded as skipped) once the section's time is spent."""
        if self.run.elapsed() < self.deadline:
            return False
        note = f"{self.name}: {what} skipped: over the section's budget ({self.deadline:.0f} s into the run)"
        self.run.skipped.append(note)
        self.log(f"{what}: SKIPPED (over budget)")
        return True

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        """Record one correctness verdict; a failure is kept for the exit code, never hidden."""
        self.run.checks += 1
        if not ok:
            msg = f"{self.name}: {what} FAILED" + (f"\n{detail}" if detail else "")
            self.run.failures.append(msg)
            self.log(msg)
        return ok

    def not_timed(self, experiment: str, variant: str, reason: str, **extra) -> None:
        self.rec.add(experiment, variant, "time", math.nan, "ms", statistic="not_timed", reason=reason, **extra)

    def refuse(self, what: str, reason: str) -> None:
        """Something this machine's software cannot run (not a failed check): said once, with why."""
        note = f"{self.name}: {what}: {reason}"
        if note not in self.run.refused:
            self.run.refused.append(note)
            self.log(f"{what}: REFUSED here: {reason}")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _extra(row: dict) -> dict:
    return json.loads(row["extra"]) if row.get("extra") else {}


# ----------------------------------------------------------------------------- ceilings
def section_ceilings(s: Section) -> None:
    """Copy bandwidth and bf16 / fp8 matmul throughput, measured now."""
    dev, p = s.dev, s.plan
    copy_gbs, moved = measure_copy(dev, p.copy_bytes)
    s.rec.add(
        "ceilings",
        "copy",
        "bandwidth",
        copy_gbs,
        "GB/s",
        shape=f"{p.copy_bytes}B",
        statistic="median",
        formula="(bytes read + bytes written) / time",
        bytes=moved,
    )
    s.log(f"copy {copy_gbs:.1f} GB/s ({p.copy_bytes / 2**20:.0f} MiB buffer)")
    tflops, ns, unsupported = {}, {}, {}
    for k, n in (("bf16", p.matmul_n), ("fp8", p.matmul_n_fp8)):
        try:
            tflops[k] = measure_matmul(k, dev, n)
            ns[k] = n
        except (BenchError, RuntimeError, NotImplementedError, TypeError) as e:
            unsupported[k] = f"not measured here: {str(e).splitlines()[0][:200]}"
            s.rec.add(
                "ceilings", "matmul", "throughput", math.nan, "TFLOP/s", dtype=k, statistic="failed", reason=str(e)
            )
            s.log(f"matmul {k}: {unsupported[k]}")
            continue
        s.rec.add(
            "ceilings",
            "matmul",
            "throughput",
            tflops[k],
            "TFLOP/s",
            shape=(n, n, n),
            dtype=k,
            statistic="median",
            formula="2 n^3 / time",
        )
        s.log(f"matmul {k} {n}^3: {tflops[k]:.4g} TFLOP/s")
    s.run.ceilings = Ceilings(
        device=device_info(dev).as_dict(),
        copy_gbs=copy_gbs,
        copy_bytes=moved,
        matmul_tflops=tflops,
        matmul_n=ns,
        unsupported=unsupported,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        seconds_to_measure=s.run.elapsed(),
        quick=s.dev.type == "cpu",
    )
    s.rec.ceilings = s.run.ceilings


# -------------------------------------------------------------------------------- fused ops
def section_fused(s: Section) -> None:
    """Every Triton fused op: fwd + bwd against float64, then GB/s beside eager / compile."""
    dev, p = s.dev, s.plan
    dt = F.as_dtype(p.dtype)
    pc, pt = F.Problem(*p.fused_check), F.Problem(*p.fused_time)
    timed = [v for v in p.fused_variants if get_variant("rms_norm", v).timeable(dev)]  # Triton kinds: GPU only
    copy = s.run.ceilings.copy_gbs if s.run.ceilings else None
    for op in F.OP_NAMES:  # every correctness check first: checks are never under the budget
        _fused_check(s, op, dt, pc)
        peers.liger_check(s, op, dt, pc)
    for op in F.OP_NAMES:  # what is not timed here, and why: rows whatever the budget leaves
        for variant in p.fused_variants:
            if variant not in timed and variant in variant_names(op):  # liger: only the ops it implements
                s.not_timed("fused_time", variant, INTERPRETED, op=op)
        for variant, why in p.skip_notes.items():
            s.not_timed("fused_time", variant, why, op=op)
    for op in F.OP_NAMES:
        if s.over_budget(f"{op} timings"):
            continue
        for direction in p.fused_directions:
            if s.over_budget(f"{op} {direction} timing"):
                continue
            first = len(s.rec.rows)
            F.sweep(
                F.OpGrid([op], [pt], [dt], [direction], timed),
                Session(dev, s.rec),
                reps=p.reps,
                budget_s=p.item_budget_s,
                experiment="fused_time",
            )
            parts, method = [], ""
            for row in list(s.rec.rows[first:]):
                ex = _extra(row)
                if row["metric"] == "time" and row["statistic"] == "failed":
                    parts.append(f"{row['variant']} failed ({ex.get('reason', '')[:80]})")
                if row["metric"] == "time" and row["statistic"] == "median":
                    method = ex.get("method", "")
                if row["metric"] != "bandwidth" or not copy:
                    continue
                pct = 100 * row["value"] / copy
                s.rec.add(
                    "fused_time",
                    row["variant"],
                    "pct_of_copy_ceiling",
                    pct,
                    "%",
                    shape=row["shape"],
                    dtype=row["dtype"],
                    statistic="median",
                    formula="GB/s / measured copy GB/s",
                    op=op,
                    direction=direction,
                    copy_gbs=copy,
                    method=method,  # how the time was taken: CUDA graph replay, or calls per sample
                )
                parts.append(f"{row['variant']} {row['value']:.0f} GB/s ({pct:.0f}%)")
            s.log(f"{op} {direction} {pt.label()}: " + (", ".join(parts) or "no timed variant"))


def _fused_check(s: Section, op: str, dt: torch.dtype, pc) -> None:
    """The op's Triton variant forward and backward (every gradient) against float64."""
    unusable = _interpreter_why_not(s.dev)
    why = unusable or get_variant(op, "triton").why_not(s.dev, dt, **F.spec(op).problem_kw(pc))
    if why:
        s.rec.add(
            "fused_check", "triton", "max_abs_err", math.nan, "", dtype=dt, statistic="not_run", op=op, reason=why
        )
        if unusable:  # this machine's triton + numpy cannot interpret any kernel: refused, not failed
            s.refuse("Triton kernels' checks", unusable)
            return
        # on a GPU the Triton kernel must run at these widths; on CPU it needs the interpreter
        if s.dev.type == "cuda" or lab_kernels.TRITON_INTERPRETED:
            s.check(False, f"{op} triton cannot run the check problem", why)
        else:
            s.log(f"{op} triton not checked: {why} (start with TRITON_INTERPRET=1 to check it on CPU)")
        return
    rows = F.check_variant(op, "triton", dt, pc, device=s.dev, seed=s.run.seed)
    for r in rows:
        s.rec.add(
            "fused_check",
            "triton",
            "max_abs_err",
            r.max_abs,
            "",
            shape=r.shape,
            dtype=dt,
            statistic="max",
            op=op,
            tensor=r.tensor,
            ok=r.ok,
            n_bad=r.n_bad,
            seed=r.seed,
        )
    bad = [r for r in rows if not r.ok]
    worst = max(rows, key=lambda r: r.max_rel if math.isfinite(r.max_rel) else math.inf)
    if s.check(not bad, f"{op} triton fwd+bwd vs float64 at {rows[0].shape}", "\n".join(r.message for r in bad)):
        s.log(f"{op} triton fwd+bwd ok at {rows[0].shape} ({len(rows)} tensors, worst {worst.tensor})")


def _interpreter_why_not(dev: torch.device) -> str | None:
    """Why Triton's interpreter cannot run here (probed once; None on a GPU or when it works)."""
    if dev.type != "cpu" or not lab_kernels.TRITON_INTERPRETED:
        return None
    return interpreter_why_not()


# -------------------------------------------------------------------------------- attention
def _attn_flops(mask: str, lengths, heads: int, head_dim: int) -> tuple[float, float]:
    """(fwd, bwd) FLOPs of self-attention over these sequences (one convention: lab_utils.attention.masks)."""
    fwd = bwd = 0.0
    for n in lengths:
        f = MK.attention_flops(MK.causal() if mask == "causal" else MK.full(), 1, heads, n, n, head_dim)
        fwd, bwd = fwd + f.fwd, bwd + f.bwd
    return fwd, bwd


def varlen_fn(path: str, lengths, cu: torch.Tensor) -> Callable:
    """``run(q, k, v)``: attention of packed sequences of these ``lengths`` on ``path``, with every
    check done before (``A.check_inputs`` once): no call reads ``cu_seqlens`` back from the device
    (a ``.tolist()`` is a synchronisation, and ``attend`` made several per call).  The Triton
    kernel takes the validated ``max_seqlen``; SDPA paths run per sequence on host-side bounds."""
    if path == "triton":
        longest = max(lengths)
        return lambda q, k, v: KA.attention(q, k, v, cu_seqlens=cu, max_seqlen=longest, validate=False)
    fn = A.get_path(path).fn
    bounds = [0, *itertools.accumulate(int(n) for n in lengths)]

    def run(q, k, v):
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            qi, ki, vi = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # 1 H l Dh
            outs.append(fn(qi, ki, vi, None, None)[0].transpose(0, 1))  # mask None: full, scale None: 1/sqrt(Dh)
        return torch.cat(outs, 0)

    return run


def _attn_timing(s: Section, path: str, q, k, v, do, *, mask=None, run=None, shape: str, extra: dict, flops):
    """Time one path forward and backward; rows with TFLOP/s and % of the measured bf16 ceiling.
    ``run(q, k, v)`` replaces ``attend`` (a packed problem, validated beforehand)."""
    parts = []
    if run is None:

        def run(a, b, c):
            return A.attend(a, b, c, path=path, mask=mask)

    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    peak = s.run.ceilings.matmul("bf16") if s.run.ceilings else None
    for direction, fl in (("fwd", flops[0]), ("bwd", flops[1])):
        if direction == "fwd":

            def fn():
                with torch.no_grad():
                    return run(q, k, v)
        else:
            out = run(qq, kk, vv)

            def fn(out=out):
                return torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)

        t = try_bench(
            fn, name=f"attention/{path}/{direction}", device=s.dev, reps=s.plan.reps, budget_s=s.plan.item_budget_s
        )
        s.rec.add_timing("attention_time", path, t, shape=shape, dtype=q.dtype, flops=fl, direction=direction, **extra)
        if not t.ok:
            parts.append(f"{path} {direction} failed: {t.reason[:80]}")
            continue
        tf = fl / (t.median_ms * 1e-3) / 1e12
        if peak:
            s.rec.add(
                "attention_time",
                path,
                "pct_of_bf16_matmul",
                100 * tf / peak,
                "%",
                shape=shape,
                dtype=q.dtype,
                statistic="median",
                formula="attention FLOPs / time / measured bf16 matmul TFLOP/s",
                direction=direction,
                bf16_tflops=peak,
                **extra,
            )
        parts.append(f"{path} {direction} {tf:.4g} TFLOP/s" + (f" ({100 * tf / peak:.0f}%)" if peak else ""))
    return parts


def section_attention(s: Section) -> None:
    """Triton flash attention vs SDPA flash / cuDNN: float64 checks, then fwd and bwd timings."""
    dev, p = s.dev, s.plan
    dt = F.as_dtype(p.dtype)
    H, D = p.attn_heads, p.attn_head_dim
    cases = [(m, None) for m in p.attn_masks] + [("varlen", p.attn_check_lengths)]
    unusable = _interpreter_why_not(dev)
    for case, lengths in cases:  # every correctness check first: checks are never under the budget
        L = p.attn_check_len
        inputs = A.random_qkv(
            len(lengths) if lengths else 1,
            H,
            max(lengths) if lengths else L,
            D,
            dtype=dt,
            device=dev,
            seed=s.run.seed,
            lengths=list(lengths) if lengths else None,
        )
        shape = f"T{sum(lengths)}xH{H}xD{D}" if lengths else f"B1xH{H}xL{L}xD{D}"
        mask = None if lengths else case
        for path in p.attn_paths:
            if path == "triton" and unusable:
                s.refuse("Triton attention's checks", unusable)
                continue
            try:
                res = A.check_path(path, inputs, mask=mask, backward=True)
            except Exception as e:  # noqa: BLE001 - one path's refusal must not lose the section's other checks
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                s.rec.add(
                    "attention_check", path, "max_abs_err", math.nan, "", shape=shape, dtype=dt,
                    statistic="raised", mask=case, seed=s.run.seed, reason=reason,
                )  # fmt: skip
                if path == "triton":  # the kernel this lab owns must run every check it is given
                    s.check(False, f"triton {case} {shape} check raised", reason)
                else:
                    s.log(f"check {case} {path}: raised, not checked ({reason[:120]})")
                continue
            ran = [r for r in res if r.ok is not None]
            for r in res:
                s.rec.add(
                    "attention_check",
                    path,
                    "max_abs_err",
                    r.max_abs,
                    "",
                    shape=shape,
                    dtype=dt,
                    statistic="max" if r.ok is not None else "skipped",
                    mask=case,
                    tensor=r.tensor,
                    ok=r.ok,
                    seed=s.run.seed,
                    note=r.note.splitlines()[0][:200] if r.note else "",
                )
            if path == "triton" and (dev.type == "cuda" or lab_kernels.TRITON_INTERPRETED):
                # the kernel this lab owns must run every check it is given (on CPU: in the interpreter)
                s.check(
                    len(ran) == len(res),
                    f"triton {case} ran every check",
                    "; ".join(r.note for r in res if r.ok is None),
                )
            if not ran:
                s.log(f"check {case} {path}: not available ({res[0].note.splitlines()[0][:90]})")
                continue
            bad = [r for r in ran if not r.ok]
            if s.check(not bad, f"{path} {case} {shape} vs float64", "\n".join(r.note for r in bad)):
                s.log(f"check {case} {path} {shape}: {', '.join(r.tensor for r in ran)} ok")
        del inputs
    g = torch.Generator(device=dev).manual_seed(s.run.seed)
    for L in p.attn_seq_lens:
        if s.over_budget(f"timing L={L}"):
            continue
        q, k, v, do = (torch.randn(1, H, L, D, generator=g, device=dev, dtype=dt) for _ in range(4))
        shape = f"B1xH{H}xL{L}xD{D}"
        for mask in p.attn_masks:
            flops = _attn_flops(mask, [L], H, D)
            for path in p.attn_paths:
                extra = dict(mask=mask, seq_len=L, head_dim=D, heads=H)
                why = A.get_path(path).why_not(
                    device=dev, dtype=dt, mask=mask, layout="bhld", head_dim=D, lq=L, lk=L, backward=True
                )
                if path == "triton" and dev.type == "cpu":
                    why = INTERPRETED
                if why:
                    s.not_timed("attention_time", path, why, **extra)
                    continue
                parts = _attn_timing(s, path, q, k, v, do, mask=mask, shape=shape, extra=extra, flops=flops)
                s.log(f"L={L} {mask}: " + "; ".join(parts))
        del q, k, v, do
    lengths = p.attn_varlen_lengths
    if not s.over_budget("varlen timing"):
        T = sum(lengths)
        q, k, v, do = (torch.randn(T, H, D, generator=g, device=dev, dtype=dt) for _ in range(4))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        shape = f"T{T}xH{H}xD{D}"
        flops = _attn_flops("full", lengths, H, D)
        A.check_inputs(q, k, v, cu_seqlens=cu)  # validated once, here: the timed calls read nothing back
        for path in p.attn_paths:
            extra = dict(mask="varlen", seq_len=max(lengths), head_dim=D, heads=H, lengths=list(lengths))
            why = A.get_path(path).why_not(
                device=dev, dtype=dt, mask="full", layout="packed", head_dim=D, backward=True
            )
            if path == "triton" and dev.type == "cpu":
                why = INTERPRETED
            if why:
                s.not_timed("attention_time", path, why, **extra)
                continue
            run = varlen_fn(path, lengths, cu)
            parts = _attn_timing(s, path, q, k, v, do, run=run, shape=shape, extra=extra, flops=flops)
            s.log(f"varlen {lengths}: " + "; ".join(parts))


# -------------------------------------------------------------------------------- fp8 GEMMs
def _dequant_reference(da, db, sa, sb) -> torch.Tensor:
    """float64 (da * sa) @ (db * sb)^T for fp8 operands and per-tensor or per-row multipliers."""
    a = da.double() * (sa.double().reshape(-1, 1) if sa.numel() > 1 else sa.double().reshape(()))
    b = db.double() * (sb.double().reshape(-1, 1) if sb.numel() > 1 else sb.double().reshape(()))
    return a @ b.t()


def section_fp8(s: Section) -> None:
    """_scaled_mm (tensor / row scales) and the Triton FP8 GEMM beside bf16, each accumulation mode
    on both sides alike (``fast_accum`` = ``_scaled_mm(use_fast_accum=...)``): every check first,
    then the timings under the budget."""
    cases = [_Fp8Case(s, M, K, N, fast) for M, K, N in s.plan.fp8_shapes for fast in s.plan.fp8_fast_accum]
    for c in cases:  # every correctness check first: checks are never under the budget
        c.check()
    t_bf16: dict = {}
    for c in cases:
        if not s.over_budget(f"{c.M}x{c.K}x{c.N}{c.suffix} timings"):
            c.time(t_bf16)


class _Fp8Case:
    """One (shape, accumulation mode): operands quantized once, checked against float64, then timed."""

    fmt, out = "fp8_e4m3", torch.bfloat16

    def __init__(self, s: Section, M: int, K: int, N: int, fast: bool):
        self.s, self.M, self.K, self.N, self.fast = s, M, K, N, fast
        self.suffix = "+fast_accum" if fast else ""
        self.shape, self.flops = (M, K, N), 2.0 * M * K * N
        self.tol = LM.fp8_gemm_tolerance(K, fast_accum=fast, out_dtype=self.out)
        g = torch.Generator(device=s.dev).manual_seed(s.run.seed)
        self.a = torch.randn(M, K, generator=g, device=s.dev)
        self.b = torch.randn(N, K, generator=g, device=s.dev) / math.sqrt(K)
        self.runs: dict[str, Callable] = {}  # variant -> the GEMM alone, on prepared operands

    def extra(self, gran: str) -> dict:
        return dict(fmt=self.fmt, granularity=gran, fast_accum=self.fast)

    def check(self) -> None:
        s, fmt, out = self.s, self.fmt, self.out
        triton_v = get_variant("lowp_matmul", "triton")
        for gran in ("tensor", "row"):
            ex, name = self.extra(gran), f"scaled_mm/{gran}{self.suffix}"
            why = LM.scaled_mm_why_not(s.dev, fmt=fmt, granularity=gran, out_dtype=out)
            if why:
                s.rec.add("fp8_gemm", name, "time", math.nan, "ms", statistic="n/a", reason=why, **ex)
                s.log(f"{name}: n/a ({why[:160]})")
            else:
                pr = LM.prepare_scaled_mm(self.a, self.b, fmt, granularity=gran)

                def sm(pr=pr, gran=gran):
                    return LM.scaled_mm(
                        self.a, self.b, fmt, granularity=gran, out_dtype=out, use_fast_accum=self.fast, prepared=pr
                    )

                self._check(name, sm(), _dequant_reference(*pr[1:]), ex)
                self.runs[name] = sm
            name = f"triton/{gran}{self.suffix}"
            why = triton_v.why_not(s.dev, fmt=fmt, granularity=gran) or _interpreter_why_not(s.dev)
            if why:
                s.rec.add("fp8_gemm", name, "time", math.nan, "ms", statistic="n/a", reason=why, **ex)
                if _interpreter_why_not(s.dev):
                    s.refuse("the Triton FP8 GEMM's checks", why)
                continue
            pa = LM.prepare_scaled_mm_any(self.a, self.b, fmt, granularity=gran)

            def tr(pa=pa):
                return LM.triton_fp8_matmul(pa[1], pa[2], pa[3], pa[4], out_dtype=out, fast_accum=self.fast)

            self._check(name, tr(), _dequant_reference(*pa[1:]), ex)
            if triton_v.timeable(s.dev):
                self.runs[name] = tr
            else:
                s.not_timed("fp8_gemm", name, INTERPRETED, **ex)

    def _check(self, variant: str, y: torch.Tensor, ref: torch.Tensor, extra: dict) -> None:
        s = self.s
        ok_dtype = y.dtype == self.out  # the kernel stores bf16 itself: a float32 result would be cast after
        err = rel_error(y.float(), ref) if bool(torch.isfinite(y).all()) else math.inf
        s.rec.add(
            "fp8_check",
            variant,
            "rel_error",
            err,
            "",
            shape=self.shape,
            dtype="float8_e4m3fn",
            statistic="value",
            formula="||y - ref||_F / ||ref||_F, ref = float64 of the dequantized operands",
            tolerance=self.tol,
            tolerance_formula="lab_kernels.lowp_matmul.fp8_gemm_tolerance(K, fast_accum, bf16 out)",
            out_dtype=str(y.dtype).replace("torch.", ""),
            seed=s.run.seed,
            **extra,
        )
        s.check(
            ok_dtype and err <= self.tol,
            f"{variant} {self.shape} vs float64 (rel error {err:.3g}, tolerance {self.tol:.3g} at K={self.K}; "
            f"output {y.dtype}, expected {self.out})",
        )

    def time(self, t_bf16: dict) -> None:
        s, p, dev, shape, flops = self.s, self.s.plan, self.s.dev, self.shape, self.flops
        if shape not in t_bf16:
            ab, bb = self.a.bfloat16(), self.b.bfloat16()
            t_bf16[shape] = try_bench(
                lambda: torch.mm(ab, bb.t()), name="bf16 mm", device=dev, reps=p.reps, budget_s=p.item_budget_s
            )
            s.rec.add_timing("fp8_gemm", "bf16", t_bf16[shape], shape=shape, dtype="bfloat16", flops=flops)
        tb = t_bf16[shape]
        parts = [_tflops_text("bf16", tb, flops)]
        for gran in ("tensor", "row"):
            ex = self.extra(gran)
            sm_name, tr_name = f"scaled_mm/{gran}{self.suffix}", f"triton/{gran}{self.suffix}"
            t_sm = t_tr = None
            for name in (sm_name, tr_name):
                if name not in self.runs:
                    continue
                t = try_bench(self.runs[name], name=name, device=dev, reps=p.reps, budget_s=p.item_budget_s)
                s.rec.add_timing("fp8_gemm", name, t, shape=shape, dtype=self.fmt, flops=flops, **ex)
                parts.append(_tflops_text(name, t, flops))
                t_sm, t_tr = (t, t_tr) if name == sm_name else (t_sm, t)
            if t_sm is not None and t_sm.ok and tb.ok:
                s.rec.add(
                    "fp8_gemm", sm_name, "speedup_vs_bf16", tb.median_ms / t_sm.median_ms, "x", shape=shape,
                    dtype=self.fmt, statistic="median", formula="bf16 median / _scaled_mm median", **ex,
                )  # fmt: skip
            if t_tr is not None and t_tr.ok and t_sm is not None and t_sm.ok:
                s.rec.add(
                    "fp8_gemm", tr_name, "vs_scaled_mm", t_sm.median_ms / t_tr.median_ms, "x", shape=shape,
                    dtype=self.fmt, statistic="median",
                    formula="_scaled_mm median / Triton median (throughput ratio, same scales and accumulation)",
                    **ex,
                )  # fmt: skip
        s.log(f"{self.M}x{self.K}x{self.N}{self.suffix}: " + "; ".join(parts))


def _tflops_text(name: str, t, flops: float) -> str:
    if not t.ok:
        return f"{name} failed ({t.reason[:60]})"
    return f"{name} {flops / (t.median_ms * 1e-3) / 1e12:.4g} TFLOP/s"


# ------------------------------------------------------------------------------- train step
PHASES = ("forward", "backward", "optimizer")


class SyntheticStep:
    """One rectified-flow step of the MMDiT on a fixed synthetic batch (no encoders, no loader):
    forward under bf16 autocast, backward, gradient clipping, AdamW.  Phases are named ranges
    (torch profiler and NVTX); ``sync`` ends each phase with a device synchronisation so that a
    phase's range covers the GPU work it launched."""

    def __init__(self, model, batch, opt, dev: torch.device, *, sync: bool):
        self.model, self.batch, self.opt, self.dev, self.sync = model, batch, opt, dev, sync
        self.loss: torch.Tensor | None = None

    def _end(self):
        if self.sync:
            _sync(self.dev)

    def body(self, zero_grad: bool = True) -> torch.Tensor:
        # cache_enabled=False: autocast's weight-cast cache must not outlive a CUDA graph capture
        with annotate("forward", self.dev):
            with torch.autocast(self.dev.type, dtype=torch.bfloat16, cache_enabled=False):
                loss = rf_loss(self.model, self.batch)
            self._end()
        with annotate("backward", self.dev):
            loss.backward()
            self._end()
        with annotate("optimizer", self.dev):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            if zero_grad:
                self.opt.zero_grad(set_to_none=True)
            self._end()
        self.loss = loss.detach()
        return self.loss

    def __call__(self) -> torch.Tensor:
        return self.body()


def graphs_available(dev: torch.device) -> bool:
    """Whether a training step can be captured as a CUDA graph on this device."""
    return dev.type == "cuda"


def _capture_graph(step: SyntheticStep, dev: torch.device):
    """Capture one whole step (forward, backward, clipping, AdamW) as a CUDA graph; warm-up runs
    on a side stream first, as capture requires.  Returns (graph, the static loss tensor)."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            step.body()
    torch.cuda.current_stream(dev).wait_stream(side)
    step.opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step.body(zero_grad=False)  # grads are allocated inside the capture; replays overwrite them
    return graph, loss


def section_train(s: Section) -> None:
    """The medium MMDiT's training step: eager, compiled, each with and without a CUDA graph."""
    dev, p = s.dev, s.plan
    cuda = dev.type == "cuda"
    mcfg = resolve_config(p.train_preset)
    model = build_model(mcfg, dev, torch.float32, seed=s.run.seed).train()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    h, w = p.train_hw
    gen = torch.Generator(device=dev).manual_seed(s.run.seed)
    batch = synthetic_batch(mcfg, p.train_batch, height=h, width=w, txt_len=p.train_txt_len, generator=gen, device=dev)
    flops = training_step_flops(mcfg, p.train_batch, batch.grid, p.train_txt_len)
    shape = f"{p.train_preset}:B{p.train_batch}x{h}x{w}px+txt{p.train_txt_len}"
    bf16_peak = s.run.ceilings.matmul("bf16") if s.run.ceilings else None
    sheet = datasheet_for(device_info(dev).name)
    s.log(f"{shape}: {sum(t.numel() for t in model.parameters()) / 1e9:.3g} B params, {flops / 1e12:.4g} TFLOP/step")
    first_loss: dict[str, float] = {}
    compiled = False
    for variant in ("eager", "eager+cuda_graph", "compile", "compile+cuda_graph"):
        graph = variant.endswith("cuda_graph")
        wants_compile = variant.startswith("compile")
        if wants_compile and not p.train_compile:
            s.not_timed("train_step", variant, p.skip_notes.get("compile", "compile not run with this plan"))
            continue
        if graph and not graphs_available(dev):
            s.not_timed("train_step", variant, "not applicable: CUDA graphs need a CUDA device")
            continue
        if s.over_budget(variant):
            continue
        if wants_compile and not compiled:
            compile_blocks(model)
            compiled = True
        model.load_state_dict(init)
        # a captured step leaves .grad tensors in the graph's private pool (allocated inside the
        # capture, never set to None): the next variant's first backward would add into them
        model.zero_grad(set_to_none=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda, capturable=cuda)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        torch.manual_seed(s.run.seed)
        step = SyntheticStep(model, batch, opt, dev, sync=False)  # no synchronisation may run inside a capture
        if graph:
            try:
                g, static_loss = _capture_graph(step, dev)
            except Exception as e:  # noqa: BLE001 - the reason a step cannot be captured is the finding
                reason = f"not applicable: capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                s.not_timed("train_step", variant, reason)
                s.log(f"{variant}: {reason}")
                del opt, step
                continue
            g.replay()
            s.check(bool(torch.isfinite(static_loss).all()), f"{variant}: replayed loss is finite")
            t = try_bench(g.replay, name=variant, device=dev, reps=p.train_reps, flush_l2=False, budget_s=120.0)
            phases_note = "one graph replay: phases are not separable"
            trace_rows = None
        else:
            loss0 = float(step())
            first_loss[variant] = loss0
            s.check(math.isfinite(loss0), f"{variant}: first loss is finite ({loss0})")
            for _ in range(p.train_warmup - 1):
                step()
            step.sync = cuda
            trace_rows = _profile_steps(s, step, variant)
            step.sync = False
            t = try_bench(step, name=variant, device=dev, reps=p.train_reps, flush_l2=False, budget_s=120.0)
            phases_note = ""
        s.rec.add_timing(
            "train_step", variant, t, shape=shape, dtype="bfloat16", flops=flops, preset=p.train_preset, autocast="bf16"
        )
        parts = []
        if t.ok:
            ach = flops / (t.median_ms * 1e-3) / 1e12
            parts.append(f"step {t.median_ms:.4g} ms, {ach:.4g} TFLOP/s")
            for ref_name, ref in (
                ("measured bf16 matmul ceiling", bf16_peak),
                ("datasheet bf16", sheet and sheet.bf16_tflops),
            ):
                if ref:
                    s.rec.add(
                        "train_step",
                        variant,
                        "mfu",
                        100 * ach / ref,
                        "%",
                        shape=shape,
                        dtype="bfloat16",
                        statistic="median",
                        reference=ref_name,
                        peak_tflops=ref,
                        formula="model FLOPs per step (fwd+bwd, meta count) / step time / peak",
                    )
                    parts.append(f"MFU {100 * ach / ref:.1f}% of {ref_name}")
        else:
            parts.append(f"failed: {t.reason[:100]}")
        if cuda:
            peak = torch.cuda.max_memory_allocated(dev)
            s.rec.add(
                "train_step",
                variant,
                "peak_memory",
                peak / 2**30,
                "GiB",
                shape=shape,
                statistic="max",
                source="torch.cuda.max_memory_allocated",
            )
            parts.append(f"peak {peak / 2**30:.1f} GiB")
        if trace_rows:
            parts.append(trace_rows)
        if phases_note:
            parts.append(phases_note)
        s.log(f"{variant}: " + "; ".join(parts))
        del step, opt
        if graph:
            del g, static_loss
        model.zero_grad(set_to_none=True)  # nothing of this variant's (graph pool) gradients survives it
    if "eager" in first_loss and "compile" in first_loss:
        le, lc = first_loss["eager"], first_loss["compile"]
        s.rec.add("train_step", "compile", "first_loss_rel_diff_vs_eager", abs(lc - le) / abs(le), "", shape=shape)
        s.check(abs(lc - le) <= 0.05 * abs(le), f"compiled step's first loss {lc:.5g} agrees with eager {le:.5g}")


def _profile_steps(s: Section, step: SyntheticStep, variant: str) -> str:
    """One warm-up and ``train_active`` profiled steps; phases, step time and peak memory from the trace."""
    dev, p = s.dev, s.plan
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    # traces can exceed a few MB: kept only where --traces asks, never in the result folder by default
    keep = s.run.traces is not None
    folder = s.run.traces if keep else Path(tempfile.mkdtemp(prefix="gpu_check-trace-"))
    trace = folder / f"train-{variant}.trace.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    with profile(
        activities=acts,
        schedule=schedule(wait=0, warmup=1, active=p.train_active, repeat=1),
        profile_memory=True,
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace)),
    ) as prof:
        for _ in range(1 + p.train_active):
            step()
            prof.step()
    a = analyse_trace(trace, dev.type)
    shape = f"{p.train_preset}:B{p.train_batch}"
    med = a.phases.groupby("phase", sort=False)["ms"].median() if len(a.phases) else pd.Series(dtype=float)
    for phase, ms in med.items():
        s.rec.add("train_phases", variant, "time", float(ms), "ms", shape=shape, statistic="median", phase=str(phase))
    if len(a.steps):
        s.rec.add(
            "train_phases",
            variant,
            "profiled_step_time",
            float(a.steps.step_ms.median()),
            "ms",
            shape=shape,
            statistic="median",
            samples=[float(x) for x in a.steps.step_ms],
            source="torch.profiler ProfilerStep ranges (phases synchronised)",
        )
    if not math.isnan(a.peak_allocated_bytes):
        s.rec.add(
            "train_phases",
            variant,
            "profiler_peak_allocated",
            a.peak_allocated_bytes / 2**20,
            "MiB",
            shape=shape,
            statistic="max",
            source="profiler [memory] events",
        )
    size = trace.stat().st_size
    if keep:
        s.rec.add("artifacts", variant, "trace_file", size, "bytes", statistic="file", path=str(trace))
    else:
        shutil.rmtree(folder, ignore_errors=True)
        s.rec.add(
            "artifacts", variant, "trace_file", size, "bytes", statistic="deleted", path="",
            note="analysed, then deleted: pass --traces DIR to keep the profiler traces",
        )  # fmt: skip
    return "phases " + ", ".join(f"{k} {v:.4g} ms" for k, v in med.items())


#: lab 08's plan needs the training step's Trainer, which builds the text/image encoders
PLAN_NEEDS = ("transformers", "diffusers")
#: No lever that compiles (``compile``, and ``kernels``, whose options include torch.compile'd
#: ops): a compile takes minutes inside one measurement, which no budget check can interrupt.
PLAN_LEVERS = ("attention_path", "activation_checkpoint")


class PlanOverBudget(Exception):
    """The plan section's budget ran out between two measurements (not a RuntimeError: the
    planner records those as a lever that failed to run and goes on)."""


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def section_plan(s: Section) -> None:
    """A short plan-and-verify of the training step (lab 08's library): measure the step, each
    lever's effect, predict the plans, run the best two and record the prediction error."""
    missing = [m for m in PLAN_NEEDS if not _importable(m)]
    if missing:
        reason = f"the Trainer's encoders need {', '.join(missing)} (carry their wheels to run this section)"
        s.log(f"plan: not run: {reason}")
        s.rec.add("plan", "plan_and_verify", "prediction_error", math.nan, "%", statistic="not_run", reason=reason)
        return
    if s.over_budget("plan_and_verify"):
        s.rec.add(
            "plan", "plan_and_verify", "prediction_error", math.nan, "%", statistic="not_run",
            reason=f"skipped: the section's budget was spent before it started ({s.deadline:.0f} s into the run)",
        )  # fmt: skip
        return
    cuda = s.dev.type == "cuda"
    cfg = TrainConfig(
        preset="small" if cuda else "tiny",
        device=s.dev.type,
        batch_size=2,
        buckets=[[512, 512]] if cuda else [[64, 64]],
        num_samples=8 if cuda else 4,
        autocast="bf16" if cuda else "none",
        encoders="precomputed",
    )
    steps, warmup = (3, 2) if cuda else (2, 1)

    def measure(c: TrainConfig):
        # each measurement is one uninterruptible item: none starts once the budget is spent
        if s.run.elapsed() >= s.deadline:
            raise PlanOverBudget(
                f"the section's budget ({s.deadline:.0f} s into the run) was spent after "
                f"{s.run.elapsed() - t0:.0f} s of measuring steps, before the next measurement"
            )
        return measure_step(c, steps=steps, warmup=warmup, statistic="median")

    t0 = s.run.elapsed()
    try:
        summary = plan_and_verify(cfg, PLAN_LEVERS, steps=steps, warmup=warmup, top=2, measure=measure)
    except PlanOverBudget as e:
        reason = f"skipped: {e}"
        s.run.skipped.append(f"plan: {reason}")
        s.log(f"plan: {reason}")
        s.rec.add("plan", "plan_and_verify", "prediction_error", math.nan, "%", statistic="not_run", reason=reason)
        return
    for v in summary["verified"]:
        s.check(v["seams_match"], f"plan {v['plan']}: the verification ran the predicted configuration")
        s.rec.add(
            "plan",
            v["plan"],
            "prediction_error",
            v["error_pct"],
            "%",
            statistic="value",
            predicted_ms=v["predicted_ms"],
            measured_ms=v["measured_ms"],
            rebased_error_pct=v["rebased_error_pct"],
            stability=v["stability"],
        )
        s.log(
            f"plan {v['plan']}: predicted {v['predicted_ms']:.4g} ms, measured {v['measured_ms']:.4g} ms "
            f"({v['error_pct']:+.1f}%, {v['stability']})"
        )


SECTION_FNS: dict[str, Callable[[Section], None]] = {
    "ceilings": section_ceilings,
    "fused": section_fused,
    "attention": section_attention,
    "fp8": section_fp8,
    "torchao": peers.section_torchao,
    "train": section_train,
    "plan": section_plan,
}


# ---------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class Target:
    key: str
    figure: str
    target: str
    threshold: float
    pick: Callable[[pd.DataFrame], pd.DataFrame]  # rows whose value is held to the threshold
    label: Callable[[pd.Series], str]


def _rows(df: pd.DataFrame, experiment: str, metric: str, **extra) -> pd.DataFrame:
    d = df[(df["experiment"] == experiment) & (df["metric"] == metric) & (df["statistic"] == "median")]
    if not len(d):
        return d
    ex = d["extra"].map(lambda e: json.loads(e) if isinstance(e, str) and e else {})
    keep = ex.map(lambda e: all(_match(e.get(k), v) for k, v in extra.items()))
    return d[keep.astype(bool)].assign(_extra=ex[keep.astype(bool)])


def _match(value, want) -> bool:
    return want(value) if callable(want) else value == want


def _attention_target(direction: str, word: str, floor: float) -> Target:
    """Triton attention on one sequence of >= 8k tokens (full or causal): % of measured bf16 matmul."""
    return Target(
        f"attn_{direction}",
        f"Triton attention {word}, >= 8k tokens: % of measured bf16 matmul",
        f">= {floor:.0f}%",
        floor,
        lambda df: _rows(
            df,
            "attention_time",
            "pct_of_bf16_matmul",
            direction=direction,
            seq_len=lambda n: (n or 0) >= 8192,
            mask=lambda m: m in ("full", "causal"),  # varlen is reported, not held to the target
        ).query("variant == 'triton'"),
        lambda r: f"{r['_extra']['mask']} {r['shape']}",
    )


TARGETS = (
    Target(
        "fused_fwd",
        "Triton fused op, forward: % of measured copy GB/s",
        ">= 85%",
        85.0,
        lambda df: _rows(df, "fused_time", "pct_of_copy_ceiling", direction="fwd").query("variant == 'triton'"),
        lambda r: f"{r['_extra']['op']} {r['shape']}",
    ),
    Target(
        "fused_fwdbwd",
        "Triton fused op, forward+backward: % of measured copy GB/s",
        ">= 75%",
        75.0,
        lambda df: _rows(df, "fused_time", "pct_of_copy_ceiling", direction="fwd+bwd").query("variant == 'triton'"),
        lambda r: f"{r['_extra']['op']} {r['shape']}",
    ),
    _attention_target("fwd", "forward", 60.0),
    _attention_target("bwd", "backward", 45.0),
    Target(
        "fp8_triton",
        "Triton FP8 GEMM throughput / _scaled_mm's (same scales)",
        ">= 0.70x",
        0.70,
        lambda df: _rows(df, "fp8_gemm", "vs_scaled_mm"),
        lambda r: f"{r['_extra']['granularity']}{_accum_label(r)} {r['shape']}",
    ),
    Target(
        "fp8_rowwise",
        "_scaled_mm FP8 row-wise speed-up over bf16 at 8192^3",
        ">= 1.6x",
        1.6,
        lambda df: _rows(df, "fp8_gemm", "speedup_vs_bf16", granularity="row").query("shape == '8192x8192x8192'"),
        lambda r: f"row{_accum_label(r)} {r['shape']}",
    ),
)


def _accum_label(r) -> str:
    return "+fast_accum" if r["_extra"].get("fast_accum") else ""


def evaluate_targets(df: pd.DataFrame) -> list[dict]:
    """One line per target: the worst measured figure, its case, and met / MISSED / not measured."""
    out = []
    for t in TARGETS:
        d = t.pick(df) if len(df) else df
        d = d[d["value"].map(lambda v: isinstance(v, (int, float)) and math.isfinite(v))] if len(d) else d
        if not len(d):
            out.append(dict(key=t.key, figure=t.figure, target=t.target, measured="", case="", verdict="not measured"))
            continue
        worst = d.loc[d["value"].idxmin()]
        unit = "%" if t.target.endswith("%") else "x"
        misses = int((d["value"] < t.threshold).sum())
        out.append(
            dict(
                key=t.key,
                figure=t.figure,
                target=t.target,
                measured=f"{worst['value']:.3g}{unit}",
                case=f"worst of {len(d)}: {t.label(worst)}",
                verdict="met" if misses == 0 else f"MISSED ({misses} of {len(d)})",
            )
        )
    return out


def summary_text(df: pd.DataFrame, ctx: dict, status: list[dict], failures: list[str], skipped: list[str]) -> str:
    lines = [
        f"gpu_check on {ctx.get('device')} ({ctx.get('baseline_kind')}), torch {ctx.get('torch_version')}, "
        f"triton {ctx.get('triton_version')}, commit {ctx.get('commit')}, run {ctx.get('run_id')}",
    ]
    ce = df[(df["experiment"] == "ceilings") & (df["statistic"] == "median")]
    if len(ce):
        lines.append(
            "ceilings (measured): "
            + ", ".join(
                f"{r.variant} {r.dtype or ''} {r.value:.4g} {r.unit}".replace("  ", " ") for r in ce.itertuples()
            )
        )
    lines.append(
        "sections: "
        + ", ".join(f"{st['notebook'].split(':')[-1]} {st['status']} ({st['seconds']:.0f} s)" for st in status)
    )
    lines.append(f"correctness: {ctx.get('checks', 0)} checks, {len(failures)} failed")
    lines += [f"  {f.splitlines()[0]}" for f in failures]
    lines.append("targets (benchmarks, not tests):")
    for e in evaluate_targets(df):
        lines.append(
            f"  {e['figure']}: {e['measured'] or '-'} (target {e['target']}) {e['verdict']} {e['case']}".rstrip()
        )
    nt = df[df["statistic"] == "not_timed"] if len(df) else df
    if len(nt):
        lines.append(f"not timed: {len(nt)} row(s), e.g. {_extra(nt.iloc[0].to_dict()).get('reason', '')[:100]}")
    lines += [f"skipped: {sk}" for sk in skipped]
    lines += [f"refused (not run by this machine's software): {r}" for r in ctx.get("refused") or []]
    if ctx.get("complete") is False:
        lines.append("INCOMPLETE: the run was stopped or is still going; the sections listed above are on disk")
    return "\n".join(lines)


def readme_table(df: pd.DataFrame, ctx: dict) -> str:
    head = (
        f"Run `{ctx.get('run_id')}` on {ctx.get('device')} (torch {ctx.get('torch_version')}, "
        f"triton {ctx.get('triton_version')}, commit {ctx.get('commit')}):"
    )
    rows = ["| figure | target | measured (worst case) | verdict |", "| --- | --- | --- | --- |"]
    for e in evaluate_targets(df):
        meas = f"{e['measured']} ({e['case']})" if e["measured"] else "-"
        rows.append(f"| {e['figure']} | {e['target']} | {meas} | {e['verdict']} |")
    return head + "\n\n" + "\n".join(rows)


def update_readme(path: Path, table: str) -> None:
    text = path.read_text()
    pat = re.compile(re.escape(README_BEGIN) + r".*?" + re.escape(README_END), re.S)
    if not pat.search(text):
        raise ValueError(f"{path}: no {README_BEGIN} ... {README_END} block to replace")
    path.write_text(pat.sub(lambda _m: f"{README_BEGIN}\n{table}\n{README_END}", text))


# ------------------------------------------------------------------------------- the run
def baseline_kind(context: dict) -> str:
    """The device kind ``perflab compare`` / ``baseline`` give a run: ``cpu`` or ``cuda-<model>``
    (the rule of ``lab_utils.run.compare.baseline_kind``, which cannot be imported here: that
    package loads the notebook runner; a test holds the two equal)."""
    kind = str(context.get("device_kind") or "unknown")
    if kind == "cpu":
        return "cpu"
    slug = lambda s: re.sub(r"[^a-z0-9]+", "-", str(s).lower()).strip("-") or "unknown"  # noqa: E731
    return f"{slug(kind)}-{slug(context.get('device') or 'unknown')}"


def plan_budgets(sections, total: float) -> dict[str, float]:
    share = sum(SHARES[x] for x in sections)
    return {x: total * SHARES[x] / share for x in sections}


def default_out(kind: str) -> Path:
    base = ROOT / "benchmarks" / "results" / f"{LAB}-{kind}-{time.strftime('%Y%m%d')}"
    out, i = base, 2
    while out.exists():
        out, i = base.with_name(f"{base.name}-{i}"), i + 1
    return out


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a run killed while
    writing leaves the previous version whole, never half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_outputs(out: Path, frames: list[pd.DataFrame], ctx: dict, status: list[dict]) -> pd.DataFrame:
    cols = ROW_COLUMNS + CONTEXT_COLUMNS + ["notebook", "run_id"]
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)
    for c in CONTEXT_COLUMNS:
        df[c] = ctx.get(c, "")
    df["run_id"] = ctx["run_id"]
    df = df.reindex(columns=cols)
    df["value"] = pd.to_numeric(df["value"], errors="coerce").astype(float)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / "records.json", df.to_json(orient="records", indent=1))
    try:
        tmp = out / ".records.parquet.tmp"
        df.to_parquet(tmp, index=False)
        os.replace(tmp, out / "records.parquet")
    except ImportError:  # no pyarrow on this machine: records.json alone is complete
        pass
    _write_atomic(out / "context.json", json.dumps(ctx, indent=1, default=str) + "\n")
    _write_atomic(out / "status.json", json.dumps(status, indent=1) + "\n")
    return df


class Interrupted(BaseException):
    """SIGTERM (a time limit's kill) or Ctrl-C: the section in progress stops; what was measured is kept."""


def _on_sigterm(signum, frame):
    raise Interrupted(f"signal {signum}")


def run_check(args) -> int:
    dev = args.dev
    plan = PLANS[dev.type]
    seed = args.seed
    budget = float(args.budget_s or plan.budget_s)
    info = device_info(dev)
    kind = baseline_kind({"device_kind": info.kind, "device": info.name})
    out = Path(args.out) if args.out else default_out(kind)
    run_id = f"{LAB}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    traces = Path(args.traces) if args.traces else None
    run = Run(dev=dev, plan=plan, seed=seed, out=out, t0=time.perf_counter(), budget_s=budget, traces=traces)
    budgets = plan_budgets(args.sections, budget)
    print(
        f"gpu_check {run_id}: {info.name} ({kind}), torch {info.torch_version}, triton {info.triton_version}, "
        f"interpreted={lab_kernels.TRITON_INTERPRETED}, seed {seed}, out {out}",
        flush=True,
    )
    if _interpreter_why_not(dev):
        run.log(f"Triton's interpreter is unusable here, its checks are refused: {_interpreter_why_not(dev)}")
    elif lab_kernels.TRITON_INTERPRETED and interpreter_note():
        run.log(f"Triton's interpreter: {interpreter_note()}")
    print("budget plan: " + ", ".join(f"{k} {v:.0f} s" for k, v in budgets.items()) + f" (total {budget:.0f} s)")
    frames, status = [], []
    params = {"plan": asdict(plan), "sections": list(args.sections), "budget_s": budget, "seed": seed}

    def context() -> dict:
        ctx = Recorder(lab=LAB, params=params, device=dev, ceilings=run.ceilings).context()
        if args.commit:  # a copy of the tree without .git (a lent GPU machine) cannot name its commit
            ctx["commit"] = args.commit
        ctx.update(
            run_id=run_id,
            suite=LAB,
            baseline_kind=kind,
            checks=run.checks,
            failures=run.failures,
            skipped=run.skipped,
            refused=run.refused,
            interpreter=interpreter_note() if lab_kernels.TRITON_INTERPRETED else "",
            seconds=run.elapsed(),
            command="python3 benchmarks/gpu_check.py " + " ".join(args.argv),
            complete=len(status) == len(args.sections),
        )
        return ctx

    def save() -> pd.DataFrame:
        ctx = context()
        df = write_outputs(out, frames, ctx, status)
        _write_atomic(out / "summary.txt", summary_text(df, ctx, status, run.failures, run.skipped) + "\n")
        return df

    interrupted = None
    old_term = signal.signal(signal.SIGTERM, _on_sigterm) if _main_thread() else None
    try:
        if any(x != "ceilings" for x in args.sections) and "ceilings" not in args.sections:
            # measured (or read from this machine's cache) before any section's clock starts
            run.ceilings = _fallback_ceilings(run)
        deadline = 0.0
        for name in args.sections:
            if name != "ceilings" and run.ceilings is None:
                run.ceilings = _fallback_ceilings(run)  # the `ceilings` section failed: before this one's budget
            deadline = max(deadline, run.elapsed()) + budgets[name]  # unspent time carries to the next section
            rec = Recorder(lab=LAB, params=params, device=dev, ceilings=run.ceilings)
            sec = Section(run, name, rec, deadline)
            n_fail = len(run.failures)
            t_start = time.perf_counter()
            run.log(f"== {name} (budget {budgets[name]:.0f} s, until {deadline:.0f} s)")
            st = dict(notebook=f"{LAB}:{name}", path=str(Path(__file__).relative_to(ROOT)), status="ok", error=None)
            try:
                SECTION_FNS[name](sec)
            except (KeyboardInterrupt, Interrupted) as e:
                interrupted = f"{type(e).__name__}{': ' + str(e) if str(e) else ''}"
                st.update(status="interrupted", error=f"stopped in this section ({interrupted})")
                run.log(f"{name} INTERRUPTED ({interrupted}): its rows so far are kept")
            except Exception as e:  # noqa: BLE001 - a section that raises is recorded; the others still run
                st.update(status="failed", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                run.log(f"{name} RAISED {st['error']}")
                traceback.print_exc()
            if len(run.failures) > n_fail and st["status"] == "ok":
                st.update(status="failed", error=f"{len(run.failures) - n_fail} correctness check(s) failed")
            st.update(seconds=time.perf_counter() - t_start, rows=len(rec.rows))
            status.append(st)
            df = rec.frame()
            df["notebook"] = st["notebook"]
            frames.append(df)
            save()  # after every section: a run stopped at a time limit keeps what it measured
            run.log(f"== {name} {st['status']} in {st['seconds']:.1f} s, {len(rec.rows)} rows")
            if interrupted:
                break
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    df = save()
    ctx = context()
    text = summary_text(df, ctx, status, run.failures, run.skipped)
    if args.update_readme and not interrupted:
        update_readme(Path(args.readme), readme_table(df, ctx))
    print(text)
    print(f"{len(df)} rows -> {out} in {run.elapsed():.0f} s")
    if interrupted:
        not_run = [x for x in args.sections if x not in {st["notebook"].split(":")[-1] for st in status}]
        print(f"interrupted ({interrupted}); not run: {', '.join(not_run) or 'none'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if run.failures:
        return EXIT_CHECK_FAILED
    return EXIT_SECTION_FAILED if any(st["status"] != "ok" for st in status) else EXIT_OK


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _fallback_ceilings(run: Run) -> Ceilings | None:
    """Ceilings when the `ceilings` section was not run (or failed): this machine's cache."""
    try:
        return get_ceilings(run.dev, quick=run.dev.type == "cpu")
    except (BenchError, RuntimeError) as e:
        run.log(f"no ceilings: {e}")
        return None


def from_records(args) -> int:
    src = Path(args.from_records)
    df = load_records(src)
    ctx = json.loads((src / "context.json").read_text()) if (src / "context.json").exists() else {}
    status = json.loads((src / "status.json").read_text()) if (src / "status.json").exists() else []
    for st in status:
        st.setdefault("seconds", 0.0)
    print(summary_text(df, ctx, status, ctx.get("failures", []), ctx.get("skipped", [])))
    if args.update_readme:
        update_readme(Path(args.readme), readme_table(df, ctx))
        print(f"table updated in {args.readme}")
    return EXIT_OK


def parse_args(argv: list[str]):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto (CUDA when present), cuda or cpu")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/results/gpu_check-<kind>-<date>)")
    ap.add_argument(
        "--traces",
        default=None,
        help="keep the profiler traces (several MB each) in this folder; by default they are analysed and deleted",
    )
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="budget of the sections in seconds (default 450 GPU, 200 CPU), checked between items",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of every check's inputs (printed, recorded)")
    ap.add_argument("--update-readme", action="store_true", help="rewrite the figures table in --readme")
    ap.add_argument("--readme", default=str(ROOT / "benchmarks" / "results" / "README.md"))
    ap.add_argument("--commit", default=None, help="commit to record when the tree has no .git (default: git's)")
    ap.add_argument("--from-records", default=None, help="summarise a finished run's folder instead of running")
    a = ap.parse_args(argv)
    a.argv = list(argv)
    secs = [x.strip() for x in a.sections.split(",") if x.strip()]
    bad = [x for x in secs if x not in SECTIONS]
    if bad or not secs:
        raise ConfigError("sections", a.sections, f"a comma-separated subset of {', '.join(SECTIONS)}")
    a.sections = [x for x in SECTIONS if x in secs]
    if a.budget_s is not None and not a.budget_s > 0:
        raise ConfigError("budget_s", a.budget_s, "a number of seconds > 0")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = parse_args(argv)
        if not a.from_records:
            a.dev = pick_device(a.device)
    except (ConfigError, ValueError, RuntimeError) as e:  # refused before any work starts
        print(f"gpu_check: {e}", file=sys.stderr)
        return EXIT_SECTION_FAILED
    return from_records(a) if a.from_records else run_check(a)


if __name__ == "__main__":
    sys.exit(main())
