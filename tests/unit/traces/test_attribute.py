"""lab_utils.traces.attribute: every rule of the module note on one hand-built trace whose answers are
known by construction (launch, op by External id or by enclosure, step windows at their edges,
ranges of the launch thread and of the main thread, phase and block), the category a launching op
gives a kernel whose name says nothing, and the one window of a trace without steps (an empty one,
a 100 ms and a 30 s one whose last instant it still holds)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest

from lab_utils.traces import PhaseTable, read_rank
from lab_utils.traces.attribute import WINDOWS, attribute, step_windows
from lab_utils.traces.categories import category

from .kineto import ann, kernel, launch, op, runtime, step, write

EVENTS = [
    step(1, 100, 200), step(2, 400, 200),  # a gap 300 .. 400, "after" from 600
    ann("## forward ##", 110, 90), ann("double_blocks.2", 120, 40), ann("inner", 125, 10),
    ann("## optimizer ##", 250, 40),
    op("aten::linear", 120, 30, 10), op("aten::addmm", 122, 26, 11), op("aten::mul", 270, 10, 0),
    launch(1, 126, ext=11), kernel("sm90_xmma_gemm", 1, 500, 40, ext=11),  # launched in step 1, runs in 2
    launch(2, 140, ext=999), kernel("vectorized_elementwise_kernel<add>", 2, 520, 5, ext=999),  # no op has 999
    launch(3, 260, ext=998), kernel("multi_tensor_apply_kernel", 3, 560, 10, ext=998),
    launch(4, 300), kernel("k_at_step_end", 4, 610, 2),  # launched at step 1's end: the gap
    launch(5, 50), kernel("k_before", 5, 620, 2),
    launch(6, 600), kernel("k_after", 6, 630, 2),  # at the last step's end: after
    launch(11, 400), kernel("k_at_step_start", 11, 640, 2),  # at step 2's start: in it
    kernel("k_older", 0, 650, 2),  # no launch, an id below every launch's: launched before the trace
    kernel("k_orphan", 99, 660, 2),  # no launch, a newer id
    ann("nccl:all_reduce", 175, 10, tid=2), launch(8, 180, tid=2, ext=997),
    kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 8, 700, 20, stream=9, ext=997),
    launch(9, 190, tid=2, ext=996), kernel("gemv2T_kernel", 9, 730, 4, ext=996),  # tid 2, no range of its own
    launch(10, 285, ext=0), kernel("Memcpy DtoD (Device -> Device)", 10, 740, 3, cat="gpu_memcpy", ext=0),
]  # fmt: skip


@pytest.fixture(scope="module")
def att(tmp_path_factory):
    trace = read_rank(write(tmp_path_factory.mktemp("attr") / "t.json", EVENTS))
    return attribute(trace)


def rows(att):
    return att.kernels.set_index("name")


def test_steps_are_the_profiler_step_ranges(att):
    assert att.has_steps and att.main_tid == "1" and att.rule == "gpu"
    # times after the trace's first microsecond (the launch at 50)
    assert att.steps[["step", "ts", "end", "dur"]].values.tolist() == [[1, 50, 250, 200], [2, 350, 550, 200]]


def test_windows_at_the_edges_of_the_steps(att):
    r = rows(att)
    want = {"sm90_xmma_gemm": ("step", 1), "vectorized_elementwise_kernel<add>": ("step", 1),
            "multi_tensor_apply_kernel": ("step", 1), "k_at_step_end": ("gap", -1), "k_before": ("before", -1),
            "k_after": ("after", -1), "k_at_step_start": ("step", 2), "k_older": ("before", -1),
            "k_orphan": ("no launch", -1), "ncclDevKernel_AllReduce_Sum_f32_RING_LL": ("step", 1),
            "gemv2T_kernel": ("step", 1), "Memcpy DtoD (Device -> Device)": ("step", 1)}  # fmt: skip
    got = {n: (r.loc[n, "window"], int(r.loc[n, "step"])) for n in want}
    assert got == want
    assert set(att.kernels["window"]) <= set(WINDOWS)
    assert math.isnan(r.loc["k_older", "launch_ts"]) and math.isnan(r.loc["k_orphan", "queue_delay"])


def test_the_launching_op_by_external_id_else_the_innermost_op_around_the_launch(att):
    r = rows(att)
    assert r.loc["sm90_xmma_gemm", "op"] == "aten::addmm"  # by its External id
    assert r.loc["vectorized_elementwise_kernel<add>", "op"] == "aten::addmm"  # no op 999: inside addmm
    assert r.loc["multi_tensor_apply_kernel", "op"] == ""  # no op around it
    assert r.loc["Memcpy DtoD (Device -> Device)", "op"] == "aten::mul"  # External id 0 is an id
    assert r.loc["k_orphan", "op"] == "" and r.loc["k_orphan", "op_index"] == -1


def test_ranges_phase_and_block_come_from_the_launch_thread_then_the_main_thread(att):
    r = rows(att)
    gemm = r.loc["sm90_xmma_gemm"]
    assert (gemm["range"], gemm["phase"], gemm["block"]) == ("inner", "forward", "double_blocks.2")
    add = r.loc["vectorized_elementwise_kernel<add>"]
    assert (add["range"], add["phase"], add["block"]) == ("double_blocks.2", "forward", "double_blocks.2")
    opt = r.loc["multi_tensor_apply_kernel"]
    assert (opt["range"], opt["phase"]) == ("## optimizer ##", "optimizer") and pd.isna(opt["block"])
    nccl = r.loc["ncclDevKernel_AllReduce_Sum_f32_RING_LL"]  # its own thread's range over the main thread's
    assert (nccl["range"], nccl["phase"]) == ("nccl:all_reduce", "communication")
    bwd = r.loc["gemv2T_kernel"]  # another thread, no range there: the main thread's around it in time
    assert (bwd["range"], bwd["phase"]) == ("## forward ##", "forward")
    assert pd.isna(r.loc["k_before", "range"]) and pd.isna(r.loc["k_before", "phase"])


def test_types_categories_launch_columns_and_queue_delay(att):
    r = rows(att)
    gemm = r.loc["sm90_xmma_gemm"]
    assert (gemm["hta_type"], gemm["category"]) == ("COMPUTATION", "matmul")
    assert r.loc["Memcpy DtoD (Device -> Device)", "category"] == "memcpy"
    assert r.loc["ncclDevKernel_AllReduce_Sum_f32_RING_LL", "hta_type"] == "COMMUNICATION"
    assert (gemm["launch_ts"], gemm["launch_tid"], gemm["launch_name"], gemm["launch_dur"]) == (
        76.0, "1", "cudaLaunchKernel", 4.0)  # fmt: skip
    assert gemm["queue_delay"] == 374.0  # starts at 500, launched at 126
    assert r.loc["gemv2T_kernel", "launch_tid"] == "2"


def test_a_phase_table_given_replaces_the_ranges_phases(tmp_path):
    trace = read_rank(write(tmp_path / "t.json", EVENTS))
    a = attribute(trace, PhaseTable(rules=(("^inner$", "data"),)))
    assert rows(a).loc["sm90_xmma_gemm", "phase"] == "data"  # the innermost range now has a phase


def test_step_windows_keep_the_first_of_a_repeated_step_and_only_ranges():
    trace_like = {"ts": [5.0, 0.0, 20.0, 30.0], "dur": [5.0, 10.0, 5.0, 1.0], "tid": ["1"] * 4,
                  "name": ["ProfilerStep#2", "ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"],
                  "cat": ["user_annotation"] * 3 + ["cpu_op"]}  # fmt: skip
    host = pd.DataFrame(trace_like)
    host["end"] = host["ts"] + host["dur"]
    s = step_windows(host)
    assert s[["step", "ts", "end"]].values.tolist() == [[1, 0, 10], [2, 5, 10]]
    assert step_windows(host.iloc[:0]).empty


def test_a_trace_without_steps_is_one_window_from_its_first_start_to_its_last_end(tmp_path):
    """The GPU starts first (at 5.5) and ends last (150.5); the host lies inside: step 0 is 0.5 .. 145.5
    after the trace's first whole microsecond (5)."""
    ev = [kernel("gemm", 1, "TS", 145.0), op("aten::mm", 20, 80, 1), launch(1, 21, ext=1),
          kernel("k_orphan", 9, 60, 2)]  # fmt: skip
    a = attribute(read_rank(write(tmp_path / "n.json", ev, literal={"TS": "5.5"})))
    assert not a.has_steps and a.main_tid == "1"
    (s,) = a.steps.to_dict(orient="records")
    assert s["step"] == 0 and s["ts"] == 0.5 and s["dur"] == 145.0
    assert s["end"] == pytest.approx(145.5, abs=1e-6) and s["end"] >= 145.5
    r = rows(a)
    assert (r.loc["gemm", "window"], r.loc["gemm", "step"]) == ("step", 0)
    assert (r.loc["k_orphan", "window"], r.loc["k_orphan", "step"]) == ("no launch", -1)
    host_first = [op("aten::mm", 2, 10, 1), launch(1, 3, ext=1), kernel("gemm", 1, 4, 20)]
    b = attribute(read_rank(write(tmp_path / "h.json", host_first)))
    assert b.steps[["ts", "dur"]].values.tolist() == [[0.0, 22.0]]  # host at 2 .. GPU end at 24
    host_last = [op("aten::mm", 0, 100, 1), launch(1, 1, ext=1), kernel("gemm", 1, 2, 8)]
    c = attribute(read_rank(write(tmp_path / "l.json", host_last)))
    assert c.steps[["ts", "dur"]].values.tolist() == [[0.0, 100.0]]  # the host's last end, not its first


def test_a_trace_of_gpu_activities_alone_is_one_window_holding_every_one(tmp_path):
    """A profile of ``ProfilerActivity.CUDA`` alone has no host event: nothing is launched, no
    operator launches anything, and every activity lies in the one window (50 .. 300 us: 200 us of
    GEMM over a 250 us span, so 80% compute and 20% idle)."""
    from lab_utils.traces import TraceAnalysis  # noqa: PLC0415

    ev = [kernel("sm90_gemm", 10, 50.0, 100.0), kernel("sm90_gemm", 11, 200.0, 100.0)]
    path = write(tmp_path / "gpu.json", ev)
    a = attribute(read_rank(path))
    assert not a.has_steps and a.main_tid is None and len(a.kernels) == 2
    assert a.kernels["window"].tolist() == ["step", "step"] and a.kernels["step"].tolist() == [0, 0]
    assert a.kernels["op"].tolist() == ["", ""] and a.kernels["op_index"].tolist() == [-1, -1]
    t = TraceAnalysis(path).temporal().iloc[0]
    assert (t["span"], t["compute"], t["idle"]) == (250.0, 200.0, 50.0)
    assert (t["compute_pct"], t["idle_pct"]) == (80.0, 20.0)


def test_the_first_host_event_can_be_the_launching_op(tmp_path):
    ev = [op("aten::mm", 0, 10, 3), launch(1, 2, ext=77), kernel("gemm", 1, 20, 5, ext=77)]
    a = attribute(read_rank(write(tmp_path / "f.json", ev)))
    assert a.kernels["op"].tolist() == ["aten::mm"] and a.kernels["op_index"].tolist() == [0]


def test_a_cpu_trace_is_attributed_by_the_cpu_rule(tmp_path):
    ev = [step(1, 0, 100), op("aten::mm", 10, 30), op("aten::add", 50, 10), ann("## forward ##", 5, 60)]
    a = attribute(read_rank(write(tmp_path / "c.json", ev)))
    assert a.rule == "cpu"
    r = rows(a)
    assert r["op"].to_dict() == {"aten::mm": "aten::mm", "aten::add": "aten::add"}
    assert r["phase"].tolist() == ["forward", "forward"] and r["window"].tolist() == ["step", "step"]
    assert r["queue_delay"].tolist() == [0.0, 0.0] and r["category"].tolist() == ["matmul", "elementwise/activation"]
    assert np.array_equal(r["hta_type"].to_numpy(), np.array(["COMPUTATION", "COMPUTATION"], dtype=object))


def test_a_trace_with_nothing_in_it_is_one_empty_window_at_zero(tmp_path):
    """No host event and no GPU activity: the one window starts and ends at 0 and holds nothing."""
    trace = read_rank(write(tmp_path / "e.json", [op("aten::mm", 5, 3)]))
    empty = dataclasses.replace(trace, host=trace.host.iloc[:0], gpu=trace.gpu.iloc[:0])
    a = attribute(empty)
    (s,) = a.steps.to_dict(orient="records")
    assert not a.has_steps and a.kernels.empty
    assert (s["step"], s["ts"], s["dur"]) == (0, 0.0, 0.0) and s["end"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("span", [100_000.0, 30_000_000.0])
def test_the_one_window_holds_the_last_instant_of_a_long_trace(tmp_path, span):
    """A trace of 100 ms or of 30 s without steps: its window ends past the last end, not on it, so the
    half-open window [ts, end) still holds that instant (at 30 s a float's step is 3.7 ns: adding
    less than half of it gives the end back); its critical path's window is the span, exactly."""
    from lab_utils.traces import TraceAnalysis  # noqa: PLC0415

    ev = [op("aten::mm", 0, 10, 1), launch(1, 1, ext=1), kernel("gemm", 1, 20, span - 20.0)]
    path = write(tmp_path / "long.json", ev)
    (s,) = attribute(read_rank(path)).steps.to_dict(orient="records")
    assert s["end"] > span and s["end"] - span < 1e-3 and s["dur"] == span
    assert TraceAnalysis(path, workers=1).critical_path(0).window_us == span


def test_a_kernel_whose_name_says_nothing_takes_the_category_of_its_launching_op(tmp_path):
    """``k_opaque`` names no category ("other" alone); launched by aten::mm it is a matmul, and a
    copy named as such is a memcpy by its event kind, whatever launched it."""
    ev = [op("aten::mm", 0, 10, 1), launch(1, 1, ext=1), kernel("k_opaque", 1, 20, 5, ext=1),
          op("aten::mm", 30, 10, 2), runtime("cudaMemcpyAsync", 2, 31, ext=2),
          kernel("k_opaque_copy", 2, 50, 5, cat="gpu_memcpy", ext=2)]  # fmt: skip
    r = rows(attribute(read_rank(write(tmp_path / "o.json", ev))))
    assert category("k_opaque") == "other" and r.loc["k_opaque", "op"] == "aten::mm"
    assert r.loc["k_opaque", "category"] == "matmul" and r.loc["k_opaque_copy", "category"] == "memcpy"
