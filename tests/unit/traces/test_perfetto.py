"""lab_utils.traces.perfetto: the Chrome trace-event JSON of an attributed job, by hand: processes and
threads per rank, slices that touch staying on their thread, a thread id 0 kept, threads without a
number given the next free ones, ids of 0 kept, events that do not nest moved to a thread of their
own, flow arrows only from a launch in the trace, their ids unique over the ranks, times rounded to
the ns, a step's events alone, and the file written plain or gzipped."""

from __future__ import annotations

import gzip
import json

import pytest

from lab_utils.traces import TraceAnalysis, read_rank
from lab_utils.traces.perfetto import gpu_pid, host_pid, perfetto_trace, rank_events, write_perfetto

from .kineto import ann, kernel, launch, op, step, write


def events_of(tmp_path, events, name="t.json", **meta):
    ta = TraceAnalysis(write(tmp_path / name, events, **meta), workers=1)
    return ta, rank_events(0, ta.traces[0], ta.attributed(0))


def slices(ev, pid):
    return [e for e in ev if e["ph"] == "X" and e["pid"] == pid]


def test_processes_threads_and_slices_of_one_rank(tmp_path):
    ev = [step(1, 0, 100, tid=0), op("aten::mm", 10, 10, 1, tid=0), op("aten::add", 20, 10, 2, tid=0),
          launch(1, 12, tid=0, ext=1), kernel("gemm", 1, 40, 10, ext=1), kernel("orphan", 99, 60, 5)]  # fmt: skip
    ta, out = events_of(tmp_path, ev, deviceProperties=[{"id": 0, "name": "NVIDIA H100 80GB HBM3"}])
    assert (host_pid(0), gpu_pid(0), host_pid(3), gpu_pid(3)) == (1, 2, 7, 8)
    meta = {(e["name"], e["pid"], e.get("tid")): e["args"] for e in out if e["ph"] == "M"}
    assert meta[("process_name", 1, None)] == {"name": "rank 0 · host"}
    assert meta[("process_name", 2, None)] == {"name": "rank 0 · GPU (NVIDIA H100 80GB HBM3)"}
    assert meta[("process_sort_index", 2, None)] == {"sort_index": 2}
    assert meta[("thread_name", 1, 0)] == {"name": "thread 0"}  # thread id 0 is a number: kept
    assert meta[("thread_name", 2, 7)] == {"name": "stream 7"} and meta[("thread_sort_index", 2, 7)] == {
        "sort_index": 7
    }
    host = slices(out, 1)
    assert {e["name"]: e["tid"] for e in host} == {
        "ProfilerStep#1": 0,
        "aten::mm": 0,
        "aten::add": 0,
        "cudaLaunchKernel": 0,
    }  # mm and add touch at 20: one thread
    mm = next(e for e in host if e["name"] == "aten::mm")
    assert (mm["ts"], mm["dur"], mm["args"]) == (10.0, 10.0, {"External id": 1})
    gemm = next(e for e in slices(out, 2) if e["name"] == "gemm")
    assert gemm["tid"] == 7 and gemm["ts"] == 40.0 and gemm["dur"] == 10.0
    assert gemm["args"]["op"] == "aten::mm" and gemm["args"]["step"] == 1 and gemm["args"]["launch_ts"] == 12.0
    assert gemm["args"]["queue_delay_us"] == 28.0 and gemm["args"]["window"] == "step"
    assert gemm["args"]["category"] == "matmul" and gemm["args"]["correlation"] == 1
    flows = [e for e in out if e["ph"] in ("s", "f")]
    assert [(e["ph"], e["pid"], e["tid"], e["ts"]) for e in flows] == [("s", 1, 0, 12.0), ("f", 2, 7, 40.0)]
    assert flows[0]["id"] == flows[1]["id"] and flows[1]["bp"] == "e"  # the orphan (no launch) has no arrow
    orphan = next(e for e in slices(out, 2) if e["name"] == "orphan")
    assert "launch_ts" not in orphan["args"] and orphan["args"]["queue_delay_us"] is None


def test_events_that_do_not_nest_move_to_a_thread_of_their_own(tmp_path):
    """A range closed 1 us after its parent: kept on a fresh thread named for the overlap, on each thread
    its own; a range ending with its parent, or starting as another ends, nests."""
    ev = [step(1, 0, 100), ann("## forward ##", 10, 50), ann("late", 40, 21), ann("after", 60, 10),
          ann("with_parent", 50, 10), ann("t2_outer", 0, 10, tid=2), ann("t2_late", 5, 6, tid=2)]  # fmt: skip
    _, out = events_of(tmp_path, ev)
    host = {e["name"]: e["tid"] for e in slices(out, 1)}
    assert host["ProfilerStep#1"] == host["## forward ##"] == host["after"] == host["with_parent"] == 1
    assert host["t2_outer"] == 2
    assert {host["late"], host["t2_late"]} == {3, 4}  # one fresh thread each
    names = {e["tid"]: e["args"]["name"] for e in out if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {1: "thread 1", 2: "thread 2", host["late"]: "thread 1 (overlap 1)",
                     host["t2_late"]: "thread 2 (overlap 1)"}  # fmt: skip


def test_flow_ids_are_unique_over_ranks_and_a_cpu_trace_draws_none(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    for r in (0, 1):
        ev = [step(1, 0, 100), launch(1, 5), kernel("k", 1, 20, 5), launch(2, 6), kernel("k", 2, 30, 5)]
        write(job / f"r{r}.json", ev, distributedInfo={"rank": r})
    ta = TraceAnalysis(job, workers=1)
    doc = perfetto_trace(ta.traces, {r: ta.attributed(r) for r in ta.ranks})
    ids = [e["id"] for e in doc["traceEvents"] if e["ph"] == "s"]
    assert ids == [0, 1, 10_000_000, 10_000_001]
    assert doc["displayTimeUnit"] == "ms" and doc["otherData"] == {"writer": "perflab trace"}
    cpu = read_rank(write(tmp_path / "cpu.json", [step(1, 0, 100), op("aten::mm", 10, 20, 1)]))
    cta = TraceAnalysis({0: cpu})
    out = rank_events(0, cpu, cta.attributed(0))
    assert not [e for e in out if e["ph"] in ("s", "f")] and len(slices(out, 2)) == 1


def test_only_the_steps_asked_for(tmp_path):
    ev = [step(1, 0, 100), step(2, 100, 100), op("aten::mm", 10, 5, 1), op("aten::add", 110, 5, 2),
          launch(1, 11, ext=1), kernel("k1", 1, 20, 5, ext=1),
          launch(2, 111, ext=2), kernel("k2", 2, 120, 5, ext=2)]  # fmt: skip
    ta = TraceAnalysis(write(tmp_path / "s.json", ev), workers=1)
    two = rank_events(0, ta.traces[0], ta.attributed(0), steps=2)
    assert {e["name"] for e in two if e["ph"] == "X"} == {"ProfilerStep#2", "aten::add", "cudaLaunchKernel", "k2"}
    both = rank_events(0, ta.traces[0], ta.attributed(0), steps=[1, 2])
    assert {e["name"] for e in both if e["ph"] == "X" and e["pid"] == 2} == {"k1", "k2"}


@pytest.mark.parametrize("name", ["p.json", "p.json.gz"])
def test_written_plain_or_gzipped(tmp_path, name):
    doc = {"traceEvents": [{"ph": "X", "name": "k", "ts": 1.5, "dur": 2.0, "pid": 2, "tid": 7}]}
    path = write_perfetto(doc, tmp_path / name)
    text = gzip.open(path, "rt").read() if name.endswith(".gz") else path.read_text()
    assert json.loads(text) == doc


def test_threads_without_a_number_take_the_next_free_ones_each_its_own(tmp_path):
    """Thread 5 keeps 5; threads named ``"loader"`` and ``"main"`` (no number) take 6 and 7, in name
    order, and a range of ``"main"`` that does not nest takes 8: no two threads share a tid."""
    ev = [step(1, 0, 100, tid=5), ann("load", 10, 20, tid="loader"), ann("outer", 0, 50, tid="main"),
          ann("late", 40, 20, tid="main")]  # fmt: skip
    _, out = events_of(tmp_path, ev)
    host = {e["name"]: e["tid"] for e in slices(out, 1)}
    assert host == {"ProfilerStep#1": 5, "load": 6, "outer": 7, "late": 8}
    names = {e["tid"]: e["args"]["name"] for e in out if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {5: "thread 5", 6: "thread loader", 7: "thread main", 8: "thread main (overlap 1)"}


def test_an_id_of_zero_is_an_id_and_a_missing_one_is_left_out(tmp_path):
    """External id 0 and correlation 0 are kept in a host slice's args; an event without them has none."""
    ev = [step(1, 0, 100), op("aten::mm", 10, 10, 0), launch(0, 12, ext=7), op("aten::add", 30, 5)]
    _, out = events_of(tmp_path, ev)
    args = {e["name"]: e["args"] for e in slices(out, 1)}
    assert args["aten::mm"] == {"External id": 0}
    assert args["cudaLaunchKernel"] == {"correlation": 0, "External id": 7}
    assert args["aten::add"] == {} and args["ProfilerStep#1"] == {}


def test_times_keep_nanoseconds_as_three_decimals(tmp_path):
    """A launch at 12.0004 us, its kernel at 40.0006 us for 10.0006 us: ts, dur, launch_ts and the
    flow's ends are rounded to the ns (12.0, 40.001, 10.001)."""
    ev = [step(1, 0, 100), launch(1, 12.0004, ext=1), kernel("gemm", 1, 40.0006, 10.0006, ext=1)]
    _, out = events_of(tmp_path, ev)
    gemm = next(e for e in slices(out, 2) if e["name"] == "gemm")
    assert (gemm["ts"], gemm["dur"], gemm["args"]["launch_ts"]) == (40.001, 10.001, 12.0)
    assert [e["ts"] for e in out if e["ph"] in ("s", "f")] == [12.0, 40.001]
    call = next(e for e in slices(out, 1) if e["name"] == "cudaLaunchKernel")
    assert call["ts"] == 12.0


def test_slices_under_a_microsecond_keep_their_length(tmp_path):
    """A 0.5 us operator, a 0.001 us one and an instant one (0 us) are written as long as they ran; so
    is a 0.5 us kernel."""
    ev = [step(1, 0, 100), op("aten::view", 10, 0.5), op("aten::alias", 20, 0.001), op("aten::detach", 30, 0.0),
          launch(1, 40), kernel("tiny", 1, 50, 0.5)]  # fmt: skip
    _, out = events_of(tmp_path, ev)
    durs = {e["name"]: e["dur"] for e in slices(out, 1) if e["name"] != "cudaLaunchKernel"}
    assert durs == {"ProfilerStep#1": 100.0, "aten::view": 0.5, "aten::alias": 0.001, "aten::detach": 0.0}
    assert [(e["name"], e["dur"]) for e in slices(out, 2)] == [("tiny", 0.5)]
