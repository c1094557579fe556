"""Attention: float64-valid reference and a hand-written Triton flash-attention (fwd + bwd).

Design note
-----------
One kernel family serves two layouts by strides alone:

* dense ``(B, H, L, Dh)``: sequence ``b`` starts at row 0 of its own batch slice;
* packed varlen ``(T, H, Dh)`` with ``cu_seqlens`` (int32, ``(n_seq + 1,)``, 0 first,
  increasing, last == T): sequence ``b`` owns rows ``cu_seqlens[b]:cu_seqlens[b+1]``
  and attends only inside itself (the layout of flash-attn's ``*_varlen_func``).

The kernels take (batch stride, head stride, row stride) and add the sequence's
start row when ``IS_VARLEN``; the batch stride is 0 there.  Attention is
self-attention (q, k, v have the same rows); ``causal`` is top-left aligned,
query ``i`` sees keys ``j <= i`` of its own sequence.

Forward (FlashAttention-2, one program per (query block, batch*head)):
    S = Q K^T * scale,  P = softmax(S) row-wise (online, base 2),  O = P V
    LSE2 = log2(sum_j exp2(S_ij * log2 e))  kept in float32 for the backward.
Backward (two kernels, no atomics):
    D_i = rowsum(dO_i * O_i)                               (torch, one pass)
    dV = P^T dO ;  dP = dO V^T ;  dS = P * (dP - D) ;  dK = scale * dS^T Q   (per key block)
    dQ = scale * dS K                                                          (per query block)
Memory traffic it should need: forward reads Q once and K, V once per query
block (L / BLOCK_M times), writes O and LSE; backward reads Q, K, V, O, dO and
writes dQ, dK, dV — no L x L matrix is ever stored.  FLOPs (full mask):
4 * B * H * L^2 * Dh forward, 2.5x that backward (5 matmuls instead of 2).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# HEAD_DIMS and check_max_seqlen are re-exported: callers read them from this op module
from ._attention_inputs import (
    HEAD_DIMS as HEAD_DIMS,
)
from ._attention_inputs import (
    OP,
    TRITON_DTYPES,
    check_cu_seqlens,
    check_qkv,
    dot_args,
    launch_config,
    launch_dims,
    lse_strides,
    same_strides,
    strides,
    triton_check,
    varlen_launch,
)
from ._attention_inputs import (
    check_max_seqlen as check_max_seqlen,
)
from ._attention_inputs import (
    check_varlen as check_varlen,
)
from .registry import register

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------- reference
def reference_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch attention, valid in float64 (computes in the input dtype).

    ``q, k, v``: (B, H, L, Dh) — or (T, H, Dh) with ``cu_seqlens``.  ``mask``: a boolean
    tensor broadcastable to (B, H, Lq, Lk), True = may attend (dense layout only).
    A row with no allowed key returns zeros (not NaN)."""
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, q.shape[0])
        outs = []
        bounds = cu_seqlens.tolist()
        for s, e in zip(bounds[:-1], bounds[1:]):
            seg = [t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # (1, H, l, Dh)
            o = reference_attention(*seg, causal=causal, scale=scale)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs, 0)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    allowed = None
    if causal:
        lq, lk = q.shape[-2], k.shape[-2]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        allowed = mask if allowed is None else (allowed & mask)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if allowed is not None:
        p = torch.nan_to_num(p, nan=0.0)  # fully-masked rows: zeros, not NaN
    return torch.matmul(p, v)


# --------------------------------------------------------------------------- kernels
@triton.jit
def _sequence(CU_SEQLENS, b, seqlen, IS_VARLEN: tl.constexpr):
    """(length, first row) of sequence b: from cu_seqlens when packed, else (seqlen, 0)."""
    if IS_VARLEN:
        start = tl.load(CU_SEQLENS + b)
        length = tl.load(CU_SEQLENS + b + 1) - start
        row0 = start.to(tl.int64)
    else:
        length = seqlen
        row0 = (b * 0).to(tl.int64)
    return length, row0


@triton.jit
def _mma(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST only under the interpreter: Triton 3.9's interpreted tl.dot returns garbage
    # for bfloat16 operands.  Operands are already rounded to their dtype, and a
    # bf16 x bf16 product is exact in fp32, so this emulates the tensor-core dot.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _attention_fwd_kernel(
    Q,
    K,
    V,
    OUT,
    LSE,
    CU_SEQLENS,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_ob,
    stride_oh,
    stride_om,
    stride_lb,
    stride_lh,
    n_heads,
    seqlen,
    qk_scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    L, row0 = _sequence(CU_SEQLENS, b, seqlen, IS_VARLEN)
    if start_m * BLOCK_M >= L:
        return
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = Q + b.to(tl.int64) * stride_qb + h * stride_qh + row0 * stride_qm
    k_base = K + b.to(tl.int64) * stride_qb + h * stride_qh + row0 * stride_qm
    v_base = V + b.to(tl.int64) * stride_qb + h * stride_qh + row0 * stride_qm
    m_ok = offs_m < L
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=m_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = L
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, L)
    for start_n in range(0, hi, BLOCK_N):
        n_idx = start_n + offs_n
        n_ok = n_idx < L
        k = tl.load(k_base + n_idx[:, None] * stride_qm + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        s = _mma(q, tl.trans(k), DOT_PRECISION, UPCAST) * qk_scale_log2  # (BM, BN), log2 units
        ok = n_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_m[:, None] >= n_idx[None, :])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(v_base + n_idx[:, None] * stride_qm + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        acc += _mma(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m_i = m_new
    acc = acc / l_i[:, None]
    o_base = OUT + b.to(tl.int64) * stride_ob + h * stride_oh + row0 * stride_om
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], acc.to(OUT.dtype.element_ty), mask=m_ok[:, None])
    lse_base = LSE + b.to(tl.int64) * stride_lb + h * stride_lh + row0
    tl.store(lse_base + offs_m, m_i + tl.log2(l_i), mask=m_ok)


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    LSE,
    DELTA,
    CU_SEQLENS,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_gb,
    stride_gh,
    stride_gm,
    stride_lb,
    stride_lh,
    n_heads,
    seqlen,
    qk_scale_log2,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program per (key block, batch*head): dV = P^T dO, dK = scale * dS^T Q."""
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    L, row0 = _sequence(CU_SEQLENS, b, seqlen, IS_VARLEN)
    if start_n * BLOCK_N >= L:
        return
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_off = b.to(tl.int64) * stride_qb + h * stride_qh + row0 * stride_qm
    n_ok = offs_n < L
    k = tl.load(K + in_off + offs_n[:, None] * stride_qm + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    v = tl.load(V + in_off + offs_n[:, None] * stride_qm + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    lse_base = LSE + b.to(tl.int64) * stride_lb + h * stride_lh + row0
    delta_base = DELTA + b.to(tl.int64) * stride_lb + h * stride_lh + row0
    lo = 0
    if CAUSAL:
        lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M  # queries before the diagonal see none of these keys
    for start_m in range(lo, L, BLOCK_M):
        offs_m = start_m + offs_m0
        m_ok = offs_m < L
        q = tl.load(Q + in_off + offs_m[:, None] * stride_qm + offs_d[None, :], mask=m_ok[:, None], other=0.0)
        do = tl.load(DO + in_off + offs_m[:, None] * stride_qm + offs_d[None, :], mask=m_ok[:, None], other=0.0)
        lse = tl.load(lse_base + offs_m, mask=m_ok, other=0.0)
        delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        st = _mma(k, tl.trans(q), DOT_PRECISION, UPCAST) * qk_scale_log2  # (BN, BM) = S^T
        ok = n_ok[:, None] & m_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_m[None, :] >= offs_n[:, None])
        pt = tl.where(ok, tl.exp2(st - lse[None, :]), 0.0)  # P^T
        dv += _mma(pt.to(do.dtype), do, DOT_PRECISION, UPCAST)
        dpt = _mma(v, tl.trans(do), DOT_PRECISION, UPCAST)  # dP^T
        dst = pt * (dpt - delta[None, :])
        dk += _mma(dst.to(q.dtype), q, DOT_PRECISION, UPCAST)
    dk = dk * sm_scale
    g_off = b.to(tl.int64) * stride_gb + h * stride_gh + row0 * stride_gm
    tl.store(DK + g_off + offs_n[:, None] * stride_gm + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=n_ok[:, None])
    tl.store(DV + g_off + offs_n[:, None] * stride_gm + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=n_ok[:, None])


@triton.jit
def _attention_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    LSE,
    DELTA,
    CU_SEQLENS,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_gb,
    stride_gh,
    stride_gm,
    stride_lb,
    stride_lh,
    n_heads,
    seqlen,
    qk_scale_log2,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program per (query block, batch*head): dQ = scale * dS K."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    L, row0 = _sequence(CU_SEQLENS, b, seqlen, IS_VARLEN)
    if start_m * BLOCK_M >= L:
        return
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_off = b.to(tl.int64) * stride_qb + h * stride_qh + row0 * stride_qm
    m_ok = offs_m < L
    q = tl.load(Q + in_off + offs_m[:, None] * stride_qm + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    do = tl.load(DO + in_off + offs_m[:, None] * stride_qm + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    lse = tl.load(LSE + b.to(tl.int64) * stride_lb + h * stride_lh + row0 + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + b.to(tl.int64) * stride_lb + h * stride_lh + row0 + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    hi = L
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, L)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < L
        k = tl.load(K + in_off + offs_n[:, None] * stride_qm + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(V + in_off + offs_n[:, None] * stride_qm + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        s = _mma(q, tl.trans(k), DOT_PRECISION, UPCAST) * qk_scale_log2
        ok = m_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        dp = _mma(do, tl.trans(v), DOT_PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _mma(ds.to(k.dtype), k, DOT_PRECISION, UPCAST)
    dq = dq * sm_scale
    g_off = b.to(tl.int64) * stride_gb + h * stride_gh + row0 * stride_gm
    tl.store(DQ + g_off + offs_m[:, None] * stride_gm + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=m_ok[:, None])


# --------------------------------------------------------------------------- host side
def attention_forward(
    q,
    k,
    v,
    *,
    causal: bool = False,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
):
    """Launch the forward kernel; returns (out, lse2) with lse2 in base-2 units (float32).
    ``out`` may be a preallocated buffer shaped and strided like q (tests poison it).
    ``validate=False``: see :func:`attention`."""
    varlen = cu_seqlens is not None
    check_qkv(q, k, v, cu_seqlens)
    max_seqlen = varlen_launch(q, cu_seqlens, max_seqlen, validate)
    if varlen:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    q, k, v = same_strides(q, k, v)
    n_seq, H, L = launch_dims(q, cu_seqlens, max_seqlen)
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride() != q.stride() or out.dtype != q.dtype:
        raise ValueError("parameter 'out' must have the shape, strides and dtype of q")
    lse = torch.empty((H, q.shape[0]) if varlen else (n_seq, H, L), device=q.device, dtype=torch.float32)
    cfg = launch_config("fwd", D, q.dtype)
    grid = (triton.cdiv(L, cfg["BLOCK_M"]), n_seq * H)
    _attention_fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens if varlen else q,
        *strides(q, varlen),
        *strides(out, varlen),
        *lse_strides(lse, varlen),
        H,
        L,
        scale * LOG2E,
        HEAD_DIM=D,
        CAUSAL=causal,
        IS_VARLEN=varlen,
        **dot_args(q.dtype),
        **cfg,
    )
    return out, lse


def attention_backward(
    do,
    q,
    k,
    v,
    out,
    lse,
    *,
    causal: bool = False,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    validate: bool = True,
):
    """Launch the backward kernels; returns (dq, dk, dv).  ``grads`` may be preallocated
    buffers shaped and strided like q, k, v (tests poison them).  ``validate=False``: see
    :func:`attention`."""
    varlen = cu_seqlens is not None
    check_qkv(q, k, v, cu_seqlens)
    max_seqlen = varlen_launch(q, cu_seqlens, max_seqlen, validate)
    if varlen:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    q, k, v = same_strides(q, k, v)
    if do.stride() != q.stride():
        do = do.contiguous() if q.is_contiguous() else torch.empty_like(q).copy_(do)
    n_seq, H, L = launch_dims(q, cu_seqlens, max_seqlen)
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    # D_i = rowsum(dO * O), in the LSE layout: (B, H, L) or (H, T)
    delta = (do.float() * out.float()).sum(-1)
    delta = delta.transpose(0, 1).contiguous() if varlen else delta.contiguous()
    if grads is None:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    else:
        dq, dk, dv = grads
        if any(g.shape != q.shape or g.stride() != q.stride() or g.dtype != q.dtype for g in grads):
            raise ValueError("parameter 'grads' must be three buffers with the shape, strides and dtype of q")
    common = dict(HEAD_DIM=D, CAUSAL=causal, IS_VARLEN=varlen, **dot_args(q.dtype))
    cu = cu_seqlens if varlen else q
    cfg = launch_config("bwd_dkdv", D, q.dtype)
    _attention_bwd_dkdv_kernel[(triton.cdiv(L, cfg["BLOCK_N"]), n_seq * H)](
        q,
        k,
        v,
        do,
        dk,
        dv,
        lse,
        delta,
        cu,
        *strides(q, varlen),
        *strides(dk, varlen),
        *lse_strides(lse, varlen),
        H,
        L,
        scale * LOG2E,
        scale,
        **common,
        **cfg,
    )
    cfg = launch_config("bwd_dq", D, q.dtype)
    _attention_bwd_dq_kernel[(triton.cdiv(L, cfg["BLOCK_M"]), n_seq * H)](
        q,
        k,
        v,
        do,
        dq,
        lse,
        delta,
        cu,
        *strides(q, varlen),
        *strides(dq, varlen),
        *lse_strides(lse, varlen),
        H,
        L,
        scale * LOG2E,
        scale,
        **common,
        **cfg,
    )
    return dq, dk, dv


class AttentionFunction(torch.autograd.Function):
    """Flash attention forward / backward through the Triton kernels (saves O and the LSE)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, cu_seqlens, max_seqlen, validate=True):
        out, lse = attention_forward(
            q, k, v, causal=causal, scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, validate=validate
        )
        ctx.save_for_backward(q, k, v, out, lse, *([cu_seqlens] if cu_seqlens is not None else []))
        ctx.causal, ctx.scale, ctx.max_seqlen, ctx.validate = causal, scale, max_seqlen, validate
        ctx.varlen = cu_seqlens is not None
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        cu = rest[0] if ctx.varlen else None
        dq, dk, dv = attention_backward(
            do,
            q,
            k,
            v,
            out,
            lse,
            causal=ctx.causal,
            scale=ctx.scale,
            cu_seqlens=cu,
            max_seqlen=ctx.max_seqlen,
            validate=ctx.validate,
        )
        return dq, dk, dv, None, None, None, None, None


def attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Triton flash attention with autograd.  q, k, v: (B, H, L, Dh), or (T, H, Dh) packed
    with ``cu_seqlens``; Dh in (64, 128); float16 / bfloat16 / float32.

    ``validate=False`` (packed layout): ``cu_seqlens`` and ``max_seqlen`` were checked once
    already (e.g. by a call with ``validate=True``, or :func:`check_varlen`); the call then
    reads nothing back from the device (checking ``cu_seqlens`` copies it to the host, a
    synchronisation a timed loop must not contain).  ``max_seqlen`` must then be given."""
    check_qkv(q, k, v, cu_seqlens)
    max_seqlen = varlen_launch(q, cu_seqlens, max_seqlen, validate)
    return AttentionFunction.apply(q, k, v, bool(causal), scale, cu_seqlens, max_seqlen, bool(validate))


def eager_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """torch SDPA (default backend choice); packed input runs one call per sequence."""
    if cu_seqlens is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    check_cu_seqlens(cu_seqlens, q.shape[0])
    b = cu_seqlens.tolist()
    outs = [
        torch.nn.functional.scaled_dot_product_attention(
            *(t[s:e].transpose(0, 1) for t in (q, k, v)), is_causal=causal, scale=scale
        ).transpose(0, 1)
        for s, e in zip(b[:-1], b[1:])
    ]
    return torch.cat(outs, 0)


def _kernel_mask_check(*, mask=None, **_):
    if mask is not None and mask not in ("full", "causal"):
        return f"attention variants here take causal=True/False only, not mask {mask!r} (lab_utils.attention: any)"
    return None


register(
    OP,
    "reference",
    reference_attention,
    kind="reference",
    description="plain torch, dense scores, valid in float64",
    check=_kernel_mask_check,
)
register(
    OP,
    "eager",
    eager_attention,
    kind="eager",
    description="torch.nn.functional.scaled_dot_product_attention, default backend",
    check=_kernel_mask_check,
)
register(
    OP,
    "triton",
    attention,
    kind="triton",
    dtypes=TRITON_DTYPES,
    check=triton_check,
    description="hand-written FlashAttention-2 forward + backward (full/causal, Dh 64/128, varlen)",
)
