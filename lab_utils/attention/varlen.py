"""Padding vs packing of a batch drawn from aspect-ratio buckets.

Design note
-----------
A diffusion-transformer batch mixes resolutions (aspect-ratio buckets, several
training resolutions) and caption lengths, so its joint sequences ``[text | image]``
differ in length.  Two ways to run attention on it:

* padding: every sequence padded to the longest ``Lmax``; a (B, H, Lmax, Dh) tensor
  with a key-padding mask.  A dense kernel computes all ``B * Lmax^2`` pairs.
* packing: sequences concatenated into (T, H, Dh), T = sum(L_i), with ``cu_seqlens``;
  a varlen kernel computes ``sum(L_i^2)`` pairs (block-diagonal).

FLOPs (forward, per head): 4 * Dh * pairs; the backward by ``lab_utils.core.flops``' convention
("kernel" 2.5x by default, "model" 2x).  "Useful" FLOPs are
the packed ones: padding wastes ``1 - sum(L_i^2) / (B * Lmax^2)`` of its work.  Memory:
q, k, v, o activations scale with the token count (B * Lmax vs T); a path that
materialises scores (SDPA math, reference) also holds H * B * Lmax^2 (padded) vs
H * sum(L_i^2) (packed, one sequence at a time: H * max L_i^2) floats.

Image tokens of an H x W image: (H / pixels_per_token) * (W / pixels_per_token) with
FLUX's 8x VAE and 2x2 patches, i.e. pixels_per_token = 16 (``tokens_for`` below).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lab_utils.attention.attend import attend, get_path
from lab_utils.core import flops as F
from lab_utils.core.config import ConfigError, check_int
from lab_utils.core.session import Session
from lab_utils.core.timing import BenchOptions, try_bench

#: FLUX-style ~1 megapixel aspect-ratio buckets (height, width in pixels).
BUCKETS_1MP = [
    (1024, 1024),
    (1152, 896),
    (896, 1152),
    (1216, 832),
    (832, 1216),
    (1344, 768),
    (768, 1344),
    (1536, 640),
    (640, 1536),
]
#: Small buckets for CPU runs: aspect ratios at two training resolutions (~256^2 and ~128^2
#: pixels), as in multi-resolution training, where padding waste is largest.
BUCKETS_SMALL = [(256, 256), (224, 288), (320, 192), (192, 320), (128, 128), (112, 144), (160, 96), (96, 160)]


def normalize_buckets(buckets, param: str = "buckets") -> list[tuple[int, int]]:
    """[[H, W], ...] or [S, ...] (square) -> [(H, W), ...]; anything else is a ConfigError."""
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, (list, tuple)) or not buckets:
        raise ConfigError(param, buckets, "a non-empty list of [height, width] pixel sizes (or square sizes)")
    out = []
    for b in buckets:
        if isinstance(b, int) and not isinstance(b, bool):
            b = (b, b)
        if (
            not isinstance(b, (list, tuple))
            or len(b) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in b)
        ):
            raise ConfigError(param, buckets, f"a list of [height, width] positive ints ({b!r} is not)")
        out.append((int(b[0]), int(b[1])))
    return out


def tokens_for(height: int, width: int, pixels_per_token: int) -> int:
    return math.prod((height // pixels_per_token, width // pixels_per_token))


@dataclass(frozen=True)
class VarlenBatch:
    lengths: tuple[int, ...]  # joint sequence length per sample (text + image)
    img_tokens: tuple[int, ...]
    txt_tokens: tuple[int, ...]
    buckets: tuple[tuple[int, int], ...]

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def cu_seqlens(self, device="cpu") -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(self.lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def bucket_batch(
    batch_size: int,
    *,
    buckets=None,
    pixels_per_token: int = 16,
    txt_len: tuple[int, int] | int = (32, 128),
    seed: int = 0,
) -> VarlenBatch:
    """A batch whose samples come from random aspect-ratio buckets with random caption
    lengths (uniform in ``txt_len``); deterministic for a seed."""
    check_int("batch_size", batch_size, min=1)
    check_int("pixels_per_token", pixels_per_token, min=1)
    bk = normalize_buckets(buckets if buckets is not None else BUCKETS_SMALL)
    lo, hi = (txt_len, txt_len) if isinstance(txt_len, int) else tuple(txt_len)
    if isinstance(lo, bool) or not isinstance(lo, int) or not isinstance(hi, int) or not 0 <= lo <= hi:
        raise ConfigError("txt_len", txt_len, "an integer >= 0 or a pair [min, max] with 0 <= min <= max")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(bk), (batch_size,), generator=g).tolist()
    txt = torch.randint(lo, hi + 1, (batch_size,), generator=g).tolist()
    img = [tokens_for(*bk[i], pixels_per_token) for i in idx]
    if min(img) < 1:
        raise ConfigError("pixels_per_token", pixels_per_token, "small enough for every bucket to have an image token")
    return VarlenBatch(tuple(i + t for i, t in zip(img, txt)), tuple(img), tuple(txt), tuple(bk[i] for i in idx))


@dataclass(frozen=True)
class PadPackCost:
    layout: str  # "padded" | "packed"
    tokens: int  # rows of q (B * Lmax or T)
    pairs: int  # (q, k) pairs computed, all heads
    fwd_flops: float
    bwd_flops: float  # by ``convention``
    useful_fraction: float  # useful pairs / computed pairs
    activation_bytes: int  # q, k, v, o
    score_bytes: int  # materialised fp32 scores of a math-style path (peak)
    convention: str = "kernel"  # lab_utils.core.flops attention convention of bwd_flops


def pad_pack_costs(
    batch: VarlenBatch, heads: int, head_dim: int, dtype=torch.bfloat16, *, convention: str = "kernel"
) -> list[PadPackCost]:
    """Computed (not measured) FLOPs and bytes of the padded and the packed layout."""
    check_int("heads", heads, min=1)
    check_int("head_dim", head_dim, min=1)
    if convention not in F.ATTENTION_CONVENTIONS:
        raise ConfigError("convention", convention, "one of " + ", ".join(map(repr, F.ATTENTION_CONVENTIONS)))
    elt = torch.empty((), dtype=dtype).element_size()
    useful = heads * sum(n * n for n in batch.lengths)
    padded_pairs = heads * batch.batch * batch.max_len**2
    out = []
    for layout, tokens, pairs, scores in (
        ("padded", batch.batch * batch.max_len, padded_pairs, padded_pairs * 4),
        ("packed", batch.total, useful, heads * max(batch.lengths) ** 2 * 4),
    ):
        fwd = F.attention_flops(1, 1, 1, 1, head_dim, pairs=pairs, direction="fwd", convention=convention)
        bwd = F.attention_flops(1, 1, 1, 1, head_dim, pairs=pairs, direction="bwd", convention=convention)
        act = 4 * tokens * heads * head_dim * elt
        out.append(PadPackCost(layout, tokens, pairs, fwd, bwd, useful / pairs, act, scores, convention))
    return out


def make_inputs(
    batch: VarlenBatch,
    heads: int,
    head_dim: int,
    *,
    dtype=torch.float32,
    device="cpu",
    seed: int = 0,
    requires_grad: bool = False,
) -> dict:
    """The same random tokens in both layouts: packed (T, H, Dh) + cu_seqlens, and padded
    (B, H, Lmax, Dh) with zeros after each sequence and a (B, 1, 1, Lmax) key mask."""
    g = torch.Generator().manual_seed(seed)
    T, B, L = batch.total, batch.batch, batch.max_len
    packed = [torch.randn(T, heads, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(3)]
    padded = [torch.zeros(B, heads, L, head_dim, device=device, dtype=dtype) for _ in range(3)]
    cu = batch.cu_seqlens(device)
    keys = torch.zeros(B, L, dtype=torch.bool, device=device)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for p, x in zip(padded, packed):
            p[i, :, : e - s] = x[s:e].transpose(0, 1)
        keys[i, : e - s] = True
    for t in (*packed, *padded):
        t.requires_grad_(requires_grad)
    return dict(packed=packed, padded=padded, cu_seqlens=cu, key_mask=keys[:, None, None, :])


def unpad(x: torch.Tensor, batch: VarlenBatch) -> torch.Tensor:
    """(B, H, Lmax, Dh) -> (T, H, Dh): the valid rows of each sequence, packed."""
    return torch.cat([x[i, :, :n].transpose(0, 1) for i, n in enumerate(batch.lengths)], 0)


#: how padding and packing are timed unless asked otherwise
PAD_PACK_BENCH = BenchOptions(reps=5, budget_s=20.0)


def time_padding_vs_packing(
    batch: VarlenBatch,
    heads: int,
    head_dim: int,
    *,
    paths,
    dtype=torch.float32,
    session: Session | None = None,
    backward: bool = False,
    bench: BenchOptions = PAD_PACK_BENCH,
) -> list[dict]:
    """Time each path on the padded (key-padding mask) and the packed layout of one batch,
    on ``session.device`` (default: CPU), measured as ``bench`` says.  TFLOP/s are *useful*
    (packed) FLOPs / time for both, so padding's waste shows as a lower rate.  Paths that
    cannot run a layout, or cannot be timed here (Triton on CPU), give a row with the
    reason.  With ``session.rec`` every timing is recorded (against ``session.ceilings``)."""
    session = session or Session()
    device, rec, ceilings = session.device, session.rec, session.ceilings
    costs = {c.layout: c for c in pad_pack_costs(batch, heads, head_dim, dtype)}
    useful = costs["packed"].fwd_flops + (costs["packed"].bwd_flops if backward else 0.0)
    inp = make_inputs(batch, heads, head_dim, dtype=dtype, device=device, requires_grad=backward)
    rows = []
    shape = f"B{batch.batch}xH{heads}xLmax{batch.max_len}xT{batch.total}xD{head_dim}"
    for path in paths:
        p = get_path(path)
        for layout in ("padded", "packed"):
            if layout == "padded":
                args, kw = inp["padded"], dict(mask=inp["key_mask"])
                why = p.why_not(
                    device=device, dtype=dtype, mask="custom", layout="bhld", head_dim=head_dim, backward=backward
                )
            else:
                args, kw = inp["packed"], dict(cu_seqlens=inp["cu_seqlens"], max_seqlen=batch.max_len)
                why = p.why_not(
                    device=device, dtype=dtype, mask="full", layout="packed", head_dim=head_dim, backward=backward
                )
            if why is None and p.kind == "triton" and torch.device(device).type == "cpu":
                why = "Triton runs through the interpreter on CPU: correctness only, never timed"
            row = dict(
                path=path,
                layout=layout,
                shape=shape,
                **{
                    k: getattr(costs[layout], k)
                    for k in ("tokens", "pairs", "fwd_flops", "useful_fraction", "activation_bytes", "score_bytes")
                },
            )
            if why:
                rows.append({**row, "time_ms": math.nan, "note": why})
                continue

            def fn(args=args, kw=kw, path=path):
                o = attend(*args, path=path, **kw)
                if backward:
                    torch.autograd.grad(o, args, torch.ones_like(o))
                return o

            t = try_bench(fn, bench, name=f"{path}/{layout}", device=device)
            if rec is not None:
                rec.add_timing(
                    "pad_vs_pack",
                    f"{path}/{layout}",
                    t,
                    shape=shape,
                    dtype=dtype,
                    flops=useful,
                    ceilings=ceilings,
                    direction="fwd+bwd" if backward else "fwd",
                    computed_pairs=costs[layout].pairs,
                    useful_fraction=costs[layout].useful_fraction,
                    flop_convention=costs[layout].convention,
                )
            ok = getattr(t, "ok", False)
            rows.append(
                {
                    **row,
                    "time_ms": t.median_ms if ok else math.nan,
                    "useful_tflops": useful / (t.median_ms * 1e-3) / 1e12 if ok else math.nan,
                    "note": "" if ok else f"{t.kind}: {t.reason}",
                }
            )
    return rows
