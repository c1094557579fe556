"""Input checks of ``lab_utils.attention.attend.attend``: one description of a call, or a refusal.

:func:`check_inputs` validates q, k, v (shapes, dtypes, devices), the packed layout's
``cu_seqlens`` / ``max_seqlen`` and the mask, and returns a :class:`Problem` that the
paths' capability checks read; :func:`normalize_mask` turns the accepted mask spellings
into what the paths take.  Every refusal is an :class:`AttentionError` naming the
parameter.  ``lab_utils.attention.attend`` re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab_kernels import attention as kernel
from lab_utils.attention.masks import Mask, causal
from lab_utils.attention.paths import AttentionError


@dataclass(frozen=True)
class Problem:
    """What check_inputs found: the layout, sizes, dtype, device and mask kind of one call."""

    layout: str  # "bhld" | "packed"
    B: int  # batch (packed: number of sequences)
    H: int
    Lq: int  # packed: longest sequence
    Lk: int
    head_dim: int
    dtype: torch.dtype
    device: str
    mask_kind: str  # "full" | "causal" | "custom"
    requires_grad: bool
    lengths: tuple[int, ...] = ()  # packed only

    def as_check(self) -> dict:
        return dict(
            device=self.device,
            dtype=self.dtype,
            head_dim=self.head_dim,
            mask=self.mask_kind,
            layout=self.layout,
            lq=self.Lq,
            lk=self.Lk,
            backward=self.requires_grad,
        )


def _mask_kind(mask) -> str:
    if mask is None:
        return "full"
    if isinstance(mask, str):
        return mask
    if isinstance(mask, Mask):
        return mask.kind
    return "custom"


def normalize_mask(mask):
    """The mask as attend() passes it on: None (full), a Mask, or a boolean tensor; refusals name 'mask'."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if isinstance(mask, str):
        if mask == "full":
            return None
        if mask == "causal":
            return causal()
        raise AttentionError(
            "mask", mask, "None, 'full', 'causal', a lab_utils.attention.masks.Mask or a boolean tensor"
        )
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise AttentionError(
                "mask",
                f"tensor of dtype {mask.dtype}",
                "a boolean tensor (True = may attend); additive float masks are not accepted",
            )
        return mask
    raise AttentionError(
        "mask", type(mask).__name__, "None, 'full', 'causal', a lab_utils.attention.masks.Mask or a boolean tensor"
    )


def check_inputs(q, k, v, *, mask=None, cu_seqlens=None, max_seqlen=None) -> Problem:
    """Validate shapes, dtypes, devices, cu_seqlens and the mask; describe the problem."""
    _check_tensors(q, k, v)
    if cu_seqlens is not None:
        return _check_packed(q, k, v, mask, cu_seqlens, max_seqlen)
    return _check_bhld(q, k, v, mask)


def _check_tensors(q, k, v) -> None:
    """q, k, v: floating-point tensors of one dtype on one device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise AttentionError(name, type(t).__name__, "a tensor")
        if not t.is_floating_point():
            raise AttentionError(name, f"dtype {t.dtype}", "a floating-point tensor")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise AttentionError(name, f"dtype {t.dtype}", f"the dtype of q ({q.dtype})")
        if t.device != q.device:
            raise AttentionError(name, f"device {t.device}", f"the device of q ({q.device})")


def _check_packed(q, k, v, mask, cu_seqlens, max_seqlen) -> Problem:
    """The packed layout: (T, H, Dh) self-attention with valid ``cu_seqlens``, a mask that
    applies inside every sequence."""
    if q.dim() != 3:
        raise AttentionError("q", f"shape {tuple(q.shape)}", "(T, H, Dh) when cu_seqlens is given")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise AttentionError(
                name,
                f"shape {tuple(t.shape)}",
                f"the shape of q {tuple(q.shape)} (packed attention is self-attention)",
            )
    try:
        kernel.check_cu_seqlens(cu_seqlens, q.shape[0])
    except ValueError as e:
        raise AttentionError(
            "cu_seqlens",
            cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens,
            str(e).split(" must ", 1)[-1],
        ) from None
    lengths = tuple(int(x) for x in (cu_seqlens[1:] - cu_seqlens[:-1]).tolist())
    if max_seqlen is not None and max_seqlen < max(lengths):
        raise AttentionError("max_seqlen", max_seqlen, f">= the longest sequence ({max(lengths)})")
    if isinstance(mask, torch.Tensor):
        raise AttentionError(
            "mask",
            "a dense tensor",
            "a Mask (mask_mod) or 'causal'/'full' in the packed layout (positions inside each sequence)",
        )
    if isinstance(mask, Mask) and mask.length is not None and any(n != mask.length for n in lengths):
        raise AttentionError(
            "mask",
            mask.name,
            f"a mask valid for every packed sequence; it was built for "
            f"{mask.length} tokens, the sequences have {list(lengths)}",
        )
    B, H, L = len(lengths), q.shape[1], max(lengths)
    return Problem(
        "packed",
        B,
        H,
        L,
        L,
        q.shape[2],
        q.dtype,
        q.device.type,
        _mask_kind(mask),
        any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled(),
        lengths,
    )


def _check_bhld(q, k, v, mask) -> Problem:
    """The (B, H, L, Dh) layout: k and v match q, the mask fits (Lq, Lk)."""
    if q.dim() != 4:
        raise AttentionError("q", f"shape {tuple(q.shape)}", "(B, H, L, Dh), or (T, H, Dh) with cu_seqlens")
    if k.dim() != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise AttentionError(
            "k",
            f"shape {tuple(k.shape)}",
            f"(B, H, Lk, Dh) = ({q.shape[0]}, {q.shape[1]}, Lk, {q.shape[3]}) to match q {tuple(q.shape)}",
        )
    if v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise AttentionError(
            "v", f"shape {tuple(v.shape)}", f"(B, H, Lk, Dv) with (B, H, Lk) = {tuple(k.shape[:3])} from k"
        )
    if v.shape[3] != q.shape[3]:
        raise AttentionError("v", f"shape {tuple(v.shape)}", f"head dim {q.shape[3]} like q (paths here share Dh)")
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    kind = _mask_kind(mask)
    _check_mask(mask, kind, q, (B, H, Lq, Lk))
    return Problem(
        "bhld",
        B,
        H,
        Lq,
        Lk,
        D,
        q.dtype,
        q.device.type,
        kind,
        any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled(),
    )


def _check_mask(mask, kind: str, q, dims: tuple[int, int, int, int]) -> None:
    """A dense mask broadcasts to (B, H, Lq, Lk) on q's device; a Mask was built for this
    length; causal needs Lq == Lk."""
    B, H, Lq, Lk = dims
    if isinstance(mask, torch.Tensor):
        try:
            torch.broadcast_shapes(mask.shape, (B, H, Lq, Lk))
            ok = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, (B, H, Lq, Lk)) == (B, H, Lq, Lk)
        except RuntimeError:
            ok = False
        if not ok:
            raise AttentionError(
                "mask", f"tensor of shape {tuple(mask.shape)}", f"broadcastable to (B, H, Lq, Lk) = {(B, H, Lq, Lk)}"
            )
        if mask.device != q.device:
            raise AttentionError("mask", f"device {mask.device}", f"the device of q ({q.device})")
    elif isinstance(mask, Mask):
        if mask.length is not None and (Lq != mask.length or Lk != mask.length):
            raise AttentionError(
                "mask",
                mask.name,
                f"a mask for Lq = Lk = {Lq if Lq == Lk else (Lq, Lk)}; it was built for {mask.length} tokens",
            )
    if kind == "causal" and Lq != Lk:
        raise AttentionError(
            "mask", "causal", f"full or a custom mask when Lq != Lk ({Lq} != {Lk}): causal alignment would be ambiguous"
        )
