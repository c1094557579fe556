"""RMSNorm with a weight: ``y = x · rsqrt(mean(x², -1) + eps) · w``.

x (..., D), weight (D,); statistics in float32; y in promote(x.dtype, weight.dtype).

Backward (x̂ = x·rstd, g = dy·w):
    dx = rstd · (g − x̂ · mean(g · x̂, -1))
    dw = Σ_rows dy · x̂            (per-program float32 partials, then a Triton column sum)

Memory traffic the op must move (M rows of D, s = element size of x, sw of w):
    forward   2·M·D·s + D·sw                       (read x, write y; w once)
    backward  3·M·D·s + 2·D·sw + 4·M                (read x, dy; write dx; w, dw; rstd saved by fwd)
The forward also writes rstd (4·M bytes) for the backward; it is counted in the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _common as C
from .registry import register, register_fused_op

OP = "rms_norm"


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, M, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_N)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)  # (BLOCK_M,)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    # Grid-stride over row tiles; each program keeps its dw partial in registers and
    # writes one row of the (P, N) partials buffer: no atomics, deterministic.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n_tiles = tl.cdiv(M, BLOCK_M)
    for t in range(pid, n_tiles, n_prog):
        rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xhat, axis=1) / N
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        acc += dy * xhat
    tl.store(dw_part_ptr + pid * N + cols, tl.sum(acc, axis=0), mask=cmask)


def _blocks(N: int) -> tuple[int, int, int]:
    BLOCK_N = C.next_pow2(N)
    BLOCK_M = max(1, min(16, 2048 // BLOCK_N))  # several short rows per program (QK-norm rows are 128)
    return BLOCK_M, BLOCK_N, C.num_warps_for(BLOCK_M * BLOCK_N)


def _launch_fwd(x2, weight, eps, y, rstd):
    """Write y (M, N) and rstd (M,) for a contiguous x2 (M, N) into the given buffers."""
    M, N = x2.shape
    if M == 0:
        return y, rstd
    BLOCK_M, BLOCK_N, nw = _blocks(N)
    C.launch(_rms_norm_fwd_kernel)[(triton.cdiv(M, BLOCK_M),)](
        x2, weight, y, rstd, M, N, eps, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=nw
    )
    return y, rstd


def _launch_bwd(dy2, x2, weight, rstd, dx, dw):
    M, N = x2.shape
    if M == 0:
        return dx, dw.zero_()
    BLOCK_M, BLOCK_N, nw = _blocks(N)
    P = C.persistent_programs(triton.cdiv(M, BLOCK_M), x2.device)
    part = torch.empty((1, P, N), device=x2.device, dtype=torch.float32)
    C.launch(_rms_norm_bwd_kernel)[(P,)](
        dy2, x2, weight, rstd, dx, part, M, N, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=nw
    )
    C.col_sum(part, dw.view(1, N))
    return dx, dw


def _fwd_fake(x2, weight, eps):
    return (x2.new_empty(x2.shape, dtype=C.promote(x2, weight)), x2.new_empty((x2.shape[0],), dtype=torch.float32))


@C.kernel_op("rms_norm_fwd", _fwd_fake)
def _fwd_op(x2: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, rstd = _fwd_fake(x2, weight, eps)
    return _launch_fwd(x2, weight, eps, y, rstd)


def _bwd_fake(dy2, x2, weight, rstd):
    return x2.new_empty(x2.shape), weight.new_empty(weight.shape)


@C.kernel_op("rms_norm_bwd", _bwd_fake)
def _bwd_op(
    dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = _bwd_fake(dy2, x2, weight, rstd)
    return _launch_bwd(dy2, x2, weight, rstd, dx, dw)


def _validate(x, weight):
    C.check_tensor(OP, "x", x)
    C.check_tensor(OP, "weight", weight)
    C.check_device(OP, ("x", x), ("weight", weight))
    if x.dim() < 1:
        raise ValueError(f"{OP}: parameter 'x' must have at least one dimension")
    C.check_shape(OP, "weight", weight, (x.shape[-1],), "one weight per element of x's last dim")
    C.check_row_width(OP, "x", x.shape[-1])


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out=None, rstd=None):
    """Triton forward on x (..., D) -> (y, rstd (M,)).  ``out``/``rstd`` may be given
    (tests poison them); otherwise the registered custom op allocates them."""
    _validate(x, weight)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    w = weight.contiguous()
    if out is None and rstd is None:
        y, r = torch.ops.lab_kernels.rms_norm_fwd(x2, w, float(eps))
    else:
        y, r = _launch_fwd(x2, w, float(eps), out.view(x2.shape), rstd)
    return y.view(x.shape), r


def rms_norm_backward(dy, x, weight, rstd, *, dx=None, dw=None):
    """Triton backward -> (dx like x, dweight like weight)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    dy2 = dy.reshape(x2.shape).contiguous()  # autograd may hand an expanded (stride-0) grad
    w = weight.contiguous()
    if dx is None and dw is None:
        gx, gw = torch.ops.lab_kernels.rms_norm_bwd(dy2, x2, w, rstd)
    else:
        gx, gw = _launch_bwd(dy2, x2, w, rstd, dx.view(x2.shape), dw)
    return gx.view(x.shape), gw


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd)
        return (dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm through the Triton kernels (forward and backward)."""
    _validate(x, weight)
    return RMSNormFunction.apply(x, weight, eps)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Plain torch in the inputs' dtype (float64 for checks)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """What FLUX's ``RMSNorm`` does: float32 statistics, cast back, then scale."""
    x_dtype = x.dtype
    xf = x.float()
    rrms = torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + eps)
    return (xf * rrms).to(x_dtype) * weight


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


register_fused_op(
    OP,
    reference=reference_rms_norm,
    eager=eager_rms_norm,
    triton=rms_norm,
    eager_description="FLUX RMSNorm in eager torch",
    triton_description="Triton fwd + bwd (dw by per-program partials + column sum), custom op",
    check=C.row_width_check(OP),
)

if hasattr(F, "rms_norm"):
    register(OP, "torch", torch_rms_norm, kind="library", description="torch.nn.functional.rms_norm")
