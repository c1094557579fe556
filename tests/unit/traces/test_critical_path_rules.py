"""The critical path of a step on hand-built Kineto traces whose path is known by construction
(the agreement with HolisticTraceAnalysis on real jobs: tests/unit/traces/test_counters_hta.py)."""

from __future__ import annotations

import numpy as np
import pytest

from lab_utils.core.config import ConfigError
from lab_utils.traces import TraceAnalysis
from lab_utils.traces.critical_path import critical_path
from unit.traces.test_collectives import kernel, launch, op, step, write


def rt(name, corr, ts, dur, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "External id": corr}}  # fmt: skip


def sync(name, corr, ts, dur, stream=7, **args):
    return {"ph": "X", "cat": "cuda_sync", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream, "device": 0, **args}}  # fmt: skip


def path_of(tmp_path, events, **kw):
    ta = TraceAnalysis(write(tmp_path / "t.json", events), workers=1)
    return ta, critical_path(ta.traces[0], ta.attributed(0), **kw)


def test_a_gpu_bound_step_is_its_kernels_back_to_back(tmp_path):
    """aten::mm (0-10) launches a 400 us GEMM at 5 (it starts at 20: a 15 us launch delay);
    aten::add (30-40) launches a second 400 us kernel behind it (420-820); the host then waits in
    cudaDeviceSynchronize (40-830) and runs aten::sum (830-840).  The path: mm's 5 us before its
    launch, the launch delay, both kernels, the sync edge, aten::sum: 5 + 15 + 400 + 400 + 10."""
    ev = [step(1, 0, 1000)]
    ev += [op("aten::mm", 0, 10, 11), launch(1, 5, ext=11, dur=3), kernel("sm80_xmma_gemm", 1, 20, 400, ext=11)]
    add = kernel("vectorized_elementwise_kernel", 2, 420, 400, ext=12)
    ev += [op("aten::add", 30, 10, 12), launch(2, 35, ext=12, dur=3), add]
    ev += [rt("cudaDeviceSynchronize", 3, 40, 790), sync("Context Sync", 3, 40, 790), op("aten::sum", 830, 10, 13)]
    _, cp = path_of(tmp_path, ev)
    assert cp.step == 1 and cp.window_us == 1000
    assert cp.length_us == pytest.approx(830)
    on = cp.edges[cp.edges["weight"] > 0]
    assert list(zip(on["kind"], on["name"], on["weight"].round(6))) == [
        ("cpu", "aten::mm", 5.0),
        ("launch delay", "", 15.0),
        ("gpu", "sm80_xmma_gemm", 400.0),
        ("gpu", "vectorized_elementwise_kernel", 400.0),
        ("cpu", "aten::sum", 10.0),
    ]
    assert "sync" in set(cp.edges["kind"])  # the GPU's end reaches the host through the sync
    bound = cp.by_bound()
    assert bound == pytest.approx({"cpu_bound": 100 * 15 / 830, "gpu_kernel_launch_overhead": 100 * 15 / 830,
                                   "gpu_compute_bound": 100 * 800 / 830})  # fmt: skip
    cats = cp.by_category().set_index("category")["us"].to_dict()
    assert cats == pytest.approx({"matmul": 400, "elementwise/activation": 400, "CPU": 15, "launch delay": 15})
    assert set(cp.items()["name"]) == {"sm80_xmma_gemm", "vectorized_elementwise_kernel", "aten::mm", "aten::sum"}


def test_a_cpu_bound_step_leaves_the_host_at_its_last_launch(tmp_path):
    """Two 300 us operators each launching a 10 us kernel near their end: the host's 590 us up to
    the second launch, its 10 us launch delay and the kernel: 610 us, the first kernel off the path."""
    ev = [step(1, 0, 700)]
    ev += [op("aten::mm", 0, 300, 11), launch(1, 290, ext=11), kernel("k_first", 1, 295, 10, ext=11)]
    ev += [op("aten::add", 300, 300, 12), launch(2, 590, ext=12), kernel("k_last", 2, 600, 10, ext=12)]
    _, cp = path_of(tmp_path, ev)
    assert cp.length_us == pytest.approx(610)
    assert cp.by_bound() == pytest.approx({"cpu_bound": 100 * 590 / 610, "gpu_kernel_launch_overhead": 100 * 10 / 610,
                                           "gpu_compute_bound": 100 * 10 / 610})  # fmt: skip
    names = set(cp.edges["name"])
    assert "k_last" in names and "k_first" not in names
    charged = cp.edges[cp.edges["kind"] == "cpu"].groupby("name")["weight"].sum().to_dict()
    # mm's own time around its launch call, the call's own 4 us, add's time up to its launch call
    assert charged == pytest.approx({"aten::mm": 296, "cudaLaunchKernel": 4, "aten::add": 290})


def test_a_stream_wait_event_makes_the_waiting_kernel_follow_the_other_stream(tmp_path):
    """A 100 us GEMM on stream 7 (20-120); an event recorded after it; stream 20 waits on the event
    and its all-reduce, launched at 14, runs 125-175.  The all-reduce's start is reached from the
    GEMM's end by the sync edge, not from its launch: 5 + 15 + 100 + 50 = 170."""
    ev = [step(1, 0, 400)]
    ev += [op("aten::mm", 0, 10, 11), launch(1, 5, ext=11, dur=3), kernel("sm80_xmma_gemm", 1, 20, 100, ext=11)]
    wait = sync("Stream Wait Event", 3, 11, 1, stream=20, wait_on_stream=7, wait_on_cuda_event_record_corr_id=2)
    ev += [rt("cudaEventRecord", 2, 9, 1), rt("cudaStreamWaitEvent", 3, 11, 1), wait]
    ev += [launch(4, 14, dur=3), kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 4, 125, 50, stream=20)]
    _, cp = path_of(tmp_path, ev)
    assert cp.length_us == pytest.approx(170)
    kinds = [k for k in cp.edges["kind"] if k != "dependency"]
    assert kinds == ["cpu", "launch delay", "gpu", "sync", "gpu"]
    assert cp.by_bound()["gpu_communication_bound"] == pytest.approx(100 * 50 / 170)
    # without the wait the all-reduce is reached from its own launch: the host's 11 us up to it, a
    # 111 us launch delay, the kernel
    ev_no_wait = [e for e in ev if e.get("cat") != "cuda_sync"]
    _, cp2 = path_of(tmp_path, ev_no_wait)
    assert "sync" not in set(cp2.edges["kind"]) and cp2.length_us == pytest.approx(11 + 111 + 50)


def test_a_blocking_call_counts_no_host_time_and_gaps_between_ops_count_nothing(tmp_path):
    """cudaStreamSynchronize (10-500) blocks on a 480 us kernel: its own 490 us is not CPU work;
    the 1000 us idle gap before aten::add is nobody's work (a 0-weight dependency)."""
    ev = [
        step(1, 0, 2000),
        op("aten::mm", 0, 10, 11),
        launch(1, 2, ext=11),
        kernel("sm80_xmma_gemm", 1, 15, 480, ext=11),
    ]
    ev += [rt("cudaStreamSynchronize", 2, 10, 490), sync("Stream Sync", 2, 10, 490), op("aten::add", 1500, 20, 12)]
    _, cp = path_of(tmp_path, ev)
    assert cp.length_us == pytest.approx(2 + 13 + 480 + 20)  # mm before launch, delay, kernel, add
    charged = cp.by_event().set_index("name")["us"].to_dict()
    assert charged == pytest.approx({"sm80_xmma_gemm": 480, "aten::add": 20, "aten::mm": 2, "": 13})


def test_step_choice_no_steps_and_a_bad_step(tmp_path):
    ev = [op("aten::mm", 0, 10, 11), launch(1, 5, ext=11), kernel("sm80_xmma_gemm", 1, 20, 40, ext=11)]
    _, cp = path_of(tmp_path, ev)
    assert cp.step == 0 and cp.length_us == pytest.approx(5 + 15 + 40)
    ev = [step(1, 0, 100), step(2, 100, 300), step(3, 400, 200)]
    ta, cp = path_of(tmp_path, ev + [op("aten::mm", 110, 10, 11)])
    assert cp.step == 3  # the median-duration step
    with pytest.raises(ConfigError, match="step"):
        critical_path(ta.traces[0], ta.attributed(0), 9)
    assert critical_path(ta.traces[0], ta.attributed(0), 2).length_us == pytest.approx(10)


def _nested(rng, tid, t0, t1, depth, out):
    """Non-overlapping ops nested inside [t0, t1) on thread ``tid``, integer times; returns the time
    each op holds for itself (its duration minus its children's), keyed by name."""
    own = {}
    t = t0 + int(rng.integers(0, 3))
    while t < t1 - 2 and len(out) < 400:
        dur = int(rng.integers(2, max(3, (t1 - t) // 2 + 1)))
        name = f"op{len(out)}"
        out.append(op(name, t, dur, 100_000 + len(out), tid=tid))
        inner = _nested(rng, tid, t, t + dur, depth - 1, out) if depth > 1 and dur > 6 else {}
        own.update(inner)
        kids = _children_of(out, name, tid)
        own[name] = dur - sum(e["dur"] for e in out if e["name"] in kids)
        t += dur + int(rng.integers(0, 4))
    return own


def _children_of(events, name, tid):
    """Names of the direct children of op ``name``: the ops inside it on its thread with no op between."""
    me = next(e for e in events if e["name"] == name)
    inside = [e for e in events if e["tid"] == tid and e is not me and me["ts"] <= e["ts"]
              and e["ts"] + e["dur"] <= me["ts"] + me["dur"]]  # fmt: skip
    return {e["name"] for e in inside
            if not any(o is not e and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"]
                       for o in inside)}  # fmt: skip


def test_a_cpu_only_step_is_its_busiest_thread_charged_to_each_ops_own_time(tmp_path):
    """Random nested ops on three threads, no GPU: every thread's ops chain start to end, a gap
    between two top-level ops weighs nothing, so the path is the thread whose top-level ops hold
    the most time, and each op on it is charged its own time (its duration minus its children's)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    events, threads = [step(1, 0, 3000)], {}
    for tid in (11, 12, 13):
        before = len(events)
        own = _nested(rng, tid, 0, int(rng.integers(600, 2900)), 3, events)
        top = [
            e
            for e in events[before:]
            if not any(
                o is not e and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"] for o in events[before:]
            )
        ]
        threads[tid] = (sum(e["dur"] for e in top), own)  # fmt: skip
    busiest = max(threads, key=lambda t: threads[t][0])
    _, cp = path_of(tmp_path, events)
    assert cp.length_us == pytest.approx(threads[busiest][0]), seed
    charged = cp.by_event(n=10_000).set_index("name")["us"].to_dict()
    want = {k: v for k, v in threads[busiest][1].items() if v > 0}
    assert charged == pytest.approx(want), seed
    assert set(cp.edges.loc[cp.edges["weight"] > 0, "where"]) == {f"thread {busiest}"}, seed
