"""LayerNorm without affine, fused with adaLN modulation: ``y = x̂ · (1 + scale) + shift``.

x (B, L, D); shift, scale (B, D) (or (B, 1, D)) broadcast over L; x̂ = (x − mean)·rstd over D,
statistics in float32; y in promote(x, shift, scale).

Backward (g = dy·(1 + scale_b)):
    dx      = rstd · (g − mean(g) − x̂ · mean(g · x̂))
    dshift  = Σ_L dy            dscale = Σ_L dy · x̂      (per-(b, program) float32 partials
                                                           reduced by a Triton column sum)

Memory traffic the op must move (M = B·L rows, s = element size):
    forward   2·M·D·s + 2·B·D·s                    (read x, write y; shift and scale once)
    backward  3·M·D·s + 3·B·D·s + 8·M              (read x, dy; write dx; read scale, write
                                                    dshift, dscale; mean/rstd saved by the forward)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _common as C
from .registry import register_fused_op

OP = "layer_norm_modulate"


@triton.jit
def _layer_norm_modulate_fwd_kernel(
    x_ptr, shift_ptr, scale_ptr, y_ptr, mean_ptr, rstd_ptr, M, L, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_N)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    b = rows // L  # batch of each row
    moffs = b[:, None] * N + cols[None, :]
    shift = tl.load(shift_ptr + moffs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + moffs, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * (1.0 + scale) + shift
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=rmask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def _layer_norm_modulate_bwd_kernel(
    dy_ptr,
    x_ptr,
    scale_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dshift_part_ptr,
    dscale_part_ptr,
    L,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # grid (B, P): program p of batch b walks that batch's row tiles with stride P and
    # writes its dshift/dscale partials to part[b, p, :].
    b = tl.program_id(0)
    pid = tl.program_id(1)
    n_prog = tl.num_programs(1)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    sc = 1.0 + tl.load(scale_ptr + b * N + cols, mask=cmask, other=0.0).to(tl.float32)
    acc_shift = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_scale = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(pid, tl.cdiv(L, BLOCK_M), n_prog):
        ls = t * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = ls < L
        rows = b * L + ls
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * sc[None, :]
        c1 = tl.sum(g, axis=1) / N
        c2 = tl.sum(g * xhat, axis=1) / N
        dx = rstd[:, None] * (g - c1[:, None] - xhat * c2[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        acc_shift += dy
        acc_scale += dy * xhat
    poffs = (b * n_prog + pid) * N + cols
    tl.store(dshift_part_ptr + poffs, tl.sum(acc_shift, axis=0), mask=cmask)
    tl.store(dscale_part_ptr + poffs, tl.sum(acc_scale, axis=0), mask=cmask)


def _blocks(N: int) -> tuple[int, int, int]:
    BLOCK_N = C.next_pow2(N)
    BLOCK_M = max(1, min(16, 2048 // BLOCK_N))
    return BLOCK_M, BLOCK_N, C.num_warps_for(BLOCK_M * BLOCK_N)


def _launch_fwd(x3, shift, scale, eps, y, mean, rstd):
    B, L, N = x3.shape
    M = B * L
    if M == 0:
        return y, mean, rstd
    BLOCK_M, BLOCK_N, nw = _blocks(N)
    C.launch(_layer_norm_modulate_fwd_kernel)[(triton.cdiv(M, BLOCK_M),)](
        x3, shift, scale, y, mean, rstd, M, L, N, eps, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=nw
    )
    return y, mean, rstd


def _launch_bwd(dy3, x3, scale, mean, rstd, dx, dshift, dscale):
    B, L, N = x3.shape
    if B * L == 0:
        return dx, dshift.zero_(), dscale.zero_()
    BLOCK_M, BLOCK_N, nw = _blocks(N)
    # enough programs in total to fill the device, shared out over the batch
    P = max(1, min(triton.cdiv(L, BLOCK_M), triton.cdiv(C.persistent_programs(1 << 30, x3.device), B)))
    pshift = torch.empty((B, P, N), device=x3.device, dtype=torch.float32)
    pscale = torch.empty((B, P, N), device=x3.device, dtype=torch.float32)
    C.launch(_layer_norm_modulate_bwd_kernel)[(B, P)](
        dy3, x3, scale, mean, rstd, dx, pshift, pscale, L, N, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=nw
    )
    C.col_sum(pshift, dshift)
    C.col_sum(pscale, dscale)
    return dx, dshift, dscale


def _fwd_fake(x3, shift, scale, eps):
    B, L, _ = x3.shape
    return (
        x3.new_empty(x3.shape, dtype=C.promote(x3, shift, scale)),
        x3.new_empty((B * L,), dtype=torch.float32),
        x3.new_empty((B * L,), dtype=torch.float32),
    )


@C.kernel_op("layer_norm_modulate_fwd", _fwd_fake)
def _fwd_op(
    x3: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, mean, rstd = _fwd_fake(x3, shift, scale, eps)
    return _launch_fwd(x3, shift, scale, eps, y, mean, rstd)


def _bwd_fake(dy3, x3, shift, scale, mean, rstd):
    return x3.new_empty(x3.shape), shift.new_empty(shift.shape), scale.new_empty(scale.shape)


@C.kernel_op("layer_norm_modulate_bwd", _bwd_fake)
def _bwd_op(
    dy3: torch.Tensor,
    x3: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dshift, dscale = _bwd_fake(dy3, x3, shift, scale, mean, rstd)
    return _launch_bwd(dy3, x3, scale, mean, rstd, dx, dshift, dscale)


def _mod2d(name, t, B, D):
    """(B, D) view of a modulation tensor given as (B, D) or (B, 1, D)."""
    if t.dim() == 3 and t.shape[1] == 1:
        t = t.reshape(t.shape[0], t.shape[2])
    C.check_shape(OP, name, t, (B, D), "one vector per batch element, broadcast over the tokens")
    return t


def _validate(x, shift, scale):
    C.check_tensor(OP, "x", x)
    C.check_tensor(OP, "shift", shift)
    C.check_tensor(OP, "scale", scale)
    C.check_device(OP, ("x", x), ("shift", shift), ("scale", scale))
    if x.dim() != 3:
        raise ValueError(f"{OP}: parameter 'x' must be (B, L, D), got shape {tuple(x.shape)}")
    B, _, D = x.shape
    _mod2d("shift", shift, B, D)
    _mod2d("scale", scale, B, D)
    C.check_row_width(OP, "x", D)


def layer_norm_modulate_forward(x, shift, scale, eps: float = 1e-6, *, out=None, mean=None, rstd=None):
    """Triton forward -> (y, mean (B·L,), rstd (B·L,)); pass buffers to write into them."""
    _validate(x, shift, scale)
    B, L, D = x.shape
    x3 = x.contiguous()
    sh, sc = _mod2d("shift", shift, B, D).contiguous(), _mod2d("scale", scale, B, D).contiguous()
    if out is None:
        return torch.ops.lab_kernels.layer_norm_modulate_fwd(x3, sh, sc, float(eps))
    return _launch_fwd(x3, sh, sc, float(eps), out, mean, rstd)


def layer_norm_modulate_backward(dy, x, shift, scale, mean, rstd, *, dx=None, dshift=None, dscale=None):
    """Triton backward -> (dx, dshift, dscale), gradients shaped like the inputs."""
    B, L, D = x.shape
    x3 = x.contiguous()
    dy3 = dy.reshape(x3.shape).contiguous()
    sh, sc = _mod2d("shift", shift, B, D).contiguous(), _mod2d("scale", scale, B, D).contiguous()
    if dx is None:
        gx, gsh, gsc = torch.ops.lab_kernels.layer_norm_modulate_bwd(dy3, x3, sh, sc, mean, rstd)
    else:
        gx, gsh, gsc = _launch_bwd(dy3, x3, sc, mean, rstd, dx, dshift, dscale)
    return gx, gsh.view(shift.shape), gsc.view(scale.shape)


class LayerNormModulateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shift, scale, eps):
        y, mean, rstd = layer_norm_modulate_forward(x, shift, scale, eps)
        ctx.save_for_backward(x, shift, scale, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, shift, scale, mean, rstd = ctx.saved_tensors
        dx, dsh, dsc = layer_norm_modulate_backward(dy, x, shift, scale, mean, rstd)
        n = ctx.needs_input_grad
        return (dx if n[0] else None, dsh if n[1] else None, dsc if n[2] else None, None)


def layer_norm_modulate(x, shift, scale, eps: float = 1e-6):
    """LayerNorm (no affine) + modulation through the Triton kernels."""
    _validate(x, shift, scale)
    return LayerNormModulateFunction.apply(x, shift, scale, eps)


def _bcast(t):
    return t if t.dim() == 3 else t[:, None, :]


def reference_layer_norm_modulate(x, shift, scale, eps: float = 1e-6):
    """Plain torch in the inputs' dtype (float64 for checks)."""
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps) * (1 + _bcast(scale)) + _bcast(shift)


def eager_layer_norm_modulate(x, shift, scale, eps: float = 1e-6):
    """What FLUX does: ``nn.LayerNorm(elementwise_affine=False)`` then ``(1 + scale) * x + shift``."""
    return (1 + _bcast(scale)) * F.layer_norm(x, (x.shape[-1],), eps=eps) + _bcast(shift)


register_fused_op(
    OP,
    reference=reference_layer_norm_modulate,
    eager=eager_layer_norm_modulate,
    triton=layer_norm_modulate,
    eager_description="F.layer_norm then modulation",
    triton_description="Triton fused LayerNorm + modulation, fwd + bwd, custom op",
    check=C.row_width_check(OP),
)
