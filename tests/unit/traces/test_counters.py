"""lab_utils.traces.counters: the launch queue per stream against a step function counted here from the
launches and starts (drawn fresh per run), its summary's time-weighted mean by hand, and the GB/s in
flight of copies and fills (Kineto's recorded bandwidth first, else bytes over duration; a 0 us fill;
a copy with neither left out; a rounding residue not counted); every launch call queues work; a
window binned into bins whose edges and maxima are counted here, at the cap itself and the default."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from lab_utils.traces.counters import (
    MAX_QUEUE,
    in_window,
    memory_bw_series,
    memory_bw_summary,
    memory_kind,
    queue_series,
    queue_summary,
)


def launched(rows) -> pd.DataFrame:
    """rows: (stream, launch_ts, ts[, launch_name])."""
    return pd.DataFrame({"stream": [r[0] for r in rows], "launch_ts": [float(r[1]) for r in rows],
                         "ts": [float(r[2]) for r in rows],
                         "launch_name": [r[3] if len(r) > 3 else "cudaLaunchKernel" for r in rows]})  # fmt: skip


def test_the_queue_is_launches_minus_starts_at_every_change(gen):
    rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    for _ in range(30):
        rows = []
        for _ in range(int(rng.integers(1, 12))):
            lt = int(rng.integers(0, 40))
            rows.append((int(rng.choice([7, 9])), lt, lt + int(rng.integers(0, 20))))
        s = queue_series(launched(rows))
        for stream in {r[0] for r in rows}:
            mine = s[s["stream"] == stream]
            for t in mine["ts"]:  # each change point: the value from then on
                want = sum(r[1] <= t for r in rows if r[0] == stream) - sum(r[2] <= t for r in rows if r[0] == stream)
                at_t = mine[mine["ts"] == t]["queue_length"].iloc[-1]
                assert at_t == want, (rows, stream, t)
            assert len(mine) == 2 * sum(r[0] == stream for r in rows)
            assert mine["queue_length"].iloc[-1] == 0


def test_a_launch_and_a_start_at_one_instant_rise_before_they_fall():
    s = queue_series(launched([(7, 0, 10), (7, 10, 10)]))
    assert s["queue_length"].tolist() == [1, 2, 1, 0]  # at 10: the second launch counts before both starts
    assert queue_series(launched([(7, 0, 5, "cudaGraphLaunch")])).empty  # not a launch call
    assert list(queue_series(launched([(7, 0, 5)]).iloc[:0]).columns) == ["ts", "stream", "queue_length"]


def test_the_queue_summary_by_hand():
    """Queue 1 from 10 to 20, 2 to 25, 1 to 40, 0 after: time-weighted mean (10 + 10 + 15) / 30."""
    series = pd.DataFrame({"ts": [10.0, 20.0, 25.0, 40.0], "stream": 7, "queue_length": [1, 2, 1, 0]})
    row = queue_summary(series).iloc[0]
    assert (row["stream"], row["count"], row["mean"], row["max"]) == (7, 4, 1.0, 2.0)
    assert row["time_mean"] == pytest.approx(35 / 30)
    assert row["at_max_us"] == 0.0
    full = queue_summary(series, max_queue=2).iloc[0]
    assert full["at_max_us"] == 5.0  # queue 2 held from 20 to 25
    assert queue_summary(series, max_queue=1).iloc[0]["at_max_us"] == 30.0 and MAX_QUEUE == 1024
    one = queue_summary(series.iloc[:1]).iloc[0]
    assert one["time_mean"] == 1.0 and one["at_max_us"] == 0.0  # one point: its value


@pytest.mark.parametrize(
    "name, kind",
    [("Memcpy HtoD (Pageable -> Device)", "Memcpy HtoD"), ("Memcpy DtoD (Device -> Device)", "Memcpy DtoD"),
     ("Memset (Device)", "Memset"), ("cudaMemcpy", "Memcpy Unknown"), ("Memcpy", "Memcpy")],
)  # fmt: skip
def test_memory_kind(name, kind):
    assert memory_kind(name) == kind


def test_gbps_in_flight_recorded_first_else_bytes_over_duration():
    m = pd.DataFrame({"name": ["Memcpy HtoD (Pageable -> Device)", "Memcpy HtoD (Pinned -> Device)",
                               "Memset (Device)", "Memset (Device)", "gemm"],
                      "hta_type": ["MEMORY", "MEMORY", "MEMORY", "MEMORY", "COMPUTATION"],
                      "ts": [0.0, 5.0, 100.0, 200.0, 0.0], "dur": [10.0, 10.0, 4.0, 0.0, 50.0],
                      "nbytes": [20_000.0, 1e6, 4_000.0, 3_000.0, np.nan],
                      "memory_gbps": [np.nan, 25.0, np.nan, np.nan, np.nan]})  # fmt: skip
    s = memory_bw_series(m)
    assert list(s.columns) == ["ts", "kind", "gbps"]
    h = s[s["kind"] == "Memcpy HtoD"]
    assert h["ts"].tolist() == [0.0, 5.0, 10.0, 15.0]
    assert h["gbps"].tolist() == pytest.approx([2.0, 27.0, 25.0, 0.0])  # 20 kB / 10 us = 2 GB/s; then Kineto's 25
    ms = s[s["kind"] == "Memset"]
    assert ms["ts"].tolist() == [100.0, 104.0, 200.0, 201.0]  # a 0 us fill counts as 1 us
    assert ms["gbps"].tolist() == pytest.approx([1.0, 0.0, 3.0, 0.0])
    summ = memory_bw_summary(s).set_index("kind")
    assert summ.loc["Memcpy HtoD", "count"] == 3 and summ.loc["Memcpy HtoD", "max"] == pytest.approx(27.0)
    assert summ.loc["Memset", "mean"] == pytest.approx(2.0)
    assert memory_bw_series(m.drop(columns="nbytes")).empty
    assert memory_bw_series(m[m["hta_type"] != "MEMORY"]).empty


def value_at(t: np.ndarray, v: np.ndarray, x: float) -> float:
    """The step function (each value holding until the next change) at ``x``; NaN before its first change."""
    i = np.searchsorted(t, x, side="right") - 1
    return float(v[i]) if i >= 0 else float("nan")


def test_a_series_on_a_window_holds_the_same_values_and_keeps_every_peak(gen):
    """Inside the window the clipped series is the same step function (checked at every change and
    between them); the value holding at the window's start opens it; past ``max_points`` each bin
    holds the largest value of its changes, so the series' maximum inside is kept."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    for _ in range(20):
        n = int(rng.integers(1, 60))
        t = np.sort(rng.choice(np.arange(0, 1000), n, replace=False)).astype(float)
        v = rng.integers(0, 9, n).astype(float)
        lo, hi = float(rng.integers(0, 500)), float(rng.integers(500, 1100))
        series = pd.DataFrame({"ts": t, "stream": 7, "queue_length": v})
        got = in_window(series, "stream", "queue_length", lo, hi, max_points=10_000)
        gt, gv = got["ts"].to_numpy(), got["queue_length"].to_numpy()
        assert (gt >= lo).all() and (gt <= hi).all() and (np.diff(gt) > 0).all()
        for x in np.concatenate([t[(t > lo) & (t <= hi)], np.linspace(lo, hi, 37)]):
            want = value_at(t, v, x)
            if np.isnan(want):
                assert not len(gt) or x < gt[0]
            else:
                assert value_at(gt, gv, x) == want, (x, lo, hi)
        few = in_window(series, "stream", "queue_length", lo, hi, max_points=4)
        if len(got) <= 4:
            assert few.equals(got)
        else:
            assert len(few) <= 4 and few["queue_length"].max() == gv.max()
            assert (few["ts"] >= lo).all() and (few["ts"] <= hi).all()


def test_a_window_without_a_change_before_it_starts_at_the_first_change_and_keys_stay_apart():
    series = pd.DataFrame({"ts": [5.0, 8.0, 2.0, 20.0], "kind": ["a", "a", "b", "b"], "gbps": [1.0, 0.0, 3.0, 0.0]})
    got = in_window(series.sort_values("ts", kind="stable"), "kind", "gbps", 3.0, 10.0)
    assert got.to_dict("list") == {"ts": [5.0, 8.0, 3.0], "kind": ["a", "a", "b"], "gbps": [1.0, 0.0, 3.0]}
    assert in_window(series.iloc[:0], "kind", "gbps", 3.0, 10.0).empty


def test_a_long_window_is_binned_into_max_points_bins_of_known_edges():
    """Changes at every integer 990..1100 except 1030..1049, a window [1000, 1100] cut into 10 bins
    of 10 us: one point per bin holding a change, at the bin's left edge, with the largest value of
    the bin's changes (the value holding at 1000 opens bin 0; the change at 1100 itself falls in the
    last bin); bins 3 and 4 hold no change and give no point."""
    t = np.array([x for x in range(990, 1101) if not 1030 <= x < 1050], dtype=float)
    v = (t * 7) % 11
    val = dict(zip(t.tolist(), v.tolist()))
    series = pd.DataFrame({"ts": t, "kind": "Memset", "gbps": v})
    got = in_window(series, "kind", "gbps", 1000.0, 1100.0, max_points=10)
    want_ts, want_v = [], []
    for b in range(10):
        members = [x for x in range(1000 + 10 * b, 1010 + 10 * b) if x in val] + ([1100] if b == 9 else [])
        if members:
            want_ts.append(1000.0 + 10 * b)
            want_v.append(max(val[x] for x in members))
    assert got["ts"].tolist() == want_ts and want_ts[3] == 1050.0
    assert got["gbps"].tolist() == want_v and (got["kind"] == "Memset").all()
    # 81 points: at a cap of 81 every change is kept as it is; at 80 the window is binned
    kept = in_window(series, "kind", "gbps", 1000.0, 1100.0, max_points=81)
    assert kept["ts"].tolist() == [x for x in t.tolist() if x >= 1000] and len(kept) == 81
    assert len(in_window(series, "kind", "gbps", 1000.0, 1100.0, max_points=80)) < 80


def test_the_default_cap_is_2000_points_per_key():
    t = np.arange(0, 4001, dtype=float)  # 4001 changes on [0, 4000]: two per 2 us bin, three in the last
    series = pd.DataFrame({"ts": np.r_[t, t], "stream": np.r_[np.full(4001, 7), np.full(4001, 9)],
                           "queue_length": np.r_[t % 5, t % 3]})  # fmt: skip
    got = in_window(series, "stream", "queue_length", 0.0, 4000.0)
    for stream, top in ((7, 4), (9, 2)):
        mine = got[got["stream"] == stream]
        assert mine["ts"].tolist() == np.arange(0, 4000, 2, dtype=float).tolist()
        assert mine["queue_length"].max() == top
    assert in_window(series, "stream", "queue_length", 0.0, 4000.0, max_points=4001)["ts"].nunique() == 4001


@pytest.mark.parametrize("call", ["cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaMemcpyAsync",
                                  "cudaMemsetAsync", "hipLaunchKernel"])  # fmt: skip
def test_every_launch_call_queues_work_and_other_calls_do_not(call):
    k = launched([(7, 0, 10, call), (7, 2, 12, "cudaGraphLaunch"), (7, 4, 20, "cudaMemcpy")])
    k.loc[len(k)] = {"stream": 7, "launch_ts": np.nan, "ts": 30.0, "launch_name": call}  # no launch in the trace
    s = queue_series(k)
    assert s["ts"].tolist() == [0.0, 10.0] and s["queue_length"].tolist() == [1, 0]


def test_queue_summary_streams_apart_sorted_and_at_max_counts_the_threshold_itself():
    """Stream 9: three launches at 0 (queue 3 for 10 us, 2 for 10 us, 1 for 10 us); stream 7: one
    kernel queued 0..4.  At max_queue 2: 20 us on stream 9, none on 7; time-weighted means by hand."""
    s = queue_series(launched([(9, 0, 10), (9, 0, 20), (9, 0, 30), (7, 0, 4)]))
    q = queue_summary(s, max_queue=2)
    assert q["stream"].tolist() == [7, 9]
    r9 = q.set_index("stream").loc[9]
    assert (r9["count"], r9["max"], r9["at_max_us"]) == (6, 3.0, 20.0)  # 1, 2, 3 at 0, then 2, 1, 0
    assert r9["time_mean"] == pytest.approx((3 * 10 + 2 * 10 + 1 * 10) / 30)
    r7 = q.set_index("stream").loc[7]
    assert (r7["time_mean"], r7["at_max_us"], r7["mean"]) == (1.0, 0.0, 0.5)
    assert queue_summary(s.iloc[:0]).empty


def test_a_copy_without_a_figure_is_left_out_and_rounding_leaves_no_phantom_bandwidth():
    """A DtoH copy with neither bytes nor a recorded bandwidth adds nothing (it does not turn the
    kind's series into NaN); three overlapping copies of 0.1, 0.2 and 0.6 GB/s leave a float residue
    after they end, which is not a point above 0 in the summary."""
    m = pd.DataFrame({"name": ["Memcpy DtoH (Device -> Pinned)"] * 2 + ["Memcpy DtoD (Device -> Device)"] * 3,
                      "hta_type": "MEMORY", "ts": [0.0, 2.0, 0.0, 1.0, 2.0], "dur": [10.0, 4.0, 5.0, 7.0, 4.0],
                      "nbytes": [np.nan, 8_000.0, np.nan, np.nan, np.nan],
                      "memory_gbps": [np.nan, np.nan, 0.1, 0.2, 0.6]})  # fmt: skip
    s = memory_bw_series(m)
    d2h = s[s["kind"] == "Memcpy DtoH"]
    assert d2h["ts"].tolist() == [2.0, 6.0] and d2h["gbps"].tolist() == pytest.approx([2.0, 0.0])
    d2d = s[s["kind"] == "Memcpy DtoD"]
    assert d2d["gbps"].tolist() == pytest.approx([0.1, 0.3, 0.9, 0.8, 0.2, 0.0])
    assert d2d["ts"].tolist() == [0.0, 1.0, 2.0, 5.0, 6.0, 8.0]
    assert d2d["gbps"].iloc[-1] > 0  # a residue of about 1e-16 GB/s is there, and left out below
    summ = memory_bw_summary(s).set_index("kind")
    assert summ.loc["Memcpy DtoD", "count"] == 5 and summ.loc["Memcpy DtoH", "count"] == 1
    assert summ.loc["Memcpy DtoD", "max"] == pytest.approx(0.9)
    assert summ.loc["Memcpy DtoD", "mean"] == pytest.approx((0.1 + 0.3 + 0.9 + 0.8 + 0.2) / 5)
