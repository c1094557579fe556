"""Activation-checkpointing (AC) policies of the MMDiT, as objects that apply themselves.

A policy decides, per block, whether the block's activations are kept for the
backward, recomputed (fully, or all but the ops a selective policy saves), moved to
host memory, or left to ``torch.compile``'s min-cut partitioner under an activation
memory budget.  As in torchtitan, a policy is applied to a model once, from outside the
model, when it is built (:func:`lab_utils.model.mmdit.build_model` calls
``ACTIVATION_CHECKPOINTS[cfg.activation_checkpoint].apply(model)``): ``apply`` chooses each
block's runner then, so the forward does no string dispatch on the policy.  A new policy
is one entry of :data:`ACTIVATION_CHECKPOINTS` and nowhere else.

"checkpoint" alone names saving the model's state (``Checkpointer``, DCP); the policies
here are "activation checkpoints" everywhere: the parameter ``activation_checkpoint``
(lab 05's ``activation_checkpoints`` list), the config field and the model's attribute.

Any other model's repeated blocks take the same policies from outside (:func:`applied`: each
treated block's ``forward`` runs through the policy's runner while the context is active): the
:data:`GENERIC_POLICIES`, those that need no block kinds (double / single are the MMDiT's, and
``compile_budget`` compiles every block: minutes on a CPU).  A block's kind there is the list
that holds it, and "every other block" counts within each list, as it does per MMDiT kind.

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
from torch import nn
from torch._functorch import config as functorch_config
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lab_utils.core.config import check_choice

#: Fraction of the activation memory torch.compile's partitioner may keep (0 = recompute all it can).
COMPILE_MEMORY_BUDGET = 0.5
#: The block kinds of the MMDiT.
BLOCK_KINDS = ("double", "single")
Runner = Callable[..., Any]


def _every(kind: str, index: int) -> bool:
    return True


@dataclass(frozen=True)
class ActivationCheckpoint:
    """One policy: its name, which blocks it treats, and how (``treatment``):
    "keep" (nothing done), "recompute" (``torch.utils.checkpoint``, inputs kept),
    "selective" (recompute all but the op families in ``saves``), "offload"
    (``save_on_cpu``) or "compile" (``torch.compile`` under an activation budget)."""

    name: str
    what: str
    treatment: str = "recompute"
    blocks: Callable[[str, int], bool] = _every
    saves: tuple[str, ...] = ()
    generic: bool = True  # acts on any model's blocks (False: needs the MMDiT's block kinds or compiles)

    @property
    def recomputes(self) -> bool:
        """Recomputes inside ``torch.utils.checkpoint`` (the treated blocks' inputs are kept)."""
        return self.treatment in ("recompute", "selective")

    def treats(self, kind: str, index: int) -> bool:
        """True when block ``index`` of ``kind`` is under this policy's treatment (a policy that is
        not generic knows the MMDiT's kinds only, "double" / "single")."""
        if not self.generic:
            check_choice("kind", kind, BLOCK_KINDS)
        return self.treatment != "keep" and self.blocks(kind, index)

    def runner(self, block: Callable[..., Any], kind: str, index: int) -> Runner | None:
        """The callable that runs ``block`` (a module, or a block's own ``forward``) under this
        policy (None: the block runs as it is)."""
        if not self.treats(kind, index):
            return None
        if self.treatment == "offload":
            return _offloaded(block)
        if self.treatment == "compile":
            return _budgeted(block)
        context_fn = _selective_context_fn(self.saves, kind, index) if self.treatment == "selective" else None
        return _recomputed(block, kind, index, context_fn)

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Install this policy on ``model`` (an MMDiT: ``double_blocks`` / ``single_blocks``),
        once: each treated block gets its runner in ``model.block_runners``; the model's
        ``activation_checkpoint`` becomes this policy.  Re-applying replaces the previous one."""
        runners = {}
        for kind in BLOCK_KINDS:
            for i, blk in enumerate(getattr(model, f"{kind}_blocks")):
                run = self.runner(blk, kind, i)
                if run is not None:
                    runners[(kind, i)] = run
        model.block_runners = runners
        model.activation_checkpoint = self
        if getattr(model, "seams", None) is not None:
            model.seams.activation_checkpoint = self.name
        return model


#: Activation-checkpoint policies, the one registry (name -> policy).
ACTIVATION_CHECKPOINTS: dict[str, ActivationCheckpoint] = {
    p.name: p
    for p in (
        ActivationCheckpoint("none", "keep all activations", "keep"),
        ActivationCheckpoint("full", "recompute every block"),
        ActivationCheckpoint(
            "double", "recompute the double-stream blocks", blocks=lambda k, i: k == "double", generic=False
        ),
        ActivationCheckpoint(
            "single", "recompute the single-stream blocks", blocks=lambda k, i: k == "single", generic=False
        ),
        ActivationCheckpoint("every_other", "recompute blocks 0, 2, ... of each kind", blocks=lambda k, i: i % 2 == 0),
        ActivationCheckpoint(
            "selective", "save matmul and attention outputs, recompute the rest", "selective",
            saves=("matmul", "attention"),
        ),
        ActivationCheckpoint("save_matmul", "save matmul outputs, recompute the rest", "selective", saves=("matmul",)),
        ActivationCheckpoint(
            "save_attention", "save attention outputs, recompute the rest", "selective", saves=("attention",)
        ),
        ActivationCheckpoint("offload", "saved tensors to (pinned) host memory", "offload"),
        ActivationCheckpoint(
            "compile_budget",
            f"torch.compile under activation_memory_budget={COMPILE_MEMORY_BUDGET}",
            "compile",
            generic=False,
        ),
    )
}  # fmt: skip
#: The same registry under its former name (the explorers read it).
CHECKPOINT_POLICIES = ACTIVATION_CHECKPOINTS
#: The policies any model's blocks take (:func:`applied`).
GENERIC_POLICIES = tuple(n for n, p in ACTIVATION_CHECKPOINTS.items() if p.generic)
#: Views of the registry: policies that recompute inside ``torch.utils.checkpoint``, and the
#: selective ones with the op families they save.
RECOMPUTE_POLICIES = tuple(n for n, p in ACTIVATION_CHECKPOINTS.items() if p.recomputes)
SELECTIVE_POLICIES = {n: p.saves for n, p in ACTIVATION_CHECKPOINTS.items() if p.treatment == "selective"}


def activation_checkpoint(name: str, param: str = "activation_checkpoint") -> ActivationCheckpoint:
    """The policy named ``name``; an unknown name is a ConfigError naming ``param``."""
    check_choice(param, name, ACTIVATION_CHECKPOINTS)
    return ACTIVATION_CHECKPOINTS[name]


def block_policy(policy: str, kind: str, index: int) -> bool:
    """True when block ``index`` of ``kind`` ("double" / "single") is under ``policy``'s treatment."""
    return activation_checkpoint(policy).treats(kind, index)


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


def saved_ops(policy: str | tuple[str, ...]) -> set:
    """The aten ops whose outputs a selective ``policy`` (a name, or its op families) saves."""
    families = SELECTIVE_POLICIES[policy] if isinstance(policy, str) else policy
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
    """Record what the policies' runners keep beyond autograd's saved tensors (for memory accounting)."""
    cap = Capture()
    _CAPTURES.append(cap)
    try:
        yield cap
    finally:
        _CAPTURES.remove(cap)


def _selective_context_fn(policy: str | tuple[str, ...], kind: str, index: int) -> Callable[[], tuple]:
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


def _offloaded(block: Callable[..., Any]) -> Runner:
    def run(*args, **kwargs):
        with offload_hooks():
            return block(*args, **kwargs)

    return run


def _budgeted(block: torch.nn.Module) -> Runner:
    def run(*args):
        with functorch_config.patch(activation_memory_budget=COMPILE_MEMORY_BUDGET):
            return _compiled(block)(*args)

    return run


def _recomputed(block: Callable[..., Any], kind: str, index: int, context_fn: Callable | None) -> Runner:
    extra = {} if context_fn is None else {"context_fn": context_fn}

    def run(*args, **kwargs):
        kept = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        for cap in _CAPTURES:
            cap.kept_inputs.append((kind, index, kept))
        return checkpoint(block, *args, use_reentrant=False, **extra, **kwargs)

    return run


# --------------------------------------------------------------------------------------
# Any model's blocks, from outside
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def applied(blocks: list[tuple[str, str, int, nn.Module]], policy: str) -> Iterator[None]:
    """Inside: ``policy`` (one of :data:`GENERIC_POLICIES`) acts on ``blocks`` (name, kind,
    index, module), each treated block's ``forward`` run by the policy's runner (only while grad
    is enabled: an inference forward runs as it is); the forwards are restored on exit."""
    check_choice("activation_checkpoint", policy, GENERIC_POLICIES)
    pol = ACTIVATION_CHECKPOINTS[policy]
    touched = []
    try:
        for _, kind, index, mod in blocks:
            fwd = mod.forward
            run = pol.runner(fwd, kind, index)
            if run is None:
                continue
            touched.append((mod, "forward" in mod.__dict__, mod.__dict__.get("forward")))

            def forward(*args, _fwd=fwd, _run=run, **kwargs):
                return _run(*args, **kwargs) if torch.is_grad_enabled() else _fwd(*args, **kwargs)

            mod.forward = forward
        yield
    finally:
        for mod, had, old in touched:
            if had:
                mod.forward = old
            else:
                del mod.forward
