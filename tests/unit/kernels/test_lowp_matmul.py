"""lab_kernels.lowp_matmul: accumulation model, emulated / _scaled_mm / Triton FP8 paths."""

import os
import subprocess
import sys

import pytest
import torch

from lab_kernels import lowp_matmul as L
from lab_kernels import quant as Q
from lab_kernels.registry import variants
from lab_utils.core.checks import assert_bitwise_equal, assert_close, rel_error, sqnr_db


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


@pytest.mark.parametrize("gran", ["tensor", "row"])
def test_triton_fp8_matmul_matches_scaled_mm(gran, gen):
    """The Triton FP8 GEMM against torch._scaled_mm itself on the same fp8 operands and scales
    (both accumulate in fp32; only the summation order differs)."""
    if L.scaled_mm_why_not("cpu", granularity=gran, out_dtype=torch.float32):
        pytest.skip(L.scaled_mm_why_not("cpu", granularity=gran, out_dtype=torch.float32))
    a, b = torch.randn(37, 80, generator=gen), torch.randn(45, 80, generator=gen)
    p = L.prepare_scaled_mm(a, b, "fp8_e4m3", granularity=gran)
    ref = L.scaled_mm(a, b, prepared=p, out_dtype=torch.float32)
    got = L.fp8_matmul_forward(p[1], p[2], p[3], p[4])
    assert_close(got, ref, atol=1e-4, rtol=1e-5, name=f"triton fp8 vs _scaled_mm ({gran})")
    assert L.triton_fp8_matmul is L.fp8_matmul_forward


def test_triton_fp8_matmul_refuses_bad_operands(gen):
    a8 = torch.randn(16, 64, generator=gen).to(torch.float8_e4m3fn)
    b8 = torch.randn(24, 64, generator=gen).to(torch.float8_e4m3fn)
    one = torch.ones(())
    with pytest.raises(ValueError, match="'b_fp8' has K = 48"):
        L.fp8_matmul_forward(a8, b8[:, :48], one, one)  # used to read past the end of b
    with pytest.raises(TypeError, match="'a_fp8' has dtype float32.*float8_e4m3fn, float8_e5m2"):
        L.fp8_matmul_forward(a8.float(), b8, one, one)
    with pytest.raises(ValueError, match="'sb' has 5 elements; expected 1 .* or 24"):
        L.fp8_matmul_forward(a8, b8, one, torch.ones(5))


_AOT_FP8 = r"""
import os
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import lab_kernels.lowp_matmul as L
import re
kern = L._fp8_matmul_fwd_kernel
# e4m3 in both accumulation modes, e5m2 in the default (promoted) one; the output is bfloat16
for dt, modes in (("fp8e4nv", (False, True)), ("fp8e5", (False,))):
    for fast in modes:
        for cfg in L.FP8_AUTOTUNE_CONFIGS:
            const = dict(ROW_SCALES=True, FAST_ACCUM=fast, **cfg.kwargs)
            p = dict(a_ptr="*" + dt, b_ptr="*" + dt, c_ptr="*bf16", sa_ptr="*fp32", sb_ptr="*fp32")
            sig = {a: "constexpr" if a in const else p.get(a, "i32") for a in kern.arg_names}
            k = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
            ptx = k.asm["ptx"]
            mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
            imprecise = re.findall(r"maxNumImpreciseAcc = (\d+)", k.asm["ttgir"])
            print(dt, fast, cfg.kwargs["BLOCK_K"], ",".join(imprecise) or "-", mma, k.metadata.shared)
"""


def test_fp8_gemm_runtime_tiles_compile_to_wgmma_for_hopper():
    """Every config the GPU autotunes over must lower to Hopper's wgmma (a 32x32x32 tile lowers
    to mma.sync) and fit sm_90's shared memory; compiled ahead of time, no GPU needed."""
    assert [tuple(c.kwargs.values()) + (c.num_stages, c.num_warps) for c in L.FP8_AUTOTUNE_CONFIGS] == list(L.FP8_TILES)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    r = subprocess.run([sys.executable, "-c", _AOT_FP8], capture_output=True, text=True, env=env, timeout=1200)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("this triton install has no ptxas to compile with")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3 * len(L.FP8_TILES), r.stdout
    for line in lines:
        _, fast, block_k, imprecise, mma, shared = line.split()
        assert mma == "wgmma", line
        assert int(shared) <= 227 * 1024, line
        # fast: Triton's sm_90 default (never promoted); else promoted to fp32 every BLOCK_K products,
        # the counterpart of _scaled_mm(use_fast_accum=False)
        assert imprecise == (str(2**30) if fast == "True" else block_k), line


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
    with pytest.raises(ValueError, match="parameter 'a'"):
        L.emulated_matmul(torch.randn(4, 32, 2), torch.randn(5, 32))
    with pytest.raises(ValueError, match="parameter 'a'"):
        L.emulated_matmul(torch.ones(4, 32, dtype=torch.int32), torch.randn(5, 32))


def test_unknown_format_names_the_parameter_and_the_allowed_values():
    a, b = torch.randn(4, 32), torch.randn(5, 32)
    with pytest.raises(ValueError, match="parameter 'fmt' = 'fp7' is not allowed: expected one of 'fp8_e4m3'"):
        L.emulated_matmul(a, b, "fp7")
    with pytest.raises(ValueError, match="parameter 'fmt_b' = 'fp7'"):
        L.emulated_matmul(a, b, "fp8_e4m3", fmt_b="fp7")
    assert "'fmt' = 'fp7' is not a format" in L.scaled_mm_why_not("cpu", fmt="fp7")
    assert "'fmt_b'" in L.scaled_mm_why_not("cpu", fmt="fp8_e4m3", fmt_b="int8")


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend a CUDA device of a given capability and CUDA version exists (for why_not only)."""

    def set_(cap, cuda_version):
        monkeypatch.setattr(L, "_scaled_mm_probe", lambda *a: None)  # nothing to call on a pretend device
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
        monkeypatch.setattr(torch.version, "cuda", cuda_version)

    return set_


def test_scaled_mm_knows_what_cublas_refuses(fake_cuda):
    fake_cuda((9, 0), "12.4")
    why = L.scaled_mm_why_not("cuda", fmt="fp8_e5m2")
    assert "Multiplication of two Float8_e5m2 matrices is not supported" in why
    assert L.scaled_mm_why_not("cuda", fmt="fp8_e4m3", fmt_b="fp8_e5m2") is None
    # row-wise scales with float32 output: only on the cuBLAS path (CUDA >= 12.9 build, sm_90)
    assert "CUDA >= 12.9" in L.scaled_mm_why_not("cuda", granularity="row", out_dtype=torch.float32)
    assert L.scaled_mm_why_not("cuda", granularity="row", out_dtype=torch.bfloat16) is None
    assert L.scaled_mm_why_not("cuda", granularity="tensor", out_dtype=torch.float32) is None
    fake_cuda((9, 0), "12.9")
    assert L.scaled_mm_why_not("cuda", granularity="row", out_dtype=torch.float32) is None
    fake_cuda((8, 9), "12.9")
    assert "sm_89" in L.scaled_mm_why_not("cuda", granularity="row", out_dtype=torch.float32)


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


def test_fp8_gemm_writes_its_output_dtype_itself(gen, monkeypatch):
    """The kernel's epilogue stores bfloat16: no float32 (M, N) buffer and no second cast kernel
    (it used to write float32 and call .to(out_dtype) after, which a fair timing must not include)."""
    a, b = torch.randn(37, 80, generator=gen), torch.randn(45, 80, generator=gen) / 9
    p = L.prepare_scaled_mm_any(a, b, "fp8_e4m3", granularity="row")
    made = []
    real_empty = torch.empty

    def spy(*size, **kw):
        t = real_empty(*size, **kw)
        made.append((tuple(t.shape), t.dtype))
        return t

    monkeypatch.setattr(torch, "empty", spy)
    y = L.fp8_matmul_forward(p[1], p[2], p[3], p[4], out_dtype=torch.bfloat16)
    monkeypatch.undo()
    assert y.dtype == torch.bfloat16 and y.shape == (37, 45)
    assert [m for m in made if m[0] == (37, 45)] == [((37, 45), torch.bfloat16)], made
    a64 = p[1].double() * p[3].double()[:, None]
    b64 = p[2].double() * p[4].double()[:, None]
    ref = a64 @ b64.T
    assert rel_error(y.float(), ref) <= L.fp8_gemm_tolerance(80, fast_accum=False, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="parameter 'out_dtype' = torch.int32 is not allowed"):
        L.fp8_matmul_forward(p[1], p[2], p[3], p[4], out_dtype=torch.int32)
    with pytest.raises(ValueError, match="parameter 'fast_accum' = 1 is not allowed"):
        L.fp8_matmul_forward(p[1], p[2], p[3], p[4], fast_accum=1)


def test_fp8_gemm_tolerance_depends_on_k_and_the_accumulation():
    """A fixed 1e-2 was too loose at small K and too tight for fast accumulation at large K:
    Hopper's never-promoted adder (13 bits, truncated) loses about 2^-13 per 32 products."""
    tol = L.fp8_gemm_tolerance
    assert tol(8192, fast_accum=True) > tol(4096, fast_accum=True) > tol(96, fast_accum=True)
    assert tol(8192, fast_accum=True) > 3e-2 > tol(8192, fast_accum=False)  # 256 unpromoted updates
    assert tol(96, fast_accum=False) < 5e-3  # the bf16 output's rounding dominates a short K
    assert tol(96, fast_accum=False, out_dtype=torch.float32) < tol(96, fast_accum=False)
    # the accumulation model of this module stays within the bound it documents (same-sign
    # products, the worst case for a truncating adder)
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(8, 4096, generator=g), torch.rand(6, 4096, generator=g)
    ref = L.reference_matmul(a, b)
    fast = rel_error(L.accumulate_matmul(a, b, "fp8_fast"), ref)
    promoted = rel_error(L.accumulate_matmul(a, b, "fp8_fast_promote128"), ref)
    assert promoted < tol(4096, fast_accum=False, out_dtype=torch.float32) < fast < tol(4096, fast_accum=True)
    with pytest.raises(ValueError, match="parameter 'K' = 0"):
        tol(0, fast_accum=False)
    with pytest.raises(ValueError, match="parameter 'out_dtype'"):
        tol(64, fast_accum=False, out_dtype=torch.int8)


def test_scaled_mm_why_not_probes_what_this_torch_accepts(monkeypatch):
    """torch 2.11's CPU _scaled_mm takes per-tensor scales only; the rules alone said row-wise
    scales run.  The capability is a tiny real call, cached per kind of problem."""
    real = torch._scaled_mm
    calls = []

    def torch_2_11(a, b, *, scale_a, scale_b, **kw):
        calls.append(scale_a.numel())
        if a.device.type == "cpu" and (scale_a.numel() != 1 or scale_b.numel() != 1):
            raise RuntimeError(
                "(scale_a.numel() == 1 && scale_b.numel() == 1) INTERNAL ASSERT FAILED at Blas.cpp:249. "
                "Now _scaled_mm only supports per-tensor scaling for CPU backend."
            )
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kw)

    monkeypatch.setattr(L, "_PROBED", {})
    monkeypatch.setattr(torch, "_scaled_mm", torch_2_11)
    why = L.scaled_mm_why_not("cpu", fmt="fp8_e4m3", granularity="row")
    assert why and "refuses row-scaled _scaled_mm" in why and "only supports per-tensor scaling" in why
    assert L.scaled_mm_why_not("cpu", fmt="fp8_e4m3", granularity="tensor") is None
    n = len(calls)
    assert L.scaled_mm_why_not("cpu", fmt="fp8_e4m3", granularity="row") == why and len(calls) == n  # cached
    with pytest.raises(RuntimeError, match="only supports per-tensor"):
        L.prepare_scaled_mm(torch.randn(4, 32), torch.randn(4, 32), granularity="row")  # refused, with the reason
