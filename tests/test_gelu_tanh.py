"""gelu_tanh: every variant against float64, poisoned outputs, bad inputs."""

import pytest
import torch

from lab_kernels import gelu_tanh as K
from lab_kernels import variants
from lab_utils.checks import assert_close, poison_
from lab_utils.fused import Problem, assert_variant_ok

OP = "gelu_tanh"
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


def test_extreme_inputs_stay_finite():
    # tanh through a sigmoid: saturates cleanly at ±1 for huge |u|, no inf/inf
    x = torch.tensor([-1e4, -30.0, -5.0, 0.0, 5.0, 30.0, 1e4])
    assert_close(K.gelu_tanh(x), K.reference_gelu_tanh(x.double()), dtype=torch.float32)


def test_poisoned_outputs_are_all_written(gen):
    x = 2 * torch.randn(3, 1001, generator=gen)
    y = poison_(torch.empty_like(x))
    K.gelu_tanh_forward(x, out=y)
    xd = x.double().requires_grad_()
    ref = K.reference_gelu_tanh(xd)
    assert_close(y, ref.detach(), dtype=torch.float32, name="y")
    dy = torch.randn(x.shape, generator=gen)
    dx = poison_(torch.empty_like(x))
    K.gelu_tanh_backward(dy, x, dx=dx)
    (gx,) = torch.autograd.grad(ref, xd, dy.double())
    assert_close(dx, gx, dtype=torch.float32, name="dx")


def test_non_contiguous_input(gen):
    x = torch.randn(96, 13, generator=gen).t()
    assert_close(K.gelu_tanh(x), K.reference_gelu_tanh(x.double()), dtype=torch.float32)


def test_triton_composes_with_torch_compile(gen):
    x = torch.randn(4, 100, generator=gen, requires_grad=True)
    y = torch.compile(K.gelu_tanh)(x)
    (gx,) = torch.autograd.grad(y.sum(), x)
    xd = x.detach().double().requires_grad_()
    ref = K.reference_gelu_tanh(xd)
    (rx,) = torch.autograd.grad(ref.sum(), xd)
    assert_close(y, ref, dtype=torch.float32)
    assert_close(gx, rx, dtype=torch.float32, name="dx")


def test_bad_inputs_name_the_parameter():
    with pytest.raises(TypeError, match="'x'.*int64"):
        K.gelu_tanh(torch.ones(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="'x'.*float64"):
        K.gelu_tanh(torch.ones(4, dtype=torch.float64))


def test_registry_lists_variants():
    assert {"reference", "eager", "compile", "triton"} <= {v.name for v in variants(OP, device="cpu")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_on_gpu_large_irregular(dtype):
    assert_variant_ok(OP, "triton", dtype, BIG, device="cuda")
