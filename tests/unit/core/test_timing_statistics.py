"""A timing's statistics read from its samples by their definitions (numpy's quantiles, written
out here), and the CPU sample sized to last at least ``min_sample_ms``: the figures every
table, compare row and roofline point of the lab is built from."""

import numpy as np
import pytest

from lab_utils.core import timing as timing_mod
from lab_utils.core.timing import BenchError, BenchOptions, Timing, bench, judge_samples

# ten samples whose quantiles are easy to write by hand (numpy's linear interpolation:
# the q-quantile of 1..10 is 1 + 9q)
TEN = tuple(float(i) for i in range(1, 11))


def test_quantiles_of_a_hand_made_timing():
    t = Timing("t", "cpu", "hand", TEN[::-1], 0.0)  # the order taken does not matter
    assert t.median_ms == 5.5
    assert t.p20_ms == pytest.approx(2.8) and t.p80_ms == pytest.approx(8.2)
    assert t.min_ms == 1.0 and t.mean_ms == 5.5
    assert t.spread == pytest.approx((8.2 - 2.8) / 5.5)
    assert np.quantile(TEN, 0.2) == pytest.approx(2.8)  # the definition used above


def test_the_verdict_reports_p80_over_p20():
    v = judge_samples(TEN)
    assert v.spread == pytest.approx(8.2 / 2.8)
    assert not v.stable and "dispersion p80/p20 = 2.93 > 1.2" in v.reason


def test_a_short_call_is_repeated_within_each_sample():
    """A call of microseconds is timed in blocks of ceil(min_sample_ms / one call) calls, so a
    sample lasts about a millisecond and the timer's resolution does not dominate it."""
    t = bench(lambda: None, device="cpu", reps=3, warmup_ms=0, check_finite=False, retries=0, min_sample_ms=1.0)
    number = t.meta["number_per_sample"]
    assert number > 10
    assert t.median_ms < 0.1  # per call, not per block of calls


def test_the_cpu_sample_plan_fits_the_budget_in_seconds():
    """50 samples of a 2 ms call take 100 ms: within a 60 s budget all 50 are taken; within a
    0.05 s budget 50 ms / 2 ms = 25; a 0.1 ms call is repeated 10 times per 1 ms sample; three
    samples of a 40 ms call (120 ms) do not fit 0.05 s even with its 50% allowance (75 ms)."""
    plan = timing_mod._cpu_sample_plan
    assert plan(2.0, "t", BenchOptions(reps=50, budget_s=60.0)) == (50, 1)
    assert plan(2.0, "t", BenchOptions(reps=50, budget_s=0.05)) == (25, 1)
    assert plan(0.1, "t", BenchOptions(reps=50, budget_s=60.0)) == (50, 10)
    with pytest.raises(BenchError, match="3 samples would exceed the budget of 0.05 s"):
        plan(40.0, "t", BenchOptions(reps=50, budget_s=0.05))


def test_cuda_samples_get_a_third_of_the_budget(monkeypatch):
    """The documented limit of a CUDA timing's samples: a third of ``budget_s`` (6 s -> 2000 ms)."""
    got = {}

    def cuda_samples(fn, o, *, est_ms, limit_ms):
        got["limit_ms"] = limit_ms
        return [1.0, 1.0, 1.0], "do_bench"

    monkeypatch.setattr(timing_mod, "_sync", lambda dev: None)
    monkeypatch.setattr(timing_mod, "cuda_samples", cuda_samples)
    t = bench(lambda: None, device="cuda", reps=3, budget_s=6.0, check_finite=False, retries=0)
    assert got["limit_ms"] == pytest.approx(2000.0) and t.meta["time_limit_ms"] == pytest.approx(2000.0)


def test_mean_and_spread_of_a_skewed_timing():
    """1, 2, 3, 4 and a stall of 20: the median is 3, the mean 6 (the stall pulls the mean
    only); numpy's p20 and p80 sit at positions 0.8 and 3.2: 1.8 and 4 + 0.2 x 16 = 7.2, so the
    relative spread is (7.2 - 1.8) / 3 = 1.8, over the median (the ten samples 1..10 above have
    mean = median and cannot tell the two apart)."""
    t = Timing("t", "cpu", "hand", (20.0, 1.0, 4.0, 2.0, 3.0), 0.0)
    assert t.median_ms == 3.0 and t.mean_ms == 6.0
    assert t.p20_ms == pytest.approx(1.8) and t.p80_ms == pytest.approx(7.2)
    assert t.spread == pytest.approx(1.8)
