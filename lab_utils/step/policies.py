"""Activation-checkpointing policies applied from the outside to any model's detected blocks
(:func:`lab_utils.step.contract.blocks`): each block's ``forward`` is wrapped for as long as
:func:`applied` is active, and restored after.

* ``none``: keep everything; ``full``: every block recomputed in the backward
  (``torch.utils.checkpoint``, non-reentrant); ``every_other``: blocks 0, 2, 4, ...;
* ``selective`` / ``save_matmul`` / ``save_attention``: every block under torch's selective
  checkpointing, saving the outputs of matmul and attention ops (or only one family) and
  recomputing the rest (the op sets of :mod:`lab_utils.model.checkpointing`);
* ``offload``: every block's saved tensors go to host memory (``save_on_cpu``).

What a policy keeps outside autograd's saved tensors (a checkpointed block's inputs, the
outputs a selective policy caches) is noted in a :class:`Kept`, so the saved-activation probe
counts every byte kept for the backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lab_utils.core.config import check_choice
from lab_utils.model.checkpointing import SELECTIVE_POLICIES, offload_hooks, saved_ops

#: The policies any model's step takes (compile_budget and the MMDiT's double / single are
#: MMDiT-only: the generic blocks have no kinds).
STEP_POLICIES = ("none", "full", "every_other", "selective", "save_matmul", "save_attention", "offload")


@dataclass
class Kept:
    """Filled while a policy runs: per checkpointed block, the tensors checkpoint keeps as its
    inputs, and the caches of selective checkpointing (torch's storage dicts)."""

    inputs: list[tuple[str, list[torch.Tensor]]] = field(default_factory=list)
    caches: list[tuple[str, dict]] = field(default_factory=list)


def treated(policy: str, index: int) -> bool:
    """True when block ``index`` (in module order) is under ``policy``'s treatment."""
    check_choice("policy", policy, STEP_POLICIES)
    if policy == "none":
        return False
    return index % 2 == 0 if policy == "every_other" else True


def _selective(policy: str, name: str, kept: Kept):
    save = saved_ops(policy)

    def policy_fn(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn():
        caching, cached = create_selective_checkpoint_contexts(policy_fn)
        kept.caches.append((name, caching.storage))
        return caching, cached

    return context_fn


def _wrapped(policy: str, name: str, fwd, kept: Kept):
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fwd(*args, **kwargs)
        if policy == "offload":
            with offload_hooks():
                return fwd(*args, **kwargs)
        kept.inputs.append((name, [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]))
        if policy in SELECTIVE_POLICIES:
            ctx = _selective(policy, name, kept)
            return checkpoint(fwd, *args, use_reentrant=False, context_fn=ctx, **kwargs)
        return checkpoint(fwd, *args, use_reentrant=False, **kwargs)

    return forward


@contextlib.contextmanager
def applied(blocks: list[tuple[str, nn.Module]], policy: str) -> Iterator[Kept]:
    """Inside: ``policy`` acts on ``blocks`` (name, module); their forwards are restored on exit."""
    check_choice("policy", policy, STEP_POLICIES)
    kept = Kept()
    touched = []
    try:
        for i, (name, mod) in enumerate(blocks):
            if treated(policy, i):
                had = "forward" in mod.__dict__
                touched.append((mod, had, mod.__dict__.get("forward")))
                mod.forward = _wrapped(policy, name, mod.forward, kept)
        yield kept
    finally:
        for mod, had, old in touched:
            if had:
                mod.forward = old
            else:
                del mod.forward
