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
per head before RoPE.

Four seams are chosen by :class:`MMDiTConfig` so later labs swap them in one place:

* ``attention_path``: "sdpa" calls ``F.scaled_dot_product_attention``; any other name
  goes through ``lab_utils.attention.attend(q, k, v, path=...)``.
* ``kernels``: the variant name (``lab_kernels`` registry) used for the fused ops
  ``rms_norm``, ``layer_norm_modulate``, ``gated_residual``, ``gelu_tanh``, ``rope``
  (and ``qk_norm_rope`` when registered); a string for all ops, or a mapping
  ``{"default": "eager", "rope": "triton"}``.
* ``recipe``: a precision recipe of ``lab_utils.precision`` applied after building
  ("bf16" is the no-op baseline).
* ``checkpoint``: the activation-checkpoint policy (see ``CHECKPOINT_POLICIES``).

Where a seam's module (or a standard variant name) is not importable yet, the model
falls back to the plain-torch implementation in this file and says so in
``model.seams`` (and a warning); a name that is unknown although its module exists is
a :class:`ConfigError` naming the parameter.

Faithfulness: :func:`convert_diffusers_state_dict` (and the per-block converters)
map diffusers' ``FluxTransformer2DModel`` / ``FluxTransformerBlock`` /
``FluxSingleTransformerBlock`` weights onto this layout; ``tests/test_mmdit.py``
checks both compute the same at float32.

Shapes: B batch, L tokens, D hidden, H heads, Dh head dim, K = 3 (q, k, v).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..config import ConfigError, LabConfig, check_bool, check_choice, check_float, check_int, check_int_list
from .checkpointing import CHECKPOINT_POLICIES, run_block

# --------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------

#: Named shapes.  ``tiny``/``small`` are CPU sizes; ``flux-dev``/``flux-schnell`` are the
#: released FLUX.1 transformer shapes (build them on ``device="meta"`` here).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_heads=4,
        depth_double=2,
        depth_single=2,
        mlp_ratio=4.0,
        latent_channels=4,
        patch_size=2,
        context_dim=32,
        pooled_dim=24,
        axes_dim=(4, 6, 6),
        guidance_embed=True,
        vae_downsample=8,
    ),
    "small": dict(
        hidden_size=384,
        num_heads=6,
        depth_double=2,
        depth_single=4,
        mlp_ratio=4.0,
        latent_channels=16,
        patch_size=2,
        context_dim=512,
        pooled_dim=256,
        axes_dim=(8, 28, 28),
        guidance_embed=True,
        vae_downsample=8,
    ),
    "medium": dict(
        hidden_size=1536,
        num_heads=12,
        depth_double=8,
        depth_single=16,
        mlp_ratio=4.0,
        latent_channels=16,
        patch_size=2,
        context_dim=4096,
        pooled_dim=768,
        axes_dim=(16, 56, 56),
        guidance_embed=True,
        vae_downsample=8,
    ),
    "flux-schnell": dict(
        hidden_size=3072,
        num_heads=24,
        depth_double=19,
        depth_single=38,
        mlp_ratio=4.0,
        latent_channels=16,
        patch_size=2,
        context_dim=4096,
        pooled_dim=768,
        axes_dim=(16, 56, 56),
        guidance_embed=False,
        vae_downsample=8,
    ),
    "flux-dev": dict(
        hidden_size=3072,
        num_heads=24,
        depth_double=19,
        depth_single=38,
        mlp_ratio=4.0,
        latent_channels=16,
        patch_size=2,
        context_dim=4096,
        pooled_dim=768,
        axes_dim=(16, 56, 56),
        guidance_embed=True,
        vae_downsample=8,
    ),
}

#: Presets too large to allocate on this 2-core CPU box (build on "meta").
LARGE_PRESETS = ("medium", "flux-schnell", "flux-dev")

#: The fused ops the blocks call through the kernel seam.
KERNEL_OPS = ("rms_norm", "layer_norm_modulate", "gated_residual", "gelu_tanh", "rope", "qk_norm_rope")
#: Variant names every lab_kernels op module is expected to register; naming one of
#: these before its op module (or the variant) exists falls back to plain torch.
STANDARD_KERNELS = ("reference", "eager", "compile", "triton")

#: Attention path served without lab_utils.attention.
BUILTIN_ATTENTION = ("sdpa",)


def _module_present(modname: str) -> bool:
    try:
        return importlib.util.find_spec(modname) is not None
    except (ImportError, ValueError):
        return False


def attention_paths() -> tuple[str, ...] | None:
    """Attention paths ``lab_utils.attention`` offers, or None while it is not importable."""
    if not _module_present("lab_utils.attention"):
        return None
    mod = importlib.import_module("lab_utils.attention")
    for name in ("PATHS", "ATTENTION_PATHS"):
        if hasattr(mod, name):
            return tuple(getattr(mod, name))
    for name in ("paths", "available_paths", "list_paths"):
        if callable(getattr(mod, name, None)):
            return tuple(getattr(mod, name)())
    return None


def recipe_names() -> tuple[str, ...] | None:
    """Recipe names of ``lab_utils.precision``, or None while it is not importable."""
    if not _module_present("lab_utils.precision"):
        return None
    mod = importlib.import_module("lab_utils.precision")
    recipes = getattr(mod, "RECIPES", None)
    return tuple(recipes) if recipes is not None else None


def _kernel_map(kernels: str | Mapping[str, str]) -> dict[str, str]:
    """Normalise the ``kernels`` field to {op: variant name} for every op."""
    if isinstance(kernels, str):
        return {op: kernels for op in KERNEL_OPS}
    if isinstance(kernels, Mapping):
        default = kernels.get("default", "eager")
        return {op: kernels.get(op, default) for op in KERNEL_OPS}
    raise ConfigError("kernels", kernels, "a variant name (e.g. 'eager') or a mapping {op: variant}")


def _registered_variants(op: str) -> list[str] | None:
    """Variant names registered for ``op``; None when lab_kernels has no module for it yet."""
    if not _module_present(f"lab_kernels.{op}"):
        return None
    from lab_kernels import registry

    try:
        registry._ensure(op)  # imports the op module, which registers its variants
    except KeyError:
        return None
    return list(registry._REGISTRY.get(op, {}))


def _check_kernels(kernels: str | Mapping[str, str]) -> None:
    if isinstance(kernels, Mapping):
        for k in kernels:
            if k != "default" and k not in KERNEL_OPS:
                raise ConfigError(
                    "kernels",
                    dict(kernels),
                    f"a mapping whose keys are 'default' or one of {', '.join(KERNEL_OPS)} ({k!r} is not)",
                )
    for op, name in _kernel_map(kernels).items():
        if not isinstance(name, str):
            raise ConfigError("kernels", kernels, "variant names as strings")
        known = _registered_variants(op)
        if name in STANDARD_KERNELS:
            continue
        if known is None or name not in known:
            allowed = sorted(set(STANDARD_KERNELS) | set(known or []))
            raise ConfigError(
                "kernels",
                kernels,
                f"a variant of lab_kernels.{op}: one of {', '.join(repr(a) for a in allowed)} ({name!r} is not)",
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
    checkpoint: str = "none"
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
        check_choice("checkpoint", self.checkpoint, CHECKPOINT_POLICIES)
        if not isinstance(self.attention_path, str):
            raise ConfigError("attention_path", self.attention_path, "a path name such as 'sdpa'")
        # Only a non-builtin choice imports the other rooms' modules (they pull heavy deps).
        paths = attention_paths() if self.attention_path not in BUILTIN_ATTENTION else None
        if paths is not None and self.attention_path not in paths:
            raise ConfigError(
                "attention_path",
                self.attention_path,
                "one of " + ", ".join(repr(p) for p in (*BUILTIN_ATTENTION, *paths)),
            )
        _check_kernels(self.kernels)
        if not isinstance(self.recipe, str):
            raise ConfigError("recipe", self.recipe, "a recipe name such as 'bf16'")
        recipes = recipe_names() if self.recipe != "bf16" else None
        if recipes is not None and self.recipe not in recipes:
            raise ConfigError("recipe", self.recipe, "one of " + ", ".join(repr(r) for r in ("bf16", *recipes)))

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


# --------------------------------------------------------------------------------------
# Plain-torch ops (the fallback behind the kernel seam; same signatures as lab_kernels)
# --------------------------------------------------------------------------------------


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last axis in float32, as FLUX's QKNorm: (x / rms(x)) * weight."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # float32 math, float64 stays float64
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(xf.dtype)).to(x.dtype)


def torch_layer_norm_modulate(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """LayerNorm without affine, then x * (1 + scale) + shift; x (B, L, D), shift/scale (B, D)."""
    y = F.layer_norm(x, (x.shape[-1],), eps=eps)
    return y * (1 + scale[:, None, :]) + shift[:, None, :]


def torch_gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + gate[:, None, :] * y."""
    return x + gate[:, None, :] * y


def torch_gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def torch_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """FLUX pair-layout RoPE on (B, H, L, Dh); cos/sin float32 (L, Dh/2) or (B, L, Dh/2):
    out[2i] = x[2i] cos_i - x[2i+1] sin_i ; out[2i+1] = x[2i] sin_i + x[2i+1] cos_i."""
    if cos.dim() == 2:
        c, s = cos[None, None], sin[None, None]  # 1 1 L Dh/2
    else:
        c, s = cos[:, None], sin[:, None]  # B 1 L Dh/2

    def rot(x):
        ct = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(ct).unflatten(-1, (-1, 2))
        x0, x1 = xf[..., 0], xf[..., 1]
        cc, ss = c.to(ct), s.to(ct)
        return torch.stack([x0 * cc - x1 * ss, x0 * ss + x1 * cc], dim=-1).flatten(-2).to(x.dtype)

    return rot(q), rot(k)


def torch_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps: float = 1e-6):
    return torch_rope(torch_rms_norm(q, q_weight, eps), torch_rms_norm(k, k_weight, eps), cos, sin)


_TORCH_OPS: dict[str, Callable] = {
    "rms_norm": torch_rms_norm,
    "layer_norm_modulate": torch_layer_norm_modulate,
    "gated_residual": torch_gated_residual,
    "gelu_tanh": torch_gelu_tanh,
    "rope": torch_rope,
    "qk_norm_rope": torch_qk_norm_rope,
}


class KernelSet:
    """The fused ops a model calls, resolved once from the config's ``kernels`` field.

    ``sources[op]`` says where each op came from ("lab_kernels.rms_norm/triton" or
    "plain torch (fallback: ...)")."""

    def __init__(
        self,
        kernels: str | Mapping[str, str] = "eager",
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        self.names = _kernel_map(kernels)
        self.sources: dict[str, str] = {}
        self.fallbacks: list[str] = []
        dev = torch.device(device).type if device is not None else None
        for op in KERNEL_OPS:
            fn = self._resolve(op, self.names[op], dev, dtype)
            setattr(self, op, fn)
        # Without a fused qk_norm_rope variant, or when a mapping names rms_norm / rope but
        # not qk_norm_rope, compose the chosen rms_norm and rope (the blocks call only the
        # fused op, so a per-op choice of rope must reach them through it).
        explicit = set(kernels) if isinstance(kernels, Mapping) else set()
        if self.sources["qk_norm_rope"].startswith("plain torch") or (
            explicit & {"rms_norm", "rope"} and "qk_norm_rope" not in explicit
        ):
            rms, rope = self.rms_norm, self.rope

            def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6):
                return rope(rms(q, q_weight, eps), rms(k, k_weight, eps), cos, sin)

            self.qk_norm_rope = qk_norm_rope
            self.sources["qk_norm_rope"] = f"composed: {self.sources['rms_norm']} + {self.sources['rope']}"

    def _resolve(self, op: str, name: str, dev: str | None, dtype) -> Callable:
        known = _registered_variants(op)
        if known is None or name not in known:
            if name not in STANDARD_KERNELS:
                raise ConfigError(
                    "kernels", name, f"a registered variant of lab_kernels.{op}: {', '.join(known or STANDARD_KERNELS)}"
                )
            why = (
                f"lab_kernels.{op} not importable yet"
                if known is None
                else f"lab_kernels.{op} has no variant {name!r} yet"
            )
            self.sources[op] = f"plain torch (fallback: {why})"
            if op != "qk_norm_rope":  # optional fused op; composing it is the normal case
                self.fallbacks.append(f"{op}: {why}")
            return _TORCH_OPS[op]
        from lab_kernels.registry import get_variant

        v = get_variant(op, name)
        if dev is not None and dev != "meta":
            reason = v.why_not(dev, dtype)
            if reason:
                raise ConfigError("kernels", name, f"a variant that runs here ({reason})")
        self.sources[op] = f"lab_kernels.{op}/{name}"
        return v.fn


# --------------------------------------------------------------------------------------
# Embeddings, RoPE, patchify
# --------------------------------------------------------------------------------------


def timestep_embedding(
    t: torch.Tensor, dim: int = 256, max_period: float = 10_000.0, time_factor: float = 1000.0
) -> torch.Tensor:
    """Sinusoidal embedding of t in [0, 1] (scaled by ``time_factor``), [cos | sin] halves, float32."""
    t = time_factor * t.float()
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None] * freqs[None]  # B half
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class MLPEmbedder(nn.Module):
    """in_layer -> SiLU -> out_layer (timestep, guidance and pooled-text embedders)."""

    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden)
        self.out_layer = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.out_layer(F.silu(self.in_layer(x)))


class RoPE3D(nn.Module):
    """Rotary angles for (t, h, w) position ids: cos, sin float32 of (L, Dh/2) for ids
    (L, 3), or (B, L, Dh/2) for ids (B, L, 3).  Frequencies in float64 like FLUX."""

    def __init__(self, axes_dim: tuple[int, ...], theta: int = 10_000):
        super().__init__()
        self.axes_dim, self.theta = tuple(axes_dim), theta

    def forward(self, ids: torch.Tensor):
        pos = ids.float()
        fdt = torch.float32 if pos.device.type in ("mps", "meta") else torch.float64
        angles = []
        for i, d in enumerate(self.axes_dim):
            freqs = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=fdt, device=pos.device) / d))  # d/2
            angles.append(pos[..., i].to(fdt)[..., None] * freqs)  # ... L d/2
        ang = torch.cat(angles, dim=-1)
        return ang.cos().float(), ang.sin().float()


def patchify(latents: torch.Tensor, patch_size: int = 2) -> torch.Tensor:
    """(B, C, H, W) latents -> (B, H/p * W/p, C*p*p) tokens, FLUX's (c ph pw) packing."""
    b, c, h, w = latents.shape
    if h % patch_size or w % patch_size:
        raise ConfigError("resolution", (h, w), f"latent sizes divisible by patch_size = {patch_size}")
    return rearrange(latents, "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=patch_size, pw=patch_size)


def unpatchify(tokens: torch.Tensor, h: int, w: int, patch_size: int = 2) -> torch.Tensor:
    """Inverse of :func:`patchify`: (B, h*w, C*p*p) -> (B, C, h*p, w*p); h, w in tokens."""
    return rearrange(tokens, "b (h w) (c ph pw) -> b c (h ph) (w pw)", h=h, w=w, ph=patch_size, pw=patch_size)


def image_ids(h: int, w: int, device=None, t: int = 0) -> torch.Tensor:
    """(h*w, 3) position ids (t, row, col) of an h x w token grid."""
    rows = torch.arange(h, device=device, dtype=torch.float32)
    cols = torch.arange(w, device=device, dtype=torch.float32)
    grid = torch.stack(torch.meshgrid(rows, cols, indexing="ij"), dim=-1).reshape(h * w, 2)
    return torch.cat([torch.full((h * w, 1), float(t), device=device), grid], dim=-1)


def text_ids(length: int, device=None) -> torch.Tensor:
    """(L_txt, 3) zeros: FLUX gives text tokens no position."""
    return torch.zeros(length, 3, device=device)


# --------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------


class Modulation(nn.Module):
    """adaLN: SiLU(vec) -> Linear(D, n*D), split into n (B, D) chunks (shift, scale, gate, ...)."""

    def __init__(self, dim: int, n: int):
        super().__init__()
        self.n = n
        self.lin = nn.Linear(dim, n * dim)

    def forward(self, vec):
        return self.lin(F.silu(vec)).chunk(self.n, dim=-1)


class _Seams:
    """Per-model choices shared by every block (kernels + attention path)."""

    def __init__(self, ops: KernelSet, attention_path: str):
        self.ops = ops
        self.attention_path = attention_path
        self._attend = None
        if attention_path not in BUILTIN_ATTENTION:
            if _module_present("lab_utils.attention"):
                self._attend = importlib.import_module("lab_utils.attention").attend
            else:
                warnings.warn(
                    f"attention_path={attention_path!r}: lab_utils.attention is not importable yet; "
                    "falling back to F.scaled_dot_product_attention",
                    stacklevel=3,
                )

    def attend(self, q, k, v, mask=None):
        if self._attend is not None:
            return self._attend(q, k, v, path=self.attention_path, mask=mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class SelfAttentionProj(nn.Module):
    """Fused qkv projection + per-head QK RMSNorm weights + output projection of one stream."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool = True):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.q_norm = nn.Parameter(torch.ones(dim // heads))
        self.k_norm = nn.Parameter(torch.ones(dim // heads))
        self.proj = nn.Linear(dim, dim)

    def split_heads(self, qkv):
        return rearrange(qkv, "b l (k h d) -> k b h l d", k=3, h=self.heads)  # 3 B H L Dh


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)


class DoubleStreamBlock(nn.Module):
    """Separate image/text weights, joint attention over cat([txt, img]).

    forward(img (B, Li, D), txt (B, Lt, D), vec (B, D), pe=(cos, sin) over Lt+Li, mask) -> (img, txt)."""

    def __init__(self, cfg: MMDiTConfig, seams: _Seams):
        super().__init__()
        d = cfg.hidden_size
        self._seams = seams
        self.heads = cfg.num_heads
        self.img_mod = Modulation(d, 6)
        self.txt_mod = Modulation(d, 6)
        self.img_attn = SelfAttentionProj(d, cfg.num_heads, cfg.qkv_bias)
        self.txt_attn = SelfAttentionProj(d, cfg.num_heads, cfg.qkv_bias)
        self.img_mlp = MLP(d, cfg.mlp_hidden)
        self.txt_mlp = MLP(d, cfg.mlp_hidden)

    def forward(self, img, txt, vec, pe, mask=None):
        ops = self._seams.ops
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = self.img_mod(vec)
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = self.txt_mod(vec)

        lt = txt.shape[1]
        cos, sin = pe  # (B,) Lt+Li Dh/2
        iq, ik, iv = self.img_attn.split_heads(self.img_attn.qkv(ops.layer_norm_modulate(img, i_shift1, i_scale1)))
        tq, tk, tv = self.txt_attn.split_heads(self.txt_attn.qkv(ops.layer_norm_modulate(txt, t_shift1, t_scale1)))
        # QK-norm weights differ per stream and RoPE is per token, so each stream gets its
        # own fused norm+rope over its slice of the angles, then the streams join.
        iq, ik = ops.qk_norm_rope(
            iq, ik, self.img_attn.q_norm, self.img_attn.k_norm, cos[..., lt:, :], sin[..., lt:, :], 1e-6
        )
        tq, tk = ops.qk_norm_rope(
            tq, tk, self.txt_attn.q_norm, self.txt_attn.k_norm, cos[..., :lt, :], sin[..., :lt, :], 1e-6
        )
        q, k, v = torch.cat([tq, iq], 2), torch.cat([tk, ik], 2), torch.cat([tv, iv], 2)  # B H Lt+Li Dh
        o = rearrange(self._seams.attend(q, k, v, mask), "b h l d -> b l (h d)")
        t_o, i_o = o[:, :lt], o[:, lt:]

        img = ops.gated_residual(img, i_gate1, self.img_attn.proj(i_o))
        h = ops.gelu_tanh(self.img_mlp.fc1(ops.layer_norm_modulate(img, i_shift2, i_scale2)))
        img = ops.gated_residual(img, i_gate2, self.img_mlp.fc2(h))

        txt = ops.gated_residual(txt, t_gate1, self.txt_attn.proj(t_o))
        h = ops.gelu_tanh(self.txt_mlp.fc1(ops.layer_norm_modulate(txt, t_shift2, t_scale2)))
        txt = ops.gated_residual(txt, t_gate2, self.txt_mlp.fc2(h))
        return img, txt


class SingleStreamBlock(nn.Module):
    """Parallel attention + MLP from one fused input projection (linear1 -> [q k v | mlp]),
    one output projection over cat([attn, gelu(mlp)]).

    forward(x (B, L, D), vec (B, D), pe, mask) -> x."""

    def __init__(self, cfg: MMDiTConfig, seams: _Seams):
        super().__init__()
        d = cfg.hidden_size
        self._seams = seams
        self.heads = cfg.num_heads
        self.dim, self.mlp_hidden = d, cfg.mlp_hidden
        self.modulation = Modulation(d, 3)
        self.linear1 = nn.Linear(d, 3 * d + self.mlp_hidden)
        self.linear2 = nn.Linear(d + self.mlp_hidden, d)
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim))
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim))

    def forward(self, x, vec, pe, mask=None):
        ops = self._seams.ops
        shift, scale, gate = self.modulation(vec)
        qkv, mlp = self.linear1(ops.layer_norm_modulate(x, shift, scale)).split([3 * self.dim, self.mlp_hidden], -1)
        q, k, v = rearrange(qkv, "b l (k h d) -> k b h l d", k=3, h=self.heads)
        q, k = ops.qk_norm_rope(q, k, self.q_norm, self.k_norm, *pe, 1e-6)
        o = rearrange(self._seams.attend(q, k, v, mask), "b h l d -> b l (h d)")
        return ops.gated_residual(x, gate, self.linear2(torch.cat([o, ops.gelu_tanh(mlp)], dim=-1)))


class FinalLayer(nn.Module):
    """adaLN (shift, scale) + LayerNorm, then Linear(D, p*p*C) back to packed latent channels."""

    def __init__(self, cfg: MMDiTConfig, seams: _Seams):
        super().__init__()
        self._seams = seams
        self.adaLN = Modulation(cfg.hidden_size, 2)
        self.linear = nn.Linear(cfg.hidden_size, cfg.in_channels)

    def forward(self, x, vec):
        shift, scale = self.adaLN(vec)
        return self.linear(self._seams.ops.layer_norm_modulate(x, shift, scale))


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------


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
        self._seams = _Seams(self.ops, cfg.attention_path)
        d = cfg.hidden_size
        self.img_in = nn.Linear(cfg.in_channels, d)
        self.txt_in = nn.Linear(cfg.context_dim, d)
        self.time_in = MLPEmbedder(256, d)
        self.vector_in = MLPEmbedder(cfg.pooled_dim, d)
        self.guidance_in = MLPEmbedder(256, d) if cfg.guidance_embed else None
        self.pe_embedder = RoPE3D(cfg.axes_dim, cfg.theta)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg, self._seams) for _ in range(cfg.depth_double))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(cfg, self._seams) for _ in range(cfg.depth_single))
        self.final_layer = FinalLayer(cfg, self._seams)
        self.seams: dict[str, str] = {}

    # -- helpers ---------------------------------------------------------------------
    def blocks(self) -> list[nn.Module]:
        return [*self.double_blocks, *self.single_blocks]

    def _ckpt(self, block, kind, index, *args):
        active = self.training and torch.is_grad_enabled()
        return run_block(self.cfg.checkpoint, block, kind, index, *args, active=active)

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
        for i, blk in enumerate(self.double_blocks):
            img, txt = self._ckpt(blk, "double", i, img, txt, vec, pe, mask)
        lt = txt.shape[1]
        x = torch.cat([txt, img], dim=1)
        for i, blk in enumerate(self.single_blocks):
            x = self._ckpt(blk, "single", i, x, vec, pe, mask)
        return self.final_layer(x[:, lt:], vec)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def analytic_param_count(cfg: MMDiTConfig) -> int:
    """Parameter count from the config alone (checked against the built model in tests)."""
    d, m, c = cfg.hidden_size, cfg.mlp_hidden, cfg.in_channels
    lin = lambda i, o, bias=True: i * o + (o if bias else 0)  # noqa: E731
    emb = lin(c, d) + lin(cfg.context_dim, d) + lin(256, d) + lin(d, d) + lin(cfg.pooled_dim, d) + lin(d, d)
    if cfg.guidance_embed:
        emb += lin(256, d) + lin(d, d)
    stream = lin(d, 6 * d) + lin(d, 3 * d, cfg.qkv_bias) + 2 * cfg.head_dim + lin(d, d) + lin(d, m) + lin(m, d)
    single = lin(d, 3 * d) + lin(d, 3 * d + m) + lin(d + m, d) + 2 * cfg.head_dim
    final = lin(d, 2 * d) + lin(d, c)
    return emb + cfg.depth_double * 2 * stream + cfg.depth_single * single + final


def forward_flops(cfg: MMDiTConfig, batch: int, img_tokens: int, txt_tokens: int) -> dict[str, float]:
    """Matmul + attention FLOPs of one forward pass (2·m·n·k per matmul; attention
    4·B·H·L²·Dh for QKᵀ and PV).  Elementwise/norm FLOPs are left out, as
    ``torch.utils.flop_counter`` does.  A training step is ~3x (forward + 2x backward)."""
    d, m, c = cfg.hidden_size, cfg.mlp_hidden, cfg.in_channels
    li, lt, b = img_tokens, txt_tokens, batch
    L = li + lt
    mm = lambda rows, i, o: 2.0 * rows * i * o  # noqa: E731
    emb = (
        mm(b * li, c, d)
        + mm(b * lt, cfg.context_dim, d)
        + mm(b, 256, d)
        + mm(b, d, d)
        + mm(b, cfg.pooled_dim, d)
        + mm(b, d, d)
        + (mm(b, 256, d) + mm(b, d, d) if cfg.guidance_embed else 0)
    )
    attn = 4.0 * b * cfg.num_heads * L * L * cfg.head_dim
    double_lin = 2 * mm(b, d, 6 * d) + mm(b * L, d, 3 * d) + mm(b * L, d, d) + mm(b * L, d, m) + mm(b * L, m, d)
    single_lin = mm(b, d, 3 * d) + mm(b * L, d, 3 * d + m) + mm(b * L, d + m, d)
    final = mm(b, d, 2 * d) + mm(b * li, d, c)
    out = {
        "embed": emb,
        "double_linear": cfg.depth_double * double_lin,
        "single_linear": cfg.depth_single * single_lin,
        "attention": (cfg.depth_double + cfg.depth_single) * attn,
        "final": final,
    }
    out["total"] = sum(out.values())
    return out


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
    The precision ``recipe`` is applied after building when it is not "bf16"."""
    cfg = resolve_config(cfg_or_preset, **overrides)
    dev = torch.device(device)
    if seed is not None and dev.type != "meta":
        torch.manual_seed(seed)
    with torch.device(dev):
        model = MMDiT(cfg, device=dev, dtype=dtype)
    model = model.to(dtype=dtype)
    model.seams = {f"kernels.{op}": src for op, src in model.ops.sources.items()}
    model.seams["attention_path"] = (
        cfg.attention_path
        if cfg.attention_path in BUILTIN_ATTENTION or model._seams._attend is not None
        else f"sdpa (fallback: lab_utils.attention not importable for {cfg.attention_path!r})"
    )
    if model.ops.fallbacks and cfg.kernels != "eager":
        warnings.warn(f"kernels={cfg.kernels!r}: plain torch used for " + "; ".join(model.ops.fallbacks), stacklevel=2)
    if cfg.recipe != "bf16":
        if _module_present("lab_utils.precision"):
            model = importlib.import_module("lab_utils.precision").apply_recipe(model, cfg.recipe)
            model.seams["recipe"] = cfg.recipe
        else:
            warnings.warn(
                f"recipe={cfg.recipe!r}: lab_utils.precision is not importable yet; model left in its build dtype",
                stacklevel=2,
            )
            model.seams["recipe"] = f"none (fallback: lab_utils.precision not importable for {cfg.recipe!r})"
    else:
        model.seams["recipe"] = "bf16 (baseline: no layer swapped)"
    model.seams["checkpoint"] = cfg.checkpoint
    return model


# --------------------------------------------------------------------------------------
# diffusers -> this layout
# --------------------------------------------------------------------------------------


def _cat(sd, prefix, names, suffix):
    return torch.cat([sd[f"{prefix}{n}.{suffix}"] for n in names], dim=0)


def convert_double_block_state_dict(sd: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """diffusers ``FluxTransformerBlock`` state dict -> :class:`DoubleStreamBlock` state dict."""
    p = prefix
    out = {}
    for stream, mod, q, k, v, qn, kn, proj, ff in (
        ("img", "norm1", "to_q", "to_k", "to_v", "norm_q", "norm_k", "to_out.0", "ff"),
        (
            "txt",
            "norm1_context",
            "add_q_proj",
            "add_k_proj",
            "add_v_proj",
            "norm_added_q",
            "norm_added_k",
            "to_add_out",
            "ff_context",
        ),
    ):
        out[f"{stream}_mod.lin.weight"] = sd[f"{p}{mod}.linear.weight"]
        out[f"{stream}_mod.lin.bias"] = sd[f"{p}{mod}.linear.bias"]
        out[f"{stream}_attn.qkv.weight"] = _cat(sd, f"{p}attn.", (q, k, v), "weight")
        if f"{p}attn.{q}.bias" in sd:
            out[f"{stream}_attn.qkv.bias"] = _cat(sd, f"{p}attn.", (q, k, v), "bias")
        out[f"{stream}_attn.q_norm"] = sd[f"{p}attn.{qn}.weight"]
        out[f"{stream}_attn.k_norm"] = sd[f"{p}attn.{kn}.weight"]
        out[f"{stream}_attn.proj.weight"] = sd[f"{p}attn.{proj}.weight"]
        out[f"{stream}_attn.proj.bias"] = sd[f"{p}attn.{proj}.bias"]
        out[f"{stream}_mlp.fc1.weight"] = sd[f"{p}{ff}.net.0.proj.weight"]
        out[f"{stream}_mlp.fc1.bias"] = sd[f"{p}{ff}.net.0.proj.bias"]
        out[f"{stream}_mlp.fc2.weight"] = sd[f"{p}{ff}.net.2.weight"]
        out[f"{stream}_mlp.fc2.bias"] = sd[f"{p}{ff}.net.2.bias"]
    return out


def convert_single_block_state_dict(sd: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """diffusers ``FluxSingleTransformerBlock`` state dict -> :class:`SingleStreamBlock` state dict:
    to_q, to_k, to_v and proj_mlp stack into the fused ``linear1``."""
    p = prefix
    return {
        "modulation.lin.weight": sd[f"{p}norm.linear.weight"],
        "modulation.lin.bias": sd[f"{p}norm.linear.bias"],
        "linear1.weight": torch.cat(
            [
                sd[f"{p}attn.to_q.weight"],
                sd[f"{p}attn.to_k.weight"],
                sd[f"{p}attn.to_v.weight"],
                sd[f"{p}proj_mlp.weight"],
            ],
            0,
        ),
        "linear1.bias": torch.cat(
            [sd[f"{p}attn.to_q.bias"], sd[f"{p}attn.to_k.bias"], sd[f"{p}attn.to_v.bias"], sd[f"{p}proj_mlp.bias"]], 0
        ),
        "linear2.weight": sd[f"{p}proj_out.weight"],
        "linear2.bias": sd[f"{p}proj_out.bias"],
        "q_norm": sd[f"{p}attn.norm_q.weight"],
        "k_norm": sd[f"{p}attn.norm_k.weight"],
    }


def convert_diffusers_state_dict(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers ``FluxTransformer2DModel`` state dict -> :class:`MMDiT` state dict."""
    out: dict[str, torch.Tensor] = {}
    ren = {
        "x_embedder": "img_in",
        "context_embedder": "txt_in",
        "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
        "proj_out": "final_layer.linear",
    }
    for src, dst in ren.items():
        for s in ("weight", "bias"):
            if f"{src}.{s}" in sd:
                out[f"{dst}.{s}"] = sd[f"{src}.{s}"]
    # diffusers' AdaLayerNormContinuous chunks (scale, shift); FLUX's final layer (shift, scale).
    for s in ("weight", "bias"):
        scale, shift = sd[f"norm_out.linear.{s}"].chunk(2, dim=0)
        out[f"final_layer.adaLN.lin.{s}"] = torch.cat([shift, scale], 0)
    n_double = len({k.split(".")[1] for k in sd if k.startswith("transformer_blocks.")})
    n_single = len({k.split(".")[1] for k in sd if k.startswith("single_transformer_blocks.")})
    for i in range(n_double):
        for k, v in convert_double_block_state_dict(sd, f"transformer_blocks.{i}.").items():
            out[f"double_blocks.{i}.{k}"] = v
    for i in range(n_single):
        for k, v in convert_single_block_state_dict(sd, f"single_transformer_blocks.{i}.").items():
            out[f"single_blocks.{i}.{k}"] = v
    return out


def config_from_diffusers(dcfg: Mapping[str, Any], **overrides) -> MMDiTConfig:
    """MMDiTConfig matching a diffusers ``FluxTransformer2DModel`` config (patch_size 2 packing:
    FLUX's transformer sees in_channels = 4 * latent_channels)."""
    in_ch = dcfg["in_channels"]
    if in_ch % 4:
        raise ConfigError("in_channels", in_ch, "a multiple of 4 (2x2 packed latents)")
    d = dcfg["num_attention_heads"] * dcfg["attention_head_dim"]
    kw = dict(
        hidden_size=d,
        num_heads=dcfg["num_attention_heads"],
        depth_double=dcfg["num_layers"],
        depth_single=dcfg["num_single_layers"],
        mlp_ratio=4.0,
        latent_channels=in_ch // 4,
        patch_size=2,
        context_dim=dcfg["joint_attention_dim"],
        pooled_dim=dcfg["pooled_projection_dim"],
        axes_dim=tuple(dcfg["axes_dims_rope"]),
        guidance_embed=bool(dcfg["guidance_embeds"]),
    )
    return MMDiTConfig(**{**kw, **overrides})


__all__ = [
    "PRESETS",
    "LARGE_PRESETS",
    "CHECKPOINT_POLICIES",
    "KERNEL_OPS",
    "MMDiTConfig",
    "MMDiT",
    "KernelSet",
    "DoubleStreamBlock",
    "SingleStreamBlock",
    "FinalLayer",
    "Modulation",
    "MLPEmbedder",
    "RoPE3D",
    "build_model",
    "resolve_config",
    "num_params",
    "analytic_param_count",
    "forward_flops",
    "patchify",
    "unpatchify",
    "image_ids",
    "text_ids",
    "timestep_embedding",
    "convert_double_block_state_dict",
    "convert_single_block_state_dict",
    "convert_diffusers_state_dict",
    "config_from_diffusers",
    "attention_paths",
    "recipe_names",
]


def diffusers_block_errors(seed: int = 0, *, dim: int = 48, heads: int = 3, axes_dim=(4, 6, 6)) -> dict[str, float]:
    """Relative errors (float32) of this file's double/single blocks against diffusers'
    ``FluxTransformerBlock`` / ``FluxSingleTransformerBlock`` on random weights converted
    with the converters above and random inputs (the tests hold them under 1e-5)."""
    from diffusers.models.transformers import transformer_flux as df

    from ..checks import rel_error

    g = torch.Generator().manual_seed(seed)
    cfg = MMDiTConfig(
        hidden_size=dim,
        num_heads=heads,
        depth_double=1,
        depth_single=1,
        axes_dim=tuple(axes_dim),
        latent_channels=4,
        context_dim=20,
        pooled_dim=12,
    )

    def randomize(m):
        with torch.no_grad():
            for n, p in m.named_parameters():
                if p.dim() == 1 and "norm" in n and "linear" not in n:
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) / max(p.shape[-1], 1) ** 0.5)

    b, lt, h, w = 2, 7, 3, 5
    ids = torch.cat([text_ids(lt), image_ids(h, w)], 0)
    ours_pe = RoPE3D(cfg.axes_dim, cfg.theta)(ids)
    their_pe = df.FluxPosEmbed(theta=cfg.theta, axes_dim=list(cfg.axes_dim))(ids)
    model = build_model(cfg, seed=seed)
    img, txt, temb = (
        torch.randn(b, h * w, dim, generator=g),
        torch.randn(b, lt, dim, generator=g),
        torch.randn(b, dim, generator=g),
    )
    ref_d = df.FluxTransformerBlock(dim=dim, num_attention_heads=heads, attention_head_dim=dim // heads).eval()
    ref_s = df.FluxSingleTransformerBlock(dim=dim, num_attention_heads=heads, attention_head_dim=dim // heads).eval()
    randomize(ref_d)
    randomize(ref_s)
    model.double_blocks[0].load_state_dict(convert_double_block_state_dict(ref_d.state_dict()))
    model.single_blocks[0].load_state_dict(convert_single_block_state_dict(ref_s.state_dict()))
    with torch.no_grad():
        r_txt, r_img = ref_d(img, txt, temb, image_rotary_emb=their_pe)
        o_img, o_txt = model.double_blocks[0](img, txt, temb, ours_pe)
        s_txt, s_img = ref_s(img, txt, temb, image_rotary_emb=their_pe)
        s_out = model.single_blocks[0](torch.cat([txt, img], 1), temb, ours_pe)
    return {
        "double.img": rel_error(o_img, r_img),
        "double.txt": rel_error(o_txt, r_txt),
        "single.img": rel_error(s_out[:, lt:], s_img),
        "single.txt": rel_error(s_out[:, :lt], s_txt),
    }
