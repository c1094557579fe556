"""Synthetic image-caption data: buckets, caption lengths, the DataLoader."""

from __future__ import annotations

import pytest
import torch

from lab_utils.core.checks import assert_close
from lab_utils.core.config import ConfigError
from lab_utils.model.data import (
    BucketBatchSampler,
    SyntheticImageCaptions,
    collate,
    forever,
    make_loader,
    normalize_buckets,
)

BUCKETS = [[64, 64], [48, 96], [96, 48]]


def test_items_are_deterministic_and_shaped():
    ds = SyntheticImageCaptions(20, BUCKETS, min_caption_len=3, max_caption_len=11, vocab_size=300, seed=5)
    again = SyntheticImageCaptions(20, BUCKETS, min_caption_len=3, max_caption_len=11, vocab_size=300, seed=5)
    lens = set()
    for i in range(20):
        a, b = ds[i], again[i]
        assert torch.equal(a["pixels"], b["pixels"]) and torch.equal(a["t5_ids"], b["t5_ids"])
        h, w = BUCKETS[a["bucket"]]
        assert a["pixels"].shape == (3, h, w)
        assert a["pixels"].abs().max() <= 1
        assert 3 <= len(a["t5_ids"]) <= 11 and a["t5_ids"][-1] == 1  # T5 EOS
        assert a["clip_ids"].shape == (77,) and a["clip_ids"][0] == 298  # CLIP BOS = vocab-2
        assert (a["clip_ids"] == 299).sum() == 1  # one EOS
        lens.add(len(a["t5_ids"]))
    assert len(lens) > 3  # lengths vary


def test_batches_are_bucket_pure_and_cover_the_epoch():
    ds = SyntheticImageCaptions(31, BUCKETS, seed=1)
    s = BucketBatchSampler([ds.bucket_of(i) for i in range(31)], 4, drop_last=False, seed=2)
    seen = []
    for b in s:
        assert len({ds.bucket_of(i) for i in b}) == 1
        seen += b
    assert sorted(seen) == list(range(31))
    s.set_epoch(1)
    assert list(s) != s.batches(0)  # reshuffled per epoch


def test_collate_pads_captions_with_mask():
    ds = SyntheticImageCaptions(12, [[32, 32]], min_caption_len=2, max_caption_len=9, seed=3)
    items = [ds[i] for i in range(4)]
    b = collate(items)
    longest = max(len(it["t5_ids"]) for it in items)
    assert b["t5_ids"].shape == (4, longest)
    assert b["t5_mask"].sum(1).tolist() == [len(it["t5_ids"]) for it in items]
    assert (b["t5_ids"][~b["t5_mask"]] == 0).all()
    fixed = collate(items, pad_to=16)
    assert fixed["t5_ids"].shape == (4, 16)


def test_dataloader_with_workers_matches_in_process():
    ds = SyntheticImageCaptions(16, BUCKETS, max_caption_len=20, seed=4)
    a = list(make_loader(ds, 2, num_workers=0, seed=9))
    b = list(make_loader(ds, 2, num_workers=2, prefetch_factor=3, pin_memory=False, seed=9))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert torch.equal(x["index"], y["index"])
        # workers run single-threaded: interpolation may round differently in the last bit
        assert_close(y["pixels"], x["pixels"], dtype=torch.float32, name="pixels from a worker")
        assert torch.equal(x["t5_ids"], y["t5_ids"])
    it = forever(make_loader(ds, 4, seed=9))
    assert len([next(it) for _ in range(3 * len(a))]) == 3 * len(a)  # crosses epochs


@pytest.mark.parametrize("bad", [[], "64", [[64]], [[64, -8]], [[64, 64.0]]])
def test_bad_buckets(bad):
    with pytest.raises(ConfigError) as e:
        normalize_buckets(bad)
    assert e.value.param == "buckets"


def test_bad_batch_size_and_workers():
    ds = SyntheticImageCaptions(4, [[32, 32]])
    with pytest.raises(ConfigError) as e:
        make_loader(ds, 0)
    assert e.value.param == "batch_size"
    with pytest.raises(ConfigError) as e:
        make_loader(ds, 8)  # cannot fill one batch with drop_last
    assert e.value.param == "batch_size"
    with pytest.raises(ConfigError) as e:
        make_loader(ds, 2, num_workers=-1)
    assert e.value.param == "num_workers"
