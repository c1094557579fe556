"""rope: what is specific to it (FLUX pair layout, per-batch tables, strided q/k views, one output
in the backward, bad inputs); the shared cases are in tests/unit/fused/test_ops.py."""

import pytest
import torch

from lab_kernels import get_variant
from lab_kernels import rope as K
from lab_utils.core.checks import assert_close, poison_

OP = "rope"


def _tables(L, half, gen, batch=None):
    ang = torch.rand(*((batch,) if batch else ()), L, half, generator=gen) * 100
    return torch.cos(ang), torch.sin(ang)


def test_pair_layout_is_flux():
    # one pair rotated by 90°: (1, 0) -> (0, 1); (0, 1) -> (-1, 0)
    q = torch.tensor([1.0, 0.0, 0.0, 1.0]).reshape(1, 1, 1, 4)
    cos, sin = torch.zeros(1, 2), torch.ones(1, 2)
    qo, _ = K.rope(q, q.clone(), cos, sin)
    assert qo.flatten().tolist() == [0.0, 1.0, -1.0, 0.0]


def test_poisoned_outputs_and_per_batch_tables(gen):
    B, H, L, Dh = 2, 3, 11, 62
    x = torch.randn(B, H, L, Dh, generator=gen)
    cos, sin = _tables(L, Dh // 2, gen, batch=B)  # (B, L, Dh/2)
    out = poison_(torch.empty_like(x))
    K.rope_forward(x, cos, sin, out=out)
    xd = x.double().requires_grad_()
    ref = K.reference_rope_one(xd, cos.double(), sin.double())
    assert_close(out, ref.detach(), dtype=torch.float32, name="out")
    dy = torch.randn(x.shape, generator=gen)
    dx = poison_(torch.empty_like(x))
    K.rope_backward(dy, cos, sin, out=dx)
    (gx,) = torch.autograd.grad(ref, xd, dy.double())
    assert_close(dx, gx, dtype=torch.float32, name="dx")


def test_strided_qk_views_from_a_qkv_projection(gen):
    # FLUX: qkv (B, L, 3*H*Dh) -> q, k, v (B, H, L, Dh) views, unit stride on Dh only
    B, L, H, Dh = 2, 13, 3, 32
    qkv = torch.randn(B, L, 3, H, Dh, generator=gen)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    assert not q.is_contiguous()
    cos, sin = _tables(L, Dh // 2, gen)
    qo, ko = K.rope(q, k, cos, sin)
    rq, rk = K.reference_rope(q.double(), k.double(), cos.double(), sin.double())
    assert_close(qo, rq, dtype=torch.float32, name="q_out")
    assert_close(ko, rk, dtype=torch.float32, name="k_out")


def test_only_one_output_used_in_backward(gen):
    q = torch.randn(1, 2, 5, 16, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, 5, 16, generator=gen, requires_grad=True)
    cos, sin = _tables(5, 8, gen)
    qo, _ = K.rope(q, k, cos, sin)
    (gq,) = torch.autograd.grad(qo.sum(), q)
    qd = q.detach().double().requires_grad_()
    (rq,) = torch.autograd.grad(K.reference_rope_one(qd, cos.double(), sin.double()).sum(), qd)
    assert_close(gq, rq, dtype=torch.float32)


def test_bad_inputs_name_the_parameter(gen):
    q = torch.randn(1, 2, 5, 16)
    cos, sin = _tables(5, 8, gen)
    with pytest.raises(ValueError, match="'cos'.*shape"):
        K.rope(q, q, cos[:4], sin)
    with pytest.raises(ValueError, match="'k'.*shape"):
        K.rope(q, torch.randn(1, 2, 6, 16), cos, sin)
    with pytest.raises(ValueError, match="'q'.*even"):
        K.rope(torch.randn(1, 2, 5, 15), torch.randn(1, 2, 5, 15), cos, sin)
    with pytest.raises(ValueError, match="'sin'.*requires grad"):
        K.rope(q, q, cos, sin.clone().requires_grad_())


def test_registry_capabilities():
    assert "odd" in get_variant(OP, "triton").why_not("cpu", torch.float32, head_dim=63)
