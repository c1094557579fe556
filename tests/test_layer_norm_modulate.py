"""layer_norm_modulate: every variant against float64, poisoned outputs, bad inputs."""

import pytest
import torch

from lab_kernels import get_variant, variants
from lab_kernels import layer_norm_modulate as K
from lab_utils.checks import assert_close, poison_, tolerance
from lab_utils.fused import Problem, assert_variant_ok

OP = "layer_norm_modulate"
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
    B, L, D = 3, 11, 781
    x = 2 * torch.randn(B, L, D, generator=gen) + 0.5
    sh, sc = torch.randn(B, D, generator=gen), torch.randn(B, D, generator=gen)
    y, mean, rstd = (poison_(torch.empty_like(x)), poison_(torch.empty(B * L)), poison_(torch.empty(B * L)))
    K.layer_norm_modulate_forward(x, sh, sc, 1e-6, out=y, mean=mean, rstd=rstd)
    xd, shd, scd = (t.double().requires_grad_() for t in (x, sh, sc))
    ref = K.reference_layer_norm_modulate(xd, shd, scd)
    assert_close(y, ref.detach(), dtype=torch.float32, name="y")
    dy = torch.randn(x.shape, generator=gen)
    dx, dsh, dsc = poison_(torch.empty_like(x)), poison_(torch.empty_like(sh)), poison_(torch.empty_like(sc))
    K.layer_norm_modulate_backward(dy, x, sh, sc, mean, rstd, dx=dx, dshift=dsh, dscale=dsc)
    gx, gsh, gsc = torch.autograd.grad(ref, (xd, shd, scd), dy.double())
    atol, rtol = tolerance(torch.float32)
    assert_close(dx, gx, atol=atol * 2, rtol=rtol, name="dx")
    assert_close(dsh, gsh, atol=atol * 4, rtol=rtol, name="dshift")
    assert_close(dsc, gsc, atol=atol * 4, rtol=rtol, name="dscale")


def test_modulation_as_b1d_and_non_contiguous_x(gen):
    x = torch.randn(2, 96, 13, generator=gen).transpose(1, 2)  # (2, 13, 96), not contiguous
    sh, sc = torch.randn(2, 1, 96, generator=gen), torch.randn(2, 1, 96, generator=gen)
    out = K.layer_norm_modulate(x, sh, sc)
    assert_close(out, K.reference_layer_norm_modulate(x.double(), sh.double(), sc.double()), dtype=torch.float32)


def test_triton_composes_with_torch_compile(gen):
    x = torch.randn(2, 5, 96, generator=gen, requires_grad=True)
    sh = torch.randn(2, 96, generator=gen, requires_grad=True)
    sc = torch.randn(2, 96, generator=gen, requires_grad=True)
    y = torch.compile(K.layer_norm_modulate)(x, sh, sc)
    got = torch.autograd.grad(y.sum(), (x, sh, sc))
    ds = [t.detach().double().requires_grad_() for t in (x, sh, sc)]
    ref = K.reference_layer_norm_modulate(*ds)
    exp = torch.autograd.grad(ref.sum(), ds)
    assert_close(y, ref, dtype=torch.float32)
    for n, a, e in zip(("dx", "dshift", "dscale"), got, exp):
        assert_close(a, e, atol=1e-4, rtol=1e-4, name=n)


def test_bad_inputs_name_the_parameter():
    x, v = torch.randn(2, 5, 64), torch.randn(2, 64)
    with pytest.raises(ValueError, match="'shift'.*shape"):
        K.layer_norm_modulate(x, torch.randn(2, 63), v)
    with pytest.raises(ValueError, match="'scale'.*shape"):
        K.layer_norm_modulate(x, v, torch.randn(3, 64))
    with pytest.raises(ValueError, match="'x'.*\\(B, L, D\\)"):
        K.layer_norm_modulate(torch.randn(5, 64), v, v)
    with pytest.raises(TypeError, match="'x'.*int32"):
        K.layer_norm_modulate(x.int(), v, v)


def test_registry_capabilities():
    assert {"reference", "eager", "compile", "triton"} <= {v.name for v in variants(OP, device="cpu")}
    assert "limit" in get_variant(OP, "triton").why_not("cpu", torch.bfloat16, shape=(1, 4, 100_000))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_on_gpu_large_irregular(dtype):
    assert_variant_ok(OP, "triton", dtype, BIG, device="cuda")
