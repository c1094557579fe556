"""The Triton group quantizer: the twin of ``formats.reference_quantize_groups``.

It quantizes rows of ``(n_groups, G)`` fp32 values, one scaling group per row (the layout
``lab_kernels.quant`` builds): amax -> scale -> scaled values -> element rounding -> codes
and the dequantized values.  Only exact operations are used (power-of-two products, IEEE
division, floor, compare), so it agrees with the reference bit for bit; ``lab_kernels.quant``
calls either through its ``backend`` argument.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common as C
from .formats import ELEM_FORMATS


@triton.jit
def _round_elem_tl(
    v,
    rbits,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    MAXV: tl.constexpr,
    EBITS: tl.constexpr,
    NAN_CODE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    a = tl.abs(v)
    a = tl.where(a > MAXV, MAXV, a)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN)
    inv_ulp = ((127 + MBITS - e) << 23).to(tl.float32, bitcast=True)
    ulp = ((127 - MBITS + e) << 23).to(tl.float32, bitcast=True)
    y = a * inv_ulp
    fl = tl.floor(y)
    frac = y - fl
    if STOCHASTIC:
        u = (rbits & 0xFFFFFF).to(tl.float32) * (2.0**-24)
        up = frac > u
    else:
        odd = (fl - 2.0 * tl.floor(fl * 0.5)) == 1.0
        up = (frac > 0.5) | ((frac == 0.5) & odd)
    q = (fl + up.to(tl.float32)) * ulp
    nan = q != q
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    q0 = tl.where(nan, 0.0, q)
    qb = q0.to(tl.int32, bitcast=True)
    qe = ((qb >> 23) & 0xFF) - 127
    normal = q0 >= 2.0**EMIN
    code_n = ((qe + 1 - EMIN) << MBITS) | ((qb >> (23 - MBITS)) & ((1 << MBITS) - 1))
    code_s = (tl.minimum(q0, 2.0**EMIN) * 2.0 ** (MBITS - EMIN)).to(tl.int32)  # only used below 2^emin
    code = tl.where(normal, code_n, code_s)
    code = tl.where(nan, NAN_CODE, code)
    code = code | (sign << (EBITS + MBITS))
    qs = (qb | (sign << 31)).to(tl.float32, bitcast=True)
    qs = tl.where(nan, float("nan"), qs)
    return qs, code


@triton.jit
def _quant_fwd_kernel(
    x_ptr,
    r_ptr,
    deq_ptr,
    code_ptr,
    scale_ptr,
    ts_ptr,
    n_rows,
    G,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    MAXV: tl.constexpr,
    EBITS: tl.constexpr,
    EMAX: tl.constexpr,
    NAN_CODE: tl.constexpr,
    SCALING: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program quantizes ROWS scaling groups (rows of G elements; G may exceed BLOCK,
    then ROWS == 1 and the row is walked in chunks).

    Traffic: reads G fp32 per group (+G int32 random bits when stochastic; twice when
    G > BLOCK: amax pass, then quantize pass), writes G fp32 + G uint8 + one scale.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    base = rows * G
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    anynan = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
    if SCALING != 0:
        if SCALING != 2:
            for start in range(0, G, BLOCK):
                m = rmask[:, None] & (start + offs < G)[None, :]
                x = tl.load(x_ptr + base[:, None] + start + offs[None, :], mask=m, other=0.0)
                ax = tl.abs(x)
                anynan = anynan | ((ax != ax) | (ax == float("inf"))).to(tl.int32)
                amax = tl.maximum(amax, tl.where(ax != ax, 0.0, ax))
    gmax = tl.max(amax, axis=1)
    bad = tl.max(anynan, axis=1) > 0
    # ---- group scale, all [ROWS]
    scale = tl.full([ROWS], 1.0, tl.float32)
    rcp = scale
    mult = scale
    biased = tl.zeros([ROWS], dtype=tl.int32)
    if SCALING == 1:
        scale = (MAXV / tl.maximum(gmax.to(tl.float64), 1e-12)).to(tl.float32)
        scale = tl.where(bad, float("nan"), scale)
        rcp = scale
    elif SCALING == 2:
        scale = tl.zeros([ROWS], dtype=tl.float32) + tl.load(ts_ptr)
        rcp = scale
    elif SCALING == 3:
        ex = ((gmax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        biased = tl.minimum(tl.maximum(ex - EMAX, -127), 128) + 127
        biased = tl.where(bad, 255, biased)
        sc = tl.maximum((biased << 23).to(tl.float32, bitcast=True), 2.0**-126)
        rcp = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), sc)
    elif SCALING == 4:
        descale = tl.math.div_rn(gmax, tl.full([ROWS], MAXV, tl.float32))
        db = descale.to(tl.int32, bitcast=True)
        dex = (db >> 23) & 0xFF
        cl = tl.where(
            dex == 0, tl.where((db & 0x7FFFFF) > 0x400000, -126, -127), dex - 127 + ((db & 0x7FFFFF) != 0).to(tl.int32)
        )
        biased = tl.minimum(tl.maximum(cl, -127), 127) + 127
        biased = tl.where(bad, 255, biased)
        rcp = tl.where(
            biased == 0,
            1.0,
            tl.where(biased >= 254, 2.0**-127, (tl.maximum(254 - biased, 0) << 23).to(tl.float32, bitcast=True)),
        )
    elif SCALING == 5:
        pts = tl.zeros([ROWS], dtype=tl.float32) + tl.load(ts_ptr)
        bs = tl.math.div_rn(gmax, tl.full([ROWS], 6.0, tl.float32))
        sc = tl.minimum(tl.maximum(tl.math.div_rn(bs, pts), 2.0**-6), 448.0)
        sc, _unused = _round_elem_tl(sc, 0, 3, -6, 448.0, 4, 0x7F, False)
        rcp = tl.math.div_rn(tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), pts), sc)
        mult = sc * pts
        scale = tl.where(bad, float("nan"), sc)
    if SCALING == 3 or SCALING == 4:
        mult = tl.where(biased == 0, 2.0**-127, (biased << 23).to(tl.float32, bitcast=True))
        mult = tl.where(biased == 255, float("nan"), mult)
        scale = biased.to(tl.float32)
    # ---- quantize pass
    for start in range(0, G, BLOCK):
        m = rmask[:, None] & (start + offs < G)[None, :]
        ptrs = base[:, None] + start + offs[None, :]
        x = tl.load(x_ptr + ptrs, mask=m, other=0.0)
        r = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
        if STOCHASTIC:
            r = tl.load(r_ptr + ptrs, mask=m, other=0)
        if SCALING == 0:
            v = x
        else:
            v = x * rcp[:, None]
        if SCALING >= 3:
            v = tl.where(bad[:, None], float("nan"), v)
        q, code = _round_elem_tl(v, r, MBITS, EMIN, MAXV, EBITS, NAN_CODE, STOCHASTIC)
        if SCALING == 1 or SCALING == 2:
            d = tl.math.div_rn(q, tl.zeros([ROWS, BLOCK], dtype=tl.float32) + scale[:, None])
        elif SCALING == 0:
            d = q
        else:
            d = q * mult[:, None]
        d = tl.where(d != d, float("nan"), d)
        tl.store(deq_ptr + ptrs, d, mask=m)
        tl.store(code_ptr + ptrs, code.to(tl.uint8), mask=m)
    tl.store(scale_ptr + rows, scale, mask=rmask)


def quant_forward(
    g: torch.Tensor,
    elem: str,
    scaling: int,
    *,
    stochastic: bool = False,
    rbits: torch.Tensor | None = None,
    tensor_scale: torch.Tensor | None = None,
    codes: bool = True,
):
    """Triton twin of :func:`reference_quantize_groups` (same arguments and results)."""
    f = ELEM_FORMATS[elem]
    C.check_device("quant", ("g", g))
    g = g.contiguous().float()
    n, G = g.shape
    deq = torch.empty_like(g)
    code = torch.empty(g.shape, dtype=torch.uint8, device=g.device)
    scale = torch.empty(n, dtype=torch.float32, device=g.device)
    ts = (
        tensor_scale.float().reshape(1)
        if tensor_scale is not None
        else torch.ones(1, dtype=torch.float32, device=g.device)
    )
    r = rbits.contiguous() if stochastic else torch.zeros(1, dtype=torch.int32, device=g.device)
    block = min(max(triton.next_power_of_2(max(G, 1)), 16), 1024)
    rows = max(1, min(64, 4096 // block)) if G <= block else 1
    if n and G:
        _quant_fwd_kernel[(triton.cdiv(n, rows),)](
            g,
            r,
            deq,
            code,
            scale,
            ts,
            n,
            G,
            MBITS=f.mbits,
            EMIN=f.emin,
            MAXV=f.max,
            EBITS=f.ebits,
            EMAX=f.emax,
            NAN_CODE=f.nan_code,
            SCALING=scaling,
            STOCHASTIC=bool(stochastic),
            ROWS=rows,
            BLOCK=block,
        )
    return deq, code, scale
