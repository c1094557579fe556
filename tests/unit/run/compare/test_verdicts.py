"""lab_utils.run.compare.verdicts on merged rows written here (no report on disk): a value of zero
on one side (its ratio and gain by hand; no sample interval for a zero time), the samples each
side kept as counted, a row judged before any measurement (one-sided: none counted, why it is on
one side; failed: which side), and error figures judged by the threshold (below zero, not by their
tolerance; the note names the rule after the threshold's reason)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from lab_utils.run.compare.coverage import ContextDiff
from lab_utils.run.compare.options import Options
from lab_utils.run.compare.rules import Direction
from lab_utils.run.compare.verdicts import RowJudge, point_gain

TIME = Direction("lower", "performance")
BANDWIDTH = Direction("higher", "performance")


def merged(**over) -> dict:
    """One row of the outer join of both sides' rows, as ``merge_sides`` makes it."""
    r = dict(
        lab="01_a", experiment="e", variant="v", shape="", dtype="", metric="time", statistic="median",
        ident="", occurrence=1, unit_b="ms", unit_c="ms", extra_b="", extra_c="", value_b=1.0, value_c=1.0,
        stable_b=None, stable_c=None, stability_b="", stability_c="", samples_b=None, samples_c=None,
        failed_b=False, failed_c=False, _merge="both",
    )  # fmt: skip
    return {**r, **over}


def judged(*rows: dict, options: Options | None = None) -> list[dict]:
    o = options or Options()
    return RowJudge(o, ContextDiff(o), False, []).rows(pd.DataFrame(list(rows)))


@pytest.mark.parametrize(
    "d, vb, vc, gain, ratio",
    [
        (TIME, 0.0, 2.0, 0.0, math.inf),  # from nothing to 2 ms: infinitely worse, ratio 2/0
        (TIME, 2.0, 0.0, math.inf, 0.0),  # to nothing: infinitely better, ratio 0/2
        (TIME, 1.0, 0.0, math.inf, 0.0),  # a base of one unit is no zero
        (BANDWIDTH, 0.0, 2.0, math.inf, math.inf),  # higher is better: from nothing is better
        (BANDWIDTH, 1.0, 0.0, 0.0, 0.0),
        (TIME, 0.0, 0.0, 1.0, 1.0),  # nothing on both sides: the same
        (TIME, 1.0, 2.0, 0.5, 2.0),  # and away from zero, the plain quotients
    ],
)
def test_a_zero_on_one_side_has_an_infinite_or_zero_ratio_and_gain(d, vb, vc, gain, ratio):
    g, q, delta = point_gain(d, vb, vc)
    assert (g, q, delta) == (gain, ratio, None)


def test_a_row_on_one_side_or_failed_counts_no_samples():
    """A row judged before anything is measured (only in one run, or failed) names no samples on
    either side, even when the side that has it kept some."""
    s = np.array([1.0, 1.1, 0.9, 1.0])
    rows = judged(
        merged(variant="gone", _merge="left_only", value_c=math.nan, samples_b=s),
        merged(variant="new", _merge="right_only", value_b=math.nan, samples_c=s),
        merged(variant="broke", failed_c=True, samples_b=s, samples_c=s),
    )
    assert [r["verdict"] for r in rows] == ["only in base", "only in candidate", "failed"]
    assert [(r["n_base"], r["n_cand"]) for r in rows] == [(0, 0)] * 3
    assert all(r["base_samples"] is None and r["cand_samples"] is None for r in rows)


@pytest.mark.parametrize(
    "failed_b, failed_c, verdict, note",
    [
        (True, True, "failed both", ""),
        (False, True, "failed", "ran in base, failed in candidate"),
        (True, False, "fixed", "failed in base, runs in candidate"),
    ],
)
def test_a_row_of_a_failed_notebook_says_which_side_failed(failed_b, failed_c, verdict, note):
    (r,) = judged(merged(failed_b=failed_b, failed_c=failed_c, value_b=1.0, value_c=5.0))
    assert (r["verdict"], r["note"]) == (verdict, note)
    assert math.isnan(r["gain"]) and not r["regression"]  # nothing compared: no gain, no gate here


def test_a_negative_error_figure_keeps_the_ratio_threshold_not_its_tolerance():
    """The tolerance and roundoff rules judge error figures >= 0; a figure below zero on either
    side (a signed error) falls back to the ratio threshold, and the note says so."""
    tol = '{"tolerance": 1e-05}'
    rows = judged(
        merged(variant="signed", metric="max_abs_err", unit_b="", unit_c="", extra_b=tol, extra_c=tol,
               value_b=-1e-6, value_c=2e-6),
        merged(variant="plain", metric="max_abs_err", unit_b="", unit_c="", extra_b=tol, extra_c=tol,
               value_b=1e-6, value_c=2e-6),
    )  # fmt: skip
    signed, plain = rows
    assert signed["note"].endswith("rule: threshold") and "tolerance" not in signed["note"]
    assert plain["note"].endswith("(rule: tolerance)")  # the same figures at or above zero: its tolerance


def test_a_measured_row_counts_the_samples_each_side_kept():
    s4, s5 = np.full(4, 1.0), np.full(5, 1.0)
    rows = judged(
        merged(variant="none"),
        merged(variant="base only", samples_b=s4),
        merged(variant="both", samples_b=s4, samples_c=s5),
    )
    assert [(r["n_base"], r["n_cand"]) for r in rows] == [(0, 0), (4, 0), (4, 5)]
    assert [r["verdict"] for r in rows] == ["same"] * 3


def test_a_zero_time_gets_no_sample_interval():
    """A ratio of samples needs both sides above zero: a base of 0 ms (its samples all 0) against
    1 ms is infinitely worse by its point values, with no interval and no noise test."""
    zeros, ones = np.zeros(8), np.ones(8)
    (r,) = judged(merged(value_b=0.0, value_c=1.0, samples_b=zeros, samples_c=ones))
    assert (r["gain"], r["ratio"], r["verdict"]) == (0.0, math.inf, "slower")
    assert math.isnan(r["lo"]) and math.isnan(r["hi"]) and math.isnan(r["p_value"]) and r["noise"] == ""


def test_a_row_on_one_side_says_why_where_a_reason_is_known():
    """Only in the base because its lab did not run in the candidate: the note says so; a row new
    in the candidate with no parameter or run difference to explain it: the bare fact."""
    o = Options()
    judge = RowJudge(o, ContextDiff(o), False, ["01_a"])
    gone, new = judge.rows(
        pd.DataFrame(
            [
                merged(variant="gone", _merge="left_only", value_c=math.nan),
                merged(lab="02_b", variant="new", _merge="right_only", value_b=math.nan),
            ]
        )
    )
    assert (gone["verdict"], gone["note"]) == (
        "only in base",
        "missing in candidate: the lab did not run in the candidate",
    )
    assert (new["verdict"], new["note"]) == ("only in candidate", "new in candidate")
    assert gone["base"] == 1.0 and math.isnan(gone["candidate"]) and new["candidate"] == 1.0 and math.isnan(new["base"])


@pytest.mark.parametrize(
    "samples, note",
    [
        (False, "no samples: threshold only; rule: threshold"),  # the threshold's reason, then the rule
        (True, "rule: threshold"),  # samples clearly apart: no reason to give, the rule alone
    ],
)
def test_an_error_figure_judged_by_the_threshold_names_the_rule_after_any_reason(samples, note):
    """An error figure with neither tolerance nor roundoff scale, doubled (100% worse, beyond the
    10% threshold): its note names the rule, after the threshold's own reason where it has one."""
    s = np.array([1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 1.0])
    kept = dict(samples_b=s, samples_c=2 * s) if samples else {}
    (r,) = judged(merged(metric="max_abs_err", unit_b="", unit_c="", value_b=1.0, value_c=2.0, **kept))
    assert (r["verdict"], r["note"]) == ("less accurate", note)


@pytest.mark.parametrize(
    "vb, vc, verdict",
    [(0.0, 1.0, "slower"), (1.0, 0.0, "faster")],  # from nothing, to nothing
)
def test_a_zero_time_with_samples_kept_says_they_were_kept(vb, vc, verdict):
    """A value of zero leaves no ratio of samples: the verdict is the threshold's, and the note
    says the samples were kept but unusable, never that there were none."""
    s = {0.0: np.zeros(8), 1.0: np.ones(8)}
    (r,) = judged(merged(value_b=vb, value_c=vc, samples_b=s[vb], samples_c=s[vc]))
    assert (r["verdict"], r["note"]) == (verdict, "samples kept but not usable for a ratio: threshold only")
    (bare,) = judged(merged(value_b=vb, value_c=vc))  # no samples at all: the bare fact
    assert (bare["verdict"], bare["note"]) == (verdict, "no samples: threshold only")


def test_an_error_figure_from_zero_with_samples_kept_names_them_and_the_rule():
    zeros, ones = np.zeros(8), np.full(8, 1e-3)
    (r,) = judged(merged(metric="max_abs_err", unit_b="", unit_c="", value_b=0.0, value_c=1e-3,
                         samples_b=zeros, samples_c=ones))  # fmt: skip
    assert (r["verdict"], r["note"]) == (
        "less accurate",
        "samples kept but not usable for a ratio: threshold only; rule: threshold",
    )
