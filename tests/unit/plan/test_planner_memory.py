"""The plan's peak memory: a lever's effect is its measured peak minus the base step's, a plan's
predicted peak the base's plus every lever's delta, and two measurements of one step keep the
smaller peak (on CPU the first run in a process carries one-time allocations)."""

import dataclasses

import pytest

from lab_utils.plan.planner import ALL_PHASES, StepProfile, compose, effect_of, merge_profiles


def profile(peak_mib: float, forward: float = 10.0) -> StepProfile:
    ph = dict.fromkeys(ALL_PHASES, 0.0) | {"forward": forward}
    return StepProfile(ph, dict.fromkeys(ph, 0.0), peak_mib, 2e12, 512.0)


def test_a_levers_peak_delta_and_the_plans_peak():
    base = profile(100.0)
    smaller = effect_of("attention_path", "math", base, profile(70.0, forward=8.0))
    larger = effect_of("num_workers", 2, base, profile(125.0))
    assert smaller.peak_delta_mib == -30.0 and larger.peak_delta_mib == 25.0
    assert compose(base, [smaller]).peak_mib == 70.0
    assert compose(base, [smaller, larger]).peak_mib == pytest.approx(95.0)


def test_merged_measurements_keep_the_smaller_peak():
    a, b = profile(120.0), profile(100.0)
    assert merge_profiles(a, b).peak_mib == 100.0
    assert merge_profiles(b, a).peak_mib == 100.0
    assert merge_profiles(a, dataclasses.replace(a, peak_mib=130.0), statistic="min").peak_mib == 120.0
