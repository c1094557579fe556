"""lab_utils.traces.critical_path on hand-built steps whose longest path is known by construction:
a kernel queued behind another (a kernel gap, charged to the kernel before it), a host that waits on
an event, a stream sync that waits on its own stream only, a CUDA graph's kernels under one launch
(all of them, or HolisticTraceAnalysis's last one), each table's shares of the path; a launch at
the previous kernel's end itself (a kernel gap) and after it (a launch delay), each edge's stream and
times, a sync whose call is outside the step, and every blocking call's time left to the GPU."""

from __future__ import annotations

import pytest

from lab_utils.traces import TraceAnalysis
from lab_utils.traces.critical_path import critical_path

from .kineto import kernel, launch, op, runtime, step, sync, write


def path_of(tmp_path, events, name="t.json", **kw):
    ta = TraceAnalysis(write(tmp_path / name, events), workers=1)
    return critical_path(ta.traces[0], ta.attributed(0), **kw)


QUEUED = [
    step(1, 0, 400),
    op("aten::mm", 0, 10, 11), launch(1, 2, ext=11), kernel("sm90_xmma_gemm", 1, 20, 100, ext=11),
    op("aten::add", 21, 10, 12), launch(2, 25, ext=12), kernel("vectorized_elementwise_kernel", 2, 130, 20, ext=12),
    op("aten::detach", 50, 0, 13),  # no duration: no node
]  # fmt: skip


def test_a_queued_kernel_follows_the_one_before_it_by_a_kernel_gap(tmp_path):
    """mm's 2 us before its launch, an 18 us launch delay, the GEMM (20..120), a 10 us gap, the add
    kernel (130..150), launched at 25 behind the running GEMM: 2 + 18 + 100 + 10 + 20 = 150."""
    cp = path_of(tmp_path, QUEUED)
    assert cp.length_us == pytest.approx(150) and cp.window_us == 400
    on = cp.edges[cp.edges["weight"] > 0]
    assert list(zip(on["kind"], on["name"], on["weight"])) == [
        ("cpu", "aten::mm", 2.0), ("launch delay", "", 18.0), ("gpu", "sm90_xmma_gemm", 100.0),
        ("kernel gap", "sm90_xmma_gemm", 10.0), ("gpu", "vectorized_elementwise_kernel", 20.0)]  # fmt: skip
    assert on["where"].tolist() == ["thread 1", "", "stream 7", "stream 7", "stream 7"]
    assert cp.by_bound() == pytest.approx({"cpu_bound": 100 * 2 / 150, "gpu_kernel_launch_overhead": 100 * 18 / 150,
                                           "gpu_compute_bound": 100 * 120 / 150,
                                           "gpu_kernel_kernel_overhead": 100 * 10 / 150})  # fmt: skip
    cats = cp.by_category().set_index("category")
    assert cats["us"].to_dict() == pytest.approx({"matmul": 100, "elementwise/activation": 20, "launch delay": 18,
                                                  "kernel gap": 10, "CPU": 2})  # fmt: skip
    assert cats["pct"].to_dict() == pytest.approx({k: 100 * v / 150 for k, v in cats["us"].items()})
    assert cats.index.tolist()[0] == "matmul" and cats.loc["matmul", "edges"] == 1
    ev = cp.by_event().set_index("name")
    assert ev["us"].to_dict() == pytest.approx({"sm90_xmma_gemm": 110, "vectorized_elementwise_kernel": 20, "": 18,
                                                "aten::mm": 2})  # fmt: skip
    assert ev["pct"].to_dict() == pytest.approx({k: 100 * v / 150 for k, v in ev["us"].items()})
    assert len(cp.by_event(2)) == 2
    items = cp.items().set_index("name")
    assert items["us"].to_dict() == pytest.approx({"sm90_xmma_gemm": 100, "vectorized_elementwise_kernel": 20,
                                                   "aten::mm": 2})  # fmt: skip
    assert items["pct"].to_dict() == pytest.approx({k: 100 * v / 150 for k, v in items["us"].items()})
    assert items.loc["aten::mm", "kind"] == "cpu" and items.loc["aten::mm", "count"] == 1
    # nodes: start and end of mm, add and the two launch calls (not the 0 us detach), and of both kernels
    assert cp.nodes == 12


def test_an_event_sync_brings_the_kernels_end_onto_the_host(tmp_path):
    """The host records an event after the GEMM's launch and blocks on it (12..230): the add after it
    starts when the GEMM ends: 2 + 18 + 200 + 10 = 230; without the Event Sync the path ends with the GEMM."""
    ev = [step(1, 0, 400), op("aten::mm", 0, 10, 11), launch(1, 2, ext=11), kernel("sm90_gemm", 1, 20, 200, ext=11),
          runtime("cudaEventRecord", 2, 11, 1), runtime("cudaEventSynchronize", 3, 12, 218),
          op("aten::add", 230, 10, 12)]  # fmt: skip
    waited = sync("Event Sync", 3, 12, 218, stream=7, wait_on_stream=7, wait_on_cuda_event_record_corr_id=2)
    cp = path_of(tmp_path, ev + [waited])
    assert cp.length_us == pytest.approx(230)
    assert cp.edges[cp.edges["weight"] > 0]["name"].tolist() == ["aten::mm", "", "sm90_gemm", "aten::add"]
    assert "sync" in set(cp.edges["kind"])
    alone = path_of(tmp_path, ev, name="n.json")
    assert alone.length_us == pytest.approx(220) and "aten::add" not in set(alone.edges["name"])


def test_a_stream_sync_waits_for_its_own_stream_and_a_context_sync_for_all(tmp_path):
    """A 100 us kernel on stream 7 and a 300 us one on stream 9; the host syncs stream 7 (10..130) and
    runs a 10 us add: the path is the 300 us kernel's (4 + 16 + 300); a context sync would wait for it
    and put the add after it (330)."""
    ev = [step(1, 0, 600), op("aten::mm", 0, 10, 11), launch(1, 2, dur=1, ext=11), kernel("k7", 1, 20, 100, ext=11),
          launch(2, 4, dur=1, ext=11), kernel("k9", 2, 20, 300, stream=9, ext=11),
          runtime("cudaStreamSynchronize", 3, 10, 120), op("aten::add", 130, 10, 12)]  # fmt: skip
    cp = path_of(tmp_path, ev + [sync("Stream Sync", 3, 10, 120, stream=7)])
    assert cp.length_us == pytest.approx(320)
    assert cp.edges[cp.edges["weight"] > 0]["name"].tolist()[-1] == "k9"
    ctx = path_of(tmp_path, ev + [sync("Context Sync", 3, 10, 120, stream=7)], name="c.json")
    assert (
        ctx.length_us == pytest.approx(330) and ctx.edges[ctx.edges["weight"] > 0]["name"].tolist()[-1] == "aten::add"
    )


def test_a_graph_launch_keeps_every_kernel_or_only_the_last_as_hta_does(tmp_path):
    ev = [step(1, 0, 100), runtime("cudaGraphLaunch", 1, 5, 3)]
    ev += [kernel(f"graph_k{i}", 1, 20 + 10 * i, 10) for i in range(3)]
    every = path_of(tmp_path, ev)
    assert every.length_us == pytest.approx(30)  # back to back, each after the one before
    assert every.edges.loc[every.edges["kind"] == "gpu", "name"].tolist() == ["graph_k0", "graph_k1", "graph_k2"]
    hta = path_of(tmp_path, ev, name="h.json", hta=True)
    assert hta.length_us == pytest.approx(10) and set(hta.edges.loc[hta.edges["kind"] == "gpu", "name"]) == {"graph_k2"}
    assert hta.nodes == every.nodes - 4  # two kernels fewer, two nodes each


@pytest.mark.parametrize("launch_ts, length", [(100.0, 130.0), (100.5, 100.0)])
def test_a_launch_as_the_stream_drains_is_a_kernel_gap_after_it_a_launch_delay(tmp_path, launch_ts, length):
    """k1 runs 10..100; aten::add launches k2 (120..130) at 100 or 100.5.  Launched while k1 has not
    yet finished (at its end itself) k2 follows k1 by a 20 us kernel gap: 2 + 8 + 90 + 20 + 10 = 130;
    launched after it, k2 follows its launch call by a launch delay, from the host's 15.5 us (mm's
    10, add's 5.5 up to the call): 45 us, so the path ends with k1 at 100."""
    ev = [step(1, 0, 400), op("aten::mm", 0, 10, 11), launch(1, 2, ext=11), kernel("k1", 1, 10, 90, ext=11),
          op("aten::add", 95, 10, 12), launch(2, launch_ts, ext=12), kernel("k2", 2, 120, 10, ext=12)]  # fmt: skip
    cp = path_of(tmp_path, ev)
    assert cp.length_us == pytest.approx(length)
    e = cp.edges
    assert e["kind"].tolist()[:3] == ["cpu", "launch delay", "gpu"]
    assert e[["start_us", "end_us"]].to_numpy().tolist()[:3] == [[0, 2], [2, 10], [10, 100]]
    if length == 130:
        assert e["kind"].tolist()[3:] == ["kernel gap", "gpu"] and e["weight"].tolist()[3] == 20
        assert e[["start_us", "end_us"]].to_numpy().tolist()[3:] == [[100, 120], [120, 130]]
    else:
        assert len(e) == 3
    # a host edge and a launch delay have no stream; a kernel and the gap charged to it have its own
    assert e["stream"].tolist() == [-1, -1, 7] + [7, 7] * (length == 130)
    assert e["where"].tolist()[:3] == ["thread 1", "", "stream 7"]


def test_a_sync_whose_call_is_outside_the_step_or_absent_adds_nothing(tmp_path):
    """Step 1 (0..100) holds a 50 us kernel; the cudaDeviceSynchronize that waits for it is in step 2,
    and a Context Sync carries the id of no call: step 1's path is 2 + 8 + 50; step 2's the host's
    20 us sync call, its time the GPU's (0 us) with nothing of step 1's GPU work in its window."""
    ev = [step(1, 0, 100), step(2, 100, 100), op("aten::mm", 0, 10, 11), launch(1, 2, ext=11),
          kernel("k1", 1, 10, 50, ext=11), runtime("cudaDeviceSynchronize", 5, 150, 20),
          sync("Context Sync", 5, 150, 20), sync("Context Sync", 77, 60, 5)]  # fmt: skip
    cp = path_of(tmp_path, ev, step=1)
    assert cp.length_us == pytest.approx(60) and cp.step == 1 and "sync" not in set(cp.edges["kind"])
    two = path_of(tmp_path, ev, name="s2.json", step=2)
    assert two.length_us == 0 and two.nodes == 2  # the sync call's start and end


BLOCKING_CALLS = ["cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventQuery", "cudaEventSynchronize",
                  "cudaMemcpy", "cudaMemcpyAsync", "hipDeviceSynchronize", "hipStreamSynchronize", "hipEventQuery",
                  "hipEventSynchronize", "hipMemcpy", "hipMemcpyAsync"]  # fmt: skip


@pytest.mark.parametrize("call", BLOCKING_CALLS + ["cudaStreamGetPriority", "cudaEventRecord"])
def test_a_blocking_call_is_not_host_work_and_other_calls_are(tmp_path, call):
    """aten::item (0..110) holds a 100 us call (5..105), then aten::add (120..130) after a 10 us gap
    (nobody's work): a blocking call leaves item's own 10 us and add's 10 (20 us); any other call
    is 100 us of host work (120 us)."""
    ev = [step(1, 0, 400), op("aten::item", 0, 110, 11), runtime(call, 1, 5, 100), op("aten::add", 120, 10, 12)]
    cp = path_of(tmp_path, ev)
    blocking = call in BLOCKING_CALLS
    assert cp.length_us == pytest.approx(20 if blocking else 120)
    charged = cp.edges[cp.edges["name"] != ""].groupby("name")["weight"].sum().to_dict()
    assert charged == pytest.approx({"aten::item": 10, "aten::add": 10, call: 0 if blocking else 100})
    assert (cp.edges["kind"] == "dependency").sum() == 1 and cp.nodes == 6
    # the tables count only time on the path: a blocking call's 0 us edge is in none of them
    assert (call in set(cp.items()["name"])) == (not blocking)
    assert (call in set(cp.by_event()["name"])) == (not blocking) and "" not in set(cp.by_event()["name"])
    cpu = cp.by_category().set_index("category").loc["CPU"]
    assert (cpu["edges"], cpu["us"]) == ((3, 20) if blocking else (4, 120))
    assert cp.items().set_index("name").loc["aten::item", "count"] == 2  # its time before and after the call
