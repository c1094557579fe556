"""lab_utils.traces.timeline: one step's bars per rank on the shared clock, by hand: which host events
are drawn (the main thread's, inside the step, an operator ending at the step's end included),
the lanes' order, start, end and launch in ms from the earliest start over the ranks, the critical
path's stretches with time, and a rank without the step."""

from __future__ import annotations

import pandas as pd
import pytest

from lab_utils.core.config import ConfigError
from lab_utils.traces import TraceAnalysis, read_rank
from lab_utils.traces.critical_path import critical_path
from lab_utils.traces.timeline import all_steps, representative_step, step_timeline

from .kineto import ann, kernel, launch, op, step, write


def rank_events(shift: float = 0.0, steps=(1, 2, 3)) -> list[dict]:
    s = shift
    ev = [step(n, s + ts, dur) for n, ts, dur in ((1, 0, 100), (2, 100, 200), (3, 300, 50)) if n in steps]
    ev += [ann("## forward ##", s + 110, 90), ann("double_blocks.0", s + 120, 30),
           op("aten::mm", s + 120, 20, 11), op("aten::t", s + 121, 1, 12), op("aten::add", s + 290, 10, 13),
           op("aten::zero_", s + 200, 0, 14), op("aten::mul", s + 150, 10, 15, tid=2),
           op("aten::empty", s + 100, 5, 16),
           launch(1, s + 125, ext=11), kernel("sm90_gemm", 1, s + 150, 40, ext=11),
           launch(2, s + 130), kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 2, s + 160, 20, stream=9),
           launch(3, s + 310), kernel("k_step3", 3, s + 320, 5)]  # fmt: skip
    return ev


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("tl")
    traces = {r: read_rank(write(d / f"r{r}.json", rank_events(1000.0 * r, steps=(1, 2, 3) if r < 2 else (1,))), r)
              for r in range(3)}  # fmt: skip
    for r, t in traces.items():
        t.rank = r
    ta = TraceAnalysis(traces)
    return ta, {r: ta.attributed(r) for r in ta.ranks}


def test_the_median_step_and_the_steps_of_the_job(job):
    ta, atts = job
    assert representative_step(atts[0]) == 1  # durations 100, 200, 50: the middle one
    assert all_steps(atts.values()) == [1, 2, 3]
    with pytest.raises(ConfigError, match="step"):
        step_timeline(ta.traces, atts, 9)


def test_the_bars_of_one_step_on_the_shared_clock(job):
    ta, atts = job
    cp = critical_path(ta.traces[0], atts[0], 2)
    zero = cp.edges.iloc[:1].assign(kind="dependency", weight=0.0)  # a 0-weight edge: nothing to draw
    edges = pd.concat([cp.edges, zero], ignore_index=True)
    tl = step_timeline(ta.traces, atts, 2, paths={0: edges})
    assert tl.step == 2 and tl.missing == [2] and tl.ranks == [0, 1, 2] and tl.t0_us == 100.0
    assert tl.lanes[:6] == ["r0 · critical path", "r0 · ranges 1", "r0 · ranges 2", "r0 · CPU ops", "r0 · stream 7",
                            "r0 · stream 9 · NCCL"]  # fmt: skip
    assert tl.lanes[6:] == ["r1 · ranges 1", "r1 · ranges 2", "r1 · CPU ops", "r1 · stream 7", "r1 · stream 9 · NCCL"]
    b = tl.bars
    r0 = b[b["rank"] == 0]
    ops = r0[r0["lane"] == "r0 · CPU ops"]
    # outermost, longer than 0, on the main thread, inside the step: empty starts at its start, add ends at its end
    assert ops["name"].tolist() == ["aten::empty", "aten::mm", "aten::add"]
    gemm = r0[(r0["name"] == "sm90_gemm") & (r0["kind"] == "kernel")].iloc[0]
    assert (gemm["start_ms"], gemm["end_ms"], gemm["launch_ms"], gemm["dur_us"]) == pytest.approx((0.05, 0.09, 0.025,
                                                                                                    40.0))  # fmt: skip
    assert (gemm["op"], gemm["phase"], gemm["category"], gemm["on_step"]) == ("aten::mm", "forward", "matmul", 2)
    r1gemm = b[(b["rank"] == 1) & (b["name"] == "sm90_gemm") & (b["kind"] == "kernel")].iloc[0]
    assert r1gemm["start_ms"] == pytest.approx(1.05)  # 1000 us later on the shared clock
    rng = r0[r0["kind"] == "range"].set_index("name")
    assert (
        rng.loc["double_blocks.0", "lane"] == "r0 · ranges 2"
        and rng.loc["## forward ##", "category"] == "phase: forward"
    )
    assert "k_step3" not in set(b["name"])
    path = r0[r0["kind"] == "path"]
    on = cp.edges[cp.edges["weight"] > 0]
    assert len(path) == len(on) and len(edges) > len(on)  # the 0-weight edges are not drawn
    assert path["dur_us"].tolist() == pytest.approx(on["weight"].tolist())
    assert set(path["category"]) <= {"path: CPU", "path: GPU compute", "path: launch delay", "path: kernel gap",
                                     "path: GPU communication"}  # fmt: skip


def lanes_events() -> list[dict]:
    """One step whose kernels come in an order unlike their lanes': stream 12 first, then stream 3's
    NCCL kernel, stream 3's gemm, stream 20; and two ranges, the second starting where the first ends."""
    ev = [step(1, 0, 1000), ann("## forward ##", 10, 90), ann("## backward ##", 100, 200)]
    ev += [op("aten::mm", 10, 20, 11)]
    for c, (name, stream, ts) in enumerate(
        [
            ("k_s12", 12, 50),
            ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 3, 60),
            ("sm90_gemm", 3, 70),
            ("k_s20", 20, 80),
        ],
        start=1,
    ):
        ev += [launch(c, 12 + c, ext=11), kernel(name, c, ts, 5, stream=stream, ext=11)]
    return ev


def test_lanes_are_ordered_by_stream_number_with_nccl_after_its_stream(tmp_path):
    ta = TraceAnalysis({0: read_rank(write(tmp_path / "r0.json", lanes_events()), 0)})
    tl = step_timeline(ta.traces, {0: ta.attributed(0)}, 1)
    assert tl.lanes == ["r0 · ranges 1", "r0 · CPU ops", "r0 · stream 3", "r0 · stream 3 · NCCL", "r0 · stream 12",
                        "r0 · stream 20"]  # fmt: skip
    # the bars come lane by lane in that order, by start within a lane
    assert tl.bars["lane"].drop_duplicates().tolist() == tl.lanes
    assert list(tl.bars.columns) == ["rank", "lane", "kind", "name", "category", "phase", "op", "stream", "start_ms",
                                     "end_ms", "dur_us", "count", "launch_ms", "on_step"]  # fmt: skip
    assert tl.bars.index.tolist() == list(range(len(tl.bars)))


def test_a_range_starting_where_the_last_ended_is_on_the_same_level(tmp_path):
    ta = TraceAnalysis({0: read_rank(write(tmp_path / "r0.json", lanes_events()), 0)})
    tl = step_timeline(ta.traces, {0: ta.attributed(0)}, 1)
    rng = tl.bars[tl.bars["kind"] == "range"].set_index("name")
    assert rng.loc["## forward ##", "lane"] == rng.loc["## backward ##", "lane"] == "r0 · ranges 1"
    assert rng["count"].tolist() == [1, 1]  # each range bar stands for one range


def test_a_step_of_more_bars_than_the_merge_bins_is_drawn_whole_under_the_limit(tmp_path):
    """1,200 kernels (more than the 1,000 bins, fewer than max_bars): every one its own bar."""
    ev = [step(1, 0, 10_000), op("aten::add", 0, 5, 11)]
    for c in range(1, 1201):
        ev += [launch(c, 1, ext=11), kernel(f"k{c % 7}", c, 10 + 8 * c, 2 + c % 5, ext=11)]
    ta = TraceAnalysis({0: read_rank(write(tmp_path / "r0.json", ev), 0)})
    tl = step_timeline(ta.traces, {0: ta.attributed(0)}, 1, max_bars=5_000)
    k = tl.bars[tl.bars["lane"] == "r0 · stream 7"]
    assert tl.merged == 0 and tl.note == "" and len(k) == 1200 and set(k["kind"]) == {"kernel"}
    assert k["dur_us"].sum() == pytest.approx(sum(2 + c % 5 for c in range(1, 1201)))


def test_merge_bins_split_any_window_longer_than_zero_and_a_zero_window_is_one_bin():
    from lab_utils.traces.timeline import _decimate

    def bars(ts, dur):
        end = [a + d for a, d in zip(ts, dur)]
        return pd.DataFrame({"rank": 0, "lane": "r0 · stream 7", "kind": "kernel", "name": "k", "stream": 7,
                             "ts": ts, "end": end, "count": 1, "dur_busy": dur})  # fmt: skip

    # a 0.1 ns window in 1,000 bins of 1e-7 us: the three short bars fall in bins 0, 5 and 20
    out, merged, below = _decimate(bars([0.0, 5e-7, 2e-6, 0.0], [1e-8] * 3 + [1e-4]), 2, 1000, 0.0, 1e-4)
    assert merged == 3 and below == pytest.approx(1e-4) and (out["kind"] == "merged").sum() == 3
    # a window of no length: every short bar in one bin, no division by zero
    out, merged, _ = _decimate(bars([5.0] * 4, [0.0, 0.0, 0.0, 0.0]), 2, 1000, 5.0, 5.0)
    assert merged == 3 and out.loc[out["kind"] == "merged", "count"].tolist() == [3]


def test_a_step_not_in_the_trace_names_up_to_twelve_steps_in_full():
    from lab_utils.traces.timeline import check_steps

    with pytest.raises(ConfigError) as twelve:
        check_steps("step", 99, [list(range(1, 7)), list(range(7, 13))])
    assert str([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]) in str(twelve.value)
    with pytest.raises(ConfigError) as thirteen:
        check_steps("step", 99, [list(range(1, 14))])
    assert str([1, 2, 3, 4, 5, 6, "...", 11, 12, 13]) in str(thirteen.value)
    check_steps("step", 12, [[], list(range(1, 13))])  # a step one rank has: no error


def test_each_phase_and_no_phase_has_its_own_range_colour():
    from lab_utils.traces.timeline import CATEGORY_COLORS

    names = ["data", "encoders", "forward", "backward", "optimizer", "checkpoint", "communication", "none"]
    colours = [CATEGORY_COLORS[f"phase: {p}"] for p in names]
    assert all(c.startswith("#") and len(c) == 7 for c in colours) and len(set(colours)) == len(names)


def test_a_rank_with_nothing_in_the_step_keeps_the_steps_window_on_the_shared_clock(tmp_path):
    from lab_utils.traces.timeline import rank_bars

    trace = read_rank(write(tmp_path / "r0.json", [step(1, 1000, 100), step(2, 1100, 50)]), 0)
    ta = TraceAnalysis({0: trace})
    rb = rank_bars(0, ta.traces[0], ta.attributed(0), 2)
    assert len(rb.bars) == 0 and (rb.lo, rb.hi) == pytest.approx((1100.0, 1150.0))


def test_the_ms_axis_starts_at_the_step_even_when_its_first_bar_starts_later(tmp_path):
    ta = TraceAnalysis({0: read_rank(write(tmp_path / "r0.json", lanes_events()), 0)})
    tl = step_timeline(ta.traces, {0: ta.attributed(0)}, 1)
    fwd = tl.bars[tl.bars["name"] == "## forward ##"].iloc[0]
    assert tl.t0_us == 0.0 and fwd["start_ms"] == pytest.approx(0.010)  # the step at 0 us, the range at 10 us


def test_kernels_the_gpu_clock_puts_before_the_step_still_start_the_axis(tmp_path):
    """Two kernels launched in the step whose GPU timestamps fall before it (clock skew): the axis
    starts at the earlier of them, so no bar has a negative start."""
    ev = [step(1, 100, 100), launch(1, 150), kernel("k_a", 1, 80, 5), launch(2, 160), kernel("k_b", 2, 90, 5)]
    ta = TraceAnalysis({0: read_rank(write(tmp_path / "r0.json", ev), 0)})
    tl = step_timeline(ta.traces, {0: ta.attributed(0)}, 1)
    assert sorted(tl.bars["name"]) == ["k_a", "k_b"]
    assert tl.bars["start_ms"].min() == pytest.approx(0.0)
