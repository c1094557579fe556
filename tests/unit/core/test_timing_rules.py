"""Every stability rule of ``lab_utils.core.timing`` at its boundary: a sample set built by hand to
lie just inside and one just outside each threshold of the default ``StabilityRules``
(dispersion 1.2, stalls 3x and 2 ms and 5% of the samples, bimodal gap 1.25, drift 10% with
|Spearman rho| >= 0.5 from 9 samples, on a CPU 85% of the time, 3 samples at least), each
set disturbing one rule only.  Then how ``bench`` turns verdicts into its result (retries,
the steadiest attempt kept, the CPU-time rule for one thread only), on fed samples.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from scipy.stats import spearmanr

from lab_utils.core import timing as timing_mod
from lab_utils.core.timing import DEFAULT_RULES, bench, judge_samples

# The documented defaults, written out rather than read from StabilityRules: a threshold moved
# in the code must fail here, not move the cases with it.
R = SimpleNamespace(
    max_spread=1.2, stall_ms=2.0, stall_factor=3.0, max_stall_share=0.05, bimodal_gap=1.25, max_drift=0.10,
    min_rho=0.5, min_samples=3, min_on_cpu=0.85,
)  # fmt: skip
E = 1e-3  # "a little": 0.1% beyond (or inside) a threshold


def dispersion_set(p80: float) -> list[float]:
    """11 samples: sorted, p20 is the 3rd (1.0) and p80 the 9th (``p80``) exactly; taken in
    an order without a trend, no gap wider than 1.15 and no stall."""
    s = [0.99, 0.995, 1.0, 1.01, 1.02, 1.03, 1.04, 1.05, p80, p80 + 0.01, p80 + 0.02]
    return [s[i] for i in (4, 0, 9, 5, 2, 8, 10, 6, 1, 3, 7)]


def stall_set(median: float, stall: float, n: int = 11, stalls: int = 1) -> list[float]:
    """``n - stalls`` samples at ``median`` and ``stalls`` at ``stall``, the stalls in the middle."""
    x = [median] * (n - stalls)
    return x[: n // 2] + [stall] * stalls + x[n // 2 :]


def bimodal_set(low: int, high: int, gap: float) -> list[float]:
    """``low`` samples at 1.0 and ``high`` at ``gap``; the low ones taken in the middle (no drift)."""
    x = [gap] * high
    return x[: high // 2] + [1.0] * low + x[high // 2 :]


def drift_set(first: float, last: float) -> list[float]:
    """9 samples in three steps: the first third at ``first``, the last at ``last`` (rho = ±1)."""
    return [first] * 3 + [(first + last) / 2] * 3 + [last] * 3


def ranked_set(ranks: list[int], drift: float) -> list[float]:
    """Samples whose ranks follow ``ranks`` (so Spearman's rho is that of the ranks) and whose
    last third's median is ``1 + drift`` times the first third's."""
    third = len(ranks) // 3
    a, b = np.median(ranks[:third]), np.median(ranks[-third:])
    d = drift / (b - a * (1 + drift))  # (1 + b·d) / (1 + a·d) = 1 + drift
    return [1 + d * r for r in ranks]


# rank orders with Spearman rho exactly 0.5 (9 samples: 1 - 6·60/720), just above and just
# below it (20 samples: 1 - 6·664/7980 and 1 - 6·666/7980); the late samples rank high in each
RHO_05 = [0, 1, 3, 5, 8, 4, 7, 6, 2]
RHO_ABOVE = [0, 1, 9, 3, 7, 5, 6, 15, 8, 19, 10, 11, 16, 13, 14, 4, 12, 17, 18, 2]
RHO_BELOW = [17, 1, 2, 3, 6, 5, 10, 11, 8, 9, 4, 7, 12, 13, 14, 15, 16, 0, 18, 19]

# (case, samples, on_cpu, the rule that must fire or None)
CASES = [
    ("2 samples", [1.0, 1.0], None, "only 2 sample(s)"),
    ("2 finite samples", [1.0, 1.0, float("nan")], None, "only 2 sample(s)"),
    ("3 samples", [1.0, 1.0, 1.0], None, None),
    ("dispersion at 1.2", dispersion_set(R.max_spread), None, None),
    ("dispersion just inside", dispersion_set(R.max_spread * (1 - E)), None, None),
    ("dispersion just outside", dispersion_set(R.max_spread * (1 + E)), None, "dispersion"),
    # median 2 ms: the factor binds (6 ms is 3x and 4 ms above)
    ("stall at 3x", stall_set(2.0, 2.0 * R.stall_factor), None, None),
    ("stall just outside 3x", stall_set(2.0, 2.0 * R.stall_factor * (1 + E)), None, "stalled"),
    # median 0.5 ms: the 2 ms binds (2.5 ms is 5x but only 2 ms above)
    ("stall at +2 ms", stall_set(0.5, 0.5 + R.stall_ms), None, None),
    ("stall just outside +2 ms", stall_set(0.5, 0.5 + R.stall_ms * (1 + E)), None, "stalled"),
    # 5% of the samples may stall: 1 of 20, 3 of 60, but not 1 of 19 nor 3 of 59
    ("1 stall of 20", stall_set(1.0, 10.0, n=20), None, None),
    ("2 stalls of 20", stall_set(1.0, 10.0, n=20, stalls=2), None, "2 of 20 samples stalled"),
    ("1 stall of 19", stall_set(1.0, 10.0, n=19), None, "1 of 19 samples stalled"),
    ("3 stalls of 60", stall_set(1.0, 10.0, n=60, stalls=3), None, None),
    ("3 stalls of 59", stall_set(1.0, 10.0, n=59, stalls=3), None, "3 of 59 samples stalled"),
    # 10 samples: the 20-80% band of the sorted samples is the 2nd to the 9th
    ("gap 1.25 low in the band", bimodal_set(2, 8, R.bimodal_gap), None, None),
    ("gap just outside, low in the band", bimodal_set(2, 8, R.bimodal_gap * (1 + E)), None, "bimodal: 2 samples"),
    ("gap 1.25 high in the band", bimodal_set(8, 2, R.bimodal_gap), None, None),
    ("gap just outside, high in the band", bimodal_set(8, 2, R.bimodal_gap * (1 + E)), None, "bimodal: 8 samples"),
    ("gap below the band", bimodal_set(1, 9, 1.3), None, None),
    ("gap above the band", bimodal_set(9, 1, 1.3), None, None),
    ("drift up just inside", drift_set(1.0, 1 + R.max_drift * (1 - E)), None, None),
    ("drift up just outside", drift_set(1.0, 1 + R.max_drift * (1 + E)), None, "drift"),
    ("drift down just inside", drift_set(1.0, 1 - R.max_drift * (1 - E)), None, None),
    ("drift down just outside", drift_set(1.0, 1 - R.max_drift * (1 + E)), None, "drift"),
    ("drift in 8 samples", [1.0] * 2 + [1.07] * 4 + [1.15] * 2, None, None),
    ("drift, rho 0.5", ranked_set(RHO_05, 0.15), None, "drift"),
    ("drift, rho just above 0.5", ranked_set(RHO_ABOVE, 0.15), None, "drift"),
    ("drift, rho just below 0.5", ranked_set(RHO_BELOW, 0.15), None, None),
    ("on a CPU 85%", [1.0] * 5, R.min_on_cpu, None),
    ("on a CPU just under 85%", [1.0] * 5, R.min_on_cpu * (1 - E), "on a CPU only"),
    ("on a CPU unknown", [1.0] * 5, float("nan"), None),
]  # fmt: skip

RULE_WORDS = ("only", "dispersion", "stalled", "bimodal", "drift", "on a CPU")


@pytest.mark.parametrize("name,samples,on_cpu,fires", CASES, ids=[c[0] for c in CASES])
def test_each_rule_at_its_boundary(name, samples, on_cpu, fires):
    v = judge_samples(samples, on_cpu=on_cpu)
    if fires is None:
        assert v.stable, (name, v.reason)
        return
    assert not v.stable and fires in v.reason, (name, v.reason)
    others = [w for w in RULE_WORDS if w in v.reason and w not in fires]
    assert not others, f"{name}: the set disturbs other rules too: {v.reason}"


def test_the_written_out_defaults_are_the_rules():
    assert DEFAULT_RULES.__dict__ == R.__dict__


def test_drift_says_which_way():
    up = judge_samples(drift_set(1.0, 1 + R.max_drift * (1 + E))).reason
    down = judge_samples(drift_set(1.0, 1 - R.max_drift * (1 + E))).reason
    assert "the last third's median is +10%" in up and "rho 1.00" in up
    assert "the last third's median is -10%" in down and "rho -0.80" in down  # ties ranked in the order taken


def test_the_sets_are_what_they_claim():
    """The constructions, checked by independent means (numpy quantiles, scipy's Spearman)."""
    for p80 in (1.2, 1.2 * (1 - E), 1.2 * (1 + E)):
        x = np.array(dispersion_set(p80))
        assert np.quantile(x, 0.2) == 1.0 and np.quantile(x, 0.8) == p80
    assert spearmanr(RHO_05, range(9)).statistic == pytest.approx(0.5, abs=1e-12)
    assert 0.5 < spearmanr(RHO_ABOVE, range(20)).statistic < 0.501
    assert 0.499 < spearmanr(RHO_BELOW, range(20)).statistic < 0.5
    for ranks in (RHO_05, RHO_ABOVE, RHO_BELOW):
        x = np.array(ranked_set(ranks, 0.15))
        third = len(x) // 3
        assert np.median(x[-third:]) / np.median(x[:third]) == pytest.approx(1.15)
        assert np.quantile(x, 0.8) / np.quantile(x, 0.2) < 1.2  # only the drift rule can fire


# ------------------------------------------------------------------ bench on fed samples


@pytest.fixture
def feed(monkeypatch):
    """bench's CPU sampler answers from a list of (samples, on_cpu), one per attempt."""
    fed: list[tuple[list[float], float]] = []

    def cpu_samples(fn, *, n, number, warmup_ms, threads):
        return fed.pop(0)

    monkeypatch.setattr(timing_mod, "_cpu_samples", cpu_samples)
    return fed


def fast_bench(**kw):
    return bench(lambda: None, device="cpu", reps=5, warmup_ms=0, check_finite=False, **kw)


QUIET = [1.0, 1.01, 0.99, 1.0, 1.0]


def test_a_disturbed_attempt_is_retried(feed):
    feed += [(bimodal_set(2, 8, 1.3), 1.0), (QUIET, 1.0)]
    t = fast_bench(retries=2, threads=2)
    assert t.stable and t.meta["attempts"] == 2 and t.samples_ms == tuple(QUIET)
    assert "(attempt 2; before: bimodal: 2 samples near 1 ms and 8 near 1.3 ms)" in t.stability.reason
    assert not feed  # no third attempt after a stable one


def test_always_disturbed_keeps_the_steadiest_attempt(feed):
    for s in (1.5, 1.3, 1.4):  # p80/p20 = s exactly (11 samples, see dispersion_set)
        feed.append((dispersion_set(s), 1.0))
    t = fast_bench(retries=2, threads=2)
    assert not t.stable and t.meta["attempts"] == 3
    assert t.stability.spread == pytest.approx(1.3) and t.samples_ms == tuple(dispersion_set(1.3))
    assert t.stability.reason.startswith("unstable in all 3 attempt(s); kept the steadiest: dispersion")
    feed.append((dispersion_set(1.5), 1.0))
    t0 = fast_bench(retries=0, threads=2)
    assert t0.meta["attempts"] == 1 and "unstable (no retry allowed)" in t0.stability.reason


def test_time_off_the_cpu_judged_for_one_thread_only(feed):
    feed.append((QUIET, 0.5))
    t = fast_bench(retries=0, threads=1)
    assert not t.stable and "on a CPU only 50%" in t.stability.reason and t.meta["on_cpu"] == 0.5
    feed.append((QUIET, 0.5))  # with idle workers among several threads the share says nothing
    assert fast_bench(retries=0, threads=2).stable


def test_the_bimodal_rule_starts_at_four_samples():
    """k = max(2, ceil(0.2 n)) samples a side: the gap check needs n >= 2k, first met at n = 4
    (k = 2), where the one gap is between the 2nd and 3rd sorted samples; at n = 3 there is none."""
    at = judge_samples([1.0, 2.0, 1.0, 2.0])
    assert not at.stable and "bimodal: 2 samples near 1 ms and 2 near 2 ms" in at.reason
    below = judge_samples([1.0, 2.0, 2.0])
    assert "bimodal" not in below.reason
