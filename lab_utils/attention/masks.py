"""Attention masks as FlexAttention ``mask_mod``s, composable with ``&`` and ``|``.

Design note
-----------
A :class:`Mask` wraps one ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may
attend) written only with tensor ops, so the *same* function serves three consumers:

* FlexAttention (``create_block_mask`` vmaps it over scalar indices),
* :func:`dense_mask`, which calls it once on broadcast index grids and returns the
  (B, H, Lq, Lk) boolean tensor (SDPA's ``attn_mask``, the float64 reference, pictures),
* :func:`count_pairs`, which evaluates it in row chunks to count allowed (q, k) pairs
  for mask-aware FLOPs without materialising an L x L tensor at GPU sizes.

``kind`` tells paths that only know ``is_causal`` what a mask is: "full" and "causal"
are recognised through composition (``causal() & full()`` is causal); everything
else is "custom" and needs a path that takes a dense mask or a mask_mod.

Token order of the joint MMDiT sequence follows FLUX: ``[text | image]``.
FLOPs follow :mod:`lab_utils.core.flops`: attention over ``P`` allowed pairs costs ``4 * P * Dh``
per head forward (QK^T and PV, 2 FLOPs per multiply-add); the backward is 2.5x that under the
"kernel" convention (the matmuls a flash backward runs: a kernel's TFLOP/s) and 2x under the
"model" convention (what MFU counts).  :class:`AttentionFlops` says which one it holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask

from lab_utils.core import flops as F
from lab_utils.core.config import ConfigError

MaskMod = Callable[[Any, Any, Any, Any], Any]


@dataclass(frozen=True)
class Mask:
    name: str
    mask_mod: MaskMod
    kind: str = "custom"  # "full" | "causal" | "custom"
    params: dict = field(default_factory=dict)
    #: the sequence length the mask was built for (None = any); a mismatch is an error
    length: int | None = None

    def __call__(self, b, h, q_idx, kv_idx):
        return self.mask_mod(b, h, q_idx, kv_idx)

    def __and__(self, other: Mask) -> Mask:
        a, c = self.mask_mod, other.mask_mod

        def mod(b, h, q, k):
            return a(b, h, q, k) & c(b, h, q, k)

        kinds = {self.kind, other.kind}
        kind = "full" if kinds == {"full"} else "causal" if kinds <= {"full", "causal"} else "custom"
        return Mask(
            f"({self.name} & {other.name})", mod, kind, {"and": [self.name, other.name]}, _join_len(self, other)
        )

    def __or__(self, other: Mask) -> Mask:
        a, c = self.mask_mod, other.mask_mod

        def mod(b, h, q, k):
            return a(b, h, q, k) | c(b, h, q, k)

        kinds = {self.kind, other.kind}
        kind = "full" if "full" in kinds else "causal" if kinds == {"causal"} else "custom"
        return Mask(f"({self.name} | {other.name})", mod, kind, {"or": [self.name, other.name]}, _join_len(self, other))

    def check_length(self, lq: int, lk: int, param: str = "mask") -> None:
        if self.length is not None and (lq != self.length or lk != self.length):
            raise ConfigError(
                param, self.name, f"a mask for sequence length {lq}x{lk}; this one was built for {self.length} tokens"
            )

    def __repr__(self) -> str:
        return f"Mask({self.name}, kind={self.kind})"


class _OnDevice:
    """A tensor a mask_mod captures, copied once per device.  FlexAttention wants captured
    tensors on the device of q (its kernels read them); a ``.to()`` inside the traced
    mask_mod would be a transfer per call."""

    def __init__(self, t: torch.Tensor):
        self._by = {str(t.device): t}

    def on(self, device) -> torch.Tensor:
        key = str(device)
        t = self._by.get(key)
        if t is None:
            t = self._by[key] = next(iter(self._by.values())).to(device)
        return t


def _join_len(a: Mask, b: Mask) -> int | None:
    if a.length is not None and b.length is not None and a.length != b.length:
        raise ConfigError("mask", f"{a.name} & {b.name}", f"masks of one sequence length ({a.length} != {b.length})")
    return a.length if a.length is not None else b.length


# --------------------------------------------------------------------------- mask constructors
def full() -> Mask:
    return Mask("full", lambda b, h, q, k: q >= 0, "full")


def causal() -> Mask:
    return Mask("causal", lambda b, h, q, k: q >= k, "causal")


def sliding_window(window: int) -> Mask:
    """Bidirectional local attention: |q - k| <= window (compose with causal for the LM form)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ConfigError("window", window, "an integer >= 0")
    return Mask(f"sliding_window({window})", lambda b, h, q, k: (q - k).abs() <= window, params={"window": window})


def _ids_from_lengths(lengths: Sequence[int], param: str) -> torch.Tensor:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (list, tuple)) or not lengths:
        raise ConfigError(param, lengths, "a non-empty list of positive sequence lengths")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ConfigError(param, lengths, f"a list of positive integers ({n!r} is not)")
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def document(lengths: Sequence[int]) -> Mask:
    """Packed sequences: token q sees token k only inside its own document.
    ``lengths`` of the packed documents; the mask covers exactly sum(lengths) tokens."""
    ids = _OnDevice(_ids_from_lengths(lengths, "lengths"))

    def mod(b, h, q, k):
        d = ids.on(q.device)
        return d[q] == d[k]

    return Mask(f"document({len(lengths)} docs)", mod, params={"lengths": list(lengths)}, length=int(sum(lengths)))


def prefix_lm(prefix: int | Sequence[int]) -> Mask:
    """Prefix-LM: keys in the prefix are visible to all; after it, causal.
    ``prefix`` an int, or one per batch element."""
    if isinstance(prefix, int) and not isinstance(prefix, bool):
        if prefix < 0:
            raise ConfigError("prefix", prefix, "an integer >= 0")
        return Mask(f"prefix_lm({prefix})", lambda b, h, q, k: (k < prefix) | (q >= k), params={"prefix": prefix})
    if (
        not isinstance(prefix, (list, tuple))
        or not prefix
        or any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in prefix)
    ):
        raise ConfigError("prefix", prefix, "an integer >= 0 or a list of them (one per batch element)")
    pre = _OnDevice(torch.tensor(list(prefix)))

    def mod(b, h, q, k):
        p = pre.on(q.device)
        return (k < p[b]) | (q >= k)

    return Mask(f"prefix_lm({list(prefix)})", mod, params={"prefix": list(prefix)})


def mmdit(txt_len: int, img_len: int, txt_valid: int | Sequence[int] | None = None) -> Mask:
    """Joint MMDiT attention over ``[text (txt_len, padded) | image (img_len)]``: everyone
    attends everyone, except padded text tokens (text position >= ``txt_valid[b]``),
    which no query may attend.  Padded text *queries* still attend (their outputs are
    discarded by the model), so no softmax row is empty."""
    for p, v in (("txt_len", txt_len), ("img_len", img_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if p == "txt_len" else 1):
            raise ConfigError(p, v, "a non-negative integer" if p == "txt_len" else "a positive integer")
    if txt_valid is None:
        txt_valid = txt_len
    vals = [txt_valid] if isinstance(txt_valid, int) and not isinstance(txt_valid, bool) else txt_valid
    if (
        not isinstance(vals, (list, tuple))
        or not vals
        or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= txt_len for t in vals)
    ):
        raise ConfigError("txt_valid", txt_valid, f"an integer in [0, {txt_len}] or a list of them (one per batch)")
    valid = _OnDevice(torch.tensor(list(vals)))
    per_batch = len(vals) > 1

    def mod(b, h, q, k):
        t = valid.on(k.device)
        tv = t[b] if per_batch else t[0]
        return (k >= txt_len) | (k < tv)

    return Mask(
        f"mmdit(txt {txt_len}, valid {list(vals) if per_batch else vals[0]}, img {img_len})",
        mod,
        params={"txt_len": txt_len, "img_len": img_len, "txt_valid": list(vals)},
        length=txt_len + img_len,
    )


def spatial_neighborhood(height: int, width: int, kernel_size: int, *, offset: int = 0) -> Mask:
    """NATTEN-style 2D neighborhood attention over a ``height x width`` grid of image tokens
    (row-major, starting at token ``offset``).  Each image query attends the
    ``kernel_size x kernel_size`` window centred on it, shifted inward at the borders so
    every query sees exactly kernel_size**2 image keys.  Tokens before ``offset``
    (text) are global: they attend to everything and everyone attends them."""
    for p, v in (("height", height), ("width", width), ("kernel_size", kernel_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(p, v, "a positive integer")
    if kernel_size % 2 == 0 or kernel_size > min(height, width):
        raise ConfigError("kernel_size", kernel_size, f"an odd integer <= min(height, width) = {min(height, width)}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ConfigError("offset", offset, "an integer >= 0")
    r = kernel_size // 2

    def window_start(c, n):
        return (c - r).clamp(0, n - kernel_size)

    def mod(b, h, q, k):
        qi, ki = q - offset, k - offset
        qy, qx = qi // width, qi % width
        ky, kx = ki // width, ki % width
        sy, sx = window_start(qy, height), window_start(qx, width)
        local = (ky >= sy) & (ky < sy + kernel_size) & (kx >= sx) & (kx < sx + kernel_size)
        return (q < offset) | (k < offset) | local

    return Mask(
        f"neighborhood({height}x{width}, k={kernel_size})",
        mod,
        params={"height": height, "width": width, "kernel_size": kernel_size, "offset": offset},
        length=offset + height * width,
    )


def packed_mask(mask: Mask | None, lengths: Sequence[int]) -> Mask:
    """The mask of a packed batch (sequences of ``lengths`` concatenated): a token sees
    only its own sequence, and inside it ``mask`` applies to positions within the
    sequence (its ``b`` index is the sequence index).  ``None`` = full inside each."""
    ids = _OnDevice(_ids_from_lengths(list(lengths), "lengths"))
    starts = _OnDevice(torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0)[:-1].tolist()]))
    inner = mask.mask_mod if mask is not None else None

    def mod(b, h, q, k):
        d, s = ids.on(q.device), starts.on(q.device)
        same = d[q] == d[k]
        if inner is None:
            return same
        return same & inner(d[q], h, q - s[d[q]], k - s[d[k]])

    name = f"packed({len(lengths)} seqs{', ' + mask.name if mask is not None else ''})"
    return Mask(name, mod, "custom", {"lengths": list(lengths)}, length=int(sum(lengths)))


MASK_NAMES = ("full", "causal", "sliding_window", "document", "prefix_lm", "mmdit", "neighborhood")


def make_mask(
    name: str,
    seq_len: int,
    *,
    window: int | None = None,
    n_docs: int = 3,
    txt_len: int | None = None,
    txt_valid: int | None = None,
    kernel_size: int = 3,
    seed: int = 0,
) -> Mask:
    """A named mask for a sequence of ``seq_len`` tokens with lab defaults (used by the
    notebook and the benchmark so both build the same masks):

    * sliding_window: window = seq_len // 8;  document: ``n_docs`` documents of
      seeded random lengths;  prefix_lm: prefix = seq_len // 4;
    * mmdit: text = seq_len // 8 tokens (3/4 of them valid), the rest image;
    * neighborhood: text = seq_len // 8 tokens, the image grid the squarest factorisation
      of the rest."""
    if name not in MASK_NAMES:
        raise ConfigError("mask", name, "one of " + ", ".join(MASK_NAMES))
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 4:
        raise ConfigError("seq_len", seq_len, "an integer >= 4")
    if name == "full":
        return full()
    if name == "causal":
        return causal()
    if name == "sliding_window":
        return sliding_window(window if window is not None else max(1, seq_len // 8))
    if name == "document":
        g = torch.Generator().manual_seed(seed)
        cuts = sorted(torch.randperm(seq_len - 1, generator=g)[: n_docs - 1].add(1).tolist())
        bounds = [0, *cuts, seq_len]
        return document([b - a for a, b in zip(bounds[:-1], bounds[1:])])
    if name == "prefix_lm":
        return prefix_lm(seq_len // 4)
    t = txt_len if txt_len is not None else max(1, seq_len // 8)
    if name == "mmdit":
        return mmdit(t, seq_len - t, txt_valid if txt_valid is not None else max(1, (3 * t) // 4))
    n_img = seq_len - t
    h = int(math.isqrt(n_img))
    while n_img % h:
        h -= 1
    w = n_img // h
    return spatial_neighborhood(h, w, min(kernel_size, h if h % 2 else h - 1) if h > 1 else 1, offset=t)


# --------------------------------------------------------------------------- dense / block forms
def _grid(B, H, Lq, Lk, device, q0: int = 0, rows: int | None = None):
    rows = Lq if rows is None else rows
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    q = torch.arange(q0, q0 + rows, device=device).view(1, 1, rows, 1)
    k = torch.arange(Lk, device=device).view(1, 1, 1, Lk)
    return b, h, q, k


def dense_mask(mask: Mask, B: int, H: int, Lq: int, Lk: int, device="cpu") -> torch.Tensor:
    """The (B, H, Lq, Lk) boolean form of a mask (True = may attend)."""
    mask.check_length(Lq, Lk)
    b, h, q, k = _grid(B, H, Lq, Lk, device)
    out = mask.mask_mod(b, h, q, k)
    return torch.broadcast_to(torch.as_tensor(out, device=device).bool(), (B, H, Lq, Lk)).clone()


def count_pairs(mask: Mask, B: int, H: int, Lq: int, Lk: int, *, chunk: int = 1024) -> int:
    """Allowed (b, h, q, k) pairs, evaluated in row chunks (never an Lq x Lk tensor)."""
    mask.check_length(Lq, Lk)
    if mask.kind == "full":
        return B * H * Lq * Lk
    if mask.kind == "causal" and Lq == Lk:
        return B * H * Lq * (Lq + 1) // 2
    total = 0
    # Masks here never depend on the head; evaluate one head and scale.
    for q0 in range(0, Lq, chunk):
        rows = min(chunk, Lq - q0)
        b, h, q, k = _grid(B, 1, Lq, Lk, "cpu", q0, rows)
        m = torch.broadcast_to(torch.as_tensor(mask.mask_mod(b, h, q, k)).bool(), (B, 1, rows, Lk))
        total += int(m.sum())
    return total * H


@dataclass(frozen=True)
class AttentionFlops:
    pairs: int  # allowed (b, h, q, k) pairs
    dense_pairs: int  # B * H * Lq * Lk
    fwd: float  # 4 * pairs * Dh
    bwd: float  # flops.ATTENTION_BWD_FACTOR[convention] * fwd
    density: float  # pairs / dense_pairs
    convention: str = "kernel"  # lab_utils.core.flops: "kernel" (2.5x backward) | "model" (2x)

    @property
    def fwd_bwd(self) -> float:
        return self.fwd + self.bwd


def attention_flops(
    mask: Mask | None, B: int, H: int, Lq: int, Lk: int, head_dim: int, *, convention: str = "kernel"
) -> AttentionFlops:
    """Mask-aware FLOPs (:func:`lab_utils.core.flops.attention_flops` over the allowed pairs only,
    not the dense L x L); the backward by ``convention`` ("kernel" or "model")."""
    if convention not in F.ATTENTION_CONVENTIONS:
        raise ConfigError("convention", convention, "one of " + ", ".join(map(repr, F.ATTENTION_CONVENTIONS)))
    mask = mask or full()
    pairs = count_pairs(mask, B, H, Lq, Lk)
    fwd = F.attention_flops(1, 1, Lq, Lk, head_dim, pairs=pairs, direction="fwd", convention=convention)
    bwd = F.attention_flops(1, 1, Lq, Lk, head_dim, pairs=pairs, direction="bwd", convention=convention)
    return AttentionFlops(pairs, B * H * Lq * Lk, fwd, bwd, pairs / (B * H * Lq * Lk), convention)


@dataclass(frozen=True)
class BlockStats:
    block_size: tuple[int, int]
    n_blocks: int  # tiles of the (Lq, Lk) grid (per batch*head)
    full_blocks: int  # every pair allowed: no mask evaluation needed
    partial_blocks: int  # some allowed: the kernel computes the tile and applies the mask
    empty_blocks: int  # none allowed: skipped
    density: float  # allowed pairs / all pairs
    block_density: float  # (full + partial) / n_blocks: the fraction of tiles a block-sparse kernel runs

    @property
    def sparsity(self) -> float:
        return 1.0 - self.density


def block_states(dense: torch.Tensor, block_q: int = 128, block_k: int = 128) -> torch.Tensor:
    """(…, nq, nk) int8 tile states of a (…, Lq, Lk) boolean mask: 0 empty, 1 partial, 2 full.
    Edge tiles are judged on their in-range part."""
    *lead, Lq, Lk = dense.shape
    nq, nk = -(-Lq // block_q), -(-Lk // block_k)
    pad = torch.zeros(*lead, nq * block_q, nk * block_k, dtype=torch.int32, device=dense.device)
    valid = torch.zeros_like(pad)
    pad[..., :Lq, :Lk] = dense.int()
    valid[..., :Lq, :Lk] = 1
    s = pad.reshape(*lead, nq, block_q, nk, block_k).sum((-3, -1))
    n = valid.reshape(*lead, nq, block_q, nk, block_k).sum((-3, -1))
    out = torch.ones_like(s, dtype=torch.int8)
    out[s == 0] = 0
    out[s == n] = 2
    return out


def block_stats(mask: Mask, Lq: int, Lk: int, *, B: int = 1, block_size: int | tuple[int, int] = 128) -> BlockStats:
    """Tile census of a mask (batch element 0 ... B-1, one head)."""
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    d = dense_mask(mask, B, 1, Lq, Lk)
    st = block_states(d, bq, bk)
    n = st.numel()
    full_b, part_b = int((st == 2).sum()), int((st == 1).sum())
    return BlockStats((bq, bk), n, full_b, part_b, n - full_b - part_b, float(d.float().mean()), (full_b + part_b) / n)


def flex_block_mask(
    mask: Mask,
    B: int | None,
    H: int | None,
    Lq: int,
    Lk: int,
    *,
    device="cpu",
    block_size: int = 128,
    compile: bool = False,
):
    """FlexAttention ``BlockMask`` of a mask (``B``/``H`` None = broadcast).  ``compile``
    builds it with torch.compile (what long sequences on GPU need)."""
    mask.check_length(Lq, Lk)
    return create_block_mask(mask.mask_mod, B, H, Lq, Lk, device=device, BLOCK_SIZE=block_size, _compile=compile)
