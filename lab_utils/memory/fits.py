"""What fits a device: the peak of a step, predicted from its parts, checked against the whole
step, and the largest batch whose peak fits, by bisection over real steps.

The peak of a step counts each byte once:

* **state**, held between steps: the parameters and the optimizer's state (every tensor in
  ``optimizer.state``, each storage once); on CUDA also whatever else the step keeps on the device
  (encoders, buffers: ``memory_allocated`` before the step less the two);
* **forward + backward**: the peak above that state while the batch is made, the forward runs and
  the backward makes the gradients (activations, temporaries, and the gradients as they appear),
  and what it leaves held (the gradients, the batch, the loss);
* **optimizer step**: the peak above that while the optimizer steps.

predicted peak = state + max(forward + backward, held after it + optimizer step).  The gradients are
counted once: inside the backward's peak, or among what it leaves for the optimizer step, where the
step peaks.  Each part is measured on its own (:func:`step_memory`; CPU: the profiler's
allocation events, CUDA: ``max_memory_allocated``) and the sum is checked against one whole step
(:func:`whole_step_peak`).  :func:`fits_bisect` builds the step at other batch sizes from its
factory (resolved once: :meth:`~lab_utils.step.contract.StepFactory.rebuild`), runs one step for
the optimizer's state, measures, and bisects; on CUDA a step that runs out of memory does not
fit.  When the largest batch tried fits, the largest that would is read off a line through the
measured peaks (a step's peak grows linearly in its batch), and said to be extrapolated.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_leaves

from lab_utils.core.config import check_int
from lab_utils.memory.policies import excursion, peak_above
from lab_utils.memory.saved import storage_bytes, storage_key
from lab_utils.step.contract import StepFactory, batch_leaves, run_step

#: A prediction further than this from its whole step (and than 64 KiB) is a broken accounting.
CHECK_TOL = 0.02


def _bytes_once(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            seen.setdefault(storage_key(t), storage_bytes(t))
    return sum(seen.values())


def step_state(step: StepFactory) -> dict[str, int]:
    """Bytes of the parameters, the gradients (one per trainable parameter, as a step makes
    them) and the optimizer's state (what ``optimizer.state`` holds now)."""
    params = list(step.model.parameters())
    opt = [t for st in step.optimizer.state.values() for t in tree_leaves(st)]
    return {
        "parameters": _bytes_once(params),
        "gradients": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        "optimizer": _bytes_once(opt),
    }


@dataclass(frozen=True)
class StepMemory:
    """The parts of a step's peak (bytes) and their sum (see the module note)."""

    batch_size: int | None
    parameters: int
    optimizer: int
    other: int  # CUDA: what else the step keeps on the device before it runs (0 on CPU)
    gradients: int  # of them, the gradients (one per trainable parameter)
    batch: int  # and the batch
    forward_backward: int  # peak above the state while the batch is made, forward and backward
    after_backward: int  # what the backward leaves held for the optimizer: gradients, batch, loss
    optimizer_step: int  # peak above the state and what the backward left, while the optimizer steps

    @property
    def state(self) -> int:
        return self.parameters + self.optimizer + self.other

    @property
    def peak(self) -> int:
        return self.state + max(self.forward_backward, self.after_backward + self.optimizer_step)

    @property
    def peak_phase(self) -> str:
        later = self.after_backward + self.optimizer_step
        return "forward + backward" if self.forward_backward >= later else "optimizer step"


def _device_other(step: StepFactory, parameters: int, optimizer: int) -> int:
    dev = step.device
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize(dev)
    return max(int(torch.cuda.memory_allocated(dev)) - parameters - optimizer, 0)


def step_memory(step: StepFactory, k: int = 1) -> StepMemory:
    """The parts of step ``k``'s peak, each measured on its own; the step's optimizer must hold its
    state already (one step taken).  The weights take the step (as a real step would)."""
    dev = step.device
    step.optimizer.zero_grad(set_to_none=True)
    st = step_state(step)
    other = _device_other(step, st["parameters"], st["optimizer"])
    held: dict = {}

    def forward_backward():
        held["batch"] = step.make_batch(k)
        held["loss"] = step.loss(step.model, held["batch"])
        held["loss"].backward()

    fb, left = excursion(forward_backward, dev)
    batch = _bytes_once(x for x in batch_leaves(held["batch"]) if isinstance(x, torch.Tensor))

    def optimizer_step():
        if step.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(step.model.parameters(), step.grad_clip)
        step.optimizer.step()

    opt = peak_above(optimizer_step, dev)
    step.optimizer.zero_grad(set_to_none=True)
    held.clear()
    bs = held_batch_size(step)
    return StepMemory(bs, st["parameters"], st["optimizer"], other, st["gradients"], batch, fb, left, opt)


def held_batch_size(step: StepFactory) -> int | None:
    src = step.source
    return None if src is None else src.keywords.get("batch_size")


def whole_step_peak(step: StepFactory, k: int = 1) -> int:
    """The peak of one whole step ``k`` (:func:`lab_utils.step.contract.run_step`, its periodic
    phases included): the state before it plus the peak above it, measured in one go."""
    step.optimizer.zero_grad(set_to_none=True)
    st = step_state(step)
    other = _device_other(step, st["parameters"], st["optimizer"])
    return st["parameters"] + st["optimizer"] + other + peak_above(lambda: run_step(step, k), step.device)


def check_prediction(mem: StepMemory, whole: int) -> str:
    """The verdict of a prediction against its whole step; raises when they part by more than
    :data:`CHECK_TOL` (and 64 KiB)."""
    diff = whole - mem.peak
    if abs(diff) > max(CHECK_TOL * whole, 64 * 2**10):
        raise AssertionError(
            f"predicted peak {mem.peak:,} B (state {mem.state:,} + {mem.peak_phase}) but the whole step "
            f"peaked at {whole:,} B: the parts do not add up to the step"
        )
    return f"the whole step peaked at {whole:,} B, {diff:+,} B from the prediction"


def _free(step: StepFactory) -> None:
    """Close a step built for one measurement; the caller drops its reference (``s = _free(s)``)
    and what it held is collected at the next build."""
    if step.close is not None:
        step.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Fit:
    """What fits ``device_bytes``: the largest batch measured to fit (0: not even one sample),
    each batch tried with its predicted peak (None: out of memory), the check of the largest
    fitting batch against its whole step, and, when every batch tried fits, the largest batch a
    line through the measured peaks fits (``extrapolated``)."""

    device_bytes: int
    batch: int
    max_batch: int
    tried: dict = field(default_factory=dict)  # batch -> StepMemory or None (OOM)
    whole: int | None = None  # whole-step peak at ``batch``
    check: str = ""
    extrapolated: int | None = None

    @property
    def capped(self) -> bool:
        return self.batch == self.max_batch


def _line(points: dict[int, int]) -> tuple[float, float] | None:
    """Least-squares intercept and slope of peak against batch (None: fewer than two batches)."""
    if len(points) < 2:
        return None
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def fits_bisect(step: StepFactory, device_bytes: int, *, max_batch: int = 16, check: bool = True) -> Fit:
    """The largest batch in [1, ``max_batch``] whose predicted peak fits ``device_bytes`` (see the
    module note); ``step`` is measured at its own batch size, other sizes are built from its factory."""
    check_int("max_batch", max_batch, min=1)
    own = held_batch_size(step)
    tried: dict[int, StepMemory | None] = {}

    def measure(b: int) -> StepMemory | None:
        s = step if b == own else step.rebuild(batch_size=b)
        try:
            if s is not step:
                run_step(s, 0)  # the optimizer's state, as the lab's own step has it
            return step_memory(s)
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            if s is not step:
                s = _free(s)

    def fits(b: int) -> bool:
        if b not in tried:
            tried[b] = measure(b)
        return tried[b] is not None and tried[b].peak <= device_bytes

    out = Fit(device_bytes, 0, max_batch, tried)
    if not fits(1):
        return out
    lo, hi = 1, max_batch
    if fits(hi):
        lo = hi
    while hi - lo > 1:  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    out.batch = lo
    if lo == max_batch:
        fits(max(1, max_batch // 2))  # two points at least for the line
        line = _line({b: m.peak for b, m in tried.items() if m is not None})
        if line is not None and line[1] > 0:
            out.extrapolated = max(int(math.floor((device_bytes - line[0]) / line[1])), max_batch)
    if check:
        s = step if lo == own else step.rebuild(batch_size=lo)
        try:
            if s is not step:
                run_step(s, 0)
            out.whole = whole_step_peak(s)
            out.check = check_prediction(tried[lo], out.whole)
        finally:
            if s is not step:
                s = _free(s)
    return out


def oom_bisect(trial: Callable[[int], object], hi: int) -> tuple[int, int]:
    """The largest batch in [0, ``hi``] whose ``trial(batch)`` runs without running out of memory,
    by bisection (each out-of-memory error counted, the search going on), and that count.  The
    one out-of-memory bisection: :func:`oom_edge` on a lab's step, ``memory.budget.bisect_fit`` on
    the MMDiT's formula projection; a trial releases what it built (``finally``)."""
    check_int("hi", hi, min=0)
    lo, ooms = 0, 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            trial(mid)
            lo = mid
        except torch.OutOfMemoryError:
            ooms += 1
            hi = mid - 1
    return lo, ooms


def oom_edge(step: StepFactory, hi: int) -> tuple[int, int]:
    """On CUDA: the largest batch in [1, ``hi``] whose real steps run (two steps each, built from
    the step's factory), by :func:`oom_bisect`, and how many out-of-memory errors it met on the way."""

    def two_steps(b: int) -> None:
        s = None
        try:
            s = step.rebuild(batch_size=b)
            run_step(s, 0)
            run_step(s, 1)
            if s.device.type == "cuda":
                torch.cuda.synchronize(s.device)
        finally:
            if s is not None:
                s = _free(s)

    return oom_bisect(two_steps, hi)
