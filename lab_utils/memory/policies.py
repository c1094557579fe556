"""Activation-checkpointing policies on one step: saved bytes, peak, counted FLOPs, step time,
and gradients against no checkpointing (a mismatch raises).

Every policy runs on the same weights and the same batch (the step's batch 1), through
:func:`lab_utils.memory.saved.policy_applied`: perflab's MMDiT through its own seam (its double /
single and compile_budget policies too), any other step's blocks from outside.  A policy that does
not act on this device (``offload``: ``save_on_cpu`` moves nothing on a CPU) is measured and
marked, never taken for a saving."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from lab_utils.core.dtypes import dtype_name
from lab_utils.core.noise import quiet_stderr_fd
from lab_utils.core.timing import try_bench
from lab_utils.memory.saved import measure_saved, policy_applied
from lab_utils.model.accounting import count_flops
from lab_utils.model.checkpointing import ACTIVATION_CHECKPOINTS
from lab_utils.step.contract import StepFactory, block_groups, blocks

#: Gradient tolerance of a policy against no checkpointing, per dtype (atol, rtol): recompute
#: replays the same kernels, so on CPU the gradients agree to rounding of reordered sums.
GRAD_TOL = {"float32": (1e-6, 1e-5), "bfloat16": (2e-2, 2e-2), "float16": (2e-2, 2e-2)}


def grads_of(step: StepFactory, policy: str | None = "none", k: int = 1) -> dict[str, torch.Tensor]:
    """Gradients of step ``k``'s forward + backward under ``policy`` (weights untouched)."""
    step.optimizer.zero_grad(set_to_none=True)
    batch = step.make_batch(k)
    with policy_applied(step, policy):
        step.loss(step.model, batch).backward()
    out = {n: p.grad.detach().clone() for n, p in step.model.named_parameters() if p.grad is not None}
    step.optimizer.zero_grad(set_to_none=True)
    return out


def param_dtype(step: StepFactory) -> str:
    p = next(step.model.parameters(), None)
    return dtype_name(p.dtype) if p is not None else "float32"


def grad_mismatch(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], dtype="float32") -> list[str]:
    """Parameters whose gradient differs beyond :data:`GRAD_TOL` of ``dtype``, or that have a
    gradient on one side only (empty = equal)."""
    atol, rtol = GRAD_TOL.get(dtype_name(dtype), GRAD_TOL["bfloat16"])
    bad = sorted(set(ref) ^ set(got))
    off = [n for n in ref if n in got and not torch.allclose(got[n].float(), ref[n].float(), atol=atol, rtol=rtol)]
    return bad + off


def excursion(fn: Callable[[], object], device: torch.device) -> tuple[int, int]:
    """Bytes allocated while ``fn()`` runs above what was live before: at their peak, and still
    held when it returns.  CUDA's allocator statistics (``max_memory_allocated``), or on CPU the
    running sum of the profiler's allocation events (+ allocation, - free, in time order)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base), int(torch.cuda.memory_allocated(device) - base)
    with (
        quiet_stderr_fd(),  # kineto's profiler_start/stop markers
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return int(peak), int(live)


def peak_above(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated while ``fn()`` runs above what was live before (:func:`excursion`)."""
    return excursion(fn, device)[0]


def acts_on(policy: str, device_type: str) -> bool:
    """Whether a policy does what it is for on this device: ``offload`` (``save_on_cpu``)
    moves saved activations to host memory, so on a CPU it moves nothing."""
    return not (policy == "offload" and device_type == "cpu")


def saved_means(policy: str, dev: torch.device) -> str:
    """What a policy's saved bytes are: kept for the backward; under ``offload`` the bytes
    left on the device, and on a CPU (where ``save_on_cpu`` moves nothing, so neither the
    memory nor the peak drops) the device bytes it would keep on a GPU."""
    if policy != "offload":
        return "kept for the backward (saved_tensors_hooks)"
    if dev.type == "cpu":
        return "device bytes it would keep on a GPU (on CPU save_on_cpu moves nothing: no memory is freed here)"
    return "kept on the device (the rest is in host memory)"


def treated_blocks(step: StepFactory, policy: str) -> int:
    """How many of the step's blocks ``policy`` treats (the MMDiT's seam: its own kinds)."""
    pol = ACTIVATION_CHECKPOINTS[policy]
    if step.has("policies"):
        with policy_applied(step, policy):
            return len(getattr(step.model, "block_runners", {}))
    return sum(pol.treats(kind, i) for _, kind, i, _ in block_groups(blocks(step)))


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    blocks: int  # blocks the policy treats
    saved_bytes: int  # measured by the saved-tensor hooks
    peak_bytes: int  # allocator peak of one forward + backward above the state before it
    flops: float  # counted FLOPs of forward + backward (recompute included)
    timing: object  # lab_utils.core.timing Timing or BenchFailure
    grads_equal: bool
    acts_here: bool  # False: the policy does not do what it is for on this device (offload on CPU)


def compare_policies(
    step: StepFactory, policies: Iterable[str], *, reps: int = 3, progress: bool = True
) -> list[PolicyResult]:
    """Every policy on the same weights and batch (see the module note)."""
    policies = list(policies)
    dev, dt = step.device, param_dtype(step)
    ref = grads_of(step, "none")
    batch = step.make_batch(1)
    out = []
    for pol in tqdm(policies, desc="AC policies", disable=not progress):
        saved = measure_saved(step, pol).total
        bad = grad_mismatch(ref, grads_of(step, pol), dt)
        if bad:
            raise AssertionError(f"policy {pol!r}: gradients differ from no checkpointing in {bad[:5]}")

        def fwd_bwd(pol=pol):
            with policy_applied(step, pol):
                step.loss(step.model, batch).backward()
            step.optimizer.zero_grad(set_to_none=True)

        peak = peak_above(fwd_bwd, dev)
        flops, _ = count_flops(fwd_bwd)
        # A shared CPU's step times are context, not results: no retries there.
        timing = try_bench(
            fwd_bwd,
            name=f"step-{pol}",
            device=dev,
            reps=reps,
            budget_s=60,
            check_finite=False,
            retries=2 if dev.type == "cuda" else 0,
        )
        treated = treated_blocks(step, pol)
        out.append(PolicyResult(pol, treated, saved, peak, float(flops), timing, True, acts_on(pol, dev.type)))
    return out
