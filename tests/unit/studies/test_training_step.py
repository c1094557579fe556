"""Lab 01's checked figures: FLOPs per step and per forward, and the parameter counts, each
held to a derivation written apart from the code that produces it (the lab raises if not)."""

from __future__ import annotations

import pytest

from lab_utils.model import MMDiTConfig
from lab_utils.profiling.profiler import training_step_flops
from lab_utils.studies import training_step as S


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
