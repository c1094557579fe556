"""Padding vs packing: batch construction from buckets, computed costs, the same result
from both layouts (padded with a key mask vs packed with cu_seqlens, and each sequence
alone), and bad parameters named."""

from __future__ import annotations

import math

import pytest
import torch

from lab_utils.attention import attend as A
from lab_utils.attention import varlen as V
from lab_utils.core.checks import assert_close
from lab_utils.core.config import ConfigError
from lab_utils.core.timing import BenchOptions


@pytest.fixture(autouse=True)
def _seed_global_rng(gen):  # inputs and nn.Linear init draw from it: the seed gen reports replays them
    torch.manual_seed(gen.initial_seed())


def test_bucket_batch_is_deterministic_and_counts_tokens():
    b = V.bucket_batch(5, buckets=[[256, 256], [128, 192]], txt_len=(3, 9), seed=3)
    assert b == V.bucket_batch(5, buckets=[[256, 256], [128, 192]], txt_len=(3, 9), seed=3)
    for n, i, t, (h, w) in zip(b.lengths, b.img_tokens, b.txt_tokens, b.buckets):
        assert i == (h // 16) * (w // 16) and 3 <= t <= 9 and n == i + t
    cu = b.cu_seqlens()
    assert (
        cu[0] == 0 and cu[-1] == b.total and torch.equal(cu[1:] - cu[:-1], torch.tensor(b.lengths, dtype=torch.int32))
    )


def test_pad_pack_costs():
    b = V.VarlenBatch((10, 30, 20), (5, 25, 15), (5, 5, 5), ((1, 1),) * 3)
    pad, pack = V.pad_pack_costs(b, heads=2, head_dim=8, dtype=torch.float16)
    assert pad.pairs == 2 * 3 * 30**2 and pack.pairs == 2 * (100 + 900 + 400)
    assert pack.useful_fraction == 1.0 and math.isclose(pad.useful_fraction, 1400 / 2700)
    assert pad.fwd_flops == 4.0 * pad.pairs * 8 and pad.bwd_flops == 2.5 * pad.fwd_flops
    assert pad.activation_bytes == 4 * 90 * 2 * 8 * 2 and pack.activation_bytes == 4 * 60 * 2 * 8 * 2


@pytest.mark.parametrize("path", ["sdpa", "math", "flash", "reference"])
def test_padded_and_packed_give_the_same_rows(path):
    b = V.VarlenBatch((23, 61, 40), (16, 50, 30), (7, 11, 10), ((1, 1),) * 3)
    inp = V.make_inputs(b, heads=2, head_dim=64, seed=1, requires_grad=True)
    padded = A.attend(*inp["padded"], path=path, mask=inp["key_mask"])
    packed = A.attend(*inp["packed"], path=path, cu_seqlens=inp["cu_seqlens"])
    assert_close(V.unpad(padded, b), packed, dtype=torch.float32, name=f"{path} padded vs packed")
    # gradients agree on the valid rows too (padded rows get no gradient from the loss)
    do = torch.randn_like(packed)
    g_pack = torch.autograd.grad(packed, inp["packed"], do)
    do_pad = torch.zeros_like(padded)
    for i, (s, e) in enumerate(zip(inp["cu_seqlens"][:-1].tolist(), inp["cu_seqlens"][1:].tolist())):
        do_pad[i, :, : e - s] = do[s:e].transpose(0, 1)
    g_pad = torch.autograd.grad(padded, inp["padded"], do_pad)
    for n, gp, gk in zip("qkv", g_pad, g_pack):
        assert_close(V.unpad(gp, b), gk, atol=2e-5, rtol=2e-4, name=f"d{n}")


def test_triton_packed_matches_padded_reference():
    b = V.bucket_batch(3, buckets=[[96, 160], [128, 128], [64, 64]], txt_len=(5, 20), seed=0)
    inp = V.make_inputs(b, heads=2, head_dim=64, seed=2)
    ref = A.attend(*inp["padded"], path="reference", mask=inp["key_mask"])
    tri = A.attend(*inp["packed"], path="triton", cu_seqlens=inp["cu_seqlens"])
    assert_close(tri, V.unpad(ref, b), dtype=torch.float32, name="triton packed")


def test_time_padding_vs_packing_rows():
    b = V.VarlenBatch((23, 40), (16, 30), (7, 10), ((1, 1),) * 2)
    rows = V.time_padding_vs_packing(b, 2, 64, paths=["sdpa", "triton"], bench=BenchOptions(reps=3, budget_s=5))
    by = {(r["path"], r["layout"]): r for r in rows}
    assert by[("sdpa", "padded")]["time_ms"] > 0 and by[("sdpa", "packed")]["time_ms"] > 0
    if not torch.cuda.is_available():
        assert "never timed" in by[("triton", "packed")]["note"]
    assert "mask" in by[("triton", "padded")]["note"]  # key padding: triton cannot honour it


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=2, buckets="1024"), "buckets"),
        (dict(batch_size=2, txt_len=(9, 3)), "txt_len"),
        (dict(batch_size=2, pixels_per_token=4096), "pixels_per_token"),
    ],
)
def test_bad_parameters(kw, param):
    with pytest.raises(ConfigError) as ei:
        V.bucket_batch(**kw)
    assert ei.value.param == param


def test_pad_pack_costs_follow_the_flop_convention():
    b = V.VarlenBatch((10, 30, 20), (5, 25, 15), (5, 5, 5), ((1, 1),) * 3)
    for convention, factor in (("kernel", 2.5), ("model", 2.0)):
        for c in V.pad_pack_costs(b, heads=2, head_dim=8, convention=convention):
            assert c.convention == convention and c.bwd_flops == factor * c.fwd_flops
    with pytest.raises(ConfigError, match="'convention'"):
        V.pad_pack_costs(b, heads=2, head_dim=8, convention="paper")
