"""MMDiT blocks: shapes, faithfulness to diffusers' FLUX blocks, gradients, seams, bad input."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers import transformer_flux as diffusers_flux

from lab_kernels import get_variant
from lab_utils import model as mmdit
from lab_utils.core.checks import assert_bitwise_equal, assert_close, rel_error
from lab_utils.core.config import ConfigError
from lab_utils.model import (
    PRESETS,
    MMDiTConfig,
    analytic_param_count,
    build_model,
    forward_flops,
    image_ids,
    num_params,
    patchify,
    text_ids,
    unpatchify,
)
from lab_utils.precision.quantized import apply_recipe

pytestmark = pytest.mark.usefixtures("one_thread")


# heads 3, head_dim 16 (axes 4+6+6): irregular on purpose.
D, HEADS, AXES = 48, 3, (4, 6, 6)


def _randomize_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Random weights everywhere, norm weights around 1 (so QK-norm scales matter)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and ("norm" in name and "linear" not in name):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / max(p.shape[-1], 1) ** 0.5)


def _pe(cfg: MMDiTConfig, lt: int, h: int, w: int):
    ids = torch.cat([text_ids(lt), image_ids(h, w)], 0)
    ours = mmdit.RoPE3D(cfg.axes_dim, cfg.theta)(ids)
    theirs = diffusers_flux.FluxPosEmbed(theta=cfg.theta, axes_dim=list(cfg.axes_dim))(ids)
    return ours, theirs


def _block_inputs(cfg: MMDiTConfig, gen: torch.Generator, b: int, lt: int, h: int, w: int):
    """Random image and text tokens, a time embedding and the rotary tables of both sides."""
    img, txt = torch.randn(b, h * w, D, generator=gen), torch.randn(b, lt, D, generator=gen)
    temb = torch.randn(b, D, generator=gen)
    return (img, txt, temb, *_pe(cfg, lt, h, w))


def _cfg(**kw) -> MMDiTConfig:
    base = dict(
        hidden_size=D,
        num_heads=HEADS,
        depth_double=1,
        depth_single=1,
        axes_dim=AXES,
        latent_channels=4,
        context_dim=20,
        pooled_dim=12,
    )
    return MMDiTConfig(**{**base, **kw})


def test_double_block_matches_diffusers():
    gen = torch.Generator().manual_seed(1)
    cfg = _cfg()
    ref = diffusers_flux.FluxTransformerBlock(dim=D, num_attention_heads=HEADS, attention_head_dim=D // HEADS).eval()
    _randomize_(ref, gen)
    model = build_model(cfg)
    blk = model.double_blocks[0]
    blk.load_state_dict(mmdit.convert_double_block_state_dict(ref.state_dict()), strict=True)
    b, lt, h, w = 2, 7, 3, 5
    img, txt, temb, ours_pe, their_pe = _block_inputs(cfg, gen, b, lt, h, w)
    with torch.no_grad():
        r_txt, r_img = ref(img, txt, temb, image_rotary_emb=their_pe)
        o_img, o_txt = blk(img, txt, temb, ours_pe)
    assert o_img.shape == (b, h * w, D) and o_txt.shape == (b, lt, D)
    assert rel_error(o_img, r_img) < 1e-5, rel_error(o_img, r_img)
    assert rel_error(o_txt, r_txt) < 1e-5, rel_error(o_txt, r_txt)


def test_single_block_matches_diffusers():
    gen = torch.Generator().manual_seed(2)
    cfg = _cfg()
    ref = diffusers_flux.FluxSingleTransformerBlock(
        dim=D, num_attention_heads=HEADS, attention_head_dim=D // HEADS
    ).eval()
    _randomize_(ref, gen)
    blk = build_model(cfg).single_blocks[0]
    blk.load_state_dict(mmdit.convert_single_block_state_dict(ref.state_dict()), strict=True)
    b, lt, h, w = 3, 5, 4, 3
    img, txt, temb, ours_pe, their_pe = _block_inputs(cfg, gen, b, lt, h, w)
    with torch.no_grad():
        r_txt, r_img = ref(img, txt, temb, image_rotary_emb=their_pe)
        out = blk(torch.cat([txt, img], 1), temb, ours_pe)
    assert out.shape == (b, lt + h * w, D)
    assert rel_error(out[:, lt:], r_img) < 1e-5
    assert rel_error(out[:, :lt], r_txt) < 1e-5


@pytest.mark.parametrize("guidance", [True, False])
def test_whole_model_matches_diffusers(guidance):
    gen = torch.Generator().manual_seed(3)
    ref = diffusers_flux.FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=D // HEADS,
        num_attention_heads=HEADS,
        joint_attention_dim=20,
        pooled_projection_dim=12,
        guidance_embeds=guidance,
        axes_dims_rope=AXES,
    ).eval()
    _randomize_(ref, gen)
    cfg = mmdit.config_from_diffusers(ref.config)
    model = build_model(cfg).eval()
    model.load_state_dict(mmdit.convert_diffusers_state_dict(ref.state_dict()), strict=True)
    b, lt, h, w = 2, 6, 3, 4
    img = torch.randn(b, h * w, 16, generator=gen)
    txt = torch.randn(b, lt, 20, generator=gen)
    y = torch.randn(b, 12, generator=gen)
    t = torch.rand(b, generator=gen)
    g = torch.full((b,), 3.5) if guidance else None
    iid, tid = image_ids(h, w), text_ids(lt)
    with torch.no_grad():
        r = ref(
            hidden_states=img,
            encoder_hidden_states=txt,
            pooled_projections=y,
            timestep=t,
            img_ids=iid,
            txt_ids=tid,
            guidance=g,
            return_dict=False,
        )[0]
        o = model(img, iid, txt, tid, t, y, g)
    assert o.shape == r.shape == (b, h * w, 16)
    assert rel_error(o, r) < 1e-5, rel_error(o, r)


def test_rope_pair_layout_matches_formula():
    gen = torch.Generator().manual_seed(4)
    q, k = (
        torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64),
        torch.randn(2, 3, 5, 8, generator=gen, dtype=torch.float64),
    )
    ang = torch.rand(5, 4, generator=gen, dtype=torch.float64) * 6
    cos, sin = ang.cos(), ang.sin()
    qo, _ = get_variant("rope", "reference")(q, k, cos, sin)
    expect = torch.empty_like(q)
    expect[..., 0::2] = q[..., 0::2] * cos - q[..., 1::2] * sin
    expect[..., 1::2] = q[..., 0::2] * sin + q[..., 1::2] * cos
    assert_close(qo, expect, dtype=torch.float64, name="rope")


def test_shapes_patchify_roundtrip_and_ids():
    lat = torch.randn(2, 4, 6, 10)
    tok = patchify(lat, 2)
    assert tok.shape == (2, 15, 16)
    assert torch.equal(unpatchify(tok, 3, 5, 2), lat)
    ids = image_ids(3, 5)
    assert ids.shape == (15, 3) and ids[:, 1].max() == 2 and ids[:, 2].max() == 4
    cfg = MMDiTConfig.from_preset("tiny")
    model = build_model(cfg)
    b, lt = 2, 9
    out = model(
        tok,
        ids,
        torch.randn(b, lt, cfg.context_dim),
        text_ids(lt),
        torch.rand(b),
        torch.randn(b, cfg.pooled_dim),
        torch.ones(b),
    )
    assert out.shape == tok.shape
    # batched ids (B, L, 3) give the same result as shared ids
    out2 = model(
        tok,
        ids.expand(b, -1, -1),
        torch.zeros(b, lt, cfg.context_dim),
        text_ids(lt).expand(b, -1, -1),
        torch.full((b,), 0.3),
        torch.zeros(b, cfg.pooled_dim),
        torch.ones(b),
    )
    out1 = model(
        tok,
        ids,
        torch.zeros(b, lt, cfg.context_dim),
        text_ids(lt),
        torch.full((b,), 0.3),
        torch.zeros(b, cfg.pooled_dim),
        torch.ones(b),
    )
    assert_close(out2, out1, dtype=torch.float32, name="batched ids")


def _tiny_inputs(cfg, b=2, h=3, w=4, lt=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, h * w, cfg.in_channels, generator=g),
        image_ids(h, w),
        torch.randn(b, lt, cfg.context_dim, generator=g),
        text_ids(lt),
        torch.rand(b, generator=g),
        torch.randn(b, cfg.pooled_dim, generator=g),
        torch.full((b,), 2.0),
    )


def test_gradients_reach_every_parameter():
    model = build_model("tiny").train()
    out = model(*_tiny_inputs(model.cfg))
    out.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("policy", ["full", "selective", "every_other", "single"])
def test_checkpoint_policies_keep_values_and_gradients(policy):
    ref = build_model("tiny", seed=5).train()
    ckpt = build_model("tiny", seed=5, activation_checkpoint=policy).train()
    inputs = _tiny_inputs(ref.cfg, seed=6)
    o_ref, o_ck = ref(*inputs), ckpt(*inputs)
    assert_close(o_ck, o_ref, dtype=torch.float32, name="output")
    o_ref.square().mean().backward()
    o_ck.square().mean().backward()
    for (n, a), (_, b) in zip(ref.named_parameters(), ckpt.named_parameters()):
        assert_close(b.grad, a.grad, dtype=torch.float32, name=f"grad {n}")


def test_txt_mask_ignores_padded_caption_tokens():
    model = build_model("tiny").eval()
    cfg = model.cfg
    img, iid, txt, tid, t, y, g = _tiny_inputs(cfg, lt=6)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    txt2 = txt.clone()
    txt2[0, 4:] = torch.randn(2, cfg.context_dim)  # change only the padded tokens of sample 0
    with torch.no_grad():
        a = model(img, iid, txt, tid, t, y, g, txt_mask=mask)
        b = model(img, iid, txt2, tid, t, y, g, txt_mask=mask)
    assert_close(b, a, dtype=torch.float32, name="masked padding")


def test_presets_param_counts_on_meta():
    for name in PRESETS:
        m = build_model(name, device="meta")
        assert all(p.is_meta for p in m.parameters())
        assert num_params(m) == analytic_param_count(m.cfg), name
    flux = build_model("flux-dev", device="meta")
    assert 11.8e9 < num_params(flux) < 12.0e9  # FLUX.1-dev: ~11.9B
    assert len(flux.double_blocks) == 19 and len(flux.single_blocks) == 38


def test_forward_flops_match_flop_counter_on_meta():
    from torch.utils.flop_counter import FlopCounterMode

    cfg = MMDiTConfig.from_preset("small")
    model = build_model(cfg, device="meta")
    b, h, w, lt = 2, 6, 5, 11
    with torch.device("meta"):
        args = (
            torch.randn(b, h * w, cfg.in_channels),
            image_ids(h, w),
            torch.randn(b, lt, cfg.context_dim),
            text_ids(lt),
            torch.rand(b),
            torch.randn(b, cfg.pooled_dim),
            torch.ones(b),
        )
    with FlopCounterMode(display=False) as fc:
        model(*args)
    assert fc.get_total_flops() == forward_flops(cfg, b, h * w, lt)["total"]


def test_seams_fall_back_or_refuse():
    m = build_model("tiny")
    assert set(m.seams) >= {"attention_path", "recipe", "activation_checkpoint", "kernels.rms_norm"}
    with pytest.raises(ConfigError) as e:
        MMDiTConfig.from_preset("tiny", kernels="no-such-variant")
    assert e.value.param == "kernels"
    with pytest.raises(ConfigError) as e:
        MMDiTConfig.from_preset("tiny", kernels={"default": "eager", "not_an_op": "eager"})
    assert e.value.param == "kernels"
    with pytest.raises(ConfigError) as e:
        MMDiTConfig.from_preset("tiny", activation_checkpoint="sometimes")
    assert e.value.param == "activation_checkpoint"
    with pytest.raises(ConfigError) as e:
        MMDiTConfig.from_preset("tiny", attention_path="no-such-path")
    assert e.value.param == "attention_path"
    with pytest.raises(ConfigError) as e:
        MMDiTConfig.from_preset("tiny", recipe="no-such-recipe")
    assert e.value.param == "recipe"


@pytest.mark.parametrize(
    "kw",
    [
        dict(kernels="reference"),
        dict(kernels={"default": "eager", "rope": "reference"}),
        dict(attention_path="math"),
        dict(recipe="fp8_tensor"),
    ],
)
def test_seams_swap_implementations(kw):
    """Each seam changes what runs, not what is computed (within the recipe's precision)."""
    batch_args = _tiny_inputs(MMDiTConfig.from_preset("tiny"), seed=11)
    ref = build_model("tiny", seed=10)
    alt = build_model("tiny", seed=10, **kw)
    if "kernels" in kw and isinstance(kw["kernels"], dict):
        assert (
            alt.seams["kernels.qk_norm_rope"].startswith("composed")
            and "rope/reference" in alt.seams["kernels.qk_norm_rope"]
        )
    if kw.get("attention_path") == "math":
        assert alt.seams["attention_path"] == "math"
    with torch.no_grad():
        a, b = ref(*batch_args), alt(*batch_args)
    if "recipe" in kw:
        assert alt.seams["recipe"] == "fp8_tensor"
        # the seam applies exactly the recipe: the same model with the recipe applied by hand
        twin = apply_recipe(build_model("tiny", seed=10), "fp8_tensor")
        with torch.no_grad():
            assert_bitwise_equal(b, twin(*batch_args), name="recipe seam vs apply_recipe")
        # e4m3 rounds each scaled operand to within 2^-4 of itself (3 mantissa bits, round to
        # nearest); a matmul of two such operands is off by about sqrt(2)·2^-4/sqrt(3) = 5% rms, and
        # the unconverted paths (embeddings, modulation, the residual stream) only dilute that
        assert 0 < rel_error(b, a) < 2**-4, rel_error(b, a)
    else:
        assert_close(b, a, dtype=torch.float32, name=str(kw))


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(preset="nope"), "preset"),
        (dict(num_heads=128), "num_heads"),  # more heads than hidden_size=64 allows
        (dict(num_heads=5), "num_heads"),  # not a divisor
        (dict(axes_dim=(4, 4, 4)), "axes_dim"),  # does not sum to head_dim 16
        (dict(hidden_size=0), "hidden_size"),
        (dict(mlp_ratio=0), "mlp_ratio"),
    ],
)
def test_bad_config_names_the_parameter(kw, param):
    preset = kw.pop("preset", "tiny")
    with pytest.raises(ConfigError) as e:
        build_model(preset, device="meta", **kw)
    assert e.value.param == param
    assert param in str(e.value)


def test_bad_resolution_names_the_parameter():
    cfg = MMDiTConfig.from_preset("tiny")
    assert cfg.check_resolution(64, 96) == (4, 6)
    for bad in [(100, 64), (64, 8), (0, 64)]:
        with pytest.raises(ConfigError) as e:
            cfg.check_resolution(*bad)
        assert e.value.param == "resolution"
    with pytest.raises(ConfigError) as e:
        patchify(torch.zeros(1, 4, 5, 6), 2)
    assert e.value.param == "resolution"
