"""The MMDiT's shape and seams: :class:`MMDiTConfig`, its named presets and validation.

Four seams are chosen here so the labs swap them in one place:

* ``attention_path``: "sdpa" calls ``F.scaled_dot_product_attention``; any other
  name goes through ``lab_utils.attention.attend.attend(q, k, v, path=...)``.
* ``kernels``: the ``lab_kernels`` variant used for the fused ops (``rms_norm``,
  ``layer_norm_modulate``, ``gated_residual``, ``gelu_tanh``, ``rope``,
  ``qk_norm_rope``); a string for all ops, or a mapping ``{"default": "eager", "rope": "triton"}``.
* ``recipe``: a precision recipe of ``lab_utils.precision.quantized`` ("bf16" = no layer swapped).
* ``activation_checkpoint``: the activation-checkpointing policy (``lab_utils.model.checkpointing``),
  applied to the built model once.

A name that is not one of the known choices is a :class:`ConfigError` naming the parameter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lab_kernels import variants
from lab_utils.attention import paths as attention_paths
from lab_utils.core.config import (
    ConfigError,
    LabConfig,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_int_list,
)
from lab_utils.model.checkpointing import ACTIVATION_CHECKPOINTS
from lab_utils.precision.quantized import RECIPES

#: Named shapes.  ``tiny``/``small`` are CPU sizes; ``flux-dev``/``flux-schnell`` are the
#: released FLUX.1 transformer shapes (build them on ``device="meta"`` here).
# The fields every preset shares (FLUX's: 2x2 latent packing, 8x VAE, MLP ratio 4).
_COMMON = dict(mlp_ratio=4.0, patch_size=2, vae_downsample=8, guidance_embed=True)
# flux-dev's transformer; flux-schnell differs only in having no guidance embedder.
_FLUX = dict(
    hidden_size=3072, num_heads=24, depth_double=19, depth_single=38, latent_channels=16,
    context_dim=4096, pooled_dim=768, axes_dim=(16, 56, 56),
)  # fmt: skip

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        _COMMON, hidden_size=64, num_heads=4, depth_double=2, depth_single=2, latent_channels=4,
        context_dim=32, pooled_dim=24, axes_dim=(4, 6, 6),
    ),
    "small": dict(
        _COMMON, hidden_size=384, num_heads=6, depth_double=2, depth_single=4, latent_channels=16,
        context_dim=512, pooled_dim=256, axes_dim=(8, 28, 28),
    ),
    "medium": dict(
        _COMMON, hidden_size=1536, num_heads=12, depth_double=8, depth_single=16, latent_channels=16,
        context_dim=4096, pooled_dim=768, axes_dim=(16, 56, 56),
    ),
    "flux-schnell": dict(_COMMON, **_FLUX, guidance_embed=False),
    "flux-dev": dict(_COMMON, **_FLUX),
}  # fmt: skip

#: Presets too large to allocate on this 2-core CPU box (build on "meta").
LARGE_PRESETS = ("medium", "flux-schnell", "flux-dev")

#: The fused ops the blocks call through the kernel seam.
KERNEL_OPS = ("rms_norm", "layer_norm_modulate", "gated_residual", "gelu_tanh", "rope", "qk_norm_rope")


def kernel_map(kernels: str | Mapping[str, str]) -> dict[str, str]:
    """Normalise the ``kernels`` field to {op: variant name} for every op."""
    if isinstance(kernels, str):
        return {op: kernels for op in KERNEL_OPS}
    if isinstance(kernels, Mapping):
        default = kernels.get("default", "eager")
        return {op: kernels.get(op, default) for op in KERNEL_OPS}
    raise ConfigError("kernels", kernels, "a variant name (e.g. 'eager') or a mapping {op: variant}")


def registered_variants(op: str) -> list[str]:
    """Variant names ``lab_kernels`` registers for ``op`` (imports the op module)."""
    return [v.name for v in variants(op, include_unavailable=True)]


def _check_kernels(kernels: str | Mapping[str, str]) -> None:
    if isinstance(kernels, Mapping):
        for k in kernels:
            if k != "default" and k not in KERNEL_OPS:
                raise ConfigError(
                    "kernels",
                    dict(kernels),
                    f"a mapping whose keys are 'default' or one of {', '.join(KERNEL_OPS)} ({k!r} is not)",
                )
    for op, name in kernel_map(kernels).items():
        if not isinstance(name, str):
            raise ConfigError("kernels", kernels, "variant names as strings")
        known = registered_variants(op)
        if name not in known:
            raise ConfigError(
                "kernels",
                kernels,
                f"a variant of lab_kernels.{op}: one of {', '.join(repr(a) for a in known)} ({name!r} is not)",
            )


@dataclass(frozen=True)
class MMDiTConfig(LabConfig):
    """Shape and seams of one MMDiT.  Build with ``MMDiTConfig.from_preset("tiny", **overrides)``."""

    hidden_size: int = 64
    num_heads: int = 4
    depth_double: int = 2
    depth_single: int = 2
    mlp_ratio: float = 4.0
    latent_channels: int = 4  # VAE latent channels (16 for FLUX's AE)
    patch_size: int = 2  # latent pixels per token side (2x2 packing in FLUX)
    context_dim: int = 32  # T5 hidden size (4096 for T5-XXL)
    pooled_dim: int = 24  # CLIP pooled size (768 for CLIP-L)
    axes_dim: tuple = (4, 6, 6)  # RoPE dims of the (t, h, w) axes; sum == head_dim
    theta: int = 10_000
    guidance_embed: bool = True
    vae_downsample: int = 8  # image pixels per latent pixel
    qkv_bias: bool = True
    attention_path: str = "sdpa"
    kernels: Any = "eager"
    recipe: str = "bf16"
    activation_checkpoint: str = "none"
    preset: str = "custom"

    def __post_init__(self):
        check_int("hidden_size", self.hidden_size, min=1)
        check_int("num_heads", self.num_heads, min=1)
        if self.num_heads > self.hidden_size or self.hidden_size % self.num_heads:
            raise ConfigError(
                "num_heads",
                self.num_heads,
                f"a divisor of hidden_size={self.hidden_size} (at most {self.hidden_size} heads)",
            )
        if self.head_dim % 2:
            raise ConfigError(
                "num_heads",
                self.num_heads,
                f"a head count giving an even head_dim (hidden_size/num_heads = {self.head_dim})",
            )
        check_int("depth_double", self.depth_double, min=0)
        check_int("depth_single", self.depth_single, min=0)
        if self.depth_double + self.depth_single == 0:
            raise ConfigError(
                "depth_single", self.depth_single, "at least one block in total (depth_double + depth_single >= 1)"
            )
        check_float("mlp_ratio", self.mlp_ratio, min=0, min_exclusive=True)
        check_int("latent_channels", self.latent_channels, min=1)
        check_int("patch_size", self.patch_size, min=1)
        check_int("context_dim", self.context_dim, min=1)
        check_int("pooled_dim", self.pooled_dim, min=1)
        check_int_list("axes_dim", list(self.axes_dim), min=2)
        if len(self.axes_dim) != 3 or any(a % 2 for a in self.axes_dim) or sum(self.axes_dim) != self.head_dim:
            raise ConfigError(
                "axes_dim", tuple(self.axes_dim), f"three even ints (t, h, w) summing to head_dim = {self.head_dim}"
            )
        object.__setattr__(self, "axes_dim", tuple(self.axes_dim))
        check_int("theta", self.theta, min=1)
        check_bool("guidance_embed", self.guidance_embed)
        check_bool("qkv_bias", self.qkv_bias)
        check_int("vae_downsample", self.vae_downsample, min=1)
        check_choice("activation_checkpoint", self.activation_checkpoint, ACTIVATION_CHECKPOINTS)
        check_choice("attention_path", self.attention_path, attention_paths.REGISTRY)
        _check_kernels(self.kernels)
        check_choice("recipe", self.recipe, RECIPES)

    # derived sizes ----------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def in_channels(self) -> int:
        """Channels of one packed token: latent_channels * patch_size**2 (64 for FLUX)."""
        return self.latent_channels * self.patch_size**2

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def pixels_per_token(self) -> int:
        """Image pixels per token side: vae_downsample * patch_size (16 for FLUX)."""
        return self.vae_downsample * self.patch_size

    @classmethod
    def from_preset(cls, preset: str, **overrides) -> MMDiTConfig:
        check_choice("preset", preset, PRESETS)
        return cls(**{**PRESETS[preset], "preset": preset, **overrides})

    def replace(self, **changes) -> MMDiTConfig:
        return dataclasses.replace(self, **changes)

    def check_resolution(self, height: int, width: int, param: str = "resolution") -> tuple[int, int]:
        """Latent-token grid (h, w) for an image of height x width pixels; a size the
        VAE downsample x patch size does not divide is a ConfigError naming ``param``."""
        ppt = self.pixels_per_token
        for v in (height, width):
            if isinstance(v, bool) or not isinstance(v, int) or v < ppt or v % ppt:
                raise ConfigError(
                    param,
                    (height, width) if height != width else height,
                    f"pixel sizes that are positive multiples of vae_downsample*patch_size = {ppt}",
                )
        return height // ppt, width // ppt


def resolve_config(cfg_or_preset: MMDiTConfig | str, **overrides) -> MMDiTConfig:
    if isinstance(cfg_or_preset, MMDiTConfig):
        return cfg_or_preset.replace(**overrides) if overrides else cfg_or_preset
    if isinstance(cfg_or_preset, str):
        return MMDiTConfig.from_preset(cfg_or_preset, **overrides)
    raise ConfigError("preset", cfg_or_preset, "a preset name (" + ", ".join(PRESETS) + ") or an MMDiTConfig")
