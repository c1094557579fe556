"""perflab's own MMDiT as a step factory: the default of every lab's ``step`` parameter.

The batch mirrors lab 01's trainer with precomputed encoders: inside ``data_loading`` the
text embeddings are drawn (``text_encoding``) and the latents drawn and packed into tokens
(``image_encoding``); the loss is :func:`lab_utils.model.train.rf_loss`, the rectified-flow
objective every MMDiT lab trains."""

from __future__ import annotations

import torch
from torch.profiler import record_function

from lab_utils.core.config import check_int
from lab_utils.model import build_model, resolve_config
from lab_utils.model.layers import image_ids, patchify, text_ids
from lab_utils.model.train import Batch, rf_loss
from lab_utils.step.contract import StepFactory

#: The default factory's step: the tiny preset, 64 x 64 px, 8 text tokens.
MMDIT_DEFAULTS = dict(preset="tiny", height=64, width=64, txt_len=8)


def mmdit_factory(
    preset: str = "tiny",
    *,
    batch_size: int = 2,
    height: int = 64,
    width: int = 64,
    txt_len: int = 8,
    device="cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> StepFactory:
    """The MMDiT of ``preset`` at one step shape, AdamW (lr 1e-4), rectified-flow loss."""
    cfg = resolve_config(preset)
    check_int("batch_size", batch_size, min=1)
    check_int("txt_len", txt_len, min=1)
    h, w = cfg.check_resolution(height, width)
    dev = torch.device(device)
    model = build_model(cfg, device=dev, dtype=dtype, seed=seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    p = cfg.patch_size

    def make_batch(k: int) -> Batch:
        g = torch.Generator().manual_seed(seed * 1_000_003 + k)
        with record_function("text_encoding"):
            txt = torch.randn(batch_size, txt_len, cfg.context_dim, generator=g).to(dev, dtype)
            y = torch.randn(batch_size, cfg.pooled_dim, generator=g).to(dev, dtype)
        with record_function("image_encoding"):
            lat = torch.randn(batch_size, cfg.latent_channels, h * p, w * p, generator=g).to(dev, dtype)
            img = patchify(lat, p)
        guidance = torch.full((batch_size,), 3.5, device=dev) if cfg.guidance_embed else None
        return Batch(img, image_ids(h, w, dev), txt, text_ids(txt_len, dev), y, guidance, None, (h, w))

    def loss(m, batch: Batch) -> torch.Tensor:
        g = torch.Generator(device=dev).manual_seed(seed)
        return rf_loss(m, batch, g)

    return StepFactory(
        model,
        opt,
        make_batch,
        loss,
        block_class=None,
        phases=("text_encoding", "image_encoding"),
        config=cfg,
    )


def mmdit_step(device="cpu", dtype: torch.dtype = torch.float32, batch_size: int = 2, seed: int = 0) -> StepFactory:
    """The default ``step``: perflab's tiny MMDiT at 64 x 64 px and 8 text tokens."""
    return mmdit_factory(**MMDIT_DEFAULTS, batch_size=batch_size, device=device, dtype=dtype, seed=seed)
