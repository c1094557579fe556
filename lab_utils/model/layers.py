"""The MMDiT's layers: the fused-op seam (:class:`KernelSet`), embeddings, RoPE,
patchify, and the double- and single-stream blocks (FLUX layout).

Shapes: B batch, L tokens, D hidden, H heads, Dh head dim, K = 3 (q, k, v).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping
from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from lab_kernels import get_variant
from lab_utils.attention.attend import attend
from lab_utils.attention.paths import AttentionPath, get_path
from lab_utils.core.config import ConfigError
from lab_utils.model.config import KERNEL_OPS, MMDiTConfig, kernel_map, registered_variants


class KernelSet:
    """The fused ops a model calls, resolved once from the config's ``kernels`` field.

    ``sources[op]`` says where each op came from ("lab_kernels.rms_norm/triton", or
    "composed: ..." for a qk_norm_rope built from the chosen rms_norm and rope)."""

    def __init__(
        self,
        kernels: str | Mapping[str, str] = "eager",
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        self.names = kernel_map(kernels)
        self.sources: dict[str, str] = {}
        dev = torch.device(device).type if device is not None else None
        for op in KERNEL_OPS:
            setattr(self, op, self._resolve(op, self.names[op], dev, dtype))
        # When a mapping names rms_norm / rope but not qk_norm_rope, compose the chosen
        # rms_norm and rope: the blocks call only the fused op, so a per-op choice of
        # rope must reach them through it.
        explicit = set(kernels) if isinstance(kernels, Mapping) else set()
        if explicit & {"rms_norm", "rope"} and "qk_norm_rope" not in explicit:
            rms, rope = self.rms_norm, self.rope

            def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6):
                return rope(rms(q, q_weight, eps), rms(k, k_weight, eps), cos, sin)

            self.qk_norm_rope = qk_norm_rope
            self.sources["qk_norm_rope"] = f"composed: {self.sources['rms_norm']} + {self.sources['rope']}"

    def _resolve(self, op: str, name: str, dev: str | None, dtype) -> Callable:
        known = registered_variants(op)
        if name not in known:
            raise ConfigError("kernels", name, f"a registered variant of lab_kernels.{op}: {', '.join(known)}")
        v = get_variant(op, name)
        if dev is not None and dev != "meta":
            reason = v.why_not(dev, dtype)
            if reason:
                raise ConfigError("kernels", name, f"a variant that runs here ({reason})")
        self.sources[op] = f"lab_kernels.{op}/{name}"
        return v.fn


# Embeddings, RoPE, patchify


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


# Blocks


class Modulation(nn.Module):
    """adaLN: SiLU(vec) -> Linear(D, n*D), split into n (B, D) chunks (shift, scale, gate, ...)."""

    def __init__(self, dim: int, n: int):
        super().__init__()
        self.n = n
        self.lin = nn.Linear(dim, n * dim)

    def forward(self, vec):
        return self.lin(F.silu(vec)).chunk(self.n, dim=-1)


class Seams(MutableMapping):
    """The model's seams, one object: the fused ops and the attention path every block calls
    (resolved to its function once, here), the precision recipe, the activation-checkpoint
    policy applied to the model.  As a mapping it reads what each seam runs
    (``kernels.<op>``: the variant or its fallback, ``attention_path``, ``recipe``,
    ``activation_checkpoint``) for records and tables; notes set on it (``seams["qk_norm"] =
    ...``) join that description."""

    def __init__(self, ops: KernelSet, attention_path: str, recipe: str = "bf16"):
        self.ops = ops
        self.attention_path = attention_path
        self.recipe = recipe
        self.activation_checkpoint = "none"  # set by the policy's apply(model)
        self.notes: dict[str, str] = {}
        # resolved once: "sdpa" calls torch directly, any other name is looked up in the registry here
        self.attend = _sdpa if attention_path == "sdpa" else partial(_attend_path, path=get_path(attention_path))

    @classmethod
    def from_config(cls, cfg: MMDiTConfig, ops: KernelSet) -> Seams:
        return cls(ops, cfg.attention_path, cfg.recipe)

    def describe(self) -> dict[str, str]:
        out = {f"kernels.{op}": src for op, src in self.ops.sources.items()}
        out["attention_path"] = self.attention_path
        out["recipe"] = self.recipe if self.recipe != "bf16" else "bf16 (baseline: no layer swapped)"
        out["activation_checkpoint"] = self.activation_checkpoint
        return {**out, **self.notes}

    def __getitem__(self, key: str) -> str:
        return self.describe()[key]

    def __setitem__(self, key: str, value: str) -> None:
        self.notes[key] = value

    def __delitem__(self, key: str) -> None:
        del self.notes[key]

    def __iter__(self):
        return iter(self.describe())

    def __len__(self) -> int:
        return len(self.describe())


def _sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _attend_path(q, k, v, mask=None, *, path: AttentionPath):
    return attend(q, k, v, path=path, mask=mask)


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

    def __init__(self, cfg: MMDiTConfig, seams: Seams):
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

    def __init__(self, cfg: MMDiTConfig, seams: Seams):
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

    def __init__(self, cfg: MMDiTConfig, seams: Seams):
        super().__init__()
        self._seams = seams
        self.adaLN = Modulation(cfg.hidden_size, 2)
        self.linear = nn.Linear(cfg.hidden_size, cfg.in_channels)

    def forward(self, x, vec):
        shift, scale = self.adaLN(vec)
        return self.linear(self._seams.ops.layer_norm_modulate(x, shift, scale))
