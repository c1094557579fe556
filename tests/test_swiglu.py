"""swiglu: every variant against float64, poisoned outputs, bad inputs."""

import pytest
import torch

from lab_kernels import swiglu as K
from lab_kernels import variants
from lab_utils.checks import assert_close, poison_
from lab_utils.fused import Problem, assert_variant_ok

OP = "swiglu"
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
    g, u = 2 * torch.randn(3, 1001, generator=gen), torch.randn(3, 1001, generator=gen)
    out = poison_(torch.empty_like(g))
    K.swiglu_forward(g, u, out=out)
    gd, ud = g.double().requires_grad_(), u.double().requires_grad_()
    ref = K.reference_swiglu(gd, ud)
    assert_close(out, ref.detach(), dtype=torch.float32, name="out")
    do = torch.randn(g.shape, generator=gen)
    dg, du = poison_(torch.empty_like(g)), poison_(torch.empty_like(u))
    K.swiglu_backward(do, g, u, dgate=dg, dup=du)
    eg, eu = torch.autograd.grad(ref, (gd, ud), do.double())
    assert_close(dg, eg, dtype=torch.float32, name="dgate")
    assert_close(du, eu, dtype=torch.float32, name="dup")


def test_non_contiguous_inputs(gen):
    g = torch.randn(96, 13, generator=gen).t()
    u = torch.randn(13, 96, generator=gen)
    assert_close(K.swiglu(g, u), K.reference_swiglu(g.double(), u.double()), dtype=torch.float32)


def test_triton_composes_with_torch_compile(gen):
    g = torch.randn(4, 100, generator=gen, requires_grad=True)
    u = torch.randn(4, 100, generator=gen, requires_grad=True)
    out = torch.compile(K.swiglu)(g, u)
    got = torch.autograd.grad(out.sum(), (g, u))
    ds = [t.detach().double().requires_grad_() for t in (g, u)]
    ref = K.reference_swiglu(*ds)
    exp = torch.autograd.grad(ref.sum(), ds)
    assert_close(out, ref, dtype=torch.float32)
    for n, a, e in zip(("dgate", "dup"), got, exp):
        assert_close(a, e, dtype=torch.float32, name=n)


def test_bad_inputs_name_the_parameter():
    with pytest.raises(ValueError, match="'up'.*shape"):
        K.swiglu(torch.randn(4, 8), torch.randn(4, 9))
    with pytest.raises(TypeError, match="'gate'.*int64"):
        K.swiglu(torch.ones(4, dtype=torch.int64), torch.ones(4))


def test_registry_lists_variants():
    assert {"reference", "eager", "compile", "triton"} <= {v.name for v in variants(OP, device="cpu")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_on_gpu_large_irregular(dtype):
    assert_variant_ok(OP, "triton", dtype, BIG, device="cuda")
