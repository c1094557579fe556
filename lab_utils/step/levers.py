"""Lab 08 on any step: the levers that act on any model, measured at the model's own shapes.

Each setting rebuilds the step from its factory (same seed: same weights and batches), applies
the lever, and times whole steps (:func:`lab_utils.step.contract.run_step`, batch 1 each time)
with :func:`lab_utils.core.timing.try_bench`; the speedup is per sample against the baseline.

* ``compile``: ``torch.compile`` on each detected block (``nn.Module.compile``);
* ``activation_checkpoint``: a policy of :mod:`lab_utils.step.policies` on the blocks;
* ``sdpa_backend``: ``torch.nn.attention.sdpa_kernel`` around the step (only when the model
  calls ``scaled_dot_product_attention``);
* ``recipe``: a precision recipe applied by swapping ``nn.Linear`` layers
  (:func:`lab_utils.precision.quantized.apply_recipe`; emulated on a CPU: its time there is the
  emulation's, its value is the numerics);
* ``batch_size``: the factory built at another batch size (when it takes ``batch_size``).

The MMDiT-only levers are excluded with their reason (:data:`MMDIT_ONLY`)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import pandas as pd
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm

from lab_utils.core.config import check_choices
from lab_utils.core.timing import try_bench
from lab_utils.precision.quantized import apply_recipe
from lab_utils.profiling.profiler import count_flops
from lab_utils.step.contract import StepFactory, blocks, run_step
from lab_utils.step.load import build_step
from lab_utils.step.policies import applied

GENERIC_LEVERS = ("compile", "activation_checkpoint", "sdpa_backend", "recipe", "batch_size")
#: Levers of lab 08 that act on perflab's own step only, and why.
MMDIT_ONLY = {
    "kernels": "fused-op kernels replace the MMDiT's own ops (its KernelSet seam); another model has no such seam",
    "attention_path": "perflab's attention paths plug into the MMDiT's attention seam; the SDPA backend is "
    "the generic attention lever",
    "encoders": "precomputing T5/CLIP/VAE outputs acts on the trainer's encoders; a factory's batch is its own",
    "num_workers": "data-loader workers act on the trainer's DataLoader; make_batch(k) is the factory's",
    "pin_memory": "pinned memory acts on the trainer's DataLoader",
    "ckpt_format": "checkpoint formats act on the trainer's checkpointer; the contract has no save",
    "distributed": "distributed strategies are lab 06's, on the MMDiT",
}
SDPA_BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


@dataclass(frozen=True)
class Excluded:
    lever: str
    setting: object
    reason: str


def calls_sdpa(step: StepFactory) -> bool:
    """Whether one forward + backward calls ``scaled_dot_product_attention`` (counted ops)."""
    batch = step.make_batch(1)
    _, per_op = count_flops(lambda: step.loss(step.model, batch).backward())
    step.optimizer.zero_grad(set_to_none=True)
    return any("scaled_dot_product" in k for k in per_op)


def _time(step: StepFactory, ctx, name: str, reps: int, device) -> object:
    def fn():
        with ctx():
            run_step(step, 1)

    return try_bench(fn, name=name, device=device, reps=reps, budget_s=120, check_finite=False, retries=0)


def _settings(lever: str, step: StepFactory, dev: torch.device, batch_size: int, recipe: str):
    """(settings to measure, exclusions) of one lever on this step and device."""
    if lever == "compile":
        if dev.type != "cuda":
            return [], [Excluded(lever, True, "torch.compile on a CPU builds C++ for minutes; measured on CUDA")]
        return [True], []
    if lever == "activation_checkpoint":
        return (["full", "every_other"], []) if blocks(step) else ([], [Excluded(lever, "full", "no blocks")])
    if lever == "sdpa_backend":
        if not calls_sdpa(step):
            return [], [Excluded(lever, "math", "the model calls no scaled_dot_product_attention")]
        names = ["math"] + (["flash", "efficient"] if dev.type == "cuda" else [])
        return names, []
    if lever == "recipe":
        return [recipe], []
    return [2 * batch_size], []


def measure_levers(
    spec: str,
    *,
    levers=GENERIC_LEVERS,
    step_kwargs: dict | None = None,
    recipe: str = "fp8_row",
    reps: int = 3,
    progress: bool = True,
) -> tuple[pd.DataFrame, list[Excluded]]:
    """Each lever's settings on the step ``spec`` names, built with ``step_kwargs`` (device,
    dtype, batch_size, seed), against its baseline (see the module note): rows lever, setting,
    batch, time_ms, per_sample_ms, speedup, stable; and what was excluded, with the reason
    (MMDiT-only levers included)."""
    check_choices("levers", list(levers), GENERIC_LEVERS)
    kw = {"device": "cpu", "dtype": torch.float32, "batch_size": 2, "seed": 0, **(step_kwargs or {})}
    dev, batch_size, seed = torch.device(kw["device"]), kw["batch_size"] or 2, kw["seed"]

    def build(b=batch_size):
        return build_step(spec, **{**kw, "device": dev, "batch_size": b})

    base = build()
    t0 = _time(base, contextlib.nullcontext, "baseline", reps, dev)
    rows = [_row("baseline", "", batch_size, t0, t0, batch_size)]
    excluded = [Excluded(k, "", why) for k, why in MMDIT_ONLY.items()]
    for lever in tqdm(list(levers), desc="levers", disable=not progress):
        settings, ex = _settings(lever, base, dev, batch_size, recipe)
        excluded += ex
        for s in settings:
            b = s if lever == "batch_size" else batch_size
            step, ctx = build(b), contextlib.nullcontext
            if lever == "batch_size" and _batch_of(step) != b:
                excluded.append(Excluded(lever, s, "the factory does not take batch_size"))
                continue
            try:
                if lever == "compile":
                    for _, blk in blocks(step):
                        blk.compile()
                elif lever == "recipe":
                    apply_recipe(step.model, s, seed=seed)
                elif lever == "activation_checkpoint":
                    ctx = lambda s=s, step=step: applied(blocks(step), s)  # noqa: E731
                elif lever == "sdpa_backend":
                    ctx = lambda s=s: sdpa_kernel([SDPA_BACKENDS[s]])  # noqa: E731
            except Exception as e:  # noqa: BLE001 - a lever that cannot apply is excluded with its reason
                excluded.append(Excluded(lever, s, f"{type(e).__name__}: {e}"))
                continue
            t = _time(step, ctx, f"{lever}={s}", reps, dev)
            if not getattr(t, "ok", False):
                excluded.append(Excluded(lever, s, f"the step failed: {getattr(t, 'reason', t)}"))
                continue
            rows.append(_row(lever, s, b, t, t0, batch_size))
    return pd.DataFrame(rows), excluded


def _batch_of(step: StepFactory) -> int | None:
    b = step.make_batch(0)
    t = b if isinstance(b, torch.Tensor) else next((v for v in _leaves(b) if isinstance(v, torch.Tensor)), None)
    return None if t is None else int(t.shape[0])


def _leaves(b):
    if isinstance(b, dict):
        return list(b.values())
    if isinstance(b, (list, tuple)):
        return list(b)
    return list(vars(b).values()) if hasattr(b, "__dict__") else []


def _row(lever: str, setting, batch: int, t, base, base_batch: int) -> dict:
    ms = float(getattr(t, "median_ms", math.nan))
    per = ms / batch
    base_per = float(getattr(base, "median_ms", math.nan)) / base_batch
    verdict = getattr(t, "stability", None)
    return dict(
        lever=lever,
        setting=str(setting),
        batch=batch,
        time_ms=ms,
        per_sample_ms=per,
        speedup=base_per / per if per > 0 else math.nan,
        stable=getattr(verdict, "stable", None),
        timing=t,
    )


def excluded_frame(excluded: list[Excluded]) -> pd.DataFrame:
    return pd.DataFrame([dict(lever=e.lever, setting=str(e.setting), reason=e.reason) for e in excluded])
