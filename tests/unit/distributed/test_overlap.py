"""The projection's overlap model: exposed communication, its band and the dominant assumption (pure functions)."""

import pytest

from lab_utils.distributed.overlap import (
    OverlapRange,
    comm_range,
    dominant,
    exposed_band,
    exposed_comm,
    overlap_model,
    sensitivity,
)
from lab_utils.distributed.projection import project


def test_no_overlap_exposes_all_the_communication():
    assert exposed_comm(3.0, 10.0, 0.0) == 3.0
    assert exposed_comm(3.0, 0.5, 0.0) == 3.0


def test_full_overlap_hides_only_what_the_compute_covers():
    assert exposed_comm(3.0, 10.0, 1.0) == 0.0
    assert exposed_comm(3.0, 1.0, 1.0) == pytest.approx(2.0)  # 1 of compute hides 1 of the 3
    assert exposed_comm(3.0, 3.0, 1.0) == 0.0


def test_hand_computed_case_at_one_scale():
    # comm 2 s, compute 1.5 s, overlap 0.6: (1 - 0.6) * 2 = 0.8 > 2 - 1.5 = 0.5
    assert exposed_comm(2.0, 1.5, 0.6) == pytest.approx(0.8)
    # error 0.5: comm in [1, 4]; low: 1 * (1 - 0.9) = 0.1 (vs 1 - 1.5 < 0); high: max(0.8 * 4, 4 - 1.5) = 3.2
    ov = OverlapRange(0.6, 0.2, 0.9, "test")
    assert comm_range(2.0, 0.5) == pytest.approx((1.0, 4.0))
    assert exposed_band(2.0, 1.5, ov, 0.5) == pytest.approx((0.1, 3.2))


def test_projection_row_follows_the_model():
    m = overlap_model([("fsdp", 0.5), ("fsdp/bf16", 0.7)])
    assert m.for_strategy("fsdp") == OverlapRange(pytest.approx(0.6), 0.5, 0.7, "measured (2 ranks)")
    df = project(gpus=(64,), overlap=m, comm_rel_err=0.5)
    r = df[df.strategy == "fsdp"].iloc[0]
    assert r.overlap == pytest.approx(0.6)
    want = max(0.4 * r.comm_ms, r.comm_ms - r.compute_ms)
    assert r.exposed_ms == pytest.approx(want) and r.exposed_ms > 0
    assert r.step_ms == pytest.approx(r.compute_ms + want)
    assert r.exposed_lo_ms <= r.exposed_ms <= r.exposed_hi_ms and r.step_lo_ms <= r.step_ms <= r.step_hi_ms
    other = df[df.strategy == "fsdp+tp"].iloc[0]  # not measured: the median of the measured, named as such
    assert other.overlap_source == "median of the measured strategies"


def test_nothing_measured_uses_the_stated_default():
    m = overlap_model([])
    assert m.for_strategy("ddp").point == 0.5 and "stated" in m.for_strategy("ddp").source


@pytest.mark.parametrize("err", [0.0, 0.2, 0.5, 0.8])
def test_band_contains_the_point_and_widens_with_the_error(err):
    ov = OverlapRange(0.6, 0.4, 0.8, "test")
    lo, hi = exposed_band(2.0, 1.5, ov, err)
    assert lo <= exposed_comm(2.0, 1.5, 0.6) <= hi
    lo2, hi2 = exposed_band(2.0, 1.5, ov, err + 0.1)
    assert lo2 <= lo and hi2 >= hi and (hi2 - lo2) > (hi - lo)


def test_dominant_assumption_is_the_one_a_hand_sensitivity_picks():
    # compute 1, comm 0.5, overlap 0.5 in [0, 1], comm error 0.1, compute error 0.25
    ov = OverlapRange(0.5, 0.0, 1.0, "test")
    s = sensitivity(1.0, 0.5, ov, 0.1, 0.25)
    # overlap: step 1.5 at 0 vs 1.0 at 1 -> 0.5; bandwidth: comm in [0.45, 0.5/0.9], half exposed;
    # compute: 1.25 + 0.25 - (0.75 + 0.25) = 0.5 (the exposed 0.25 is the same at both ends)
    assert s["overlap"] == pytest.approx(0.5)
    assert s["bandwidth"] == pytest.approx(0.5 * (0.5 / 0.9 - 0.45))
    assert s["compute"] == pytest.approx(0.5)
    assert dominant({"overlap": 0.1, "bandwidth": 0.3, "compute": 0.2}) == "bandwidth"
    # a large comm error on a comm-bound step: bandwidth dominates
    s2 = sensitivity(0.1, 2.0, OverlapRange(0.5, 0.4, 0.6, "t"), 0.8, 0.25)
    # overlap: max(0.4 * 2, 1.9) = max(0.6 * 2, 1.9) -> 0; bandwidth: comm in [0.4, 10] -> steps 10.0 and 0.4
    assert s2["overlap"] == pytest.approx(0.0)
    assert s2["bandwidth"] == pytest.approx((10.0 - 0.1) - max(0.2, 0.4 - 0.1))
    assert dominant(s2) == "bandwidth"


def test_a_measured_overlap_is_the_mean_of_its_runs():
    """Three runs of fsdp at 0.2, 0.3 and 1.0: the point is their mean 0.5 (the median would be
    0.3), the range 0.2..1.0; the unmeasured default is the median of all runs."""
    m = overlap_model([("fsdp", 0.2), ("fsdp/bf16", 0.3), ("fsdp", 1.0), ("ddp", 0.9)])
    assert m.for_strategy("fsdp") == OverlapRange(pytest.approx(0.5), 0.2, 1.0, "measured (3 ranks)")
    assert m.for_strategy("fsdp+tp").point == pytest.approx(0.6)  # median of 0.2, 0.3, 0.9, 1.0
