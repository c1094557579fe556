"""The per-operator roofline of lab_utils.traces.roofline on the shapes torch records: attention in each
op's own argument layout (checked against torch's schemas and meta kernels), backward attention as
backward, causal and grouped-query attention, fp32 GEMMs with and without TF32, ``out=`` tensors,
and the datasheet row of the exact part.  Every figure is a hand count of the synthetic trace's
shapes (the traces are written here in Kineto's CUDA format), or of a trace torch records here."""

from __future__ import annotations

import json

import pytest
import torch

from lab_utils.core.config import ConfigError
from lab_utils.core.flops import ATTENTION_BWD_FACTOR, causal_pairs
from lab_utils.run.cli import main as perflab
from lab_utils.traces import TraceAnalysis
from lab_utils.traces.roofline import ATTENTION_OPS
from unit.traces.test_collectives import kernel, launch, op, step, write

H100 = [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85045149696, "numSms": 132}]
BF16 = "c10::BFloat16"
B, S, H, D = 1, 4608, 24, 128  # a FLUX-like joint attention: 4096 image + 512 text tokens, 24 heads of 128


def _attn(name, ext, dims, types, concrete=None):
    args = {"Input Dims": dims, "Input type": types}
    if concrete is not None:
        args["Concrete Inputs"] = concrete
    return op(name, 10 * ext, 5, ext, **args)


def sdpa_trace(tmp_path, *, fwd_us=499.8, bwd_us=1249.5, causal=None, kv_heads=H, props=H100, name="flux.json"):
    """One step of FLUX-like SDPA as torch's CUDA build records it: the public op, the dispatch op
    ([b, h, s, d]) and the kernel's own op ``_flash_attention_forward`` ([b, s, h, d]), whose
    External id the kernel carries; then ``_flash_attention_backward`` on autograd's thread."""
    q, kv = [B, S, H, D], [B, S, kv_heads, D]
    c_fwd = None if causal is None else ["", "", "", "", "", "", "", "0.", str(causal), "False", ""]
    c_bwd = None if causal is None else [""] * 10 + ["0.", str(causal)] + [""] * 3
    ev = [step(1, 0, 10_000)]
    ev += [_attn("aten::scaled_dot_product_attention", 1, [[B, H, S, D], [B, kv_heads, S, D], [B, kv_heads, S, D],
                 [], [], [], [], []], [BF16] * 3 + ["", "Scalar", "Scalar", "", "Scalar"])]  # fmt: skip
    ev += [_attn("aten::_scaled_dot_product_flash_attention", 2, [[B, H, S, D], [B, kv_heads, S, D],
                 [B, kv_heads, S, D], [], [], [], []], [BF16] * 3 + ["Scalar"] * 3 + [""])]  # fmt: skip
    ev += [_attn("aten::_flash_attention_forward", 3, [q, kv, kv] + [[]] * 8, [BF16] * 3 + ["", ""] + ["Scalar"] * 6,
                 c_fwd)]  # fmt: skip
    ev += [launch(1, 40, ext=3), kernel("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", 1, 100,
                                        fwd_us, ext=3)]  # fmt: skip
    ev += [_attn("aten::_flash_attention_backward", 4, [q, q, kv, kv, q, [B, H, S]] + [[]] * 9,
                 [BF16] * 5 + ["float"] + [""] * 9, c_bwd)]  # fmt: skip
    ev += [launch(2, 1000, ext=4), kernel("void flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", 2, 2000, bwd_us, ext=4)]
    return write(tmp_path / name, ev, deviceProperties=props)


def fwd_flops(pairs=S * S, heads=H):
    return 4.0 * B * heads * pairs * D  # QK^T and PV, 2 FLOPs per multiply-add, per query head


def test_the_table_follows_torchs_schemas():
    """Each op's q, k, v and mask argument sit where the installed torch's schema puts them."""
    for name, spec in ATTENTION_OPS.items():
        args = [a.name for a in getattr(torch.ops.aten, name.split("::")[1]).default._schema.arguments]
        assert [a.rstrip("_") for a in args[spec.query : spec.query + 3]] == ["query", "key", "value"], name
        if spec.causal is not None:
            assert args[spec.causal] == "is_causal", name
        if spec.mask_type is not None:
            assert args[spec.mask_type] == "custom_mask_type", name
        assert spec.backward == name.endswith("_backward") and (spec.query == 1) == spec.backward, name


#: forward op -> a call of its meta kernel on (q, k, v) laid out as the table says
META_CALLS = {
    "aten::_scaled_dot_product_flash_attention": lambda a, q, k, v: a(q, k, v, 0.0, True),
    "aten::_scaled_dot_product_flash_attention_for_cpu": lambda a, q, k, v: a(q, k, v, 0.0, True),
    "aten::_scaled_dot_product_efficient_attention": lambda a, q, k, v: a(q, k, v, None, True, 0.0, True),
    "aten::_scaled_dot_product_cudnn_attention": lambda a, q, k, v: a(q, k, v, None, True, 0.0, True),
    "aten::_flash_attention_forward": lambda a, q, k, v: a(
        q, k, v, None, None, q.shape[1], k.shape[1], 0.0, True, False
    ),  # fmt: skip
    "aten::_efficient_attention_forward": lambda a, q, k, v: a(q, k, v, None, None, None, None, None, 0.0, 1, True),
}
#: backward op -> its forward (the same saved q, k, v: the same layout)
FORWARD_OF = {
    "aten::_scaled_dot_product_flash_attention_backward": "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention_backward": "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention_backward": "aten::_scaled_dot_product_cudnn_attention",
    "aten::_flash_attention_backward": "aten::_flash_attention_forward",
    "aten::_efficient_attention_backward": "aten::_efficient_attention_forward",
}


def test_the_layouts_are_those_of_torchs_meta_kernels():
    """Built in the table's layout with distinct sizes, each forward's log-sum-exp comes out
    [batch, heads, ...]: torch reads the heads where the table says they are."""
    b, s, t, h, d = 2, 7, 11, 3, 8
    for name, call in META_CALLS.items():
        spec = ATTENTION_OPS[name]
        shape = (lambda n: (b, h, n, d)) if spec.layout == "bhsd" else (lambda n: (b, n, h, d))
        q, k, v = (torch.empty(shape(n), device="meta", dtype=torch.float16) for n in (s, t, t))
        lse = call(getattr(torch.ops.aten, name.split("::")[1]), q, k, v)[1]
        assert tuple(lse.shape[:2]) == (b, h), name
    for bwd, fwd in FORWARD_OF.items():
        assert ATTENTION_OPS[bwd].layout == ATTENTION_OPS[fwd].layout, bwd
    assert set(FORWARD_OF) == {n for n, s in ATTENTION_OPS.items() if s.backward}


def test_flux_attention_on_h100_is_compute_bound_in_the_inner_ops_layout(tmp_path):
    """The kernel is charged to ``_flash_attention_forward``, q [b, s, h, d]: 4·b·h·s²·d FLOPs, so a
    500 us kernel runs at 522 TFLOP/s, 53% of the H100 SXM5's 989.4 bf16 peak, compute-bound (read
    as [b, h, s, d] it would be s/h = 192x fewer FLOPs and "memory-bound")."""
    rf = TraceAnalysis(sdpa_trace(tmp_path)).roofline(0).set_index("op")
    f = rf.loc["aten::_flash_attention_forward"]
    assert f["flops"] == fwd_flops() and f["direction"] == "fwd" and f["mask"] == "full (mask not recorded)"
    assert f["tflops"] == pytest.approx(fwd_flops() / 499.8e-6 / 1e12) and f["tflops"] == pytest.approx(522, rel=1e-3)
    assert f["bound"] == "compute" and f["peak_tflops"] == 989.4 and f["peak"] == "BF16 tensor cores"
    assert f["pct_of_peak"] == pytest.approx(100 * f["tflops"] / 989.4)
    assert f["bytes"] == 2 * 4 * B * S * H * D  # q, k, v read, o written, bf16


def test_backward_attention_is_costed_as_backward(tmp_path):
    """``_flash_attention_backward``: 2.5x the forward's FLOPs (the project's kernel convention),
    so a 1249.5 us backward also runs at 522 TFLOP/s; it writes dq, dk, dv."""
    rf = TraceAnalysis(sdpa_trace(tmp_path)).roofline(0).set_index("op")
    bwd = rf.loc["aten::_flash_attention_backward"]
    assert ATTENTION_BWD_FACTOR["kernel"] == 2.5
    assert bwd["direction"] == "bwd" and bwd["flops"] == 2.5 * fwd_flops()
    assert bwd["tflops"] == pytest.approx(522, rel=1e-3) and bwd["bound"] == "compute"
    q = B * S * H * D
    assert bwd["bytes"] == 2 * (5 * q + 3 * q) + 4 * B * H * S  # grad_out, q, k, v, out + lse (fp32) read; dq dk dv


def test_causal_and_grouped_query_attention(tmp_path):
    """``is_causal`` recorded True: the allowed pairs s(s+1)/2; 8 key/value heads for 24 query heads:
    the FLOPs still count every query head, the bytes read the smaller k and v."""
    rf = TraceAnalysis(sdpa_trace(tmp_path, causal=True, kv_heads=8)).roofline(0).set_index("op")
    f, b = rf.loc["aten::_flash_attention_forward"], rf.loc["aten::_flash_attention_backward"]
    pairs = S * (S + 1) // 2
    assert causal_pairs(S) == pairs and f["mask"] == "causal" and b["mask"] == "causal"
    assert f["flops"] == fwd_flops(pairs) and b["flops"] == 2.5 * fwd_flops(pairs)
    assert f["bytes"] == 2 * (B * S * H * D * 2 + 2 * B * S * 8 * D)  # q and o at 24 heads, k and v at 8
    full = TraceAnalysis(sdpa_trace(tmp_path, causal=False, name="full.json")).roofline(0).set_index("op")
    assert full.loc["aten::_flash_attention_forward", "mask"] == "full"
    assert full.loc["aten::_flash_attention_forward", "flops"] == fwd_flops()


def test_memory_efficient_attention_bottom_right_and_variable_length(tmp_path):
    """``_efficient_attention_forward`` [b, s, h, d] with ``custom_mask_type`` 2 (causal from the bottom
    right) and 512 queries over 4608 keys: query i sees i + 4097 keys; a 3-d (variable-length) call
    is not costed, its pairs are not in the shapes."""
    s_q, t = 512, 4608
    q, kv = [B, s_q, H, D], [B, t, H, D]
    concrete = [""] * 8 + ["0.", "2", "True", ""]
    ev = [step(1, 0, 10_000), _attn("aten::_efficient_attention_forward", 1, [q, kv, kv] + [[]] * 9,
                                    [BF16] * 3 + [""] * 9, concrete)]  # fmt: skip
    ev += [launch(1, 20, ext=1), kernel("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", 1, 40, 100.0, ext=1)]
    ev += [_attn("aten::_flash_attention_forward", 2, [[9000, H, D], [9000, H, D], [9000, H, D], [B + 1], [B + 1]]
                 + [[]] * 6, [BF16] * 3 + ["int"] * 2 + [""] * 6)]  # fmt: skip
    ev += [launch(2, 200, ext=2), kernel("flash_fwd_varlen_kernel", 2, 300, 50.0, ext=2)]
    rf = TraceAnalysis(write(tmp_path / "eff.json", ev, deviceProperties=H100)).roofline(0).set_index("op")
    e = rf.loc["aten::_efficient_attention_forward"]
    pairs = sum(min(t, i + t - s_q + 1) for i in range(s_q))  # counted query by query
    assert e["mask"] == "causal (bottom right)" and causal_pairs(s_q, t, bottom_right=True) == pairs
    assert e["flops"] == 4.0 * B * H * pairs * D
    assert "aten::_flash_attention_forward" not in rf.index


def test_sdpa_recorded_by_torch_is_costed_from_its_own_trace(tmp_path):
    """A trace torch records here (CPU: SDPA dispatches to ``_scaled_dot_product_flash_attention_for_cpu``,
    the CPU rule reads the attention op whole): forward and backward from the shapes and the
    ``Concrete Inputs`` torch wrote, causal."""
    b, h, s, d = 2, 3, 64, 16
    q = torch.randn(b, h, s, d, requires_grad=True)
    k, v = torch.randn(b, h, s, d, requires_grad=True), torch.randn(b, h, s, d, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.profiler.record_function("ProfilerStep#1"):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    path = tmp_path / "sdpa_cpu.json"
    prof.export_chrome_trace(str(path))
    rf = TraceAnalysis(path).roofline(0, "all")
    att = rf[rf["kind"] == "attention"].set_index("direction")
    pairs = s * (s + 1) // 2
    assert att.loc["fwd", "flops"] == 4.0 * b * h * pairs * d and att.loc["fwd", "mask"] == "causal"
    assert att.loc["bwd", "flops"] == 2.5 * 4.0 * b * h * pairs * d and att.loc["bwd", "mask"] == "causal"
    assert att.loc["fwd", "op"] == "aten::scaled_dot_product_attention"


def gemm_trace(tmp_path, props, name="gemm.json"):
    m = n = k = 4096
    dims = [[m, k], [k, n]]
    ev = [step(1, 0, 100_000)]
    gemms = [(["float", "float"], "ampere_sgemm_128x64_nn"),
             (["float", "float"], "sm80_xmma_gemm_tf32f32_tf32f32_f32_nn_n_tilesize128"),
             ([BF16, BF16], "sm80_xmma_gemm_bf16bf16_bf16f32_f32_nn_n")]  # fmt: skip
    for ext, (types, kname) in enumerate(gemms, start=1):
        ev += [op("aten::mm", 100 * ext, 10, ext, **{"Input Dims": dims, "Input type": types})]
        ev += [launch(ext, 100 * ext + 2, ext=ext), kernel(kname, ext, 1000 * ext, 900.0, ext=ext)]
    ev += [op("aten::mul", 5000, 10, 9, **{"Input Dims": [[m, n], [], [m, n]], "Input type": ["float", "double",
                                                                                                "float"]})]  # fmt: skip
    ev += [launch(9, 5002, ext=9), kernel("vectorized_elementwise_kernel<mul>", 9, 6000, 100.0, ext=9)]
    where = {"Input Dims": [[m, n], [m, n], [m, n]], "Input type": ["bool", "float", "float"]}
    ev += [op("aten::where", 7000, 10, 10, **where)]
    ev += [launch(10, 7002, ext=10), kernel("elementwise_kernel<where>", 10, 8000, 100.0, ext=10)]
    return write(tmp_path / name, ev, deviceProperties=props)


def test_an_fp32_gemm_is_held_to_tf32_only_when_its_kernel_ran_in_tf32(tmp_path):
    """On an A100: ``ampere_sgemm`` (no TF32 in its name) -> the 19.5 TFLOP/s fp32 peak, the
    ``tf32`` kernel -> 156, bf16 -> 312; each row names the peak it was held to."""
    props = [{"id": 0, "name": "NVIDIA A100-SXM4-80GB", "totalGlobalMem": 84990623744, "numSms": 108}]
    rf = TraceAnalysis(gemm_trace(tmp_path, props)).roofline(0)
    mm = rf[rf["op"] == "aten::mm"].set_index("tf32")
    fp32 = rf[(rf["op"] == "aten::mm") & ~rf["types"].str.contains("BFloat16")].set_index("tf32")
    assert fp32.loc[False, "peak_tflops"] == 19.5 and "FP32 CUDA cores" in fp32.loc[False, "peak"]
    assert fp32.loc[True, "peak_tflops"] == 156.0 and fp32.loc[True, "peak"] == "TF32 tensor cores"
    bf16 = mm[mm["types"].str.contains("BFloat16")].iloc[0]
    assert bf16["peak_tflops"] == 312.0 and bf16["peak"] == "BF16 tensor cores"
    flops = 2.0 * 4096**3
    assert fp32.loc[False, "pct_of_peak"] == pytest.approx(100 * flops / 900e-6 / 1e12 / 19.5)


def test_an_out_tensor_is_written_not_read_and_where_writes_its_values_type(tmp_path):
    """``mul(x, 2.0, out=y)`` moves x once and y once (8 bytes per float element, not 12: the old
    count put this A100 row at 127% of its HBM); ``where(cond, a, b)`` reads 1 + 4 + 4 bytes and
    writes 4 per element."""
    props = [{"id": 0, "name": "NVIDIA A100-SXM4-80GB", "totalGlobalMem": 84990623744, "numSms": 108}]
    rf = TraceAnalysis(gemm_trace(tmp_path, props)).roofline(0).set_index("op")
    n = 4096 * 4096
    assert rf.loc["aten::mul", "bytes"] == 8 * n and rf.loc["aten::mul", "bound"] == "memory"
    assert rf.loc["aten::mul", "peak"].startswith("HBM")
    assert rf.loc["aten::mul", "pct_of_peak"] == pytest.approx(100 * 8 * n / 100e-6 / 1e9 / 2039.0)
    assert rf.loc["aten::where", "bytes"] == (1 + 4 + 4 + 4) * n


@pytest.mark.parametrize(
    "props,part,hbm,bf16",
    [
        ([{"id": 0, "name": "NVIDIA H100 PCIe", "totalGlobalMem": 85520809984, "numSms": 114}], "H100 PCIe", 2000.0,
         756.5),
        ([{"id": 0, "name": "NVIDIA H100", "numSms": 114}], "H100 PCIe", 2000.0, 756.5),  # told by its SMs
        ([{"id": 0, "name": "NVIDIA H100 NVL", "totalGlobalMem": 100485038080, "numSms": 132}], "H100 NVL", 3900.0,
         835.5),
        ([{"id": 0, "name": "NVIDIA H100 80GB HBM3", "numSms": 132}], "H100 SXM5", 3350.0, 989.4),
        ([{"id": 0, "name": "NVIDIA A100-PG509-200", "totalGlobalMem": 42505273344, "numSms": 108}], "A100 SXM4 40GB",
         1555.0, 312.0),  # the real recsys_a100_rank3's GPU: a 40 GB part reporting 42.5e9 B
        ([{"id": 0, "name": "NVIDIA A100-PCIE-40GB"}], "A100 PCIe 40GB", 1555.0, 312.0),
        ([{"id": 0, "name": "NVIDIA A100 80GB PCIe"}], "A100 PCIe 80GB", 1935.0, 312.0),
    ],
)  # fmt: skip
def test_the_roofline_holds_each_trace_to_its_exact_part(tmp_path, props, part, hbm, bf16):
    rf = TraceAnalysis(gemm_trace(tmp_path, props)).roofline(0)
    assert (rf["part"] == part).all() and (rf["peak_gbps"] == hbm).all()
    assert rf.loc[rf["types"].str.contains("BFloat16"), "peak_tflops"].iloc[0] == bf16
    mul = rf[rf["op"] == "aten::mul"].iloc[0]
    assert mul["pct_of_peak"] == pytest.approx(100 * mul["gbps"] / hbm)


def test_a_trace_that_names_no_gpu_takes_one(tmp_path, capsys):
    """No ``deviceProperties``: no datasheet, the rates alone; ``gpu=`` (``--gpu``) supplies the part,
    a trace that names its GPU keeps it, and a name perflab has no row for is refused before any
    work with the parts it knows."""
    path = gemm_trace(tmp_path, None, name="anon.json")
    assert (TraceAnalysis(path).roofline(0)["bound"] == "no datasheet for None").all()
    rf = TraceAnalysis(path, gpu="H100 PCIe").roofline(0)
    assert (rf["part"] == "H100 PCIe").all() and rf["pct_of_peak"].notna().all()
    named = gemm_trace(tmp_path, H100, name="named.json")
    assert (TraceAnalysis(named, gpu="H100 PCIe").roofline(0)["part"] == "H100 SXM5").all()
    for bad in ("H100", "RTX 9090"):
        with pytest.raises(ConfigError, match="gpu"):
            TraceAnalysis(path, gpu=bad)
    out = tmp_path / "o"
    assert perflab(["trace", str(path), "--out", str(out), "--gpu", "RTX 9090"]) == 2
    err = capsys.readouterr().err
    assert "H100 PCIe" in err and "A100 SXM4 40GB" in err and not out.exists()
    assert perflab(["trace", str(path), "--out", str(out), "--gpu", "H100 PCIe", "--json"]) == 0
    fig = json.loads(capsys.readouterr().out)
    assert {r["part"] for r in fig["roofline"]["0"]} == {"H100 PCIe"}


def test_lab_09_takes_the_gpu_of_a_trace_that_names_none(tmp_path):
    from lab_utils.studies.traces import TracesLabConfig, load

    path = gemm_trace(tmp_path, None, name="anon.json")
    lt = load(TracesLabConfig(trace_path=str(path), gpu="A100 SXM4 40GB"))
    assert lt.analyses["trace"].datasheet(0).name == "A100 SXM4 40GB"
    with pytest.raises(ConfigError, match="gpu"):
        TracesLabConfig(trace_path=str(path), gpu="A100")
