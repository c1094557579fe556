"""lab_utils.traces.launches: queue length against a count written here, and the host-bound and
launch-bound verdicts at each of their thresholds, on kernels laid out so that every figure is
known by construction (n kernels of K us, each launched in an L us call d us before it starts,
g us after the previous one ended); no idle time and an empty selection give shares of 0."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from lab_utils.traces.launches import SHORT_US, launch_stats, queue_lengths


def frame(ts, dur, launch, launch_dur=4.0, stream=7) -> pd.DataFrame:
    ts, dur = np.asarray(ts, dtype=float), np.asarray(dur, dtype=float)
    n = len(ts)
    return pd.DataFrame({"ts": ts, "dur": dur, "end": ts + dur, "launch_ts": np.asarray(launch, dtype=float),
                         "launch_dur": np.broadcast_to(np.asarray(launch_dur, dtype=float), (n,)).copy(),
                         "stream": np.broadcast_to(np.asarray(stream), (n,)).copy(),
                         "hta_type": "COMPUTATION"})  # fmt: skip


def one_by_one(n: int, K: float, L: float, g: float, d: float) -> pd.DataFrame:
    """Kernel i runs at i (K + g) for K us, launched d <= g us before it: nothing is ever queued."""
    ts = np.arange(n) * (K + g)
    return frame(ts, np.full(n, K), ts - d, L)


def test_queue_length_is_launched_before_minus_finished_per_stream(gen):
    rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    for _ in range(30):
        n = int(rng.integers(1, 15))
        launch = np.sort(rng.integers(0, 50, n)).astype(float)
        ts = launch + rng.integers(0, 30, n)
        dur = rng.integers(1, 10, n).astype(float)
        stream = rng.integers(0, 2, n)
        if n > 2:
            launch[int(rng.integers(0, n))] = np.nan  # no launch in the trace
        order = rng.permutation(n)  # rows in any order: a trace's table is not sorted by launch
        launch, ts, dur, stream = launch[order], ts[order], dur[order], stream[order]
        k = frame(ts, dur, launch, stream=stream)
        got = queue_lengths(k)
        for i in range(n):
            if np.isnan(launch[i]):
                assert np.isnan(got[i])
                continue
            same = (stream == stream[i]) & ~np.isnan(launch)
            before = int((same & (launch < launch[i])).sum())
            done = int((same & (ts + dur <= launch[i])).sum())
            assert got[i] == max(before - done, 0), (i, k)


def test_queue_length_counts_only_earlier_launches_still_running():
    k = frame([10, 12, 40], [20, 5, 5], [0, 1, 30])
    assert queue_lengths(k).tolist() == [0, 1, 0]  # the second is queued behind the first; the third after both
    touching = frame([0, 10], [10, 5], [0, 10])  # launched the instant the first ends: not queued
    assert queue_lengths(touching).tolist() == [0, 0]


def test_every_figure_of_a_launch_bound_job_by_hand():
    k = one_by_one(5, K=12.0, L=3.0, g=3.75, d=1.875)
    s = launch_stats(k)
    assert (s.activities, s.launched) == (5, 5)
    assert s.idle_share == pytest.approx(15 / 75)  # four gaps of 3.75 in a span of 5 x 12 + 15
    assert s.host_wait_share_of_idle == pytest.approx(0.5)  # each gap: 1.875 before the launch
    assert s.queue_delay_median_us == s.queue_delay_p90_us == pytest.approx(1.875)
    assert (s.queue_length_median, s.queue_length_max) == (0.0, 0.0)
    assert (s.launch_us, s.kernel_median_us, s.launch_gap_share) == (3.0, 12.0, 1.0)
    assert s.longest_host_wait_us == pytest.approx(1.875)
    assert s.short_share == 0.0
    # every threshold met exactly: idle 20%, host wait 50%, kernels 4 launches long
    assert s.host_bound and s.launch_bound, s.reason
    assert s.reason.startswith("launch-bound: idle 20% of the span, 50% of it waiting for the host, median queue 0")
    assert "kernels median 12 us against a 3 us launch, 100% of the wait between launches" in s.reason


@pytest.mark.parametrize(
    "change, fails",
    [
        (dict(g=3.5, d=1.75), "idle 19% of the span < 20%"),  # 14 / 74
        (dict(d=1.9), "host wait 49% of idle < 50%"),
    ],
)
def test_just_under_a_host_bound_threshold_is_not_host_bound(change, fails):
    args = dict(n=5, K=12.0, L=3.0, g=3.75, d=1.875) | change
    s = launch_stats(one_by_one(**args))
    assert not s.host_bound and not s.launch_bound
    assert s.reason == f"not launch-bound: {fails}", s.reason


def test_a_queue_over_one_is_not_host_bound():
    ts = np.array([0.0, 20.0, 40.0, 60.0, 80.0, 100.0])
    k = frame(ts, np.full(6, 10.0), [-10.0, 1.0, 2.0, 3.0, 4.0, 90.0])  # 1..4 launched while others wait
    s = launch_stats(k)
    assert s.queue_length_median == 1.5 and s.queue_length_max == 4.0  # queues 0, 1, 2, 3, 4, 0
    assert not s.host_bound and "median queue 1.5 > 1" in s.reason


def test_thresholds_are_parameters_and_a_queue_of_exactly_the_maximum_passes():
    k = one_by_one(5, K=12.0, L=3.0, g=3.75, d=1.875)
    assert not launch_stats(k, idle_min=0.21).host_bound
    assert not launch_stats(k, host_wait_min=0.51).host_bound
    assert launch_stats(k, queue_max=0.0).host_bound  # median queue 0 <= 0
    assert not launch_stats(k, kernel_launches=3.9).launch_bound
    assert launch_stats(k, kernel_launches=3.9).host_bound


def test_kernels_longer_than_four_launches_are_host_bound_not_launch_bound():
    s = launch_stats(one_by_one(5, K=12.0, L=2.9, g=3.75, d=1.875))
    assert s.host_bound and not s.launch_bound
    assert s.reason.startswith("host-bound, not launch-bound: idle 20% of the span")
    assert "its kernels are long: median 12 us against a 2.9 us launch (over 4 launches)" in s.reason


def test_a_gap_of_exactly_a_hundred_launches_is_a_stall():
    """L = 0.0625 us, gaps of 6.25 us = 100 launches: not shorter than 100 launches, so none of the host
    wait counts as waiting between launches."""
    s = launch_stats(one_by_one(4, K=0.25, L=0.0625, g=6.25, d=0.0))
    assert s.host_bound and s.kernel_median_us == 4 * s.launch_us
    assert s.launch_gap_share == 0.0 and not s.launch_bound
    assert "100% of the host wait is in stalls longer than 100 launches (the longest 0.00625 ms)" in s.reason
    shorter = launch_stats(one_by_one(4, K=0.25, L=0.0625, g=6.2, d=0.0))
    assert shorter.launch_gap_share == 1.0 and shorter.launch_bound


def test_a_launch_gap_share_of_exactly_half_is_launch_bound():
    """Gaps 10 -> 12 (2 us, under 100 launches of 1 us) and 22 -> 534 (a stall): host waits of 1 us in
    each give exactly half of the host wait between launches; 2 us in the stall, a third."""
    loose = dict(idle_min=0.0, host_wait_min=0.0, kernel_launches=10.0)
    half = launch_stats(frame([0.0, 12.0, 534.0], [10.0] * 3, [0.0, 11.0, 23.0], 1.0), **loose)
    assert half.launch_gap_share == pytest.approx(0.5) and half.launch_bound, half.reason
    third = launch_stats(frame([0.0, 12.0, 534.0], [10.0] * 3, [0.0, 11.0, 24.0], 1.0), **loose)
    assert third.launch_gap_share == pytest.approx(1 / 3) and third.host_bound and not third.launch_bound
    assert third.longest_host_wait_us == pytest.approx(2.0)


def test_short_share_queue_delay_percentile_and_activities_without_launch():
    ts = np.arange(10) * 100.0
    dur = np.array([SHORT_US, 9.99, 1, 50, 50, 50, 50, 50, 50, 50])
    launch = ts - np.arange(1, 11)  # delays 1 .. 10
    k = frame(ts, dur, launch)
    extra = frame([2000.0], [5.0], [np.nan])
    s = launch_stats(pd.concat([k, extra], ignore_index=True))
    assert (s.activities, s.launched) == (11, 10)
    assert s.short_share == pytest.approx(0.2)  # 9.99 and 1; exactly 10 us is not short
    assert s.queue_delay_median_us == pytest.approx(5.5)
    assert s.queue_delay_p90_us == pytest.approx(9.1)  # numpy's linear percentile: 9 + 0.1 x (10 - 9)


def test_no_launch_at_all_gives_no_verdict_figures():
    s = launch_stats(frame([0.0, 50.0], [10.0, 10.0], [np.nan, np.nan]))
    assert s.launched == 0 and np.isnan(s.short_share) and np.isnan(s.queue_delay_median_us)
    assert np.isnan(s.launch_us) and np.isnan(s.kernel_median_us) and np.isnan(s.queue_length_median)
    assert s.host_wait_share_of_idle == 0.0 and s.longest_host_wait_us == 0.0
    assert not s.host_bound and "host wait 0% of idle < 50%" in s.reason


def test_no_idle_time_is_no_host_wait():
    """Three kernels back to back (0 .. 30 us): no idle, so none of it is host wait."""
    s = launch_stats(frame([0.0, 10.0, 20.0], [10.0] * 3, [-5.0, -4.0, -3.0]))
    assert s.idle_share == 0.0 and s.host_wait_share_of_idle == 0.0 and s.longest_host_wait_us == 0.0
    assert s.reason == "not launch-bound: idle 0% of the span < 20%; host wait 0% of idle < 50%", s.reason


def test_an_empty_selection_gives_zero_shares_and_no_verdict():
    s = launch_stats(frame([], [], []))
    assert (s.activities, s.launched, s.idle_share, s.host_wait_share_of_idle) == (0, 0, 0.0, 0.0)
    assert not s.host_bound and not s.launch_bound and np.isnan(s.queue_length_median)
