"""lab_utils.core.flops: the lab's one set of FLOP and byte conventions, checked by hand."""

import pytest

from lab_utils.core import flops as F


def test_matmul_and_attention_conventions():
    assert F.matmul_flops(3, 5, 7) == 2 * 3 * 5 * 7
    fwd = F.attention_flops(2, 3, 100, 100, 64)
    assert fwd == 4 * 2 * 3 * 100 * 100 * 64
    # kernel: the five matmuls of a flash backward (2.5x); model: 2x, the MFU convention
    assert F.attention_flops(2, 3, 100, 100, 64, direction="bwd", convention="kernel") == 2.5 * fwd
    assert F.attention_flops(2, 3, 100, 100, 64, direction="bwd", convention="model") == 2.0 * fwd
    assert F.attention_flops(1, 1, 8, 8, 64, direction="fwd+bwd", convention="model") == 3 * 4 * 64 * 64
    causal = F.attention_flops(1, 1, 8, 8, 64, pairs=F.causal_pairs(8))
    assert causal == 4 * 36 * 64
    with pytest.raises(ValueError, match="'convention'"):
        F.attention_flops(1, 1, 8, 8, 64, convention="mfu")


def test_causal_pairs_count_by_enumeration():
    for lq, lk in ((7, 7), (5, 9), (9, 5), (1, 1)):
        assert F.causal_pairs(lq, lk) == sum(1 for i in range(lq) for j in range(lk) if j <= i)


def test_rope_is_three_flops_per_element_and_gelu_one_value():
    # a rotated pair: x0·c − x1·s and x0·s + x1·c = 4 multiplies + 2 adds for 2 elements
    assert F.FUSED_FLOPS_PER_ELEMENT["rope"] == (3, 3)
    assert F.FUSED_FLOPS_PER_ELEMENT["gelu_tanh"][0] == F.GELU_TANH_FLOPS == 9
    n = 2 * 1 * 3 * 10 * 32  # q and k of (1, 3, 10, 32)
    assert F.fused_flops("rope", "fwd", batch=1, tokens=10, hidden=96, head_dim=32) == 3 * n
    qknr = F.FUSED_FLOPS_PER_ELEMENT["qk_norm_rope"]
    assert qknr == tuple(a + b for a, b in zip(F.FUSED_FLOPS_PER_ELEMENT["rms_norm"], (3, 3)))


def test_layer_norm_modulate_backward_bytes_are_the_kernels_three_passes():
    B, L, D, s = 2, 10, 96, 2
    M = B * L
    got = F.fused_bytes("layer_norm_modulate", "bwd", batch=B, tokens=L, hidden=D, elem_size=s)
    # x and dy read, dx written (3 passes over M x D); scale read, dshift and dscale written; mean, rstd
    assert got == 3 * M * D * s + 3 * B * D * s + 8 * M


def test_every_fused_op_has_bytes_and_flops_in_every_direction():
    for op in F.FUSED_OPS:
        for d in F.DIRECTIONS:
            kw = dict(batch=1, tokens=16, hidden=256, head_dim=64)
            assert F.fused_bytes(op, d, elem_size=4, **kw) > 0 and F.fused_flops(op, d, **kw) > 0
        total = F.fused_bytes(op, "fwd+bwd", elem_size=4, **kw)
        assert total == F.fused_bytes(op, "fwd", elem_size=4, **kw) + F.fused_bytes(op, "bwd", elem_size=4, **kw)
    with pytest.raises(ValueError, match="'op'"):
        F.fused_bytes("layernorm", "fwd", batch=1, tokens=1, hidden=1, elem_size=4)
    with pytest.raises(ValueError, match="'direction'"):
        F.fused_flops("rms_norm", "forward", batch=1, tokens=1, hidden=1)
