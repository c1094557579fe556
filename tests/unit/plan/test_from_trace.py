"""lab_utils.plan.from_trace: the step profile the planner plans from, read from a five-step trace
written here whose phase times are known by construction (a forward kernel of 0.1 to 0.5 ms, a
text encoder's 0.05 ms, a backward that ran in two steps of five, an all-reduce that belongs to no
lever), each figure worked out by hand: the median and the min, the spread (p80 - p20) / figure,
a phase whose figure is zero (its spread is 0, never a division by zero), a step whose kernels
outlast its window (``other`` is 0, never negative), one step, the lab trainer's own data,
optimizer and checkpoint ranges, and the refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lab_utils.core.config import ConfigError
from lab_utils.plan.from_trace import profile_from_trace
from lab_utils.plan.planner import ALL_PHASES
from lab_utils.traces import TraceAnalysis

from ..traces.kineto import Job, ann, op, step

FWD_US = [100.0, 200.0, 300.0, 400.0, 500.0]
STEP_US = [1000.0, 1000.0, 1000.0, 1000.0, 2000.0]


def five_steps(tmp_path):
    j, t = Job(), 0.0
    for s, (dur, fwd) in enumerate(zip(STEP_US, FWD_US)):
        j.add(step(s + 1, t, dur), ann("text_encoder", t + 10, 40), ann("## forward ##", t + 100, 300))
        j.gpu("t5_gemm", t + 20, t + 30, 50.0)  # launched in the encoder's range: text_encoding
        j.gpu("sm90_gemm", t + 110, t + 120, fwd)
        if s >= 3:  # a backward in the last two steps only: its median over five steps is 0
            j.add(ann("## backward ##", t + 500, 200))
            j.gpu("sm90_gemm_bwd", t + 510, t + 520, 250.0)
        j.add(ann("nccl:all_reduce", t + 800, 20))  # communication: no lever, its time stays in other
        j.gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL", t + 805, t + 810, 80.0, stream=9)
        j.gpu("void at::native::fill_kernel", t + 900, t + 905, 5.0)  # launched in no phase: other
        t += dur
    return j.write(tmp_path / "five.json")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return TraceAnalysis(five_steps(tmp_path_factory.mktemp("plan")), workers=1)


def q(v, p):
    """The linear-interpolation quantile, by hand: position p * (n - 1) between the sorted values."""
    v = sorted(v)
    pos = p * (len(v) - 1)
    i = int(math.floor(pos))
    return v[i] + (pos - i) * (v[min(i + 1, len(v) - 1)] - v[i])


def test_each_phase_per_step_and_its_median_and_spread_by_hand(trace):
    prof = profile_from_trace(trace)
    assert set(prof.phases) == set(prof.spread) == set(prof.phase_samples) == set(ALL_PHASES)
    assert prof.step_samples == pytest.approx((1.0, 1.0, 1.0, 1.0, 2.0))  # ms, the host-side step windows
    assert prof.phase_samples["forward"] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert prof.phase_samples["text_encoding"] == pytest.approx([0.05] * 5)  # the trace's encoders phase
    assert prof.phase_samples["backward"] == pytest.approx([0.0, 0.0, 0.0, 0.25, 0.25])
    # other: the step less forward, encoder and backward (the all-reduce and the fill are in it)
    other = [1.0 - 0.05 - 0.1, 1.0 - 0.05 - 0.2, 1.0 - 0.05 - 0.3, 1.0 - 0.05 - 0.4 - 0.25, 2.0 - 0.05 - 0.5 - 0.25]
    assert prof.phase_samples["other"] == pytest.approx(other)
    assert prof.phases["forward"] == pytest.approx(0.3) and prof.phases["text_encoding"] == pytest.approx(0.05)
    assert prof.phases["other"] == pytest.approx(0.75)  # sorted 0.30 0.65 0.75 0.85 1.20
    # p20 = 0.1 + 0.8 * 0.1 = 0.18, p80 = 0.4 + 0.2 * 0.1 = 0.42: (0.42 - 0.18) / 0.3
    assert prof.spread["forward"] == pytest.approx(0.8)
    assert prof.spread["other"] == pytest.approx((q(other, 0.8) - q(other, 0.2)) / 0.75)
    assert prof.spread["other"] == pytest.approx((0.92 - 0.58) / 0.75)
    assert prof.spread["text_encoding"] == 0.0  # the same every step
    assert sum(prof.phase_samples[p][4] for p in ALL_PHASES) == pytest.approx(2.0)  # the phases sum to the step
    assert prof.seams == {"trace": trace.path, "rank": 0}
    assert math.isnan(prof.flops) and math.isnan(prof.tokens) and math.isnan(prof.peak_mib)


def test_a_phase_whose_figure_is_zero_has_spread_zero(trace):
    prof = profile_from_trace(trace)
    # backward: 0, 0, 0, 0.25, 0.25 ms -> median 0, while p80 - p20 = 0.25: no relative spread of nothing
    assert prof.phases["backward"] == 0.0 and q([0, 0, 0, 0.25, 0.25], 0.8) - q([0, 0, 0, 0.25, 0.25], 0.2) == 0.25
    assert prof.spread["backward"] == 0.0
    # a phase the trace never names: zero every step, zero spread (not 0 / 0)
    for p in ("data_loading", "optimizer", "checkpoint", "image_encoding"):
        assert prof.phases[p] == 0.0 and prof.spread[p] == 0.0 and prof.phase_samples[p] == [0.0] * 5
    assert all(np.isfinite(v) for v in prof.spread.values())


def test_the_min_statistic_takes_each_phases_fastest_step(trace):
    prof = profile_from_trace(trace, statistic="min", flops=3e12, tokens=4096, peak_mib=512.0)
    assert prof.phases["forward"] == pytest.approx(0.1) and prof.phases["other"] == pytest.approx(0.30)
    assert prof.phases["backward"] == 0.0 and prof.spread["backward"] == 0.0
    assert prof.spread["forward"] == pytest.approx(0.24 / 0.1)  # the same p80 - p20 over the min
    assert (prof.flops, prof.tokens, prof.peak_mib) == (3e12, 4096.0, 512.0)


def test_one_step_and_kernels_that_outlast_the_step(tmp_path):
    j = Job()
    j.add(step(1, 0.0, 1000.0), ann("## forward ##", 0.0, 500.0))
    j.gpu("sm90_gemm", 10.0, 20.0, 1500.0)  # 1.5 ms of GPU work launched in a 1 ms step
    prof = profile_from_trace(j.write(tmp_path / "one.json"))
    assert prof.step_samples == (1.0,) and prof.phases["forward"] == pytest.approx(1.5)
    assert prof.phases["other"] == 0.0 and prof.phase_samples["other"] == [0.0]  # clipped, not -0.5
    assert prof.spread["forward"] == 0.0  # one sample: p20 = p80


def test_bad_input_is_refused_naming_the_parameter(trace, tmp_path):
    with pytest.raises(ConfigError, match="statistic"):
        profile_from_trace(trace, statistic="mean")
    with pytest.raises(ConfigError, match=r"rank.*\[0\]"):
        profile_from_trace(trace, rank=1)
    no_steps = Job().add(op("aten::mm", 0.0, 10.0)).write(tmp_path / "nosteps.json")
    with pytest.raises(ConfigError, match="ProfilerStep"):
        profile_from_trace(no_steps)


def test_the_lab_trainers_own_phase_names_map_to_the_planners_phases(tmp_path):
    """Two steps of 2 ms whose data, optimizer and checkpoint ranges are the lab trainer's own
    names, each launching one kernel of a known length (us): every planner phase by hand."""
    j, t = Job(), 0.0
    for s, (data, opt, ckpt) in enumerate([(100.0, 40.0, 0.0), (300.0, 60.0, 500.0)]):
        j.add(step(s + 1, t, 2000.0), ann("data_loading", t + 10, 150), ann("optimizer", t + 1000, 100))
        j.gpu("copy_kernel", t + 20, t + 30, data)
        j.gpu("multi_tensor_apply_kernel", t + 1010, t + 1020, opt)
        if ckpt:
            j.add(ann("checkpoint", t + 1500, 100))
            j.gpu("copy_d2h", t + 1510, t + 1520, ckpt)
        t += 2000.0
    prof = profile_from_trace(j.write(tmp_path / "lab.json"))
    assert prof.phase_samples["data_loading"] == pytest.approx([0.1, 0.3])
    assert prof.phase_samples["optimizer"] == pytest.approx([0.04, 0.06])
    assert prof.phase_samples["checkpoint"] == pytest.approx([0.0, 0.5])
    assert prof.phase_samples["other"] == pytest.approx([2.0 - 0.14, 2.0 - 0.86])
    assert prof.phases["data_loading"] == pytest.approx(0.2)  # the median of two: their mean
    assert prof.spread["data_loading"] == pytest.approx((0.26 - 0.14) / 0.2)  # p80 0.1 + 0.8 * 0.2, p20 0.1 + 0.2 * 0.2
    assert prof.phases["checkpoint"] == pytest.approx(0.25) and prof.phases["image_encoding"] == 0.0
    assert prof.step_samples == pytest.approx((2.0, 2.0)) and prof.stability
