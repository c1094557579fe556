"""What every fused op of lab_kernels shares, one parametrized module: each variant × dtype
against float64 (forward outputs and every gradient), poisoned output buffers, torch.compile
(the "compile" variant and the Triton ops inside a compiled function), non-contiguous
inputs, the registry's public API, the large irregular shapes (through the interpreter on
CPU, smaller), and the GPU cases (skipped with the reason on CPU).  Each op's own test file
keeps only what is specific to it.

Random inputs come from the ``gen`` fixture: a failing case reports its seed and
``PERFLAB_SEED=<seed>`` replays it."""

import math
import os
import subprocess
import sys

import pytest
import torch

import lab_kernels
from lab_kernels import (
    gated_residual,
    gelu_tanh,
    get_variant,
    layer_norm_modulate,
    qk_norm_rope,
    register,
    rms_norm,
    rope,
    swiglu,
    unregister,
    variant_names,
    variants,
)
from lab_utils.core.checks import compare, poison_, rel_error, tolerance
from lab_utils.fused import ops as fused

OPS = fused.OP_NAMES
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ON_GPU = torch.cuda.is_available()
# Irregular sizes: tokens and hidden are not powers of two, head dim 62 (an odd pair count).
SMALL = {op: fused.Problem(2, 37, 781) for op in OPS} | {
    "rope": fused.Problem(2, 37, 186, head_dim=62),
    "qk_norm_rope": fused.Problem(2, 37, 186, head_dim=62),
}


def _big(tokens: int) -> dict:
    return {op: fused.Problem(1, tokens, 781) for op in OPS} | {
        "rope": fused.Problem(1, tokens, 768, head_dim=128),
        "qk_norm_rope": fused.Problem(1, tokens, 768, head_dim=128),
    }


# The large irregular shape; through the interpreter (CPU) with fewer tokens, still many
# row tiles per program of the grid-stride backward loops.
BIG = _big(1823)
BIG_HERE = BIG if ON_GPU else _big(263)
TINY = {op: fused.Problem(1, 19, 96, head_dim=32) for op in OPS}
# Variants every op registers; a library variant where one exists.
CHEAP = [(op, v) for op in OPS for v in ("eager",) + (("torch",) if op == "rms_norm" else ())]


def _seed(gen: torch.Generator) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=gen))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_triton_matches_float64(op, dtype, gen):
    fused.assert_variant_ok(op, "triton", dtype, SMALL[op], seed=_seed(gen))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op,variant", CHEAP)
def test_cheap_variants_match_float64(op, variant, dtype, gen):
    # bfloat16 on the large irregular shape, where rounding matters most
    problem = BIG[op] if dtype == torch.bfloat16 else SMALL[op]
    fused.assert_variant_ok(op, variant, dtype, problem, seed=_seed(gen))


# Peer libraries' kernels (Liger-Kernel: lab_kernels.liger), registered as Triton variants with
# extra["library"]: the same float64 checks, forward and every gradient, small and large shapes.
PEERS = [(op, v.name) for op in OPS for v in variants(op, include_unavailable=True) if v.extra.get("library")]
#: the only reasons a peer variant may not run its check on this machine (anything else fails)
PEER_REFUSALS = ("computes in bfloat16, which Triton's interpreter gets wrong", "needs TRITON_INTERPRET=1")


def _peer_runs(op, variant, dtype, problem) -> None:
    """Skip with the reason when the variant cannot run here for an allowed reason; fail otherwise."""
    why = get_variant(op, variant).why_not("cpu", dtype, **fused.spec(op).problem_kw(problem))
    if why is not None:
        assert any(r in why for r in PEER_REFUSALS), f"{op}/{variant} {dtype} cannot run: {why}"
        pytest.skip(why)


def test_every_block_op_liger_covers_has_a_peer_variant():
    assert {op for op, v in PEERS if v == "liger"} == {"rms_norm", "layer_norm_modulate", "swiglu", "rope"}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op,variant", PEERS)
def test_peer_variants_match_float64(op, variant, dtype, gen):
    _peer_runs(op, variant, dtype, SMALL[op])
    fused.assert_variant_ok(op, variant, dtype, SMALL[op], seed=_seed(gen))


@pytest.mark.parametrize("op,variant", PEERS)
def test_peer_variants_large_irregular(op, variant, gen):
    """The irregular large shape through the interpreter (fewer tokens), float32."""
    _peer_runs(op, variant, torch.float32, BIG_HERE[op])
    fused.assert_variant_ok(op, variant, torch.float32, BIG_HERE[op], seed=_seed(gen))


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: the caching allocator is what gets poisoned")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op,variant", PEERS)
def test_peer_outputs_over_poisoned_memory(op, variant, dtype, gen):
    """A peer library allocates its own outputs (no buffer to hand it): fill the CUDA caching
    allocator's free memory with NaN first, so an element its kernels leave unwritten reads NaN and
    fails the float64 check (which counts NaN disagreements), at the large irregular shape."""
    poison = torch.full((1 << 28,), float("nan"), device="cuda")
    del poison  # its blocks return to the cache, NaN-filled, for the allocations below
    fused.assert_variant_ok(op, variant, dtype, BIG[op], device="cuda", seed=_seed(gen))


#: unit roundoff (half the spacing of 1.0's neighbours) of the low-precision dtypes
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("variant", ["eager", "triton"])
@pytest.mark.parametrize("op", OPS)
def test_low_precision_error_is_a_rounding_not_a_percent(op, variant, dtype, gen):
    """The elementwise check above allows 1.6e-2 (bfloat16) and 2e-3 (float16) per element, and
    twice that for gradients: a systematic error of a percent (bfloat16) or 0.13% (float16) passes
    it.  Norm-wise, a result rounded to the dtype once or a few times is off by about one unit
    roundoff u (measured: at most 1.1 u over every op, variant, output and gradient; the Triton
    interpreter truncates to bfloat16, up to 2 u per element); so each output and gradient must be
    within 2 u of float64 in ||a - e|| / ||e||, which a 1% error in bfloat16 (2.6 u) or 0.13% in
    float16 (2.7 u) fails."""
    seed = _seed(gen)
    args, inp, _ = fused.make_inputs(op, TINY[op], dtype, seed=seed)
    ref_args = [a.detach().double().requires_grad_(a.requires_grad) for a in args]
    ref = fused.as_tuple(get_variant(op, "reference")(*ref_args))
    out = fused.as_tuple(get_variant(op, variant)(*args))
    g = torch.Generator().manual_seed(seed + 1)
    douts = [torch.randn(r.shape, generator=g, dtype=torch.float64).to(dtype) for r in ref]
    diff = [(n, a, r) for n, a, r in zip(inp.names, args, ref_args) if n in inp.grads]
    got = torch.autograd.grad(out, [a for _, a, _ in diff], douts)
    want = torch.autograd.grad(ref, [r for _, _, r in diff], [d.double() for d in douts])
    names = [f"out{i}" for i in range(len(out))] + [f"grad {n}" for n, _, _ in diff]
    u = UNIT_ROUNDOFF[dtype]
    for name, a, e in zip(names, list(out) + list(got), list(ref) + list(want)):
        err = rel_error(a, e)
        assert err <= 2 * u, f"{op}/{variant} {dtype} {name}: ||a - e|| / ||e|| = {err / u:.2f} u (seed {seed})"


@pytest.mark.parametrize("op", OPS)
def test_triton_large_irregular(op, gen):
    """The irregular large shape (fewer tokens through the interpreter; every dtype on a GPU)."""
    for dtype in DTYPES if ON_GPU else [torch.float32]:
        fused.assert_variant_ok(op, "triton", dtype, BIG_HERE[op], device="cuda" if ON_GPU else "cpu", seed=_seed(gen))


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS)
def test_compile_variant_and_triton_inside_compile(op, gen):
    fused.assert_variant_ok(op, "compile", torch.float32, TINY[op], seed=_seed(gen))
    tri = get_variant(op, "triton")
    register(op, "triton_compiled", torch.compile(tri.fn), kind="triton", dtypes=tri.dtypes)
    try:
        fused.assert_variant_ok(op, "triton_compiled", torch.float32, TINY[op], seed=_seed(gen))
    finally:
        unregister(op, "triton_compiled")


def _transposed_strides(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dims' strides swapped (not contiguous)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 2 else t


@pytest.mark.parametrize("op", OPS)
def test_non_contiguous_inputs(op, gen):
    args, _, seed = fused.make_inputs(op, SMALL[op], torch.float32, seed=_seed(gen), requires_grad=False)
    strided = [_transposed_strides(a) for a in args]
    assert any(not a.is_contiguous() for a in strided)
    got = _outputs(op, "triton", strided)
    exp = _outputs(op, "reference", [a.double() for a in args])
    for i, (g, e) in enumerate(zip(got, exp)):
        atol, rtol = tolerance(torch.float32)
        rep = compare(g, e, atol=atol, rtol=rtol, name=f"{op} out{i} from strided inputs (seed {seed})")
        assert rep.ok, rep.message


def _outputs(op, variant, args) -> tuple:
    out = get_variant(op, variant)(*args)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# ---------------------------------------------------------------------------------------------
# Poisoned outputs: the host launchers write into given (NaN-filled) buffers; every element of
# every output and gradient must be written.  One entry per op: (args, dy) -> (outputs, grads).


def _p(t: torch.Tensor) -> torch.Tensor:
    return poison_(torch.empty_like(t))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return poison_(torch.empty(x.numel() // x.shape[-1]))


def _rms(args, dy):
    x, w = args
    y, r = _p(x), _rows(x)
    rms_norm.rms_norm_forward(x, w, 1e-6, out=y, rstd=r)
    dx, dw = _p(x), _p(w)
    rms_norm.rms_norm_backward(dy[0], x, w, r, dx=dx, dw=dw)
    return (y,), (dx, dw)


def _lnm(args, dy):
    x, sh, sc = args
    y, mean, rstd = _p(x), _rows(x), _rows(x)
    layer_norm_modulate.layer_norm_modulate_forward(x, sh, sc, 1e-6, out=y, mean=mean, rstd=rstd)
    dx, dsh, dsc = _p(x), _p(sh), _p(sc)
    layer_norm_modulate.layer_norm_modulate_backward(dy[0], x, sh, sc, mean, rstd, dx=dx, dshift=dsh, dscale=dsc)
    return (y,), (dx, dsh, dsc)


def _gr(args, dy):
    x, gate, y = args
    out = _p(x)
    gated_residual.gated_residual_forward(x, gate, y, out=out)
    dyy, dgate = _p(y), _p(gate)
    dx, _, _ = gated_residual.gated_residual_backward(dy[0], x, gate, y, dy=dyy, dgate=dgate)
    return (out,), (dx, dgate, dyy)


def _gelu(args, dy):
    (x,) = args
    y, dx = _p(x), _p(x)
    gelu_tanh.gelu_tanh_forward(x, out=y)
    gelu_tanh.gelu_tanh_backward(dy[0], x, dx=dx)
    return (y,), (dx,)


def _swiglu(args, dy):
    g, u = args
    out, dg, du = _p(g), _p(g), _p(u)
    swiglu.swiglu_forward(g, u, out=out)
    swiglu.swiglu_backward(dy[0], g, u, dgate=dg, dup=du)
    return (out,), (dg, du)


def _rope(args, dy):
    q, k, cos, sin = args
    outs, grads = [], []
    for x, d in zip((q, k), dy):
        o, dx = _p(x), _p(x)
        rope.rope_forward(x, cos, sin, out=o)
        rope.rope_backward(d, cos, sin, out=dx)
        outs.append(o)
        grads.append(dx)
    return tuple(outs), tuple(grads)


def _qknr(args, dy):
    q, k, qw, kw, cos, sin = args
    outs, gx, gw = [], [], []
    for x, w, d in zip((q, k), (qw, kw), dy):
        o, r = _p(x), _rows(x)
        qk_norm_rope.qk_norm_rope_forward(x, w, cos, sin, 1e-6, out=o, rstd=r)
        dx, dw = _p(x), _p(w)
        qk_norm_rope.qk_norm_rope_backward(d, x, w, cos, sin, r, dx=dx, dw=dw)
        outs.append(o)
        gx.append(dx)
        gw.append(dw)
    return tuple(outs), (gx[0], gx[1], gw[0], gw[1])


POISONED = {
    "rms_norm": _rms,
    "layer_norm_modulate": _lnm,
    "gated_residual": _gr,
    "gelu_tanh": _gelu,
    "swiglu": _swiglu,
    "rope": _rope,
    "qk_norm_rope": _qknr,
}


def test_every_op_has_a_poisoned_output_case():
    assert set(POISONED) == set(OPS)


@pytest.mark.parametrize("op", OPS)
def test_poisoned_outputs_are_all_written(op, gen):
    args, inp, seed = fused.make_inputs(op, SMALL[op], torch.float32, seed=_seed(gen), requires_grad=False)
    ref_args = [a.double().requires_grad_(n in inp.grads) for n, a in zip(inp.names, args)]
    ref = _outputs(op, "reference", ref_args)
    g = torch.Generator().manual_seed(seed + 1)
    dy = [torch.randn(r.shape, generator=g) for r in ref]
    outs, grads = POISONED[op](args, dy)
    exp = torch.autograd.grad(ref, [a for a in ref_args if a.requires_grad], [d.double() for d in dy])
    atol, rtol = tolerance(torch.float32)
    for i, (o, r) in enumerate(zip(outs, ref)):
        rep = compare(o, r.detach(), atol=atol, rtol=rtol, name=f"{op} out{i} (seed {seed})")
        assert rep.ok, rep.message
    names = [n for n in inp.names if n in inp.grads]
    for n, got, e in zip(names, grads, exp, strict=True):
        n_sum = max(1, outs[0].numel() // e.numel())  # a broadcast parameter's gradient sums n rows
        ga, gr = tolerance(torch.float32, fused.GRAD_TOL_SCALE)
        rep = compare(got, e, atol=ga * math.sqrt(n_sum), rtol=gr, name=f"{op} grad {n} (seed {seed})")
        assert rep.ok, rep.message


# ---------------------------------------------------------------------------------------------
# Registry


@pytest.mark.parametrize("op", OPS)
def test_registry_public_api(op):
    names = variant_names(op)
    assert {"reference", "eager", "compile", "triton"} <= set(names)
    assert names == tuple(v.name for v in variants(op, include_unavailable=True))
    assert op in lab_kernels.list_ops()
    tri = get_variant(op, "triton")
    assert tri.kind == "triton" and "float64" in tri.why_not("cpu", torch.float64)
    assert {v.name for v in variants(op, device="cpu", dtype=torch.float32)} >= {"reference", "eager"}
    if lab_kernels.TRITON_INTERPRETED:
        assert "TRITON_INTERPRET" in tri.why_not("cuda", torch.float32)
        assert not tri.timeable("cpu") and get_variant(op, "eager").timeable("cpu")
    with pytest.raises(KeyError, match="not a variant"):
        get_variant(op, "nope")


def test_unknown_op_names_the_known_ones():
    with pytest.raises(KeyError, match="rms_norm"):
        variant_names("layernorm")


def test_one_interpreter_predicate():
    assert lab_kernels.TRITON_INTERPRETED == (os.environ.get("TRITON_INTERPRET") == "1")
    assert lab_kernels.TRITON_INTERPRETED == (not ON_GPU or os.environ.get("TRITON_INTERPRET") == "1")


# ---------------------------------------------------------------------------------------------
# GPU


GPU_PATH_SCRIPT = r"""
import lab_kernels, torch
assert not lab_kernels.TRITON_INTERPRETED
import lab_kernels._common as C
from lab_kernels import rms_norm, layer_norm_modulate, gated_residual, gelu_tanh, swiglu, rope, qk_norm_rope
from torch._subclasses.fake_tensor import FakeTensorMode
C._sm_count = lambda idx: 132                 # no GPU to ask; the trace only needs a number
bf = torch.bfloat16
with FakeTensorMode():
    e = lambda *s, dt=bf: torch.empty(*s, dtype=dt, device="cuda")
    x, w = e(2, 37, 781), e(781)
    y, r = rms_norm.rms_norm_forward(x, w); dx, dw = rms_norm.rms_norm_backward(y, x, w, r)
    assert (y.shape, r.shape, dx.shape, dw.shape) == (x.shape, (74,), x.shape, w.shape) and y.dtype == bf
    sh, sc = e(2, 781), e(2, 781)
    y, m, r = layer_norm_modulate.layer_norm_modulate_forward(x, sh, sc)
    g = layer_norm_modulate.layer_norm_modulate_backward(y, x, sh, sc, m, r)
    assert [t.shape for t in g] == [x.shape, sh.shape, sc.shape]
    o = gated_residual.gated_residual_forward(x, sh, x); g = gated_residual.gated_residual_backward(o, x, sh, x)
    assert [t.shape for t in g] == [x.shape, x.shape, sh.shape]
    o = gelu_tanh.gelu_tanh_forward(x); assert gelu_tanh.gelu_tanh_backward(o, x).shape == x.shape
    o = swiglu.swiglu_forward(x, x); assert [t.shape for t in swiglu.swiglu_backward(o, x, x)] == [x.shape] * 2
    q, cos, sin = e(2, 3, 37, 62), e(37, 31, dt=torch.float32), e(37, 31, dt=torch.float32)
    o = rope.rope_forward(q, cos, sin); assert rope.rope_backward(o, cos, sin).shape == q.shape
    qw = e(62)
    o, r = qk_norm_rope.qk_norm_rope_forward(q, qw, cos, sin)
    g = qk_norm_rope.qk_norm_rope_backward(o, q, qw, cos, sin, r)
    assert [t.shape for t in g] == [q.shape, qw.shape] and r.shape == (2 * 3 * 37,)
print("GPU-path ops traced")
"""


def test_gpu_registration_traces_with_fake_cuda_tensors(tmp_path):
    """Without a GPU, import the kernels as a GPU machine would (TRITON_INTERPRET=0: the host
    functions become torch.library.triton_op with wrap_triton launches) and trace every forward
    and backward host op on fake CUDA tensors: registration, launch grids and output
    shapes/dtypes of the GPU path run here, only the kernels themselves do not."""
    script = tmp_path / "gpu_path.py"
    script.write_text(GPU_PATH_SCRIPT)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1200, cwd=root)
    assert r.returncode == 0 and "GPU-path ops traced" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (compiled Triton)")
@pytest.mark.parametrize("op", OPS)
def test_gpu_runs_compiled_triton(op):
    """On a GPU the kernels are compiled, the Triton variant runs and is timed there."""
    assert not lab_kernels.TRITON_INTERPRETED
    tri = get_variant(op, "triton")
    assert tri.why_not("cuda", torch.bfloat16, **fused.spec(op).problem_kw(BIG[op])) is None
    assert tri.timeable("cuda")
