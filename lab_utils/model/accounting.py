"""Counting from the config alone: parameters and forward FLOPs of an MMDiT
(checked against the built model and ``torch.utils.flop_counter`` in tests)."""

from __future__ import annotations

from torch import nn

from lab_utils.model.config import MMDiTConfig


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
