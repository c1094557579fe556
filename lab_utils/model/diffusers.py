"""diffusers' FLUX weights onto this layout, and the block-level agreement check.

:func:`convert_diffusers_state_dict` (and the per-block converters) map diffusers'
``FluxTransformer2DModel`` / ``FluxTransformerBlock`` / ``FluxSingleTransformerBlock``
state dicts onto :class:`~lab_utils.model.mmdit.MMDiT`; :func:`diffusers_block_errors`
runs both on the same random weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lab_utils.core.checks import rel_error
from lab_utils.core.config import ConfigError
from lab_utils.model.config import MMDiTConfig
from lab_utils.model.layers import RoPE3D, image_ids, text_ids
from lab_utils.model.mmdit import build_model


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


def diffusers_block_errors(seed: int = 0, *, dim: int = 48, heads: int = 3, axes_dim=(4, 6, 6)) -> dict[str, float]:
    """Relative errors (float32) of this file's double/single blocks against diffusers'
    ``FluxTransformerBlock`` / ``FluxSingleTransformerBlock`` on random weights converted
    with the converters above and random inputs (the tests hold them under 1e-5)."""
    from diffusers.models.transformers import transformer_flux as df  # noqa: PLC0415  (reference only; seconds to import)

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
