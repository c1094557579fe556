"""Rotary position embedding on q and k, FLUX pair layout.

q, k (B, H, L, Dh), any strides with a unit stride on Dh; cos, sin (L, Dh/2) or
(B, L, Dh/2), read in float32.  Pairs (2i, 2i+1) rotate by angle i:
    out[2i]   = x[2i]·cos_i − x[2i+1]·sin_i
    out[2i+1] = x[2i]·sin_i + x[2i+1]·cos_i
Outputs are contiguous (B, H, L, Dh) in the input's dtype.

Backward is the transposed rotation (sin → −sin).  cos and sin are tables: the Triton
variant computes no gradient for them and refuses inputs that require one.

Memory traffic the op must move (n = B·H·L·Dh elements of q and of k, s = element size,
t = elements of one table, 4-byte float32):
    forward   4·n·s + 2·4·t        (read q, k; write q_out, k_out; cos and sin once)
    backward  4·n·s + 2·4·t        (read dq_out, dk_out; write dq, dk; cos and sin once)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common as C
from .registry import register_fused_op

OP = "rope"


@triton.jit
def _rope_rows(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    R,
    H,
    L,
    HALF,
    sxb,
    sxh,
    sxl,
    cos_sb,
    sign,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    pos = rows % L
    bh = rows // L
    h = bh % H
    b = bh // H
    xoff = b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + pos.to(tl.int64) * sxl  # (BLOCK_R,)
    i = tl.arange(0, BLOCK_H)
    mask = rmask[:, None] & (i < HALF)[None, :]
    xp = x_ptr + xoff[:, None] + 2 * i[None, :]
    x0 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(xp + 1, mask=mask, other=0.0).to(tl.float32)
    coff = b.to(tl.int64) * cos_sb + pos * HALF
    c = tl.load(cos_ptr + coff[:, None] + i[None, :], mask=mask, other=0.0).to(tl.float32)
    s = sign * tl.load(sin_ptr + coff[:, None] + i[None, :], mask=mask, other=0.0).to(tl.float32)
    op = out_ptr + rows.to(tl.int64)[:, None] * (2 * HALF) + 2 * i[None, :]
    tl.store(op, (x0 * c - x1 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(op + 1, (x0 * s + x1 * c).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_fwd_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, R, H, L, HALF, sxb, sxh, sxl, cos_sb, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr
):
    _rope_rows(x_ptr, cos_ptr, sin_ptr, out_ptr, R, H, L, HALF, sxb, sxh, sxl, cos_sb, 1.0, BLOCK_R, BLOCK_H)


@triton.jit
def _rope_bwd_kernel(
    dy_ptr, cos_ptr, sin_ptr, dx_ptr, R, H, L, HALF, sxb, sxh, sxl, cos_sb, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr
):
    # The rotation is orthogonal: its transpose is the rotation by −angle.
    _rope_rows(dy_ptr, cos_ptr, sin_ptr, dx_ptr, R, H, L, HALF, sxb, sxh, sxl, cos_sb, -1.0, BLOCK_R, BLOCK_H)


def _unit_last(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(kernel, x, cos, sin, out):
    B, H, L, Dh = x.shape
    R, HALF = B * H * L, Dh // 2
    if R == 0 or HALF == 0:
        return out
    BLOCK_H = C.next_pow2(HALF)
    BLOCK_R = max(1, min(64, 2048 // BLOCK_H))
    cos_sb = cos.stride(0) if cos.dim() == 3 else 0
    C.launch(kernel)[(triton.cdiv(R, BLOCK_R),)](
        x,
        cos,
        sin,
        out,
        R,
        H,
        L,
        HALF,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        cos_sb,
        BLOCK_R=BLOCK_R,
        BLOCK_H=BLOCK_H,
        num_warps=C.num_warps_for(BLOCK_R * BLOCK_H),
    )
    return out


def _fake(x, cos, sin):
    return x.new_empty(x.shape)


@C.kernel_op("rope_fwd", _fake)
def _fwd_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _launch(_rope_fwd_kernel, x, cos, sin, x.new_empty(x.shape))


@C.kernel_op("rope_bwd", _fake)
def _bwd_op(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _launch(_rope_bwd_kernel, dy, cos, sin, dy.new_empty(dy.shape))


def check_tables(op, q, cos, sin):
    """Shared by rope and qk_norm_rope: shapes of q/cos/sin, named in the message."""
    if q.dim() != 4:
        raise ValueError(f"{op}: parameter 'q' must be (B, H, L, Dh), got shape {tuple(q.shape)}")
    B, _, L, Dh = q.shape
    if Dh % 2:
        raise ValueError(f"{op}: parameter 'q' has head dim {Dh}; rope rotates pairs, so it must be even")
    for name, t in (("cos", cos), ("sin", sin)):
        C.check_tensor(op, name, t, dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16))
        if tuple(t.shape) not in ((L, Dh // 2), (B, L, Dh // 2)):
            raise ValueError(
                f"{op}: parameter {name!r} has shape {tuple(t.shape)}, expected (L, Dh/2) = "
                f"{(L, Dh // 2)} or (B, L, Dh/2) = {(B, L, Dh // 2)}"
            )
    if cos.shape != sin.shape:
        raise ValueError(f"{op}: parameters 'cos' {tuple(cos.shape)} and 'sin' {tuple(sin.shape)} differ")
    C.check_row_width(op, "q", Dh)


def _validate(q, k, cos, sin):
    C.check_tensor(OP, "q", q)
    C.check_tensor(OP, "k", k)
    C.check_device(OP, ("q", q), ("k", k), ("cos", cos), ("sin", sin))
    check_tables(OP, q, cos, sin)
    if k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(
            f"{OP}: parameter 'k' has shape {tuple(k.shape)}; expected (B, H_k, L, Dh) matching "
            f"q {tuple(q.shape)} in B, L and Dh"
        )
    C.needs_no_grad(OP, cos=cos, sin=sin)


def _rotate(kernel, op, x, cos, sin, out):
    """Through the registered custom op, or straight into a caller's ``out`` buffer."""
    x = _unit_last(x)
    cos, sin = cos.contiguous(), sin.contiguous()
    if out is None:
        return op(x, cos, sin)
    return _launch(kernel, x, cos, sin, out)


def rope_forward(x, cos, sin, *, out=None):
    """Rotate one tensor x (B, H, L, Dh) -> contiguous (B, H, L, Dh)."""
    return _rotate(_rope_fwd_kernel, torch.ops.lab_kernels.rope_fwd, x, cos, sin, out)


def rope_backward(dy, cos, sin, *, out=None):
    """The gradient of the rotation: dy rotated by the inverse angles."""
    return _rotate(_rope_bwd_kernel, torch.ops.lab_kernels.rope_bwd, dy, cos, sin, out)


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope_forward(q, cos, sin), rope_forward(k, cos, sin)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        dq = rope_backward(dq_out, cos, sin) if dq_out is not None and ctx.needs_input_grad[0] else None
        dk = rope_backward(dk_out, cos, sin) if dk_out is not None and ctx.needs_input_grad[1] else None
        return dq, dk, None, None


def rope(q, k, cos, sin):
    """(q_out, k_out) through the Triton kernels."""
    _validate(q, k, cos, sin)
    return RoPEFunction.apply(q, k, cos, sin)


def _bcast_table(t, x):
    # (L, Dh/2) -> (1, 1, L, Dh/2); (B, L, Dh/2) -> (B, 1, L, Dh/2)
    return t[None, None] if t.dim() == 2 else t[:, None]


def reference_rope_one(x, cos, sin):
    """Plain torch rotation of one tensor, computed in x's dtype (float64 for checks)."""
    c = _bcast_table(cos, x).to(x.dtype)
    s = _bcast_table(sin, x).to(x.dtype)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


def reference_rope(q, k, cos, sin):
    return reference_rope_one(q, cos, sin), reference_rope_one(k, cos, sin)


def eager_rope_one(x, cos, sin):
    """What FLUX's ``apply_rope`` does: a float32 2×2 rotation per pair, cast back."""
    c = _bcast_table(cos, x).float()
    s = _bcast_table(sin, x).float()
    xf = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    # freqs as FLUX stores them: [[cos, -sin], [sin, cos]] (..., Dh/2, 2, 2)
    freqs = torch.stack((torch.stack((c, -s), -1), torch.stack((s, c), -1)), -2)
    out = freqs[..., 0] * xf[..., 0] + freqs[..., 1] * xf[..., 1]
    return out.reshape(*x.shape).type_as(x)


def eager_rope(q, k, cos, sin):
    return eager_rope_one(q, cos, sin), eager_rope_one(k, cos, sin)


register_fused_op(
    OP,
    reference=reference_rope,
    eager=eager_rope,
    triton=rope,
    reference_description="plain torch pair rotation, float64-valid",
    eager_description="FLUX apply_rope (2x2 rotation matrices)",
    triton_description="Triton fwd + bwd (transposed rotation), strided q/k, custom op",
    check=C.even_head_dim_check(OP),
)
