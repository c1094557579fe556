"""lab_utils.traces.roofline: each costed operator's FLOPs and bytes counted by hand from its shapes
(every element size of the table, broadcasting, ``out=`` tensors, a recorded flag list one short),
and the per-op table's rates, peaks and bound against a datasheet row made here, at the ridge
point itself; the trace's first host event costed like any other; a trace with no costed launching
op has an empty table of every column."""

from __future__ import annotations

import pandas as pd
import pytest

from lab_utils.core.datasheets import DatasheetPeak
from lab_utils.traces import TraceAnalysis
from lab_utils.traces.roofline import ATTENTION_OPS, COLUMNS, ITEMSIZE, attention_cost, cost, op_roofline

from .kineto import H100, kernel, launch, op, step, write

BF16 = "c10::BFloat16"
#: a part whose ridge is 100 FLOP/byte for bf16 (100 TFLOP/s over 1,000 GB/s), 10 for fp32
PART = DatasheetPeak("test part", 100.0, 200.0, None, 50.0, 1000.0, 80, "made in the test", fp32_tflops=10.0)


#: the bytes of each type name torch records (``Input type``), as C++ and torch define them
SIZES = {"float": 4, "double": 8, "c10::half": 2, "c10::bfloat16": 2, "half": 2, "bfloat16": 2, "long int": 8,
         "int": 4, "bool": 1, "unsigned char": 1, "signed char": 1, "short int": 2, "c10::float8_e4m3fn": 1,
         "c10::float8_e5m2": 1, "c10::float8_e4m3fnuz": 1, "c10::float8_e5m2fnuz": 1}  # fmt: skip


@pytest.mark.parametrize("typ, size", sorted(SIZES.items()))
def test_every_element_size_of_the_table(typ, size):
    assert set(ITEMSIZE) == set(SIZES)
    c = cost("aten::relu", [[10, 3]], [typ.upper() if "c10" in typ else typ])  # c10::BFloat16 as recorded
    assert c.bytes == 2 * 30 * size and c.flops == 30.0 and c.kind == "elementwise/norm"


def test_an_unknown_type_counts_four_bytes_and_a_shapeless_call_is_not_costed():
    assert cost("aten::relu", [[5]], ["c10::complex<float>"]).bytes == 2 * 5 * 4
    assert cost("aten::relu", [[]], ["float"]) is None and cost("aten::relu", [], []) is None
    assert cost("aten::unknown_op", [[4, 4]], ["float"]) is None


@pytest.mark.parametrize(
    "op, dims, types, flops, nbytes",
    [
        ("aten::mm", [[3, 5], [5, 7]], ["float", "float"], 2 * 3 * 5 * 7, 4 * (15 + 35 + 21)),
        ("aten::addmm", [[7], [3, 5], [5, 7]], [BF16] * 3, 2 * 3 * 5 * 7, 2 * (7 + 15 + 35 + 21)),
        ("aten::_scaled_mm", [[3, 5], [5, 7], [], []], ["c10::Float8_e4m3fn"] * 2 + ["", ""], 2 * 105,
         15 + 35 + 2 * 21),  # fp8 in (1 byte each), bf16 out
        ("aten::bmm", [[2, 3, 5], [2, 5, 7]], ["float", "float"], 2 * 2 * 3 * 5 * 7, 4 * (30 + 70 + 42)),
        ("aten::baddbmm", [[2, 3, 7], [2, 3, 5], [2, 5, 7]], ["half"] * 3, 2 * 2 * 105, 2 * (42 + 30 + 70 + 42)),
        ("aten::linear", [[2, 3, 5], [7, 5]], [BF16] * 2, 2 * 6 * 7 * 5, 2 * (30 + 35 + 42)),  # no bias: 2 tensors
        ("aten::linear", [[6, 5], [7, 5], [7]], ["float"] * 3, 2 * 6 * 7 * 5, 4 * (30 + 35 + 7 + 42)),
    ],
)  # fmt: skip
def test_matmul_flops_and_bytes_by_hand(op, dims, types, flops, nbytes):
    c = cost(op, dims, types)
    assert (c.flops, c.bytes, c.kind) == (float(flops), float(nbytes), "matmul")


def test_matmuls_whose_shapes_do_not_fit_are_not_costed():
    assert cost("aten::mm", [[3, 5]], ["float"]) is None  # one tensor
    assert cost("aten::mm", [[3], [3, 5]], ["float", "float"]) is None  # a vector
    assert cost("aten::bmm", [[3, 5], [5, 7]], ["float", "float"]) is None  # not 3-d
    assert cost("aten::linear", [[3, 5]], ["float"]) is None


def test_elementwise_broadcasts_to_the_largest_input_and_writes_the_promoted_type():
    add = cost("aten::add", [[4, 8], [8], []], [BF16, "float", "Scalar"])
    assert add.flops == 32.0  # the output has the larger input's elements
    assert add.bytes == 32 * 2 + 8 * 4 + 32 * 4  # bf16 [4, 8] and float [8] read, float written
    ln = cost("aten::layer_norm", [[2, 16], [], [16], [16], []], ["float", "", "float", "float", "Scalar"])
    assert ln.flops == 32.0  # no per-element count for layer_norm in the fused table: 1 per element
    rms = cost("aten::rms_norm", [[2, 16], [], [16]], [BF16, "", BF16])
    assert rms.flops == 4 * 32.0  # rms_norm's 4 FLOPs per element


@pytest.mark.parametrize(
    "dims, types, nbytes",
    [
        ([[4, 8], [4, 8], [], [4, 8]], ["float"] * 2 + ["Scalar", "float"], 3 * 32 * 4),  # add(a, b, alpha, out=)
        ([[4, 8], [4, 8], []], ["float"] * 2 + ["Scalar"], 3 * 32 * 4),  # add(a, b, alpha): nothing past it
        ([[4, 8], [4, 8], [], [8]], ["float"] * 2 + ["Scalar", "float"], 32 * 4 * 3 + 8 * 4),  # not an out: other size
    ],
)
def test_an_out_tensor_past_the_ops_own_arguments_is_written_not_read(dims, types, nbytes):
    assert cost("aten::add", dims, types).bytes == nbytes


def test_attention_mask_flags_from_the_recorded_concrete_inputs():
    q = [1, 2, 8, 4]  # b, h, s, d (the public op's layout)
    dims, types = [q, q, q], [BF16] * 3
    full = 4.0 * 1 * 2 * 8 * 8 * 4
    causal_flag = ["", "", "", "", "", "True"]  # is_causal at index 5
    c = attention_cost("aten::scaled_dot_product_attention", dims, types, causal_flag)
    assert (c.mask, c.flops) == ("causal", 4.0 * 2 * (8 * 9 // 2) * 4)
    short = attention_cost("aten::scaled_dot_product_attention", dims, types, causal_flag[:5])
    assert (short.mask, short.flops) == ("full", full)  # the list ends before the flag: not causal
    none = attention_cost("aten::scaled_dot_product_attention", dims, types, [])
    assert none.mask == "full (mask not recorded)" and none.flops == full
    assert none.bytes == 3 * 64 * 2 + 64 * 2 and none.direction == "fwd"
    eff = [[1, 8, 2, 4]] * 3  # the kernels' own op: [b, s, h, d]
    mt = ATTENTION_OPS["aten::_efficient_attention_forward"].mask_type
    two = attention_cost("aten::_efficient_attention_forward", eff, types, [""] * mt + ["2"])
    assert two.mask == "causal (bottom right)"
    one = attention_cost("aten::_efficient_attention_forward", eff, types, [""] * mt + ["1"])
    assert one.mask == "causal" and one.flops == 4.0 * 2 * 36 * 4


def rows_trace(tmp_path, ops):
    """One step; per (name, dims, types, kernel name, kernel us) an op launching one kernel."""
    ev = [step(1, 0, 1_000_000)]
    for i, (name, dims, types, kname, us) in enumerate(ops, start=1):
        ev += [op(name, 100 * i, 10, i, **{"Input Dims": dims, "Input type": types}),
               launch(i, 100 * i + 1, ext=i), kernel(kname, i, 10_000 * i, us, ext=i)]  # fmt: skip
    return TraceAnalysis(write(tmp_path / "r.json", ev, deviceProperties=[H100]), workers=1)


def test_the_ridge_point_itself_is_compute_bound(tmp_path):
    """bf16 square mm of n: intensity 2n^3 / (3 n^2 x 2 bytes) = n / 3: 300 is at the ridge (100), 297 below."""
    ta = rows_trace(tmp_path, [("aten::mm", [[300, 300], [300, 300]], [BF16] * 2, "gemm_a", 10.0),
                               ("aten::mm", [[297, 297], [297, 297]], [BF16] * 2, "gemm_b", 10.0)])  # fmt: skip
    rf = op_roofline(ta.kernels(0), ta.traces[0].host, ta.device(0), peak=PART).set_index("flops")
    at, below = rf.loc[2.0 * 300**3], rf.loc[2.0 * 297**3]
    assert at["intensity"] == pytest.approx(100.0) and at["bound"] == "compute"
    assert at["peak"] == "BF16 tensor cores" and at["peak_tflops"] == 100.0 and at["peak_gbps"] == 1000.0
    assert at["tflops"] == pytest.approx(2 * 300**3 / 10e-6 / 1e12)
    assert at["pct_of_peak"] == pytest.approx(100 * at["tflops"] / 100.0)
    assert below["intensity"] == pytest.approx(99.0) and below["bound"] == "memory"
    assert below["peak"] == "HBM (BF16 tensor cores below the ridge)"
    assert below["gbps"] == pytest.approx(3 * 297**2 * 2 / 10e-6 / 1e9)
    assert below["pct_of_peak"] == pytest.approx(100 * below["gbps"] / 1000.0)
    assert (rf["part"] == "test part").all() and (rf["device"] == ta.device(0)).all()


def test_rates_calls_and_peaks_on_the_traced_gpu(tmp_path):
    """Two calls of the same add are one row of 2 calls; an fp32 mm without TF32 in its kernel's name is
    held to the fp32 rate; the GPU's row is the trace's own H100 SXM5."""
    add = ("aten::add", [[1024, 1024], [1024, 1024], []], ["float", "float", "Scalar"], "vectorized_add", 10.0)
    mm = ("aten::mm", [[64, 32], [32, 16]], ["float", "float"], "sm90_gemm_fp32", 2.0)
    rf = rows_trace(tmp_path, [add, add, mm]).roofline(0).set_index("op")
    a = rf.loc["aten::add"]
    n = 1024 * 1024
    assert (a["calls"], a["gpu_us"], a["flops"], a["bytes"]) == (2, 20.0, 2.0 * n, 2 * 3 * 4.0 * n)
    assert a["gbps"] == pytest.approx(3 * 4 * n * 2 / 20e-6 / 1e9) and a["bound"] == "memory"
    assert a["peak_tflops"] == 66.9 and a["peak"] == "HBM (FP32 vector below the ridge)"
    assert a["pct_of_peak"] == pytest.approx(100 * a["gbps"] / 3350.0) and a["part"] == "H100 SXM5"
    m = rf.loc["aten::mm"]
    assert (
        not m["tf32"]
        and m["peak_tflops"] == 66.9
        and m["intensity"] == pytest.approx(2 * 64 * 32 * 16 / (4 * (64 * 32 + 32 * 16 + 64 * 16)))
    )
    assert rf.index.tolist() == ["aten::add", "aten::mm"]  # most GPU time first


def test_no_datasheet_keeps_the_rates_and_says_why(tmp_path):
    ev = [step(1, 0, 1000), op("aten::mm", 10, 5, 1, **{"Input Dims": [[4, 4], [4, 4]], "Input type": ["float"] * 2}),
          launch(1, 11, ext=1), kernel("gemm", 1, 100, 1.0, ext=1)]  # fmt: skip
    ta = TraceAnalysis(write(tmp_path / "n.json", ev, deviceProperties=[{"id": 0, "name": "Some GPU 9000"}]))
    row = ta.roofline(0).iloc[0]
    assert row["tflops"] == pytest.approx(128 / 1e-6 / 1e12) and row["bound"] == "no datasheet for Some GPU 9000"
    assert row["part"] == "" and row["peak"] == "" and row["device"] == "Some GPU 9000"
    assert op_roofline(ta.kernels(0).iloc[:0], ta.traces[0].host, "x").empty


def test_a_trace_whose_launching_ops_none_is_costed_has_an_empty_table_of_every_column(tmp_path):
    """A scan (no cost rule) and an mm whose shapes do not fit launch kernels: no row, the columns kept."""
    ta = rows_trace(tmp_path, [("aten::cumsum", [[4, 4], []], ["float", "Scalar"], "scan_kernel", 3.0),
                               ("aten::mm", [[4, 4], [4]], ["float", "float"], "gemm", 2.0)])  # fmt: skip
    rf = op_roofline(ta.kernels(0), ta.traces[0].host, ta.device(0), peak=PART)
    assert isinstance(rf, pd.DataFrame) and rf.empty and list(rf.columns) == COLUMNS
    assert ta.roofline(0).empty


def test_the_first_host_event_launching_is_costed_like_any_other(tmp_path):
    """The mm is the trace's first host event (row 0): its kernel's time and its 2 x 4 x 4 x 4 FLOPs count."""
    ev = [op("aten::mm", 0.0, 10, 1, **{"Input Dims": [[4, 4], [4, 4]], "Input type": ["float"] * 2}),
          launch(1, 2.0, ext=1), kernel("gemm", 1, 20.0, 2.0, ext=1)]  # fmt: skip
    ta = TraceAnalysis(write(tmp_path / "first.json", ev, deviceProperties=[H100]), workers=1)
    assert ta.kernels(0)["op_index"].tolist() == [0]
    rf = op_roofline(ta.kernels(0), ta.traces[0].host, ta.device(0), peak=PART)
    assert rf[["op", "calls", "gpu_us", "flops"]].values.tolist() == [["aten::mm", 1, 2.0, 128.0]]
