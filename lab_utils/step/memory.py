"""Lab 05 on any step: where the bytes of a training step go.

* state: parameters, gradients and the optimizer's state, read from the optimizer itself
  (every tensor in ``optimizer.state``, each storage once);
* saved activations: every storage autograd saves for the backward (``saved_tensors_hooks``;
  parameters and buffers skipped), every input a checkpointed block keeps and every output a
  selective policy caches, each counted once and attributed to the module that made it (the
  innermost module running when its op ran), its block and its aten op;
* policies: :mod:`lab_utils.step.policies` on the detected blocks, each step's saved bytes,
  peak, time and its gradients against no checkpointing (a mismatch raises);
* what fits: the largest batch whose real step (state + the step's measured peak) fits the
  device's bytes, by bisection on real steps.  The analytic formula of saved bytes
  (:func:`lab_utils.memory.saved.saved_bytes_formula`) knows only perflab's MMDiT.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from tqdm.auto import tqdm

from lab_utils.core.config import check_int
from lab_utils.core.noise import quiet_stderr_fd
from lab_utils.core.timing import try_bench
from lab_utils.memory.saved import CreatorMode, RegionTracker, storage_bytes, storage_key
from lab_utils.step.contract import StepFactory, blocks, region_of
from lab_utils.step.policies import STEP_POLICIES, applied

#: Gradient tolerance of a policy against no checkpointing (float32 atol, rtol): recompute
#: replays the same kernels on the same inputs.
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-5
FORMULA_NOTE = (
    "the analytic formula of saved bytes and the what-fits projection to large shapes know only "
    "perflab's MMDiT; for this step, saved bytes are measured and what fits is bisected on real steps"
)


# --------------------------------------------------------------------------------------
# State: parameters, gradients, optimizer
# --------------------------------------------------------------------------------------


def _bytes_once(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(storage_key(t), storage_bytes(t))
    return sum(seen.values())


def state_bytes(step: StepFactory) -> dict[str, int]:
    """Bytes of parameters, gradients (one per trainable parameter, as a step leaves them
    before ``zero_grad``) and the optimizer's state (what ``optimizer.state`` holds now)."""
    params = list(step.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    opt = [t for st in step.optimizer.state.values() for t in tree_leaves(st) if isinstance(t, torch.Tensor)]
    return {
        "parameters": _bytes_once(params),
        "gradients": sum(p.numel() * p.element_size() for p in trainable),
        "optimizer": _bytes_once(t for t in opt if t.device.type != "meta"),
    }


# --------------------------------------------------------------------------------------
# Saved activations, attributed to the module tree
# --------------------------------------------------------------------------------------


class ModuleTracker(RegionTracker):
    """The innermost module running (forward pre/post hooks on every module, by its
    ``named_modules`` name); ``loss`` outside."""

    def __init__(self, model: nn.Module, outside: str = "loss"):
        self.stack = [outside]
        self.handles = []
        for name, mod in model.named_modules():
            self._track(mod, name or "model")


@dataclass
class SavedProbe:
    """The storages kept for the backward after one forward, each once."""

    rows: list[dict] = field(default_factory=list)  # module, region, op, how, bytes, shape, dtype

    @property
    def total(self) -> int:
        return sum(r["bytes"] for r in self.rows)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=["region", "module", "op", "how", "bytes", "shape", "dtype"])

    def by(self, *cols: str) -> dict:
        out: dict = defaultdict(int)
        for r in self.rows:
            out[tuple(r[c] for c in cols) if len(cols) > 1 else r[cols[0]]] += r["bytes"]
        return dict(out)


@contextmanager
def saved_probe(model: nn.Module, block_names: list[str], kept=None) -> Iterator[SavedProbe]:
    """Inside: what the forward keeps for the backward (see the module note); complete on
    exit.  ``kept``: the :class:`lab_utils.step.policies.Kept` of an active policy."""
    probe = SavedProbe()
    state = {storage_key(p) for p in model.parameters()} | {storage_key(b) for b in model.buffers()}
    tracker = ModuleTracker(model)
    mode = CreatorMode(tracker)
    seen: dict[int, tuple[torch.Tensor, str]] = {}

    def note(t: torch.Tensor, how: str) -> None:
        k = storage_key(t)
        if k not in state and k not in seen:
            seen[k] = (t, how)

    def pack(t):
        note(t, "saved")
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
            yield probe
        for _, ts in kept.inputs if kept is not None else ():
            for t in ts:
                note(t, "kept_input")
        for _, storage in kept.caches if kept is not None else ():
            for t in tree_leaves(storage):
                t = getattr(t, "val", t)
                if isinstance(t, torch.Tensor):
                    note(t, "selective_cache")
    finally:
        tracker.remove()
    for k, (t, how) in seen.items():
        module, op = mode.made.get(k, ("input", "input"))
        region = module if module in ("input", "loss") else region_of("" if module == "model" else module, block_names)
        probe.rows.append(
            dict(
                region=region,
                module=module,
                op=op,
                how=how,
                bytes=storage_bytes(t),
                shape=tuple(t.shape),
                dtype=str(t.dtype).replace("torch.", ""),
            )
        )


def measure_saved(step: StepFactory, policy: str = "none", k: int = 1) -> SavedProbe:
    """Saved bytes of step ``k``'s forward under ``policy`` (the batch is made outside the probe)."""
    bl = blocks(step)
    batch = step.make_batch(k)
    step.model.train()
    with applied(bl, policy) as kept, saved_probe(step.model, [n for n, _ in bl], kept) as probe:
        loss = step.loss(step.model, batch)
    del loss
    return probe


# --------------------------------------------------------------------------------------
# Policies on the same step: saved bytes, peak, time, gradients
# --------------------------------------------------------------------------------------


def grads_of(step: StepFactory, policy: str, k: int = 1) -> dict[str, torch.Tensor]:
    """Gradients of step ``k``'s forward + backward under ``policy`` (weights untouched)."""
    step.optimizer.zero_grad(set_to_none=True)
    batch = step.make_batch(k)
    with applied(blocks(step), policy):
        step.loss(step.model, batch).backward()
    out = {n: p.grad.detach().clone() for n, p in step.model.named_parameters() if p.grad is not None}
    step.optimizer.zero_grad(set_to_none=True)
    return out


def grad_mismatch(ref: dict, got: dict, atol: float = GRAD_ATOL, rtol: float = GRAD_RTOL) -> list[str]:
    """Parameters whose gradient differs (or is missing on one side) beyond the tolerance."""
    bad = sorted(set(ref) ^ set(got))
    return bad + [n for n in ref if n in got and not torch.allclose(got[n], ref[n], atol=atol, rtol=rtol)]


def step_peak(fn: Callable[[], None], device: torch.device) -> int:
    """Peak bytes allocated while ``fn()`` runs above what was live before: CUDA's allocator
    statistics, or on CPU the running sum of the profiler's allocation events."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    with (
        quiet_stderr_fd(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return int(peak)


def _device(step: StepFactory) -> torch.device:
    p = next(step.model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def compare_policies(
    step: StepFactory, policies: Iterable[str] = STEP_POLICIES, *, reps: int = 3, progress: bool = True
) -> pd.DataFrame:
    """Every policy on the same weights and batch: saved bytes, peak of forward + backward,
    step time, and gradients against no checkpointing (a mismatch raises)."""
    policies = list(policies)
    dev = _device(step)
    ref = grads_of(step, "none")
    bl = blocks(step)
    rows = []
    for pol in tqdm(policies, desc="AC policies", disable=not progress):
        saved = measure_saved(step, pol).total
        bad = grad_mismatch(ref, grads_of(step, pol))
        if bad:
            raise AssertionError(f"policy {pol!r}: gradients differ from no checkpointing in {bad[:5]}")
        batch = step.make_batch(1)

        def fwd_bwd(pol=pol, batch=batch):
            with applied(bl, pol):
                step.loss(step.model, batch).backward()
            step.optimizer.zero_grad(set_to_none=True)

        peak = step_peak(fwd_bwd, dev)
        timing = try_bench(
            fwd_bwd, name=f"step-{pol}", device=dev, reps=reps, budget_s=60, check_finite=False, retries=0
        )
        rows.append(
            dict(
                policy=pol,
                blocks=sum(1 for i in range(len(bl)) if pol != "none" and (pol != "every_other" or i % 2 == 0)),
                saved_bytes=saved,
                peak_bytes=peak,
                time_ms=getattr(timing, "median_ms", float("nan")),
                stable=getattr(getattr(timing, "stability", None), "stable", None),
                grads_equal=True,
                timing=timing,
            )
        )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------
# What fits: bisection on real steps
# --------------------------------------------------------------------------------------


def step_bytes(build: Callable[[int], StepFactory], batch_size: int, policy: str = "none") -> int:
    """State (after one optimizer step) + the peak of one forward + backward at ``batch_size``."""
    step = build(batch_size)
    dev = _device(step)
    bl = blocks(step)
    batch = step.make_batch(0)
    with applied(bl, policy):
        step.loss(step.model, batch).backward()
    step.optimizer.step()
    step.optimizer.zero_grad(set_to_none=True)
    state = sum(state_bytes(step).values())

    def fwd_bwd():
        with applied(bl, policy):
            step.loss(step.model, step.make_batch(1)).backward()

    return state + step_peak(fwd_bwd, dev)


def fits_bisect(
    build: Callable[[int], StepFactory], device_bytes: int, *, policy: str = "none", max_batch: int = 64
) -> dict:
    """The largest batch size in [1, max_batch] whose real step fits ``device_bytes``
    (:func:`step_bytes`; on CUDA an out-of-memory step counts as not fitting), by bisection;
    ``tried``: every batch size measured and its bytes (None: out of memory)."""
    check_int("max_batch", max_batch, min=1)
    tried: dict[int, int | None] = {}

    def fits(b: int) -> bool:
        try:
            tried[b] = step_bytes(build, b, policy)
        except torch.cuda.OutOfMemoryError:
            tried[b] = None
            torch.cuda.empty_cache()
            return False
        return tried[b] <= device_bytes

    if not fits(1):
        return dict(policy=policy, batch=0, device_bytes=device_bytes, tried=tried)
    lo, hi = 1, max_batch
    if fits(hi):
        return dict(policy=policy, batch=hi, device_bytes=device_bytes, tried=tried)
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return dict(policy=policy, batch=lo, device_bytes=device_bytes, tried=tried)
