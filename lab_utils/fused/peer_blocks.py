"""Peers of the whole-block comparison: Liger's kernels inside perflab's block, and diffusers'
own FLUX blocks, unfused and with their fused QKV projection.

* ``"liger"``: perflab's block with each fused op Liger-Kernel implements taken from Liger
  (``lab_kernels.liger``: rms_norm and rope, composed into the QK-norm + RoPE, and the adaLN
  LayerNorm), eager torch for the ops Liger has no kernel for (gated residual, GELU): what a
  team adopting Liger would run.
* ``"diffusers"``: diffusers' ``FluxTransformerBlock`` / ``FluxSingleTransformerBlock`` with
  its default ``FluxAttnProcessor``: q, k and v from three projections (``to_q``, ``to_k``,
  ``to_v``; ``add_*_proj`` for the text stream), where perflab's block (BFL's layout) has one
  fused ``qkv`` linear.  Lab 03's attention paths all start from q, k, v, so this projection
  is the difference between diffusers' processor and what lab 03 measures.
* ``"diffusers+fused_qkv"``: the same block after diffusers' ``fuse_projections()`` (one
  ``to_qkv`` / ``to_added_qkv`` linear, diffusers' own fused path).

All run on the same weights: when a diffusers provider is asked for, the diffusers block is
built first and its state dict converted onto perflab's block
(``lab_utils.model.diffusers``), so every provider's outputs are compared with the eager
block's (``lab_utils.fused.blocks.block_agreement``).
"""

from __future__ import annotations

import torch
from torch import nn

from lab_utils.model import MMDiTConfig
from lab_utils.model.diffusers import convert_double_block_state_dict, convert_single_block_state_dict

#: the kernels of the "liger" block provider: Liger where it has a kernel, eager elsewhere
LIGER_KERNELS = {"default": "eager", "rms_norm": "liger", "rope": "liger", "layer_norm_modulate": "liger"}
DIFFUSERS_PROVIDERS = {"diffusers": False, "diffusers+fused_qkv": True}  # name: fuse_projections()
#: the unfused projections diffusers keeps beside the fused ones (no gradient once fused)
_UNFUSED = ("to_q.", "to_k.", "to_v.", "add_q_proj.", "add_k_proj.", "add_v_proj.")


def diffusers_block(kind: str, cfg: MMDiTConfig, *, seed: int) -> nn.Module:
    """diffusers' FLUX block of ``kind`` with ``cfg``'s widths, float32, weights drawn from ``seed``."""
    from diffusers.models.transformers import transformer_flux as df  # noqa: PLC0415  (a peer; seconds to import)

    torch.manual_seed(seed)
    cls = df.FluxTransformerBlock if kind == "double" else df.FluxSingleTransformerBlock
    kw = dict(dim=cfg.hidden_size, num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim)
    if kind == "single":
        kw["mlp_ratio"] = cfg.mlp_ratio
    return cls(**kw)


def load_into(base: nn.Module, kind: str, ref: nn.Module) -> None:
    """Give perflab's block ``base`` the diffusers block's weights (converted)."""
    conv = convert_double_block_state_dict if kind == "double" else convert_single_block_state_dict
    base.load_state_dict(conv(ref.state_dict()))


def fuse_qkv(block: nn.Module) -> nn.Module:
    """diffusers' own QKV fusion; the unfused projections it keeps stop taking gradients."""
    with torch.no_grad():
        block.attn.fuse_projections()
    assert block.attn.fused_projections, "diffusers' fuse_projections() did not fuse"
    for n, p in block.named_parameters():
        if n.startswith(tuple(f"attn.{u}" for u in _UNFUSED)):
            p.requires_grad_(False)
    return block


def diffusers_pe(pe: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """perflab's tables (L, Dh/2) -> diffusers' ``image_rotary_emb`` (L, Dh), each angle twice
    (FLUX's pair layout: ``repeat_interleave_real``)."""
    return tuple(t.repeat_interleave(2, dim=-1) for t in pe)


def diffusers_forward(block: nn.Module, kind: str, txt_tokens: int):
    """A function with perflab's block signature and outputs around the diffusers block:
    double (img, txt, vec, pe) -> (img, txt); single (x = [txt | img], vec, pe) -> x."""

    def fwd(*inputs):
        if kind == "double":
            img, txt, vec, pe = inputs
            txt_o, img_o = block(img, txt, vec, image_rotary_emb=diffusers_pe(pe))
            return img_o, txt_o
        x, vec, pe = inputs
        txt_o, img_o = block(x[:, txt_tokens:], x[:, :txt_tokens], vec, image_rotary_emb=diffusers_pe(pe))
        return torch.cat([txt_o, img_o], dim=1)

    return fwd


__all__ = [
    "DIFFUSERS_PROVIDERS",
    "LIGER_KERNELS",
    "diffusers_block",
    "diffusers_forward",
    "diffusers_pe",
    "fuse_qkv",
    "load_into",
]
