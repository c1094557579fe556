"""Low-precision element formats and their exact plain-torch numerics (shared by
``lab_kernels.quant``'s reference and Triton quantizers and by ``lowp_matmul``).

The formats (FP8 e4m3fn / e5m2, MXFP8, MXFP4, NVFP4), their element grids, the scaling
modes the quantizer kernel switches on, and the float64-free reference rounding of a
scaling group (:func:`reference_quantize_groups`); the design note of ``quant`` explains
the numerics.  Plain torch only: no Triton here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# --------------------------------------------------------------------------- formats


@dataclass(frozen=True)
class ElemFormat:
    name: str
    ebits: int
    mbits: int
    emin: int  # exponent of the smallest normal
    max: float  # largest finite magnitude
    emax: int  # floor(log2(max)), torchao's *_MAX_POW2
    torch_dtype: torch.dtype | None
    nan_code: int

    @property
    def bias(self) -> int:
        return 1 - self.emin

    @property
    def n_codes(self) -> int:
        return 1 << (1 + self.ebits + self.mbits)


ELEM_FORMATS = {
    "e4m3": ElemFormat("e4m3", 4, 3, -6, 448.0, 8, torch.float8_e4m3fn, 0x7F),
    "e5m2": ElemFormat("e5m2", 5, 2, -14, 57344.0, 15, torch.float8_e5m2, 0x7F),
    "e2m1": ElemFormat("e2m1", 2, 1, 0, 6.0, 2, None, 0x7),
}
ELEM_IDS = {"e4m3": 0, "e5m2": 1, "e2m1": 2}


@dataclass(frozen=True)
class Format:
    """A quantization format: element type plus how it is scaled."""

    name: str
    elem: str
    family: str  # "fp8" | "mx" | "nvfp4"
    block_size: int | None  # default block (fp8: for granularity block/block2d)
    bits_per_elem: float  # storage incl. scales amortised over the block

    @property
    def elem_format(self) -> ElemFormat:
        return ELEM_FORMATS[self.elem]


FORMATS: dict[str, Format] = {
    "fp8_e4m3": Format("fp8_e4m3", "e4m3", "fp8", 128, 8.0),
    "fp8_e5m2": Format("fp8_e5m2", "e5m2", "fp8", 128, 8.0),
    "mxfp8_e4m3": Format("mxfp8_e4m3", "e4m3", "mx", 32, 8.25),
    "mxfp8_e5m2": Format("mxfp8_e5m2", "e5m2", "mx", 32, 8.25),
    "mxfp4": Format("mxfp4", "e2m1", "mx", 32, 4.25),
    "nvfp4": Format("nvfp4", "e2m1", "nvfp4", 16, 4.5),
}
GRANULARITIES = ("tensor", "row", "block", "block2d", "none")
SCALE_RULES = ("floor", "rceil")
ROUNDINGS = ("nearest", "stochastic")
NONFINITE = ("propagate", "raise")

FP8_EPS = 1e-12  # torchao float8_utils.EPS
E4M3_TINY = 2.0**-6  # torch.finfo(float8_e4m3fn).tiny, NVFP4 scale floor
F32_MIN_NORMAL = 2.0**-126
NVFP4_TENSOR_DIV = 448.0 * 6.0

# kernel switches
SCALING_NONE, SCALING_AMAX, SCALING_GIVEN, SCALING_MX_FLOOR, SCALING_MX_RCEIL, SCALING_NVFP4 = range(6)


def param_error(param: str, value, allowed: str) -> ValueError:
    return ValueError(f"parameter {param!r} = {value!r} is not allowed: expected {allowed}")


def check_format(fmt: str, param: str = "fmt") -> Format:
    """The :class:`Format` named ``fmt``; a ValueError naming ``param`` and the allowed names otherwise."""
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise param_error(param, fmt, "one of " + ", ".join(repr(f) for f in FORMATS))
    return FORMATS[fmt]


# ------------------------------------------------------------------ element grid helpers


def representable_values(elem: str, *, positive_only: bool = False) -> torch.Tensor:
    """Every finite value of an element format, sorted (float64), +0 once."""
    codes = torch.arange(ELEM_FORMATS[elem].n_codes, dtype=torch.int32)
    v = decode_codes(codes.to(torch.uint8), elem).double()
    v = v[torch.isfinite(v)]
    v = torch.unique(v)  # merges ±0
    return v[v >= 0] if positive_only else v


def decode_codes(codes: torch.Tensor, elem: str) -> torch.Tensor:
    """uint8 element codes (unpacked, one per byte) -> float32 values (NaN/Inf as the format defines)."""
    f = ELEM_FORMATS[elem]
    c = codes.to(torch.int32)
    nb = f.ebits + f.mbits
    sign = (c >> nb) & 1
    ex = (c >> f.mbits) & ((1 << f.ebits) - 1)
    man = (c & ((1 << f.mbits) - 1)).double()
    mag = torch.where(
        ex == 0, man * 2.0 ** (f.emin - f.mbits), (1 + man / (1 << f.mbits)) * torch.exp2((ex - f.bias).double())
    )
    if elem == "e4m3":
        mag = torch.where((ex == 15) & (man == 7), float("nan"), mag)
    elif elem == "e5m2":
        mag = torch.where((ex == 31) & (man == 0), float("inf"), mag)
        mag = torch.where((ex == 31) & (man != 0), float("nan"), mag)
    return torch.where(sign == 1, -mag, mag).float()


# ------------------------------------------------------------------ torch reference numerics


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def bits_f32(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32).contiguous().view(torch.float32)


CANONICAL_NAN_BITS = 0x7FC00000


def round_elements_reference(
    v: torch.Tensor, f: ElemFormat, stochastic: bool, rbits: torch.Tensor | None, codes: bool = True
):
    """fp32 v (already scaled) -> (rounded fp32 value, uint8 code or None).  See module note."""
    a = torch.clamp(v.abs(), max=f.max)  # saturate; NaN stays
    e = ((f32_bits(a) >> 23) & 0xFF) - 127
    e = torch.clamp(e, min=f.emin)
    inv_ulp = bits_f32((127 + f.mbits - e) << 23)
    ulp = bits_f32((127 - f.mbits + e) << 23)
    y = a * inv_ulp
    fl = torch.floor(y)
    frac = y - fl
    if stochastic:
        u = (rbits & 0xFFFFFF).to(torch.float32) * (2.0**-24)
        up = frac > u
    else:
        odd = (fl - 2.0 * torch.floor(fl * 0.5)) == 1.0
        up = (frac > 0.5) | ((frac == 0.5) & odd)
    q = (fl + up.to(torch.float32)) * ulp
    nan = torch.isnan(q)
    if not codes:
        return torch.where(nan, bits_f32(torch.full_like(e, CANONICAL_NAN_BITS)), torch.copysign(q, v)), None
    sign = (f32_bits(v) >> 31) & 1
    # code: subnormal (q < 2^emin) -> mantissa only, else biased exponent | mantissa bits
    qb = f32_bits(torch.where(nan, torch.zeros_like(q), q))
    qe = ((qb >> 23) & 0xFF) - 127
    normal = q >= 2.0**f.emin
    code_n = ((qe + f.bias) << f.mbits) | ((qb >> (23 - f.mbits)) & ((1 << f.mbits) - 1))
    code_s = (torch.clamp(q, max=2.0**f.emin) * 2.0 ** (f.mbits - f.emin)).to(torch.int32)
    code = torch.where(normal, code_n, torch.where(nan, torch.zeros_like(code_s), code_s))
    code = torch.where(nan, torch.full_like(code, f.nan_code), code)
    code = code | (sign << (f.ebits + f.mbits))
    qs = bits_f32(f32_bits(torch.where(nan, torch.zeros_like(q), q)) | (sign << 31))
    qs = torch.where(nan, bits_f32(torch.full_like(sign, CANONICAL_NAN_BITS)), qs)
    return qs, code.to(torch.uint8)


def ceil_log2_bits(d: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(d)) for finite d >= 0 in fp32 from its bits, floored at -127 (E8M0's least)."""
    b = f32_bits(d)
    ex = (b >> 23) & 0xFF
    man = b & 0x7FFFFF
    # subnormal d: in (2^-127, 2^-126) -> -126; <= 2^-127 (mantissa 0x400000) -> -127 (the E8M0 floor)
    sub = torch.where(man > 0x400000, torch.full_like(ex, -126), torch.full_like(ex, -127))
    return torch.where(ex == 0, sub, ex - 127 + (man != 0).to(torch.int32))


def e8m0_to_f32(biased: torch.Tensor) -> torch.Tensor:
    b = biased.to(torch.int32)
    s = bits_f32(torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23))
    return torch.where(b == 255, bits_f32(torch.full_like(b, CANONICAL_NAN_BITS)), s)


def reference_quantize_groups(
    g: torch.Tensor,
    elem: str,
    scaling: int,
    *,
    stochastic: bool = False,
    rbits: torch.Tensor | None = None,
    tensor_scale: torch.Tensor | None = None,
    codes: bool = True,
):
    """Quantize rows of ``g`` (n_groups, G) fp32, one scaling group per row.

    Returns (dequantized fp32 (n_groups, G), codes uint8 (n_groups, G), group scale fp32 (n_groups,)):
    the scale is fp8's multiplier, MX's biased E8M0 exponent (as a float), NVFP4's e4m3 block scale.
    """
    f = ELEM_FORMATS[elem]
    n = g.shape[0]
    amax = g.abs().amax(dim=1) if g.shape[1] else torch.zeros(n)
    bad = ~torch.isfinite(amax)
    nanv = torch.full_like(amax, float("nan"))
    if scaling == SCALING_NONE:
        q, code = round_elements_reference(g, f, stochastic, rbits, codes)
        return q, code, torch.ones(n)
    if scaling in (SCALING_AMAX, SCALING_GIVEN):
        if scaling == SCALING_AMAX:
            scale = (f.max / torch.clamp(amax.double(), min=FP8_EPS)).float()
            scale = torch.where(bad, nanv, scale)
        else:
            scale = tensor_scale.float().expand(n)
        v = g * scale[:, None]
        q, code = round_elements_reference(v, f, stochastic, rbits, codes)
        return q / scale[:, None], code, scale
    if scaling == SCALING_MX_FLOOR:
        ex = ((f32_bits(amax) >> 23) & 0xFF) - 127
        biased = torch.clamp(ex - f.emax, -127, 128) + 127
        biased = torch.where(bad, torch.full_like(biased, 255), biased)
        sc = torch.clamp(bits_f32(biased << 23), min=F32_MIN_NORMAL)  # 255 -> inf
        rcp = 1.0 / sc  # exact: power of two (or 0 for inf)
        v = g * rcp[:, None]
        v = torch.where(bad[:, None], nanv[:, None].expand_as(v), v)
    elif scaling == SCALING_MX_RCEIL:
        descale = amax / f.max
        biased = torch.clamp(ceil_log2_bits(descale), -127, 127) + 127
        biased = torch.where(bad, torch.full_like(biased, 255), biased)
        rcp = torch.where(
            biased == 0,
            torch.ones_like(descale),
            torch.where(
                biased >= 254, torch.full_like(descale, 2.0**-127), bits_f32((254 - biased).clamp(min=0) << 23)
            ),
        )
        v = g * rcp[:, None]
        v = torch.where(bad[:, None], nanv[:, None].expand_as(v), v)
    elif scaling == SCALING_NVFP4:
        pts = tensor_scale.float()
        bs = amax / 6.0
        sc = torch.clamp(bs / pts, min=E4M3_TINY, max=448.0)
        sc, _ = round_elements_reference(sc, ELEM_FORMATS["e4m3"], False, None)
        recip = (1.0 / pts) / sc
        v = g * recip[:, None]
        v = torch.where(bad[:, None], nanv[:, None].expand_as(v), v)
        q, code = round_elements_reference(v, f, stochastic, rbits, codes)
        deq = q * (sc * pts)[:, None]
        sc = torch.where(bad, nanv, sc)
        return deq, code, sc
    else:
        raise ValueError(f"unknown scaling mode {scaling}")
    q, code = round_elements_reference(v, f, stochastic, rbits, codes)
    deq = q * e8m0_to_f32(biased)[:, None]
    return deq, code, biased.to(torch.float32)
