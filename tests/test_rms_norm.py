"""rms_norm: every variant against the float64 reference, poisoned outputs, bad inputs."""

import pytest
import torch

import lab_kernels
from lab_kernels import get_variant, variants
from lab_kernels import rms_norm as K
from lab_utils.checks import assert_close, poison_, tolerance
from lab_utils.fused import Problem, assert_variant_ok

OP = "rms_norm"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SMALL = Problem(1, 37, 781)  # irregular, interpreter-sized
BIG = Problem(1, 1823, 781)  # the irregular large shape, for the cheap variants


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_matches_reference(dtype):
    assert_variant_ok(OP, "triton", dtype, SMALL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["eager", "torch"])
def test_cheap_variants_match_reference(variant, dtype):
    # the large irregular shape where rounding matters most; the small one elsewhere
    assert_variant_ok(OP, variant, dtype, BIG if dtype == torch.bfloat16 else SMALL)


def test_compile_variant_matches_reference():
    assert_variant_ok(OP, "compile", torch.float32, Problem(1, 19, 96))


def test_poisoned_outputs_are_all_written(gen):
    x = torch.randn(3, 13, 781, generator=gen)
    w = 1 + 0.1 * torch.randn(781, generator=gen)
    y, rstd = poison_(torch.empty_like(x)), poison_(torch.empty(39))
    K.rms_norm_forward(x, w, 1e-6, out=y, rstd=rstd)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    ref = K.reference_rms_norm(xd, wd)
    assert_close(y, ref.detach(), dtype=torch.float32, name="y")
    dy = torch.randn(x.shape, generator=gen)
    dx, dw = poison_(torch.empty_like(x)), poison_(torch.empty_like(w))
    K.rms_norm_backward(dy, x, w, rstd, dx=dx, dw=dw)
    gx, gw = torch.autograd.grad(ref, (xd, wd), dy.double())
    assert_close(dx, gx, dtype=torch.float32, name="dx")
    assert_close(dw, gw, atol=tolerance(torch.float32)[0] * 8, rtol=tolerance(torch.float32)[1], name="dw")


def test_non_contiguous_input_gives_the_right_answer(gen):
    x = torch.randn(781, 37, generator=gen).t()  # (37, 781) with strides (1, 37)
    w = torch.randn(781, generator=gen)
    assert not x.is_contiguous()
    assert_close(K.rms_norm(x, w), K.reference_rms_norm(x.double(), w.double()), dtype=torch.float32)


def test_triton_composes_with_torch_compile(gen):
    x = torch.randn(2, 5, 96, generator=gen, requires_grad=True)
    w = torch.randn(96, generator=gen, requires_grad=True)
    f = torch.compile(K.rms_norm)
    y = f(x, w)
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = K.reference_rms_norm(xd, wd)
    rx, rw = torch.autograd.grad(ref.sum(), (xd, wd))
    assert_close(y, ref, dtype=torch.float32)
    assert_close(gx, rx, dtype=torch.float32, name="dx")
    assert_close(gw, rw, atol=1e-4, rtol=1e-4, name="dw")


def test_bad_inputs_name_the_parameter():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="'weight'.*shape"):
        K.rms_norm(x, torch.randn(63))
    with pytest.raises(TypeError, match="'x'.*int64"):
        K.rms_norm(torch.ones(4, 64, dtype=torch.int64), torch.randn(64))
    with pytest.raises(TypeError, match="'weight'.*float64"):
        K.rms_norm(x, torch.randn(64, dtype=torch.float64))


def test_registry_capabilities():
    names = {v.name for v in variants(OP, device="cpu", dtype=torch.float32)}
    assert {"reference", "eager", "compile", "triton"} <= names
    tri = get_variant(OP, "triton")
    assert "single-pass limit" in tri.why_not("cpu", torch.float32, shape=(2, 1 << 17))
    assert "float64" in tri.why_not("cpu", torch.float64)
    if lab_kernels.TRITON_INTERPRETED:
        assert "TRITON_INTERPRET" in tri.why_not("cuda", torch.float32)
        assert not tri.timeable("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_on_gpu_large_irregular(dtype):
    assert_variant_ok(OP, "triton", dtype, BIG, device="cuda")
