"""The step contract: what every measurement of labs 01, 05, 07 and 08 takes, and the identity
its records carry.

A *factory* is a function named ``package.module:function``.  Called (with whichever of the
keywords ``device``, ``dtype``, ``batch_size``, ``seed`` and ``lab`` it accepts), it returns a
:class:`StepFactory`:

* ``model`` (an ``nn.Module``) and ``optimizer`` (over the model's parameters);
* ``make_batch(k)``: the batch of step ``k``, equal for equal ``k`` and different for different
  ``k`` (seeded; the loader checks both);
* ``loss(model, batch)``: a zero-dimensional tensor whose backward gives the step's gradients;
* optionally ``block_class`` (a class or tuple of classes: the repeated blocks checkpointing
  and telemetry act on; detected from repeated children when absent), ``phases`` (names of
  ``record_function`` ranges the factory opens itself, inside ``make_batch`` or ``loss``),
  ``flops(batch)`` (FLOPs of one forward + backward; counted with ``FlopCounterMode`` when
  absent), ``config`` (what identifies the model's configuration; the model's own ``config``
  attribute when absent), ``grad_clip`` (the total gradient norm is clipped to it before the
  optimizer step; 0: never), ``periodic`` (work run every N steps after the optimizer, each in
  its own phase: a checkpoint save), ``capabilities`` (what a lab section may ask of this
  step beyond the contract, name -> the object that provides it; :data:`CAPABILITIES`) and
  ``close()`` (releases what the step holds beyond its tensors; labs call it when done).

One step is :func:`run_step`: ``make_batch(k)`` (phase ``data_loading``), ``loss``
(``forward``), ``backward``, clip + ``optimizer.step()`` + ``zero_grad`` (``optimizer``), then
each due periodic phase.  A factory that names one of these phases among its own ``phases``
opens that range itself (perflab's MMDiT trainer opens ``data_loading``, ``text_encoding`` and
``image_encoding`` inside ``make_batch``), so no range is opened twice.  On CUDA every phase
ends with a synchronize, so a phase's range holds the GPU work it launched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lab_utils.core.device import annotate

#: The phases every step has, in order.
STEP_PHASES = ("data_loading", "forward", "backward", "optimizer")

#: What a section may ask of a step beyond the contract (``StepFactory.capabilities``), and
#: what the object under each name is.  perflab's MMDiT declares all of them.
CAPABILITIES = {
    "presets": "the model's named presets, their parameter counts against the published ones (lab 01)",
    "diffusers_equivalence": "the blocks against diffusers' FLUX blocks, and learning a fixed batch (lab 01)",
    "flop_formula": "an analytic FLOP count the counted FLOPs are held to (lab 01)",
    "bad_input": "the model config's own refusals of bad parameters (lab 01)",
    "explorer": "a live explorer of the model's seams (labs 01, 05, 07, 08)",
    "memory_formula": "the analytic per-token formula of saved activations, its presets' accounting, "
    "the what-fits projection to large shapes and the FSDP projection (lab 05)",
    "fsdp_check": "real fully_shard runs of the model on gloo against the FSDP projection (lab 05)",
    "policies": "its own activation-checkpointing seam: name -> policy applied, with policies "
    "beyond the generic ones (lab 05, lab 08)",
    "stability_runs": "its own training runs at its presets: QK-norm, bf16 updates, AdamW settings, "
    "low-precision recipes, fp16 loss scaling (lab 07)",
    "train_config": "a trainer configuration whose fields are levers (encoders, loader, checkpoints, "
    "attention path, kernels, ...): lab 08 rebuilds the step with a field changed",
    "tokens": "tokens(batch): tokens of a step, for tokens per second (lab 08)",
    "trainer": "the trainer that owns the step (its loader, encoders and checkpointer: lab 01's explorer)",
    "loss_parts": "loss_parts(model, batch): the loss with its timesteps, for the loss per timestep bucket (lab 07)",
    "poison_batch": "poison_batch(batch, scale): the batch with its inputs scaled, lab 07's provoked spike "
    "(without it a step's floating-point tensors are scaled, or its loss)",
}


@dataclass(frozen=True)
class Periodic:
    """Work a step runs every ``every`` steps (after the optimizer, in its own phase ``name``):
    ``run(k)`` after step ``k`` when ``(k + 1) % every == 0``."""

    name: str
    every: int
    run: Callable[[int], Any]


@dataclass
class StepFactory:
    """What a factory returns (see the module note)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    make_batch: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    block_class: type | tuple[type, ...] | None = None
    phases: tuple[str, ...] = ()
    flops: Callable[[Any], float] | None = None
    config: Any = None
    grad_clip: float = 0.0
    periodic: tuple[Periodic, ...] = ()
    capabilities: Mapping[str, Any] = field(default_factory=dict)
    #: releases what the step holds beyond its tensors (pending async saves, checkpoint files)
    close: Callable[[], None] | None = field(default=None, repr=False)
    name: str = ""  # the factory's "package.module:function", filled in by the loader
    #: how to build this step again (other keywords: a batch size, a lever): filled in by the loader
    source: Any = field(default=None, repr=False)
    #: what was applied on top of the factory's step (lab 08's lever settings)
    settings: dict = field(default_factory=dict)

    def has(self, capability: str) -> bool:
        """Whether the step declares ``capability`` (one of :data:`CAPABILITIES`)."""
        if capability not in CAPABILITIES:
            raise KeyError(f"unknown capability {capability!r}; known: {', '.join(CAPABILITIES)}")
        return capability in self.capabilities

    def rebuild(self, **keywords) -> StepFactory:
        """The same factory (resolved once, not imported again) called with ``keywords`` changed."""
        if self.source is None:
            raise ValueError(f"step {self.name or 'unnamed'} has no source to rebuild from (not loaded by the loader)")
        return self.source.build(**keywords)

    @property
    def device(self) -> torch.device:
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")


def blocks(step_or_model: StepFactory | nn.Module, block_class=None) -> list[tuple[str, nn.Module]]:
    """The repeated blocks, in module order: instances of ``block_class`` when given, else the
    items of every ``nn.ModuleList``/``nn.Sequential`` of at least two children of one class
    (outermost lists only: a block's own inner lists are not blocks)."""
    if isinstance(step_or_model, StepFactory):
        model, block_class = step_or_model.model, block_class or step_or_model.block_class
    else:
        model = step_or_model
    if block_class is not None:
        out = [(n, m) for n, m in model.named_modules() if n and isinstance(m, block_class)]
        return [(n, m) for n, m in out if not any(n.startswith(o + ".") for o, _ in out if o != n)]
    out: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if any(name.startswith(o + ".") or name == o for o, _ in out):
            continue
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
            classes = Counter(type(c) for c in mod)
            if len(classes) == 1:
                out += [(f"{name}.{i}" if name else str(i), c) for i, c in enumerate(mod)]
    return out


def block_groups(named: list[tuple[str, nn.Module]]) -> list[tuple[str, str, int, nn.Module]]:
    """Each block as (name, kind, index, module): its kind is the list that holds it (the name
    without its last part: ``transformer_blocks``), its index its place in that list; the order
    checkpointing's per-kind policies (every other block) count in."""
    seen: Counter = Counter()
    out = []
    for name, mod in named:
        kind = name.rpartition(".")[0] or "blocks"
        out.append((name, kind, seen[kind], mod))
        seen[kind] += 1
    return out


def region_of(name: str, block_names: list[str]) -> str:
    """The block a module belongs to, else its top-level child's name, else ``model``."""
    for b in block_names:
        if name == b or name.startswith(b + "."):
            return b
    return name.split(".")[0] if name else "model"


# --------------------------------------------------------------------------------------
# One step
# --------------------------------------------------------------------------------------


@dataclass
class StepRun:
    """What one :func:`run_step` left: the (detached) loss, the gradient norm before clipping
    (NaN when the step does not clip) and the batch (its shapes are the step's FLOPs)."""

    loss: torch.Tensor
    grad_norm: float
    batch: Any


def _phase(step: StepFactory, name: str, sync: bool):
    """The range of phase ``name`` unless the factory opens it itself; synchronized at its end."""
    if name in step.phases:
        return contextlib.nullcontext()
    dev = step.device

    @contextlib.contextmanager
    def ranged():
        with annotate(name, dev):
            yield
            if sync:
                torch.cuda.synchronize(dev)

    return ranged()


def run_step(step: StepFactory, k: int) -> StepRun:
    """One training step ``k`` in the named phases (see the module note)."""
    sync = step.device.type == "cuda"
    with _phase(step, "data_loading", sync):
        batch = step.make_batch(k)
    with _phase(step, "forward", sync):
        loss = step.loss(step.model, batch)
    with _phase(step, "backward", sync):
        loss.backward()
    with _phase(step, "optimizer", sync):
        gn = math.nan
        if step.grad_clip > 0:
            gn = float(torch.nn.utils.clip_grad_norm_(step.model.parameters(), step.grad_clip))
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)
    for p in step.periodic:
        if (k + 1) % p.every == 0:
            with _phase(step, p.name, sync):
                p.run(k)
    return StepRun(loss.detach(), gn, batch)


# --------------------------------------------------------------------------------------
# Batches: equal for equal k
# --------------------------------------------------------------------------------------


def batch_leaves(batch: Any) -> list:
    """The leaves of a batch, in a fixed order: tensors and plain values of nested dicts,
    lists, tuples, dataclasses and objects."""
    if isinstance(batch, torch.Tensor) or batch is None or isinstance(batch, (int, float, str, bool)):
        return [batch]
    if isinstance(batch, Mapping):
        return [x for k in sorted(batch, key=str) for x in batch_leaves(batch[k])]
    if isinstance(batch, (list, tuple)):
        return [x for v in batch for x in batch_leaves(v)]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [x for f in dataclasses.fields(batch) for x in batch_leaves(getattr(batch, f.name))]
    if hasattr(batch, "__dict__"):
        return [x for k in sorted(vars(batch)) for x in batch_leaves(vars(batch)[k])]
    return [batch]


def same_batch(a: Any, b: Any) -> bool:
    """Whether two batches hold equal leaves (tensors: same shape, dtype and values)."""
    la, lb = batch_leaves(a), batch_leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.cpu(), y.cpu()):
                return False
        elif x != y:
            return False
    return True


def skeleton(batch: Any) -> Any:
    """The batch with every tensor replaced by an empty ``meta`` tensor of its shape and dtype
    (dicts, lists, tuples and dataclasses rebuilt): what a FLOP or token count reads, holding no
    memory (a profile keeps one per step without changing the step's memory)."""
    if isinstance(batch, torch.Tensor):
        return torch.empty(batch.shape, dtype=batch.dtype, device="meta")
    if isinstance(batch, Mapping):
        return type(batch)((k, skeleton(v)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(skeleton(v) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(
            batch, **{f.name: skeleton(getattr(batch, f.name)) for f in dataclasses.fields(batch) if f.init}
        )
    return batch


def batch_size_of(batch: Any) -> int | None:
    """The leading size of the batch's first tensor (None: no tensor in it)."""
    t = next((x for x in batch_leaves(batch) if isinstance(x, torch.Tensor) and x.dim()), None)
    return None if t is None else int(t.shape[0])


# --------------------------------------------------------------------------------------
# Identity: which model a record measured
# --------------------------------------------------------------------------------------


def _config_of(step: StepFactory) -> Any:
    cfg = step.config if step.config is not None else getattr(step.model, "config", None)
    if cfg is None:
        return str(step.model)  # the module tree's repr: classes and layer sizes
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    return dict(cfg) if isinstance(cfg, dict) or hasattr(cfg, "items") else cfg


def config_hash(step: StepFactory) -> str:
    """12 hex digits of sha256 over the model's configuration (sorted JSON; library-version
    fields that do not change the model are dropped)."""
    cfg = _config_of(step)
    if isinstance(cfg, dict):
        cfg = {k: v for k, v in cfg.items() if k not in ("_diffusers_version", "transformers_version", "_name_or_path")}
    text = json.dumps(cfg, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class StepIdentity:
    """What a record of a step carries: the factory, the model class, its parameter count and
    a hash of its configuration.  ``key`` (factory and class) goes into each row's variant on a
    step that is not the default, so ``perflab compare`` never matches rows of two models, and
    matches two versions of one; the count and hash go into the run's parameters, so a
    comparison of two versions says when they differ."""

    factory: str
    model_class: str
    parameters: int
    config_hash: str

    @property
    def key(self) -> str:
        return f"{self.factory}/{self.model_class}"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def extra(self) -> dict:
        """The fields each row of this step carries."""
        return dict(model_class=self.model_class, parameters=self.parameters, config=self.config_hash)

    def __str__(self) -> str:
        return f"{self.key} · {self.parameters:,} parameters · config {self.config_hash}"


def identity(step: StepFactory) -> StepIdentity:
    m = step.model
    return StepIdentity(
        step.name or "unnamed",
        f"{type(m).__module__}.{type(m).__qualname__}",
        sum(p.numel() for p in m.parameters()),
        config_hash(step),
    )
