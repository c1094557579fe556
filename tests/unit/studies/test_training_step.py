"""Lab 01's checked figures: FLOPs per step and per forward, and the parameter counts, each
held to a derivation written apart from the code that produces it (the lab raises if not)."""

from __future__ import annotations

import math

import holoviews as hv
import pandas as pd
import pytest

from lab_utils.core.records import Recorder
from lab_utils.model import MMDiTConfig
from lab_utils.profiling.profiler import training_step_flops
from lab_utils.studies import training_step as S

hv.extension("bokeh")  # the MFU table is a holoviews table with options


def test_step_flops_by_hand_equal_the_flop_counter_at_other_shapes():
    for cfg in (MMDiTConfig.from_preset("tiny"), MMDiTConfig.from_preset("tiny", guidance_embed=False)):
        assert training_step_flops(cfg, 3, (3, 5), 9) == S.step_flops_by_hand(cfg, 3, 15, 9)
    # tiny, batch 2, 16 + 16 tokens: 3 x 28,235,776 less the input gradients of img_in
    # (2*32*16*64), txt_in (2*32*32*64), time/vector/guidance first linears (2*2*{256,24,256}*64)
    assert S.step_flops_by_hand(MMDiTConfig.from_preset("tiny"), 2, 16, 16) == 3 * 28_235_776 - 333_824


def test_flop_lines_raise_when_the_counted_step_is_wrong(monkeypatch):
    tiny_fwd = int(S.forward_flops(MMDiTConfig.from_preset("tiny"), 2, 16, 16)["total"])
    monkeypatch.setattr(S, "training_step_flops", lambda *a: 2 * tiny_fwd)  # a backward costing one forward
    with pytest.raises(AssertionError, match="tiny step: counted"):
        S.flop_lines()


def test_flop_lines_raise_when_the_forward_formula_is_wrong(monkeypatch):
    real = S.forward_flops

    def attention_halved(cfg, b, li, lt):
        f = dict(real(cfg, b, li, lt))
        f["total"] -= f["attention"] / 2
        return f

    monkeypatch.setattr(S, "forward_flops", attention_halved)
    monkeypatch.setattr(S, "step_flops_by_hand", lambda *a: S.training_step_flops(*a[:2], (4, 4), 16))
    with pytest.raises(AssertionError, match="flux-dev forward: .* != from its modules"):
        S.flop_lines()


def test_preset_lines_raise_off_the_public_parameter_counts(monkeypatch):
    # every weight counted twice, by the model and by the formula alike: only the public figure sees it
    count, formula = S.num_params, S.analytic_param_count
    monkeypatch.setattr(S, "num_params", lambda m: 2 * count(m))
    monkeypatch.setattr(S, "analytic_param_count", lambda c: 2 * formula(c))
    with pytest.raises(AssertionError, match="flux-schnell: 23.782 B, public figure 11.9 B"):
        S.preset_lines()


def _mfu_frame(achieved: float, pct: float) -> pd.DataFrame:
    return pd.DataFrame(
        [
            dict(quantity="achieved", dtype="bf16", tflops=achieved, pct=None, reference="", samples=[achieved]),
            dict(quantity="datasheet peak", dtype="bf16", tflops=1.0, pct=pct, reference="sheet", samples=[pct]),
        ]
    )


def test_an_undefined_mfu_reads_not_available_in_its_table():
    t = S.mfu_table(_mfu_frame(math.nan, math.nan)).data.set_index("quantity")
    assert t.loc["achieved", "tflops"] == "n/a" and t.loc["achieved", "pct"] == ""  # no peak: no share
    assert t.loc["datasheet peak", "tflops"] == "1" and t.loc["datasheet peak", "pct"] == "n/a"
    shown = t[["tflops", "pct"]].to_string()
    assert "inf" not in shown and "nan" not in shown
    ok = S.mfu_table(_mfu_frame(0.0123456, 1.23456)).data.set_index("quantity")
    assert (ok.loc["achieved", "tflops"], ok.loc["datasheet peak", "pct"]) == ("0.0123", "1.23")
    assert ok.loc["achieved", "pct"] == ""


def test_an_undefined_mfu_reads_not_available_in_the_headline():
    rec = Recorder(lab="01_training_step")
    rec.add("step", "profile", "step_time", 0.0, "ms", statistic="median")
    rec.add("mfu", "measured matmul ceiling", "pct_of_peak", math.nan, "%", statistic="total")
    figs = {f.label: f for f in S.headline(rec.frame())}
    assert figs["MFU"].value == "n/a"
    rec = Recorder(lab="01_training_step")
    rec.add("mfu", "measured matmul ceiling", "pct_of_peak", 12.5, "%", statistic="total")
    assert {f.label: f.value for f in S.headline(rec.frame())}["MFU"] == "12.5 %"
    assert "MFU" not in {f.label for f in S.headline(Recorder(lab="01_training_step").frame())}  # no profile


def test_an_undefined_mfu_has_no_bars_and_says_why():
    assert "MFU n/a" in S.mfu_bars(_mfu_frame(math.nan, math.nan)).data
    assert "No peak" in S.mfu_bars(_mfu_frame(0.1, math.nan).iloc[:1]).data  # no peak at all
    assert isinstance(S.mfu_bars(_mfu_frame(0.1, 10.0)), hv.Bars)
