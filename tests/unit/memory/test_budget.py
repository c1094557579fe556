"""Memory lab, the figures a user acts on: predicted peak, transient bytes and what fits against
a hand-summed tiny case; the FSDP projection at uneven world sizes against ``torch.chunk``
(fast, per rank and per parameter) and real ``fully_shard`` runs on gloo (slow); the optimizer
that confirms a fit holds the state the prediction counts."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lab_utils import memory as mem
from lab_utils.core.config import ConfigError
from lab_utils.model import build_model, resolve_config

D, M = 64, 256  # the tiny preset's width and MLP width


def _n_params(preset: str) -> int:
    return sum(p.numel() for p in build_model(preset, device="meta").parameters())


# --------------------------------------------------------------------------------------
# Predicted peak, transient, what fits: a tiny case summed by hand
# --------------------------------------------------------------------------------------


def _hand_peak(sh: mem.StepShape, policy: str) -> dict[str, int]:
    """float32 tiny step: AdamW state 16 B/param (4 weight + 4 gradient + 8 moments, no master);
    activations counted by the saved-tensor hooks (float32, so CPU and CUDA LayerNorm statistics
    agree); transient 2 x B·L·(3D+M)·4 plus, under recompute, the largest block's own saved
    bytes (its hooks bytes under no checkpointing less the output the next block keeps)."""
    cfg = resolve_config("tiny")
    n = _n_params("tiny")
    rows = sh.batch * (sh.img_tokens + sh.txt_tokens)
    transient = 2 * rows * (3 * D + M) * 4
    if policy != "none":
        by = mem.mmdit_saved(cfg, sh, "float32", "none").by_region()
        out = rows * D * 4  # img + txt out of a double block, x out of a single block
        transient += max(by["double_blocks.0"] - out, by["single_blocks.0"] - out)
    act = mem.mmdit_saved(cfg, sh, "float32", policy).total
    want = dict(parameters=4 * n, gradients=4 * n, optimizer=8 * n, master_weights=0, activations=act)
    want["transient"] = transient
    want["total"] = sum(want.values())
    return want


@pytest.mark.parametrize("policy", ["none", "full"])
def test_predicted_peak_and_transient_equal_a_hand_sum(policy):
    cfg, sh = resolve_config("tiny"), mem.StepShape(3, 16, 5)
    want = _hand_peak(sh, policy)
    assert mem.predicted_peak(cfg, sh, "float32", policy) == want
    assert mem.transient_bytes(cfg, sh, "float32", policy) == want["transient"]
    if policy == "none":  # written out: 2 x 3·21 rows x (3·64 + 256) x 4 B
        assert want["transient"] == 225_792


def test_compile_budget_is_bounded_by_no_checkpointing():
    """torch.compile's partitioner may save anything no checkpointing saves: its predicted peak is
    the hand-summed peak of no checkpointing (not of full recompute, which is smaller)."""
    cfg, sh = resolve_config("tiny"), mem.StepShape(3, 16, 5)
    want = _hand_peak(sh, "none")
    assert mem.predicted_peak(cfg, sh, "float32", "compile_budget") == want
    assert want["total"] > _hand_peak(sh, "full")["total"]


def test_bfloat16_state_by_hand():
    """bfloat16 parameters: 2 B weight + 2 B gradient (the gradient has the parameter's dtype),
    8 B of fp32 AdamW moments, 4 B of fp32 master weight per parameter."""
    n = _n_params("tiny")
    got = mem.state_totals(resolve_config("tiny"), "bfloat16")
    assert got == dict(parameters=2 * n, gradients=2 * n, optimizer=8 * n, master_weights=4 * n)


def test_default_device_is_an_h200_of_141_decimal_gb():
    """NVIDIA's datasheet: 141 GB of HBM3e, decimal (131.3 GiB), when no CUDA device is there."""
    assert mem.H200_BYTES == 141_000_000_000
    assert round(mem.H200_BYTES / 2**30, 1) == 131.3


def test_what_fits_at_its_boundary():
    """The largest batch fits a device of exactly its hand-summed peak, one byte less does not."""
    cfg = resolve_config("tiny")
    peak5 = _hand_peak(mem.StepShape(5, 16, 5), "none")["total"]  # 64 px = 4 x 4 tokens
    assert peak5 > _hand_peak(mem.StepShape(4, 16, 5), "none")["total"]
    rows = mem.what_fits(cfg, "float32", "none", peak5, (64,), txt_len=5, max_batch=64)
    assert rows[0]["max_batch"] == 5 and rows[0]["predicted_peak_bytes"] == peak5
    assert mem.what_fits(cfg, "float32", "none", peak5 - 1, (64,), txt_len=5, max_batch=64)[0]["max_batch"] == 4


def test_sharded_peak_is_the_fullest_ranks_padded_state():
    """At 3 ranks (no tiny row count divides by 3) the per-rank state is rank 0's padded shard
    (torch.chunk's first chunk of every parameter), not a third of the total."""
    cfg, sh = resolve_config("tiny"), mem.StepShape(1, 16, 5)
    chunk0 = sum(torch.chunk(p, 3)[0].numel() for p in build_model("tiny", device="meta").parameters())
    got = mem.predicted_peak(cfg, sh, "float32", "none", shards=3)
    assert (got["parameters"], got["gradients"], got["optimizer"]) == (4 * chunk0, 4 * chunk0, 8 * chunk0)
    assert got["parameters"] > math.ceil(4 * _n_params("tiny") / 3)
    with pytest.raises(ConfigError, match="shards"):
        mem.predicted_peak(cfg, sh, "float32", "none", shards=0)


# --------------------------------------------------------------------------------------
# FSDP projection: torch.chunk rows, padded storage
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, ws, held, padded",
    [
        (10, 3, [4, 4, 2], 4),
        (10, 5, [2, 2, 2, 2, 2], 2),
        (10, 6, [2, 2, 2, 2, 2, 0], 2),  # torch.chunk makes 5 chunks: the 6th rank holds none
        (7, 6, [2, 2, 2, 1, 0, 0], 2),
        (2, 3, [1, 1, 0], 1),
    ],
)
def test_fsdp_shard_rows_by_hand(rows, ws, held, padded):
    assert [mem.fsdp_shard_rows(rows, ws, r) for r in range(ws)] == [(h, padded) for h in held]


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(7, 10)  # weight 10 x 7, bias 10
        self.p = nn.Parameter(torch.zeros(2, 3))


def test_fsdp_rank_state_by_hand():
    """Rank 2 of 3: weight holds 2 of 10 rows (14 elements) in a 4-row padded shard (28), bias 2
    in 4, p none of 2 rows in a 1-row shard (3): allocated (28 + 4 + 3) x 4 B for parameters
    and gradients, moments 2 x (14 + 2) x 4 B."""
    got = mem.fsdp_rank_state(_Toy(), 3, 2)
    assert got == dict(parameters=140, gradients=140, optimizer=128, master_weights=0)
    bf16 = mem.fsdp_rank_state(_Toy(), 3, 2, dtype="bfloat16")
    assert bf16 == dict(parameters=70, gradients=70, optimizer=128, master_weights=64)


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("world_size", [3, 5, 6])
def test_fsdp_projection_follows_torch_chunk(preset, world_size):
    """Per rank and per parameter: the rows held are torch.chunk's chunk (none past the last
    chunk), the storage is the first chunk's size on every rank (fully_shard's padding)."""
    model = build_model(preset, device="meta")
    uneven = False
    for rank in range(world_size):
        shards = mem.fsdp_rank_params(model, world_size, rank)
        held_total = padded_total = 0
        for name, p in model.named_parameters():
            chunks = torch.chunk(p, world_size)
            held = chunks[rank].numel() if rank < len(chunks) else 0
            assert (shards[name]["numel"], shards[name]["padded_numel"]) == (held, chunks[0].numel()), (name, rank)
            held_total, padded_total = held_total + held, padded_total + chunks[0].numel()
            uneven |= held != chunks[0].numel()
        for dtype, s, master in (("float32", 4, 0), ("bfloat16", 2, 4)):
            want = dict(parameters=s * padded_total, gradients=s * padded_total, optimizer=8 * held_total)
            want["master_weights"] = master * held_total
            assert mem.fsdp_rank_state(model, world_size, rank, dtype) == want, (rank, dtype)
    assert uneven  # the case exercises padding


def test_fsdp_flux_dev_padding_at_five_ranks():
    """flux-dev in bf16 at 5 ranks: the last rank allocates 20.75 MB of parameter and gradient
    padding beyond the rows it holds (the figure an independent check reported)."""
    model = mem.meta_model(resolve_config("flux-dev"))
    shards = mem.fsdp_rank_params(model, 5, 4)
    pad = sum(2 * 2 * (v["padded_numel"] - v["numel"]) for v in shards.values())
    assert round(pad / 1e6, 2) == 20.75
    held = sum(v["numel"] for v in shards.values())
    got = mem.fsdp_rank_state(model, 5, 4, "bfloat16")
    assert got["parameters"] + got["gradients"] == 2 * 2 * held + pad


@pytest.mark.slow
def test_fsdp_real_fully_shard_uneven_world_sizes():
    """One spawn of 6 gloo ranks; fully_shard at 1..6 ranks on subgroups.  Every rank's
    allocated and held bytes and every parameter's shard equal the projection, and torch.chunk."""
    rows = mem.run_fsdp("tiny", [1, 2, 3, 4, 5, 6], timeout_s=1200)
    assert sorted((r["world_size"], r["rank"]) for r in rows) == [(w, r) for w in range(1, 7) for r in range(w)]
    shapes = {n: p.shape for n, p in build_model("tiny", device="meta").named_parameters()}
    padded_somewhere = False
    for r in rows:
        assert not mem.fsdp_mismatches(r), (r["world_size"], r["rank"], mem.fsdp_mismatches(r)[:5])
        for name, got in r["params"].items():
            chunks = torch.chunk(torch.empty(shapes[name], device="meta"), r["world_size"])
            held = chunks[r["rank"]].numel() if r["rank"] < len(chunks) else 0
            assert (got["numel"], got["padded_numel"]) == (held, chunks[0].numel()), (r["world_size"], name)
        padded_somewhere |= r["parameters"] > r["parameters_held"]
    assert padded_somewhere


# --------------------------------------------------------------------------------------
# The optimizer that confirms a fit
# --------------------------------------------------------------------------------------


def test_master_adamw_equals_torch_adamw():
    """fp32 parameters: bitwise torch's single-tensor AdamW.  bf16 parameters: the master follows
    torch's AdamW run on an fp32 copy with the upcast bf16 gradients, the parameter is its rounding."""
    seed = 7
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    ref = [nn.Parameter(torch.randn(13, 5, generator=gen)), nn.Parameter(torch.randn(5, generator=gen))]
    mine = [nn.Parameter(p.detach().clone()) for p in ref]
    low = [nn.Parameter(p.detach().bfloat16()) for p in ref]
    ref_low = [nn.Parameter(p.detach().bfloat16().float()) for p in ref]
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    t_ref, t_ref_low = torch.optim.AdamW(ref, foreach=False, **kw), torch.optim.AdamW(ref_low, foreach=False, **kw)
    o_mine, o_low = mem.MasterAdamW(mine, **kw), mem.MasterAdamW(low, **kw)
    for _ in range(3):
        for a, b, c, d in zip(ref, mine, low, ref_low):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad, c.grad = g.clone(), g.clone(), g.bfloat16()
            d.grad = g.bfloat16().float()
        for o in (t_ref, t_ref_low, o_mine, o_low):
            o.step()
    for a, b in zip(ref, mine):
        assert torch.equal(a, b)
    for c, d, m in zip(low, ref_low, o_low.master):
        assert torch.allclose(m, d, rtol=1e-6, atol=1e-7) and torch.equal(c, m.bfloat16())
    assert o_mine.state_bytes() == dict(optimizer=2 * 4 * 70, master_weights=0)
    assert o_low.state_bytes() == dict(optimizer=2 * 4 * 70, master_weights=4 * 70)


def test_bisect_fit_holds_the_predicted_state():
    """The real step that confirms a fit holds what the prediction counts: bf16 weights and
    gradients, fp32 master weights and moments (16 B per parameter), not torch AdamW's 4 B."""
    cfg = resolve_config("tiny")
    fit = mem.bisect_fit(cfg, "full", 32, 4, hi=2, device="cpu")
    assert (fit.edge, fit.ooms) == (2, 0)  # nothing runs out of memory on a CPU
    n = _n_params("tiny")
    assert fit.state == dict(parameters=2 * n, gradients=2 * n, optimizer=8 * n, master_weights=4 * n)
    assert fit.state == mem.state_totals(cfg, "bfloat16")
