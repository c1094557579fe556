"""lab_utils.run.compare.text, the printed summary: a row's label (its metric, statistic and
repeat number), numbers as printed (NaN, infinity), the ratio column (a dB row's difference, the
interval turned to candidate / base for a lower-is-better row, nothing without a ratio) and the
sections (which rows each lists, how many before "... N more").  The expected strings are
written out by hand here."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from lab_utils.run.compare.comparison import compare
from lab_utils.run.compare.sides import Side, normalise
from lab_utils.run.compare.text import fmt_num, ratio_text, row_label, summary_text

CPU = {"device": "Test CPU 9000", "device_kind": "cpu", "torch_version": "2.13.0", "commit": "aaaa"}


def label_row(**over) -> dict:
    r = dict(
        lab="01_norms", experiment="fwd", variant="triton", shape="64x96", dtype="bfloat16", ident="",
        metric="time", statistic="median", occurrence=1,
    )  # fmt: skip
    return {**r, **over}


def test_a_row_label_names_the_row_its_metric_and_statistic():
    assert row_label(label_row()) == "01_norms/fwd/triton 64x96 bfloat16 time[median]"
    # a plain value names no statistic; an empty shape leaves no double space
    assert row_label(label_row(statistic="value", shape="")) == "01_norms/fwd/triton bfloat16 time"
    assert row_label(label_row(ident="mask=causal")) == "01_norms/fwd/triton 64x96 bfloat16 [mask=causal] time[median]"


@pytest.mark.parametrize("occurrence, tail", [(1, "time[median]"), (2, "time[median] #2"), (3, "time[median] #3")])
def test_a_row_label_numbers_a_repeated_key_from_its_second_row(occurrence, tail):
    assert row_label(label_row(occurrence=occurrence)) == f"01_norms/fwd/triton 64x96 bfloat16 {tail}"


@pytest.mark.parametrize(
    "v, text",
    [(None, "—"), (math.nan, "—"), (math.inf, "inf"), (2.0, "2"), (0.000123456, "0.0001235"), (1234567.0, "1.235e+06")],
)
def test_numbers_print_with_four_significant_digits_and_a_dash_for_none(v, text):
    assert fmt_num(v) == text


def ratio_row(**over) -> dict:
    r = dict(unit="ms", base=2.0, candidate=3.0, ratio=1.5, lo=math.nan, hi=math.nan, better="lower")
    return {**r, **over}


def test_a_ratio_prints_alone_without_an_interval():
    assert ratio_text(ratio_row()) == "x1.5"
    assert ratio_text(ratio_row(ratio=math.inf)) == "xinf"  # from zero: infinitely more


def test_a_ratio_without_a_value_prints_nothing():
    assert ratio_text(ratio_row(ratio=math.nan)) == ""


def test_a_lower_is_better_interval_prints_as_candidate_over_base():
    """``lo``/``hi`` bound the gain (base / candidate for a time): printed beside the ratio
    (candidate / base) they are inverted and swapped: a gain in [0.5, 0.8] is a ratio in [1.25, 2]."""
    assert ratio_text(ratio_row(lo=0.5, hi=0.8)) == "x1.5 [1.25, 2]"
    # higher is better: the gain is the ratio, printed as it is
    assert ratio_text(ratio_row(better="higher", lo=1.25, hi=2.0)) == "x1.5 [1.25, 2]"


def test_a_db_row_prints_its_difference_and_only_with_both_values():
    assert ratio_text(ratio_row(unit="dB", base=28.0, candidate=31.0, ratio=31 / 28)) == "+3.00 dB"
    # one side without a value: no difference; the ratio (NaN here) decides
    assert ratio_text(ratio_row(unit="dB", base=28.0, candidate=math.nan, ratio=math.nan)) == ""


def side(label: str, rows: list[dict]) -> Side:
    df = pd.DataFrame(rows)
    for c, v in CPU.items():
        df[c] = v
    return Side(label=label, source=label, rows=normalise(df), context=dict(CPU))


def value_row(variant: str, value: float, metric: str = "params") -> dict:
    return dict(lab="02_blocks", experiment="count", variant=variant, shape="", dtype="", metric=metric,
                statistic="value", value=value, unit="", samples=None, extra="")  # fmt: skip


def section_lines(text: str, title: str) -> list[str]:
    """The lines of one section: its title line ``title (n):`` and the indented ones under it."""
    lines = text.splitlines()
    start = next(i for i, s in enumerate(lines) if s.startswith(f"{title} ("))
    out = [lines[start]]
    for s in lines[start + 1 :]:
        if not s.startswith("  "):
            break
        out.append(s)
    return out


def test_rows_only_in_the_candidate_are_listed_under_their_own_section():
    base = side("base", [value_row("kept", 1.0)])
    cand = side("candidate", [value_row("kept", 1.0), value_row("new", 2.0)])
    text = compare(base, cand).summary_text()
    lines = section_lines(text, "only in candidate")
    assert lines[0] == "only in candidate (1):"
    assert len(lines) == 2 and "02_blocks/count/new params" in lines[1] and "ONLY IN CANDIDATE" in lines[1]
    assert "only in base (" not in text  # an empty section prints nothing


@pytest.mark.parametrize("n, limit, listed, more", [(3, 3, 3, None), (4, 3, 3, 1), (1, 1, 1, None), (2, 1, 1, 1)])
def test_a_section_lists_up_to_the_limit_then_says_how_many_more(n, limit, listed, more):
    base = side("base", [value_row("kept", 1.0)])
    cand = side("candidate", [value_row("kept", 1.0)] + [value_row(f"new{i}", 2.0) for i in range(n)])
    lines = section_lines(compare(base, cand).summary_text(limit=limit), "only in candidate")
    assert lines[0] == f"only in candidate ({n}):"
    rows = [s for s in lines[1:] if "ONLY IN CANDIDATE" in s]
    tail = [s for s in lines[1:] if "more (see compare.html" in s]
    assert len(rows) == listed
    assert tail == ([] if more is None else [f"  ... {more} more (see compare.html / compare.json)"])


def test_the_summary_lists_forty_rows_a_section_by_default():
    base = side("base", [value_row("kept", 1.0)])
    cand = side("candidate", [value_row("kept", 1.0)] + [value_row(f"new{i:02d}", 2.0) for i in range(41)])
    cmp = compare(base, cand)
    for text in (summary_text(cmp), cmp.summary_text()):
        lines = section_lines(text, "only in candidate")
        assert sum("ONLY IN CANDIDATE" in s for s in lines) == 40
        assert lines[-1] == "  ... 1 more (see compare.html / compare.json)"


def test_a_summary_row_prints_both_values_its_ratio_and_verdict():
    """A time 2 ms -> 3 ms kept without samples: 50% slower by its point values, not gated."""
    t = dict(lab="01_norms", experiment="fwd", variant="triton", shape="", dtype="", metric="time",
             statistic="median", unit="ms", samples=None, extra="")  # fmt: skip
    text = compare(side("base", [{**t, "value": 2.0}]), side("candidate", [{**t, "value": 3.0}])).summary_text()
    (line,) = [s for s in text.splitlines() if "01_norms/fwd/triton" in s]
    assert line == (
        "  01_norms/fwd/triton time[median]: 2 -> 3 ms  x1.5  SLOWER (no samples, so no noise estimate: not gated)"
    )
