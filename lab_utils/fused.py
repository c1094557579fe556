"""Fused-op variants: inputs, correctness against float64, bytes moved, provider × sweep timing.

Design note
-----------
One :class:`Problem` describes a size for every op of ``lab_kernels`` (batch, tokens,
hidden; heads × head_dim for the rope ops).  :data:`OPS` maps each op to an
:class:`OpSpec`: how to draw its inputs (float64, from a seeded generator), which of
them are differentiable, and the bytes the op must move (each input read once, each
output written once — the formulas are the ones in each op module's docstring).

* :func:`check_variant` runs a variant forward and backward and compares every output
  and every gradient with the reference computed in float64 on the same (rounded)
  inputs, with tolerances tied to dtype (``lab_utils.checks``).
* :func:`bench_variant` times one (variant, problem, dtype, direction) with the lab's
  one timing primitive; :func:`sweep` is providers × problems × dtypes × directions,
  written as tidy rows (time, GB/s, % of measured copy ceiling, speedup over eager,
  peak memory on CUDA).  Triton variants are never timed on CPU (interpreter).
* :func:`block_compare` times a whole MMDiT double/single-stream block forward +
  backward with the fused ops taken from different variants.

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

import torch

import lab_kernels
from lab_kernels import get_variant, variants

from .checks import compare, tolerance
from .config import LabConfig, check_bool, check_choice, check_choices, check_float, check_int, check_int_list
from .records import Recorder, fmt_dtype
from .timing import BenchFailure, try_bench

OP_NAMES = ("rms_norm", "layer_norm_modulate", "gated_residual", "gelu_tanh", "swiglu", "rope", "qk_norm_rope")
DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GRAD_TOL_SCALE = 2.0


def as_dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    try:
        return DTYPES[d]
    except KeyError:
        raise ValueError(f"dtype {d!r} is not one of {', '.join(DTYPES)}") from None


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
    make: Callable[[Problem, torch.Generator], OpInputs]
    bytes_fwd: Callable[[Problem, int], float]
    bytes_bwd: Callable[[Problem, int], float]
    n_outputs: int = 1
    problem_kw: Callable[[Problem], dict] = field(default=lambda p: {"shape": (p.batch, p.tokens, p.hidden)})

    def bytes(self, p: Problem, dtype, direction: str) -> float:
        s = torch.empty((), dtype=as_dtype(dtype)).element_size()
        if direction == "fwd":
            return self.bytes_fwd(p, s)
        if direction == "bwd":
            return self.bytes_bwd(p, s)
        return self.bytes_fwd(p, s) + self.bytes_bwd(p, s)


# Inputs are drawn in float64 on the CPU for checks; benchmarks draw them in float32 on the
# generator's device (drawing GB-sized float64 tensors on the host would dominate a GPU sweep).
_DRAW = {"dtype": torch.float64}


def _randn(g, *shape, scale=1.0, offset=0.0):
    return torch.randn(*shape, generator=g, dtype=_DRAW["dtype"], device=g.device) * scale + offset


def _tables(p: Problem, g):
    # FLUX-like angles: position × frequency 10000^(-2i/Dh), positions shuffled per draw.
    half = p.head_dim // 2
    pos = torch.randperm(max(p.tokens, 1) * 4, generator=g, device=g.device)[: p.tokens].to(_DRAW["dtype"])
    freq = 10000.0 ** (-torch.arange(half, dtype=_DRAW["dtype"], device=g.device) * 2 / p.head_dim)
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


def _n(p):
    return p.batch * p.tokens * p.hidden


def _nqk(p):
    return p.batch * p.heads * p.tokens * p.head_dim


def _rope_kw(p):
    return {"shape": (p.batch, p.heads, p.tokens, p.head_dim), "head_dim": p.head_dim}


_T = lambda p: p.tokens * (p.head_dim // 2)  # noqa: E731  (elements of one rope table)

# Bytes each op must move (each input read once, each output written once); s = element size.
OPS: dict[str, OpSpec] = {
    "rms_norm": OpSpec(
        "rms_norm",
        _make_rms,
        lambda p, s: 2 * _n(p) * s + p.hidden * s,
        lambda p, s: 3 * _n(p) * s + 2 * p.hidden * s + 4 * p.rows,
    ),
    "layer_norm_modulate": OpSpec(
        "layer_norm_modulate",
        _make_lnm,
        lambda p, s: 2 * _n(p) * s + 2 * p.batch * p.hidden * s,
        lambda p, s: 3 * _n(p) * s + 4 * p.batch * p.hidden * s + 8 * p.rows,
    ),
    "gated_residual": OpSpec(
        "gated_residual",
        _make_gr,
        lambda p, s: 3 * _n(p) * s + p.batch * p.hidden * s,
        lambda p, s: 3 * _n(p) * s + 2 * p.batch * p.hidden * s,
    ),
    "gelu_tanh": OpSpec("gelu_tanh", _make_gelu, lambda p, s: 2 * _n(p) * s, lambda p, s: 3 * _n(p) * s),
    "swiglu": OpSpec("swiglu", _make_swiglu, lambda p, s: 3 * _n(p) * s, lambda p, s: 5 * _n(p) * s),
    "rope": OpSpec(
        "rope",
        _make_rope,
        lambda p, s: 4 * _nqk(p) * s + 8 * _T(p),
        lambda p, s: 4 * _nqk(p) * s + 8 * _T(p),
        n_outputs=2,
        problem_kw=_rope_kw,
    ),
    "qk_norm_rope": OpSpec(
        "qk_norm_rope",
        _make_qknr,
        lambda p, s: 4 * _nqk(p) * s + 2 * p.head_dim * s + 8 * _T(p),
        lambda p, s: 6 * _nqk(p) * s + 4 * p.head_dim * s + 8 * _T(p) + 8 * p.batch * p.heads * p.tokens,
        n_outputs=2,
        problem_kw=_rope_kw,
    ),
}


# Arithmetic per element of the main tensor(s) as our kernels count it (fwd, bwd):
# transcendental functions count as one.  Only used to place points on the roofline:
# every op here sits far left of the ridge point.
FLOPS_PER_ELEMENT: dict[str, tuple[float, float]] = {
    "rms_norm": (4, 9),
    "layer_norm_modulate": (8, 14),
    "gated_residual": (2, 3),
    "gelu_tanh": (9, 15),
    "swiglu": (4, 9),
    "rope": (6, 6),
    "qk_norm_rope": (10, 18),
}


def flops(op: str, problem: Problem, direction: str) -> float:
    n = _nqk(problem) * 2 if op in ("rope", "qk_norm_rope") else _n(problem)
    f, b = FLOPS_PER_ELEMENT[op]
    return n * {"fwd": f, "bwd": b, "fwd+bwd": f + b}[direction]


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
    if fast:
        g = torch.Generator(device=device).manual_seed(seed)
        _DRAW["dtype"] = torch.float32
    try:
        inp = spec(op).make(problem, g)
    finally:
        _DRAW["dtype"] = torch.float64
    dt = as_dtype(dtype)
    args = []
    for name, a in zip(inp.names, inp.args):
        t = a.to(device=device, dtype=torch.float32 if name in inp.tables else dt)
        if requires_grad and name in inp.grads:
            t.requires_grad_(True)
        args.append(t)
    return args, inp, seed


def _tuple(out) -> tuple:
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
    ref_out = _tuple(get_variant(op, "reference")(*ref_args))
    g = torch.Generator().manual_seed(seed + 1)
    douts64 = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in ref_out]
    douts = [d.to(device=device, dtype=dt) for d in douts64]
    ref_douts = [d.to(torch.float64) for d in douts]  # the same rounded upstream gradient
    out = _tuple(v(*args))
    rows = []
    shape = "x".join(map(str, inp.shape))
    # An unfused variant that rounds an intermediate to the dtype (declared at
    # registration as tol_scale) is held to a proportionally wider tolerance.
    tol_scale = float(v.extra.get("tol_scale", 1.0))
    atol, rtol = tolerance(dt, tol_scale)

    def add(tensor, actual, expected, a_tol, r_tol):
        rep = compare(
            actual,
            expected,
            atol=a_tol,
            rtol=r_tol,
            name=f"{op}/{variant} {fmt_dtype(dt)} {shape} {tensor} (seed {seed})",
        )
        rows.append(
            CheckRow(
                op,
                variant,
                fmt_dtype(dt),
                shape,
                tensor,
                rep.max_abs,
                rep.max_rel,
                rep.n_bad,
                rep.numel,
                rep.ok,
                rep.message,
                seed,
            )
        )

    if len(out) != len(ref_out):
        raise AssertionError(f"{op}/{variant} returned {len(out)} outputs, the reference {len(ref_out)}")
    for i, (o, r) in enumerate(zip(out, ref_out)):
        if o.dtype != dt:
            rows.append(
                CheckRow(
                    op,
                    variant,
                    fmt_dtype(dt),
                    shape,
                    f"out{i}",
                    math.inf,
                    math.inf,
                    -1,
                    o.numel(),
                    False,
                    f"{op}/{variant}: output {i} has dtype {o.dtype}, expected {dt}",
                    seed,
                )
            )
            continue
        add("out" if len(out) == 1 else f"out{i}", o, r.detach(), atol, rtol)
    if grads:
        diff = [(n, a, r) for n, a, r in zip(inp.names, args, ref_args) if n in inp.grads]
        got = torch.autograd.grad(out, [a for _, a, _ in diff], douts, allow_unused=True)
        exp = torch.autograd.grad(ref_out, [r for _, _, r in diff], ref_douts, allow_unused=True)
        ga, gr = tolerance(dt, grad_tol_scale * tol_scale)
        n_out = out[0].numel()
        for (n, _, _), a, e in zip(diff, got, exp):
            # A broadcast parameter's gradient is a sum over the rows it was broadcast to:
            # rounding errors of n terms grow like sqrt(n), so its atol does too.
            n_sum = max(1, n_out // max(e.numel(), 1))
            if a is None:
                rows.append(
                    CheckRow(
                        op,
                        variant,
                        fmt_dtype(dt),
                        shape,
                        f"grad {n}",
                        math.inf,
                        math.inf,
                        -1,
                        0,
                        False,
                        f"{op}/{variant}: no gradient for {n!r}",
                        seed,
                    )
                )
                continue
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
    import pandas as pd

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
    out = _tuple(v(*args))
    douts = [torch.randn_like(o) for o in out]
    if direction == "bwd":
        return lambda: torch.autograd.grad(out, diff, douts, retain_graph=True)
    return lambda: torch.autograd.grad(_tuple(v(*args)), diff, douts)


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
) -> None:
    """Providers × sweep: every timeable variant of each op on each problem, dtype and
    direction -> rows (time median/p20/p80, GB/s, % of copy ceiling, speedup over eager,
    peak memory).  Untimeable variants (Triton on CPU) get no rows."""
    items = [(op, p, d, dr) for op in ops for p in problems for d in dtypes for dr in directions]
    if progress:
        from tqdm.auto import tqdm

        items = tqdm(items, desc="sweep")
    for op, p, d, direction in items:
        dt = as_dtype(d)
        kw = spec(op).problem_kw(p)
        eager_ms = None
        vs = [v for v in variants(op, device=device, dtype=dt, **kw) if v.kind != "reference" and v.timeable(device)]
        vs.sort(key=lambda v: v.name != "eager")  # eager first: the speedup baseline
        for v in vs:
            if variant_names is not None and v.name not in variant_names and v.name != "eager":
                continue
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


# ---------------------------------------------------------------------------------------------
# Sizes from the model presets


def preset_dims(preset: str) -> dict:
    """hidden size, heads, head dim and MLP hidden of a model preset (``lab_utils.model.mmdit``)."""
    from .model import mmdit

    if preset not in mmdit.PRESETS:
        raise ValueError(f"parameter 'preset' = {preset!r} is not allowed: expected one of {', '.join(mmdit.PRESETS)}")
    p = mmdit.PRESETS[preset]
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


# ---------------------------------------------------------------------------------------------
# Block level: a whole MMDiT block forward + backward with the fused ops from one provider

BLOCK_PROVIDERS = {
    # name: (kernels variant for every fused op, torch.compile the whole block)
    "eager": ("eager", False),
    "compile": ("eager", True),
    "triton": ("triton", False),
    "triton+compile": ("triton", True),
}


@dataclass
class BlockCase:
    provider: str
    kind: str  # "double" | "single"
    fn: Callable  # one forward + backward
    forward: Callable  # forward only -> outputs
    shape: str
    kernels: str
    compiled: bool


def _block_inputs(cfg, kind: str, batch: int, img_tokens: int, txt_tokens: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    D, half = cfg.hidden_size, cfg.head_dim // 2
    L = img_tokens + txt_tokens
    ang = torch.rand(L, half, generator=g) * 50
    pe = (torch.cos(ang).to(device), torch.sin(ang).to(device))

    def t(*s):
        return torch.randn(*s, generator=g).to(device=device, dtype=dtype).requires_grad_()

    vec = t(batch, D)
    if kind == "double":
        return (t(batch, img_tokens, D), t(batch, txt_tokens, D), vec, pe)
    return (t(batch, L, D), vec, pe)


def block_cases(
    preset: str = "tiny",
    *,
    kinds: Sequence[str] = ("double", "single"),
    providers: Sequence[str] = ("eager", "compile", "triton"),
    batch: int = 1,
    img_tokens: int = 64,
    txt_tokens: int = 16,
    dtype=torch.float32,
    device="cpu",
    seed: int = 0,
) -> list[BlockCase]:
    """One MMDiT block per kind (weights shared by every provider), wrapped per provider."""
    import copy

    from .model import mmdit

    dt = as_dtype(dtype)
    for p in providers:
        if p not in BLOCK_PROVIDERS:
            raise ValueError(f"parameter 'block_providers' has {p!r}; allowed: {', '.join(BLOCK_PROVIDERS)}")
    cfg = mmdit.MMDiTConfig.from_preset(preset)
    out = []
    for kind in kinds:
        if kind not in ("double", "single"):
            raise ValueError(f"parameter 'block_kinds' has {kind!r}; allowed: 'double', 'single'")
        cls = mmdit.DoubleStreamBlock if kind == "double" else mmdit.SingleStreamBlock
        torch.manual_seed(seed)
        base = cls(cfg, mmdit._Seams(mmdit.KernelSet("eager"), cfg.attention_path)).to(device=device, dtype=dt)
        inputs = _block_inputs(cfg, kind, batch, img_tokens, txt_tokens, dt, device, seed)
        diff = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
        for p in providers:
            kernels, comp = BLOCK_PROVIDERS[p]
            blk = copy.deepcopy(base)
            seams = mmdit._Seams(mmdit.KernelSet(kernels, device=device, dtype=dt), cfg.attention_path)
            for m in blk.modules():
                if hasattr(m, "_seams"):
                    m._seams = seams
            fwd = torch.compile(blk) if comp else blk
            params = [q for q in blk.parameters() if q.requires_grad]

            def one(fwd=fwd, params=params, inputs=inputs, diff=diff):
                outs = _tuple(fwd(*inputs))
                return torch.autograd.grad(outs, diff + params, [torch.ones_like(o) for o in outs])

            shape = (
                f"B{batch}xLimg{img_tokens}xLtxt{txt_tokens}xD{cfg.hidden_size}"
                if kind == "double"
                else f"B{batch}xL{img_tokens + txt_tokens}xD{cfg.hidden_size}"
            )
            out.append(
                BlockCase(p, kind, one, lambda fwd=fwd, inputs=inputs: _tuple(fwd(*inputs)), shape, kernels, comp)
            )
    return out


def block_agreement(cases: Sequence[BlockCase], baseline: str = "eager") -> list[dict]:
    """Max abs difference of each provider's block outputs from the baseline provider's
    (same weights, same inputs): shows a fused variant is a drop-in replacement."""
    rows = []
    for kind in dict.fromkeys(c.kind for c in cases):
        ks = [c for c in cases if c.kind == kind]
        base = next((c for c in ks if c.provider == baseline), None)
        if base is None:
            continue
        with torch.no_grad():
            ref = [o.float() for o in base.forward()]
            for c in ks:
                outs = [o.float() for o in c.forward()]
                err = max(float((a - b).abs().max()) for a, b in zip(outs, ref))
                scale = max(float(b.abs().max()) for b in ref)
                rows.append(dict(kind=kind, provider=c.provider, max_abs_diff=err, max_abs_ref=scale))
    return rows


def block_compare(
    rec: Recorder,
    cases: Sequence[BlockCase],
    *,
    device="cpu",
    dtype=torch.float32,
    reps: int = 10,
    budget_s: float = 30.0,
    experiment: str = "block",
) -> None:
    """Time each case's forward + backward (median/p20/p80), speedup over the eager
    provider and peak memory (CUDA).  Providers running Triton on CPU are not timed."""
    dev = torch.device(device)
    eager_ms: dict[str, float] = {}
    for c in sorted(cases, key=lambda c: c.provider != "eager"):
        extra = dict(kind=c.kind, kernels=c.kernels, compiled=c.compiled, direction="fwd+bwd")
        if c.kernels == "triton" and dev.type == "cpu":
            continue  # interpreter: correctness only (block_agreement)
        t = try_bench(c.fn, name=f"{c.kind}/{c.provider}", device=dev, reps=reps, budget_s=budget_s)
        rec.add_timing(experiment, c.provider, t, shape=c.shape, dtype=dtype, **extra)
        if not getattr(t, "ok", False):
            continue
        if c.provider == "eager":
            eager_ms[c.kind] = t.median_ms
        if c.kind in eager_ms:
            rec.add(
                experiment,
                c.provider,
                "speedup_vs_eager",
                eager_ms[c.kind] / t.median_ms,
                "x",
                shape=c.shape,
                dtype=dtype,
                statistic="median",
                formula="eager median / provider median",
                **extra,
            )
        mem = peak_memory_bytes(c.fn, dev)
        if mem is not None:
            rec.add(
                experiment,
                c.provider,
                "peak_memory",
                mem / 2**20,
                "MiB",
                shape=c.shape,
                dtype=dtype,
                statistic="value",
                formula="max_memory_allocated - allocated before the call",
                **extra,
            )


# ---------------------------------------------------------------------------------------------
# The lab's parameters (labs/02_fused_kernels.ipynb; parameterized/sets/02_fused_kernels/*.yaml)


@dataclass(frozen=True)
class FusedKernelsConfig(LabConfig):
    """Parameters of ``labs/02_fused_kernels.ipynb``; defaults are the small CPU set."""

    device: str = "auto"
    op: str = "rms_norm"  # the op of the correctness table and roofline
    dtype: str = "float32"  # the sweep's dtype
    directions: tuple = ("fwd", "fwd+bwd")
    check_dtypes: tuple = ("float32", "bfloat16", "float16")
    check_tokens: int = 37  # correctness problem: irregular on purpose
    check_hidden: int = 781
    check_head_dim: int = 62
    check_variants: tuple = ("eager", "triton", "torch")  # "compile" adds one compile per dtype
    sweep_ops: tuple = ("rms_norm", "gelu_tanh")
    sweep_variants: tuple = ("eager", "torch")  # plus "compile", "triton" (GPU), library names
    preset: str = "small"  # hidden sizes (and MLP width) from the model preset
    tokens: tuple = (128, 1024)
    batch: int = 1
    reps: int = 5
    budget_s: float = 5.0
    block_preset: str = "tiny"
    block_kinds: tuple = ("double", "single")
    block_providers: tuple = ("eager", "triton")
    block_img_tokens: int = 64
    block_txt_tokens: int = 16
    block_dtype: str = "float32"
    compare_compile: bool = True  # eager vs torch.compile of `op`, forward, largest size
    seed: int = 0
    quick_ceilings: bool = True

    def __post_init__(self):
        from .model import mmdit

        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        check_choice("op", self.op, OP_NAMES)
        check_choice("dtype", self.dtype, tuple(DTYPES))
        check_choices("directions", self.directions, DIRECTIONS)
        check_choices("check_dtypes", self.check_dtypes, tuple(DTYPES))
        check_int("check_tokens", self.check_tokens, min=1)
        check_int("check_hidden", self.check_hidden, min=2)
        check_int("check_head_dim", self.check_head_dim, min=2)
        if self.check_head_dim % 2:
            from .config import ConfigError

            raise ConfigError("check_head_dim", self.check_head_dim, "an even integer (rope rotates pairs)")
        check_choices("sweep_ops", self.sweep_ops, OP_NAMES)
        check_choice("preset", self.preset, tuple(mmdit.PRESETS))
        check_int_list("tokens", self.tokens, min=1)
        check_int("batch", self.batch, min=1)
        check_int("reps", self.reps, min=3)
        check_float("budget_s", self.budget_s, min=0, min_exclusive=True)
        check_choice("block_preset", self.block_preset, tuple(mmdit.PRESETS))
        check_choices("block_kinds", self.block_kinds, ("double", "single"))
        check_choices("block_providers", self.block_providers, tuple(BLOCK_PROVIDERS))
        check_int("block_img_tokens", self.block_img_tokens, min=1)
        check_int("block_txt_tokens", self.block_txt_tokens, min=1)
        check_choice("block_dtype", self.block_dtype, tuple(DTYPES))
        check_int("seed", self.seed, min=0)
        check_bool("quick_ceilings", self.quick_ceilings)
        check_bool("compare_compile", self.compare_compile)
        known = set()
        for op in OP_NAMES:
            known |= {v.name for v in variants(op, include_unavailable=True)}
        check_choices("check_variants", self.check_variants, sorted(known - {"reference"}))
        check_choices("sweep_variants", self.sweep_variants, sorted(known - {"reference"}))

    @property
    def check_problem(self) -> Problem:
        return Problem(1, self.check_tokens, self.check_hidden, self.check_head_dim)

    def problems(self) -> list[Problem]:
        return problems_for([self.preset], self.tokens, batch=self.batch)


def sweep_frame(df, experiment: str | None = "op_sweep"):
    """Median GB/s rows of a sweep with their size columns unpacked (for plots)."""
    import json

    import pandas as pd

    d = df[(df.metric == "bandwidth") & (df.statistic == "median")].copy()
    if experiment is not None:
        d = d[d.experiment == experiment]
    if d.empty:
        return pd.DataFrame(columns=["op", "variant", "dtype", "direction", "tokens", "hidden", "bytes", "gbs"])
    ex = d["extra"].map(json.loads)
    for k in ("op", "direction", "tokens", "hidden", "bytes", "kind"):
        d[k] = ex.map(lambda e, k=k: e.get(k))
    d["gbs"] = d["value"]
    d["MB"] = d["bytes"] / 1e6
    return d[["op", "variant", "kind", "dtype", "direction", "tokens", "hidden", "shape", "bytes", "MB", "gbs"]]


# ---------------------------------------------------------------------------------------------
# Views of the rows for the lab's plots (plots read records; they never measure)


def roofline_points(df, ceilings):
    """One roofline point per (op, variant, direction, dtype, shape) from a sweep's median time rows."""
    import json

    import pandas as pd

    from .roofline import roofline

    d = df[(df.metric == "time") & (df.statistic == "median") & (df.experiment == "op_sweep")]
    pts = []
    for _, r in d.iterrows():
        e = json.loads(r["extra"])
        p = Problem(e["batch"], e["tokens"], e["hidden"], e["head_dim"])
        b, f = bytes_moved(e["op"], p, r["dtype"], e["direction"]), flops(e["op"], p, e["direction"])
        pt = roofline(r["value"], bytes=b, flops=f, ceilings=ceilings, dtype=r["dtype"])
        pts.append(
            dict(
                op=e["op"],
                variant=f"{e['op']}/{r['variant']} {e['direction']}",
                dtype=r["dtype"],
                shape=r["shape"],
                intensity=pt.intensity,
                tflops=pt.tflops,
                gbs=pt.gbs,
                time_ms=pt.time_ms,
                pct_of_ceiling=pt.pct_of_ceiling,
            )
        )
    return pd.DataFrame(pts)


def bandwidth_holomap(df, ceilings):
    """GB/s vs bytes moved per variant, the measured copy ceiling drawn; one frame per
    (op, dtype, direction)."""
    from .plots import init

    hv = init()
    d = sweep_frame(df)
    frames = {}
    for (op, dt, dr), g in d.groupby(["op", "dtype", "direction"], sort=True):
        layers = [hv.HLine(ceilings.copy_gbs).opts(color="black", line_dash="dashed", line_width=2)]
        layers.append(
            hv.Text(
                float(g["MB"].min()),
                ceilings.copy_gbs * 1.03,
                f"copy ceiling {ceilings.copy_gbs:.0f} GB/s",
                halign="left",
                fontsize=9,
            )
        )
        for v, gv in g.groupby("variant", sort=True):
            gv = gv.sort_values("MB")
            layers.append(
                hv.Curve(gv, "MB", ["gbs", "shape"], label=v) * hv.Scatter(gv, "MB", ["gbs", "shape"], label=v)
            )
        frames[(op, dt, dr)] = hv.Overlay(layers).opts(
            logx=True,
            xlabel="MB moved per call",
            ylabel="GB/s",
            legend_position="bottom_right",
            title=f"{op} {dt} {dr}: achieved bandwidth",
        )
    if not frames:
        return hv.Div("<p>no timed rows (nothing timeable on this device)</p>")
    return hv.HoloMap(frames, kdims=["op", "dtype", "direction"])


def speedup_table(df, experiment: str = "op_sweep"):
    """op × shape × direction rows, one column per variant: median speedup over eager."""
    import json

    sp = df[(df.metric == "speedup_vs_eager") & (df.experiment == experiment)].copy()
    if sp.empty:
        return sp
    ex = sp["extra"].map(json.loads)
    sp["op"], sp["direction"] = ex.map(lambda e: e["op"]), ex.map(lambda e: e["direction"])
    return sp.pivot_table(index=["op", "shape", "dtype", "direction"], columns="variant", values="value").round(2)


def block_bars(df):
    """Forward + backward time of each block provider (median with p20/p80 in the hover)."""
    import json

    from .plots import init

    hv = init()
    d = df[(df.experiment == "block") & (df.metric == "time") & (df.statistic == "median")].copy()
    if d.empty:
        return hv.Div("<p>no block timings</p>")
    d["kind"] = d["extra"].map(lambda e: json.loads(e)["kind"])
    d["ms"] = d["value"]
    return hv.Bars(d, ["kind", "variant"], ["ms", "shape"]).opts(
        title="MMDiT block forward + backward (median)", ylabel="ms", xlabel="block / provider", multi_level=True
    )


__all__ = [
    "OPS",
    "OP_NAMES",
    "DIRECTIONS",
    "DTYPES",
    "Problem",
    "OpSpec",
    "CheckRow",
    "bytes_moved",
    "flops",
    "check_variant",
    "correctness_table",
    "assert_variant_ok",
    "bench_variant",
    "sweep",
    "make_inputs",
    "problems_for",
    "preset_dims",
    "peak_memory_bytes",
    "BLOCK_PROVIDERS",
    "block_cases",
    "block_agreement",
    "block_compare",
    "FusedKernelsConfig",
    "sweep_frame",
    "roofline_points",
    "bandwidth_holomap",
    "block_bars",
    "speedup_table",
    "lab_kernels",
]
