"""Frozen text and image encoders of a FLUX-style training run, built from configs.

Design note: the architectures are the real ones (transformers' ``T5EncoderModel`` and
``CLIPTextModel``, diffusers' ``AutoencoderKL``) built from configs with random
weights: nothing is downloaded at run time, so the step costs what a real step
costs while the numbers the encoders produce are meaningless as semantics.  Sizes
follow the MMDiT preset: the T5 hidden size is the model's ``context_dim``, CLIP's
pooled output is ``pooled_dim`` and the VAE's latent channels / downsampling are
``latent_channels`` / ``vae_downsample``.  ``flux-dev`` gets T5-XXL, CLIP-L and
FLUX's 16-channel AE (build those on ``device="meta"`` here).

Tokenizers are not used: the synthetic dataset (``lab_utils.model.data``) serves token
ids directly.  ``precompute`` runs the encoders once over a dataset and caches
latents and embeddings, the mode real runs often use.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from lab_utils.core.config import ConfigError
from lab_utils.model.config import MMDiTConfig, resolve_config
from lab_utils.model.data import CachedLatents, collate
from lab_utils.model.layers import patchify

#: Encoder shapes per MMDiT preset (T5 d_model == context_dim, CLIP hidden == pooled_dim).
ENCODER_PRESETS: dict[str, dict] = {
    "tiny": dict(
        t5=dict(d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=512),
        clip=dict(intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, vocab_size=512),
        vae=dict(block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=4),
    ),
    "small": dict(
        t5=dict(d_ff=1024, num_layers=4, num_heads=8, d_kv=64, vocab_size=32128),
        clip=dict(intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, vocab_size=49408),
        vae=dict(block_out_channels=(32, 64, 128, 128), layers_per_block=1, norm_num_groups=32),
    ),
    # T5-v1.1-XXL encoder, CLIP ViT-L/14 text tower, FLUX.1 autoencoder.
    "flux": dict(
        t5=dict(d_ff=10240, num_layers=24, num_heads=64, d_kv=64, vocab_size=32128),
        clip=dict(intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, vocab_size=49408),
        vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32),
    ),
}
_PRESET_ENCODERS = {"tiny": "tiny", "small": "small", "medium": "flux", "flux-dev": "flux", "flux-schnell": "flux"}

CLIP_LEN = 77
#: FLUX.1 autoencoder latent normalisation (diffusers' vae config of FLUX.1-dev).
FLUX_VAE_SCALE, FLUX_VAE_SHIFT = 0.3611, 0.1159


def encoder_preset(cfg: MMDiTConfig) -> dict:
    name = _PRESET_ENCODERS.get(cfg.preset)
    if name is None:
        # a custom config: pick the closest size class by hidden width
        name = "tiny" if cfg.hidden_size <= 128 else ("small" if cfg.hidden_size <= 512 else "flux")
    return ENCODER_PRESETS[name]


def build_t5(cfg: MMDiTConfig, device="cpu", dtype=torch.float32) -> nn.Module:
    from transformers import T5Config, T5EncoderModel  # noqa: PLC0415  (seconds to import; absent on bare GPU machines)

    p = encoder_preset(cfg)["t5"]
    tcfg = T5Config(
        d_model=cfg.context_dim,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        dropout_rate=0.0,
        **p,
    )
    with torch.device(device):
        return T5EncoderModel(tcfg).to(dtype).eval().requires_grad_(False)


def build_clip(cfg: MMDiTConfig, device="cpu", dtype=torch.float32) -> nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel  # noqa: PLC0415  (optional, heavy: see build_t5)

    p = encoder_preset(cfg)["clip"]
    ccfg = CLIPTextConfig(
        hidden_size=cfg.pooled_dim,
        max_position_embeddings=CLIP_LEN,
        hidden_act="quick_gelu",
        projection_dim=cfg.pooled_dim,
        pad_token_id=0,
        bos_token_id=p["vocab_size"] - 2,
        eos_token_id=p["vocab_size"] - 1,
        **p,
    )
    with torch.device(device):
        return CLIPTextModel(ccfg).to(dtype).eval().requires_grad_(False)


def build_vae(cfg: MMDiTConfig, device="cpu", dtype=torch.float32) -> nn.Module:
    from diffusers import AutoencoderKL  # noqa: PLC0415  (optional, heavy: see build_t5)

    p = dict(encoder_preset(cfg)["vae"])
    boc = tuple(p.pop("block_out_channels"))
    levels = cfg.vae_downsample.bit_length() - 1
    if 2**levels != cfg.vae_downsample:
        raise ConfigError("vae_downsample", cfg.vae_downsample, "a power of two")
    boc = (boc + (boc[-1],) * levels)[: levels + 1]
    with torch.device(device):
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            latent_channels=cfg.latent_channels,
            block_out_channels=boc,
            down_block_types=("DownEncoderBlock2D",) * len(boc),
            up_block_types=("UpDecoderBlock2D",) * len(boc),
            use_quant_conv=False,
            use_post_quant_conv=False,
            scaling_factor=FLUX_VAE_SCALE,
            shift_factor=FLUX_VAE_SHIFT,
            **p,
        )
    if dtype != torch.float32:
        vae = vae.to(dtype)
    return vae.eval().requires_grad_(False)


def text_vocab(cfg: MMDiTConfig) -> dict:
    """Token-id space the synthetic captions may use with these encoders: ids in
    [2, vocab_size - 2) fit both T5 and CLIP; CLIP's BOS/EOS are its last two ids
    (49406/49407 for CLIP-L)."""
    p = encoder_preset(cfg)
    clip_vocab = p["clip"]["vocab_size"]
    return dict(vocab_size=min(p["t5"]["vocab_size"], clip_vocab), clip_bos=clip_vocab - 2, clip_eos=clip_vocab - 1)


@dataclass
class TextEmbeddings:
    txt: torch.Tensor  # B L_txt context_dim (T5 last hidden state)
    y: torch.Tensor  # B pooled_dim (CLIP pooled output)
    txt_mask: torch.Tensor | None


class Encoders(nn.Module):
    """T5 + CLIP + VAE, frozen.  ``encode_text`` and ``encode_image`` run under no_grad."""

    def __init__(
        self,
        cfg_or_preset: MMDiTConfig | str,
        device="cpu",
        dtype=torch.float32,
        *,
        seed: int = 0,
        with_vae: bool = True,
    ):
        super().__init__()
        self.cfg = resolve_config(cfg_or_preset)
        dev = torch.device(device)
        if dev.type != "meta":
            torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.t5 = build_t5(self.cfg, dev, dtype)
            self.clip = build_clip(self.cfg, dev, dtype)
            self.vae = build_vae(self.cfg, dev, dtype) if with_vae else None

    def param_counts(self) -> dict[str, int]:
        out = {
            "t5": sum(p.numel() for p in self.t5.parameters()),
            "clip": sum(p.numel() for p in self.clip.parameters()),
        }
        if self.vae is not None:
            out["vae"] = sum(p.numel() for p in self.vae.parameters())
        return out

    @torch.no_grad()
    def encode_text(
        self, t5_ids: torch.Tensor, t5_mask: torch.Tensor | None, clip_ids: torch.Tensor, *, mask_padding: bool = True
    ) -> TextEmbeddings:
        """t5_ids (B, L) with t5_mask (B, L) True on real tokens; clip_ids (B, 77)."""
        txt = self.t5(
            input_ids=t5_ids, attention_mask=t5_mask.long() if t5_mask is not None else None
        ).last_hidden_state
        y = self.clip(input_ids=clip_ids).pooler_output
        return TextEmbeddings(txt=txt, y=y, txt_mask=t5_mask if mask_padding else None)

    @torch.no_grad()
    def encode_image(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """pixels (B, 3, H, W) in [-1, 1] -> normalised latents (B, C, H/8, W/8): (z - shift) * scale."""
        if self.vae is None:
            raise ConfigError("encoders", "precomputed", "a VAE (build Encoders with with_vae=True) to encode pixels")
        dist = self.vae.encode(pixels.to(self.vae.dtype)).latent_dist
        z = dist.sample(generator=generator)
        return (z - self.vae.config.shift_factor) * self.vae.config.scaling_factor


def precompute(
    dataset, encoders: Encoders, *, batch_size: int = 8, device="cpu", autocast_dtype: torch.dtype | None = None
):
    """Run the encoders once over ``dataset`` (a ``lab_utils.model.data.SyntheticImageCaptions``)
    and return a ``CachedLatents`` dataset holding latents, T5 states and pooled CLIP
    vectors per item (T5 states trimmed to each caption's length)."""

    items = []
    dev = torch.device(device)
    ctx = torch.autocast(dev.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    for b in dataset.batches(batch_size):
        batch = collate([dataset[i] for i in b])
        with ctx:
            emb = encoders.encode_text(batch["t5_ids"].to(dev), batch["t5_mask"].to(dev), batch["clip_ids"].to(dev))
            lat = encoders.encode_image(batch["pixels"].to(dev))
        for j, i in enumerate(b):
            n = int(batch["t5_mask"][j].sum())
            items.append(
                dict(index=i, latents=lat[j].float().cpu(), txt=emb.txt[j, :n].float().cpu(), y=emb.y[j].float().cpu())
            )
    items.sort(key=lambda d: d["index"])
    return CachedLatents(items, bucket_of=[dataset.bucket_of(d["index"]) for d in items], buckets=dataset.buckets)


def latents_to_tokens(latents: torch.Tensor, cfg: MMDiTConfig) -> torch.Tensor:
    return patchify(latents, cfg.patch_size)
