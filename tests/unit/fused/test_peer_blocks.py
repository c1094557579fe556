"""lab_utils.fused.peer_blocks: the Liger block provider and diffusers' own FLUX blocks (QKV
projections unfused and fused) in lab 02's whole-block comparison, on the eager block's weights."""

import pytest
import torch

from lab_utils.core.records import Recorder
from lab_utils.fused import blocks as fused_blocks
from lab_utils.fused import peer_blocks as peers

SMALL = dict(img_tokens=6, txt_tokens=3)


@pytest.mark.parametrize("kind", ["double", "single"])
def test_diffusers_blocks_compute_the_eager_blocks_outputs(kind):
    cases = fused_blocks.block_cases(
        "tiny", kinds=(kind,), providers=("eager", "diffusers", "diffusers+fused_qkv"), **SMALL
    )
    agree = {r["provider"]: r for r in fused_blocks.block_agreement(cases)}
    assert set(agree) == {"eager", "diffusers", "diffusers+fused_qkv"}
    for r in agree.values():
        assert r["max_abs_diff"] <= 1e-5 * r["max_abs_ref"], r
    for c in cases:  # forward + backward, every input and used parameter gets a gradient
        grads = c.fn()
        assert all(g is not None and torch.isfinite(g).all() for g in grads), c.provider


def test_the_fused_qkv_block_runs_diffusers_fused_projection():
    """diffusers' fused path is the one timed: a change of its to_qkv weight changes the outputs
    (and the unfused projections it keeps take no gradient)."""
    held = {}
    orig = peers.diffusers_forward

    def spy(block, kind, txt_tokens):
        held[kind] = block
        return orig(block, kind, txt_tokens)

    peers.diffusers_forward = spy
    try:
        cases = fused_blocks.block_cases("tiny", kinds=("double",), providers=("eager", "diffusers+fused_qkv"), **SMALL)
    finally:
        peers.diffusers_forward = orig
    blk = held["double"]
    assert blk.attn.fused_projections and not blk.attn.to_q.weight.requires_grad
    assert blk.attn.to_qkv.weight.requires_grad and blk.attn.to_added_qkv.weight.requires_grad
    before = fused_blocks.block_agreement(cases)[1]["max_abs_diff"]
    with torch.no_grad():
        blk.attn.to_qkv.weight[0, 0] += 0.5
    after = fused_blocks.block_agreement(cases)[1]["max_abs_diff"]
    assert before <= 1e-6 < 1e-3 < after


def test_diffusers_tables_repeat_each_angle_for_its_pair():
    ang = torch.rand(5, 4)
    cos, sin = peers.diffusers_pe((torch.cos(ang), torch.sin(ang)))
    assert cos.shape == (5, 8) and torch.equal(cos[:, 0::2], torch.cos(ang))
    assert torch.equal(sin[:, 1::2], torch.sin(ang))


def test_liger_block_agrees_and_is_never_timed_on_cpu():
    cases = fused_blocks.block_cases("tiny", kinds=("single",), providers=("eager", "liger", "diffusers"), **SMALL)
    by = {c.provider: c for c in cases}
    assert by["liger"].interpreted and not by["diffusers"].interpreted and not by["eager"].interpreted
    agree = {r["provider"]: r["max_abs_diff"] for r in fused_blocks.block_agreement(cases)}
    assert agree["liger"] < 1e-4, agree
    rec = Recorder("test")
    fused_blocks.block_compare(rec, cases, reps=3, budget_s=10)
    timed = set(rec.frame().query("metric == 'time'").variant)
    assert timed == {"eager", "diffusers"}


def test_liger_kernels_choose_liger_where_it_has_a_kernel():
    from lab_utils.model import KernelSet

    ks = KernelSet(peers.LIGER_KERNELS)
    assert ks.sources["rms_norm"].endswith("/liger") and ks.sources["layer_norm_modulate"].endswith("/liger")
    assert ks.sources["qk_norm_rope"] == "composed: lab_kernels.rms_norm/liger + lab_kernels.rope/liger"
    assert ks.sources["gelu_tanh"].endswith("/eager") and ks.sources["gated_residual"].endswith("/eager")


def test_diffusers_torchao_import_note_is_dropped_as_noise(caplog):
    """diffusers' import-time note about torchao-serialized checkpoints (none are loaded here) would
    otherwise land in lab 02's checked block-agreement cell (lab_utils.core.noise)."""
    import logging

    import lab_utils  # noqa: F401  (installs the filters)

    log = logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer")
    with caplog.at_level(logging.WARNING):
        log.warning("Unable to import `torchao` Tensor objects. This may affect loading checkpoints")
        log.warning("a real warning")
    assert [r.getMessage() for r in caplog.records] == ["a real warning"]
