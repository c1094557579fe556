"""The one timing primitive of the lab.

Method
------
* The first call (compilation, autotuning, lazy init) is run and checked on its own,
  outside the statistics: it must not raise, must return finite tensors, and must
  fit the time budget.
* CUDA: ``triton.testing.do_bench`` (device events, L2 flushed before every
  repetition by writing a 256 MB buffer, its own warm-up in ms) with
  ``return_mode="all"`` so every sample is kept; ``cuda_graph=True`` uses
  ``do_bench_cudagraph`` (graph replay removes launch gaps).  ``flush_l2=False``
  falls back to a plain event loop that does not flush.
* CPU: ``torch.utils.benchmark.Timer`` (synchronized wall clock, gc disabled, fixed
  thread count), one sample per ``timeit(number)`` block, the block sized so one
  sample lasts at least ~1 ms.
* Statistics are the median with p20/p80; samples are kept so comparisons can judge
  noise (``lab_utils.run.compare``).  The interpreter of Triton must never be timed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


class BenchError(RuntimeError):
    """A callable that could not be timed; ``.failure`` holds the structured reason."""

    def __init__(self, failure: BenchFailure):
        self.failure = failure
        super().__init__(f"benchmark {failure.name or '<fn>'!r} failed ({failure.kind}): {failure.reason}")


@dataclass(frozen=True)
class BenchFailure:
    name: str
    kind: str  # "raised" | "nonfinite" | "budget"
    reason: str

    ok = False


@dataclass(frozen=True)
class Timing:
    name: str
    device: str
    method: str  # "do_bench" | "do_bench_cudagraph" | "events" | "torch.utils.benchmark"
    samples_ms: tuple[float, ...]
    first_call_ms: float  # compile/warm-up call, excluded from the statistics
    meta: dict = field(default_factory=dict)

    ok = True

    @property
    def n(self) -> int:
        return len(self.samples_ms)

    def quantile(self, q: float) -> float:
        return float(np.quantile(np.asarray(self.samples_ms), q))

    @property
    def median_ms(self) -> float:
        return self.quantile(0.5)

    @property
    def p20_ms(self) -> float:
        return self.quantile(0.2)

    @property
    def p80_ms(self) -> float:
        return self.quantile(0.8)

    @property
    def min_ms(self) -> float:
        return float(min(self.samples_ms))

    @property
    def mean_ms(self) -> float:
        return float(np.mean(self.samples_ms))

    @property
    def spread(self) -> float:
        """(p80 - p20) / median: the relative noise of this measurement."""
        return (self.p80_ms - self.p20_ms) / self.median_ms if self.median_ms > 0 else float("nan")

    def __str__(self) -> str:
        return (
            f"{self.name or 'fn'}: median {self.median_ms:.4g} ms "
            f"[p20 {self.p20_ms:.4g}, p80 {self.p80_ms:.4g}] over {self.n} samples ({self.method})"
        )


def _nonfinite(out: Any) -> str | None:
    """Describe the first non-finite tensor in ``out`` (tensor / tuple / list / dict)."""
    if isinstance(out, torch.Tensor):
        if out.is_floating_point() or out.is_complex():
            bad = ~torch.isfinite(out.detach())
            if bool(bad.any()):
                return f"{int(bad.sum())} of {out.numel()} elements are NaN/Inf"
        return None
    if isinstance(out, (tuple, list)):
        for i, o in enumerate(out):
            r = _nonfinite(o)
            if r:
                return f"output[{i}]: {r}"
    if isinstance(out, dict):
        for k, o in out.items():
            r = _nonfinite(o)
            if r:
                return f"output[{k!r}]: {r}"
    if isinstance(out, float) and not math.isfinite(out):
        return f"returned {out}"
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(
    fn: Callable[[], Any],
    *,
    name: str = "",
    device: str | torch.device | None = None,
    reps: int = 50,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    min_sample_ms: float = 1.0,
    budget_s: float = 60.0,
    cuda_graph: bool = False,
    flush_l2: bool = True,
    check_finite: bool = True,
    grad_to_none=None,
) -> Timing:
    """Time ``fn()``; raise :class:`BenchError` if it raises, returns NaN/Inf, or would
    exceed ``budget_s``.  ``reps`` is the sample count on CPU; on CUDA ``rep_ms`` sets
    how long do_bench measures (it picks the repetition count)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if reps < 3:
        raise ValueError(f"parameter 'reps' = {reps} is not allowed: expected an integer >= 3")

    # First call: compile / autotune / lazy init.  Out of the statistics, but checked.
    try:
        _sync(dev)
        t0 = time.perf_counter()
        out = fn()
        _sync(dev)
        first_ms = (time.perf_counter() - t0) * 1e3
    except Exception as e:  # noqa: BLE001 - we re-raise with context
        raise BenchError(BenchFailure(name, "raised", f"{type(e).__name__}: {e}")) from e
    if check_finite:
        bad = _nonfinite(out)
        if bad:
            raise BenchError(BenchFailure(name, "nonfinite", bad))
    del out
    if first_ms / 1e3 > budget_s:
        raise BenchError(
            BenchFailure(name, "budget", f"first call took {first_ms / 1e3:.1f} s, over the budget of {budget_s} s")
        )

    # Second call gives a compile-free estimate for sizing the run against the budget.
    t0 = time.perf_counter()
    try:
        fn()
        _sync(dev)
    except Exception as e:  # noqa: BLE001
        raise BenchError(BenchFailure(name, "raised", f"{type(e).__name__}: {e}")) from e
    est_ms = max((time.perf_counter() - t0) * 1e3, 1e-4)

    if dev.type == "cuda":
        import triton.testing as tt

        rep_ms_eff = min(rep_ms, budget_s * 1e3 / 3)
        if cuda_graph:
            samples = tt.do_bench_cudagraph(fn, rep=rep_ms_eff, grad_to_none=grad_to_none, return_mode="all")
            method = "do_bench_cudagraph"
        elif flush_l2:
            samples = tt.do_bench(fn, warmup=warmup_ms, rep=rep_ms_eff, grad_to_none=grad_to_none, return_mode="all")
            method = "do_bench"
        else:
            samples = _event_loop(fn, reps=max(reps, 10), warmup_ms=warmup_ms, est_ms=est_ms)
            method = "events"
        return Timing(
            name,
            str(dev),
            method,
            tuple(float(s) for s in samples),
            first_ms,
            meta={"flush_l2": flush_l2 and not cuda_graph, "cuda_graph": cuda_graph},
        )

    import torch.utils.benchmark as tub

    number = max(1, int(math.ceil(min_sample_ms / est_ms)))
    n = reps
    if est_ms * number * n / 1e3 > budget_s:  # shrink to the budget, never below 3 samples
        n = max(3, int(budget_s * 1e3 / (est_ms * number)))
        if est_ms * number * n / 1e3 > budget_s * 1.5:
            raise BenchError(
                BenchFailure(
                    name, "budget", f"one call takes {est_ms:.1f} ms; 3 samples would exceed the budget of {budget_s} s"
                )
            )
    timer = tub.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    warm_deadline = time.perf_counter() + warmup_ms / 1e3
    while time.perf_counter() < warm_deadline:
        fn()
    samples = []
    for _ in range(n):
        m = timer.timeit(number)
        samples.append(m.median * 1e3)
    return Timing(
        name,
        str(dev),
        "torch.utils.benchmark",
        tuple(samples),
        first_ms,
        meta={"number_per_sample": number, "threads": torch.get_num_threads()},
    )


def _event_loop(fn, *, reps: int, warmup_ms: float, est_ms: float) -> list[float]:
    for _ in range(max(1, int(warmup_ms / est_ms))):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def try_bench(fn: Callable[[], Any], **kwargs) -> Timing | BenchFailure:
    """Like :func:`bench` but a failure is returned (to be recorded), not raised."""
    try:
        return bench(fn, **kwargs)
    except BenchError as e:
        return e.failure
