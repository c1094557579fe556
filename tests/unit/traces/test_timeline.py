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
