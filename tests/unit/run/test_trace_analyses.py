"""lab_utils.run.trace_analyses: the figures ``perflab trace`` adds per rank, on inputs whose answers
are known by construction: a critical path written edge by edge (its share of the step, its parts),
the path per step of a trace with and without steps, the ten worst launch delays, a rank off the
page keeping its idle per stream and steps, and the text summary's lines of a figures dict written
here."""

from __future__ import annotations

import pandas as pd
import pytest

from lab_utils.run.trace_analyses import path_figures, path_values, rank_extras, rank_figures, summary_lines
from lab_utils.traces import TraceAnalysis
from lab_utils.traces.critical_path import CriticalPath

from ..traces.kineto import Job, op, step


def path(length_us: float, window_us: float, edges: list[tuple[str, float, str, str, str]], step: int = 2):
    """A critical path of the given edges: (kind, weight us, event name, category, bound_by)."""
    e = pd.DataFrame(edges, columns=["kind", "weight", "name", "category", "bound_by"])
    return CriticalPath(rank=0, step=step, window_us=window_us, length_us=length_us, edges=e, nodes=len(e) + 1,
                        graph_edges=len(e))  # fmt: skip


EDGES = [("gpu", 30.0, "gemm", "matmul", "gpu_compute_bound"), ("cpu", 10.0, "aten::mm", "CPU", "cpu_bound"),
         ("dependency", 0.0, "", "dependency", "cpu_bound")]  # fmt: skip


@pytest.mark.parametrize(
    "length, window, share",
    [(40.0, 80.0, 50.0), (40.0, 40.0, 100.0), (40.0, 1000.0, 4.0), (40.0, 0.0, None)],
)
def test_the_paths_share_of_its_step(length, window, share):
    """share_of_step = 100 x length / window, in %; a window of 0 us has no share."""
    fig = path_figures(path(length, window, EDGES))
    assert (fig["step"], fig["length_us"], fig["window_us"]) == (2, length, window)
    assert fig["share_of_step"] == (None if share is None else pytest.approx(share))


def test_the_paths_parts_by_bound_category_and_event():
    """30 of 40 us GPU compute, 10 host work; a 0 us edge counts nowhere."""
    fig = path_figures(path(40.0, 80.0, EDGES))
    assert fig["by_bound"] == pytest.approx({"gpu_compute_bound": 75.0, "cpu_bound": 25.0})
    assert [(r["category"], r["us"], r["edges"]) for r in fig["by_category"]] == [("matmul", 30.0, 1), ("CPU", 10.0, 1)]
    assert [(r["name"], r["us"], r["pct"]) for r in fig["events"]] == [("gemm", 30.0, 75.0), ("aten::mm", 10.0, 25.0)]


def three_steps(tmp_path):
    """Steps 1-3 of host duration 100, 300, 200 us (median: step 3), one kernel on stream 7 in each."""
    j, t = Job(), 0.0
    for n, d in enumerate((100.0, 300.0, 200.0), start=1):
        j.add(step(n, t, d))
        j.gpu("gemm", t + 10, t + 20, 40.0)
        t += d
    return TraceAnalysis(j.write(tmp_path / "r.json"), workers=1)


def test_a_rank_off_the_page_keeps_its_idle_per_stream_and_its_steps(tmp_path):
    ta = three_steps(tmp_path)
    off = rank_extras(ta, 0, None, page=False, max_bars=100, perfetto="none")
    assert set(off) == {"stream_idle", "step", "steps"}  # no figures, bars or events off the page
    assert off["step"] == 3 and off["steps"] == [1, 2, 3]
    assert [(r["rank"], r["stream"]) for r in off["stream_idle"]] == [(0, 7)]
    assert rank_extras(ta, 0, 2, page=False, max_bars=100, perfetto="none")["step"] == 2
    on = rank_extras(ta, 0, None, page=True, max_bars=100, perfetto="none")
    assert on["step"] == 3 and on["figures"]["critical_path"]["step"] == 3 and "perfetto" not in on


def test_the_summary_lines_of_hand_written_analyses():
    """The path with its share and parts (most first), its top three events, the call tree's depth 1-2 rows
    that are not kernels, the sequences, the launches and the idle per stream, in ms."""
    tree = [{"depth": 0, "kind": "range", "path": "ProfilerStep", "gpu_total_us": 4000.0, "gpu_self_us": 0.0},
            {"depth": 1, "kind": "range", "path": "ProfilerStep > ## forward ##", "gpu_total_us": 3000.0,
             "gpu_self_us": 0.0},
            {"depth": 2, "kind": "op", "path": "ProfilerStep > ## forward ## > aten::mm", "gpu_total_us": 2500.0,
             "gpu_self_us": 2500.0},
            {"depth": 2, "kind": "kernel", "path": "ProfilerStep > ## forward ## > gemm", "gpu_total_us": 500.0,
             "gpu_self_us": 500.0},
            {"depth": 3, "kind": "kernel", "path": "ProfilerStep > ## forward ## > aten::mm > gemm",
             "gpu_total_us": 2500.0, "gpu_self_us": 2500.0}]  # fmt: skip
    cp = {"step": 3, "length_us": 1500.0, "share_of_step": 75.0, "by_bound": {"cpu_bound": 40.0,
          "gpu_compute_bound": 60.0}, "events": [{"name": "gemm", "us": 900.0, "pct": 60.0},
                                                 {"name": "", "us": 3.0, "pct": 0.2},
                                                 {"name": "add", "us": 2.0, "pct": 0.1},
                                                 {"name": "fourth", "us": 1.0, "pct": 0.05}]}  # fmt: skip
    lo = {"launches": 12, "runtime_outliers": 1, "delay_outliers": 2}
    fig = {"analyses": {"0": {"critical_path": cp, "hierarchy": tree, "launch_outliers": lo,
                              "sequences": [{"short": "a → b", "count": 4, "total_us": 2500.0}]},
                        "1": {"critical_path": None, "hierarchy": [], "sequences": [], "launch_outliers": lo}},
           "stream_idle": [{"rank": 0, "stream": 7, "host_wait": 1500.0, "kernel_wait": 250.0, "other": 0.0}],
           "timeline_step": 3}  # fmt: skip
    assert summary_lines(fig) == [
        "rank 0 critical path of step 3: 1.500 ms (75% of the step): gpu_compute_bound 60.0%, cpu_bound 40.0%",
        "        0.900 ms  60.0%  gemm",
        "        0.003 ms   0.2%  (launch delays)",
        "        0.002 ms   0.1%  add",
        "rank 0 call tree (GPU time, total / self):",
        "        3.000 ms /     0.000 ms  ProfilerStep > ## forward ##",
        "        2.500 ms /     2.500 ms  ProfilerStep > ## forward ## > aten::mm",
        "rank 0 repeated: a → b x4 (2.500 ms)",
        "rank 0 launches: 12 calls, 1 over 50 us, 2 with a launch delay over 100 us",
        "rank 1: no step 3 here, no critical path",
        "rank 1 launches: 12 calls, 1 over 50 us, 2 with a launch delay over 100 us",
        "idle per stream (ms): rank stream host_wait kernel_wait other",
        "     0      7     1.500       0.250     0.000",
    ]
    no_share = fig | {"analyses": {"0": fig["analyses"]["0"] | {"critical_path": cp | {"share_of_step": None}}}}
    assert (
        summary_lines(no_share)[0]
        == "rank 0 critical path of step 3: 1.500 ms: gpu_compute_bound 60.0%, cpu_bound 40.0%"
    )


def test_a_trace_without_steps_has_no_path_per_step(tmp_path):
    """No ProfilerStep: an empty table of the record columns; with steps, the path's length per step."""
    j = Job()
    j.gpu("gemm", 10.0, 20.0, 40.0)
    flat = path_values(TraceAnalysis(j.write(tmp_path / "flat.json"), workers=1), 0)
    assert isinstance(flat, pd.DataFrame) and flat.empty
    assert list(flat.columns) == ["metric", "unit", "step_index", "value", "step"]
    per_step = path_values(three_steps(tmp_path), 0)
    assert sorted(per_step.loc[per_step["metric"] == "critical_path", "step"]) == [1, 2, 3]


def test_the_ten_longest_launch_delays_are_the_worst(tmp_path):
    """12 launches waiting 101..112 us (over the 100 us cut-off) and one waiting 10 us: the worst are
    the ten longest waits, longest first; all 12 counted."""
    j = Job().add(step(1, 0.0, 20_000.0))
    for i in range(12):
        t = 1000.0 * (i + 1)
        j.gpu(f"k{i}", t, t + 4.0 + 101.0 + i, 5.0)  # 4 us launch call, then 101 + i us of delay
    j.gpu("prompt", 15_000.0, 15_014.0, 5.0)
    lo = rank_figures(TraceAnalysis(j.write(tmp_path / "d.json"), workers=1), 0, None)["launch_outliers"]
    assert (lo["launches"], lo["delay_outliers"]) == (13, 12)
    assert [r["name"] for r in lo["worst"]] == [f"k{i}" for i in range(11, 1, -1)]
    assert [r["delay_us"] for r in lo["worst"]] == pytest.approx([101.0 + i for i in range(11, 1, -1)])


def test_the_call_tree_keeps_the_parts_holding_half_a_percent_of_the_gpu_time_or_more(tmp_path):
    """Kernels of 991, 5 and 4 us under aten::mm, aten::add and aten::mul: of the 1000 us, aten::add's 5 us
    are 0.5% (the floor itself, kept), aten::mul's 4 us 0.4% (under it, left out of the page's tree)."""
    j = Job().add(step(1, 0.0, 5000.0))
    for i, (name, dur) in enumerate((("aten::mm", 991.0), ("aten::add", 5.0), ("aten::mul", 4.0))):
        t = 100.0 + 1000.0 * i
        j.add(op(name, t, 20.0, ext=i + 1))
        j.gpu(f"k_{name[6:]}", t + 5, t + 30, dur, ext=i + 1)
    ta = TraceAnalysis(j.write(tmp_path / "t.json"), workers=1)
    assert len(ta.hierarchy(0)) == 7  # the step, three operators, three kernels
    tree = rank_figures(ta, 0, None)["hierarchy"]
    assert [(r["path"], r["gpu_pct"]) for r in tree] == [
        ("ProfilerStep", 100.0),
        ("ProfilerStep > aten::mm", pytest.approx(99.1)),
        ("ProfilerStep > aten::mm > k_mm", pytest.approx(99.1)),
        ("ProfilerStep > aten::add", pytest.approx(0.5)),
        ("ProfilerStep > aten::add > k_add", pytest.approx(0.5)),
    ]


def test_the_summary_names_the_three_first_repeated_sequences_of_a_rank():
    """Four sequences, listed by total time: the first three are printed, in that order, the fourth is not."""
    seqs = [{"short": f"s{i}", "count": 10 - i, "total_us": 1000.0 * (4 - i)} for i in range(4)]
    lo = {"launches": 1, "runtime_outliers": 0, "delay_outliers": 0}
    fig = {"analyses": {"0": {"critical_path": None, "hierarchy": [], "sequences": seqs, "launch_outliers": lo}}}
    assert [ln for ln in summary_lines(fig) if " repeated: " in ln] == [
        "rank 0 repeated: s0 x10 (4.000 ms)",
        "rank 0 repeated: s1 x9 (3.000 ms)",
        "rank 0 repeated: s2 x8 (2.000 ms)",
    ]
    one = fig | {"analyses": {"0": fig["analyses"]["0"] | {"sequences": seqs[3:]}}}
    assert [ln for ln in summary_lines(one) if " repeated: " in ln] == ["rank 0 repeated: s3 x7 (1.000 ms)"]
