"""Gated residual: ``out = x + gate[:, None, :] · y``.

x, y (B, L, D); gate (B, D) (or (B, 1, D)) broadcast over L; math in float32,
out in promote(x, gate, y).

Backward:
    dx = dout          (passed through: no kernel, no traffic)
    dy = dout · gate
    dgate = Σ_L dout · y   (per-(b, L-tile) float32 partials reduced by a Triton column sum)

Memory traffic the op must move (M = B·L rows, s = element size):
    forward   3·M·D·s + B·D·s                      (read x, y; write out; gate once)
    backward  3·M·D·s + 2·B·D·s                    (read dout, y; write dy; read gate, write dgate)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common as C
from .registry import register_fused_op

OP = "gated_residual"


@triton.jit
def _gated_residual_fwd_kernel(x_ptr, gate_ptr, y_ptr, out_ptr, L, N, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    ls = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = (ls < L)[:, None] & cmask[None, :]
    offs = (b * L + ls).to(tl.int64)[:, None] * N + cols[None, :]
    gate = tl.load(gate_ptr + b * N + cols, mask=cmask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x + gate[None, :] * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_residual_bwd_kernel(
    dout_ptr, gate_ptr, y_ptr, dy_ptr, dgate_part_ptr, L, N, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr
):
    b = tl.program_id(0)
    lt = tl.program_id(1)
    n_lt = tl.num_programs(1)
    ls = lt * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = (ls < L)[:, None] & cmask[None, :]
    offs = (b * L + ls).to(tl.int64)[:, None] * N + cols[None, :]
    gate = tl.load(gate_ptr + b * N + cols, mask=cmask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dy_ptr + offs, (dout * gate[None, :]).to(dy_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_part_ptr + (b * n_lt + lt) * N + cols, tl.sum(dout * y, axis=0), mask=cmask)


def _blocks(N: int) -> tuple[int, int, int]:
    BLOCK_N = min(C.next_pow2(N), 256)
    BLOCK_L = 32
    return BLOCK_L, BLOCK_N, 4


def _launch_fwd(x3, gate, y3, out):
    B, L, N = x3.shape
    if B * L * N == 0:
        return out
    BLOCK_L, BLOCK_N, nw = _blocks(N)
    grid = (B, triton.cdiv(L, BLOCK_L), triton.cdiv(N, BLOCK_N))
    C.launch(_gated_residual_fwd_kernel)[grid](x3, gate, y3, out, L, N, BLOCK_L=BLOCK_L, BLOCK_N=BLOCK_N, num_warps=nw)
    return out


def _launch_bwd(dout3, gate, y3, dy, dgate):
    B, L, N = y3.shape
    if B * L * N == 0:
        return dy, dgate.zero_()
    BLOCK_L, BLOCK_N, nw = _blocks(N)
    n_lt = triton.cdiv(L, BLOCK_L)
    part = torch.empty((B, n_lt, N), device=y3.device, dtype=torch.float32)
    C.launch(_gated_residual_bwd_kernel)[(B, n_lt, triton.cdiv(N, BLOCK_N))](
        dout3, gate, y3, dy, part, L, N, BLOCK_L=BLOCK_L, BLOCK_N=BLOCK_N, num_warps=nw
    )
    C.col_sum(part, dgate)
    return dy, dgate


def _fwd_fake(x3, gate, y3):
    return x3.new_empty(x3.shape, dtype=C.promote(x3, gate, y3))


@C.kernel_op("gated_residual_fwd", _fwd_fake)
def _fwd_op(x3: torch.Tensor, gate: torch.Tensor, y3: torch.Tensor) -> torch.Tensor:
    return _launch_fwd(x3, gate, y3, _fwd_fake(x3, gate, y3))


def _bwd_fake(dout3, gate, y3):
    return y3.new_empty(y3.shape), gate.new_empty(gate.shape)


@C.kernel_op("gated_residual_bwd", _bwd_fake)
def _bwd_op(dout3: torch.Tensor, gate: torch.Tensor, y3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dy, dgate = _bwd_fake(dout3, gate, y3)
    return _launch_bwd(dout3, gate, y3, dy, dgate)


def _gate2d(gate, B, D):
    if gate.dim() == 3 and gate.shape[1] == 1:
        gate = gate.reshape(gate.shape[0], gate.shape[2])
    C.check_shape(OP, "gate", gate, (B, D), "one gate vector per batch element, broadcast over the tokens")
    return gate


def _validate(x, gate, y):
    for n, t in (("x", x), ("gate", gate), ("y", y)):
        C.check_tensor(OP, n, t)
    C.check_device(OP, ("x", x), ("gate", gate), ("y", y))
    if x.dim() != 3:
        raise ValueError(f"{OP}: parameter 'x' must be (B, L, D), got shape {tuple(x.shape)}")
    C.check_shape(OP, "y", y, tuple(x.shape), "same shape as x")
    _gate2d(gate, x.shape[0], x.shape[2])


def gated_residual_forward(x, gate, y, *, out=None):
    _validate(x, gate, y)
    g = _gate2d(gate, x.shape[0], x.shape[2]).contiguous()
    if out is None:
        return torch.ops.lab_kernels.gated_residual_fwd(x.contiguous(), g, y.contiguous())
    return _launch_fwd(x.contiguous(), g, y.contiguous(), out)


def gated_residual_backward(dout, x, gate, y, *, dy=None, dgate=None):
    """-> (dx, dy, dgate); dx is dout itself (cast to x's dtype)."""
    g = _gate2d(gate, x.shape[0], x.shape[2]).contiguous()
    dout3 = dout.reshape(x.shape).contiguous()
    if dy is None:
        gy, gg = torch.ops.lab_kernels.gated_residual_bwd(dout3, g, y.contiguous())
    else:
        gy, gg = _launch_bwd(dout3, g, y.contiguous(), dy, dgate)
    return dout3.to(x.dtype), gy, gg.view(gate.shape)


class GatedResidualFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, y):
        out = gated_residual_forward(x, gate, y)
        ctx.save_for_backward(x, gate, y)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, gate, y = ctx.saved_tensors
        dx, dy, dgate = gated_residual_backward(dout, x, gate, y)
        n = ctx.needs_input_grad
        return dx if n[0] else None, dgate if n[1] else None, dy if n[2] else None


def gated_residual(x, gate, y):
    """x + gate[:, None, :] * y through the Triton kernels."""
    _validate(x, gate, y)
    return GatedResidualFunction.apply(x, gate, y)


def reference_gated_residual(x, gate, y):
    """Plain torch in the inputs' dtype (float64 for checks)."""
    g = gate if gate.dim() == 3 else gate[:, None, :]
    return x + g * y


def eager_gated_residual(x, gate, y):
    """What FLUX writes (``x + gate * y`` with gate unsqueezed): the same expression as the reference."""
    return reference_gated_residual(x, gate, y)


register_fused_op(
    OP,
    reference=reference_gated_residual,
    eager=eager_gated_residual,
    triton=gated_residual,
    eager_description="x + gate[:, None] * y in eager torch",
    triton_description="Triton fwd + bwd (dgate by per-tile partials + column sum), custom op",
)
