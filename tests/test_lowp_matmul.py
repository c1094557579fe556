"""lab_kernels.lowp_matmul: accumulation model, emulated / _scaled_mm / Triton FP8 paths."""

import pytest
import torch

import lab_kernels  # noqa: F401
from lab_kernels import lowp_matmul as L
from lab_kernels import quant as Q
from lab_kernels.registry import variants
from lab_utils.checks import assert_bitwise_equal, assert_close, rel_error, sqnr_db


def test_round_mantissa_bf16_equals_torch_cast(gen):
    x = torch.randn(4096, generator=gen) * torch.exp(torch.randn(4096, generator=gen) * 10)
    assert_bitwise_equal(L.round_mantissa(x, 7), x.bfloat16().float(), name="RNE to bf16")
    t = L.round_mantissa(x, 7, "truncate")
    assert_bitwise_equal(t, (x.view(torch.int32) & ~0xFFFF).view(torch.float32), name="truncate")
    assert bool((t.abs() <= x.abs()).all())
    with pytest.raises(ValueError, match="'acc_bits'"):
        L.round_mantissa(x, 30)
    with pytest.raises(ValueError, match="'rounding'"):
        L.round_mantissa(x, 7, "up")


def test_accumulation_models(gen):
    a = torch.randn(24, 2048, generator=gen).abs()  # same-sign products: accumulation error shows
    b = torch.randn(20, 2048, generator=gen).abs()
    ref = L.reference_matmul(a, b)
    assert_close(L.accumulate_matmul(a, b, "fp32"), ref.float(), dtype=torch.float32, name="fp32")
    e = {k: rel_error(L.accumulate_matmul(a, b, k), ref) for k in L.ACCUMULATIONS}
    assert e["fp32"] < 1e-6
    assert e["bf16"] > 10 * e["fp32"]
    assert e["fp8_fast"] > e["fp8_fast_promote128"] > e["fp32"], e
    exact23 = L.accumulate_matmul(a, b, L.Accumulation("x", 23, "nearest", 16))
    assert rel_error(exact23, ref) < 1e-6


def test_split_k(gen):
    a, b = torch.randn(9, 301, generator=gen), torch.randn(7, 301, generator=gen)
    ref = L.reference_matmul(a, b).float()
    for s in (1, 2, 3, 7):
        assert_close(L.accumulate_matmul(a, b, "fp32", split_k=s), ref, dtype=torch.float32, name=f"split_k={s}")
    with pytest.raises(ValueError, match="'split_k'"):
        L.accumulate_matmul(a, b, "fp32", split_k=0)
    with pytest.raises(ValueError, match="'accum'"):
        L.accumulate_matmul(a, b, "fp16ish")


@pytest.mark.parametrize(
    "fmt,gran",
    [
        ("fp8_e4m3", "tensor"),
        ("fp8_e4m3", "row"),
        ("fp8_e4m3", "block"),
        ("mxfp8_e4m3", None),
        ("mxfp4", None),
        ("nvfp4", None),
    ],
)
def test_emulated_equals_quantized_operands(fmt, gran, gen):
    a, b = torch.randn(33, 256, generator=gen), torch.randn(17, 256, generator=gen) * 0.02
    y = L.emulated_matmul(a, b, fmt, granularity=gran, out_dtype=torch.float32)
    gb = "block2d" if gran == "block" else gran
    qa = Q.fake_quantize(a, fmt, granularity=gran)
    qb = Q.fake_quantize(b, fmt, granularity=gb)
    assert_bitwise_equal(y, qa @ qb.T, name=f"{fmt} emulated")
    floor = {"fp8_e4m3": 26, "mxfp8_e4m3": 25, "mxfp4": 13, "nvfp4": 15}[fmt]
    assert sqnr_db(y, L.reference_matmul(a, b)) > floor


def test_hadamard_cancels_in_the_product(gen):
    a, b = torch.randn(16, 128, generator=gen), torch.randn(12, 128, generator=gen)
    ha, hb = Q.hadamard_transform(a, 32), Q.hadamard_transform(b, 32)
    assert_close(ha @ hb.T, a @ b.T, atol=1e-4, rtol=1e-4, name="(aH)(bH)^T = ab^T")
    # with outlier channels the rotation helps MXFP4 (a statistical claim: fixed seed, 64 x 256)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=g), torch.randn(48, 256, generator=g)
    a[:, [3, 77]] *= 80
    plain = sqnr_db(L.emulated_matmul(a, b, "mxfp4"), L.reference_matmul(a, b))
    rot = sqnr_db(L.emulated_matmul(a, b, "mxfp4", hadamard=32), L.reference_matmul(a, b))
    assert rot > plain, (rot, plain)  # 15.4 vs 14.8 dB at this seed


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("gran", ["tensor", "row"])
def test_scaled_mm_matches_emulation_on_cpu(fmt, gran, gen):
    if L.scaled_mm_why_not("cpu", granularity=gran, fmt=fmt):
        pytest.skip(L.scaled_mm_why_not("cpu", granularity=gran, fmt=fmt))
    a, b = torch.randn(40, 96, generator=gen), torch.randn(24, 96, generator=gen) * 3
    y = L.scaled_mm(a, b, fmt, granularity=gran, out_dtype=torch.float32)
    e = L.emulated_matmul(a, b, fmt, granularity=gran, out_dtype=torch.float32)
    # same fp8 operands; only the dequant order (data*s vs data/scale) and summation order differ
    assert_close(y, e, atol=1e-4, rtol=1e-4, name=f"_scaled_mm {fmt}/{gran}")


def test_triton_fp8_matmul_matches_scaled_mm(gen):
    a, b = torch.randn(37, 80, generator=gen), torch.randn(45, 80, generator=gen)
    for gran in ("tensor", "row"):
        p = L.prepare_scaled_mm_any(a, b, "fp8_e4m3", granularity=gran)
        t = L.triton_fp8_matmul(p[1], p[2], p[3], p[4])
        ref = (
            (p[1].float() @ p[2].float().T)
            * (p[3].reshape(-1, 1) if gran == "row" else p[3])
            * (p[4].reshape(1, -1) if gran == "row" else p[4])
        )
        assert_close(t, ref, dtype=torch.float32, name=f"triton fp8 {gran}")


def test_capability_reasons():
    assert "CPU" in (L.scaled_mm_why_not("cpu", fmt="mxfp8_e4m3") or "")
    assert "CPU" in (L.scaled_mm_why_not("cpu", fmt="fp8_e4m3", granularity="block") or "")
    v = {x.name: x for x in variants("lowp_matmul", include_unavailable=True)}
    assert {"reference", "emulated", "scaled_mm", "triton"} <= set(v)
    assert v["triton"].why_not("cpu", fmt="mxfp4") is not None
    assert not v["triton"].timeable("cpu")


def test_bad_shapes_name_parameter():
    with pytest.raises(ValueError, match="'b'"):
        L.emulated_matmul(torch.randn(4, 32), torch.randn(5, 16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_89+ for FP8, sm_100 for MX)")
def test_scaled_mm_on_gpu():  # pragma: no cover - no GPU here
    a = torch.randn(256, 512, device="cuda")
    b = torch.randn(128, 512, device="cuda")
    for fmt, gran in (("fp8_e4m3", "tensor"), ("fp8_e4m3", "row"), ("mxfp8_e4m3", None)):
        why = L.scaled_mm_why_not("cuda", fmt=fmt, granularity=gran)
        if why:
            continue
        y = L.scaled_mm(a, b, fmt, granularity=gran, out_dtype=torch.float32)
        assert sqnr_db(y.cpu(), L.reference_matmul(a.cpu(), b.cpu())) > 25
