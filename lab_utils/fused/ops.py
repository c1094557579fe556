"""Fused-op variants: correctness against float64, bytes moved, provider × sweep timing.

Design note
-----------
The problems and inputs (:class:`Problem`, :data:`OPS`, :func:`make_inputs`, sizes from
the model presets) are defined in ``lab_utils.fused.inputs`` and re-exported here; the
bytes an op must move and its FLOPs are counted in ``lab_utils.core.flops`` (each input read
once, each output written once; the formulas are repeated in each op module's docstring).

* :func:`check_variant` runs a variant forward and backward and compares every output
  and every gradient with the reference computed in float64 on the same (rounded)
  inputs, with tolerances tied to dtype (``lab_utils.core.checks``).
* :func:`bench_variant` times one (variant, problem, dtype, direction) with the lab's
  one timing primitive, on CUDA as graph replays (:func:`time_op`: host dispatch out of the
  time); :func:`sweep` is providers × problems × dtypes × directions,
  written as tidy rows (time, GB/s, % of measured copy ceiling, speedup over eager,
  peak memory on CUDA).  Triton variants are never timed on CPU (interpreter).
* Whole MMDiT blocks with the fused ops from one provider: ``lab_utils.fused.blocks``.

Gradient tolerance: a backward in low precision chains several roundings (eager
autograd rounds every intermediate to the dtype), so gradients are compared at
``tolerance(dtype, GRAD_TOL_SCALE)``; the gradient of a broadcast parameter (weight,
shift, scale, gate) is a sum over the n rows it was broadcast to, and the rounding error
of a sum of n rounded terms grows like √n, so its atol is multiplied by √n.

Output bound of ``layer_norm_modulate``: ``y = x̂·(1 + scale) + shift`` cancels where the product and
the shift nearly cancel, and there a rounding error of the product is large against ``|y|``:
a tolerance relative to ``|y|`` (atol + rtol·|y|) fails correct results (bfloat16: an element of
-0.018 computed as 0, its product rounded by half an ulp of ~5).  Its output is held instead to a
bound per element from the operands (:func:`layer_norm_modulate_bound`):
``|err| <= c·(u·(|x̂·(1+scale)| + |shift|) + u32·(1 + |x̂|)·|1+scale|)`` with ``u`` the dtype's unit
roundoff, ``u32`` float32's (the statistics are float32), ``c`` = 4: the eager path rounds x̂, 1 + scale,
the product and the sum, each by at most ``u`` of its operands, and the mean and rstd move x̂
by about ``u32·(1 + |x̂|)`` (measured: at most 0.82 of that at 781 wide).  Measured on random
draws: eager bfloat16 reaches 0.82 of the bound, fused kernels 0.5 (Triton's interpreter truncates),
so an error twice the eager one fails it.

Interpreter caveat: Triton's interpreter converts float32 to bfloat16 by truncation
(round toward zero; measured on triton 3.9: about half of random values differ from
torch's round-to-nearest-even by one ulp), while compiled Triton on a GPU rounds to
nearest.  On CPU a Triton bfloat16 result can therefore be one ulp off instead of half
an ulp; the bfloat16 tolerance (1.6e-2 relative, two ulps) covers it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from lab_kernels import get_variant, variants
from lab_utils.core.checks import compare, tolerance
from lab_utils.core.records import fmt_dtype
from lab_utils.core.session import Session
from lab_utils.core.timing import BenchFailure, try_bench
from lab_utils.fused.inputs import (
    DIRECTIONS,
    DTYPES,
    OP_NAMES,
    OPS,
    Draw,
    OpInputs,
    OpSpec,
    Problem,
    as_dtype,
    as_tuple,
    bytes_moved,
    flops,
    make_inputs,
    ops_sizes_note,
    preset_dims,
    problems_for,
    spec,
)

GRAD_TOL_SCALE = 2.0

#: float32's unit roundoff: the fused ops compute their statistics in float32
U_FP32 = torch.finfo(torch.float32).eps / 2


def layer_norm_modulate_bound(x, shift, scale, dtype, eps: float = 1e-6, c: float = 4.0) -> torch.Tensor:
    """Per-element bound on ``layer_norm_modulate``'s output error in ``dtype`` (module note), from
    its float64 operands: c·(u·(|x̂·(1+scale)| + |shift|) + u32·(1 + |x̂|)·|1+scale| + u·tiny)."""
    fi = torch.finfo(dtype)
    u = fi.eps / 2
    x, shift, scale = (t.detach().to(torch.float64) for t in (x, shift, scale))
    mean = x.mean(-1, keepdim=True)
    xhat = (x - mean) * torch.rsqrt((x - mean).pow(2).mean(-1, keepdim=True) + eps)
    one_plus = 1 + (scale.unsqueeze(-2) if scale.dim() == 2 else scale)
    sh = shift.unsqueeze(-2) if shift.dim() == 2 else shift
    # u * tiny: half the subnormal spacing, a rounding's absolute error below the normal range
    return c * (u * ((xhat * one_plus).abs() + sh.abs()) + U_FP32 * (1 + xhat.abs()) * one_plus.abs() + u * fi.tiny)


#: ops whose output is held to a bound per element from its operands instead of atol + rtol·|y|
OUT_BOUNDS: dict[str, Callable] = {"layer_norm_modulate": layer_norm_modulate_bound}

# ---------------------------------------------------------------------------------------------
# Correctness


@dataclass(frozen=True)
class CheckRow:
    op: str
    variant: str
    dtype: str
    shape: str
    tensor: str  # "out", "out0", "grad x", ...
    max_abs: float
    max_rel: float
    n_bad: int
    numel: int
    ok: bool
    message: str
    seed: int
    bound: float = math.nan  # the bound max_abs is held to (CloseReport.max_abs_bound): passes while <= it


def check_variant(
    op: str,
    variant: str,
    dtype,
    problem: Problem,
    *,
    device="cpu",
    seed: int | None = None,
    grads: bool = True,
    grad_tol_scale: float = GRAD_TOL_SCALE,
) -> list[CheckRow]:
    """Run ``variant`` forward (+ backward) and compare every output and gradient with the
    float64 reference on the same rounded inputs.  Fresh inputs unless ``seed`` is given."""
    dt = as_dtype(dtype)
    v = get_variant(op, variant)
    args, inp, seed = make_inputs(op, problem, dt, device, seed=seed, requires_grad=grads)
    ref_args = [a.detach().to("cpu", torch.float64).requires_grad_(a.requires_grad) for a in args]
    ref_out = as_tuple(get_variant(op, "reference")(*ref_args))
    g = torch.Generator().manual_seed(seed + 1)
    douts64 = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in ref_out]
    douts = [d.to(device=device, dtype=dt) for d in douts64]
    ref_douts = [d.to(torch.float64) for d in douts]  # the same rounded upstream gradient
    out = as_tuple(v(*args))
    rows: list[CheckRow] = []
    shape = "x".join(map(str, inp.shape))
    # An unfused variant that rounds an intermediate to the dtype (declared at
    # registration as tol_scale) is held to a proportionally wider tolerance.
    tol_scale = float(v.extra.get("tol_scale", 1.0))
    atol, rtol = tolerance(dt, tol_scale)

    def fail(tensor: str, numel: int, message: str) -> None:
        rows.append(
            CheckRow(op, variant, fmt_dtype(dt), shape, tensor, math.inf, math.inf, -1, numel, False, message, seed)
        )

    def add(tensor, actual, expected, a_tol, r_tol):
        name = f"{op}/{variant} {fmt_dtype(dt)} {shape} {tensor} (seed {seed})"
        rep = compare(actual, expected, atol=a_tol, rtol=r_tol, name=name)
        rows.append(
            CheckRow(
                op, variant, fmt_dtype(dt), shape, tensor, rep.max_abs, rep.max_rel, rep.n_bad, rep.numel, rep.ok,
                rep.message, seed, rep.max_abs_bound,
            )
        )  # fmt: skip

    if len(out) != len(ref_out):
        raise AssertionError(f"{op}/{variant} returned {len(out)} outputs, the reference {len(ref_out)}")
    for i, (o, r) in enumerate(zip(out, ref_out)):
        tensor = "out" if len(out) == 1 else f"out{i}"
        if o.dtype != dt:
            fail(tensor, o.numel(), f"{op}/{variant}: output {i} has dtype {o.dtype}, expected {dt} (seed {seed})")
            continue
        if op in OUT_BOUNDS:
            add(tensor, o, r.detach(), tol_scale * OUT_BOUNDS[op](*ref_args, dt), 0.0)
        else:
            add(tensor, o, r.detach(), atol, rtol)
    if grads:
        diff = [(n, a, r) for n, a, r in zip(inp.names, args, ref_args) if n in inp.grads]
        got = torch.autograd.grad(out, [a for _, a, _ in diff], douts, allow_unused=True)
        exp = torch.autograd.grad(ref_out, [r for _, _, r in diff], ref_douts, allow_unused=True)
        ga, gr = tolerance(dt, grad_tol_scale * tol_scale)
        n_out = out[0].numel()
        for (n, _, _), a, e in zip(diff, got, exp):
            if a is None:
                fail(f"grad {n}", 0, f"{op}/{variant}: no gradient for {n!r} (seed {seed})")
                continue
            # A broadcast parameter's gradient is a sum over the rows it was broadcast to:
            # rounding errors of n terms grow like sqrt(n), so its atol does too.
            n_sum = max(1, n_out // max(e.numel(), 1))
            add(f"grad {n}", a, e, ga * math.sqrt(n_sum), gr)
    return rows


def assert_variant_ok(op: str, variant: str, dtype, problem: Problem, **kw) -> list[CheckRow]:
    """:func:`check_variant`, raising an AssertionError that lists every failing tensor
    (how many elements mismatch, where, and the seed to reproduce)."""
    rows = check_variant(op, variant, dtype, problem, **kw)
    bad = [r for r in rows if not r.ok]
    if bad:
        raise AssertionError("\n".join(r.message for r in bad))
    return rows


def correctness_table(
    op: str,
    dtypes: Sequence,
    problem: Problem,
    *,
    device="cpu",
    seed: int | None = 0,
    variant_names: Sequence[str] | None = None,
    grads: bool = True,
):
    """A DataFrame: one row per (variant, dtype) with the worst error over outputs and
    gradients and the verdict; variants that cannot run here are listed with the reason."""
    recs = []
    for d in dtypes:
        dt = as_dtype(d)
        kw = spec(op).problem_kw(problem)
        for v in variants(op, include_unavailable=True):
            if v.kind == "reference" or (variant_names is not None and v.name not in variant_names):
                continue
            why = v.why_not(device, dt, **kw)
            if why:
                recs.append(
                    dict(
                        variant=v.name,
                        dtype=fmt_dtype(dt),
                        verdict="n/a",
                        worst="",
                        max_abs=math.nan,
                        max_rel=math.nan,
                        bound=math.nan,
                        n_bad=0,
                        note=why,
                    )
                )
                continue
            rows = check_variant(op, v.name, dt, problem, device=device, seed=seed, grads=grads)
            worst = max(rows, key=lambda r: (not r.ok, r.max_abs))
            largest = max(rows, key=lambda r: r.max_abs)  # the tensor max_abs comes from: its bound
            recs.append(
                dict(
                    variant=v.name,
                    dtype=fmt_dtype(dt),
                    verdict="PASS" if all(r.ok for r in rows) else "FAIL",
                    worst=worst.tensor,
                    max_abs=max(r.max_abs for r in rows),
                    max_rel=max(r.max_rel for r in rows),
                    bound=largest.bound,
                    n_bad=sum(max(r.n_bad, 0) for r in rows),
                    note="" if worst.ok else worst.message.splitlines()[0],
                )
            )
    return pd.DataFrame(recs)


# ---------------------------------------------------------------------------------------------
# Timing


def _bench_fn(op: str, variant: str, problem: Problem, dtype, direction: str, device, seed: int = 0):
    """A zero-argument callable running one (variant, problem, direction) on fresh-once inputs."""
    if direction not in DIRECTIONS:
        raise ValueError(f"parameter 'direction' = {direction!r} is not allowed: expected one of {DIRECTIONS}")
    v = get_variant(op, variant)
    args, inp, _ = make_inputs(op, problem, dtype, device, seed=seed, requires_grad=True, fast=True)
    diff = [a for n, a in zip(inp.names, args) if n in inp.grads]
    if direction == "fwd":
        return lambda: v(*args)
    out = as_tuple(v(*args))
    douts = [torch.randn_like(o) for o in out]
    if direction == "bwd":
        return lambda: torch.autograd.grad(out, diff, douts, retain_graph=True)
    return lambda: torch.autograd.grad(as_tuple(v(*args)), diff, douts)


def peak_memory_bytes(fn: Callable, device) -> float | None:
    """Peak allocated bytes above the level before one call (CUDA only; None elsewhere)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    return float(torch.cuda.max_memory_allocated(dev) - base)


#: Calls per sample when a fused op's call cannot be captured as a CUDA graph: its host dispatch
#: then overlaps the previous calls' GPU work instead of adding to every sample.
CALLS_PER_SAMPLE = 16


def time_op(fn: Callable, *, name: str, device, reps: int, budget_s: float, rep_ms: float = 100.0, graph: bool = True):
    """Time one fused-op call (Timing or BenchFailure); the method is in ``Timing.method``.

    On CUDA the call (one Python-dispatched op, or forward + backward through autograd) is
    replayed as a CUDA graph (``do_bench_cudagraph``): at flux-dev widths the GPU work of one
    call is shorter than its dispatch, and one dispatched call per sample would time the host.
    Where capture fails, each sample runs :data:`CALLS_PER_SAMPLE` calls back to back and is
    divided by that count (the method says so, with the capture's error).  On CPU the op's
    time is host time: one call per ``timeit`` block."""
    dev = torch.device(device)
    kw = dict(name=name, device=dev, reps=reps, budget_s=budget_s, rep_ms=rep_ms, check_finite=True)
    if dev.type != "cuda":
        return try_bench(fn, **kw)
    why = "not asked for"
    if graph:
        t = try_bench(fn, cuda_graph=True, **kw)
        if getattr(t, "ok", False) or t.kind != "raised":
            return t  # timed, or a failure (non-finite, over budget) that another method would repeat
        why = t.reason
    n = CALLS_PER_SAMPLE

    def calls():
        out = None
        for _ in range(n):
            out = fn()
        return out

    t = try_bench(calls, **kw)
    if not getattr(t, "ok", False):
        return t
    return dataclasses.replace(
        t,
        samples_ms=tuple(x / n for x in t.samples_ms),
        first_call_ms=t.first_call_ms,
        method=f"{t.method}, {n} calls per sample (no CUDA graph: {why.splitlines()[0][:160] if why else ''})",
        meta={**t.meta, "calls_per_sample": n, "cuda_graph": False},
    )


def bench_variant(
    op: str,
    variant: str,
    problem: Problem,
    dtype,
    direction: str,
    *,
    device="cpu",
    reps: int = 20,
    budget_s: float = 20.0,
):
    """Timing (or BenchFailure) and peak memory of one variant; refuses Triton on CPU."""
    v = get_variant(op, variant)
    if not v.timeable(device):
        return BenchFailure(
            f"{op}/{variant}", "raised", "Triton on CPU runs in the interpreter: correctness only, never timed"
        ), None
    why = v.why_not(device, as_dtype(dtype), **spec(op).problem_kw(problem))
    if direction != "fwd" and v.extra.get("backward_overwrites_inputs"):
        # repeated calls on the same inputs would run on the last call's gradients (and overflow)
        why = f"not timed: {v.extra['backward_overwrites_inputs']}"
    if why:
        return BenchFailure(f"{op}/{variant}", "raised", why), None
    try:
        fn = _bench_fn(op, variant, problem, dtype, direction, device)
    except Exception as e:  # noqa: BLE001 - recorded as a failure row
        return BenchFailure(f"{op}/{variant}", "raised", f"{type(e).__name__}: {e}"), None
    t = time_op(fn, name=f"{op}/{variant}/{direction}", device=device, reps=reps, budget_s=budget_s)
    mem = peak_memory_bytes(fn, device) if getattr(t, "ok", False) else None
    return t, mem


@dataclass(frozen=True)
class OpGrid:
    """What :func:`sweep` times: each op on each problem, dtype and direction; ``variant_names``:
    only these variants (and eager, the speedup baseline), None: every timeable one."""

    ops: Sequence[str]
    problems: Sequence[Problem]
    dtypes: Sequence
    directions: Sequence[str] = ("fwd",)
    variant_names: Sequence[str] | None = None


def sweep(
    grid: OpGrid,
    session: Session,
    *,
    reps: int = 20,
    budget_s: float = 20.0,
    experiment: str = "op_sweep",
    progress: bool = False,
    check: Problem | None = None,
) -> list[tuple[str, str, str]]:
    """Providers × sweep: every timeable variant of each op of ``grid`` on each problem, dtype
    and direction, on ``session.device`` -> rows in ``session.rec`` (time median/p20/p80, GB/s,
    % of copy ceiling, speedup over eager, peak memory).  Untimeable variants (Triton on CPU)
    get no rows.

    ``check``: before a variant is timed for the first time (per op and dtype), it is checked
    against float64 on this problem (or on the timed one where it cannot run this one), with
    inputs drawn from ``session.seed``, the gradients too when a direction includes the
    backward; a failure raises AssertionError and nothing more is timed.  Returns the
    (op, variant, dtype) triples checked."""
    rec, device, variant_names = session.rec, session.device, grid.variant_names
    if rec is None:
        raise ValueError("sweep writes rows: give the session a Recorder (Session(device, rec))")
    ops, problems, dtypes, directions = grid.ops, grid.problems, grid.dtypes, grid.directions
    items = [(op, p, d, dr) for op in ops for p in problems for d in dtypes for dr in directions]
    items = tqdm(items, desc="sweep", disable=not progress)
    grads = any(d != "fwd" for d in directions)
    checked: list[tuple[str, str, str]] = []
    for op, p, d, direction in items:
        dt = as_dtype(d)
        kw = spec(op).problem_kw(p)
        eager_ms = None
        vs = [v for v in variants(op, device=device, dtype=dt, **kw) if v.kind != "reference" and v.timeable(device)]
        vs.sort(key=lambda v: v.name != "eager")  # eager first: the speedup baseline
        for v in vs:
            if variant_names is not None and v.name not in variant_names and v.name != "eager":
                continue
            if check is not None and (op, v.name, fmt_dtype(dt)) not in checked:
                where = check if v.can_run(device, dt, **spec(op).problem_kw(check)) else p
                assert_variant_ok(op, v.name, dt, where, device=device, seed=session.seed, grads=grads)
                checked.append((op, v.name, fmt_dtype(dt)))
            t, mem = bench_variant(op, v.name, p, dt, direction, device=device, reps=reps, budget_s=budget_s)
            nbytes = bytes_moved(op, p, dt, direction)
            extra = dict(
                op=op,
                direction=direction,
                tokens=p.tokens,
                hidden=p.hidden,
                batch=p.batch,
                head_dim=p.head_dim,
                kind=v.kind,
            )
            shape = "x".join(map(str, kw["shape"]))
            rec.add_timing(
                experiment, v.name, t, shape=shape, dtype=dt, bytes=nbytes, flops=flops(op, p, direction), **extra
            )
            if not getattr(t, "ok", False):
                continue
            if v.name == "eager":
                eager_ms = t.median_ms
            if eager_ms:
                rec.add(
                    experiment,
                    v.name,
                    "speedup_vs_eager",
                    eager_ms / t.median_ms,
                    "x",
                    shape=shape,
                    dtype=dt,
                    statistic="median",
                    formula="eager median / variant median",
                    **extra,
                )
            if mem is not None:
                rec.add(
                    experiment,
                    v.name,
                    "peak_memory",
                    mem / 2**20,
                    "MiB",
                    shape=shape,
                    dtype=dt,
                    statistic="value",
                    formula="max_memory_allocated - allocated before the call",
                    **extra,
                )
    return checked


__all__ = [
    "DIRECTIONS",
    "DTYPES",
    "OPS",
    "OP_NAMES",
    "CheckRow",
    "OpGrid",
    "Draw",
    "OpInputs",
    "OpSpec",
    "Problem",
    "as_dtype",
    "as_tuple",
    "assert_variant_ok",
    "bench_variant",
    "bytes_moved",
    "check_variant",
    "correctness_table",
    "flops",
    "make_inputs",
    "ops_sizes_note",
    "peak_memory_bytes",
    "preset_dims",
    "problems_for",
    "spec",
    "sweep",
    "time_op",
]
