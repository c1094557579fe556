"""lab_utils.profiling.traces (lab 01's trace reader) on traces written here, whose every figure is
counted by hand: the categories of kernel and operator names (the launching op when a kernel's name
says nothing, the optimizer by ancestry, autograd's wrappers as bookkeeping), a CUDA trace of two
steps (busy as the union of its kernels clipped to the step, idle, the phases and their coverage, a
phase inside another kept apart, a kernel charged to the step that launched it, one without a launch
to the step it ran in, one launched after the last step left out), the categories and top operators
over the steps and per step, the allocation curve from the first step's start (binned past 3000
points to its running max), and a CPU trace split by the operators' self time."""

from __future__ import annotations

import math

import pytest

from lab_utils.profiling.traces import CATEGORIES, IDLE, _union_us, analyse_trace, categorize
from lab_utils.traces.categories import operator_category

from ..traces.kineto import HOST_PID, ann, kernel, launch, op, step, write

MiB = 2**20


def memory(ts: float, allocated: float, device_type: int = 1) -> dict:
    """The allocator's total at ``ts`` (``profile_memory=True``; device type 1: CUDA, 0: CPU)."""
    return {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": HOST_PID, "tid": 1, "ts": ts,
            "s": "t", "args": {"Total Allocated": allocated, "Device Type": device_type}}  # fmt: skip


def test_a_kernel_is_named_by_its_own_name_else_by_its_launching_op():
    assert categorize("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert categorize("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>") == "attention"
    assert categorize("void at::native::vectorized_layer_norm_kernel<float>") == "normalization"
    assert categorize("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert categorize("void at::native::reduce_kernel<512, 1>") == "reduction"
    assert categorize("Memcpy HtoD (Pinned -> Device)") == "copy/cast"
    assert categorize("kernel_x") == "other" and categorize("kernel_x", "aten::mm") == "matmul"
    assert categorize("flash_fwd_kernel", "aten::mm") == "attention"  # its own name first
    assert categorize("", "aten::sum") == "reduction" and categorize("", "") == "other"
    assert set(CATEGORIES) >= {categorize(n) for n in ("aten::mm", "aten::add", "aten::copy_", "x")}


def test_under_the_optimizer_everything_is_the_optimizers_and_autograds_wrappers_are_other():
    assert categorize("aten::add_") == "elementwise/activation"
    assert categorize("aten::add_", under_optimizer=True) == "optimizer"
    assert categorize("kernel_x", "aten::mm", under_optimizer=True) == "optimizer"
    # the table alone would name these by the operator they wrap; their self time is the engine's
    for name in ("AddmmBackward0", "autograd::engine::evaluate_function: NativeLayerNormBackward0"):
        assert operator_category(name) != "other" and categorize(name) == "other"
    assert categorize("torch::autograd::AccumulateGrad", "aten::mm") == "other"
    assert categorize("AddmmBackward0x") == "matmul"  # "Backward<digits>" only at the end of the name


@pytest.mark.parametrize(
    "intervals, total",
    [
        ([], 0.0),
        ([(0.0, 10.0)], 10.0),
        ([(0.0, 10.0), (10.0, 15.0)], 15.0),  # touching
        ([(0.0, 10.0), (2.0, 4.0)], 10.0),  # nested
        ([(5.0, 8.0), (0.0, 6.0), (20.0, 21.0)], 9.0),  # overlapping, unsorted, a gap
        ([(0.0, 1.0), (3.0, 4.0), (6.0, 7.0)], 3.0),
    ],
)
def test_the_union_of_intervals(intervals, total):
    assert _union_us(intervals) == total


def cuda_trace(tmp_path):
    """Steps 1 [100, 1100) and 2 [1100, 2100) us, the kernels on stream 7:

    step 1: forward 110-510 (text_encoding 120-170 inside it), optimizer 600-900; aten::mm launches a
    GEMM 300-500, aten::add a kernel_x 450-550 (overlapping it), aten::add_ under Optimizer.step a
    kernel 700-820, and aten::mm at 990 a GEMM 1050-1150 (past the step's end: 50 us busy in it);
    busy 250 + 120 + 50 = 420 us, idle 580; phases 0.7 ms of 1.
    step 2: forward 1110-1410; aten::mm launches a GEMM 1300-1400; flash_fwd_kernel 1500-1550 has no
    launch in the trace (charged to the step it ran in); busy 150, idle 850; phases 0.3 ms.
    After the steps aten::mm launches a GEMM at 2300 (in no step's figures).
    Memory (CUDA): 1 MiB at 50, 3 MiB at 600, 2 MiB at 1600; the CPU's 10 MiB at 700 is not CUDA's."""
    ev = [step(1, 100, 1000), step(2, 1100, 1000), ann("forward", 110, 400), ann("text_encoding", 120, 50),
          ann("optimizer", 600, 300), ann("Optimizer.step#AdamW.step", 610, 200),
          op("aten::mm", 200, 30, 1), launch(1, 205), kernel("sm90_xmma_gemm", 1, 300, 200),
          op("aten::add", 250, 20, 2), launch(2, 255), kernel("kernel_x", 2, 450, 100),
          op("aten::add_", 620, 20, 3), launch(3, 625), kernel("kernel_y", 3, 700, 120),
          op("aten::mm", 990, 8, 4), launch(4, 992), kernel("sm90_xmma_gemm", 4, 1050, 100),
          ann("forward", 1110, 300), op("aten::mm", 1200, 30, 5), launch(5, 1205),
          kernel("sm90_xmma_gemm", 5, 1300, 100), kernel("flash_fwd_kernel", 99, 1500, 50),
          op("aten::mm", 2200, 30, 6), launch(6, 2205), kernel("sm90_xmma_gemm", 6, 2300, 40),
          memory(50, 1 * MiB), memory(600, 3 * MiB), memory(700, 10 * MiB, device_type=0),
          memory(1600, 2 * MiB)]  # fmt: skip
    return write(tmp_path / "cuda.json", ev)


def test_a_cuda_traces_steps_busy_idle_and_phases_by_hand(tmp_path):
    a = analyse_trace(cuda_trace(tmp_path))
    assert (a.device_kind, a.source) == ("cuda", "cuda kernels")
    rows = a.steps.to_dict(orient="records")
    assert [r["step"] for r in rows] == [1, 2]
    for r, (busy, phases) in zip(rows, ((0.42, 0.7), (0.15, 0.3))):
        assert r["step_ms"] == pytest.approx(1.0) and r["busy_ms"] == pytest.approx(busy)
        assert r["idle_ms"] == pytest.approx(1.0 - busy) and r["phase_sum_ms"] == pytest.approx(phases)
        assert r["coverage"] == pytest.approx(phases)  # of a 1 ms step
    ph = {(r.step, r.phase): r.ms for r in a.phases.itertuples()}
    assert ph == {(1, "forward"): pytest.approx(0.4), (1, "optimizer"): pytest.approx(0.3),
                  (2, "forward"): pytest.approx(0.3)}  # fmt: skip
    nested = a.nested_phases.to_dict(orient="records")
    assert nested == [{"step": 1, "phase": "text_encoding", "within": "forward", "ms": pytest.approx(0.05)}]


def test_a_cuda_traces_categories_and_top_operators_by_hand(tmp_path):
    """matmul: 200 + 100 (launched in step 1) + 100 us; elementwise 100; the optimizer's 120; attention 50;
    idle 580 + 850 us; shares of the 2 ms of steps.  The GEMM launched after the steps counts nowhere."""
    a = analyse_trace(cuda_trace(tmp_path), top=2)
    cat = a.categories.set_index("category")
    assert list(cat.index) == [*CATEGORIES, IDLE]
    want = {"matmul": 0.4, "elementwise/activation": 0.1, "optimizer": 0.12, "attention": 0.05, IDLE: 1.43}
    assert cat["ms"].to_dict() == pytest.approx({c: want.get(c, 0.0) for c in cat.index})
    assert cat["pct_of_step"].to_dict() == pytest.approx({c: 100 * want.get(c, 0.0) / 2.0 for c in cat.index})
    by = a.categories_by_step.set_index(["step", "category"])["ms"]
    assert len(by) == 2 * (len(CATEGORIES) + 1)
    assert (by[(1, "matmul")], by[(2, "matmul")], by[(1, "attention")], by[(2, "attention")]) == pytest.approx(
        (0.3, 0.1, 0.0, 0.05)
    )
    assert (by[(1, IDLE)], by[(2, IDLE)], by[(2, "optimizer")]) == pytest.approx((0.58, 0.85, 0.0))
    top = a.top_ops.to_dict(orient="records")
    assert [(r["name"], r["category"], r["calls"]) for r in top] == [("aten::mm", "matmul", 3),
                                                                     ("aten::add_", "optimizer", 1)]  # fmt: skip
    assert [r["ms"] for r in top] == pytest.approx([0.4, 0.12]) and a.top_n == 2
    assert [r["pct_of_step"] for r in top] == pytest.approx([20.0, 6.0])
    per = {(r.step, r.name): r.ms for r in a.top_ops_by_step.itertuples()}
    assert per == pytest.approx({(1, "aten::mm"): 0.3, (1, "aten::add_"): 0.12, (2, "aten::mm"): 0.1,
                                 (2, "aten::add_"): 0.0})  # fmt: skip
    every = analyse_trace(cuda_trace(tmp_path)).top_ops  # a kernel without its launch goes by its own name
    assert list(every["name"]) == ["aten::mm", "aten::add_", "aten::add", "flash_fwd_kernel"]


def test_the_allocation_curve_starts_at_the_first_step_in_mib(tmp_path):
    a = analyse_trace(cuda_trace(tmp_path))
    assert a.memory.to_dict(orient="list") == {"t_ms": pytest.approx([-0.05, 0.5, 1.5]),
                                               "allocated_mb": pytest.approx([1.0, 3.0, 2.0])}  # fmt: skip
    assert a.peak_allocated_bytes == 3 * MiB
    cpu = analyse_trace(cuda_trace(tmp_path), device_kind="cpu")  # the CPU allocator's curve
    assert cpu.memory.to_dict(orient="list") == {"t_ms": pytest.approx([0.6]), "allocated_mb": [10.0]}
    assert cpu.peak_allocated_bytes == 10 * MiB


def test_no_allocations_have_no_peak(tmp_path):
    ev = [step(1, 0, 100), op("aten::mm", 10, 20, 1), launch(1, 12), kernel("gemm", 1, 40, 10)]
    a = analyse_trace(write(tmp_path / "t.json", ev))
    assert a.memory.empty and list(a.memory.columns) == ["t_ms", "allocated_mb"]
    assert math.isnan(a.peak_allocated_bytes)


def test_a_long_allocation_curve_is_binned_to_its_running_max(tmp_path):
    """A CPU trace's 3001 points, one per us from the step's start (0 to 3 ms), 1 MiB each but a 7 MiB spike at 1 ms:
    binned to at most 1501 bins of 3/1500 ms, each its first time and its highest total; the spike kept."""
    ev = [step(1, 0, 4000)] + [memory(float(t), (7 if t == 1000 else 1) * MiB, 0) for t in range(3001)]
    a = analyse_trace(write(tmp_path / "long.json", ev))
    m = a.memory
    assert 1400 < len(m) <= 1501 and m["t_ms"].is_monotonic_increasing
    assert m["t_ms"].iloc[0] == 0.0 and m["allocated_mb"].max() == 7.0 and (m["allocated_mb"] == 7.0).sum() == 1
    spike = m.loc[m["allocated_mb"] == 7.0, "t_ms"].iloc[0]
    assert 1.0 - 0.002 <= spike <= 1.0
    assert a.peak_allocated_bytes == 7 * MiB
    short = analyse_trace(write(tmp_path / "short.json", ev[:3001]))  # 3000 points: kept as they are
    assert len(short.memory) == 3000


def test_a_cpu_trace_splits_its_steps_by_the_operators_self_time(tmp_path):
    """Step 1 [0, 1000) us: aten::linear 100-400 holds aten::mm 110-310 (self 100 and 200 us); aten::add_
    510-560 under Optimizer.step (the optimizer's); aten::relu 900-1100 runs past the step's end (self
    200 us, busy to 1000); busy: the union 100-400, 510-560, 900-1000 = 450 us, idle 550."""
    ev = [step(1, 0, 1000), op("aten::linear", 100, 300), op("aten::mm", 110, 200),
          ann("Optimizer.step#SGD.step", 500, 200), op("aten::add_", 510, 50), op("aten::relu", 900, 200)]  # fmt: skip
    a = analyse_trace(write(tmp_path / "cpu.json", ev))
    assert (a.device_kind, a.source) == ("cpu", "cpu operators (self time)")
    r = a.steps.iloc[0]
    assert (r.step_ms, r.busy_ms, r.idle_ms) == pytest.approx((1.0, 0.45, 0.55))
    cat = a.categories.set_index("category")["ms"]
    assert (cat["matmul"], cat["optimizer"], cat["elementwise/activation"], cat[IDLE]) == pytest.approx(
        (0.3, 0.05, 0.2, 0.55)
    )
    top = {r.name: (r.calls, r.ms) for r in a.top_ops.itertuples()}
    assert top == {"aten::mm": (1, pytest.approx(0.2)), "aten::relu": (1, pytest.approx(0.2)),
                   "aten::linear": (1, pytest.approx(0.1)), "aten::add_": (1, pytest.approx(0.05))}  # fmt: skip


def test_a_trace_without_steps_is_one_window(tmp_path):
    ev = [op("aten::mm", 0, 10, 1), launch(1, 2, ext=1), kernel("gemm", 1, 20, 5)]
    one = analyse_trace(write(tmp_path / "nosteps.json", ev))
    assert list(one.steps["step"]) == [0] and one.categories.set_index("category").loc["matmul", "ms"] == 0.005
