"""lab_utils.run.compare.stats: the rank tests against the base shifted by the threshold each
way (either better direction), and the note of a change within the threshold (significant
when its interval leaves out 1, at the interval's edge exactly 1: noise).  The threshold (5%) and
the confidence (99%) are written out here, not read from ``Options``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lab_utils.run.compare.options import Options
from lab_utils.run.compare.rules import Direction
from lab_utils.run.compare.stats import judge, rank_pvalues

TIME = Direction("lower", "performance")
NAN = math.nan


@pytest.mark.parametrize("better", ["lower", "higher"])
def test_rank_tests_shift_the_base_by_the_threshold_each_way(gen, better):
    """Threshold 5%: for a time (lower is better) "worse" tests the candidate against base x 1.05
    and "better" against base / 1.05; for a bandwidth (higher is better) the other way round.
    Samples in a 1% band make the one-sided p-values extreme: 3% up or down is beyond neither
    bound, 10% beyond one of them."""
    s = 1 + float(torch.rand((), generator=gen))
    base = np.linspace(1.0, 1.01, 10) * s
    for within in (0.97, 1.03):
        pw, pb = rank_pvalues(base, base * within, 1.05, better)
        assert pw > 0.5 and pb > 0.5, within
    up, down = rank_pvalues(base, base * 1.10, 1.05, better), rank_pvalues(base, base * 0.90, 1.05, better)
    worse, improved = (up, down) if better == "lower" else (down, up)
    assert worse[0] < 1e-3 and worse[1] > 0.5
    assert improved[1] < 1e-3 and improved[0] > 0.5


@pytest.mark.parametrize(
    "lo, hi, note",
    [
        (1.001, 1.03, "significant but within threshold"),  # the whole interval above 1
        (0.97, 0.999, "significant but within threshold"),  # the whole interval below 1
        (1.0, 1.03, "within noise"),  # the interval reaches 1: no change shown
        (0.97, 1.0, "within noise"),
        (0.98, 1.03, "within noise"),
    ],
)
def test_a_change_within_the_threshold_is_significant_only_when_its_interval_leaves_out_one(lo, hi, note):
    """A gain of 1.01 (inside the 5% threshold) with its bootstrap interval inside (1/1.05, 1.05)."""
    assert judge(1.01, lo, hi, NAN, NAN, TIME, Options()) == ("same", note)


def test_a_rank_tested_change_within_the_threshold_is_within_noise():
    """With ``method="rank"`` the p-values test a change beyond the threshold: one below 1 - 99%
    is a verdict, and neither below it leaves the change within noise."""
    o = Options(method="rank")
    assert judge(1.01, NAN, NAN, 0.5, 0.02, TIME, o) == ("same", "within noise")
    assert judge(1.01, NAN, NAN, 0.5, 0.009, TIME, o) == ("faster", "")
    assert judge(1.01, NAN, NAN, 0.009, 0.5, TIME, o) == ("slower", "")


@pytest.mark.parametrize("worse", [True, False])
def test_a_rank_test_at_the_significance_level_itself_is_no_verdict(worse):
    """A p-value must be below 1 - confidence to count: exactly at it, the change is noise."""
    o = Options(method="rank")
    alpha = 1 - 0.99
    pw, pb = (alpha, 0.5) if worse else (0.5, alpha)
    assert judge(1.01, NAN, NAN, pw, pb, TIME, o) == ("same", "within noise")
