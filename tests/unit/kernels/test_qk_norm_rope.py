"""qk_norm_rope: what is specific to it (strided q/k views with weight gradients, bad inputs);
the shared cases are in tests/unit/fused/test_ops.py."""

import pytest
import torch

from lab_kernels import get_variant
from lab_kernels import qk_norm_rope as K
from lab_utils.core.checks import assert_close

OP = "qk_norm_rope"


def _tables(L, half, gen, batch=None):
    ang = torch.rand(*((batch,) if batch else ()), L, half, generator=gen) * 100
    return torch.cos(ang), torch.sin(ang)


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
    assert "odd" in get_variant(OP, "triton").why_not("cpu", torch.float32, head_dim=63)
