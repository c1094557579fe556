"""gated_residual: every variant against float64, poisoned outputs, bad inputs."""

import pytest
import torch

from lab_kernels import gated_residual as K
from lab_kernels import variants
from lab_utils.checks import assert_close, poison_, tolerance
from lab_utils.fused import Problem, assert_variant_ok

OP = "gated_residual"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SMALL = Problem(2, 37, 781)
BIG = Problem(1, 1823, 781)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_matches_reference(dtype):
    assert_variant_ok(OP, "triton", dtype, SMALL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eager_matches_reference(dtype):
    assert_variant_ok(OP, "eager", dtype, BIG if dtype == torch.bfloat16 else SMALL)


def test_compile_variant_matches_reference():
    assert_variant_ok(OP, "compile", torch.float32, Problem(2, 19, 96))


def test_poisoned_outputs_are_all_written(gen):
    B, L, D = 2, 45, 300
    x, y = torch.randn(B, L, D, generator=gen), torch.randn(B, L, D, generator=gen)
    gate = torch.randn(B, D, generator=gen)
    out = poison_(torch.empty_like(x))
    K.gated_residual_forward(x, gate, y, out=out)
    xd, gd, yd = (t.double().requires_grad_() for t in (x, gate, y))
    ref = K.reference_gated_residual(xd, gd, yd)
    assert_close(out, ref.detach(), dtype=torch.float32, name="out")
    dout = torch.randn(x.shape, generator=gen)
    dy, dgate = poison_(torch.empty_like(y)), poison_(torch.empty_like(gate))
    dx, _, _ = K.gated_residual_backward(dout, x, gate, y, dy=dy, dgate=dgate)
    gx, gg, gy = torch.autograd.grad(ref, (xd, gd, yd), dout.double())
    atol, rtol = tolerance(torch.float32)
    assert_close(dx, gx, dtype=torch.float32, name="dx")
    assert_close(dy, gy, dtype=torch.float32, name="dy")
    assert_close(dgate, gg, atol=atol * 8, rtol=rtol, name="dgate")


def test_non_contiguous_and_b1d_gate(gen):
    x = torch.randn(2, 96, 13, generator=gen).transpose(1, 2)
    y = torch.randn(2, 13, 96, generator=gen)
    gate = torch.randn(2, 1, 96, generator=gen)
    assert_close(
        K.gated_residual(x, gate, y),
        K.reference_gated_residual(x.double(), gate.double(), y.double()),
        dtype=torch.float32,
    )


def test_triton_composes_with_torch_compile(gen):
    ts = [torch.randn(2, 5, 96, generator=gen), torch.randn(2, 96, generator=gen), torch.randn(2, 5, 96, generator=gen)]
    ts = [t.requires_grad_() for t in ts]
    out = torch.compile(K.gated_residual)(*ts)
    got = torch.autograd.grad(out.sum(), ts)
    ds = [t.detach().double().requires_grad_() for t in ts]
    ref = K.reference_gated_residual(*ds)
    exp = torch.autograd.grad(ref.sum(), ds)
    assert_close(out, ref, dtype=torch.float32)
    for n, a, e in zip(("dx", "dgate", "dy"), got, exp):
        assert_close(a, e, atol=1e-4, rtol=1e-4, name=n)


def test_bad_inputs_name_the_parameter():
    x = torch.randn(2, 5, 64)
    with pytest.raises(ValueError, match="'gate'.*shape"):
        K.gated_residual(x, torch.randn(2, 65), x)
    with pytest.raises(ValueError, match="'y'.*shape"):
        K.gated_residual(x, torch.randn(2, 64), torch.randn(2, 6, 64))
    with pytest.raises(TypeError, match="'gate'.*int64"):
        K.gated_residual(x, torch.ones(2, 64, dtype=torch.int64), x)


def test_registry_lists_variants():
    assert {"reference", "eager", "compile", "triton"} <= {v.name for v in variants(OP, device="cpu")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_on_gpu_large_irregular(dtype):
    assert_variant_ok(OP, "triton", dtype, BIG, device="cuda")
