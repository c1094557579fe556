"""Saved activations of a step, measured: every storage autograd keeps for the backward, each
counted once and attributed to the module that made it, its region and its aten op.

* ``saved_tensors_hooks`` see every tensor autograd saves; parameters and buffers are state,
  not activations, and are skipped; each *storage* is counted once (views share storage, and a
  view keeps its whole base alive).  A checkpointed block keeps its inputs and, under a selective
  policy, the outputs torch caches: ``lab_utils.model.checkpointing.capture`` reports both.
* A ``TorchDispatchMode`` remembers, for every storage an op creates, the innermost module that
  was running (forward pre / post hooks on every module) and the op.  A storage's region is the
  block holding its module, else the module's top-level child, else ``model``; ``input`` for what
  was made before the step (the batch), ``loss`` for what the loss made outside the model.
* :func:`measure_saved` runs one forward of a step (its batch made outside the probe) under a
  policy: the step's own seam when it declares one (perflab's MMDiT), else the policy applied to
  its blocks from outside.  On the MMDiT its bytes equal the analytic model
  (:mod:`lab_utils.memory.formula`) region by region; everything works on ``meta`` tensors.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lab_utils.core.config import check_choice
from lab_utils.core.dtypes import parse_dtype
from lab_utils.memory.formula import StepShape, pixels_of
from lab_utils.model import MMDiTConfig, resolve_config
from lab_utils.model.checkpointing import GENERIC_POLICIES, applied, capture
from lab_utils.step.contract import StepFactory, block_groups, blocks, region_of
from lab_utils.step.mmdit import synthetic_step


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (the same for every view of it, also on ``meta``)."""
    return t.untyped_storage()._cdata


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


# --------------------------------------------------------------------------------------
# Which module is running, and which made a storage
# --------------------------------------------------------------------------------------


class ModuleTracker:
    """The innermost module running, by its ``named_modules`` name (``model`` for the root), kept
    by forward pre / post hooks registered from outside; ``outside`` (the loss) around the model."""

    def __init__(self, model: nn.Module, outside: str = "loss"):
        self.stack: list[str] = [outside]
        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._enter(name or "model")))
            self.handles.append(mod.register_forward_hook(self._leave(name or "model"), always_call=True))

    def _enter(self, name):
        def hook(mod, args):
            self.stack.append(name)

        return hook

    def _leave(self, name):
        def hook(mod, args, out):
            if self.stack[-1] == name:
                self.stack.pop()

        return hook

    @property
    def current(self) -> str:
        return self.stack[-1]

    def remove(self):
        for h in self.handles:
            h.remove()


class CreatorMode(TorchDispatchMode):
    """Remembers, for every storage an op creates, the module and aten op that made it.
    Outputs that share an input's storage (views, in-place ops) keep their creator."""

    def __init__(self, tracker: ModuleTracker):
        super().__init__()
        self.tracker = tracker
        self.made: dict[int, tuple[str, str]] = {}
        self.events: list[tuple[str, str, int, int]] = []  # (module, op, storage key, bytes) per new storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                k = storage_key(t)
                if k not in ins:
                    where = (self.tracker.current, func.overloadpacket.__name__)
                    self.made[k] = where
                    self.events.append((*where, k, storage_bytes(t)))
        return out


# --------------------------------------------------------------------------------------
# What a forward keeps for the backward
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SavedTensor:
    region: str  # a block ("double_blocks.0", "layers.3"), a top-level module, "model", "loss" or "input"
    module: str  # the innermost module that made the storage ("input": made before the step)
    op: str  # the aten op that made the storage ("input" for tensors made outside the step)
    how: str  # "saved" (autograd), "kept_input" (checkpoint), "selective_cache"
    nbytes: int  # of the whole storage
    shape: tuple
    dtype: str


@dataclass
class SavedReport:
    """The storages kept for the backward after one forward, each counted once."""

    tensors: list[SavedTensor] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def by(self, *cols: str) -> dict:
        """Bytes per value of ``cols`` (one column: its values; several: tuples of them)."""
        out: dict = defaultdict(int)
        for t in self.tensors:
            key = tuple(getattr(t, c if c != "bytes" else "nbytes") for c in cols)
            out[key if len(cols) > 1 else key[0]] += t.nbytes
        return dict(out)

    def by_region(self) -> dict[str, int]:
        return self.by("region")

    def by_op(self) -> dict[tuple[str, str], int]:
        return self.by("region", "op")

    def rows(self) -> list[dict]:
        return [
            dict(region=t.region, module=t.module, op=t.op, how=t.how, bytes=t.nbytes, shape=t.shape, dtype=t.dtype)
            for t in self.tensors
        ]

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows(), columns=["region", "module", "op", "how", "bytes", "shape", "dtype"])


@contextmanager
def saved_tensor_probe(
    model: nn.Module, block_names: list[str] | None = None, *, creators: bool = True
) -> Iterator[SavedReport]:
    """Inside: every storage autograd saves (parameters and buffers skipped), every input a
    checkpointed block keeps and every output a selective policy caches, counted once,
    attributed to the module and op that made it and to its region among ``block_names``
    (default: the model's repeated blocks).  The report is complete on exit.

    ``creators=False`` attributes a storage to the module running when it was saved (op
    "saved"): torch.compile runs eager under a dispatch mode, so the compiled policy is
    measured that way."""
    names = [n for n, _ in blocks(model)] if block_names is None else list(block_names)
    report = SavedReport()
    state = {storage_key(p) for p in model.parameters()} | {storage_key(b) for b in model.buffers()}
    tracker = ModuleTracker(model)
    mode = CreatorMode(tracker) if creators else contextlib.nullcontext()
    seen: dict[int, tuple[torch.Tensor, str]] = {}
    saved_in: dict[int, tuple[str, str]] = {}

    def note(t: torch.Tensor, how: str) -> None:
        k = storage_key(t)
        if k not in state and k not in seen:
            seen[k] = (t, how)
            saved_in[k] = (tracker.current, "saved")

    def pack(t):
        note(t, "saved")
        return t

    try:
        with capture() as cap, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
            yield report
        for _, _, ts in cap.kept_inputs:
            for t in ts:
                note(t, "kept_input")
        for _, _, storage in cap.selective_caches:
            for t in tree_leaves(storage):
                t = getattr(t, "val", t)
                if isinstance(t, torch.Tensor):
                    note(t, "selective_cache")
    finally:
        tracker.remove()
    for k, (t, how) in seen.items():
        module, op = mode.made.get(k, ("input", "input")) if creators else saved_in[k]
        region = module if module in ("input", "loss") else region_of("" if module == "model" else module, names)
        report.tensors.append(
            SavedTensor(region, module, op, how, storage_bytes(t), tuple(t.shape), str(t.dtype).replace("torch.", ""))
        )


# --------------------------------------------------------------------------------------
# Policies on a step, and the measurement
# --------------------------------------------------------------------------------------


def policies_of(step: StepFactory) -> tuple[str, ...]:
    """The activation-checkpointing policies ``step`` takes: its own seam's (perflab's MMDiT:
    every policy), else the generic ones its blocks take from outside."""
    return tuple(step.capabilities["policies"].names) if step.has("policies") else GENERIC_POLICIES


def policy_applied(step: StepFactory, policy: str | None):
    """Inside: ``policy`` acts on ``step`` (its own seam when it declares one, else its blocks
    from outside); ``None`` or "none": nothing changes."""
    if policy in (None, "none"):
        return contextlib.nullcontext()
    check_choice("activation_checkpoint", policy, policies_of(step))
    if step.has("policies"):
        return step.capabilities["policies"].applied(policy)
    return applied(block_groups(blocks(step)), policy)


def measure_saved(step: StepFactory, policy: str | None = None, k: int = 1) -> SavedReport:
    """What step ``k``'s forward under ``policy`` keeps for the backward (the batch is made outside
    the probe; the loss is dropped before the backward)."""
    batch = step.make_batch(k)
    step.model.train()
    names = [n for n, _ in blocks(step)]
    creators = policy != "compile_budget"
    with policy_applied(step, policy), saved_tensor_probe(step.model, names, creators=creators) as rep:
        loss = step.loss(step.model, batch)
    del loss
    return rep


def mmdit_saved(
    cfg: MMDiTConfig | str,
    sh: StepShape,
    dtype: str | torch.dtype = "float32",
    policy: str | None = None,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> SavedReport:
    """:func:`measure_saved` on perflab's MMDiT of ``cfg`` at step shape ``sh`` (its synthetic step:
    ``lab_utils.step.mmdit.synthetic_step``); ``device="meta"`` works for every preset."""
    cfg = resolve_config(cfg)
    height, width = pixels_of(cfg, sh)
    step = synthetic_step(
        cfg,
        batch_size=sh.batch,
        height=height,
        width=width,
        txt_len=sh.txt_tokens,
        device=device,
        dtype=parse_dtype("dtype", dtype),
        seed=seed,
    )
    return measure_saved(step, policy)
