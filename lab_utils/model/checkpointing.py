"""Activation-checkpointing (AC) policies of the MMDiT.

A policy decides, per block, whether the block's activations are kept for the
backward or recomputed, and how (full recompute, torch's selective checkpointing
that keeps matmul/attention outputs).  ``MMDiT`` calls :func:`run_block` for every
block, so a new policy is added here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..config import ConfigError

#: Activation-checkpoint policies:
#: none: keep all activations; full: recompute every block; double / single: only
#: that block kind; every_other: every second block (both kinds); selective: every block
#: with torch's selective checkpointing that saves matmul/attention outputs and
#: recomputes the cheap elementwise/norm ops.
CHECKPOINT_POLICIES = ("none", "full", "double", "single", "every_other", "selective")


def block_policy(policy: str, kind: str, index: int) -> bool:
    """True when block ``index`` of ``kind`` ("double" / "single") is checkpointed under ``policy``."""
    if policy == "none":
        return False
    if policy in ("full", "selective"):
        return True
    if policy == "double":
        return kind == "double"
    if policy == "single":
        return kind == "single"
    if policy == "every_other":
        return index % 2 == 0
    raise ConfigError("checkpoint", policy, "one of " + ", ".join(CHECKPOINT_POLICIES))


def _saved_ops() -> set:
    aten = torch.ops.aten
    save = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.linear.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
    }
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        save.add(aten._scaled_dot_product_flash_attention_for_cpu.default)
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        save.add(aten._scaled_dot_product_cudnn_attention.default)
    return save


def selective_context():
    """Save matmul / attention outputs, recompute everything else (norms, activations)."""
    save = _saved_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def run_block(policy: str, block: Callable[..., Any], kind: str, index: int, *args, active: bool = True):
    """Call ``block(*args)`` under ``policy``; ``active`` is False in eval / no-grad, where nothing is saved."""
    if not (active and block_policy(policy, kind, index)):
        return block(*args)
    if policy == "selective":
        return checkpoint(block, *args, use_reentrant=False, context_fn=selective_context)
    return checkpoint(block, *args, use_reentrant=False)
