"""A configuration of a step for the optimization plan: the lab's step, and the lever settings on it.

:class:`StepSetup` is what the planner measures, varies, composes and verifies, for any step:

* on perflab's MMDiT (its ``train_config`` capability) each lever that is a field of the trainer's
  :class:`~lab_utils.model.train.TrainConfig` is set there (the config checks it: a refused
  combination is excluded with its reason) and the step is rebuilt from it;
* any other lever, and every lever on another step, is one of :data:`lab_utils.plan.levers.GENERIC_LEVERS`
  applied to a fresh build of the step's factory (resolved once, never imported again):
  ``batch_size`` builds it at that size, ``compile`` compiles each detected block,
  ``activation_checkpoint`` runs the step's forward under the policy (its blocks from outside, or
  its own seam), ``sdpa_backend`` runs it under ``torch.nn.attention.sdpa_kernel`` (:func:`around`:
  the whole step, a recompute in the backward too), ``recipe`` swaps its
  ``nn.Linear`` layers for the recipe's (``lab_utils.precision.quantized.apply_recipe``).

``to_dict()`` is what a run of the setup must show it ran (the planner's verification checks it):
the trainer's config with its fields set, and the generic settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lab_utils.core.config import ConfigError
from lab_utils.core.device import pick_device
from lab_utils.memory.saved import policies_of, policy_applied
from lab_utils.model.accounting import count_flops
from lab_utils.model.train import TrainConfig
from lab_utils.plan.levers import GENERIC_LEVERS, LEVERS, Excluded, candidates
from lab_utils.precision.quantized import apply_recipe
from lab_utils.step.contract import StepFactory, blocks
from lab_utils.step.mmdit import trainer_step

SDPA_BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
TRAIN_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig) if f.init)
#: Levers of a step without a trainer's config when the lab asks for "auto": the generic ones a
#: CPU times in seconds (compile and recipes join on CUDA).
STEP_CPU_LEVERS = ("activation_checkpoint", "sdpa_backend", "batch_size")
STEP_CUDA_LEVERS = ("compile", "activation_checkpoint", "sdpa_backend", "recipe", "batch_size")


@dataclass(frozen=True)
class StepSetup:
    """The lab's step (``step``: its factory builds the others; None: perflab's MMDiT trainer of
    ``train``), its trainer's config when it has one, and the generic lever settings on it."""

    step: StepFactory | None = field(default=None, compare=False)
    train: TrainConfig | None = None
    settings: tuple = ()  # (lever, value) pairs of the generic levers set, sorted

    @classmethod
    def of(cls, step: StepFactory) -> StepSetup:
        """The setup of a loaded step, nothing changed."""
        return cls(step, step.capabilities.get("train_config"))

    @property
    def device(self) -> torch.device:
        return self.step.device if self.step is not None else pick_device(self.train.device)

    @property
    def batch_size(self) -> int | None:
        given = dict(self.settings).get("batch_size")
        if given is not None:
            return given
        if self.train is not None:
            return self.train.batch_size
        return self.step.source.keywords.get("batch_size") if self.step is not None and self.step.source else None

    def replace(self, **choices) -> StepSetup:
        """This setup with levers set (a trainer's field is checked by its config: ConfigError)."""
        train, settings = self.train, dict(self.settings)
        for lever, value in choices.items():
            if lever not in LEVERS:
                raise ConfigError("levers", lever, "a lever among " + ", ".join(LEVERS))
            if train is not None and lever in TRAIN_FIELDS:
                train = dataclasses.replace(train, **{lever: value})
            elif lever in GENERIC_LEVERS:
                settings[lever] = value
            else:
                raise ConfigError("levers", lever, "a lever this step has (generic: " + ", ".join(GENERIC_LEVERS) + ")")
        return StepSetup(self.step, train, tuple(sorted(settings.items())))

    def to_dict(self) -> dict:
        base = self.train.to_dict() if self.train is not None else {"step": self.step.name if self.step else ""}
        return {**base, **dict(self.settings)}

    def build(self, *, own: StepFactory | None = None) -> StepFactory:
        """A step running this setup; ``own``: the lab's loaded step, used as it is when nothing is
        changed (the step that was checked is the step measured)."""
        settings = dict(self.settings)
        if own is not None and self == StepSetup.of(own):
            return own
        if self.step is None:
            step = trainer_step(self.train)
        elif self.train is not None:
            step = self.step.rebuild(lab=self.train, batch_size=self.train.batch_size)
        else:
            step = self.step.rebuild(**({"batch_size": settings["batch_size"]} if "batch_size" in settings else {}))
        return apply_generic(step, settings)


def apply_generic(step: StepFactory, settings: dict) -> StepFactory:
    """``step`` with the generic levers of ``settings`` applied (the module note); its ``settings``
    say what was applied."""
    loss, ctx = step.loss, []
    if settings.get("compile"):
        for _, blk in blocks(step):
            blk.compile()
    if settings.get("recipe"):
        apply_recipe(step.model, settings["recipe"])
    if settings.get("activation_checkpoint"):
        ctx.append(lambda s=settings["activation_checkpoint"]: policy_applied(step, s))
    if ctx:

        def wrapped(model, batch):
            with contextlib.ExitStack() as stack:
                for c in ctx:
                    stack.enter_context(c())
                return loss(model, batch)

        step.loss = wrapped
    step.settings = {**step.settings, **settings}
    return step


def around(step: StepFactory):
    """What a run of ``step`` goes under as a whole: its SDPA backend (forward and backward, and a
    checkpointed block's recompute, on one kernel), else nothing."""
    backend = step.settings.get("sdpa_backend")
    return sdpa_kernel([SDPA_BACKENDS[backend]]) if backend else contextlib.nullcontext()


def ran(step: StepFactory, setup: StepSetup) -> dict:
    """What a run of ``setup`` shows it ran: its trainer's config (the one the step was built from)
    and the generic settings the build applied."""
    train = step.capabilities.get("train_config")
    base = train.to_dict() if train is not None else {"step": step.name}
    return {**base, **{k: v for k, v in step.settings.items() if k in GENERIC_LEVERS}}


def calls_sdpa(step: StepFactory) -> bool:
    """Whether one forward + backward calls ``scaled_dot_product_attention`` (counted ops)."""
    batch = step.make_batch(1)
    _, per_op = count_flops(lambda: step.loss(step.model, batch).backward())
    step.optimizer.zero_grad(set_to_none=True)
    return any("scaled_dot_product" in k for k in per_op)


def step_candidates(lever: str, setup: StepSetup, device: torch.device) -> tuple[list, list[Excluded]]:
    """Settings of ``lever`` on ``setup``: a trainer's field through its config (:func:`candidates`),
    a generic lever by what the step and the device allow, anything else excluded with why."""
    if setup.train is not None and lever in TRAIN_FIELDS:
        return candidates(lever, setup.train, device)
    if lever not in GENERIC_LEVERS:
        why = "needs a trainer's config with this field (capability train_config): this step does not declare it"
        return [], [Excluded(lever, "", why)]
    step, cuda = setup.step, device.type == "cuda"
    if lever == "compile":
        if not cuda:
            return [], [Excluded(lever, True, "torch.compile on a CPU builds C++ for minutes; measured on CUDA")]
        return [True], []
    if lever == "activation_checkpoint":
        if not blocks(step):
            return [], [Excluded(lever, "full", "no repeated blocks detected (give the factory block_class)")]
        return [p for p in ("full", "selective") if p in policies_of(step)], []
    if lever == "sdpa_backend":
        if not calls_sdpa(step):
            return [], [Excluded(lever, "math", "the model calls no scaled_dot_product_attention")]
        return (["math", "flash", "efficient"] if cuda else ["math"]), []
    if lever == "recipe":  # the trainer's rule for fp8 / MX recipes by compute capability, on the bf16 baseline
        return candidates(lever, SimpleNamespace(recipe="bf16", dtype="float32"), device)
    b = setup.batch_size
    if b is None or step.source is None or not step.source.accepts("batch_size"):
        return [], [Excluded(lever, "", "the factory does not take batch_size")]
    return [2 * b], []


def auto_levers(step: StepFactory, device: torch.device, trainer_levers: tuple) -> tuple:
    """The levers of ``levers="auto"``: a trainer's (``trainer_levers``) on a step with a trainer's
    config, else the generic ones this device times."""
    if step.has("train_config"):
        return tuple(trainer_levers)
    return STEP_CUDA_LEVERS if device.type == "cuda" else STEP_CPU_LEVERS
