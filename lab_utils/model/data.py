"""Synthetic image-caption data with aspect-ratio buckets, served by a real DataLoader.

Design note: what matters for a training step's profile is the *shape* of the data
path, not the pixels: images of several resolutions (aspect-ratio buckets; one
bucket per batch so tensors stack), captions of variable length (padded per batch to
the longest, or to a fixed length like FLUX's 512 T5 tokens), decoding work in
loader workers, pinned host memory and prefetching.  Items are generated
deterministically from (seed, index), so a batch is reproducible in any worker.

Two item kinds:

* :class:`SyntheticImageCaptions`: pixels (3, H, W) in [-1, 1], T5 token ids of the
  caption's length, 77 CLIP token ids (BOS, tokens, EOS, padding);
* :class:`CachedLatents`: precomputed VAE latents, T5 states and pooled CLIP vectors
  (``lab_utils.model.encoders.precompute`` builds it), as real runs cache them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from lab_utils.attention.varlen import normalize_buckets
from lab_utils.core.config import ConfigError, check_int

CLIP_LEN = 77
T5_PAD, T5_EOS = 0, 1


class SyntheticImageCaptions(Dataset):
    """``n`` image-caption pairs; item i has a bucket, a caption length and content drawn
    from (seed, i).  Pixels are smooth random fields (low-res noise, bilinear upsampled)."""

    def __init__(
        self,
        n: int,
        buckets,
        *,
        min_caption_len: int = 8,
        max_caption_len: int = 64,
        vocab_size: int = 512,
        clip_bos: int | None = None,
        clip_eos: int | None = None,
        seed: int = 0,
    ):
        check_int("num_samples", n, min=1)
        self.buckets = normalize_buckets(buckets)
        check_int("min_caption_len", min_caption_len, min=1)
        check_int("max_caption_len", max_caption_len, min=min_caption_len)
        check_int("vocab_size", vocab_size, min=8)
        self.n, self.seed, self.vocab_size = n, seed, vocab_size
        self.min_len, self.max_len = min_caption_len, max_caption_len
        self.clip_bos = vocab_size - 2 if clip_bos is None else clip_bos
        self.clip_eos = vocab_size - 1 if clip_eos is None else clip_eos
        g = torch.Generator().manual_seed(seed)
        self._bucket = torch.randint(len(self.buckets), (n,), generator=g).tolist()
        self._len = torch.randint(min_caption_len, max_caption_len + 1, (n,), generator=g).tolist()

    def __len__(self) -> int:
        return self.n

    def bucket_of(self, i: int) -> int:
        return self._bucket[i]

    def caption_len(self, i: int) -> int:
        return self._len[i]

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        h, w = self.buckets[self._bucket[i]]
        low = torch.rand(1, 3, max(h // 16, 1), max(w // 16, 1), generator=g) * 2 - 1
        pixels = F.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)[0]  # 3 H W
        n = self._len[i]
        words = torch.randint(2, self.vocab_size - 2, (n,), generator=g)
        t5_ids = torch.cat([words[: n - 1], torch.tensor([T5_EOS])])  # n
        clip_words = words[: CLIP_LEN - 2]
        clip_ids = torch.zeros(CLIP_LEN, dtype=torch.long)
        clip_ids[0] = self.clip_bos
        clip_ids[1 : 1 + len(clip_words)] = clip_words
        clip_ids[1 + len(clip_words)] = self.clip_eos
        return dict(index=i, bucket=self._bucket[i], pixels=pixels, t5_ids=t5_ids, clip_ids=clip_ids)

    def batches(self, batch_size: int) -> list[list[int]]:
        """Deterministic, unshuffled bucket-pure batches (for precomputing)."""
        return BucketBatchSampler(self._bucket, batch_size, shuffle=False, drop_last=False).batches(0)


class CachedLatents(Dataset):
    """Precomputed latents (C, h, w), T5 states (L_i, context_dim) and pooled y (pooled_dim)."""

    def __init__(self, items: Sequence[dict], bucket_of: Sequence[int], buckets):
        self.items, self._bucket, self.buckets = list(items), list(bucket_of), list(buckets)

    def __len__(self) -> int:
        return len(self.items)

    def bucket_of(self, i: int) -> int:
        return self._bucket[i]

    def __getitem__(self, i: int) -> dict:
        return {**self.items[i], "index": i, "bucket": self._bucket[i]}


class BucketBatchSampler(Sampler):
    """Batches whose items share one bucket (so images stack).  Shuffles within buckets and
    the order of batches per epoch (seed + epoch); ``drop_last`` drops ragged tails."""

    def __init__(
        self, bucket_of: Sequence[int], batch_size: int, *, shuffle: bool = True, drop_last: bool = True, seed: int = 0
    ):
        check_int("batch_size", batch_size, min=1)
        self.bucket_of, self.batch_size = list(bucket_of), batch_size
        self.shuffle, self.drop_last, self.seed, self.epoch = shuffle, drop_last, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self, epoch: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + epoch)
        groups: dict[int, list[int]] = {}
        for i, b in enumerate(self.bucket_of):
            groups.setdefault(b, []).append(i)
        out = []
        for b in sorted(groups):
            idx = groups[b]
            if self.shuffle:
                rng.shuffle(idx)
            for s in range(0, len(idx), self.batch_size):
                chunk = idx[s : s + self.batch_size]
                if len(chunk) == self.batch_size or not self.drop_last:
                    out.append(chunk)
        if self.shuffle:
            rng.shuffle(out)
        return out

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches(self.epoch)

    def __len__(self) -> int:
        return len(self.batches(self.epoch))


def _pad_stack(seqs: list[torch.Tensor], pad_to: int | None, value: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (L_i, ...) tensors to a common length; returns (B, L, ...) and a (B, L) mask."""
    longest = max(s.shape[0] for s in seqs)
    length = longest if pad_to is None else pad_to
    if length < longest:
        seqs = [s[:length] for s in seqs]
    out = seqs[0].new_full((len(seqs), length, *seqs[0].shape[1:]), value)
    mask = torch.zeros(len(seqs), length, dtype=torch.bool)
    for j, s in enumerate(seqs):
        out[j, : s.shape[0]] = s
        mask[j, : s.shape[0]] = True
    return out, mask


def collate(items: list[dict], pad_to: int | None = None) -> dict:
    """Stack one bucket's items.  Captions pad to the longest in the batch (``pad_to=None``)
    or to a fixed length (FLUX pads T5 to 512); the mask is True on real tokens."""
    if len({it["bucket"] for it in items}) != 1:
        raise ValueError("collate expects one bucket per batch; use BucketBatchSampler")
    out = {"index": torch.tensor([it["index"] for it in items]), "bucket": items[0]["bucket"]}
    if "pixels" in items[0]:
        out["pixels"] = torch.stack([it["pixels"] for it in items])
        out["t5_ids"], out["t5_mask"] = _pad_stack([it["t5_ids"] for it in items], pad_to, T5_PAD)
        out["clip_ids"] = torch.stack([it["clip_ids"] for it in items])
    else:
        out["latents"] = torch.stack([it["latents"] for it in items])
        out["txt"], out["t5_mask"] = _pad_stack([it["txt"] for it in items], pad_to, 0.0)
        out["y"] = torch.stack([it["y"] for it in items])
    return out


def make_loader(
    dataset,
    batch_size: int,
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int = 2,
    pad_to: int | None = None,
    shuffle: bool = True,
    drop_last: bool = True,
    seed: int = 0,
) -> DataLoader:
    """A ``torch.utils.data.DataLoader`` over bucket-pure batches."""
    check_int("batch_size", batch_size, min=1)
    check_int("num_workers", num_workers, min=0)
    check_int("prefetch_factor", prefetch_factor, min=1)
    sampler = BucketBatchSampler(
        [dataset.bucket_of(i) for i in range(len(dataset))], batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed
    )
    if len(sampler) == 0:
        raise ConfigError(
            "batch_size", batch_size, f"a size that fills at least one batch from {len(dataset)} samples in one bucket"
        )
    kw = dict(prefetch_factor=prefetch_factor, persistent_workers=True) if num_workers > 0 else {}
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=partial(collate, pad_to=pad_to),
        num_workers=num_workers,
        pin_memory=pin_memory,
        **kw,
    )


def forever(loader: DataLoader) -> Iterator[dict]:
    """Iterate a loader across epochs (the sampler reshuffles per epoch)."""
    epoch = 0
    while True:
        if hasattr(loader.batch_sampler, "set_epoch"):
            loader.batch_sampler.set_epoch(epoch)
        yield from loader
        epoch += 1
