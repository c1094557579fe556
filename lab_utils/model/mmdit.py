"""A FLUX-style MMDiT (rectified-flow diffusion transformer), built from config.

Design note
-----------
The model follows Black Forest Labs' FLUX layout: text and image tokens go through
``depth_double`` double-stream blocks (separate weights per stream, one joint
attention over ``cat([txt, img])``), then ``depth_single`` single-stream blocks over
the concatenated sequence (one fused input projection feeding attention *and* the MLP
in parallel), then an adaLN final layer.  Everything is conditioned on ``vec`` =
timestep MLP + (guidance MLP) + pooled-text MLP via adaLN modulation (shift, scale,
gate).  Positions are 3-axis RoPE over (t, h, w) ids; queries and keys are RMS-normed
per head before RoPE.  The seams (attention path, fused-op kernels, precision recipe,
activation checkpointing) are fields of :class:`~lab_utils.model.config.MMDiTConfig`.

Every block runs inside a named range (``double_blocks.3``), visible in the torch
profiler and, on CUDA, in Nsight Systems (NVTX).

Faithfulness: ``lab_utils.model.diffusers`` maps diffusers' ``FluxTransformer2DModel``
weights onto this layout; ``tests/unit/model/test_mmdit.py`` checks both compute the same at float32.
"""

from __future__ import annotations

import torch
from torch import nn

from lab_utils.core.config import ConfigError
from lab_utils.core.device import annotate
from lab_utils.model.checkpointing import ACTIVATION_CHECKPOINTS
from lab_utils.model.config import MMDiTConfig, resolve_config
from lab_utils.model.layers import (
    DoubleStreamBlock,
    FinalLayer,
    KernelSet,
    MLPEmbedder,
    RoPE3D,
    Seams,
    SingleStreamBlock,
    timestep_embedding,
)
from lab_utils.precision.quantized import apply_recipe


class MMDiT(nn.Module):
    """FLUX-style MMDiT.  ``forward(img, img_ids, txt, txt_ids, timesteps, y, guidance=None)``
    in FLUX's calling convention:

    * img: packed latent tokens (B, L_img, in_channels); img_ids (L_img, 3) or (B, L_img, 3)
    * txt: T5 states (B, L_txt, context_dim); txt_ids (L_txt, 3) or (B, L_txt, 3)
    * timesteps (B,) in [0, 1]; y: pooled CLIP (B, pooled_dim); guidance (B,) or None
    * txt_mask (optional, B x L_txt bool, True = real token) masks padded caption keys.

    Returns the predicted velocity, (B, L_img, in_channels).
    """

    def __init__(self, cfg: MMDiTConfig, *, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.ops = KernelSet(cfg.kernels, device=device, dtype=dtype)
        self.seams = Seams.from_config(cfg, self.ops)
        d = cfg.hidden_size
        self.img_in = nn.Linear(cfg.in_channels, d)
        self.txt_in = nn.Linear(cfg.context_dim, d)
        self.time_in = MLPEmbedder(256, d)
        self.vector_in = MLPEmbedder(cfg.pooled_dim, d)
        self.guidance_in = MLPEmbedder(256, d) if cfg.guidance_embed else None
        self.pe_embedder = RoPE3D(cfg.axes_dim, cfg.theta)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg, self.seams) for _ in range(cfg.depth_double))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(cfg, self.seams) for _ in range(cfg.depth_single))
        self.final_layer = FinalLayer(cfg, self.seams)
        # the activation-checkpointing policy is applied from outside, once (build_model)
        self.activation_checkpoint = ACTIVATION_CHECKPOINTS["none"]
        self.block_runners: dict[tuple[str, int], object] = {}

    # -- helpers ---------------------------------------------------------------------
    def blocks(self) -> list[nn.Module]:
        return [*self.double_blocks, *self.single_blocks]

    def _runner(self, block, kind: str, index: int, active: bool):
        """The block's runner under the applied policy (the block itself in eval / no-grad)."""
        return self.block_runners.get((kind, index), block) if active else block

    def conditioning(self, timesteps, y, guidance=None):
        """vec (B, D) = time MLP + guidance MLP + pooled-text MLP."""
        dt = self.img_in.weight.dtype
        vec = self.time_in(timestep_embedding(timesteps, 256).to(dt))
        if self.guidance_in is not None:
            if guidance is None:
                raise ConfigError(
                    "guidance", None, f"a (B,) guidance tensor: preset {self.cfg.preset!r} has guidance_embed=True"
                )
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(dt))
        return vec + self.vector_in(y)

    def forward(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None, txt_mask=None):
        if img.dim() != 3 or img.shape[-1] != self.cfg.in_channels:
            raise ConfigError("img", tuple(img.shape), f"(B, L_img, in_channels={self.cfg.in_channels})")
        if txt.dim() != 3 or txt.shape[-1] != self.cfg.context_dim:
            raise ConfigError("txt", tuple(txt.shape), f"(B, L_txt, context_dim={self.cfg.context_dim})")
        img = self.img_in(img)
        vec = self.conditioning(timesteps, y, guidance)
        txt = self.txt_in(txt)
        ids = torch.cat([txt_ids, img_ids], dim=-2)
        pe = self.pe_embedder(ids)
        mask = None
        if txt_mask is not None:
            b, lt, li = txt.shape[0], txt.shape[1], img.shape[1]
            keys = torch.cat([txt_mask.bool(), torch.ones(b, li, dtype=torch.bool, device=txt_mask.device)], 1)
            mask = keys[:, None, None, :]  # B 1 1 Lt+Li
        active = self.training and torch.is_grad_enabled()
        for i, blk in enumerate(self.double_blocks):
            with annotate(f"double_blocks.{i}", img.device):
                img, txt = self._runner(blk, "double", i, active)(img, txt, vec, pe, mask)
        lt = txt.shape[1]
        x = torch.cat([txt, img], dim=1)
        for i, blk in enumerate(self.single_blocks):
            with annotate(f"single_blocks.{i}", x.device):
                x = self._runner(blk, "single", i, active)(x, vec, pe, mask)
        return self.final_layer(x[:, lt:], vec)


def build_model(
    cfg_or_preset: MMDiTConfig | str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    seed: int | None = 0,
    **overrides,
) -> MMDiT:
    """Build an :class:`MMDiT` from a preset name or config (``overrides`` replace fields).

    ``device="meta"`` allocates nothing (parameter, FLOP and memory accounting of
    ``flux-dev`` and friends here).  Weights are random (FLUX-like init: Linear
    defaults, zero-initialised adaLN modulation outputs would make a fresh model the
    identity, so we keep them random so gradients reach every weight from step 0).
    The precision ``recipe`` is applied after building when it is not "bf16"; the
    activation-checkpointing policy is applied last, once (``policy.apply(model)``)."""
    cfg = resolve_config(cfg_or_preset, **overrides)
    dev = torch.device(device)
    if seed is not None and dev.type != "meta":
        torch.manual_seed(seed)
    with torch.device(dev):
        model = MMDiT(cfg, device=dev, dtype=dtype)
    model = model.to(dtype=dtype)
    if cfg.recipe != "bf16":
        model = apply_recipe(model, cfg.recipe)
    ACTIVATION_CHECKPOINTS[cfg.activation_checkpoint].apply(model)
    return model
