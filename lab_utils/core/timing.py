"""The one timing primitive of the lab, and the judge of its own samples.

Method
------
* The first call (compilation, autotuning, lazy init) is run and checked on its own,
  outside the statistics: it must not raise, must return finite tensors, and must
  fit the time budget.
* CUDA: ``triton.testing.do_bench`` (device events, L2 flushed before every
  repetition by writing a 256 MB buffer, its own warm-up in ms) with
  ``return_mode="all"`` so every sample is kept; ``cuda_graph=True`` uses
  ``do_bench_cudagraph`` (graph replay removes launch gaps).  ``flush_l2=False``
  falls back to a plain event loop that does not flush.  do_bench picks its repetition
  count from a time budget (``rep_ms``, 100 ms by default), which gives at most two
  samples for a call of 50 ms or more; so the budget is raised to fit ``reps`` samples
  and topped up until there are ``reps``, within a stated limit (a third of
  ``budget_s``, recorded as ``meta["time_limit_ms"]``).
* CPU: ``torch.utils.benchmark.Timer`` (synchronized wall clock, gc disabled), one
  sample per ``timeit(number)`` block, the block sized so one sample lasts at least
  ~1 ms.  The intra-op thread count is chosen, not inherited (``lab_utils.core.cpu_threads``):
  on a machine whose cores are busy with other processes, a parallel region with one
  thread per core waits for whichever thread the scheduler took away, and a 0.4 ms op
  reads as a 32 ms scheduler quantum.  The choice and its reason are kept in
  ``meta`` and in the run's context.
* Statistics are the median with p20/p80; samples are kept so comparisons can judge
  noise (``lab_utils.run.compare``).  The interpreter of Triton must never be timed.

Stability: every timing carries the verdict of :func:`lab_utils.core.samples.judge_samples` on its
samples (what a timing is, its verdict and the judge live in ``samples``, which imports no torch).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils.benchmark as tub

from lab_utils.core.cpu_threads import THREADS_ENV, ThreadChoice, busy_cores, choose_cpu_threads, usable_cores
from lab_utils.core.samples import (
    DEFAULT_RULES,
    BenchError,
    BenchFailure,
    Stability,
    StabilityRules,
    Timing,
    judge_samples,
    timing_context,
)

__all__ = [
    "THREADS_ENV",
    "BenchError",
    "BenchFailure",
    "Stability",
    "StabilityRules",
    "ThreadChoice",
    "Timing",
    "bench",
    "busy_cores",
    "choose_cpu_threads",
    "cpu_threads",
    "cuda_samples",
    "judge_samples",
    "timing_context",
    "try_bench",
    "usable_cores",
]


@contextlib.contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads, restoring the previous count after."""
    prev = torch.get_num_threads()
    if n != prev:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != prev:
            torch.set_num_threads(prev)


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


def cuda_samples(fn, o: BenchOptions, *, est_ms: float, limit_ms: float) -> tuple[list[float], str]:
    """At least ``o.reps`` device-timed samples (fewer only when ``limit_ms`` runs out)."""
    import triton.testing as tt  # noqa: PLC0415  (triton is imported only where a GPU is timed)

    reps, warmup_ms, cuda_graph, grad_to_none = o.reps, o.warmup_ms, o.cuda_graph, o.grad_to_none
    if not o.flush_l2 and not cuda_graph:
        return _event_loop(fn, reps=reps, warmup_ms=warmup_ms, est_ms=est_ms), "events"
    t0 = time.perf_counter()
    asked_ms = 0.0  # what the do_bench calls were given: their warm-up and measuring time
    samples: list[float] = []
    while len(samples) < reps:
        left_ms = limit_ms - max((time.perf_counter() - t0) * 1e3, asked_ms)
        if samples and left_ms <= est_ms:
            break
        # do_bench repeats for rep / (its estimate of one call): ask for the samples still missing
        want_ms = max(o.rep_ms if not samples else 0.0, (reps - len(samples)) * est_ms * 1.2)
        rep = max(min(want_ms, left_ms), est_ms)
        asked_ms += rep + (0.0 if cuda_graph else warmup_ms)
        if cuda_graph:
            got = tt.do_bench_cudagraph(fn, rep=rep, grad_to_none=grad_to_none, return_mode="all")
        else:
            got = tt.do_bench(fn, warmup=warmup_ms, rep=rep, grad_to_none=grad_to_none, return_mode="all")
        samples += [float(s) for s in (got if isinstance(got, (list, tuple)) else [got])]
    return samples, "do_bench_cudagraph" if cuda_graph else "do_bench"


def _cpu_samples(fn, *, n: int, number: int, warmup_ms: float, threads: int) -> tuple[list[float], float]:
    """``n`` samples, and the share of their wall time this thread spent on a CPU."""
    timer = tub.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    with cpu_threads(threads):
        warm_deadline = time.perf_counter() + warmup_ms / 1e3
        while time.perf_counter() < warm_deadline:
            fn()
        samples = []
        c0, w0 = time.thread_time(), time.perf_counter()
        for _ in range(n):
            samples.append(timer.timeit(number).median * 1e3)
        cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
    return samples, (cpu / wall if wall > 0 else math.nan)


@dataclass(frozen=True)
class BenchOptions:
    """How :func:`bench` measures (``bench(fn, BenchOptions(reps=20))``, or the same fields as
    keywords: ``bench(fn, reps=20)``).  ``reps``: samples on every device (on CUDA, do_bench's
    time budget is raised to fit them, within a third of ``budget_s``); ``retries``: new
    attempts when the samples are judged unstable; ``threads``: CPU intra-op threads (default:
    :func:`choose_cpu_threads`); ``rules``: the stability rules (:data:`DEFAULT_RULES`)."""

    reps: int = 50
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    min_sample_ms: float = 1.0
    budget_s: float = 60.0
    cuda_graph: bool = False
    flush_l2: bool = True
    check_finite: bool = True
    grad_to_none: Any = None
    retries: int = 2
    threads: int | str | None = None
    rules: StabilityRules | None = None

    def __post_init__(self):
        if isinstance(self.reps, bool) or not isinstance(self.reps, int) or self.reps < 3:
            raise ValueError(f"parameter 'reps' = {self.reps} is not allowed: expected an integer >= 3")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"parameter 'retries' = {self.retries!r} is not allowed: expected an integer >= 0")


#: one measuring attempt: (samples in ms, method, extra meta, stability verdict)
Attempt = tuple[list[float], str, dict, Stability]


def bench(
    fn: Callable[[], Any],
    options: BenchOptions | None = None,
    *,
    name: str = "",
    device: str | torch.device | None = None,
    **kw,
) -> Timing:
    """Time ``fn()``; raise :class:`BenchError` if it raises, returns NaN/Inf, or would
    exceed ``budget_s``.  ``options`` (:class:`BenchOptions`, or its fields as keywords ``kw``)
    say how.  The samples are judged (:func:`judge_samples`); an unstable measurement is taken
    again up to ``retries`` times while the budget allows."""
    o = replace(options, **kw) if options is not None else BenchOptions(**kw)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t_start = time.perf_counter()
    first_ms, est_ms = _first_calls(fn, dev, name, o)
    if dev.type == "cuda":
        limit_ms = o.budget_s * 1e3 / 3
        meta = {"flush_l2": o.flush_l2 and not o.cuda_graph, "cuda_graph": o.cuda_graph, "time_limit_ms": limit_ms}

        def measure() -> tuple[list[float], str, dict]:
            s, method = cuda_samples(fn, o, est_ms=est_ms, limit_ms=limit_ms)
            return s, method, {}
    else:
        n, number = _cpu_sample_plan(est_ms, name, o)
        meta = {"number_per_sample": number}

        def measure() -> tuple[list[float], str, dict]:
            choice = choose_cpu_threads(o.threads)
            s, on_cpu = _cpu_samples(fn, n=n, number=number, warmup_ms=o.warmup_ms, threads=choice.threads)
            extra = {"threads": choice.threads, "threads_reason": choice.reason, "on_cpu": round(on_cpu, 3)}
            return s, "torch.utils.benchmark", extra

    attempts = _attempts(measure, o, t_start)
    samples, method, extra, verdict = _kept(attempts, o.retries)
    if dev.type == "cuda" and len(samples) < o.reps:
        verdict = _note(verdict, f"{len(samples)} of {o.reps} samples within the time limit of {limit_ms / 1e3:.1f} s")
    return Timing(
        name,
        str(dev),
        method,
        tuple(float(s) for s in samples),
        first_ms,
        meta={**meta, **extra, "reps": o.reps, "attempts": len(attempts)},
        verdict=verdict,
    )


def _first_calls(fn, dev: torch.device, name: str, o: BenchOptions) -> tuple[float, float]:
    """(first call's ms, compile-free estimate of one call's ms).  The first call compiles,
    autotunes or initialises lazily: out of the statistics, but checked (raises, non-finite
    output, over the budget); the second gives the estimate that sizes the run."""
    budget_s = o.budget_s
    try:
        _sync(dev)
        t0 = time.perf_counter()
        out = fn()
        _sync(dev)
        first_ms = (time.perf_counter() - t0) * 1e3
    except Exception as e:  # noqa: BLE001 - we re-raise with context
        raise BenchError(BenchFailure(name, "raised", f"{type(e).__name__}: {e}")) from e
    if o.check_finite:
        bad = _nonfinite(out)
        if bad:
            raise BenchError(BenchFailure(name, "nonfinite", bad))
    del out
    if first_ms / 1e3 > budget_s:
        raise BenchError(
            BenchFailure(name, "budget", f"first call took {first_ms / 1e3:.1f} s, over the budget of {budget_s} s")
        )
    t0 = time.perf_counter()
    try:
        fn()
        _sync(dev)
    except Exception as e:  # noqa: BLE001
        raise BenchError(BenchFailure(name, "raised", f"{type(e).__name__}: {e}")) from e
    return first_ms, max((time.perf_counter() - t0) * 1e3, 1e-4)


def _cpu_sample_plan(est_ms: float, name: str, o: BenchOptions) -> tuple[int, int]:
    """(samples, calls per sample) on CPU: each sample lasts ``min_sample_ms`` or more, and the
    samples fit the budget (never fewer than 3; raises when 3 would not fit)."""
    min_sample_ms, budget_s = o.min_sample_ms, o.budget_s
    number = max(1, int(math.ceil(min_sample_ms / est_ms)))
    n = o.reps
    if est_ms * number * n / 1e3 > budget_s:  # shrink to the budget, never below 3 samples
        n = max(3, int(budget_s * 1e3 / (est_ms * number)))
        if est_ms * number * n / 1e3 > budget_s * 1.5:
            raise BenchError(
                BenchFailure(
                    name,
                    "budget",
                    f"one call takes {est_ms:.1f} ms; 3 samples would exceed the budget of {budget_s} s",
                )
            )
    return n, number


def _attempts(measure: Callable[[], tuple[list[float], str, dict]], o: BenchOptions, t_start: float) -> list[Attempt]:
    """Measure and judge; again (up to ``retries`` times) while unstable and the budget allows."""
    rules = o.rules or DEFAULT_RULES
    attempts: list[Attempt] = []
    for attempt in range(1 + o.retries):
        a0 = time.perf_counter()
        samples, method, extra = measure()
        # with one thread the op runs on this thread: its CPU time over the wall time says how
        # long the scheduler kept it off the CPU (with more, idle workers make the figure unreliable)
        verdict = judge_samples(samples, rules, on_cpu=extra.get("on_cpu") if extra.get("threads") == 1 else None)
        attempts.append((samples, method, extra, verdict))
        if verdict.stable:
            break
        spent = time.perf_counter() - t_start
        if attempt < o.retries and spent + (time.perf_counter() - a0) > o.budget_s:
            attempts[-1] = (samples, method, extra, _note(verdict, "no budget left to measure again"))
            break
        if attempt < o.retries:
            time.sleep(0.05)  # let a burst of other work pass before measuring again
    return attempts


def _kept(attempts: list[Attempt], retries: int) -> Attempt:
    """The last attempt when it is stable, else the steadiest (smallest p80/p20) of them all,
    its verdict saying how many attempts it took."""
    kept = attempts[-1] if attempts[-1][3].stable else min(attempts, key=lambda a: _finite_or_inf(a[3].spread))
    samples, method, extra, verdict = kept
    k = len(attempts)
    if verdict.stable and k > 1:
        verdict = Stability(
            True, f"{verdict.reason} (attempt {k}; before: {attempts[0][3].reason})", verdict.spread, 0, k
        )
    elif not verdict.stable:
        tries = (
            f"unstable in all {k} attempt(s)" if k > 1 else ("unstable" if retries else "unstable (no retry allowed)")
        )
        verdict = Stability(False, f"{tries}; kept the steadiest: {verdict.reason}", verdict.spread, verdict.stalls, k)
    return samples, method, extra, verdict


def _finite_or_inf(x: float) -> float:
    return x if math.isfinite(x) else math.inf


def _note(v: Stability, note: str) -> Stability:
    return Stability(v.stable, f"{v.reason} ({note})", v.spread, v.stalls, v.attempts)


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


def try_bench(fn: Callable[[], Any], options: BenchOptions | None = None, **kwargs) -> Timing | BenchFailure:
    """Like :func:`bench` but a failure is returned (to be recorded), not raised."""
    try:
        return bench(fn, options, **kwargs)
    except BenchError as e:
        return e.failure
