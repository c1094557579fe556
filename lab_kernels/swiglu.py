"""SwiGLU gating: ``out = silu(gate) · up = gate · σ(gate) · up``.

gate, up: same shape (any); math in float32, out in promote(gate, up).

Backward (σ = σ(gate)):
    dgate = dout · up · σ · (1 + gate · (1 − σ))
    dup   = dout · gate · σ

Memory traffic the op must move (n elements each, s = element size):
    forward   3·n·s        (read gate, up; write out)
    backward  5·n·s        (read gate, up, dout; write dgate, dup)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _common as C
from .registry import register_fused_op

OP = "swiglu"
BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dout_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(dg_ptr + offs, (do * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (do * g * s).to(du_ptr.dtype.element_ty), mask=mask)


def _launch_fwd(g, u, out):
    n = g.numel()
    if n:
        C.launch(_swiglu_fwd_kernel)[(triton.cdiv(n, BLOCK),)](g, u, out, n, BLOCK=BLOCK, num_warps=4)
    return out


def _launch_bwd(dout, g, u, dg, du):
    n = g.numel()
    if n:
        C.launch(_swiglu_bwd_kernel)[(triton.cdiv(n, BLOCK),)](dout, g, u, dg, du, n, BLOCK=BLOCK, num_warps=4)
    return dg, du


def _fwd_fake(g, u):
    return g.new_empty(g.shape, dtype=C.promote(g, u))


@C.kernel_op("swiglu_fwd", _fwd_fake)
def _fwd_op(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return _launch_fwd(g, u, _fwd_fake(g, u))


def _bwd_fake(dout, g, u):
    return torch.empty_like(g), torch.empty_like(u)


@C.kernel_op("swiglu_bwd", _bwd_fake)
def _bwd_op(dout: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dg, du = _bwd_fake(dout, g, u)
    return _launch_bwd(dout, g, u, dg, du)


def _validate(gate, up):
    C.check_tensor(OP, "gate", gate)
    C.check_tensor(OP, "up", up)
    C.check_device(OP, ("gate", gate), ("up", up))
    C.check_shape(OP, "up", up, tuple(gate.shape), "same shape as gate")


def swiglu_forward(gate, up, *, out=None):
    _validate(gate, up)
    g, u = gate.contiguous(), up.contiguous()
    return torch.ops.lab_kernels.swiglu_fwd(g, u) if out is None else _launch_fwd(g, u, out)


def swiglu_backward(dout, gate, up, *, dgate=None, dup=None):
    g, u = gate.contiguous(), up.contiguous()
    do = dout.reshape(g.shape).contiguous()
    if dgate is None:
        return torch.ops.lab_kernels.swiglu_bwd(do, g, u)
    return _launch_bwd(do, g, u, dgate, dup)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dg, du = swiglu_backward(dout, gate, up)
        return dg, du


def swiglu(gate, up):
    """silu(gate) * up through the Triton kernels."""
    _validate(gate, up)
    return SwiGLUFunction.apply(gate, up)


def reference_swiglu(gate, up):
    """Plain torch formula in the inputs' dtype (float64 for checks)."""
    return gate * torch.sigmoid(gate) * up


def eager_swiglu(gate, up):
    return F.silu(gate) * up


register_fused_op(
    OP,
    reference=reference_swiglu,
    eager=eager_swiglu,
    triton=swiglu,
    reference_description="plain torch formula, float64-valid",
    eager_description="F.silu(gate) * up",
    triton_description="Triton fwd + bwd, custom op",
)
