"""A model written for the tests that is unlike perflab's MMDiT: a PixArt-alpha-style diffusion
transformer.  Image tokens only go through the blocks; text enters by **cross-attention** (queries
from the image, keys and values from the text); the timestep conditions every block through
**adaLN-single** (one MLP of the timestep gives six modulation vectors shared by all blocks, each
block adds its own learned table); positions are a fixed 2-D sine-cosine table added once (**no
RoPE**).  Trained with rectified flow on random latents and text embeddings, AdamW.

``pixart_step`` is a factory of the step contract (``tests/pixart_step.py:pixart_step``, imported
as ``pixart_step:pixart_step`` with the tests' folder importable)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lab_utils.step.contract import StepFactory

WIDTH, HEADS, DEPTH, TEXT_DIM, CHANNELS, PATCH = 32, 4, 3, 24, 4, 2


def sincos_2d(h: int, w: int, dim: int) -> torch.Tensor:
    """(h*w, dim) fixed sine-cosine positions (half the channels for rows, half for columns)."""
    quarter = dim // 4
    freq = 1.0 / (10_000 ** (torch.arange(quarter, dtype=torch.float64) / quarter))
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij")
    parts = []
    for pos in (ys.reshape(-1), xs.reshape(-1)):
        ang = pos[:, None] * freq[None]
        parts += [ang.sin(), ang.cos()]
    return torch.cat(parts, dim=1).float()


class CrossAttention(nn.Module):
    """Queries from ``x``, keys and values from ``ctx`` (or from ``x``: self-attention)."""

    def __init__(self, width: int, ctx_dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(ctx_dim, 2 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape
        ctx = x if ctx is None else ctx
        q = self.q(x).view(b, n, self.heads, d // self.heads).transpose(1, 2)
        k, v = self.kv(ctx).view(b, ctx.shape[1], 2, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, n, d))


class PixArtBlock(nn.Module):
    """Self-attention, cross-attention to the text, MLP; adaLN-single modulation (shared ``t6``
    plus this block's own table) on the self-attention and MLP branches."""

    def __init__(self, width: int, text_dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.attn = CrossAttention(width, width, heads)
        self.norm_x = nn.LayerNorm(width, eps=1e-6)
        self.cross = CrossAttention(width, text_dim, heads)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))
        self.table = nn.Parameter(torch.randn(6, width) / math.sqrt(width))

    def forward(self, x: torch.Tensor, text: torch.Tensor, t6: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.table[None] + t6.view(-1, 6, x.shape[-1])).unbind(1)
        h = self.norm1(x) * (1 + scale1[:, None]) + shift1[:, None]
        x = x + gate1[:, None] * self.attn(h)
        x = x + self.cross(self.norm_x(x), text)
        h = self.norm2(x) * (1 + scale2[:, None]) + shift2[:, None]
        return x + gate2[:, None] * self.mlp(h)


class PixArt(nn.Module):
    def __init__(self, grid: int = 4):
        super().__init__()
        self.patch = nn.Linear(CHANNELS * PATCH * PATCH, WIDTH)
        self.register_buffer("pos", sincos_2d(grid, grid, WIDTH), persistent=False)
        self.t_embed = nn.Sequential(nn.Linear(64, WIDTH), nn.SiLU(), nn.Linear(WIDTH, WIDTH))
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(WIDTH, 6 * WIDTH))  # adaLN-single: one for all blocks
        self.blocks = nn.ModuleList(PixArtBlock(WIDTH, TEXT_DIM, HEADS) for _ in range(DEPTH))
        self.final_norm = nn.LayerNorm(WIDTH, elementwise_affine=False, eps=1e-6)
        self.final = nn.Linear(WIDTH, CHANNELS * PATCH * PATCH)
        self.config = dict(kind="pixart-alpha-style", width=WIDTH, heads=HEADS, depth=DEPTH, grid=grid)

    def forward(self, tokens: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        half = 32
        freqs = torch.exp(-math.log(10_000) * torch.arange(half, device=t.device) / half)
        temb = self.t_embed(torch.cat([(t[:, None] * 1000 * freqs).sin(), (t[:, None] * 1000 * freqs).cos()], dim=1))
        t6 = self.t_block(temb)
        x = self.patch(tokens) + self.pos
        for blk in self.blocks:
            x = blk(x, text, t6)
        return self.final(self.final_norm(x))


def pixart_step(device="cpu", dtype=torch.float32, batch_size: int = 2, seed: int = 0) -> StepFactory:
    """The PixArt-style model at 8 x 8 latents (4 x 4 tokens of 2 x 2 patches), 6 text tokens,
    rectified flow, AdamW (lr 1e-4)."""
    torch.manual_seed(seed)
    model = PixArt().to(device, dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens, dim = 16, CHANNELS * PATCH * PATCH

    def make_batch(k: int) -> dict:
        g = torch.Generator().manual_seed(seed * 1_000_003 + k)
        return {
            "x0": torch.randn(batch_size, tokens, dim, generator=g).to(device, dtype),
            "text": torch.randn(batch_size, 6, TEXT_DIM, generator=g).to(device, dtype),
            "k": k,
        }

    def loss(m, b: dict) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed + b["k"])
        x0 = b["x0"]
        t = torch.sigmoid(torch.randn(x0.shape[0], generator=g)).to(x0.device, x0.dtype)
        noise = torch.randn(x0.shape, generator=g).to(x0.device, x0.dtype)
        x_t = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
        return F.mse_loss(m(x_t, t, b["text"]).float(), (noise - x0).float())

    return StepFactory(model, opt, make_batch, loss, config=model.config)
