"""Pins of the low-precision formats' figures against numbers derived outside the code.

What is pinned, and from where:

* each format's storage in bits per element: the element's own bits plus the scale's 8 bits
  amortised over the OCP MX block of 32 (MXFP8 8.25, MXFP4 4.25) or NVFP4's block of 16 (4.5);
  the element formats' largest magnitudes and ``emax`` from the OCP MX v1.0 tables and
  ``torch.finfo``;
* the MX "floor" scale of a block whose amax is 1: ``2^(0 - emax)`` (E8M0 code 127 - emax);
* NVFP4's two-level scale by hand: tensor scale ``amax / (448 * 6)``, block scale ``block amax
  / 6 / tensor scale`` (both backends);
* ``QuantizedTensor.dequantize`` of FP8 (``x = data / scale``) on values the scale maps exactly;
* the FP8 GEMM tolerance at hand-counted K (its documented terms, written out as numbers);
* the accumulation model's round-to-nearest-even against torch's own bfloat16 cast, ties included.
"""

from __future__ import annotations

import pytest
import torch

import lab_kernels  # noqa: F401  (sets up the Triton interpreter before anything imports Triton)
from lab_kernels import lowp_matmul as L
from lab_kernels import quant as Q

# OCP MX v1.0, table 1 (and NVIDIA's NVFP4): element bits, scale bits, block size
SPEC_BITS = {
    "fp8_e4m3": 8.0,  # per-tensor scale: nothing per element
    "fp8_e5m2": 8.0,
    "mxfp8_e4m3": 8 + 8 / 32,
    "mxfp8_e5m2": 8 + 8 / 32,
    "mxfp4": 4 + 8 / 32,
    "nvfp4": 4 + 8 / 16,  # e4m3 block scale per 16 (the fp32 tensor scale is one per tensor)
}


def test_bits_per_element_are_the_specs():
    assert {k: f.bits_per_elem for k, f in Q.FORMATS.items()} == SPEC_BITS
    assert {k: f.block_size for k, f in Q.FORMATS.items() if f.family != "fp8"} == {
        "mxfp8_e4m3": 32,
        "mxfp8_e5m2": 32,
        "mxfp4": 32,
        "nvfp4": 16,
    }


def test_element_maxima_are_the_ocp_tables():
    # OCP MX v1.0 table 2: e4m3 (fn) 448 = 1.75 * 2^8, e5m2 57344 = 1.75 * 2^15, e2m1 6 = 1.5 * 2^2
    want = {"e4m3": (448.0, 8), "e5m2": (57344.0, 15), "e2m1": (6.0, 2)}
    assert {k: (f.max, f.emax) for k, f in Q.ELEM_FORMATS.items()} == want
    assert Q.ELEM_FORMATS["e4m3"].max == torch.finfo(torch.float8_e4m3fn).max
    assert Q.ELEM_FORMATS["e5m2"].max == torch.finfo(torch.float8_e5m2).max


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_mx_floor_scale_of_a_unit_block(backend):
    """amax = 1 (2^0): the OCP floor rule gives 2^(0 - emax), E8M0 code 127 - emax."""
    x = torch.zeros(2, 32)
    x[:, 5] = 1.0
    x[1, 7] = -0.25
    want = {"mxfp8_e4m3": 127 - 8, "mxfp8_e5m2": 127 - 15, "mxfp4": 127 - 2}
    for fmt, code in want.items():
        q = Q.quantize(x, fmt, backend=backend)
        assert q.scale.view(torch.uint8).flatten().tolist() == [code, code], fmt
        assert torch.equal(q.dequantize(torch.float32), x), fmt  # 1 and 0.25 are exact in every element


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_nvfp4_two_level_scale_by_hand(backend):
    """amax 2688 = 448 * 6: tensor scale 1; the block holding it scales by 448, a block of
    amax 18 by 18 / 6 = 3; the amaxes dequantize exactly."""
    x = torch.zeros(1, 32)
    x[0, 3] = 2688.0
    x[0, 20] = -18.0
    x[0, 21] = 9.0  # 9 / 3 = 3, an e2m1 value
    q = Q.quantize(x, "nvfp4", backend=backend)
    assert float(q.tensor_scale) == 1.0
    assert q.scale.float().flatten().tolist() == [448.0, 3.0]
    assert torch.equal(q.dequantize(torch.float32), x)
    # the same tensor scaled by 1/4: every scale the same but the tensor scale, a quarter
    q4 = Q.quantize(x / 4, "nvfp4", backend=backend)
    assert float(q4.tensor_scale) == 0.25
    assert q4.scale.float().flatten().tolist() == [448.0, 3.0]


def test_fp8_dequantize_divides_by_the_scale():
    """amax 2: the e4m3 tensor scale is 448 / 2 = 224; 1 -> 224 and 0.5 -> 112 are e4m3 values,
    so data / scale gives x back exactly."""
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0]])
    for fmt, gran in (("fp8_e4m3", "tensor"), ("fp8_e4m3", "row")):
        q = Q.quantize(x, fmt, granularity=gran)
        assert float(q.scale.flatten()[0]) == 224.0
        assert q.dequantize(torch.float32).tolist() == x.tolist(), gran


def test_fp8_gemm_tolerance_by_hand():
    tol = L.fp8_gemm_tolerance
    bf16, fp32 = 2.0**-8, 2.0**-20
    # fast accumulation: one 13-bit adder update per started 32 products
    assert tol(16, fast_accum=True) == bf16 + 1 * 2.0**-13
    assert tol(32, fast_accum=True) == bf16 + 1 * 2.0**-13
    assert tol(33, fast_accum=True) == bf16 + 2 * 2.0**-13
    assert tol(96, fast_accum=True) == bf16 + 3 * 2.0**-13
    # promoted every 128: four updates at most, plus fp32's 2^-24 per element of K
    assert tol(4096, fast_accum=False) == bf16 + 4 * 2.0**-13 + 2.0**-12
    assert tol(1024, fast_accum=False, out_dtype=torch.float32) == fp32 + 4 * 2.0**-13 + 2.0**-14
    assert tol(8, fast_accum=False, out_dtype=torch.float16) == 2.0**-11 + 4 * 2.0**-13 + 8 * 2.0**-24


def test_round_mantissa_nearest_is_torchs_bf16_cast_ties_to_even(gen):
    # 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 (even: 1); 1 + 3 * 2^-8 halfway between
    # 1 + 2^-7 (odd) and 1 + 2^-6 (even: up)
    ties = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 2 * (1 + 3 * 2.0**-8)])
    assert L.round_mantissa(ties, 7).tolist() == [1.0, 1 + 2.0**-6, -1.0, 2 * (1 + 2.0**-6)]
    # random values, half of them forced onto a tie (low 16 bits 0x8000)
    bits = torch.randn(4096, generator=gen).view(torch.int32)
    bits[::2] = (bits[::2] & ~0xFFFF) | 0x8000
    x = bits.view(torch.float32)
    assert torch.equal(L.round_mantissa(x, 7), x.to(torch.bfloat16).float())


def test_bf16_accumulation_of_one_step_is_the_bf16_rounded_sum(gen):
    """K = 16 is one inner step of the bf16 model: the exact sum rounded once to bfloat16."""
    a, b = torch.randn(8, 16, generator=gen), torch.randn(5, 16, generator=gen)
    want = (a.double() @ b.double().T).float().to(torch.bfloat16).float()
    assert torch.equal(L.accumulate_matmul(a, b, "bf16"), want)
