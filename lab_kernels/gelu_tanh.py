"""GELU, tanh approximation (FLUX MLP): ``y = ½·x·(1 + tanh(u))``, ``u = √(2/π)·(x + 0.044715·x³)``.

Elementwise on any shape; math in float32, y in x's dtype.  tanh(u) is computed as
``2·σ(2u) − 1`` (finite for every input, no libdevice call needed in the interpreter).

Backward:
    dx = dy · (½·(1 + t) + ½·x·(1 − t²)·√(2/π)·(1 + 3·0.044715·x²)),   t = tanh(u)

Memory traffic the op must move (n elements, s = element size):
    forward   2·n·s        (read x, write y)
    backward  3·n·s        (read x, dy; write dx)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _common as C
from .registry import register_fused_op

OP = "gelu_tanh"
BLOCK = 1024


@triton.jit
def _tanh(u):
    return 2.0 * tl.sigmoid(2.0 * u) - 1.0


@triton.jit
def _gelu_tanh_fwd_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
    tl.store(y_ptr + offs, (0.5 * x * (1.0 + t)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_bwd_kernel(dy_ptr, x_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
    du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    dx = dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _launch_fwd(x, y):
    n = x.numel()
    if n:
        C.launch(_gelu_tanh_fwd_kernel)[(triton.cdiv(n, BLOCK),)](x, y, n, BLOCK=BLOCK, num_warps=4)
    return y


def _launch_bwd(dy, x, dx):
    n = x.numel()
    if n:
        C.launch(_gelu_tanh_bwd_kernel)[(triton.cdiv(n, BLOCK),)](dy, x, dx, n, BLOCK=BLOCK, num_warps=4)
    return dx


def _fwd_fake(x):
    return torch.empty_like(x)


@C.kernel_op("gelu_tanh_fwd", _fwd_fake)
def _fwd_op(x: torch.Tensor) -> torch.Tensor:
    return _launch_fwd(x, torch.empty_like(x))


def _bwd_fake(dy, x):
    return torch.empty_like(x)


@C.kernel_op("gelu_tanh_bwd", _bwd_fake)
def _bwd_op(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _launch_bwd(dy, x, torch.empty_like(x))


def _validate(x):
    C.check_tensor(OP, "x", x)
    C.check_device(OP, ("x", x))


def gelu_tanh_forward(x, *, out=None):
    _validate(x)
    xc = x.contiguous()
    return torch.ops.lab_kernels.gelu_tanh_fwd(xc) if out is None else _launch_fwd(xc, out)


def gelu_tanh_backward(dy, x, *, dx=None):
    xc = x.contiguous()
    dyc = dy.reshape(x.shape).contiguous()
    return torch.ops.lab_kernels.gelu_tanh_bwd(dyc, xc) if dx is None else _launch_bwd(dyc, xc, dx)


class GeluTanhFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return gelu_tanh_forward(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return gelu_tanh_backward(dy, x)


def gelu_tanh(x):
    """tanh-GELU through the Triton kernels."""
    _validate(x)
    return GeluTanhFunction.apply(x)


def reference_gelu_tanh(x):
    """Plain torch formula in the input's dtype (float64 for checks)."""
    return 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x.pow(3))))


def eager_gelu_tanh(x):
    """What FLUX runs: ``nn.GELU(approximate="tanh")``."""
    return F.gelu(x, approximate="tanh")


register_fused_op(
    OP,
    reference=reference_gelu_tanh,
    eager=eager_gelu_tanh,
    triton=gelu_tanh,
    reference_description="plain torch formula, float64-valid",
    eager_description='F.gelu(approximate="tanh")',
    triton_description="Triton fwd + bwd, custom op",
)
