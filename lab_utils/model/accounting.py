"""Counting: parameters and forward FLOPs of an MMDiT from its config alone (checked against the
built model and ``torch.utils.flop_counter`` in tests), FLOPs of any function by
``FlopCounterMode`` (:func:`count_flops`, CPU's flash attention included) and of an MMDiT
training step on ``meta`` (:func:`training_step_flops`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lab_utils.model.config import MMDiTConfig
from lab_utils.model.mmdit import build_model
from lab_utils.model.train import rf_loss, synthetic_batch


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


def _cpu_sdpa_flop_mapping() -> dict:
    """FlopCounterMode has formulas for CUDA's SDPA kernels but not for the CPU flash
    kernel; count it the same way (QKᵀ and PV: 4·B·H·Lq·Lk·Dh forward, 2x backward)."""
    aten = torch.ops.aten
    out = {}

    def fwd(q_shape, k_shape, v_shape):
        b, h, lq, d = q_shape
        lk = k_shape[-2]
        return 2 * b * h * lq * lk * d + 2 * b * h * lq * lk * v_shape[-1]

    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        # FlopCounterMode hands formulas the shapes of tensor arguments
        def f(query, key, value, *args, out_shape=None, **kw):
            return fwd(query, key, value)

        def b(grad_out, query, key, value, *args, out_shape=None, **kw):
            return 2 * fwd(query, key, value)

        out[aten._scaled_dot_product_flash_attention_for_cpu] = f
        if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
            out[aten._scaled_dot_product_flash_attention_for_cpu_backward] = b
    return out


def count_flops(fn, *, device_kind: str = "meta") -> tuple[int, dict[str, int]]:
    """FLOPs of ``fn()`` by ``torch.utils.flop_counter``; returns (total, per-op)."""
    with FlopCounterMode(display=False, custom_mapping=_cpu_sdpa_flop_mapping()) as fc:
        fn()
    per_op = {str(k): int(v) for k, v in fc.get_flop_counts().get("Global", {}).items()}
    return int(fc.get_total_flops()), per_op


_FLOP_CACHE: dict[tuple, int] = {}


def training_step_flops(model_cfg, batch_size: int, grid: tuple[int, int], txt_len: int) -> int:
    """Model FLOPs of one training step (forward + backward of the MMDiT) at this shape,
    counted on a meta-device copy (nothing is computed or allocated)."""
    cfg = model_cfg.replace(kernels="eager", attention_path="sdpa", activation_checkpoint="none", recipe="bf16")
    key = (cfg, batch_size, tuple(grid), txt_len)
    if key not in _FLOP_CACHE:
        model = build_model(cfg, device="meta").train()
        h, w = grid
        ppt = cfg.pixels_per_token
        batch = synthetic_batch(cfg, batch_size, height=h * ppt, width=w * ppt, txt_len=txt_len, device="meta")
        total, _ = count_flops(lambda: rf_loss(model, batch).backward())
        _FLOP_CACHE[key] = total
    return _FLOP_CACHE[key]
