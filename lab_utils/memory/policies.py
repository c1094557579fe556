"""Activation-checkpointing policies on the same step: saved bytes, peak, counted FLOPs,
step time, and gradients against no checkpointing."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from tqdm.auto import tqdm

from lab_utils.core.dtypes import dtype_name, parse_dtype
from lab_utils.core.noise import quiet_stderr_fd
from lab_utils.core.timing import try_bench
from lab_utils.memory.saved import FORMULA_POLICIES, StepShape, batch_for, measure_saved, saved_bytes_formula
from lab_utils.model import MMDiTConfig, build_model
from lab_utils.model.train import rf_loss

# --------------------------------------------------------------------------------------
# AC policies on the same step: peak, saved bytes, time, recomputed FLOPs, gradients
# --------------------------------------------------------------------------------------

#: Gradient tolerance of a policy against no checkpointing, per dtype (atol, rtol): recompute
#: replays the same kernels, so on CPU the gradients agree to rounding of reordered sums.
GRAD_TOL = {"float32": (1e-6, 1e-5), "bfloat16": (2e-2, 2e-2)}


def step_grads(cfg: MMDiTConfig, sh: StepShape, dtype, policy: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of one rectified-flow step under ``policy`` (same weights and batch for every policy)."""
    dt = parse_dtype("dtype", dtype)
    model = build_model(cfg.replace(activation_checkpoint=policy), dtype=dt, seed=seed)
    model.train()
    gen = torch.Generator().manual_seed(seed)
    batch = batch_for(cfg, sh, dt, torch.device("cpu"), gen)
    rf_loss(model, batch, gen).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def grad_mismatch(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], dtype) -> list[str]:
    """Names of parameters whose gradient differs beyond :data:`GRAD_TOL` (empty = equal)."""
    atol, rtol = GRAD_TOL[dtype_name(dtype)]
    return [n for n in ref if not torch.allclose(got[n].float(), ref[n].float(), atol=atol, rtol=rtol)]


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    saved_bytes: int  # measured by the saved-tensor hooks
    formula_bytes: int | None  # the analytic model (None for compile_budget)
    peak_bytes: int  # allocator peak of one step above the state before it
    flops: float  # counted FLOPs of forward + backward
    timing: object  # lab_utils.core.timing Timing or BenchFailure
    grads_equal: bool


def step_flops(model: nn.Module, batch, gen_seed: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    """Counted FLOPs of one forward + backward (``FlopCounterMode``: matmul and attention
    FLOPs), and the gradients that step produced."""
    with FlopCounterMode(display=False) as fc:
        rf_loss(model, batch, torch.Generator(device=batch.img.device).manual_seed(gen_seed)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(fc.get_total_flops()), grads


def step_peak(model: nn.Module, batch, seed: int = 0) -> int:
    """Peak bytes allocated during one forward + backward above what was live before: CUDA's
    allocator statistics, or on CPU the profiler's memory events (their running sum)."""
    dev = batch.img.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        rf_loss(model, batch, gen).backward()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
    else:
        with (
            quiet_stderr_fd(),  # kineto's profiler_start/stop markers
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof,
        ):
            rf_loss(model, batch, gen).backward()
        events = sorted(
            (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
        )
        live = peak = 0
        for _, nbytes in events:  # +allocation / -free, in time order
            live += nbytes
            peak = max(peak, live)
    model.zero_grad(set_to_none=True)
    return int(peak)


def compare_policies(
    cfg: MMDiTConfig,
    sh: StepShape,
    dtype,
    policies: Iterable[str],
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    reps: int = 5,
    progress: bool = True,
) -> list[PolicyResult]:
    """Every policy on the same weights and batch: saved bytes (hooks and formula), allocator
    peak, counted FLOPs, step time (``lab_utils.core.timing``) and its gradients against no
    checkpointing (a mismatch raises)."""
    dt = parse_dtype("dtype", dtype)
    dev = torch.device(device)
    policies = list(policies)
    batch = batch_for(cfg, sh, dt, dev, torch.Generator(device="cpu").manual_seed(seed))
    _, ref = step_flops(
        build_model(cfg.replace(activation_checkpoint="none"), device=dev, dtype=dt, seed=seed), batch, seed
    )
    out = []
    for pol in tqdm(policies, desc="AC policies", disable=not progress):
        pcfg = cfg.replace(activation_checkpoint=pol)
        model = build_model(pcfg, device=dev, dtype=dt, seed=seed)
        model.train()
        saved = measure_saved(pcfg, sh, dt, device=dev, seed=seed, model=model).total
        formula = (
            sum(saved_bytes_formula(pcfg, sh, dt, device_type=dev.type).values()) if pol in FORMULA_POLICIES else None
        )
        peak = step_peak(model, batch, seed)
        flops, grads = step_flops(model, batch, seed)
        bad = grad_mismatch(ref, grads, dt)
        if bad:
            raise AssertionError(f"policy {pol!r}: gradients differ from no checkpointing in {bad[:5]}")

        def step(model=model):
            rf_loss(model, batch, torch.Generator(device=dev).manual_seed(seed)).backward()
            model.zero_grad(set_to_none=True)

        # A shared CPU's step times are context, not results: no retries there.
        timing = try_bench(
            step,
            name=f"step-{pol}",
            device=dev,
            reps=reps,
            budget_s=60,
            check_finite=False,
            retries=2 if dev.type == "cuda" else 0,
        )
        out.append(PolicyResult(pol, saved, formula, peak, flops, timing, True))
    return out
