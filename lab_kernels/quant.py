"""Low-precision formats: FP8 (e4m3fn, e5m2), MXFP8, MXFP4 and NVFP4, emulated exactly.

Design note
-----------
Every quantizer is split the same way so that the plain-torch reference and the
Triton kernel share one definition of the numerics:

1. *Layout* (host, torch, shared): move the quantized ``axis`` last, pad it with
   zeros to a multiple of the block (zeros never change a block's amax, and the
   padding is cropped again), and view the tensor as ``(n_groups, G)`` rows, one
   scaling group per row (``block2d`` tiles are rearranged into rows first).
2. *Quantize a group* (reference: ``formats.reference_quantize_groups``; Triton:
   ``quant_triton._quant_fwd_kernel``): amax -> scale -> scaled values -> element rounding ->
   codes and the dequantized values.  Both use only exact operations (power-of-two
   products, IEEE division, floor, compare), so they agree bit for bit.
3. *Pack* (host): fp8 codes viewed as ``torch.float8_*``; fp4 codes two per byte,
   first element in the low nibble (torchao's ``pack_uint4`` layout).

Element rounding (``formats.round_elements_reference`` and the kernel's twin) works
on |v| in fp32: ``e = max(floor(log2|v|), emin)`` from the exponent bits, ``y = |v| * 2^(m-e)`` (exact), then
round-to-nearest-even on ``y``'s fraction, or stochastic rounding (round up when
the fraction exceeds ``u``, a 24-bit uniform drawn from a caller-visible tensor of
random bits, so reference and kernel consume the same draws).  Values are clamped
to ``±max`` *before* rounding: every format saturates (PTX ``satfinite``
semantics): finite overflow and ±Inf become ±max, NaN stays NaN.

Scales
------
* FP8 ``tensor`` / ``row`` / ``block`` (1 x block_size along ``axis``, default 128,
  for activations) / ``block2d`` (block_size x block_size tiles over ``axis`` and
  the flattened other dims, default 128 x 128, for weights): torchao's float8
  convention ``scale = fp32(fmax / fp64(max(amax, 1e-12)))``, ``data =
  sat(x * scale)``, ``x ≈ data / scale``.  ``granularity="none"`` is the unscaled
  saturating cast.
* MX (OCP MX v1.0): one E8M0 exponent per 32 elements.  ``"floor"``: ``2^(floor(
  log2 amax) - emax_elem)`` (the OCP rule; torchao ``ScaleCalculationMode.FLOOR``);
  ``"rceil"``: ``2^ceil(log2(amax / max_elem))`` (NVIDIA's cuBLAS/TE rule, what the
  Blackwell ``cvt.rp.satfinite.ue8m0`` instruction computes). ``x ≈ data * 2^(e-127)``.
* NVFP4: e2m1 elements, one e4m3 scale per 16 elements and one fp32 per-tensor
  scale ``amax / (448 * 6)``; ``x ≈ data * (s_e4m3 * s_tensor)`` (torchao's
  ``nvfp4_quantize`` with a per-tensor scale).

Non-finite inputs (explicit policy)
-----------------------------------
* Scaled formats: a NaN or ±Inf anywhere in a scaling group makes that group's
  scale NaN (E8M0 0xFF for MX, the OCP NaN scale; NaN fp32 scale otherwise) and the
  whole group dequantizes to NaN.  (torchao agrees for NaN; for Inf its MX path
  saturates the Inf and flushes the rest of the block, which we consider a silent
  corruption.)  ``nonfinite="raise"`` refuses such inputs with a ValueError naming
  ``x``.
* The unscaled cast (``granularity="none"``) saturates ±Inf to ±max, keeps NaN.
* Codes of NaN elements: e4m3 0x7F, e5m2 0x7F (with the sign), e2m1 has no NaN and
  writes 0x7 (±6): the group scale carries the NaN.
* NVFP4 of an all-zero tensor uses a per-tensor scale of 1 (torchao divides by
  zero there).

Import order
------------
On a CPU-only machine import ``lab_kernels`` before anything that imports Triton
(torchao does): ``lab_kernels`` sets ``TRITON_INTERPRET=1`` and Triton must see it
first, or the interpreted kernels fail with "Cannot call @triton.jit'd outside of
the scope of a kernel".

Padding
-------
``fake_quantize`` pads a blocked axis that the block size does not divide with
zeros and crops the result (``pad=True``, the default); ``pad=False`` refuses
with a ValueError naming ``block_size``.  The packed ``quantize`` returns padded
data and records the original shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .formats import (
    ELEM_FORMATS,
    FORMATS,
    FP8_EPS,
    GRANULARITIES,
    NONFINITE,
    NVFP4_TENSOR_DIV,
    ROUNDINGS,
    SCALE_RULES,
    SCALING_AMAX,
    SCALING_GIVEN,
    SCALING_MX_FLOOR,
    SCALING_MX_RCEIL,
    SCALING_NONE,
    SCALING_NVFP4,
    ElemFormat,
    Format,
    check_format,
    decode_codes,
    e8m0_to_f32,
    param_error,
    reference_quantize_groups,
    representable_values,
)
from .quant_torchao import TORCHAO_FORMATS, torchao_check, torchao_fake_quantize
from .quant_triton import quant_forward
from .registry import register

triton_quantize_groups = quant_forward  # the launcher's descriptive name
_BACKENDS = {"reference": reference_quantize_groups, "triton": quant_forward}

# ------------------------------------------------------------------ layout


@dataclass
class _Layout:
    shape: tuple  # original shape
    axis: int
    moved_shape: tuple  # axis moved last, padded
    group: int
    pad_k: int
    block2d: tuple | None = None  # (M, K, Mp, Kp, B)


def _rand_bits(shape, generator, device) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=generator, dtype=torch.int32).to(device)


def _to_groups(x: torch.Tensor, axis: int, group: int | None, pad: bool, block2d: bool = False):
    """x -> (groups (n, G) fp32, layout).  group=None: the whole (moved) axis is one group."""
    xf = x.float()
    xm = xf.movedim(axis, -1)
    K = xm.shape[-1]
    if group is None:
        g = xm.reshape(-1, K) if xm.dim() else xm.reshape(1, 1)
        return g.contiguous(), _Layout(tuple(x.shape), axis, tuple(xm.shape), K, 0)
    pad_k = (-K) % group
    if pad_k and not pad:
        raise param_error(
            "block_size",
            group,
            f"a divisor of the quantized axis (size {K}), or pad=True (pads with zeros, then crops)",
        )
    if block2d:
        xm2 = xm.reshape(-1, K)
        M = xm2.shape[0]
        pad_m = (-M) % group
        xp = torch.nn.functional.pad(xm2, (0, pad_k, 0, pad_m))
        Mp, Kp = xp.shape
        g = xp.reshape(Mp // group, group, Kp // group, group).permute(0, 2, 1, 3).reshape(-1, group * group)
        return g.contiguous(), _Layout(
            tuple(x.shape), axis, tuple(xm.shape), group * group, pad_k, (M, K, Mp, Kp, group)
        )
    xp = torch.nn.functional.pad(xm, (0, pad_k)) if pad_k else xm
    return xp.reshape(-1, group).contiguous(), _Layout(tuple(x.shape), axis, tuple(xp.shape), group, pad_k)


def _from_groups(g: torch.Tensor, lay: _Layout, crop: bool = True) -> torch.Tensor:
    if lay.block2d is not None:
        M, K, Mp, Kp, B = lay.block2d
        xp = g.reshape(Mp // B, Kp // B, B, B).permute(0, 2, 1, 3).reshape(Mp, Kp)
        if not crop:
            return xp
        xm = xp[:M, :K].reshape(lay.moved_shape)
        return xm.movedim(-1, lay.axis)
    xp = g.reshape(lay.moved_shape)
    if not crop:
        return xp
    if lay.pad_k:
        xp = xp[..., : xp.shape[-1] - lay.pad_k]
    return xp.movedim(-1, lay.axis) if xp.dim() else xp.reshape(lay.shape)


# ------------------------------------------------------------------ public API


@dataclass
class QuantizedTensor:
    """Packed result of :func:`quantize`.

    ``data``: fp8 formats: a ``torch.float8_*`` tensor; fp4 formats: uint8, two codes
    per byte (first in the low nibble), in the *moved* layout (``axis`` last, padded
    to the block; block2d: a 2-D (M, K) padded matrix).
    ``scale``: fp8: fp32 multiplier (x ≈ data / scale), shape per granularity;
    MX: ``torch.float8_e8m0fnu`` (biased exponent), (..., K/32); NVFP4:
    ``torch.float8_e4m3fn`` block scales (..., K/16) and ``tensor_scale`` fp32.
    """

    fmt: str
    granularity: str
    data: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor | None
    shape: tuple
    axis: int
    block_size: int | None
    dtype: torch.dtype
    _layout: _Layout = field(repr=False, default=None)
    _codes: torch.Tensor = field(repr=False, default=None)
    _deq: torch.Tensor = field(repr=False, default=None)  # the quantizer's own dequantized output

    def codes(self) -> torch.Tensor:
        """Unpacked element codes (uint8, one per element, moved+padded layout)."""
        return _from_groups(self._codes, self._layout, crop=False)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        F = FORMATS[self.fmt]
        vals = decode_codes(self._codes, F.elem)
        lay = self._layout
        if self.granularity == "none":
            g = vals
        elif F.family == "fp8":
            s = self.scale.float()
            g = _groups_like(vals, lay) / s.reshape(-1, 1)
        elif F.family == "mx":
            g = _groups_like(vals, lay) * e8m0_to_f32(self.scale.view(torch.uint8)).reshape(-1, 1)
        else:
            mult = self.scale.float() * self.tensor_scale.float()
            g = _groups_like(vals, lay) * mult.reshape(-1, 1)
        return _from_groups(g.reshape(-1, lay.group), lay).to(dtype or self.dtype)


def _groups_like(vals: torch.Tensor, lay: _Layout) -> torch.Tensor:
    return vals.reshape(-1, lay.group)  # _codes are kept in the group layout


def hadamard_matrix(n: int, seed: int | None = 0, dtype=torch.float32) -> torch.Tensor:
    """Orthonormal (random) Hadamard: ``H_n @ diag(±1) / sqrt(n)``; n a power of two.
    ``seed=None`` gives the plain Sylvester matrix."""
    if n < 1 or n & (n - 1):
        raise param_error("hadamard", n, "a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if seed is not None:
        gen = torch.Generator().manual_seed(int(seed))
        signs = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
        h = signs[:, None] * h
    return (h / math.sqrt(n)).to(dtype)


def hadamard_transform(
    x: torch.Tensor, n: int, *, axis: int = -1, seed: int | None = 0, inverse: bool = False
) -> torch.Tensor:
    """Rotate ``x`` along ``axis`` in blocks of ``n`` by the random Hadamard matrix (orthonormal,
    so the inverse is the transpose and (xH)(wH)^T = x w^T along a shared K axis)."""
    K = x.shape[axis]
    if K % n:
        raise param_error("hadamard", n, f"a divisor of the quantized axis (size {K})")
    H = hadamard_matrix(n, seed, torch.float32).to(x.device)
    if inverse:
        H = H.T
    xm = x.float().movedim(axis, -1)
    y = (xm.reshape(*xm.shape[:-1], K // n, n) @ H).reshape(xm.shape)
    return y.movedim(-1, axis).to(x.dtype)


def _plan(fmt: str, granularity: str | None, block_size, scale_rule: str, rounding: str):
    F = check_format(fmt)
    if scale_rule not in SCALE_RULES:
        raise param_error("scale_rule", scale_rule, "one of " + ", ".join(map(repr, SCALE_RULES)))
    if rounding not in ROUNDINGS:
        raise param_error("rounding", rounding, "one of " + ", ".join(map(repr, ROUNDINGS)))
    if F.family == "fp8":
        gran = granularity or "tensor"
        if gran not in GRANULARITIES:
            raise param_error("granularity", gran, "one of " + ", ".join(map(repr, GRANULARITIES)))
        if gran in ("block", "block2d"):
            bs = F.block_size if block_size is None else block_size
        elif block_size is not None:
            raise param_error(
                "block_size",
                block_size,
                f"None with granularity={gran!r} (one scale per {gran}); a block size needs 'block' or 'block2d'",
            )
        else:
            bs = None
    else:
        if granularity not in (None, "block"):
            raise param_error("granularity", granularity, f"'block' (or None) for {fmt}: its scaling is per block")
        gran = "block"
        bs = F.block_size if block_size is None else block_size
        if F.family == "mx" and bs != 32:
            raise param_error("block_size", bs, f"32 for {fmt} (the OCP MX block)")
        if F.family == "nvfp4" and bs != 16:
            raise param_error("block_size", bs, "16 for nvfp4")
    if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int) or bs < 1):
        raise param_error("block_size", bs, "a positive integer")
    return F, gran, bs


def quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    axis: int = -1,
    block_size: int | None = None,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    granularity: str | None = None,
    pad: bool = False,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    backend: str = "reference",
    nonfinite: str = "propagate",
    tensor_scale: torch.Tensor | None = None,
    _deq_only: bool = False,
) -> QuantizedTensor:
    """Quantize ``x`` to ``fmt``; returns packed data + scales (:class:`QuantizedTensor`).

    See the module note for formats, scales, the non-finite policy and padding.
    ``backend``: "reference" (plain torch) or "triton" (bit-identical).
    Stochastic rounding draws its bits from ``generator`` (or ``seed``; default 0).
    ``tensor_scale`` overrides the per-tensor scale (fp8 tensor / NVFP4 amax-derived).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise param_error(
            "x", type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype, "a floating-point torch.Tensor"
        )
    if backend not in _BACKENDS:
        raise param_error("backend", backend, "one of " + ", ".join(map(repr, _BACKENDS)))
    if nonfinite not in NONFINITE:
        raise param_error("nonfinite", nonfinite, "one of " + ", ".join(map(repr, NONFINITE)))
    if not isinstance(axis, int) or not -max(x.dim(), 1) <= axis < max(x.dim(), 1):
        raise param_error("axis", axis, f"an integer in [-{max(x.dim(), 1)}, {max(x.dim(), 1)})")
    F, gran, bs = _plan(fmt, granularity, block_size, scale_rule, rounding)
    if nonfinite == "raise" and not bool(torch.isfinite(x).all()):
        raise param_error(
            "x", f"tensor with {int((~torch.isfinite(x)).sum())} NaN/Inf elements", "finite values (nonfinite='raise')"
        )
    axis = axis % max(x.dim(), 1)
    if x.dim() == 0:
        x = x.reshape(1)
    fn = _BACKENDS[backend]
    stochastic = rounding == "stochastic"
    ts = None
    if F.family == "fp8":
        if gran == "none":
            g, lay = _to_groups(x, axis, None, pad)
            scaling = SCALING_NONE
        elif gran == "tensor":
            g, lay = _to_groups(x, axis, None, pad)
            scaling = SCALING_GIVEN
            if tensor_scale is None:
                amax = g.abs().amax() if g.numel() else torch.zeros(())
                ts = (F.elem_format.max / torch.clamp(amax.double(), min=FP8_EPS)).float()
                if not bool(torch.isfinite(amax)):
                    ts = torch.tensor(float("nan"))
            else:
                ts = tensor_scale.float().reshape(())
        elif gran == "row":
            g, lay = _to_groups(x, axis, None, pad)
            scaling = SCALING_AMAX
        else:
            g, lay = _to_groups(x, axis, bs, pad, block2d=(gran == "block2d"))
            scaling = SCALING_AMAX
    elif F.family == "mx":
        g, lay = _to_groups(x, axis, bs, pad)
        scaling = SCALING_MX_FLOOR if scale_rule == "floor" else SCALING_MX_RCEIL
    else:
        g, lay = _to_groups(x, axis, bs, pad)
        scaling = SCALING_NVFP4
        if tensor_scale is None:
            amax = g.abs().amax() if g.numel() else torch.zeros(())
            ts = amax.float() / NVFP4_TENSOR_DIV
            if float(ts) == 0.0:
                ts = torch.ones(())
            # a non-finite amax poisons only its own blocks (NaN scale), not the tensor scale
            if not bool(torch.isfinite(ts)):
                fin = g[torch.isfinite(g)]
                ts = (fin.abs().amax().float() / NVFP4_TENSOR_DIV) if fin.numel() else torch.ones(())
                ts = ts if float(ts) > 0 else torch.ones(())
        else:
            ts = tensor_scale.float().reshape(())
    rb = None
    if stochastic:
        gen = generator if generator is not None else torch.Generator().manual_seed(0 if seed is None else seed)
        rb = _rand_bits(tuple(g.shape), gen, g.device)
    if ts is not None:
        ts = ts.to(g.device)
    deq, codes, gscale = fn(g, F.elem, scaling, stochastic=stochastic, rbits=rb, tensor_scale=ts, codes=not _deq_only)
    if _deq_only:
        return _from_groups(deq, lay)
    # packing
    if F.elem != "e2m1":
        data = _from_groups(codes, lay, crop=False).contiguous().view(F.elem_format.torch_dtype)
    else:
        c = _from_groups(codes, lay, crop=False).contiguous()
        data = (
            c
            if c.shape[-1] % 2
            else (c.reshape(-1)[0::2] | (c.reshape(-1)[1::2] << 4)).reshape(*c.shape[:-1], c.shape[-1] // 2)
        )
    lead = lay.moved_shape[:-1]
    if F.family == "fp8":
        if gran in ("tensor", "none"):
            scale = (ts if ts is not None else torch.ones(())).float().reshape(())
        elif gran == "row":
            scale = gscale.reshape(*lead, 1)
        elif gran == "block":
            scale = gscale.reshape(*lead, -1)
        else:
            M, K, Mp, Kp, B = lay.block2d
            scale = gscale.reshape(Mp // B, Kp // B)
    elif F.family == "mx":
        scale = gscale.to(torch.uint8).reshape(*lead, -1).view(torch.float8_e8m0fnu)
    else:
        scale = gscale.reshape(*lead, -1).to(torch.float8_e4m3fn)
    return QuantizedTensor(
        fmt,
        gran,
        data,
        scale,
        ts if F.family == "nvfp4" else None,
        tuple(x.shape),
        axis,
        bs,
        x.dtype,
        lay,
        codes,
        _from_groups(deq, lay),
    )


def fake_quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    axis: int = -1,
    block_size: int | None = None,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    granularity: str | None = None,
    pad: bool = True,
    hadamard: int | None = None,
    hadamard_seed: int = 0,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    backend: str = "reference",
    nonfinite: str = "propagate",
) -> torch.Tensor:
    """Quantize then dequantize: the value ``x`` takes in ``fmt``, in ``x``'s dtype.

    ``fmt``: fp8_e4m3, fp8_e5m2 (``granularity`` "tensor" (default) | "row" | "block"
    (1 x block_size along ``axis``, default 128) | "block2d" (block_size², default 128²)
    | "none" (unscaled saturating cast)), mxfp8_e4m3, mxfp8_e5m2, mxfp4 (block 32,
    ``scale_rule`` "floor" | "rceil"), nvfp4 (block 16).  ``rounding``: "nearest"
    (ties to even) | "stochastic".  ``hadamard=n`` rotates ``axis`` in blocks of n by a
    random Hadamard matrix before quantizing and rotates back after (error in the
    original basis).  The dequantized value is computed in fp32 and cast to x.dtype.
    """
    kw = dict(
        axis=axis,
        block_size=block_size,
        scale_rule=scale_rule,
        rounding=rounding,
        granularity=granularity,
        pad=pad,
        seed=seed,
        generator=generator,
        backend=backend,
        nonfinite=nonfinite,
        _deq_only=True,
    )
    if hadamard is not None:
        xr = hadamard_transform(x.float(), hadamard, axis=axis, seed=hadamard_seed)
        q = quantize(xr, fmt, **kw)
        return hadamard_transform(q, hadamard, axis=axis, seed=hadamard_seed, inverse=True).to(x.dtype)
    deq = quantize(x, fmt, **kw)
    return deq.reshape(x.shape).to(x.dtype)


class QuantFunction(torch.autograd.Function):
    """Fake quantization forward, straight-through (identity) gradient backward."""

    @staticmethod
    def forward(ctx, x, kw):
        return fake_quantize(x, **kw)

    @staticmethod
    def backward(ctx, g):
        return g, None


def fake_quantize_ste(x: torch.Tensor, fmt: str, **kw) -> torch.Tensor:
    """fake_quantize with a straight-through gradient (identity), for training recipes."""
    return QuantFunction.apply(x, dict(fmt=fmt, **kw))


def cast_elements(x: torch.Tensor, elem: str, *, rounding: str = "nearest", seed: int = 0, backend: str = "reference"):
    """Unscaled element cast of fp32 values: (rounded values fp32, codes uint8). Saturating."""
    if elem not in ELEM_FORMATS:
        raise param_error("elem", elem, "one of " + ", ".join(map(repr, ELEM_FORMATS)))
    if rounding not in ROUNDINGS:
        raise param_error("rounding", rounding, "one of " + ", ".join(map(repr, ROUNDINGS)))
    g = x.float().reshape(1, -1).contiguous()
    rb = _rand_bits(tuple(g.shape), torch.Generator().manual_seed(seed), g.device) if rounding == "stochastic" else None
    q, c, _ = _BACKENDS[backend](g, elem, SCALING_NONE, stochastic=rounding == "stochastic", rbits=rb)
    return q.reshape(x.shape), c.reshape(x.shape)


# ------------------------------------------------------------------ registry


def _fq_variant(backend):
    def fn(x, fmt, **kw):
        return fake_quantize(x, fmt, backend=backend, **kw)

    return fn


register(
    "quant",
    "reference",
    _fq_variant("reference"),
    kind="reference",
    description="plain-torch fake quantization (exact; the spec)",
)
register(
    "quant",
    "triton",
    _fq_variant("triton"),
    kind="triton",
    description="Triton group quantizer, bit-identical to the reference",
)


register(
    "quant",
    "torchao",
    torchao_fake_quantize,
    kind="library",
    check=torchao_check,
    description="torchao 0.18 float8 / MX / NVFP4 references",
)


# The format names live in lab_kernels.formats; quant re-exports them as its own API.
__all__ = [
    "ELEM_FORMATS",
    "FORMATS",
    "GRANULARITIES",
    "NONFINITE",
    "ROUNDINGS",
    "SCALE_RULES",
    "TORCHAO_FORMATS",
    "ElemFormat",
    "Format",
    "QuantFunction",
    "QuantizedTensor",
    "cast_elements",
    "check_format",
    "decode_codes",
    "fake_quantize",
    "fake_quantize_ste",
    "hadamard_matrix",
    "hadamard_transform",
    "quant_forward",
    "quantize",
    "reference_quantize_groups",
    "representable_values",
    "torchao_fake_quantize",
    "triton_quantize_groups",
]
