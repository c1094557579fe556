"""The levers an optimization plan may pull, and which of their settings can run here.

A lever acts on a step's configuration (:class:`lab_utils.plan.setup.StepSetup`).  The
*generic* ones (:data:`GENERIC_LEVERS`: ``torch.compile`` per block, activation checkpointing,
the SDPA backend, a precision recipe, the batch size) act on any step; on perflab's MMDiT each of
them is the field of the same name of its trainer's :class:`~lab_utils.model.train.TrainConfig`
(its ``train_config`` capability), as are the levers only a trainer has (kernels, attention path,
encoders, loader workers, pinned memory, checkpoint format).  A lever declares the phases of the
step it acts on: a plan composes a lever's measured effect on those phases only, so noise in the
other phases of the lever's measurement does not leak into the prediction. Each lever carries its
risk (numerical, memory, engineering effort) in words, for the recommendations.

:func:`candidates` lists the settings a lever can try on a device, and the settings
it cannot, each with its reason (the plan goes on without them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab_kernels.registry import variants
from lab_utils.attention import paths as attention_paths
from lab_utils.attention.attend import available_paths
from lab_utils.core.config import ConfigError
from lab_utils.model.checkpointing import ACTIVATION_CHECKPOINTS
from lab_utils.model.config import KERNEL_OPS
from lab_utils.precision.quantized import RECIPES

COMPUTE = ("forward", "backward")


#: Every phase a step has (the trainer's names; another step has the first four and its own).
ALL_STEP_PHASES = ("data_loading", "text_encoding", "image_encoding", "forward", "backward", "optimizer")


@dataclass(frozen=True)
class Lever:
    name: str  # the TrainConfig field it sets (or, generic, what it does to any step)
    phases: tuple[str, ...]  # the step phases its effect is composed on
    numerical: str  # numerical risk, in words
    effort: str  # engineering effort, in words
    what: str  # one line for the recommendations
    generic: bool = False  # acts on any step, not only through a trainer's config


LEVERS: dict[str, Lever] = {
    lv.name: lv
    for lv in (
        Lever(
            "compile",
            COMPUTE,
            "none expected (same math, fused)",
            "low: one call per block; compile time",
            "torch.compile each block",
            generic=True,
        ),
        Lever(
            "kernels",
            COMPUTE,
            "low: fused ops agree with the reference within dtype tolerance",
            "medium: a kernel library to keep",
            "fused-op kernel variant",
        ),
        Lever(
            "attention_path",
            COMPUTE,
            "low: checked against float64 attention in lab 03",
            "low: a path name",
            "attention path",
        ),
        Lever(
            "activation_checkpoint",
            COMPUTE,
            "none (recomputation is exact)",
            "low: a policy name",
            "activation-checkpointing policy",
            generic=True,
        ),
        Lever(
            "recipe",
            COMPUTE,
            "high: low-precision matmuls; see lab 04's convergence runs",
            "medium: scaling recipes to monitor",
            "precision recipe",
            generic=True,
        ),
        Lever(
            "sdpa_backend",
            COMPUTE,
            "low: the same attention, another kernel (float32 agreement to rounding)",
            "low: one context manager (torch.nn.attention.sdpa_kernel)",
            "scaled_dot_product_attention backend",
            generic=True,
        ),
        Lever(
            "batch_size",
            ALL_STEP_PHASES,
            "low: more samples per step (the learning rate may want to follow)",
            "low: a number, if the memory holds it (lab 05's what fits)",
            "batch size (timed per sample)",
            generic=True,
        ),
        Lever("autocast", COMPUTE, "medium: bf16 activations", "low: one context manager", "bf16 autocast"),
        Lever(
            "encoders",
            ("data_loading", "text_encoding", "image_encoding"),
            "none (same embeddings, cached)",
            "medium: an embedding cache to build and store",
            "precomputed text/image embeddings",
        ),
        Lever("num_workers", ("data_loading",), "none", "low: a loader argument", "data-loader workers"),
        Lever("pin_memory", ("data_loading",), "none", "low: a loader argument", "pinned host memory"),
        # an async save writes from a background thread while the next steps run: it acts on
        # their phases as well as on the blocking part of the save
        Lever(
            "ckpt_format",
            ("checkpoint", "data_loading", "text_encoding", "image_encoding", "forward", "backward", "optimizer"),
            "none (same state saved)",
            "low: a format name; async needs the previous save awaited",
            "checkpoint format",
        ),
        Lever(
            "distributed",
            COMPUTE + ("communication",),
            "low: same math, reduced in another order",
            "high: a multi-process launch",
            "distributed strategy",
        ),
    )
}

ASYNC_NOTE = "the interval (ckpt_every) is kept; a plan amortizes the save over it"
#: The levers any step takes.
GENERIC_LEVERS = tuple(n for n, lv in LEVERS.items() if lv.generic)


def check_levers(param: str, names) -> tuple[str, ...]:
    """Lever names, validated: an unknown name raises ConfigError naming ``param``."""
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise ConfigError(param, names, "a list of lever names: " + ", ".join(LEVERS))
    for n in names:
        if n not in LEVERS:
            raise ConfigError(param, names, f"lever names among {', '.join(LEVERS)} ({n!r} is not one)")
    if len(set(names)) != len(names):
        raise ConfigError(param, names, "each lever at most once")
    return tuple(names)


@dataclass(frozen=True)
class Excluded:
    lever: str
    value: object
    reason: str


def _kernel_options(device: torch.device, dtype: torch.dtype) -> tuple[list, list[Excluded]]:
    ok, out = [], []
    for name in ("compile", "triton"):
        whys = [
            v.why_not(device.type, dtype)
            for op in KERNEL_OPS
            for v in variants(op, include_unavailable=True)
            if v.name == name
        ]
        why = next((w for w in whys if w), None)
        if name == "triton" and device.type == "cpu":
            why = "Triton runs on CPU only through its interpreter, which is for correctness and is never timed"
        (out.append(Excluded("kernels", name, why)) if why else ok.append(name))
    return ok, out


def _attention_options(device, dtype, base: str) -> tuple[list, list[Excluded]]:
    here = set(available_paths(device.type, dtype, mask="full", backward=True, include_reference=False))
    ok, out = [], []
    for name, p in attention_paths.REGISTRY.items():
        if name == base or p.kind == "reference":
            continue
        if name == "triton" and device.type == "cpu":
            out.append(Excluded("attention_path", name, "Triton on CPU is the interpreter: never timed"))
        elif name in here:
            ok.append(name)
        else:
            why = p.why_not(device=device.type, dtype=dtype, mask="full", layout="bhld", head_dim=64, backward=True)
            out.append(Excluded("attention_path", name, why or "not available here"))
    return ok, out


def candidates(lever: str, base, device: torch.device, *, world_size: int = 1) -> tuple[list, list[Excluded]]:
    """Settings of ``lever`` (other than the base's) that can run on ``device``, and those
    that cannot, each with its reason. ``base`` is the measured step's TrainConfig (a lever with
    no field of that name there, ``sdpa_backend``, is for the step setup: ``plan.setup``)."""
    check_levers("levers", [lever])
    if lever == "batch_size":
        return [2 * base.batch_size], []
    dtype = torch.bfloat16 if base.dtype == "bfloat16" else torch.float32
    cuda = device.type == "cuda"
    if lever == "compile":
        return ([] if base.compile else [True]), []
    if lever == "kernels":
        ok, out = _kernel_options(device, dtype)
        return [k for k in ok if k != base.kernels], out
    if lever == "attention_path":
        return _attention_options(device, dtype, base.attention_path)
    if lever == "activation_checkpoint":
        opts = ["full", "selective"] if base.activation_checkpoint == "none" else ["none"]
        out = (
            [Excluded(lever, "compile_budget", "needs torch.compile of every block (minutes on CPU)")]
            if not cuda
            else []
        )
        return [o for o in opts if o in ACTIVATION_CHECKPOINTS], out
    if lever == "recipe":
        if not cuda:
            return [], [
                Excluded(lever, r, "low-precision matmuls are emulated on CPU: no speedup to measure")
                for r in RECIPES
                if r != base.recipe
            ]
        cap = torch.cuda.get_device_capability(device)
        ok = [r for r in ("fp8_tensor", "fp8_row") if r != base.recipe]
        out = [
            Excluded(lever, r, f"needs sm_100 (this device is sm_{cap[0]}{cap[1]})")
            for r in ("mxfp8",)
            if cap < (10, 0)
        ]
        return (ok if cap >= (8, 9) else []), out + (
            [] if cap >= (8, 9) else [Excluded(lever, r, "fp8 needs sm_89 or newer") for r in ok]
        )
    if lever == "autocast":
        if not cuda:
            return [], [Excluded(lever, "bf16", "bf16 autocast on CPU runs without bf16 matmul units here")]
        return (["bf16"] if base.autocast == "none" else []), []
    if lever == "encoders":
        return (["precomputed"] if base.encoders == "live" else []), []
    if lever == "num_workers":
        return [w for w in (0, 2) if w != base.num_workers], []
    if lever == "pin_memory":
        if not cuda:
            return [], [Excluded(lever, True, "pinned memory speeds host-to-GPU copies; there is no GPU")]
        return ([] if base.pin_memory else [True]), []
    if lever == "ckpt_format":
        if not base.ckpt_every:
            return [], [Excluded(lever, "dcp_async", "the measured step saves no checkpoint (ckpt_every = 0)")]
        return [f for f in ("dcp", "dcp_async") if f != base.ckpt_format], []
    # distributed
    if world_size < 2:
        return [], [Excluded(lever, "fsdp", "the measured step runs on one process: no strategy to change")]
    return [], [Excluded(lever, "fsdp", "multi-process plans are projected by lab 06, not run by this lab")]
