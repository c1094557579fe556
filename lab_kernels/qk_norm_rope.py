"""QK RMSNorm fused with RoPE: ``out = rope(rmsnorm(x) · w)`` for x in (q, k).

q, k (B, H, L, Dh), unit stride on Dh (other strides free, e.g. a view of the qkv
projection); q_weight, k_weight (Dh,); cos, sin (L, Dh/2) or (B, L, Dh/2), FLUX pair
layout (see ``rope``).  rstd = rsqrt(mean(x², Dh) + eps) in float32; outputs contiguous
in the input's dtype.

Backward per row (n = x̂·w, x̂ = x·rstd; dn = rotation by −angle of dout):
    g  = dn · w
    dx = rstd · (g − x̂ · mean(g · x̂))
    dw = Σ_rows dn · x̂     (per-program float32 partials, then a Triton column sum)

Memory traffic the op must move (n = B·H·L·Dh elements of each of q and k, R = B·H·L rows
each, s = element size, t = elements of one table, weights 2·Dh·sw):
    forward   4·n·s + 2·Dh·sw + 2·4·t                   (read q, k; write outputs; tables once)
    backward  6·n·s + 4·Dh·sw + 2·4·t + 2·4·R           (read q, k, dq_out, dk_out; write dq, dk;
                                                         weights and their grads; rstd saved by fwd)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common as C
from .registry import register_fused_op
from .rope import check_tables, eager_rope_one, reference_rope_one

OP = "qk_norm_rope"


@triton.jit
def _row_offsets(rows, H, L, sxb, sxh, sxl):
    pos = rows % L
    bh = rows // L
    h = bh % H
    b = bh // H
    return b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + pos.to(tl.int64) * sxl, b, pos


@triton.jit
def _qk_norm_rope_fwd_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    rstd_ptr,
    R,
    H,
    L,
    HALF,
    sxb,
    sxh,
    sxl,
    cos_sb,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    xoff, b, pos = _row_offsets(rows, H, L, sxb, sxh, sxl)
    i = tl.arange(0, BLOCK_H)
    imask = i < HALF
    mask = rmask[:, None] & imask[None, :]
    xp = x_ptr + xoff[:, None] + 2 * i[None, :]
    x0 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)  # even elements (BLOCK_R, BLOCK_H)
    x1 = tl.load(xp + 1, mask=mask, other=0.0).to(tl.float32)  # odd elements
    rstd = 1.0 / tl.sqrt((tl.sum(x0 * x0, axis=1) + tl.sum(x1 * x1, axis=1)) / (2 * HALF) + eps)
    w0 = tl.load(w_ptr + 2 * i, mask=imask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + 2 * i + 1, mask=imask, other=0.0).to(tl.float32)
    n0 = x0 * rstd[:, None] * w0[None, :]
    n1 = x1 * rstd[:, None] * w1[None, :]
    coff = b.to(tl.int64) * cos_sb + pos * HALF
    c = tl.load(cos_ptr + coff[:, None] + i[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + coff[:, None] + i[None, :], mask=mask, other=0.0).to(tl.float32)
    op = out_ptr + rows.to(tl.int64)[:, None] * (2 * HALF) + 2 * i[None, :]
    tl.store(op, (n0 * c - n1 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(op + 1, (n0 * s + n1 * c).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def _qk_norm_rope_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    R,
    H,
    L,
    HALF,
    sxb,
    sxh,
    sxl,
    syb,
    syh,
    syl,
    cos_sb,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    i = tl.arange(0, BLOCK_H)
    imask = i < HALF
    w0 = tl.load(w_ptr + 2 * i, mask=imask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + 2 * i + 1, mask=imask, other=0.0).to(tl.float32)
    acc0 = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for t in range(pid, tl.cdiv(R, BLOCK_R), n_prog):
        rows = t * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        mask = rmask[:, None] & imask[None, :]
        xoff, b, pos = _row_offsets(rows, H, L, sxb, sxh, sxl)
        yoff, b, pos = _row_offsets(rows, H, L, syb, syh, syl)
        xp = x_ptr + xoff[:, None] + 2 * i[None, :]
        yp = dy_ptr + yoff[:, None] + 2 * i[None, :]
        x0 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        x1 = tl.load(xp + 1, mask=mask, other=0.0).to(tl.float32)
        d0 = tl.load(yp, mask=mask, other=0.0).to(tl.float32)
        d1 = tl.load(yp + 1, mask=mask, other=0.0).to(tl.float32)
        coff = b.to(tl.int64) * cos_sb + pos * HALF
        c = tl.load(cos_ptr + coff[:, None] + i[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + coff[:, None] + i[None, :], mask=mask, other=0.0).to(tl.float32)
        dn0 = d0 * c + d1 * s  # transposed rotation
        dn1 = d1 * c - d0 * s
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xh0 = x0 * rstd[:, None]
        xh1 = x1 * rstd[:, None]
        g0 = dn0 * w0[None, :]
        g1 = dn1 * w1[None, :]
        cc = (tl.sum(g0 * xh0, axis=1) + tl.sum(g1 * xh1, axis=1)) / (2 * HALF)
        dp = dx_ptr + rows.to(tl.int64)[:, None] * (2 * HALF) + 2 * i[None, :]
        tl.store(dp, (rstd[:, None] * (g0 - xh0 * cc[:, None])).to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dp + 1, (rstd[:, None] * (g1 - xh1 * cc[:, None])).to(dx_ptr.dtype.element_ty), mask=mask)
        acc0 += dn0 * xh0
        acc1 += dn1 * xh1
    pp = dw_part_ptr + pid * (2 * HALF) + 2 * i
    tl.store(pp, tl.sum(acc0, axis=0), mask=imask)
    tl.store(pp + 1, tl.sum(acc1, axis=0), mask=imask)


def _blocks(Dh):
    BLOCK_H = C.next_pow2(Dh // 2)
    BLOCK_R = max(1, min(32, 2048 // BLOCK_H))
    return BLOCK_R, BLOCK_H, C.num_warps_for(BLOCK_R * BLOCK_H)


def _cos_sb(cos):
    return cos.stride(0) if cos.dim() == 3 else 0


def _launch_fwd(x, w, cos, sin, eps, out, rstd):
    B, H, L, Dh = x.shape
    R = B * H * L
    if R == 0:
        return out, rstd
    BLOCK_R, BLOCK_H, nw = _blocks(Dh)
    C.launch(_qk_norm_rope_fwd_kernel)[(triton.cdiv(R, BLOCK_R),)](
        x,
        w,
        cos,
        sin,
        out,
        rstd,
        R,
        H,
        L,
        Dh // 2,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        _cos_sb(cos),
        eps,
        BLOCK_R=BLOCK_R,
        BLOCK_H=BLOCK_H,
        num_warps=nw,
    )
    return out, rstd


def _launch_bwd(dy, x, w, cos, sin, rstd, dx, dw):
    B, H, L, Dh = x.shape
    R = B * H * L
    if R == 0:
        return dx, dw.zero_()
    BLOCK_R, BLOCK_H, nw = _blocks(Dh)
    P = C.persistent_programs(triton.cdiv(R, BLOCK_R), x.device)
    part = torch.empty((1, P, Dh), device=x.device, dtype=torch.float32)
    C.launch(_qk_norm_rope_bwd_kernel)[(P,)](
        dy,
        x,
        w,
        cos,
        sin,
        rstd,
        dx,
        part,
        R,
        H,
        L,
        Dh // 2,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        dy.stride(0),
        dy.stride(1),
        dy.stride(2),
        _cos_sb(cos),
        BLOCK_R=BLOCK_R,
        BLOCK_H=BLOCK_H,
        num_warps=nw,
    )
    C.col_sum(part, dw.view(1, Dh))
    return dx, dw


def _fwd_fake(x, w, cos, sin, eps):
    B, H, L, _ = x.shape
    return x.new_empty(x.shape), x.new_empty((B * H * L,), dtype=torch.float32)


@C.kernel_op("qk_norm_rope_fwd", _fwd_fake)
def _fwd_op(
    x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, rstd = _fwd_fake(x, w, cos, sin, eps)
    return _launch_fwd(x, w, cos, sin, eps, out, rstd)


def _bwd_fake(dy, x, w, cos, sin, rstd):
    return x.new_empty(x.shape), w.new_empty(w.shape)


@C.kernel_op("qk_norm_rope_bwd", _bwd_fake)
def _bwd_op(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = _bwd_fake(dy, x, w, cos, sin, rstd)
    return _launch_bwd(dy, x, w, cos, sin, rstd, dx, dw)


def _unit_last(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _validate(q, k, q_weight, k_weight, cos, sin):
    for n, t in (("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight)):
        C.check_tensor(OP, n, t)
    C.check_device(OP, ("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight), ("cos", cos), ("sin", sin))
    check_tables(OP, q, cos, sin)
    if k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(
            f"{OP}: parameter 'k' has shape {tuple(k.shape)}; expected (B, H_k, L, Dh) matching "
            f"q {tuple(q.shape)} in B, L and Dh"
        )
    Dh = q.shape[-1]
    C.check_shape(OP, "q_weight", q_weight, (Dh,), "one weight per head-dim element")
    C.check_shape(OP, "k_weight", k_weight, (Dh,), "one weight per head-dim element")
    C.needs_no_grad(OP, cos=cos, sin=sin)


def qk_norm_rope_forward(x, weight, cos, sin, eps: float = 1e-6, *, out=None, rstd=None):
    """Norm + rope of one tensor x (B, H, L, Dh) -> (out, rstd (B·H·L,))."""
    x = _unit_last(x)
    w, cos, sin = weight.contiguous(), cos.contiguous(), sin.contiguous()
    if out is None:
        return torch.ops.lab_kernels.qk_norm_rope_fwd(x, w, cos, sin, float(eps))
    return _launch_fwd(x, w, cos, sin, float(eps), out, rstd)


def qk_norm_rope_backward(dy, x, weight, cos, sin, rstd, *, dx=None, dw=None):
    """-> (dx contiguous like x, dweight)."""
    x, dy = _unit_last(x), _unit_last(dy)
    w, cos, sin = weight.contiguous(), cos.contiguous(), sin.contiguous()
    if dx is None:
        return torch.ops.lab_kernels.qk_norm_rope_bwd(dy, x, w, cos, sin, rstd)
    return _launch_bwd(dy, x, w, cos, sin, rstd, dx, dw)


class QKNormRoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, eps):
        qo, rq = qk_norm_rope_forward(q, q_weight, cos, sin, eps)
        ko, rk = qk_norm_rope_forward(k, k_weight, cos, sin, eps)
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin, rq, rk)
        return qo, ko

    @staticmethod
    def backward(ctx, dqo, dko):
        q, k, qw, kw, cos, sin, rq, rk = ctx.saved_tensors
        dq = dqw = dk = dkw = None
        if dqo is not None:
            dq, dqw = qk_norm_rope_backward(dqo, q, qw, cos, sin, rq)
        if dko is not None:
            dk, dkw = qk_norm_rope_backward(dko, k, kw, cos, sin, rk)
        n = ctx.needs_input_grad
        return (
            dq if n[0] else None,
            dk if n[1] else None,
            dqw if n[2] else None,
            dkw if n[3] else None,
            None,
            None,
            None,
        )


def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6):
    """(q_out, k_out) = rope(rmsnorm(q)·q_weight), rope(rmsnorm(k)·k_weight) through Triton."""
    _validate(q, k, q_weight, k_weight, cos, sin)
    return QKNormRoPEFunction.apply(q, k, q_weight, k_weight, cos, sin, eps)


def reference_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6):
    """Plain torch in the inputs' dtype (float64 for checks)."""

    def one(x, w):
        return reference_rope_one(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w, cos, sin)

    return one(q, q_weight), one(k, k_weight)


def eager_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6):
    """FLUX's QKNorm (RMSNorm in float32, cast back, scale) then apply_rope, unfused."""

    def norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + eps)).to(x.dtype) * w

    return eager_rope_one(norm(q, q_weight), cos, sin), eager_rope_one(norm(k, k_weight), cos, sin)


# The unfused path rounds the normalised q/k to the dtype before rotating them: two
# roundings in a row, so checks hold it to twice the dtype's tolerance (tol_scale).
register_fused_op(
    OP,
    reference=reference_qk_norm_rope,
    eager=eager_qk_norm_rope,
    triton=qk_norm_rope,
    eager_description="FLUX QKNorm then apply_rope, unfused",
    triton_description="Triton fused RMSNorm + rope, fwd + bwd (dw by partials + column sum), custom op",
    check=C.even_head_dim_check(OP),
    eager_tol_scale=2.0,
)
