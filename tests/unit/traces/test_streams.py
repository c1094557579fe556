"""lab_utils.traces.streams: idle per stream in HolisticTraceAnalysis's three kinds and the launch
outliers, against a loop over the activities written here (drawn fresh per run) and at the
thresholds themselves (a gap of exactly 30 us, a 50 us launch call, a 100 us delay); the idle table
has one row per stream in stream order."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from lab_utils.traces.streams import KERNEL_WAIT_US, LAUNCH_CALLS, launch_outliers, stream_idle


def frame(rows) -> pd.DataFrame:
    """rows: (stream, ts, dur, launch_ts, launch_dur[, launch_name])."""
    out = [{"stream": s, "ts": float(ts), "dur": float(d), "end": float(ts + d), "launch_ts": float(lt),
            "launch_dur": float(ld), "launch_name": r[5] if len(r) > 5 else "cudaLaunchKernel",
            "name": f"k{i}", "op": f"aten::op{i}", "step": 1}
           for i, r in enumerate(rows) for s, ts, d, lt, ld in [r[:5]]]  # fmt: skip
    return pd.DataFrame(out)


def idle_by_loop(k: pd.DataFrame, wait_us: float) -> dict[int, dict[str, float]]:
    out = {}
    for s in sorted(set(k["stream"])):
        rows = sorted([r for r in k.itertuples() if r.stream == s], key=lambda r: r.ts)
        acc = dict.fromkeys(("host_wait", "kernel_wait", "other"), 0.0)
        for prev, cur in zip(rows, rows[1:]):
            gap = cur.ts - prev.end
            if not math.isnan(cur.launch_ts) and cur.launch_ts > prev.end:
                acc["host_wait"] += gap
            elif gap < wait_us:
                acc["kernel_wait"] += gap
            else:
                acc["other"] += gap
        out[int(s)] = acc | {"activities": len(rows)}
    return out


def test_idle_per_stream_equals_a_loop_over_the_gaps(gen):
    rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    for _ in range(30):
        rows, t = [], {0: 0.0, 3: 0.0}
        for _ in range(int(rng.integers(1, 14))):
            s = int(rng.choice([0, 3]))
            ts = t[s] + float(rng.integers(0, 60))
            lt = ts - float(rng.integers(0, 80)) if rng.random() < 0.85 else np.nan
            rows.append((s, ts, float(rng.integers(1, 20)), lt, 4.0))
            t[s] = ts + rows[-1][2]
        k = frame(rows)
        got = stream_idle(k).set_index("stream")
        want = idle_by_loop(k, KERNEL_WAIT_US)
        assert sorted(got.index) == sorted(want)
        for s, w in want.items():
            row = got.loc[s]
            idle = w["host_wait"] + w["kernel_wait"] + w["other"]
            assert row["activities"] == w["activities"]
            for kind in ("host_wait", "kernel_wait", "other"):
                assert row[kind] == pytest.approx(w[kind]), (s, kind, k)
                assert row[f"{kind}_pct"] == pytest.approx(100 * w[kind] / idle if idle else 0.0)
            assert row["idle"] == pytest.approx(idle)


def test_the_three_kinds_at_their_boundaries():
    k = frame([(7, 0, 10, 0, 4),  # first: no gap before it
               (7, 40, 10, 10, 4),  # launched at 10 = the previous end: queued; gap 30 = the limit: other
               (7, 79.5, 10, 40, 4),  # gap 29.5 under the limit, launched before the gap: kernel wait
               (7, 200, 10, 90, 4),  # launched 90 > 89.5: host wait 110.5
               (7, 215, 10, np.nan, 4)])  # fmt: skip
    row = stream_idle(k).iloc[0]
    assert (row["host_wait"], row["kernel_wait"], row["other"]) == (110.5, 29.5 + 5.0, 30.0)
    assert row["idle"] == 175.0 and row["activities"] == 5
    assert row["host_wait_pct"] == pytest.approx(100 * 110.5 / 175)
    assert stream_idle(k, kernel_wait_us=30.5).iloc[0]["kernel_wait"] == 64.5  # the 30 us gap now under it
    lone = stream_idle(frame([(2, 0, 10, 0, 4)])).iloc[0]
    assert lone["idle"] == 0.0 and lone["host_wait_pct"] == 0.0 and lone["stream"] == 2
    assert stream_idle(frame([(2, 0, 10, 0, 4)]).iloc[:0]).empty


def test_launch_outliers_at_their_cutoffs():
    k = frame([(7, 100, 5, 0, 50),  # call 50 us (= cutoff: no outlier); delay 100 - 50 = 50
               (7, 300, 60, 150, 50.5),  # a slow call; its delay 99.5
               (7, 500, 5, 300, 100),  # call 100 (slow), delay 100: slow call named first
               (7, 700, 5, 560, 39),  # delay 101: long delay; 5 < 39: shorter than its call
               (7, 800, 10, 795, 10),  # queued: delay clipped at 0; as long as its call: not shorter
               (7, 900, 20, 800, 10, "cudaGraphLaunch"),  # not a launch call: left out
               (7, 950, 20, np.nan, 10)])  # fmt: skip
    lo = launch_outliers(k)
    assert lo.launches == 5
    assert lo.table["delay_us"].tolist() == [50.0, 99.5, 100.0, 101.0, 0.0]
    assert lo.table["outlier"].tolist() == ["", "slow launch call", "slow launch call", "long launch delay", ""]
    assert (lo.runtime_outliers, lo.delay_outliers, lo.gpu_shorter_than_cpu) == (2, 1, 3)
    assert lo.cpu_us == pytest.approx(50 + 50.5 + 100 + 39 + 10) and lo.gpu_us == pytest.approx(85.0)
    assert lo.delay_us == pytest.approx(350.5)
    assert lo.table["name"].tolist() == ["k0", "k1", "k2", "k3", "k4"] and lo.table["op"].tolist()[0] == "aten::op0"
    tight = launch_outliers(k, runtime_cutoff_us=200.0, delay_cutoff_us=99.0)
    assert (tight.runtime_outliers, tight.delay_outliers) == (0, 3)
    assert set(LAUNCH_CALLS) >= {"cudaLaunchKernel", "cudaMemcpyAsync", "hipLaunchKernel"}
    empty = launch_outliers(k.iloc[:0])
    assert empty.launches == 0 and empty.cpu_us == 0.0 and empty.table.empty


def test_one_row_per_stream_in_stream_order_whatever_order_the_activities_come_in():
    """Stream 9's activities come first in the table, stream 2's after: the rows are 2 then 9, each
    with its own gap (5 us on 2, 12 us on 9)."""
    k = frame([(9, 0, 10, 0, 4), (9, 22, 10, 0, 4), (2, 3, 10, 0, 4), (2, 18, 10, 0, 4)])
    got = stream_idle(k)
    assert got["stream"].tolist() == [2, 9]
    assert got["kernel_wait"].tolist() == [5.0, 12.0]
