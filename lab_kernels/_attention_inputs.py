"""What attention's Triton kernels accept and how they read it (private to the package).

One kernel family serves the dense ``(B, H, L, Dh)`` layout and the packed varlen
``(T, H, Dh)`` layout with ``cu_seqlens``; this module holds the input checks of both
layouts (every refusal names the parameter), the registry's capability check, and the
strides and launch sizes the host launchers in ``lab_kernels.attention`` pass to the kernels.
"""

from __future__ import annotations

import operator

import torch

from . import _common as C

OP = "attention"
HEAD_DIMS = (64, 128)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> None:
    """Refuse a ``cu_seqlens`` that is not [0, l0, l0+l1, ..., total] with every l > 0."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"parameter 'cu_seqlens' must be a 1-D integer tensor [0, l0, l0+l1, ..., T] "
            f"with at least 2 entries, got {cu_seqlens!r}"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"parameter 'cu_seqlens' must be int32 or int64, got {cu_seqlens.dtype}")
    c = cu_seqlens.tolist()
    if c[0] != 0:
        raise ValueError(f"parameter 'cu_seqlens' must start at 0, got {c[0]} (cu_seqlens={c})")
    if any(b <= a for a, b in zip(c[:-1], c[1:])):
        raise ValueError(f"parameter 'cu_seqlens' must be strictly increasing (no empty sequence), got {c}")
    if c[-1] != total:
        raise ValueError(
            f"parameter 'cu_seqlens' must end at the packed length {total} (q.shape[0]), got {c[-1]} (cu_seqlens={c})"
        )


def check_max_seqlen(cu_seqlens: torch.Tensor | None, max_seqlen) -> int | None:
    """The launch length of a packed problem: ``max_seqlen``, validated, or the longest sequence.

    The kernels launch ``cdiv(max_seqlen, BLOCK)`` blocks per sequence, so a ``max_seqlen``
    below the longest sequence would leave that sequence's tail rows unwritten."""
    if max_seqlen is None:
        if cu_seqlens is None:
            return None
        return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if cu_seqlens is None:
        raise ValueError(
            f"parameter 'max_seqlen' = {max_seqlen!r} is given without 'cu_seqlens'; it describes "
            "the packed (T, H, Dh) layout only (leave it None for (B, H, L, Dh))"
        )
    try:
        if isinstance(max_seqlen, bool):
            raise TypeError
        max_seqlen = operator.index(max_seqlen)
    except TypeError:
        raise ValueError(f"parameter 'max_seqlen' must be an int, got {max_seqlen!r}") from None
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if max_seqlen < longest:
        raise ValueError(
            f"parameter 'max_seqlen' = {max_seqlen} is smaller than the longest packed sequence ({longest} "
            f"rows, cu_seqlens={cu_seqlens.tolist()}); it must be >= {longest}"
        )
    return max_seqlen


def check_qkv(q, k, v, cu_seqlens):
    """Refuse q, k, v the kernels cannot take: layout, one shape, one dtype, head dim, device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"parameter {name!r} must be a tensor, got {type(t).__name__}")
    want = 3 if cu_seqlens is not None else 4
    layout = "(T, H, Dh) with cu_seqlens" if cu_seqlens is not None else "(B, H, L, Dh)"
    if q.dim() != want:
        raise ValueError(f"parameter 'q' must be {layout}, got shape {tuple(q.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        bad = "k" if k.shape != q.shape else "v"
        raise ValueError(
            f"parameter {bad!r} has shape {tuple((k if bad == 'k' else v).shape)}; the Triton "
            f"kernel does self-attention and needs q, k, v of one shape {tuple(q.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        bad = "k" if k.dtype != q.dtype else "v"
        raise ValueError(
            f"parameter {bad!r} has dtype {(k if bad == 'k' else v).dtype}, q has {q.dtype}: "
            f"q, k, v must share one dtype"
        )
    if q.dtype not in TRITON_DTYPES:
        raise ValueError(f"parameter 'q' has dtype {q.dtype}; the Triton kernel takes float16, bfloat16, float32")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"parameter 'q' has head dim {q.shape[-1]}; the Triton kernel supports {HEAD_DIMS}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"parameters 'q', 'k', 'v' are on different devices ({q.device}, {k.device}, {v.device})")
    C.check_device(OP, ("q", q), ("k", k), ("v", v))


def check_varlen(q, cu_seqlens, max_seqlen) -> int | None:
    """Every check of the packed layout's inputs; the validated launch length (None when dense)."""
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, q.shape[0])
    return check_max_seqlen(cu_seqlens, max_seqlen)


def varlen_launch(q, cu_seqlens, max_seqlen, validate: bool) -> int | None:
    """The validated launch length, or (``validate=False``: checked before, by the caller) the
    caller's ``max_seqlen``, checked without reading anything back from the device."""
    if validate:
        return check_varlen(q, cu_seqlens, max_seqlen)
    if cu_seqlens is None:
        return check_max_seqlen(None, max_seqlen)
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(
            f"parameter 'max_seqlen' = {max_seqlen!r} is not allowed with validate=False: expected the longest "
            "packed sequence's length (an int >= 1), checked beforehand (check_varlen)"
        )
    return max_seqlen


def triton_check(*, device=None, dtype=None, head_dim=None, mask=None, causal=None, layout=None, lq=None, lk=None, **_):
    """Capability check for the registry: why the Triton kernel cannot run a problem."""
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"attention/triton supports head dims {HEAD_DIMS}, not {head_dim}"
    if mask is not None and mask not in ("full", "causal"):
        return f"attention/triton supports masks 'full' and 'causal', not {mask!r}"
    if lq is not None and lk is not None and lq != lk:
        return "attention/triton does self-attention only (query and key lengths must match)"
    if layout is not None and layout not in ("bhld", "packed"):
        return f"attention/triton supports layouts 'bhld' and 'packed', not {layout!r}"
    return None


#: The kinds of launch :func:`launch_config` sizes: one per kernel.
LAUNCH_KINDS = ("fwd", "bwd_dkdv", "bwd_dq")


def launch_config(kind: str, head_dim: int, dtype: torch.dtype) -> dict:
    """Tile sizes of one kernel (``kind`` in :data:`LAUNCH_KINDS`).  Interpreter: 32x32 (several
    blocks even at L ~ 100, so the loop and boundary masks are exercised).  GPU (Hopper/Ampere-sized
    shared memory): FA2-style tiles, smaller for float32 (true fp32 dots, no tensor cores).

    Backward at head dim 128 in 16-bit (Hopper): every dot of both kernels has an M of 64 per
    warpgroup, so it lowers to wgmma (a 32-row tile lowered dQ to mma.sync), and the operand tiles
    are loaded one step ahead (2 stages; the JIT's 16-byte specialization makes them async copies).
    dK/dV: 64 keys per program, 64 queries per step, 8 warps (208 registers, no spill, 97 KB
    shared); dQ: 128 queries per program, 64 keys per step, 8 warps (221 registers, no spill,
    128 KB shared): ptxas -v for sm_90a (triton 3.9).  Compiled for sm_90 by the tests; not
    tuned on a GPU."""
    if kind not in LAUNCH_KINDS:
        raise ValueError(f"parameter 'kind' = {kind!r} is not allowed: expected one of {LAUNCH_KINDS}")
    if C.interpreted():
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    if kind == "fwd":
        # FA2-tutorial-style Hopper defaults; fp32 x Dh 128 halves BLOCK_N to fit shared memory.
        # Educated defaults, not tuned on a GPU; the tests compile them for sm_90.
        f32_128 = dtype == torch.float32 and head_dim > 64
        return dict(
            BLOCK_M=128,
            BLOCK_N=32 if f32_128 else 64,
            num_warps=8 if head_dim > 64 else 4,
            num_stages=2 if f32_128 else 3,
        )
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=1)
    if head_dim <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    if kind == "bwd_dkdv":
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)


def dot_args(dtype) -> dict:
    # fp32 inputs: true fp32 dots ("ieee"), so float32 meets its tolerance (no TF32).
    upcast = C.interpreted() and dtype == torch.bfloat16
    return dict(DOT_PRECISION="ieee" if (dtype == torch.float32 or upcast) else "tf32", UPCAST=upcast)


def launch_dims(q, cu_seqlens, max_seqlen):
    """(n_seq, n_heads, seqlen_or_max, batch/head/row strides of a (B,H,L,D)/(T,H,D) tensor)."""
    if cu_seqlens is None:
        B, H, L, _ = q.shape
        return B, H, L
    return cu_seqlens.numel() - 1, q.shape[1], int(max_seqlen)


def same_strides(q, k, v):
    """The kernels take one set of strides for q, k, v and need a unit last stride;
    a (B, L, H, D).transpose(1, 2) view is used in place when all three agree."""
    if q.stride(-1) == 1 and q.stride() == k.stride() == v.stride():
        return q, k, v
    return q.contiguous(), k.contiguous(), v.contiguous()


def strides(t, varlen: bool):
    if varlen:  # (T, H, D): no batch stride, row stride = stride(0)
        return 0, t.stride(1), t.stride(0)
    return t.stride(0), t.stride(1), t.stride(2)


def lse_strides(lse, varlen: bool):
    if varlen:  # (H, T)
        return 0, lse.stride(0)
    return lse.stride(0), lse.stride(1)  # (B, H, L)
