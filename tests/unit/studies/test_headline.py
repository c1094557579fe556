"""lab_utils.studies.headline: a lab's takeaway figures from records written here: the rows a
headline reads (a missing column matches nothing, a non-numeric value is no figure), numbers at
their thresholds (1,000 and up with separators, else three significant digits, n/a for nothing),
sizes in MiB below one GiB and in GiB from there (binary units written out), a variant read
without its step identity key,
the share of unstable timings counted by hand, which lab's rows a headline sees (its notebook, else
its lab), one lab's failing headline named without costing the index, and the takeaway's text and
HTML (escaped)."""

from __future__ import annotations

import pandas as pd
import pytest

from lab_utils.core.records import Recorder
from lab_utils.studies import headline as H

LAB = "98_unit_headline"


@pytest.fixture
def registered(monkeypatch):
    """A headline registered for LAB only while a test runs: the step time of its 'step' rows."""
    seen = []

    def fn(df):
        seen.append(df)
        r = H.rows(df, experiment="step", metric="step_time")
        return [H.Figure("step", H.fmt(float(r["value"].iloc[0]), "ms"), H.verdict(r.iloc[0]))]

    monkeypatch.setitem(H.HEADLINES, LAB, fn)
    return seen


def rec(lab=LAB) -> Recorder:
    r = Recorder(lab, device="cpu")
    r.add("step", "a", "step_time", 1234.5, "ms", statistic="median", samples=[1234.5] * 5, stable=True)
    r.add("step", "b", "step_time", 10.0, "ms", statistic="median", stable=False, stability="spread 30%")
    r.add("step", "a", "peak", 5.0, "MiB")
    return r


@pytest.mark.parametrize(
    "v, unit, text",
    [(999.4, "ms", "999 ms"), (999.6, "ms", "1e+03 ms"), (1000.0, "ms", "1,000 ms"), (7168.9, "", "7,169"),
     (-1500.0, "B", "-1,500 B"), (0.000123456, "", "0.000123"), (12.345, "%", "12.3 %"), (0.0, "", "0"),
     (None, "ms", "n/a"), (float("inf"), "", "n/a"), (float("nan"), "ms", "n/a")],
)  # fmt: skip
def test_a_figure_reads_plainly_at_its_thresholds(v, unit, text):
    assert H.fmt(v, unit) == text


def test_fmt_digits_and_the_rows_a_headline_reads():
    assert H.fmt(12345.6, digits=5) == "12346" and H.fmt(123456.0, digits=5) == "123,456"
    df = pd.DataFrame({"experiment": ["s", "s", "t"], "metric": ["x", "x", "x"], "value": [1.0, "n/a", 3.0]})
    assert H.rows(df, experiment="s")["value"].tolist() == [1.0]  # a value that is no number: no figure
    assert H.rows(df, experiment="t", metric="x")["value"].tolist() == [3.0]
    assert H.rows(df, shape="2x2").empty and len(H.rows(df)) == 2  # a column the rows lack matches nothing
    num = pd.DataFrame({"variant": [1, 2], "value": [5.0, 6.0]})
    assert H.rows(num, variant="2")["value"].tolist() == [6.0]  # compared as text


def test_verdict_and_the_share_of_unstable_timings():
    assert (H.verdict({"stable": False}), H.verdict({"stable": True}), H.verdict({"stable": None}), H.verdict({})) == (
        "UNSTABLE", "", "", "")  # fmt: skip
    df = H.frame_of(rec())
    assert H.unstable_figure(df) == H.Figure("unstable timings", "1 of 2 (50%)")  # the peak is no timing
    assert H.unstable_figure(df.iloc[0:0]) == H.Figure("unstable timings", "none judged")
    three = pd.concat([df, df.iloc[[0]]], ignore_index=True)
    assert H.unstable_figure(three).value == "1 of 3 (33%)"


def test_a_headline_reads_its_own_labs_rows(registered):
    both = pd.concat([H.frame_of(rec()), H.frame_of(rec("01_other"))], ignore_index=True)
    figs = H.headline(LAB, both)
    assert [str(f) for f in figs] == ["step: 1,234 ms", "unstable timings: 1 of 2 (50%)"]
    assert set(registered[-1]["lab"]) == {LAB} and len(registered[-1]) == 3
    by_nb = both.assign(notebook=["x"] * 3 + [LAB] * 3)  # a notebook column names the lab where it is set
    H.headline(LAB, by_nb)
    assert set(registered[-1]["lab"]) == {"01_other"}
    calls = len(registered)
    assert H.headline(LAB, H.frame_of(rec("01_other"))) == [H.Figure("unstable timings", "none judged")]
    assert len(registered) == calls  # no rows of its lab: its headline is not asked
    assert H.headline("97_unregistered", rec("97_unregistered")) == [H.Figure("unstable timings", "1 of 2 (50%)")]


def test_an_unstable_figure_says_so(registered):
    r = Recorder(LAB, device="cpu")
    r.add("step", "a", "step_time", 2.5, "ms", statistic="median", stable=False, stability="drift")
    assert H.frame_of(r)["stable"].dtype == bool  # a verdict on every row: numpy's False, not Python's
    assert str(H.headline(LAB, r)[0]) == "step: 2.5 ms (UNSTABLE)"
    r.add("step", "a", "peak", 5.0, "MiB")  # a row without a verdict: an object column
    assert str(H.headline(LAB, r)[0]) == "step: 2.5 ms (UNSTABLE)"
    assert H.verdict(pd.Series({"stable": float("nan")})) == "" and H.verdict(pd.Series({"stable": True})) == ""


def test_one_labs_failing_headline_is_named_and_the_others_go_on(registered, monkeypatch):
    def boom(df):
        raise ValueError("no step rows")

    monkeypatch.setitem(H.HEADLINES, "96_broken", boom)
    df = pd.concat([H.frame_of(rec()), H.frame_of(rec("96_broken"))], ignore_index=True)
    out = H.headlines(df, [LAB, "96_broken"])
    assert out["96_broken"] == [H.Figure("headline", "not available", "ValueError: no step rows")]
    assert str(out[LAB][0]) == "step: 1,234 ms"


def test_the_takeaway_in_text_and_html(registered):
    t = H.takeaway(rec())
    assert t.lab == LAB and str(t) == "Takeaway: step: 1,234 ms; unstable timings: 1 of 2 (50%)" and repr(t) == str(t)
    assert "<li>step: <b>1,234 ms</b></li>" in t._repr_html_()
    empty = H.Takeaway(LAB, ())
    assert str(empty) == "Takeaway: " + H.PENDING and H.PENDING in empty._repr_html_()
    figs = [H.Figure("a<b", "1 & 2", "x>y"), H.Figure("c", "3")]
    assert H.figures_html(figs) == ('a&lt;b: <b>1 &amp; 2</b> <span class="muted">(x&gt;y)</span> · c: <b>3</b>')
    assert "<i>(x&gt;y)</i>" in H.Takeaway(LAB, tuple(figs))._repr_html_()


def test_the_board_shows_the_pending_takeaway_and_fills_it_in_place(registered, monkeypatch):
    shown = []

    class Handle:
        def update(self, obj):
            shown.append(("update", obj))

    def display(obj, display_id=False):
        shown.append(("display", obj))
        return Handle() if display_id else None

    monkeypatch.setattr(H, "display", display)
    b = H.board(LAB)
    assert shown == [("display", H.Takeaway(LAB, ()))]
    assert b.update(rec()) is None  # the last cell shows nothing a second time
    assert shown[1] == ("update", H.takeaway(rec(), LAB)) and str(shown[1][1]).startswith("Takeaway: step: 1,234 ms")
    b.handle = None  # outside a notebook display gives no handle: update is a no-op
    b.update(rec())
    assert len(shown) == 2


MiB, GiB = 1024 * 1024, 1024 * 1024 * 1024  # binary units, written out


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 MiB"), (512 * 1024, "0.5 MiB"), (3 * MiB + MiB // 2, "3.5 MiB"), (999 * MiB, "999 MiB"),
     (1000 * MiB, "1,000 MiB"), (GiB - 1, "1,024 MiB"), (GiB, "1 GiB"), (GiB + GiB // 2, "1.5 GiB"),
     (80 * GiB, "80 GiB"), (2048 * GiB, "2,048 GiB"), (-2 * GiB, "-2 GiB"), (-5 * MiB, "-5 MiB"),
     (None, "n/a"), (float("nan"), "n/a"), (float("inf"), "n/a")],
)  # fmt: skip
def test_a_size_reads_in_mib_below_one_gib_and_in_gib_from_there(n, text):
    assert H.fmt_bytes(n) == text


def test_a_sizes_digits():
    assert H.fmt_bytes(1.2345 * GiB, digits=2) == "1.2 GiB" and H.fmt_bytes(1.2345 * GiB) == "1.23 GiB"
    assert H.fmt_bytes(123.456 * MiB, digits=5) == "123.46 MiB"


@pytest.mark.parametrize(
    "variant, plain",
    [("pkg.mod:make_step/pkg.mod.Net · bf16", "bf16"), ("pkg.mod:make_step/pkg.mod.Net", ""),
     ("bf16", "bf16"), ("a:b c/d · x", "a:b c/d · x"), ("x · pkg.mod:fn/pkg.Net · y", "x · pkg.mod:fn/pkg.Net · y"),
     (3, "3")],
)  # fmt: skip
def test_a_variant_without_its_step_identity_key(variant, plain):
    assert H.unscoped(variant) == plain  # only a leading "<factory>/<class>" key is dropped


def test_the_rows_of_a_non_default_step_match_their_plain_variant():
    df = pd.DataFrame(
        {"variant": ["pkg.mod:fn/pkg.Net · bf16", "bf16", "pkg.mod:fn/pkg.Net · fp32"], "value": [1.0, 2.0, 3.0]}
    )
    assert H.rows(df, variant="bf16")["value"].tolist() == [1.0, 2.0]
    assert H.rows(df, variant="fp32")["value"].tolist() == [3.0]
    assert H.frame_of(df.iloc[0:0]).empty
