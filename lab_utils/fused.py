"""Fused-op variants: inputs, correctness against float64, bytes moved, provider × sweep timing.

Design note
-----------
One :class:`Problem` describes a size for every op of ``lab_kernels`` (batch, tokens,
hidden; heads × head_dim for the rope ops).  :data:`OPS` maps each op to an
:class:`OpSpec`: how to draw its inputs (float64, from a seeded generator), which of
them are differentiable; the bytes it must move and its FLOPs are counted in
``lab_utils.flops`` (each input read once, each output written once; the formulas are
repeated in each op module's docstring).

* :func:`check_variant` runs a variant forward and backward and compares every output
  and every gradient with the reference computed in float64 on the same (rounded)
  inputs, with tolerances tied to dtype (``lab_utils.checks``).
* :func:`bench_variant` times one (variant, problem, dtype, direction) with the lab's
  one timing primitive; :func:`sweep` is providers × problems × dtypes × directions,
  written as tidy rows (time, GB/s, % of measured copy ceiling, speedup over eager,
  peak memory on CUDA).  Triton variants are never timed on CPU (interpreter).
* Whole MMDiT blocks with the fused ops from one provider: ``lab_utils.fused_blocks``.

Gradient tolerance: a backward in low precision chains several roundings (eager
autograd rounds every intermediate to the dtype), so gradients are compared at
``tolerance(dtype, GRAD_TOL_SCALE)``; the gradient of a broadcast parameter (weight,
shift, scale, gate) is a sum over the n rows it was broadcast to, and the rounding error
of a sum of n rounded terms grows like √n, so its atol is multiplied by √n.

Interpreter caveat: Triton's interpreter converts float32 to bfloat16 by truncation
(round toward zero; measured on triton 3.9: about half of random values differ from
torch's round-to-nearest-even by one ulp), while compiled Triton on a GPU rounds to
nearest.  On CPU a Triton bfloat16 result can therefore be one ulp off instead of half
an ulp; the bfloat16 tolerance (1.6e-2 relative, two ulps) covers it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch
from tqdm.auto import tqdm

from lab_kernels import get_variant, variants

from . import flops as F
from .checks import compare, tolerance
from .dtypes import LAB_DTYPES, parse_dtype
from .model import PRESETS
from .records import Recorder, fmt_dtype
from .timing import BenchFailure, try_bench

OP_NAMES = F.FUSED_OPS
DIRECTIONS = F.DIRECTIONS
DTYPES = {name: parse_dtype("dtype", name) for name in LAB_DTYPES}
GRAD_TOL_SCALE = 2.0


def as_dtype(d) -> torch.dtype:
    """A lab dtype name (or a torch.dtype) as a torch.dtype; ConfigError naming 'dtype' otherwise."""
    return parse_dtype("dtype", d, LAB_DTYPES)


@dataclass(frozen=True)
class Problem:
    """One size for every op: x (batch, tokens, hidden); q, k (batch, heads, tokens, head_dim)."""

    batch: int
    tokens: int
    hidden: int
    head_dim: int = 128

    @property
    def heads(self) -> int:
        return max(1, self.hidden // self.head_dim)

    @property
    def rows(self) -> int:
        return self.batch * self.tokens

    def label(self) -> str:
        return f"B{self.batch}xL{self.tokens}xD{self.hidden}"


@dataclass
class OpInputs:
    args: list  # positional arguments of the op, float64 on CPU
    grads: tuple[str, ...]  # names of the differentiable arguments
    names: tuple[str, ...]  # names of all arguments
    tables: tuple[str, ...] = ()  # arguments that stay float32 whatever the dtype (rope cos/sin)
    shape: tuple = ()  # the main tensor's shape, for records and capability checks


@dataclass(frozen=True)
class OpSpec:
    op: str
    make: Callable[[Problem, Draw], OpInputs]
    n_outputs: int = 1
    problem_kw: Callable[[Problem], dict] = field(default=lambda p: {"shape": (p.batch, p.tokens, p.hidden)})

    def bytes(self, p: Problem, dtype, direction: str) -> float:
        """Bytes one call must move (``lab_utils.flops.fused_bytes``)."""
        s = torch.empty((), dtype=as_dtype(dtype)).element_size()
        return F.fused_bytes(
            self.op, direction, batch=p.batch, tokens=p.tokens, hidden=p.hidden, head_dim=p.head_dim, elem_size=s
        )


@dataclass(frozen=True)
class Draw:
    """Where inputs are drawn: float64 on the CPU for checks; benchmarks draw float32 on the
    device (drawing GB-sized float64 tensors on the host would dominate a GPU sweep)."""

    gen: torch.Generator
    dtype: torch.dtype = torch.float64

    @property
    def device(self) -> torch.device:
        return self.gen.device


def _randn(g: Draw, *shape, scale=1.0, offset=0.0):
    return torch.randn(*shape, generator=g.gen, dtype=g.dtype, device=g.device) * scale + offset


def _tables(p: Problem, g):
    # FLUX-like angles: position × frequency 10000^(-2i/Dh), positions shuffled per draw.
    half = p.head_dim // 2
    pos = torch.randperm(max(p.tokens, 1) * 4, generator=g.gen, device=g.device)[: p.tokens].to(g.dtype)
    freq = 10000.0 ** (-torch.arange(half, dtype=g.dtype, device=g.device) * 2 / p.head_dim)
    ang = pos[:, None] * freq[None, :]
    return torch.cos(ang), torch.sin(ang)


def _make_rms(p, g):
    x = _randn(g, p.batch, p.tokens, p.hidden)
    return OpInputs(
        [x, _randn(g, p.hidden, scale=0.1, offset=1.0)], ("x", "weight"), ("x", "weight"), shape=tuple(x.shape)
    )


def _make_lnm(p, g):
    x = _randn(g, p.batch, p.tokens, p.hidden, scale=2.0, offset=0.5)
    return OpInputs(
        [x, _randn(g, p.batch, p.hidden, scale=0.5), _randn(g, p.batch, p.hidden, scale=0.5)],
        ("x", "shift", "scale"),
        ("x", "shift", "scale"),
        shape=tuple(x.shape),
    )


def _make_gr(p, g):
    x = _randn(g, p.batch, p.tokens, p.hidden)
    return OpInputs(
        [x, _randn(g, p.batch, p.hidden, scale=0.5), _randn(g, p.batch, p.tokens, p.hidden)],
        ("x", "gate", "y"),
        ("x", "gate", "y"),
        shape=tuple(x.shape),
    )


def _make_gelu(p, g):
    x = _randn(g, p.batch, p.tokens, p.hidden, scale=2.0)
    return OpInputs([x], ("x",), ("x",), shape=tuple(x.shape))


def _make_swiglu(p, g):
    gate = _randn(g, p.batch, p.tokens, p.hidden, scale=2.0)
    return OpInputs(
        [gate, _randn(g, p.batch, p.tokens, p.hidden)], ("gate", "up"), ("gate", "up"), shape=tuple(gate.shape)
    )


def _qk(p, g):
    shp = (p.batch, p.heads, p.tokens, p.head_dim)
    return _randn(g, *shp), _randn(g, *shp, scale=1.5)


def _make_rope(p, g):
    q, k = _qk(p, g)
    cos, sin = _tables(p, g)
    return OpInputs([q, k, cos, sin], ("q", "k"), ("q", "k", "cos", "sin"), tables=("cos", "sin"), shape=tuple(q.shape))


def _make_qknr(p, g):
    q, k = _qk(p, g)
    cos, sin = _tables(p, g)
    return OpInputs(
        [q, k, _randn(g, p.head_dim, scale=0.1, offset=1.0), _randn(g, p.head_dim, scale=0.1, offset=1.0), cos, sin],
        ("q", "k", "q_weight", "k_weight"),
        ("q", "k", "q_weight", "k_weight", "cos", "sin"),
        tables=("cos", "sin"),
        shape=tuple(q.shape),
    )


def _rope_kw(p):
    return {"shape": (p.batch, p.heads, p.tokens, p.head_dim), "head_dim": p.head_dim}


# How each op's inputs are drawn; its bytes and FLOPs are counted in lab_utils.flops.
OPS: dict[str, OpSpec] = {
    "rms_norm": OpSpec("rms_norm", _make_rms),
    "layer_norm_modulate": OpSpec("layer_norm_modulate", _make_lnm),
    "gated_residual": OpSpec("gated_residual", _make_gr),
    "gelu_tanh": OpSpec("gelu_tanh", _make_gelu),
    "swiglu": OpSpec("swiglu", _make_swiglu),
    "rope": OpSpec("rope", _make_rope, n_outputs=2, problem_kw=_rope_kw),
    "qk_norm_rope": OpSpec("qk_norm_rope", _make_qknr, n_outputs=2, problem_kw=_rope_kw),
}


def flops(op: str, problem: Problem, direction: str) -> float:
    """FLOPs of one call (``lab_utils.flops.fused_flops``: per-element counts documented there)."""
    return F.fused_flops(
        op, direction, batch=problem.batch, tokens=problem.tokens, hidden=problem.hidden, head_dim=problem.head_dim
    )


def spec(op: str) -> OpSpec:
    if op not in OPS:
        raise ValueError(f"parameter 'op' = {op!r} is not allowed: expected one of {', '.join(OPS)}")
    return OPS[op]


def bytes_moved(op: str, problem: Problem, dtype, direction: str) -> float:
    """Bytes the op must move for one call in ``direction`` (documented per op)."""
    return spec(op).bytes(problem, dtype, direction)


def _generator(seed: int | None) -> tuple[torch.Generator, int]:
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())  # fresh inputs, reported for reproduction
    g = torch.Generator().manual_seed(seed)
    return g, seed


def make_inputs(
    op: str,
    problem: Problem,
    dtype,
    device="cpu",
    *,
    seed: int | None = None,
    requires_grad: bool = True,
    fast: bool = False,
):
    """(args in dtype on device, OpInputs in float64, seed).  Tables stay float32.
    ``fast``: draw in float32 directly on ``device`` (benchmarks; values differ from the
    float64 draw of the same seed)."""
    g, seed = _generator(seed)
    draw = Draw(torch.Generator(device=device).manual_seed(seed), torch.float32) if fast else Draw(g)
    inp = spec(op).make(problem, draw)
    dt = as_dtype(dtype)
    args = []
    for name, a in zip(inp.names, inp.args):
        t = a.to(device=device, dtype=torch.float32 if name in inp.tables else dt)
        if requires_grad and name in inp.grads:
            t.requires_grad_(True)
        args.append(t)
    return args, inp, seed


def as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


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
                rep.message, seed,
            )
        )  # fmt: skip

    if len(out) != len(ref_out):
        raise AssertionError(f"{op}/{variant} returned {len(out)} outputs, the reference {len(ref_out)}")
    for i, (o, r) in enumerate(zip(out, ref_out)):
        tensor = "out" if len(out) == 1 else f"out{i}"
        if o.dtype != dt:
            fail(tensor, o.numel(), f"{op}/{variant}: output {i} has dtype {o.dtype}, expected {dt} (seed {seed})")
            continue
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
                        n_bad=0,
                        note=why,
                    )
                )
                continue
            rows = check_variant(op, v.name, dt, problem, device=device, seed=seed, grads=grads)
            worst = max(rows, key=lambda r: (not r.ok, r.max_abs))
            recs.append(
                dict(
                    variant=v.name,
                    dtype=fmt_dtype(dt),
                    verdict="PASS" if all(r.ok for r in rows) else "FAIL",
                    worst=worst.tensor,
                    max_abs=max(r.max_abs for r in rows),
                    max_rel=max(r.max_rel for r in rows),
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
    rep_ms: float = 100.0,
):
    """Timing (or BenchFailure) and peak memory of one variant; refuses Triton on CPU."""
    v = get_variant(op, variant)
    if not v.timeable(device):
        return BenchFailure(
            f"{op}/{variant}", "raised", "Triton on CPU runs in the interpreter: correctness only, never timed"
        ), None
    why = v.why_not(device, as_dtype(dtype), **spec(op).problem_kw(problem))
    if why:
        return BenchFailure(f"{op}/{variant}", "raised", why), None
    try:
        fn = _bench_fn(op, variant, problem, dtype, direction, device)
    except Exception as e:  # noqa: BLE001 - recorded as a failure row
        return BenchFailure(f"{op}/{variant}", "raised", f"{type(e).__name__}: {e}"), None
    t = try_bench(
        fn,
        name=f"{op}/{variant}/{direction}",
        device=device,
        reps=reps,
        budget_s=budget_s,
        rep_ms=rep_ms,
        check_finite=True,
    )
    mem = peak_memory_bytes(fn, device) if getattr(t, "ok", False) else None
    return t, mem


def sweep(
    rec: Recorder,
    ops: Sequence[str],
    problems: Sequence[Problem],
    dtypes: Sequence,
    directions: Sequence[str],
    *,
    device="cpu",
    variant_names: Sequence[str] | None = None,
    reps: int = 20,
    budget_s: float = 20.0,
    experiment: str = "op_sweep",
    progress: bool = False,
    check: Problem | None = None,
    check_seed: int | None = 0,
) -> list[tuple[str, str, str]]:
    """Providers × sweep: every timeable variant of each op on each problem, dtype and
    direction -> rows (time median/p20/p80, GB/s, % of copy ceiling, speedup over eager,
    peak memory).  Untimeable variants (Triton on CPU) get no rows.

    ``check``: before a variant is timed for the first time (per op and dtype), it is checked
    against float64 on this problem (or on the timed one where it cannot run this one), the
    gradients too when a direction includes the backward; a failure raises AssertionError and
    nothing more is timed.  Returns the (op, variant, dtype) triples checked."""
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
                assert_variant_ok(op, v.name, dt, where, device=device, seed=check_seed, grads=grads)
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


# ---------------------------------------------------------------------------------------------
# Sizes from the model presets


def preset_dims(preset: str) -> dict:
    """hidden size, heads, head dim and MLP hidden of a model preset (``lab_utils.model.PRESETS``)."""
    if preset not in PRESETS:
        raise ValueError(f"parameter 'preset' = {preset!r} is not allowed: expected one of {', '.join(PRESETS)}")
    p = PRESETS[preset]
    hidden, heads = int(p["hidden_size"]), int(p["num_heads"])
    return dict(hidden=hidden, heads=heads, head_dim=hidden // heads, mlp_hidden=int(hidden * p["mlp_ratio"]))


def problems_for(
    presets: Sequence[str], tokens: Sequence[int], *, batch: int = 1, include_mlp: bool = True
) -> list[Problem]:
    """Token counts × hidden sizes taken from presets (and their MLP widths)."""
    out = []
    for pr in presets:
        d = preset_dims(pr)
        widths = [d["hidden"]] + ([d["mlp_hidden"]] if include_mlp else [])
        for L in tokens:
            for w in widths:
                pb = Problem(batch, int(L), w, d["head_dim"])
                if pb not in out:
                    out.append(pb)
    return out


def ops_sizes_note() -> str:
    return (
        "rms_norm, layer_norm_modulate, gated_residual, gelu_tanh, swiglu: x (batch, tokens, hidden); "
        "rope, qk_norm_rope: q, k (batch, hidden/head_dim, tokens, head_dim)"
    )


__all__ = [
    "DIRECTIONS",
    "DTYPES",
    "OPS",
    "OP_NAMES",
    "CheckRow",
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
    "peak_memory_bytes",
    "preset_dims",
    "problems_for",
    "spec",
    "sweep",
]
