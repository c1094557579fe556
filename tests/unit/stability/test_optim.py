"""Pins of the training-stability figures against hand counts and torch's own rounding: mutants at points
no earlier mutant touched found them unpinned.

* ``half_ulp``: half the spacing above |w| in bfloat16, float16 and float32, at 1, 1.5, 2 and 0
  (the subnormal step: float16's is 2^-24, so half of it is 2^-25);
* ``lost_update_mask`` at, just below and just above half an ulp, each checked against what
  torch's round-to-nearest-even cast really does to ``w + u`` (an odd-mantissa weight, where a tie
  rounds away from w, so an update of exactly half an ulp is applied, not lost);
* ``StabilityAdamW`` plain fp32 after two steps against AdamW written out in float64;
* ``DynamicLossScaler``'s scale over a hand-written sequence of good and overflowing steps;
* ``SpikeDetector``'s robust z-score (1.4826 x MAD) by hand and at its threshold (a spike is
  above it, not at it);
* ``RunResult.final_loss``: the mean of the last quarter's losses (1, 2, 9 -> 4; the median is 2).
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from lab_utils.stability.optim import DynamicLossScaler, StabilityAdamW, half_ulp, lost_update_mask
from lab_utils.stability.training import RunResult, RunSpec, SpikeDetector


@pytest.mark.parametrize(
    "dtype,mbits,tiny",
    [(torch.bfloat16, 7, 2.0**-133), (torch.float16, 10, 2.0**-24), (torch.float32, 23, 2.0**-149)],
)
def test_half_ulp_by_hand(dtype, mbits, tiny):
    w = torch.tensor([1.0, 1.5, 2.0, -2.0])
    want = [2.0 ** -(mbits + 1), 2.0 ** -(mbits + 1), 2.0**-mbits, 2.0**-mbits]
    assert half_ulp(w, dtype).tolist() == want
    if dtype != torch.float32:  # float32's half subnormal step, 2^-150, is below float32's range
        assert half_ulp(torch.zeros(1), dtype).tolist() == [tiny / 2]
    # the spacing itself, as torch's next representable value says
    one = torch.tensor(1.0, dtype=dtype)
    assert float(torch.nextafter(one, torch.tensor(2.0, dtype=dtype)) - one) == 2 * want[0]


def test_lost_update_boundary_against_torchs_rounding():
    w = torch.tensor(1 + 2.0**-7)  # bf16 mantissa 0000001: odd
    hu = 2.0**-8
    us = torch.tensor([hu * (1 - 2.0**-10), hu, hu * (1 + 2.0**-10)])
    ws = w.expand(3).contiguous()
    lost_by_rounding = (ws + us).to(torch.bfloat16).float() == ws
    assert lost_by_rounding.tolist() == [True, False, False]
    assert lost_update_mask(ws, us, torch.bfloat16).tolist() == [True, False, False]


def test_stability_adamw_plain_fp32_two_steps_by_hand(gen):
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.99, 1e-8, 0.1
    w0 = torch.randn(32, generator=gen, dtype=torch.float64)
    gs = [torch.randn(32, generator=gen, dtype=torch.float64) for _ in range(2)]
    p = torch.nn.Parameter(w0.float().clone())
    opt = StabilityAdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    w, m, v = w0.clone(), torch.zeros(32, dtype=torch.float64), torch.zeros(32, dtype=torch.float64)
    for t, g in enumerate(gs, 1):
        p.grad = g.float()
        opt.step()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - lr * ((m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * w)
        torch.testing.assert_close(p.detach().double(), w, rtol=1e-5, atol=1e-6)


def test_loss_scaler_sequence_by_hand():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    seq = [True, True, True, True, True, True, False, True, True, True, True]
    scales = []
    for i, finite in enumerate(seq):
        s.update(i, finite)
        scales.append(s.scale)
    # doubles after the 3rd and 6th good steps, halves on the overflow, doubles 3 good steps later
    assert scales == [1024, 1024, 2048, 2048, 2048, 4096, 2048, 2048, 2048, 4096, 4096]
    assert [skipped for _, _, skipped in s.history] == [not f for f in seq]


def test_spike_z_score_by_hand_and_at_the_threshold():
    # window 1..6: median 3.5, |x - median| = 2.5 1.5 .5 .5 1.5 2.5 -> MAD 1.5, sigma = 1.4826 * 1.5
    z10 = (10 - 3.5) / (1.4826 * 1.5)
    assert z10 == pytest.approx(2.9228, abs=1e-4)

    def detector(threshold):
        d = SpikeDetector(window=16, threshold=threshold, min_history=6)
        for x in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
            assert not d.observe(x, 1.0 + x / 100).spike
        return d

    c = detector(10.0).observe(10.0, 1.035)
    assert c.z_loss == pytest.approx(z10, rel=1e-12) and not c.spike
    assert not detector(z10).observe(10.0, 1.035).spike  # at the threshold: not a spike
    assert detector(z10 * (1 - 1e-9)).observe(10.0, 1.035).spike  # just above it
    assert detector(2.0).observe(10.0, 1.035).spike


def test_final_loss_is_the_mean_of_the_last_quarter():
    losses = [5.0] * 9 + [1.0, 2.0, 9.0]  # 12 steps: the last 3
    res = RunResult(RunSpec(), pd.DataFrame({"step": range(12), "loss": losses}), pd.DataFrame())
    assert res.final_loss() == 4.0
    with_nan = [5.0] * 9 + [1.0, math.nan, 9.0]  # a skipped step's NaN is left out
    res = RunResult(RunSpec(), pd.DataFrame({"step": range(12), "loss": with_nan}), pd.DataFrame())
    assert res.final_loss() == 5.0


def test_bf16_parameters_keep_float32_moments_by_hand(gen):
    """The moments of a bf16 parameter are float32: after two steps the second moment is the
    float64 hand recurrence to float32 precision (a bf16 one is off by ~1e-3 relative)."""
    b1, b2 = 0.9, 0.99
    p = torch.nn.Parameter(torch.randn(64, generator=gen).to(torch.bfloat16))
    opt = StabilityAdamW([p], lr=1e-3, betas=(b1, b2))
    m, v = torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    for _ in range(2):
        g = (1 + torch.rand(64, generator=gen)).to(torch.bfloat16)
        p.grad = g
        opt.step()
        m = b1 * m + (1 - b1) * g.double()
        v = b2 * v + (1 - b2) * g.double() ** 2
    st = opt.state[p]
    assert st["m"].dtype == st["v"].dtype == torch.float32
    torch.testing.assert_close(st["v"].double(), v, rtol=1e-6, atol=0)
    torch.testing.assert_close(st["m"].double(), m, rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode, lost", [("master", 0), ("plain", 64)])
def test_a_tiny_update_is_lost_in_bf16_but_kept_by_the_float32_master(gen, mode, lost):
    """|w| in [1, 2): bf16 half-ulp 2^-8, float32 half-ulp 2^-24.  An update of ~1e-5 (lr) is
    lost against every bf16 weight (plain) and against none of the float32 master copy."""
    p = torch.nn.Parameter((1 + 0.5 * torch.rand(64, generator=gen)).to(torch.bfloat16))
    opt = StabilityAdamW([p], lr=1e-5, mode=mode)
    opt.track = True
    p.grad = torch.randn(64, generator=gen).to(torch.bfloat16)
    opt.step()
    assert float(opt.last_stats[p][2]) == lost
