"""The call-tree breakdown, repeated kernel sequences, idle per stream, launch outliers and the
queue/bandwidth series, each on a hand-built Kineto trace whose answer is known by construction
(their agreement with HolisticTraceAnalysis where it has them: tests/unit/traces/test_counters_hta.py)."""

from __future__ import annotations

import pytest

from lab_utils.core.config import ConfigError
from lab_utils.traces import TraceAnalysis
from lab_utils.traces.counters import memory_bw_series, memory_bw_summary, queue_series, queue_summary
from lab_utils.traces.sequences import frequent_sequences, short_name
from unit.traces.test_collectives import ann, kernel, launch, op, step, write


def module(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "python_function", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def analysed(tmp_path, events):
    return TraceAnalysis(write(tmp_path / "t.json", events), workers=1)


def block(t, ext, corr):
    """``nn.Module: Block`` (t .. t+180): aten::linear > aten::addmm launching a 100 us GEMM, then
    aten::gelu launching a 20 us kernel."""
    return [
        module("nn.Module: Block", t, 180),
        op("aten::linear", t + 10, 70, ext),
        op("aten::addmm", t + 15, 60, ext + 1),
        launch(corr, t + 20, ext=ext + 1),
        kernel("sm80_xmma_gemm", corr, t + 600, 100, ext=ext + 1),
        op("aten::gelu", t + 90, 40, ext + 2),
        launch(corr + 1, t + 95, ext=ext + 2),
        kernel("vectorized_elementwise_kernel<gelu>", corr + 1, t + 710, 20, ext=ext + 2),
    ]


def tree_trace():
    ev = [step(1, 0, 1000), ann("## forward ##", 10, 400)] + block(20, 11, 1) + block(210, 21, 3)
    ev += [ann("## backward ##", 450, 450)]  # the backward thread's work runs inside it, on thread 2
    ev += [op("autograd::engine::evaluate_function: AddmmBackward0", 500, 100, 30, tid=2),
           op("aten::mm", 510, 80, 31, tid=2), launch(5, 520, tid=2, ext=31),
           kernel("sm80_xmma_gemm_bwd", 5, 1100, 150, ext=31)]  # fmt: skip
    ev += [launch(6, 950, ext=99), kernel("Memset (Device)", 6, 1300, 5, cat="gpu_memset", ext=99)]
    ev += [kernel("orphan_kernel", 77, 1400, 7, ext=77)]  # no launch in the trace
    return ev


def test_gpu_time_adds_up_the_call_tree(tmp_path):
    """Known tree: two same-named blocks add up (count 2); the backward thread's operators hang
    under ## backward ##; a launch outside any operator stays under the step; a kernel without a
    launch goes to (no host event)."""
    ta = analysed(tmp_path, tree_trace())
    t = ta.hierarchy(0, scope="all").set_index("path")
    S, F, B = "ProfilerStep", "ProfilerStep > ## forward ##", "ProfilerStep > ## backward ##"
    blk = f"{F} > nn.Module: Block"
    want = {  # path: (count, total, self)
        S: (1, 395, 5),
        F: (1, 240, 0),
        blk: (2, 240, 0),
        f"{blk} > aten::linear": (2, 200, 0),
        f"{blk} > aten::linear > aten::addmm": (2, 200, 200),
        f"{blk} > aten::linear > aten::addmm > sm80_xmma_gemm": (2, 200, 200),
        f"{blk} > aten::gelu": (2, 40, 40),
        B: (1, 150, 0),
        f"{B} > autograd::engine::evaluate_function: AddmmBackward0 > aten::mm": (1, 150, 150),
        f"{S} > Memset (Device)": (1, 5, 5),
        "(no host event)": (1, 7, 7),
        "(no host event) > orphan_kernel": (1, 7, 7),
    }
    for path, (count, total, self_us) in want.items():
        row = t.loc[path]
        assert (row["count"], row["gpu_total_us"], row["gpu_self_us"]) == (count, total, self_us), path
    assert (t.loc[blk, "kind"], t.loc[F, "kind"], t.loc[f"{blk} > aten::gelu", "kind"]) == ("module", "range", "op")
    assert t.loc[blk, "kernels"] == 4 and t.loc[blk, "cpu_us"] == 360  # two blocks of 180 us
    assert t.loc[S, "gpu_pct"] == pytest.approx(100 * 395 / 402)
    # invariants: a row's total is its children's (kernels are leaf rows), its self its kernel
    # leaves'; the top rows add up to all the kernel time
    df = t.reset_index()
    for row in df[df["kind"] != "kernel"].itertuples():
        kids = df[df["parent"] == row.path]
        assert row.gpu_total_us == pytest.approx(kids["gpu_total_us"].sum()), row.path
        assert row.gpu_self_us == pytest.approx(kids[kids["kind"] == "kernel"]["gpu_total_us"].sum()), row.path
    assert df[df["depth"] == 0]["gpu_total_us"].sum() == pytest.approx(402)
    assert list(df["path"][:3]) == [S, F, blk]  # depth first, largest first


def test_the_steps_scope_leaves_the_unlaunched_kernel_out(tmp_path):
    t = analysed(tmp_path, tree_trace()).hierarchy(0).set_index("path")
    assert "(no host event)" not in t.index and t.loc["ProfilerStep", "gpu_pct"] == pytest.approx(100)


def seq_trace():
    """Step 1, stream 7: A B C six times, each followed by a different kernel X1..X6, then A B C once
    on stream 20; step 2, stream 7: R five times in a row."""
    ev, t, c = [step(1, 0, 10_000), step(2, 10_000, 10_000)], 10, 1
    for i in range(6):
        for name, d in (("A", 10), ("B", 20), ("C", 30), (f"X{i}", 5)):
            ev += [launch(c, t - 5), kernel(name, c, t, d)]
            t, c = t + d + 2, c + 1
    for name, d in (("A", 10), ("B", 20), ("C", 30)):
        ev += [launch(c, t), kernel(name, c, t + 1, d, stream=20)]
        t, c = t + d + 4, c + 1
    t = 10_100
    for _ in range(5):
        ev += [launch(c, t - 5), kernel("R", c, t, 7)]
        t, c = t + 8, c + 1
    return ev


def test_repeated_kernel_sequences_by_hand(tmp_path):
    """A → B → C: 7 occurrences (6 + 1 on stream 20), 60 us of kernels each, two gaps (2 us on
    stream 7, 4 us on 20) inside each; A → B and B → C occur as often, so they are left out; the run
    of five R's is one row, R → R, twice (non-overlapping), and R → R → R (a repeat) is left out."""
    ta = analysed(tmp_path, seq_trace())
    sq = ta.sequences(0)
    assert list(sq["pattern"]) == ["A → B → C", "R → R"]
    abc = sq.iloc[0]
    assert (abc["count"], abc["length"]) == (7, 3)
    assert abc["total_us"] == pytest.approx(7 * 60) and abc["mean_us"] == pytest.approx(60)
    assert abc["gap_us"] == pytest.approx(6 * 2 * 2 + 2 * 4)
    assert abc["categories"].count("→") == 2
    rr = sq.iloc[1]
    assert (rr["count"], rr["total_us"]) == (2, 28)
    assert list(frequent_sequences(ta.kernels(0), min_count=7)["pattern"]) == ["A → B → C"]
    assert frequent_sequences(ta.kernels(0), min_count=8).empty
    longer = frequent_sequences(ta.kernels(0), min_len=4)
    assert list(longer["pattern"]) == []  # nothing of 4 kernels repeats (X1..X6 differ)


@pytest.mark.parametrize("kw,param", [({"min_count": 1}, "min_count"), ({"min_len": 3, "max_len": 2}, "max_len"),
                                      ({"min_len": 0}, "min_len")])  # fmt: skip
def test_sequence_options_are_checked_by_name(tmp_path, kw, param):
    ta = analysed(tmp_path, seq_trace())
    with pytest.raises(ConfigError, match=param):
        ta.sequences(0, **kw)


def test_short_names():
    assert short_name("void at::native::vectorized_elementwise_kernel<4, at::native::X>(int, float)") == (
        "at::native::vectorized_elementwise_kernel"
    )
    assert short_name("sm80_xmma_gemm") == "sm80_xmma_gemm"
    assert short_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"


def test_idle_per_stream_three_kinds_at_their_boundary(tmp_path):
    """K1 0-10; K2 queued at 5, starts 40: a 30 us gap, not under the 30 us threshold: other; K3
    queued at 39, starts 69.9 after K2's end at 50: 19.9 us of kernel wait; K4 launched at 100 after
    K3's end (79.9), starts 110: 30.1 us of host wait."""
    ev = [step(1, 0, 500), launch(1, 0), kernel("K1", 1, 0, 10), launch(2, 5), kernel("K2", 2, 40, 10)]
    ev += [launch(3, 39), kernel("K3", 3, 69.9, 10), launch(4, 100), kernel("K4", 4, 110, 10)]
    si = analysed(tmp_path, ev).stream_idle().set_index("stream").loc[7]
    assert (si["other"], si["kernel_wait"], si["host_wait"]) == pytest.approx((30.0, 19.9, 30.1))
    assert si["idle"] == pytest.approx(80.0) and si["activities"] == 4
    si2 = analysed(tmp_path, ev).stream_idle(kernel_wait_us=30.001).set_index("stream").loc[7]
    assert si2["kernel_wait"] == pytest.approx(49.9) and si2["other"] == 0


def test_launch_outliers_by_hand(tmp_path):
    """A 60 us launch call (over 50), a 150 us launch delay (over 100), a 2 us kernel behind a 4 us call."""
    ev = [step(1, 0, 1000), launch(1, 0, dur=60), kernel("slow_call", 1, 70, 70)]
    ev += [launch(2, 100, dur=4), kernel("late", 2, 254, 50), launch(3, 400, dur=4), kernel("tiny", 3, 405, 2)]
    lo = analysed(tmp_path, ev).launch_outliers(0)
    assert (lo.launches, lo.runtime_outliers, lo.delay_outliers, lo.gpu_shorter_than_cpu) == (3, 1, 1, 1)
    assert lo.delay_us == pytest.approx(10 + 150 + 1) and lo.cpu_us == pytest.approx(68)
    assert dict(zip(lo.table["name"], lo.table["outlier"])) == {"slow_call": "slow launch call",
                                                                "late": "long launch delay", "tiny": ""}  # fmt: skip


def test_queue_length_series_by_hand(tmp_path):
    """Three kernels launched at 0, 1, 2 that start at 10, 20, 30: the queue reads 1 2 3 2 1 0;
    held 1, 1, 8, 10, 10 us over 30 us: a time-weighted mean of 57 / 30."""
    ev = [step(1, 0, 100)]
    for i in range(3):
        ev += [launch(i + 1, i, dur=0.5), kernel(f"k{i}", i + 1, 10 * (i + 1), 5)]
    ta = analysed(tmp_path, ev)
    q = queue_series(ta.kernels(0))
    assert list(q["queue_length"]) == [1, 2, 3, 2, 1, 0] and list(q["ts"]) == [0, 1, 2, 10, 20, 30]
    s = queue_summary(q).iloc[0]
    assert (s["count"], s["mean"], s["max"]) == (6, 1.5, 3) and s["time_mean"] == pytest.approx(57 / 30)
    assert queue_summary(q, max_queue=3).iloc[0]["at_max_us"] == pytest.approx(8)


def test_memory_bandwidth_series_by_hand(tmp_path):
    """Two overlapping device copies recording 100 and 50 GB/s (0-10, 5-15): 100, 150, 50, then 0;
    a host copy without the recorded figure moves 1 MB in 10 us: 100 GB/s from its bytes."""
    ev = [step(1, 0, 100), launch(1, 0), launch(2, 1), launch(3, 2)]
    dtod, bw = "Memcpy DtoD (Device -> Device)", "memory bandwidth (GB/s)"
    ev += [kernel(dtod, 1, 0, 10, cat="gpu_memcpy", bytes=1000, **{bw: 100.0}),
           kernel(dtod, 2, 5, 10, cat="gpu_memcpy", stream=8, **{bw: 50.0}),
           kernel("Memcpy HtoD (Pageable -> Device)", 3, 40, 10, cat="gpu_memcpy", bytes=1_000_000)]  # fmt: skip
    series = memory_bw_series(analysed(tmp_path, ev).kernels(0))
    dtod = series[series["kind"] == "Memcpy DtoD"]
    assert list(dtod["gbps"]) == pytest.approx([100, 150, 50, 0])
    s = memory_bw_summary(series).set_index("kind")
    assert (s.loc["Memcpy DtoD", "count"], s.loc["Memcpy DtoD", "mean"], s.loc["Memcpy DtoD", "max"]) == (3, 100, 150)
    assert s.loc["Memcpy HtoD", "max"] == pytest.approx(100.0)
