"""The contract of a step perflab did not write, and the identity its records carry.

A *factory* is a function named ``package.module:function``.  Called (with whichever of the
keywords ``device``, ``dtype``, ``batch_size``, ``seed`` it accepts), it returns a
:class:`StepFactory`:

* ``model`` (an ``nn.Module``) and ``optimizer`` (over the model's parameters);
* ``make_batch(k)``: the batch of step ``k``, the same for the same ``k`` (seeded);
* ``loss(model, batch)``: a scalar tensor whose backward gives the step's gradients;
* optionally ``block_class`` (a class or tuple of classes: the repeated blocks checkpointing
  and telemetry act on; detected from repeated children when absent), ``phases`` (names of
  ``torch.profiler.record_function`` ranges the factory opens itself, inside ``make_batch``
  or ``loss``), ``flops(batch)`` (FLOPs of one forward + backward; counted with
  ``FlopCounterMode`` when absent) and ``config`` (what identifies the model's configuration;
  the model's own ``config`` attribute when absent).

One step is: ``make_batch(k)`` (phase ``data_loading``), ``loss`` (``forward``), ``backward``,
``optimizer.step()`` + ``zero_grad`` (``optimizer``): :func:`run_step`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

#: The phases every step has, in order (the names lab 01's trainer uses for the same work).
STEP_PHASES = ("data_loading", "forward", "backward", "optimizer")


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
    name: str = ""  # the factory's "package.module:function", filled in by load_step


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


def region_of(name: str, block_names: list[str]) -> str:
    """The block a module belongs to, else its top-level child's name, else ``model``."""
    for b in block_names:
        if name == b or name.startswith(b + "."):
            return b
    return name.split(".")[0] if name else "model"


def run_step(step: StepFactory, k: int) -> torch.Tensor:
    """One training step ``k`` in the four named phases; returns the (detached) loss."""
    with record_function("data_loading"):
        batch = step.make_batch(k)
    with record_function("forward"):
        loss = step.loss(step.model, batch)
    with record_function("backward"):
        loss.backward()
    with record_function("optimizer"):
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


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
    a hash of its configuration.  ``key`` (factory and class) goes into each generic row's
    variant, so ``perflab compare`` never matches rows of two models, and matches two
    versions of one; the count and hash go into the run's parameters, so a comparison of two
    versions says when they differ."""

    factory: str
    model_class: str
    parameters: int
    config_hash: str

    @property
    def key(self) -> str:
        return f"{self.factory}/{self.model_class}"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

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
