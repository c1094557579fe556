"""Frozen T5 / CLIP / VAE built from configs (random weights, no downloads) and the cache mode."""

from __future__ import annotations

import pytest
import torch

from lab_utils.core.checks import assert_close
from lab_utils.model.data import SyntheticImageCaptions, collate
from lab_utils.model.encoders import Encoders, precompute, text_vocab


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    return Encoders("tiny")


def test_shapes_and_frozen(tiny):
    cfg = tiny.cfg
    ds = SyntheticImageCaptions(6, [[48, 80]], max_caption_len=13, seed=1, **text_vocab(cfg))
    b = collate([ds[i] for i in range(3)])
    emb = tiny.encode_text(b["t5_ids"], b["t5_mask"], b["clip_ids"])
    assert emb.txt.shape == (3, b["t5_ids"].shape[1], cfg.context_dim)
    assert emb.y.shape == (3, cfg.pooled_dim)
    lat = tiny.encode_image(b["pixels"])
    assert lat.shape == (3, cfg.latent_channels, 48 // 8, 80 // 8)
    assert torch.isfinite(lat).all() and torch.isfinite(emb.txt).all()
    assert not any(p.requires_grad for p in tiny.parameters())


def test_padding_does_not_change_real_token_states(tiny):
    ds = SyntheticImageCaptions(8, [[32, 32]], min_caption_len=3, max_caption_len=30, seed=2, **text_vocab(tiny.cfg))
    short = min(range(8), key=ds.caption_len)
    alone = collate([ds[short]])
    padded = collate([ds[short]], pad_to=40)
    a = tiny.encode_text(alone["t5_ids"], alone["t5_mask"], alone["clip_ids"])
    b = tiny.encode_text(padded["t5_ids"], padded["t5_mask"], padded["clip_ids"])
    n = ds.caption_len(short)
    assert_close(b.txt[:, :n], a.txt[:, :n], dtype=torch.float32, name="T5 states under padding")
    assert_close(b.y, a.y, dtype=torch.float32, name="CLIP pooled")


def test_precompute_caches_text_states(tiny):
    ds = SyntheticImageCaptions(5, [[32, 32], [32, 48]], max_caption_len=10, seed=3, **text_vocab(tiny.cfg))
    cache = precompute(ds, tiny, batch_size=2)
    assert len(cache) == 5
    for i in range(5):
        it = cache[i]
        h, w = ds.buckets[ds.bucket_of(i)]
        assert it["latents"].shape == (tiny.cfg.latent_channels, h // 8, w // 8)
        assert it["txt"].shape == (ds.caption_len(i), tiny.cfg.context_dim)
        one = collate([ds[i]])
        ref = tiny.encode_text(one["t5_ids"], one["t5_mask"], one["clip_ids"])
        assert_close(it["txt"], ref.txt[0], dtype=torch.float32, name=f"cached txt {i}")
        assert_close(it["y"], ref.y[0], dtype=torch.float32, name=f"cached y {i}")


def test_flux_sized_encoders_on_meta():
    enc = Encoders("flux-dev", device="meta")
    counts = enc.param_counts()
    assert 4.7e9 < counts["t5"] < 4.8e9  # T5-v1.1-XXL encoder
    assert 1.2e8 < counts["clip"] < 1.25e8  # CLIP ViT-L/14 text tower
    assert 8.0e7 < counts["vae"] < 8.8e7  # FLUX.1 autoencoder
    assert enc.vae.config.latent_channels == 16
