"""Activation-checkpointing (AC) policies of the MMDiT.

A policy decides, per block, whether the block's activations are kept for the
backward, recomputed (fully, or all but the ops a selective policy saves), moved to
host memory, or left to ``torch.compile``'s min-cut partitioner under an activation
memory budget.  ``MMDiT`` calls :func:`run_block` for every block, so a new policy
is added here and nowhere else.

What a policy keeps outside autograd's saved tensors (a checkpointed block's inputs,
the outputs a selective policy caches) is reported to an active :func:`capture`, so
that ``lab_utils.memory`` counts every byte kept for the backward exactly.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._functorch import config as functorch_config
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lab_utils.core.config import ConfigError

#: Activation-checkpoint policies:
#: none: keep all activations; full: recompute every block; double / single: only that
#: block kind; every_other: every second block of each kind (index 0, 2, ...);
#: selective: every block with torch's selective checkpointing that saves matmul and
#: attention outputs and recomputes the cheap elementwise/norm ops; save_matmul /
#: save_attention: the same, saving only matmul (resp. only attention) outputs;
#: offload: every block's saved tensors go to (pinned, on CUDA) host memory through
#: ``torch.autograd.graph.save_on_cpu``; compile_budget: every block compiled with
#: ``torch.compile`` under ``activation_memory_budget`` = :data:`COMPILE_MEMORY_BUDGET`.
CHECKPOINT_POLICIES = (
    "none",
    "full",
    "double",
    "single",
    "every_other",
    "selective",
    "save_matmul",
    "save_attention",
    "offload",
    "compile_budget",
)

#: Policies that recompute inside ``torch.utils.checkpoint`` (the block's inputs are kept).
RECOMPUTE_POLICIES = ("full", "double", "single", "every_other", "selective", "save_matmul", "save_attention")
#: Selective policies: name -> which op families are saved.
SELECTIVE_POLICIES = {
    "selective": ("matmul", "attention"),
    "save_matmul": ("matmul",),
    "save_attention": ("attention",),
}
#: Fraction of the activation memory torch.compile's partitioner may keep (0 = recompute all it can).
COMPILE_MEMORY_BUDGET = 0.5


def block_policy(policy: str, kind: str, index: int) -> bool:
    """True when block ``index`` of ``kind`` ("double" / "single") is under ``policy``'s treatment."""
    if policy not in CHECKPOINT_POLICIES:
        raise ConfigError("checkpoint", policy, "one of " + ", ".join(CHECKPOINT_POLICIES))
    if kind not in ("double", "single"):
        raise ConfigError("kind", kind, "'double' or 'single'")
    if policy == "none":
        return False
    if policy == "double":
        return kind == "double"
    if policy == "single":
        return kind == "single"
    if policy == "every_other":
        return index % 2 == 0
    return True


def matmul_ops() -> set:
    aten = torch.ops.aten
    return {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default}


def attention_ops() -> set:
    aten = torch.ops.aten
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
    )
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def saved_ops(policy: str) -> set:
    """The aten ops whose outputs a selective ``policy`` saves (everything else is recomputed)."""
    families = SELECTIVE_POLICIES[policy]
    ops: set = set()
    if "matmul" in families:
        ops |= matmul_ops()
    if "attention" in families:
        ops |= attention_ops()
    return ops


# --------------------------------------------------------------------------------------
# Capture: what a policy keeps outside autograd's saved tensors
# --------------------------------------------------------------------------------------


@dataclass
class Capture:
    """Filled while :func:`capture` is active: per checkpointed block, the input tensors
    ``torch.utils.checkpoint`` keeps alive, and the caches of selective checkpointing
    ({op: {index: wrapped output}} as torch stores them)."""

    kept_inputs: list[tuple[str, int, list[torch.Tensor]]] = field(default_factory=list)
    selective_caches: list[tuple[str, int, dict]] = field(default_factory=list)


_CAPTURES: list[Capture] = []


@contextlib.contextmanager
def capture() -> Iterator[Capture]:
    """Record what :func:`run_block` keeps beyond autograd's saved tensors (for memory accounting)."""
    cap = Capture()
    _CAPTURES.append(cap)
    try:
        yield cap
    finally:
        _CAPTURES.remove(cap)


def _selective_context_fn(policy: str, kind: str, index: int) -> Callable[[], tuple]:
    save = saved_ops(policy)

    def policy_fn(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn():
        caching, cached = create_selective_checkpoint_contexts(policy_fn)
        for cap in _CAPTURES:
            cap.selective_caches.append((kind, index, caching.storage))
        return caching, cached

    return context_fn


def selective_context(policy: str = "selective"):
    """Contexts of torch's selective checkpointing for ``policy`` (one of :data:`SELECTIVE_POLICIES`)."""
    return _selective_context_fn(policy, "", -1)()


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(block: torch.nn.Module) -> Callable[..., Any]:
    fn = _COMPILED.get(block)
    if fn is None:
        fn = _COMPILED[block] = torch.compile(block)
    return fn


def offload_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """``save_on_cpu``, pinned when a CUDA device is present (pinning needs one)."""
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


def run_block(policy: str, block: Callable[..., Any], kind: str, index: int, *args, active: bool = True):
    """Call ``block(*args)`` under ``policy``; ``active`` is False in eval / no-grad, where nothing is saved."""
    if not (active and block_policy(policy, kind, index)):
        return block(*args)
    if policy == "offload":
        with offload_hooks():
            return block(*args)
    if policy == "compile_budget":
        with functorch_config.patch(activation_memory_budget=COMPILE_MEMORY_BUDGET):
            return _compiled(block)(*args)
    for cap in _CAPTURES:
        cap.kept_inputs.append((kind, index, [a for a in tree_leaves(args) if isinstance(a, torch.Tensor)]))
    if policy in SELECTIVE_POLICIES:
        return checkpoint(block, *args, use_reentrant=False, context_fn=_selective_context_fn(policy, kind, index))
    return checkpoint(block, *args, use_reentrant=False)
