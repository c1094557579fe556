"""qk_norm_rope: every variant against float64, poisoned outputs, strides, bad inputs."""

import pytest
import torch

from lab_kernels import get_variant, variants
from lab_kernels import qk_norm_rope as K
from lab_utils.checks import assert_close, poison_, tolerance
from lab_utils.fused import Problem, assert_variant_ok

OP = "qk_norm_rope"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SMALL = Problem(2, 37, 186, head_dim=62)
BIG = Problem(1, 1823, 768, head_dim=128)


def _tables(L, half, gen, batch=None):
    ang = torch.rand(*((batch,) if batch else ()), L, half, generator=gen) * 100
    return torch.cos(ang), torch.sin(ang)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_matches_reference(dtype):
    assert_variant_ok(OP, "triton", dtype, SMALL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eager_matches_reference(dtype):
    assert_variant_ok(OP, "eager", dtype, BIG if dtype == torch.bfloat16 else SMALL)


def test_compile_variant_matches_reference():
    assert_variant_ok(OP, "compile", torch.float32, Problem(1, 19, 64, head_dim=32))


def test_poisoned_outputs_are_all_written(gen):
    B, H, L, Dh = 2, 3, 11, 62
    x = torch.randn(B, H, L, Dh, generator=gen)
    w = 1 + 0.1 * torch.randn(Dh, generator=gen)
    cos, sin = _tables(L, Dh // 2, gen, batch=B)
    out, rstd = poison_(torch.empty_like(x)), poison_(torch.empty(B * H * L))
    K.qk_norm_rope_forward(x, w, cos, sin, 1e-6, out=out, rstd=rstd)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    ref, _ = K.reference_qk_norm_rope(xd, xd, wd, wd, cos.double(), sin.double())
    assert_close(out, ref.detach(), dtype=torch.float32, name="out")
    dy = torch.randn(x.shape, generator=gen)
    dx, dw = poison_(torch.empty_like(x)), poison_(torch.empty_like(w))
    K.qk_norm_rope_backward(dy, x, w, cos, sin, rstd, dx=dx, dw=dw)
    gx, gw = torch.autograd.grad(ref, (xd, wd), dy.double())
    atol, rtol = tolerance(torch.float32)
    assert_close(dx, gx, dtype=torch.float32, name="dx")
    assert_close(dw, gw, atol=atol * 20, rtol=rtol, name="dweight")


def test_strided_qk_views(gen):
    B, L, H, Dh = 2, 13, 3, 32
    qkv = torch.randn(B, L, 3, H, Dh, generator=gen, requires_grad=True)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    qw = (1 + 0.1 * torch.randn(Dh, generator=gen)).requires_grad_()
    kw = (1 + 0.1 * torch.randn(Dh, generator=gen)).requires_grad_()
    cos, sin = _tables(L, Dh // 2, gen)
    qo, ko = K.qk_norm_rope(q, k, qw, kw, cos, sin)
    got = torch.autograd.grad(qo.sum() + 3 * ko.sum(), (qkv, qw, kw))
    ds = [t.detach().double().requires_grad_() for t in (qkv, qw, kw)]
    rq, rk = K.reference_qk_norm_rope(
        ds[0][:, :, 0].transpose(1, 2), ds[0][:, :, 1].transpose(1, 2), ds[1], ds[2], cos.double(), sin.double()
    )
    exp = torch.autograd.grad(rq.sum() + 3 * rk.sum(), ds)
    assert_close(qo, rq, dtype=torch.float32, name="q_out")
    assert_close(ko, rk, dtype=torch.float32, name="k_out")
    for n, a, e in zip(("dqkv", "dq_weight", "dk_weight"), got, exp):
        assert_close(a, e, atol=1e-4, rtol=1e-4, name=n)


def test_triton_composes_with_torch_compile(gen):
    q = torch.randn(1, 2, 7, 32, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, 7, 32, generator=gen, requires_grad=True)
    qw = torch.randn(32, generator=gen, requires_grad=True)
    kw = torch.randn(32, generator=gen, requires_grad=True)
    cos, sin = _tables(7, 16, gen)
    qo, ko = torch.compile(K.qk_norm_rope)(q, k, qw, kw, cos, sin)
    got = torch.autograd.grad(qo.sum() + ko.sum(), (q, k, qw, kw))
    ds = [t.detach().double().requires_grad_() for t in (q, k, qw, kw)]
    rq, rk = K.reference_qk_norm_rope(*ds, cos.double(), sin.double())
    exp = torch.autograd.grad(rq.sum() + rk.sum(), ds)
    assert_close(qo, rq, dtype=torch.float32)
    for n, a, e in zip(("dq", "dk", "dq_weight", "dk_weight"), got, exp):
        assert_close(a, e, atol=1e-4, rtol=1e-4, name=n)


def test_bad_inputs_name_the_parameter(gen):
    q = torch.randn(1, 2, 5, 16)
    w = torch.randn(16)
    cos, sin = _tables(5, 8, gen)
    with pytest.raises(ValueError, match="'k_weight'.*shape"):
        K.qk_norm_rope(q, q, w, torch.randn(15), cos, sin)
    with pytest.raises(ValueError, match="'q_weight'.*shape"):
        K.qk_norm_rope(q, q, torch.randn(32), w, cos, sin)
    with pytest.raises(ValueError, match="'cos'.*shape"):
        K.qk_norm_rope(q, q, w, w, torch.randn(5, 9), sin)
    with pytest.raises(TypeError, match="'q_weight'.*int64"):
        K.qk_norm_rope(q, q, w.long(), w, cos, sin)


def test_registry_capabilities():
    assert {"reference", "eager", "compile", "triton"} <= {v.name for v in variants(OP, device="cpu")}
    assert "odd" in get_variant(OP, "triton").why_not("cpu", torch.float32, head_dim=63)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_on_gpu_large_irregular(dtype):
    assert_variant_ok(OP, "triton", dtype, BIG, device="cuda")
