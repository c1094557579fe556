"""Step factories for models no one here wrote, at tiny sizes (a step in well under a second
on a CPU): diffusers' ``FluxTransformer2DModel`` and ``SD3Transformer2DModel`` trained with
the rectified-flow objective, and transformers' ``LlamaForCausalLM`` with next-token loss.
Use them as ``step = "lab_utils.step.examples:flux_step"`` (``sd3_step``, ``llama_step``), or
copy one as the start of your own (the README's "Your model" section is the FLUX one, complete)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from lab_utils.step.contract import StepFactory


def _placed(model, device, dtype):
    """On ``device`` in ``dtype`` (no cast when already float32: diffusers warns on any cast)."""
    model = model.to(device)
    return (model if dtype in (None, torch.float32) else model.to(dtype)).train()


def _rf(x0: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rectified flow: t ~ sigmoid(N(0, 1)), x_t = (1 - t) x0 + t noise, target noise - x0."""
    t = torch.sigmoid(torch.randn(x0.shape[0], generator=g)).to(x0.device, x0.dtype)
    noise = torch.randn(x0.shape, generator=g).to(x0.device, x0.dtype)
    tt = t.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - tt) * x0 + tt * noise, t, noise - x0


def flux_step(device="cpu", dtype=torch.float32, batch_size: int = 2, seed: int = 0) -> StepFactory:
    """diffusers' FLUX transformer (2 double + 2 single blocks, 2 heads of 16), 8 x 8 latent
    tokens of 16 channels, 8 text tokens."""
    from diffusers import FluxTransformer2DModel  # noqa: PLC0415  (heavy optional dependency, imported on use)

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    model = _placed(model, device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    h = w = 8
    txt_len = 8
    img_ids = torch.stack(torch.meshgrid(torch.arange(1), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    img_ids = img_ids.reshape(-1, 3).to(device, dtype)
    txt_ids = torch.zeros(txt_len, 3, device=device, dtype=dtype)

    def make_batch(k: int) -> dict:
        g = torch.Generator().manual_seed(seed * 1_000_003 + k)
        return {
            "x0": torch.randn(batch_size, h * w, 16, generator=g).to(device, dtype),
            "txt": torch.randn(batch_size, txt_len, 32, generator=g).to(device, dtype),
            "pooled": torch.randn(batch_size, 32, generator=g).to(device, dtype),
            "k": k,
        }

    def loss(m, b: dict) -> torch.Tensor:
        with record_function("noising"):
            x_t, t, target = _rf(b["x0"], torch.Generator().manual_seed(seed + b["k"]))
        pred = m(
            hidden_states=x_t,
            encoder_hidden_states=b["txt"],
            pooled_projections=b["pooled"],
            timestep=t,
            img_ids=img_ids,
            txt_ids=txt_ids,
            return_dict=False,
        )[0]
        return F.mse_loss(pred.float(), target.float())

    return StepFactory(model, opt, make_batch, loss, phases=("noising",))


def sd3_step(device="cpu", dtype=torch.float32, batch_size: int = 2, seed: int = 0) -> StepFactory:
    """diffusers' SD3 transformer (2 joint blocks, 2 heads of 8), 16 x 16 latents of 4
    channels (8 x 8 tokens), 8 text tokens."""
    from diffusers import SD3Transformer2DModel  # noqa: PLC0415  (heavy optional dependency, imported on use)

    torch.manual_seed(seed)
    model = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=16,
        pooled_projection_dim=32,
        out_channels=4,
        pos_embed_max_size=16,
    )
    model = _placed(model, device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make_batch(k: int) -> dict:
        g = torch.Generator().manual_seed(seed * 1_000_003 + k)
        return {
            "x0": torch.randn(batch_size, 4, 16, 16, generator=g).to(device, dtype),
            "txt": torch.randn(batch_size, 8, 32, generator=g).to(device, dtype),
            "pooled": torch.randn(batch_size, 32, generator=g).to(device, dtype),
            "k": k,
        }

    def loss(m, b: dict) -> torch.Tensor:
        x_t, t, target = _rf(b["x0"], torch.Generator().manual_seed(seed + b["k"]))
        pred = m(
            hidden_states=x_t,
            encoder_hidden_states=b["txt"],
            pooled_projections=b["pooled"],
            timestep=t * 1000,
            return_dict=False,
        )[0]
        return F.mse_loss(pred.float(), target.float())

    return StepFactory(model, opt, make_batch, loss)


def llama_step(device="cpu", dtype=torch.float32, batch_size: int = 2, seed: int = 0) -> StepFactory:
    """transformers' Llama (2 layers, hidden 32, 4 heads / 2 KV heads, vocabulary 128), 32
    tokens per sequence, next-token cross entropy."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415  (heavy optional dependency, imported on use)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).to(device, dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make_batch(k: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + k)
        return torch.randint(0, cfg.vocab_size, (batch_size, 32), generator=g).to(device)

    def loss(m, ids: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, labels=ids, use_cache=False).loss

    return StepFactory(model, opt, make_batch, loss)
