"""Activation-checkpointing policies are objects applied to a model once, from outside it.

``build_model`` applies ``ACTIVATION_CHECKPOINTS[cfg.activation_checkpoint]``; the policy picks
each block's runner then, so the forward does not consult the policy (by name or otherwise) on
any call; a model built without ``build_model`` keeps everything (policy "none")."""

from __future__ import annotations

import pytest
import torch

from lab_utils.core.config import ConfigError
from lab_utils.model import ACTIVATION_CHECKPOINTS, CHECKPOINT_POLICIES, MMDiT, MMDiTConfig, build_model
from lab_utils.model.checkpointing import ActivationCheckpoint, activation_checkpoint
from lab_utils.model.train import rf_loss, synthetic_batch


def _saved_tensors(model) -> int:
    """Tensors autograd keeps for the backward during one training step's forward."""
    n = 0

    def pack(t):
        nonlocal n
        n += 1
        return t

    batch = synthetic_batch(model.cfg, 2, generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = rf_loss(model, batch, torch.Generator().manual_seed(2))
    loss.backward()
    return n


def test_one_registry_under_one_name():
    assert CHECKPOINT_POLICIES is ACTIVATION_CHECKPOINTS  # the former name is the same dict
    assert all(isinstance(p, ActivationCheckpoint) and p.name == n for n, p in ACTIVATION_CHECKPOINTS.items())
    assert len(ACTIVATION_CHECKPOINTS) == 10
    with pytest.raises(ConfigError, match="'activation_checkpoint' = 'often'"):
        activation_checkpoint("often")


@pytest.mark.parametrize("name", ["none", "full", "double", "single", "every_other", "selective", "offload"])
def test_build_model_applies_the_configured_policy_to_the_blocks_it_treats(name):
    model = build_model("tiny", activation_checkpoint=name)
    policy = ACTIVATION_CHECKPOINTS[name]
    assert model.activation_checkpoint is policy and model.seams["activation_checkpoint"] == name
    treated = {(k, i) for k in ("double", "single") for i in range(2) if policy.treats(k, i)}
    assert set(model.block_runners) == treated
    expected = {"none": set(), "double": {("double", 0), ("double", 1)}, "every_other": {("double", 0), ("single", 0)}}
    if name in expected:
        assert treated == expected[name]


def test_forward_never_consults_the_policy_after_apply(monkeypatch):
    """After build, the policy's methods may raise: the forward and backward still run, and
    still checkpoint (fewer saved tensors than no checkpointing)."""
    plain = _saved_tensors(build_model("tiny", seed=3).train())
    model = build_model("tiny", seed=3, activation_checkpoint="full").train()

    def refuse(*a, **k):
        raise AssertionError("the policy was consulted during the step")

    for meth in ("treats", "runner", "apply"):
        monkeypatch.setattr(ActivationCheckpoint, meth, refuse)
    full = _saved_tensors(model)
    print(f"saved tensors: none {plain}, full {full}")
    assert full < plain


def test_a_model_built_without_build_model_keeps_everything_until_a_policy_is_applied():
    cfg = MMDiTConfig.from_preset("tiny", activation_checkpoint="full")
    torch.manual_seed(0)
    bare = MMDiT(cfg).train()
    assert bare.activation_checkpoint.name == "none" and not bare.block_runners
    n_bare = _saved_tensors(bare)
    ACTIVATION_CHECKPOINTS["full"].apply(bare)
    assert _saved_tensors(bare) < n_bare
    ACTIVATION_CHECKPOINTS["none"].apply(bare)  # re-applying replaces the previous policy
    assert _saved_tensors(bare) == n_bare


def test_seams_are_one_object():
    model = build_model("tiny", attention_path="math")
    blocks = [*model.double_blocks, *model.single_blocks]
    assert all(b._seams is model.seams for b in blocks) and model.final_layer._seams is model.seams
    assert model.seams["attention_path"] == "math" and dict(model.seams)["recipe"].startswith("bf16")
    model.seams["qk_norm"] = "off"  # notes join the description
    assert dict(model.seams)["qk_norm"] == "off"
