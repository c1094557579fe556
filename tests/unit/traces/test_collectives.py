"""One rule of lab_utils.traces per test, on small traces written here in Kineto's CUDA trace format."""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pandas as pd
import pytest

from lab_utils.core.config import ConfigError
from lab_utils.traces import TraceAnalysis, read_job, read_rank
from lab_utils.traces import reader as reader_mod
from lab_utils.traces.categories import category, hta_type
from lab_utils.traces.collectives import (
    AlphaBeta,
    CollectiveEvent,
    aligned,
    events_of,
    fit_alpha_beta,
    parse_name,
    skew,
    straggler,
)


def step(n, ts, dur, tid=1):
    return {
        "ph": "X",
        "cat": "user_annotation",
        "name": f"ProfilerStep#{n}",
        "pid": 1,
        "tid": tid,
        "ts": ts,
        "dur": dur,
    }


def ann(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def op(name, ts, dur, ext, tid=1, **args):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {"External id": ext, **args}}  # fmt: skip


def launch(corr, ts, tid=1, ext=None, dur=4):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "External id": ext if ext is not None else corr}}  # fmt: skip


def kernel(name, corr, ts, dur, stream=7, cat="kernel", ext=None, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "External id": ext if ext is not None else corr, "stream": stream,
                     "device": 0, **args}}  # fmt: skip


def write(path, events, gz=False, literal=None, **meta):
    """``literal``: {"TS1": "1711964650123456.789"} puts number text a Python float cannot hold."""
    doc = {"schemaVersion": 1, **meta, "traceEvents": events, "traceName": "made by the tests"}
    text = json.dumps(doc, indent=1)
    for key, number in (literal or {}).items():
        text = text.replace(f'"{key}"', number)
    if gz:
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


def lagging(tmp_path):
    """Two steps; the GPU runs each kernel about one step after its launch."""
    ev = [step(1, 0, 100), step(2, 100, 100)]
    ev += [op("aten::mm", 40, 20, 11), launch(1, 50, ext=11), kernel("sm80_xmma_gemm", 1, 150, 30, ext=11)]
    ev += [op("aten::add", 140, 20, 12), launch(2, 150, ext=12), kernel("elementwise_kernel_add", 2, 300, 10, ext=12)]
    return write(tmp_path / "lag.json", ev, distributedInfo={"rank": 0, "world_size": 1})


def test_kernels_go_to_the_step_that_launched_them_not_the_one_they_ran_in(tmp_path):
    ta = TraceAnalysis(lagging(tmp_path))
    k = ta.kernels(0).set_index("correlation")
    assert k.loc[1, "step"] == 1 and k.loc[2, "step"] == 2  # by time: step 2 and none
    assert list(k["op"]) == ["aten::mm", "aten::add"]
    per = ta.kernels(0, "steps").groupby("step")["dur"].sum()
    assert per.to_dict() == {1: 30.0, 2: 10.0}
    assert k.loc[1, "queue_delay"] == 100.0


def test_kernels_launched_before_the_window_are_reported_apart(tmp_path):
    ev = [step(5, 100, 100), step(6, 200, 100), launch(10, 20), kernel("k_early", 10, 110, 5)]  # before the first step
    ev += [launch(11, 150), kernel("k_in", 11, 160, 5)]
    ev += [kernel("k_pretrace", 3, 101, 2)]  # no launch in the trace, older correlation id: before the trace
    ev += [kernel("k_orphan", 99, 170, 2)]  # no launch, newer id: no launch
    ta = TraceAnalysis(write(tmp_path / "pre.json", ev))
    w = ta.kernels(0).set_index("name")["window"].to_dict()
    assert w == {"k_early": "before", "k_in": "step", "k_pretrace": "before", "k_orphan": "no launch"}
    assert list(ta.kernels(0, "steps")["name"]) == ["k_in"]
    assert set(ta.kernels(0, "hta")["name"]) == {"k_early", "k_in"}  # HTA: launched in the trace, up to the last step
    windows = ta.windows().set_index("window")["count"].to_dict()
    assert windows == {"before": 2, "no launch": 1, "step": 1}


def test_backward_thread_launches_take_the_main_threads_ranges(tmp_path):
    ev = [step(1, 0, 300), ann("## forward ##", 10, 80), ann("## backward ##", 100, 150)]
    ev += [launch(1, 50, tid=1), kernel("fwd_k", 1, 60, 5)]
    ev += [launch(2, 120, tid=2), kernel("bwd_k", 2, 130, 5)]  # autograd's thread: no range of its own
    ev += [ann("nccl:all_reduce", 160, 20, tid=2), launch(3, 165, tid=2), kernel("ncclKernel_AllReduce", 3, 170, 5)]
    ev += [ann("double_blocks.3", 20, 30), launch(4, 30), kernel("blk_k", 4, 35, 2)]
    ta = TraceAnalysis(write(tmp_path / "bwd.json", ev))
    k = ta.kernels(0).set_index("name")
    assert k.loc["fwd_k", "phase"] == "forward"
    assert k.loc["bwd_k", "phase"] == "backward" and k.loc["bwd_k", "range"] == "## backward ##"
    assert k.loc["ncclKernel_AllReduce", "phase"] == "communication"  # its own thread's range wins
    assert k.loc["blk_k", "block"] == "double_blocks.3" and k.loc["blk_k", "phase"] == "forward"
    assert ta.attributed(0).main_tid == "1"


def test_a_trace_without_steps_is_one_window(tmp_path):
    ev = [
        op("aten::mm", 0, 10, 1),
        launch(1, 2, ext=1),
        kernel("gemm", 1, 20, 5),
        launch(2, 30),
        kernel("k2", 2, 40, 5),
    ]
    ta = TraceAnalysis(write(tmp_path / "nosteps.json", ev))
    k = ta.kernels(0, "steps")
    assert set(k["step"]) == {0} and len(k) == 2
    assert not ta.attributed(0).has_steps and len(ta.steps(0)) == 1
    assert "no steps" in ta.summary()


def test_json_gz_and_ns_float_timestamps_are_read_exactly(tmp_path):
    ev = [step(1, 1711964650123400, 100)]
    ev += [launch(1, "TS1"), kernel("k", 1, "TS2", 0.5)]
    digits = {"TS1": "1711964650123456.789", "TS2": "1711964650123457.001"}
    plain = read_rank(write(tmp_path / "a.json", ev, literal=digits))
    gz = read_rank(write(tmp_path / "rank-0.pt.trace.json.gz", ev, gz=True, literal=digits))
    for r in (plain, gz):
        t_launch = float(r.host.loc[r.host["cat"] == "cuda_runtime", "ts"].iloc[0])
        t_kernel = float(r.gpu["ts"].iloc[0])
        assert t_kernel - t_launch == pytest.approx(0.212, abs=1e-9)  # float64 of the absolute value: 0.25
        assert r.t0_us == 1711964650123400
    assert gz.gpu[["ts", "dur"]].equals(plain.gpu[["ts", "dur"]])


def test_streamed_blocks_cut_only_between_events(tmp_path, monkeypatch):
    ev = [step(1, 0, 1000)]
    for i in range(200):
        name = 'weird }, {"ph": name' if i % 7 == 0 else f"kernel_{i}"
        ev += [launch(i + 1, 2 * i), kernel(name, i + 1, 2 * i + 1, 1.0, input_dims=[[i, 2]])]
    path = write(tmp_path / "big.json", ev, distributedInfo={"rank": 3})
    whole = read_rank(path)
    monkeypatch.setattr(reader_mod, "BLOCK_BYTES", 97)
    streamed = read_rank(path)
    assert streamed.rank == whole.rank == 3
    assert len(streamed.gpu) == 200
    assert streamed.gpu["name"].astype(str).tolist() == whole.gpu["name"].astype(str).tolist()
    assert np.array_equal(streamed.gpu["ts"], whole.gpu["ts"])


def test_folder_ranks_come_from_distributed_info_else_the_file_name(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    write(job / "host_a.json", [step(1, 0, 10)], distributedInfo={"rank": 5})
    write(job / "trace_rank-2.json.gz", [step(1, 0, 10)], gz=True)
    assert sorted(read_job(job, workers=2)) == [2, 5]
    write(job / "other_rank2.json", [step(1, 0, 10)])
    with pytest.raises(ConfigError, match="rank 2"):
        read_job(job, workers=1)
    with pytest.raises(ConfigError, match="path"):
        read_job(tmp_path / "missing")


def test_nccl_kernel_arguments_and_names_give_size_algorithm_and_bus_bandwidth(tmp_path):
    ev = [step(1, 0, 1000)]
    ar_args = {"In msg nelems": 1 << 20, "Out msg nelems": 1 << 20, "dtype": "Float", "Group size": 4}
    ar_name = "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)"
    ev += [launch(1, 10), kernel(ar_name, 1, 20, 100.0, **ar_args, **{"Collective name": "allreduce"})]
    ag_args = {"In msg nelems": 1000, "Out msg nelems": 4000, "dtype": "BFloat16", "Group size": 4}
    ev += [op("record_param_comms", 200, 10, 77, **ag_args, **{"Collective name": "_allgather_base"})]
    ag_name = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    ev += [launch(2, 205, ext=77), kernel(ag_name, 2, 210, 50.0, ext=77)]
    ev += [launch(3, 300), kernel("sm80_xmma_gemm_bf16", 3, 230, 40.0)]  # computation under the all-gather
    ta = TraceAnalysis(write(tmp_path / "nccl.json", ev, distributedInfo={"rank": 0, "world_size": 4}))
    c = ta.collectives().set_index("collective")
    ar, ag = c.loc["all_reduce"], c.loc["all_gather"]
    assert (ar["algorithm"], ar["protocol"], ar["redop"], ar["dtype"]) == ("RING", "LL", "Sum", "float")
    assert ar["bytes"] == 4 * (1 << 20)
    assert ar["algbw_gbps"] == pytest.approx(4 * (1 << 20) / 100e3)
    assert ar["busbw_gbps"] == pytest.approx(ar["algbw_gbps"] * 2 * 3 / 4)
    assert ag["bytes"] == 2 * 4000  # all-gather moves its output; size from the host call's record
    assert ag["busbw_gbps"] == pytest.approx(8000 / 50e3 * 3 / 4)
    assert ag["hidden_us"] == pytest.approx(30.0) and ag["exposed_us"] == pytest.approx(20.0)
    assert parse_name("ncclDevKernel_ReduceScatter_Sum_bf16_TREE_LL128(x)")["algorithm"] == "TREE"
    assert parse_name("ncclDevKernel_ReduceScatter_Sum_bf16_TREE_LL128(x)")["protocol"] == "LL128"


def test_overlap_uses_gpu_events_only(tmp_path):
    """A host-side nccl:* range is not communication: no NCCL kernel, no overlap figure."""
    ev = [step(1, 0, 1000), ann("nccl:all_reduce", 0, 900), launch(1, 10), kernel("gemm_kernel", 1, 20, 500)]
    ta = TraceAnalysis(write(tmp_path / "hostnccl.json", ev))
    assert math.isnan(ta.overlap().loc[0, "overlap_pct"])
    assert ta.shares().loc[0, "COMMUNICATION"] == 0.0


def test_temporal_split_overlap_and_idle_host_wait_by_hand(tmp_path):
    ev = [step(1, 0, 1000)]
    ev += [launch(1, 0), kernel("gemm_a", 1, 100, 100)]  # compute [100, 200)
    ev += [launch(2, 0), kernel("ncclKernel_SendRecv", 2, 150, 100, stream=9)]  # comm [150, 250): half hidden
    ev += [launch(3, 280), kernel("Memcpy HtoD (Pinned -> Device)", 3, 300, 50, cat="gpu_memcpy", stream=10)]
    ev += [launch(4, 0), kernel("gemm_b", 4, 400, 100)]  # queued long before: the gap before it is not host wait
    ta = TraceAnalysis(write(tmp_path / "split.json", ev))
    t = ta.temporal().loc[0]
    assert t["span"] == 400 and t["busy"] == 300 and t["idle"] == 100
    assert (t["compute"], t["communication"], t["memory"]) == (200, 50, 50)
    assert ta.overlap().loc[0, "overlap_pct"] == pytest.approx(50.0)
    idle = ta.idle().loc[0]
    assert idle["host_wait"] == pytest.approx(30.0)  # gap [250, 300): memcpy launched at 280
    assert idle["other_wait"] == pytest.approx(70.0)  # gap [350, 400) and the rest of [250, 300)
    top = ta.top_kernels(0, 2)
    assert list(top["name"]) == ["gemm_a", "gemm_b"] or list(top["name"]) == ["gemm_a", "ncclKernel_SendRecv"]


def test_launch_bound_verdict(tmp_path):
    ev = [step(1, 0, 10_000)]
    for i in range(50):  # short kernels launched one by one, each only after the previous ended
        ev += [launch(i + 1, 100 * i), kernel(f"tiny_{i % 3}", i + 1, 100 * i + 8, 3)]
    ls = TraceAnalysis(write(tmp_path / "lb.json", ev)).launch_stats().loc[0]
    assert ls["launch_bound"] and ls["short_share"] == 1.0 and ls["queue_length_median"] == 0
    ev = [step(1, 0, 10_000)] + [
        x for i in range(50) for x in (launch(i + 1, i), kernel("big", i + 1, 10 + 100 * i, 100))
    ]
    ls = TraceAnalysis(write(tmp_path / "busy.json", ev)).launch_stats().loc[0]
    assert not ls["launch_bound"] and "idle" in ls["reason"]


def test_cross_rank_skew_and_straggler():
    import pandas as pd

    def c(starts, ends):
        return pd.DataFrame({"collective": "all_reduce", "pg_name": "0", "ts": starts, "end": ends, "bytes": 8.0})

    per = {0: c([0.0, 100.0, 200.0], [50.0, 150.0, 250.0]), 1: c([30.0, 140.0, 225.0], [50.0, 150.0, 250.0])}
    sk = skew(per, {0: 0.0, 1: 0.0})
    assert list(sk["skew_us"]) == [30.0, 40.0, 25.0] and list(sk["last_rank"]) == [1, 1, 1]
    assert list(sk["wait_us_rank0"]) == [30.0, 40.0, 25.0] and list(sk["transfer_us"]) == [20.0, 10.0, 25.0]
    assert straggler(sk, 2).rank == 1
    assert straggler(skew(per, {0: 0.0, 1: -100.0}), 2).rank == 0  # clock offsets apply: rank 1 now arrives first
    alternating = {0: c([0.0, 100.0], [50.0, 150.0]), 1: c([10.0, 90.0], [50.0, 150.0])}
    assert straggler(skew(alternating, {0: 0.0, 1: 0.0}), 2).rank is None


@pytest.mark.parametrize(
    "name,kind,cat,hta",
    [
        ("void split_embedding_codegen_forward_unweighted_kernel<float, float, float, false, long>(x)", "kernel",
         "embedding", "COMPUTATION"),
        ("Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1_SN_LDSB0", "kernel", "matmul", "COMPUTATION"),
        ("Cijk_Ailk_Bjlk_HHS_BH_MT128x128x32_MI32x32x8x1_SN", "kernel", "matmul", "COMPUTATION"),
        ("triton_poi_fused_add_mul_0", "kernel", "elementwise/activation", "COMPUTATION"),
        ("triton_red_fused_sum_1", "kernel", "reduction", "COMPUTATION"),
        ("triton__0d1d2d3d", "kernel", "fused (triton)", "COMPUTATION"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
         "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)", "kernel",
         "reduction", "COMPUTATION"),
        ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "kernel", "communication",
         "COMMUNICATION"),
        ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", "memcpy", "MEMORY"),
        ("Memset (Device)", "gpu_memset", "memset", "MEMORY"),
        ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
         "::{lambda()#3}::operator()() const::{lambda(float)#1}>(int)", "kernel", "copy/cast", "COMPUTATION"),
        ("void fbgemm_gpu::permute_2D_lengths_kernel<int>(int, int, int const*, int const*, int*)", "kernel",
         "copy/cast", "COMPUTATION"),
        ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>(Flash_fwd_params)", "kernel", "attention",
         "COMPUTATION"),
        ("Stream Sync", "cuda_sync", "other", "OTHER"),
    ],
)  # fmt: skip
def test_categories_on_real_kernel_names(name, kind, cat, hta):
    assert category(name, kind) == cat
    assert hta_type(name) == hta


def test_rocm_trace_stream_0_kernels_are_attributed_by_launch(tmp_path):
    ev = [step(1, 0, 100), op("aten::addmm", 10, 20, 5), launch(1, 15, ext=5)]
    ev += [kernel("Cijk_Alik_Bljk_SB_MT64x16x32", 1, 40, 12.5, stream=0, ext=5)]
    props = [{"id": 0, "name": "AMD Instinct MI250X", "numSms": 110}]
    ta = TraceAnalysis(write(tmp_path / "rocm.json", ev, deviceProperties=props))
    k = ta.kernels(0, "steps")
    assert list(k["step"]) == [1] and list(k["category"]) == ["matmul"]
    assert ta.traces[0].vendor == "rocm"


def test_alpha_beta_fit_is_the_one_lab_06_uses():
    from lab_utils.distributed import comm
    from lab_utils.traces import collectives

    assert comm.fit_alpha_beta is collectives.fit_alpha_beta and comm.AlphaBeta is collectives.AlphaBeta
    ev = [collectives.CollectiveEvent("all_reduce", b, 0.0, 5.0 + 1e-3 * b) for b in (1_000, 10_000, 100_000) * 2]
    fit = collectives.fit_alpha_beta(ev)["all_reduce"]
    assert fit.alpha_us == pytest.approx(5.0) and fit.beta_us_per_byte == pytest.approx(1e-3)


def test_the_labs_own_trace_reader_uses_these_rules(tmp_path):
    """lab_utils.profiling.traces (lab 01's profiler) reads .json.gz, a trace without steps,
    and charges a kernel to the step that launched it, through this package."""
    from lab_utils.profiling.traces import analyse_trace

    src = json.loads(lagging(tmp_path).read_text())
    gz = write(tmp_path / "lag.pt.trace.json.gz", src["traceEvents"], gz=True)
    a = analyse_trace(gz)
    by = a.categories_by_step.set_index(["step", "category"])["ms"]
    assert by[(1, "matmul")] == pytest.approx(0.03) and by[(2, "matmul")] == 0.0
    ev = [op("aten::mm", 0, 10, 1), launch(1, 2, ext=1), kernel("gemm", 1, 20, 5)]
    one = analyse_trace(write(tmp_path / "nosteps.json", ev))
    assert list(one.steps["step"]) == [0] and one.categories.set_index("category").loc["matmul", "ms"] == 0.005


def test_reading_memory_stays_bounded_by_the_kept_events(tmp_path, monkeypatch):
    """Streamed in blocks: the peak stays below the JSON's size and a third of what ``json.loads``
    of the same text needs (its Python objects)."""
    import tracemalloc

    ev = [step(1, 0, 10**7)]
    for i in range(20_000):
        name = f"void some_templated_kernel<float, {i % 50}>(Params)"
        ev += [launch(i + 1, 10 * i), kernel(name, i + 1, 10 * i + 5, 3)]
    path = write(tmp_path / "many.json", ev)
    size = path.stat().st_size
    monkeypatch.setattr(reader_mod, "BLOCK_BYTES", 256 << 10)
    peaks = {}
    for how, fn in (("json", lambda: json.loads(path.read_bytes())), ("perflab", lambda: read_rank(path))):
        tracemalloc.start()
        try:
            out = fn()
            peaks[how] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert len(out.gpu) == 20_000 and len(out.host) == 20_001
    assert peaks["perflab"] < size, f"peak {peaks['perflab'] / 1e6:.1f} MB for a {size / 1e6:.1f} MB trace"
    assert peaks["perflab"] < peaks["json"] / 3, peaks


def test_roofline_per_op_from_recorded_shapes_against_the_traced_gpu(tmp_path):
    m, n, k = 1024, 2048, 512
    ev = [step(1, 0, 1000)]
    ev += [op("aten::mm", 10, 20, 5, **{"Input Dims": [[m, k], [k, n]], "Input type": ["c10::BFloat16"] * 2})]
    ev += [launch(1, 12, ext=5), kernel("sm80_xmma_gemm_bf16bf16", 1, 40, 100.0, ext=5)]
    ev += [op("aten::add", 200, 20, 6, **{"Input Dims": [[m, n], [m, n], []], "Input type": ["float", "float", ""]})]
    ev += [launch(2, 205, ext=6), kernel("vectorized_elementwise_kernel<add>", 2, 300, 50.0, ext=6)]
    props = [{"id": 0, "name": "NVIDIA A100-SXM4-80GB"}]
    ta = TraceAnalysis(write(tmp_path / "roof.json", ev, deviceProperties=props))
    rf = ta.roofline(0).set_index("op")
    mm = rf.loc["aten::mm"]
    assert mm["flops"] == 2 * m * n * k and mm["bytes"] == 2 * (m * k + k * n + m * n)
    assert mm["tflops"] == pytest.approx(2 * m * n * k / 100e-6 / 1e12)
    assert mm["peak_tflops"] == 312.0 and mm["bound"] == "compute"  # A100 bf16 dense; intensity ~ 293 > ridge 153
    assert mm["pct_of_peak"] == pytest.approx(100 * mm["tflops"] / 312.0)
    add = rf.loc["aten::add"]
    assert add["bytes"] == 3 * m * n * 4 and add["bound"] == "memory"
    assert add["pct_of_peak"] == pytest.approx(100 * (3 * m * n * 4 / 50e-6) / 2039e9)


def test_records_carry_each_step_as_a_sample(tmp_path):
    from lab_utils.core.records import Recorder

    ta = TraceAnalysis(lagging(tmp_path))
    rows = {r["metric"]: r for r in ta.record(Recorder("09_traces")).rows}
    kt = rows["kernel_time"]
    assert kt["variant"] == "rank0" and kt["samples"] == [0.03, 0.01] and kt["value"] == pytest.approx(0.02)
    assert rows["category:matmul"]["samples"] == [0.03, 0.0]
    assert {"span", "idle_share", "compute_share"} <= set(rows) and "comm_overlap" not in rows  # no comm: no figure
    assert rows["idle_share"]["unit"] == "% of span" and rows["span"]["unit"] == "ms"


def test_alpha_beta_fit_reads_the_median_duration_at_each_size():
    """At each size four calls on the line 5 us + 1e-3 us/B and one stalled 100x: the median per
    size is on the line, so the fit recovers it exactly (a mean would be 20.8x the line)."""
    from lab_utils.traces.collectives import CollectiveEvent, fit_alpha_beta

    ev = []
    for b in (1_000, 10_000, 100_000):
        d = 5.0 + 1e-3 * b
        ev += [CollectiveEvent("all_reduce", b, 0.0, d)] * 4 + [CollectiveEvent("all_reduce", b, 0.0, 100 * d)]
    fit = fit_alpha_beta(ev)["all_reduce"]
    assert fit.alpha_us == pytest.approx(5.0) and fit.beta_us_per_byte == pytest.approx(1e-3)
    assert fit.n_events == 15


def test_transfer_is_the_median_over_ranks():
    """Three ranks start at 0, 10 and 30 us (the last arrival at 30) and end at 40, 50 and 120:
    their transfers after the last arrival are 10, 20 and 90 us, median 20 (mean 40)."""
    import pandas as pd

    per = {
        r: pd.DataFrame({"collective": "all_reduce", "pg_name": "0", "ts": [s], "end": [e], "bytes": 8.0})
        for r, (s, e) in enumerate([(0.0, 40.0), (10.0, 50.0), (30.0, 120.0)])
    }
    sk = skew(per, dict.fromkeys(per, 0.0))
    assert list(sk["skew_us"]) == [30.0] and list(sk["transfer_us"]) == [20.0] and list(sk["last_rank"]) == [2]


@pytest.mark.parametrize("last,n_ranks,rank", [([1, 1, 0, 2], 4, 1), ([1, 0, 2], 4, None), ([1, 1, 1, 0], 4, 1)])
def test_a_rank_last_in_exactly_half_of_the_collectives_is_the_straggler(last, n_ranks, rank):
    """The rule: last in at least half of the collectives (and more often than 1.5 / n), with a
    median skew of at least 10 % of the median transfer.  Half (2 of 4) is enough; a third is not."""
    import pandas as pd

    sk = pd.DataFrame({"skew_us": 50.0, "transfer_us": 100.0, "last_rank": last})
    assert straggler(sk, n_ranks).rank == rank


# nccl-tests' doc/PERFORMANCE.md: busBw = algBw x this factor of the rank count n, algBw = S / t
# (S: the message, the input of an all-reduce, reduce-scatter, all-to-all, broadcast, reduce and
# send/recv, the output of an all-gather)
NCCL_TESTS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
                     "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
                     "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "send_recv": lambda n: 1.0}  # fmt: skip
NCCL_KERNEL = {"all_reduce": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all_gather": "ncclDevKernel_AllGather_RING_LL",
               "reduce_scatter": "ncclKernel_ReduceScatter_RING_SIMPLE_Sum_float",
               "all_to_all": "ncclDevKernel_SendRecv", "broadcast": "ncclDevKernel_Broadcast_RING_LL",
               "reduce": "ncclDevKernel_Reduce_Sum_f32_RING_LL", "send_recv": "ncclDevKernel_SendRecv"}  # fmt: skip
ARG_NAME = {"all_to_all": "all_to_all", "send_recv": "send"}


@pytest.mark.parametrize("kind", sorted(NCCL_TESTS_FACTOR))
@pytest.mark.parametrize("n", [2, 8])
def test_bus_bandwidth_of_every_collective_is_nccl_tests(tmp_path, kind, n):
    """One 100 us call moving 8 MB (2 M floats in, or out for an all-gather; the other side n times
    larger or smaller): algbw 80 GB/s; busbw that times nccl-tests' factor for n ranks."""
    big, small = 2_000_000, 2_000_000 // n
    n_in, n_out = {"all_gather": (small, big), "reduce_scatter": (big, small)}.get(kind, (big, big))
    args = {"In msg nelems": n_in, "Out msg nelems": n_out, "dtype": "Float", "Group size": n}
    args["Collective name"] = ARG_NAME.get(kind, kind.replace("_", ""))
    ev = [step(1, 0, 1000), launch(1, 10), kernel(NCCL_KERNEL[kind], 1, 100, 100.0, **args)]
    c = TraceAnalysis(write(tmp_path / "t.json", ev), workers=1).collectives().iloc[0]
    assert c["collective"] == kind and c["bytes"] == 8_000_000 and c["group"] == n
    assert c["algbw_gbps"] == pytest.approx(80.0)
    assert c["bus_factor"] == pytest.approx(NCCL_TESTS_FACTOR[kind](n))
    assert c["busbw_gbps"] == pytest.approx(80.0 * NCCL_TESTS_FACTOR[kind](n))
    assert c["exposed_us"] == 100 and c["hidden_us"] == 0


# NCCL >= 2.19 kernel names end in the element type's short name (ncclDevKernel_AllReduce_Sum_f32_RING_LL)
NCCL_DTYPE_BYTES = {"i8": 1, "u8": 1, "i32": 4, "i64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "f8e4m3": 1,
                    "f8e5m2": 1}  # fmt: skip


@pytest.mark.parametrize("dtype", sorted(NCCL_DTYPE_BYTES))
def test_a_kernel_names_element_type_sizes_the_call(tmp_path, dtype):
    """An all-reduce of 1 M elements over 100 us whose size comes from its name's element type alone
    (no ``dtype`` argument): 1 M x the type's bytes, and algbw 1e6 x bytes / 100 us."""
    name = f"ncclDevKernel_AllReduce_Sum_{dtype}_RING_LL"
    args = {"In msg nelems": 1_000_000, "Out msg nelems": 1_000_000, "Group size": 2}
    ev = [step(1, 0, 1000), launch(1, 10), kernel(name, 1, 100, 100.0, **args)]
    c = TraceAnalysis(write(tmp_path / "t.json", ev), workers=1).collectives().iloc[0]
    assert c["dtype"] == dtype and c["bytes"] == 1_000_000 * NCCL_DTYPE_BYTES[dtype]
    assert c["algbw_gbps"] == pytest.approx(10.0 * NCCL_DTYPE_BYTES[dtype])


@pytest.mark.parametrize("kind", sorted(NCCL_TESTS_FACTOR))
def test_a_group_of_one_rank_has_no_bus_factor(tmp_path, kind):
    """A call in a group of one rank (``Group size`` 1): busbw is algbw (factor 1), not the 2(n-1)/n or
    (n-1)/n of a larger group, which would read 0 there.  8 MB in 100 us: 80 GB/s both."""
    n_in, n_out = 2_000_000, 2_000_000
    args = {"In msg nelems": n_in, "Out msg nelems": n_out, "dtype": "Float", "Group size": 1}
    args["Collective name"] = ARG_NAME.get(kind, kind.replace("_", ""))
    ev = [step(1, 0, 1000), launch(1, 10), kernel(NCCL_KERNEL[kind], 1, 100, 100.0, **args)]
    c = TraceAnalysis(write(tmp_path / "t.json", ev), workers=1).collectives().iloc[0]
    assert c["collective"] == kind and c["group"] == 1 and c["bus_factor"] == 1.0
    assert c["algbw_gbps"] == pytest.approx(80.0) and c["busbw_gbps"] == pytest.approx(80.0)


@pytest.mark.parametrize("group, world, factor", [(None, 8, 2 * 7 / 8), (4, 8, 2 * 3 / 4), (None, None, 1.0)])
def test_the_group_size_is_the_calls_else_the_jobs(tmp_path, group, world, factor):
    """An all-reduce of 4 MB (2 M bf16 in 50 us: 80 GB/s) without ``Group size`` counts the job's
    ranks (``distributedInfo.world_size``); without either it is 1 (no factor)."""
    args = {"In msg nelems": 2_000_000, "Out msg nelems": 2_000_000, "dtype": "BFloat16"}
    args |= {"Group size": group} if group else {}
    ev = [step(1, 0, 1000), launch(1, 10), kernel(NCCL_KERNEL["all_reduce"], 1, 100, 50.0, **args)]
    meta = {"distributedInfo": {"rank": 0, "world_size": world}} if world else {}
    c = TraceAnalysis(write(tmp_path / "t.json", ev, **meta), workers=1).collectives().iloc[0]
    assert c["bytes"] == 4_000_000 and c["algbw_gbps"] == pytest.approx(80.0)
    assert c["busbw_gbps"] == pytest.approx(80.0 * factor)


def test_bus_bandwidth_with_the_wait_and_from_the_transfer_alone():
    """An 8 MB all-reduce over 4 ranks (factor 1.5) arriving at 0, 100, 100, 100 (rank 0 waits
    100 us), every rank ending at 200: the transfer is 100 us: 80 GB/s x 1.5 = 120 GB/s; over each
    rank's whole call 60 GB/s (rank 0: 200 us) and 120 (the others): median 120."""
    per = {r: pd.DataFrame({"collective": "all_reduce", "pg_name": "0", "ts": [0.0 if r == 0 else 100.0],
                            "end": [200.0], "bytes": 8e6, "bus_factor": 1.5}) for r in range(4)}  # fmt: skip
    al = aligned(per, dict.fromkeys(per, 0.0)).set_index("rank")
    assert al["wait_us"].tolist() == [100, 0, 0, 0] and al["transfer_us"].tolist() == [100] * 4
    assert al["busbw_gbps"].tolist() == pytest.approx([60, 120, 120, 120])
    assert al["busbw_transfer_gbps"].tolist() == pytest.approx([120] * 4)
    sk = skew(per, dict.fromkeys(per, 0.0)).iloc[0]
    assert (sk["skew_us"], sk["transfer_us"], sk["bytes"]) == (100, 100, 8e6)
    assert sk["busbw_transfer_gbps"] == pytest.approx(120) and sk["busbw_gbps"] == pytest.approx(120)
    assert sk["wait_us_rank0"] == 100 and sk["wait_us_rank3"] == 0 and sk["last_rank"] in (1, 2, 3)
    # shifted by a clock offset of +50 us on rank 0, it arrives 50 us before the others
    assert skew(per, {0: 50.0, 1: 0.0, 2: 0.0, 3: 0.0}).iloc[0]["skew_us"] == 50
    # a call on one rank only is no common collective
    lone = {0: per[0], 1: per[1].assign(collective="all_gather")}
    assert aligned(lone, {0: 0.0, 1: 0.0}).empty and skew(lone, {0: 0.0, 1: 0.0}).empty


def test_a_collective_whose_ranks_move_different_sizes_is_sized_by_the_largest():
    """An uneven all-to-all over 2 ranks (factor 1/2): rank 0 moves 4 MB, rank 1 8 MB, both from 0
    to 100 us.  The collective moves the larger, 8 MB: 8e6 B / 100 us = 80 GB/s x 1/2 = 40 GB/s
    (sized by the smaller it would read 20)."""
    per = {r: pd.DataFrame({"collective": "all_to_all", "pg_name": "0", "ts": [0.0], "end": [100.0],
                            "bytes": [b], "bus_factor": 0.5}) for r, b in enumerate([4e6, 8e6])}  # fmt: skip
    sk = skew(per, dict.fromkeys(per, 0.0)).iloc[0]
    assert sk["bytes"] == 8e6 and sk["transfer_us"] == 100
    assert sk["busbw_transfer_gbps"] == pytest.approx(40.0)


@pytest.mark.parametrize("skew_us, rank", [(10.0, 1), (9.99, None)])
def test_the_straggler_needs_a_skew_of_a_tenth_of_the_transfer(skew_us, rank):
    sk = pd.DataFrame({"skew_us": skew_us, "transfer_us": 100.0, "last_rank": [1, 1, 1, 1]})
    s = straggler(sk, 2)
    assert s.rank == rank and s.last_share == 1.0 and s.median_skew_us == skew_us and s.median_transfer_us == 100
    assert s.verdict.startswith("rank 1 is the straggler" if rank else "no straggler")
    assert "of 4 collectives" in s.verdict and s.verdict.endswith("(all 2 ranks)")


def test_the_straggler_on_two_ranks_needs_more_than_three_quarters_and_says_what_it_rests_on():
    """With 2 ranks, more often than 1.5 / 2 = 75 %: last in 3 of 4 is not enough, 4 of 4 is; drawn
    from 2 of 128 ranks the verdict says so."""
    three = pd.DataFrame({"skew_us": 50.0, "transfer_us": 100.0, "last_rank": [1, 1, 1, 0]})
    assert straggler(three, 2).rank is None and straggler(three, 2).last_share == 0.75
    assert straggler(three, 4).rank == 1  # 75 % > 1.5 / 4
    four = straggler(three.assign(last_rank=1), 2, world_size=128)
    assert four.rank == 1 and (four.ranks, four.world_size) == (2, 128)
    assert "median skew 0.05 ms vs transfer 0.10 ms" in four.verdict
    assert four.verdict.endswith("(drawn from 2 of the job's 128 ranks: the other 126 are not in the traces, "
                                 "and any of them may arrive later)")  # fmt: skip
    none = straggler(three.iloc[:0], 2)
    assert none.rank is None and none.verdict.startswith("no collective common to all ranks")


@pytest.mark.parametrize("group, world, factor", [(None, 4, 2 * 3 / 4), (2, 4, 1.0), (None, None, 1.0)])
def test_a_cpu_traces_collective_takes_its_size_from_the_record_inside_and_the_jobs_ranks(tmp_path, group, world,
                                                                                          factor):  # fmt: skip
    """A gloo all-reduce (the backend's 200 us range on its thread) holding a record of 1 M floats:
    4 MB, 20 GB/s; the group size is the record's, else the job's ranks (4: x 1.5), else none; the
    50 us of an operator on the main thread inside it are hidden, the rest exposed."""
    rec = {"In msg nelems": 1_000_000, "Out msg nelems": 1_000_000, "dtype": "Float"}
    rec |= {"Group size": group} if group else {}
    ev = [step(1, 0, 1000), op("c10d::allreduce_", 10, 20, -1), ann("gloo:all_reduce", 15, 200, tid=3),
          op("record_param_comms", 20, 5, -1, tid=3, **rec), op("aten::mm", 100, 50, -1),
          op("aten::add", 400, 10, -1)]  # fmt: skip
    meta = {"distributedInfo": {"rank": 0, "world_size": world}} if world else {}
    c = TraceAnalysis(write(tmp_path / "g.json", ev, **meta), workers=1).collectives()
    assert c["name"].tolist() == ["gloo:all_reduce"]
    row = c.iloc[0]
    assert (row["collective"], row["bytes"], row["dur"]) == ("all_reduce", 4_000_000, 200)
    assert row["algbw_gbps"] == pytest.approx(20.0) and row["busbw_gbps"] == pytest.approx(20.0 * factor)
    assert (row["hidden_us"], row["exposed_us"]) == (50, 150)  # aten::mm (100..150) runs during it


@pytest.mark.parametrize("other_type", ["Scalar", "int", ""])
def test_a_cpu_collectives_size_from_shapes_counts_its_tensors_only(tmp_path, other_type):
    """A communication operator without a size record, its inputs recorded (``record_shapes``): a
    1000 x 250 float tensor and two non-tensor arguments (empty shapes): 1000 x 250 x 4 = 1 MB, the
    non-tensor arguments count nothing (200 us: 5 GB/s)."""
    shapes = {"Input Dims": [[1000, 250], [], []], "Input type": ["float", other_type, other_type]}
    ev = [step(1, 0, 1000), op("c10d::allreduce_", 10, 200, -1, **shapes)]
    c = TraceAnalysis(write(tmp_path / "c.json", ev), workers=1).collectives().iloc[0]
    assert (c["collective"], c["bytes"], c["dur"]) == ("all_reduce", 1_000_000, 200)
    assert c["algbw_gbps"] == pytest.approx(5.0)


def test_fit_inputs_are_each_sized_calls_kind_bytes_start_and_duration():
    c = pd.DataFrame({"collective": ["all_reduce", "all_gather", "all_reduce"], "bytes": [4096.0, np.nan, 8e6],
                      "ts": [10.0, 20.0, 30.5], "dur": [7.5, 3.0, 90.0], "transfer_us": [5.0, 1.0, 60.0]})  # fmt: skip
    assert events_of(c) == [
        CollectiveEvent("all_reduce", 4096, 10.0, 7.5),
        CollectiveEvent("all_reduce", 8_000_000, 30.5, 90.0),
    ]
    assert [e.dur_us for e in events_of(c, "transfer_us")] == [5.0, 60.0]
    flat = AlphaBeta("all_reduce", 5.0, 0.0, 3, 1.0, 0.0)  # no per-byte cost: no bandwidth limit
    assert flat.gbps == float("inf") and flat.predict_us(1e9) == 5.0
    assert AlphaBeta("all_reduce", 5.0, 1e-3, 3, 1.0, 0.0).gbps == pytest.approx(1.0)  # 1 ns per byte: 1 GB/s


def test_one_rank_has_no_common_collective():
    one = {0: pd.DataFrame({"collective": "all_reduce", "pg_name": "0", "ts": [0.0], "end": [10.0], "bytes": 8.0})}
    al = aligned(one, {0: 0.0})
    assert al.empty and {"wait_us", "transfer_us", "busbw_gbps", "busbw_transfer_gbps", "rank"} <= set(al.columns)
    assert skew(one, {0: 0.0}).empty and straggler(skew(one, {0: 0.0}), 1).rank is None


def test_the_alpha_beta_fit_minimizes_the_relative_error():
    """Four sizes off a line (the largest 2x slow): the fit minimizes the sum of squared relative
    errors, sum(((alpha + beta x - y) / y)^2), solved here as the least-squares problem
    [1/y, x/y] (alpha, beta) = 1; a plain least-squares fit would follow the slow large call
    (alpha below 0, beta 2e-3 us/B)."""
    xs, ys = np.array([1e3, 1e4, 1e5, 1e6]), np.array([3.0, 12.0, 110.0, 2000.0])
    (alpha, beta), *_ = np.linalg.lstsq(np.stack([1 / ys, xs / ys], axis=1), np.ones(4), rcond=None)
    assert alpha > 0 and beta < 1.5e-3  # the small calls lead, not the slow large one
    fit = fit_alpha_beta([CollectiveEvent("all_reduce", int(x), 0.0, float(y)) for x, y in zip(xs, ys)])
    got = fit["all_reduce"]
    assert (got.alpha_us, got.beta_us_per_byte) == pytest.approx((alpha, beta), rel=1e-9)
    want_err = float(np.median(np.abs(alpha + beta * xs - ys) / ys)) * 100
    assert got.median_abs_err_pct == pytest.approx(want_err, rel=1e-9) and got.n_events == 4


def test_barriers_carry_no_payload_and_do_not_stop_the_fit():
    """A barrier first, all-gathers at two sizes (too few, and first of the kinds), then all-reduces
    at three sizes on 2 us + 1 ns/B and send/recv at three sizes on 10 us + 0.5 ns/B (sends and
    receives one kind): those two fit exactly, no barrier or all-gather kind."""
    ev = [CollectiveEvent("barrier", 0, 0.0, 50.0), CollectiveEvent("all_gather", 10, 0.0, 3.0)]
    ev += [CollectiveEvent("all_gather", 20, 0.0, 4.0)]
    for b in (1_000, 100_000, 10_000_000):
        ev += [CollectiveEvent("all_reduce", b, 0.0, 2.0 + 1e-3 * b)]
        ev += [CollectiveEvent("send" if b < 10**6 else "recv", b, 0.0, 10.0 + 5e-4 * b)]
    fit = fit_alpha_beta(ev)
    assert sorted(fit) == ["all_reduce", "send_recv"]
    assert (fit["all_reduce"].alpha_us, fit["all_reduce"].beta_us_per_byte) == pytest.approx((2.0, 1e-3))
    assert fit["send_recv"].gbps == pytest.approx(2.0) and fit["send_recv"].n_events == 3
    assert fit_alpha_beta(ev[:7]) == {}  # two sizes of each: not enough
