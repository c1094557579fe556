"""Masks: each mask_mod against its dense boolean form written out by hand (loops),
composition, chunked pair counting, mask-aware FLOPs, block census vs FlexAttention's
BlockMask, bad parameters named."""

from __future__ import annotations

import itertools

import pytest
import torch

from lab_utils.attention import masks as M
from lab_utils.core import flops
from lab_utils.core.config import ConfigError


def _loops(B, L, allowed):
    """The dense form from a plain-Python predicate allowed(b, q, k)."""
    out = torch.zeros(B, 1, L, L, dtype=torch.bool)
    for b, q, k in itertools.product(range(B), range(L), range(L)):
        out[b, 0, q, k] = bool(allowed(b, q, k))
    return out


def _natten_window(c, n, ks):
    start = min(max(c - ks // 2, 0), n - ks)
    return range(start, start + ks)


L = 37  # irregular


@pytest.mark.parametrize(
    "name",
    [
        "full",
        "causal",
        "sliding",
        "document",
        "prefix",
        "prefix_per_batch",
        "mmdit",
        "mmdit_per_batch",
        "neighborhood",
        "neighborhood_text",
    ],
)
def test_mask_mod_matches_dense_boolean_form(name):
    B = 2
    if name == "full":
        m, want = M.full(), _loops(B, L, lambda b, q, k: True)
    elif name == "causal":
        m, want = M.causal(), _loops(B, L, lambda b, q, k: k <= q)
    elif name == "sliding":
        m, want = M.sliding_window(4), _loops(B, L, lambda b, q, k: abs(q - k) <= 4)
    elif name == "document":
        lens = [10, 20, 7]
        doc = [i for i, n in enumerate(lens) for _ in range(n)]
        m, want = M.document(lens), _loops(B, L, lambda b, q, k: doc[q] == doc[k])
    elif name == "prefix":
        m, want = M.prefix_lm(9), _loops(B, L, lambda b, q, k: k < 9 or k <= q)
    elif name == "prefix_per_batch":
        pre = [3, 11]
        m, want = M.prefix_lm(pre), _loops(B, L, lambda b, q, k: k < pre[b] or k <= q)
    elif name == "mmdit":
        m, want = M.mmdit(8, L - 8, 5), _loops(B, L, lambda b, q, k: k >= 8 or k < 5)
    elif name == "mmdit_per_batch":
        tv = [2, 8]
        m, want = M.mmdit(8, L - 8, tv), _loops(B, L, lambda b, q, k: k >= 8 or k < tv[b])
    elif name in ("neighborhood", "neighborhood_text"):
        off = 0 if name == "neighborhood" else 7
        h, w, ks = (5, 7, 3) if off == 0 else (5, 6, 5)
        n = off + h * w

        def allowed(b, q, k):
            if q < off or k < off:
                return True
            qy, qx = divmod(q - off, w)
            ky, kx = divmod(k - off, w)
            return ky in _natten_window(qy, h, ks) and kx in _natten_window(qx, w, ks)

        m, want = M.spatial_neighborhood(h, w, ks, offset=off), _loops(B, n, allowed)
        got = M.dense_mask(m, B, 1, n, n)
        assert torch.equal(got, want)
        # every image query sees exactly ks^2 image keys (NATTEN: windows shift at borders)
        assert (got[0, 0, off:, off:].sum(-1) == ks * ks).all()
        return
    got = M.dense_mask(m, B, 3, L, L)
    assert got.shape == (B, 3, L, L) and got.dtype == torch.bool
    assert torch.equal(got, want.expand(B, 3, L, L))
    assert M.count_pairs(m, B, 3, L, L, chunk=5) == int(want.sum()) * 3


def test_composition_and_kinds():
    c, w = M.causal(), M.sliding_window(3)
    both = M.dense_mask(c & w, 1, 1, L, L)
    assert torch.equal(both, M.dense_mask(c, 1, 1, L, L) & M.dense_mask(w, 1, 1, L, L))
    either = M.dense_mask(c | w, 1, 1, L, L)
    assert torch.equal(either, M.dense_mask(c, 1, 1, L, L) | M.dense_mask(w, 1, 1, L, L))
    assert (c & M.full()).kind == "causal" and (c | M.full()).kind == "full" and (c & w).kind == "custom"
    # joint MMDiT + 2D neighborhood over the image tokens
    j = M.mmdit(6, 20, 4) & M.spatial_neighborhood(4, 5, 3, offset=6)
    d = M.dense_mask(j, 1, 1, 26, 26)[0, 0]
    assert not d[:, 4:6].any() and d[:, :4].all()
    with pytest.raises(ConfigError, match="'mask'"):
        M.document([3, 4]) & M.document([5, 5])


def test_flops_are_mask_aware():
    f = M.attention_flops(M.causal(), 2, 3, 50, 50, 64)
    assert f.pairs == 2 * 3 * 50 * 51 // 2
    assert f.fwd == 4.0 * f.pairs * 64 and f.bwd == 2.5 * f.fwd
    d = M.make_mask("document", 64)
    assert M.attention_flops(d, 1, 1, 64, 64, 64).pairs == sum(n * n for n in d.params["lengths"])
    assert M.attention_flops(None, 1, 2, 10, 12, 8).density == 1.0


def test_block_census_matches_flex_block_mask():
    n, bs = 200, 64
    for m in (M.causal(), M.make_mask("neighborhood", n), M.make_mask("document", n)):
        st = M.block_stats(m, n, n, block_size=bs)
        assert st.full_blocks + st.partial_blocks + st.empty_blocks == st.n_blocks == 16
        bm = M.flex_block_mask(m, 1, None, n, n, block_size=bs)
        # flex's dense block view: 1 where a tile is computed (partial or full)
        flex_tiles = bm.to_dense()[0, 0].bool()
        mine = M.block_states(M.dense_mask(m, 1, 1, n, n), bs, bs)[0, 0] > 0
        assert torch.equal(flex_tiles[: mine.shape[0], : mine.shape[1]], mine), m.name
    cs = M.block_stats(M.causal(), 256, 256, block_size=64)
    assert (cs.full_blocks, cs.partial_blocks, cs.empty_blocks) == (6, 4, 6)


@pytest.mark.parametrize(
    "call,param",
    [
        (lambda: M.sliding_window(-1), "window"),
        (lambda: M.document([3, 0]), "lengths"),
        (lambda: M.prefix_lm(-2), "prefix"),
        (lambda: M.mmdit(8, 10, 9), "txt_valid"),
        (lambda: M.mmdit(8, 0), "img_len"),
        (lambda: M.spatial_neighborhood(4, 4, 2), "kernel_size"),
        (lambda: M.spatial_neighborhood(4, 0, 3), "width"),
        (lambda: M.make_mask("diagonal", 16), "mask"),
        (lambda: M.dense_mask(M.document([3, 4]), 1, 1, 8, 8), "mask"),
    ],
)
def test_bad_mask_parameters(call, param):
    with pytest.raises(ConfigError) as ei:
        call()
    assert ei.value.param == param


def test_flops_say_which_backward_convention_they_use():
    """One convention table (lab_utils.core.flops): "kernel" (2.5x, what a flash backward runs)
    for an attention kernel's TFLOP/s, "model" (2x) for MFU; the count says which it holds."""
    pairs = 50 * 51 // 2
    k = M.attention_flops(M.causal(), 2, 3, 50, 50, 64)
    m = M.attention_flops(M.causal(), 2, 3, 50, 50, 64, convention="model")
    assert (k.convention, m.convention) == ("kernel", "model")
    assert k.fwd == m.fwd == flops.attention_flops(2, 3, 50, 50, 64, pairs=pairs)
    assert k.bwd == flops.attention_flops(2, 3, 50, 50, 64, pairs=pairs, direction="bwd", convention="kernel")
    assert m.bwd == 2.0 * m.fwd and k.bwd == 2.5 * k.fwd
    with pytest.raises(ConfigError) as ei:
        M.attention_flops(M.causal(), 1, 1, 8, 8, 64, convention="paper")
    assert ei.value.param == "convention"
