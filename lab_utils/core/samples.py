"""What a timing is and the judge of its own samples; no torch (records and the trace reader use it).

:class:`Timing` holds one measurement's samples (the median with p20/p80, the first call kept
apart), :class:`BenchFailure` a callable that could not be timed, and :func:`judge_samples`
the verdict every timing carries.  ``lab_utils.core.timing`` takes the samples.

Stability
---------
Every timing carries a verdict (:class:`Stability`) from :func:`judge_samples`: its
dispersion (p80/p20), bimodality (two clusters of samples), stalls (samples several ms
and several times above the median: a descheduled thread, a scheduler quantum), drift
(a trend across the samples in the order they were taken: a clock or a load that
changed) and, for single-threaded CPU timing, the share of the time the thread was
actually on a CPU.  An unstable measurement is taken again, at most ``retries`` more times and
within the budget; if none is stable the steadiest attempt is kept and the verdict says
so.  The thresholds are :class:`StabilityRules`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lab_utils.core.cpu_threads import choose_cpu_threads


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


# ------------------------------------------------------------------------------ stability
@dataclass(frozen=True)
class StabilityRules:
    """When a set of samples is not a measurement.

    * ``max_spread``: p80 / p20 above this is too dispersed.
    * stalls: a sample more than ``stall_factor`` x the median *and* more than ``stall_ms``
      above it; up to ``max_stall_share`` of the samples may stall (none of fewer than 20).
    * bimodality: sorted samples jump by more than ``bimodal_gap`` (ratio of neighbours)
      somewhere between the 20th and 80th percentile.
    * drift (>= 9 samples): the last third's median differs from the first third's by more
      than ``max_drift`` and the samples trend with their order (|Spearman rho| >= ``min_rho``).
    * descheduled (CPU, one thread): the timed thread was on a CPU for less than
      ``min_on_cpu`` of the wall time it measured.  A core shared with another busy process
      slows every sample alike, which no dispersion test sees; the CPU time does.
    """

    max_spread: float = 1.2
    stall_ms: float = 2.0
    stall_factor: float = 3.0
    max_stall_share: float = 0.05
    bimodal_gap: float = 1.25
    max_drift: float = 0.10
    min_rho: float = 0.5
    min_samples: int = 3
    min_on_cpu: float = 0.85

    def __post_init__(self):
        for name in ("max_spread", "stall_factor", "bimodal_gap"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 1):
                raise ValueError(f"parameter {name!r} = {v!r} is not allowed: expected a number > 1")
        for name in ("stall_ms", "max_stall_share", "max_drift", "min_rho", "min_on_cpu"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"parameter {name!r} = {v!r} is not allowed: expected a number >= 0")


DEFAULT_RULES = StabilityRules()


@dataclass(frozen=True)
class Stability:
    """The verdict on one timing's samples: ``stable`` and, either way, why."""

    stable: bool
    reason: str
    spread: float  # p80 / p20
    stalls: int = 0
    attempts: int = 1

    def __str__(self) -> str:
        return ("stable" if self.stable else "UNSTABLE") + f": {self.reason}"


def _spearman(x: np.ndarray) -> float:
    """Rank correlation of the samples with the order they were taken in."""
    n = x.size
    ranks = np.empty(n)
    ranks[np.argsort(x, kind="stable")] = np.arange(n)
    order = np.arange(n)
    r, o = ranks - ranks.mean(), order - order.mean()
    den = math.sqrt(float((r * r).sum() * (o * o).sum()))
    return float((r * o).sum() / den) if den > 0 else 0.0


def judge_samples(
    samples: Sequence[float], rules: StabilityRules | None = None, *, on_cpu: float | None = None
) -> Stability:
    """Judge a timing's samples (in the order they were taken); see :class:`StabilityRules`.
    ``on_cpu``: the share of the measuring time the timed thread was on a CPU (single-
    threaded CPU timing), below ``min_on_cpu`` when other processes took the core."""
    r = rules or DEFAULT_RULES
    x = np.asarray([float(s) for s in samples], dtype=float)
    x = x[np.isfinite(x)]
    n = int(x.size)
    if n < r.min_samples:
        return Stability(False, f"only {n} sample(s): too few to judge (need {r.min_samples})", math.nan)
    med = float(np.median(x))
    p20, p80 = float(np.quantile(x, 0.2)), float(np.quantile(x, 0.8))
    spread = p80 / p20 if p20 > 0 else math.inf
    problems = []
    if spread > r.max_spread:
        problems.append(f"dispersion p80/p20 = {spread:.2f} > {r.max_spread:g}")
    stalled = x[(x > r.stall_factor * med) & (x - med > r.stall_ms)]
    allowed = math.floor(r.max_stall_share * n)
    if stalled.size > allowed:
        problems.append(
            f"{stalled.size} of {n} samples stalled (up to {stalled.max():.3g} ms against a median of {med:.3g} ms:"
            f" a descheduled thread or a scheduler quantum)"
        )
    s = np.sort(x)
    k = max(2, math.ceil(0.2 * n))
    if n >= 2 * k:
        lo_side = s[k - 1 : n - k]
        hi_side = s[k : n - k + 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            jumps = np.where(lo_side > 0, hi_side / lo_side, np.inf)
        if jumps.size and float(jumps.max()) > r.bimodal_gap:
            i = int(np.argmax(jumps)) + k
            problems.append(
                f"bimodal: {i} samples near {np.median(s[:i]):.3g} ms and {n - i} near {np.median(s[i:]):.3g} ms"
            )
    if n >= 9:
        third = n // 3
        a, b = float(np.median(x[:third])), float(np.median(x[-third:]))
        rho = _spearman(x)
        if a > 0 and abs(b / a - 1) > r.max_drift and abs(rho) >= r.min_rho:
            problems.append(
                f"drift: the last third's median is {b / a - 1:+.0%} against the first third's (Spearman rho "
                f"{rho:.2f}): a clock or a load that changed while measuring"
            )
    if on_cpu is not None and math.isfinite(on_cpu) and on_cpu < r.min_on_cpu:
        problems.append(
            f"on a CPU only {on_cpu:.0%} of the time it measured (descheduled for the rest: other processes "
            f"share the cores, so every sample is slowed alike)"
        )
    if problems:
        return Stability(False, "; ".join(problems), spread, int(stalled.size))
    return Stability(True, f"p80/p20 = {spread:.3f}, no stall, one mode, no drift over {n} samples", spread, 0)


def timing_context() -> dict:
    """What a run's context records about timing: the thread policy and its choice now."""
    c = choose_cpu_threads()
    return {"cpu_threads": c.as_dict(), "stability_rules": DEFAULT_RULES.__dict__.copy()}


# ------------------------------------------------------------------------------ timing result
@dataclass(frozen=True)
class Timing:
    name: str
    device: str
    method: str  # "do_bench" | "do_bench_cudagraph" | "events" | "torch.utils.benchmark"
    samples_ms: tuple[float, ...]
    first_call_ms: float  # compile/warm-up call, excluded from the statistics
    meta: dict = field(default_factory=dict)
    verdict: Stability | None = None  # None: judged from the samples with the default rules

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

    @property
    def stability(self) -> Stability:
        return self.verdict if self.verdict is not None else judge_samples(self.samples_ms)

    @property
    def stable(self) -> bool:
        return self.stability.stable

    def __str__(self) -> str:
        mark = "" if self.stable else f"; UNSTABLE: {self.stability.reason}"
        return (
            f"{self.name or 'fn'}: median {self.median_ms:.4g} ms "
            f"[p20 {self.p20_ms:.4g}, p80 {self.p80_ms:.4g}] over {self.n} samples ({self.method}){mark}"
        )
