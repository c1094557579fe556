"""The analytic model of perflab's MMDiT's saved activations: per block and region, from width,
heads, MLP ratio, sequence lengths and dtype, for every policy that ``torch.utils.checkpoint`` or
``save_on_cpu`` implements (``compile_budget`` is the partitioner's choice and is measured only).
It equals the measurement (:func:`lab_utils.memory.saved.measure_saved` on the MMDiT's step) byte
for byte on CPU (tests), and projects to shapes no CPU holds (flux-dev at 1024 px)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lab_utils.core.config import ConfigError, check_choice, check_int
from lab_utils.core.dtypes import parse_dtype
from lab_utils.model import CHECKPOINT_POLICIES, MMDiTConfig
from lab_utils.model.checkpointing import RECOMPUTE_POLICIES, SELECTIVE_POLICIES, block_policy
from lab_utils.model.train import synthetic_batch

#: The dtypes the memory lab accounts for (parameters and activations in one dtype).
MEMORY_DTYPES = ("float32", "bfloat16")
#: Top-level modules of the MMDiT outside the blocks, each its own region.
EMBED_REGIONS = ("img_in", "txt_in", "time_in", "vector_in", "guidance_in", "pe_embedder", "final_layer")
#: Policies whose saved bytes the analytic model predicts exactly.
FORMULA_POLICIES = tuple(p for p in CHECKPOINT_POLICIES if p != "compile_budget")


def block_names(cfg: MMDiTConfig) -> list[str]:
    return [f"double_blocks.{i}" for i in range(cfg.depth_double)] + [
        f"single_blocks.{i}" for i in range(cfg.depth_single)
    ]


def check_block(cfg: MMDiTConfig, block: str, param: str = "block") -> str:
    """``block`` as "double_blocks.i" / "single_blocks.i"; an index out of range names ``param``."""
    names = block_names(cfg)
    if block not in names:
        raise ConfigError(
            param,
            block,
            f"one of double_blocks.0..{cfg.depth_double - 1}, "
            f"single_blocks.0..{cfg.depth_single - 1} (preset {cfg.preset!r})",
        )
    return block


@dataclass(frozen=True)
class StepShape:
    """One step's token shape: batch, image tokens, text tokens."""

    batch: int
    img_tokens: int
    txt_tokens: int

    @property
    def tokens(self) -> int:
        return self.img_tokens + self.txt_tokens


def step_shape(cfg: MMDiTConfig, batch: int, height: int, width: int, txt_len: int) -> StepShape:
    check_int("batch_size", batch, min=1)
    check_int("txt_len", txt_len, min=1)
    h, w = cfg.check_resolution(height, width)
    return StepShape(batch, h * w, txt_len)


def _qk_extra(n_tokens: int, d: int, s: int) -> int:
    """QK-norm's saved float32 work for q and k of ``n_tokens`` rows: in float32 the
    normalised q/k (x·rrms); in a 16-bit dtype the float32 upcasts and the rounded
    normalised q/k."""
    return 2 * n_tokens * d * 4 + (0 if s == 4 else 2 * n_tokens * d * s)


def double_block_bytes(cfg: MMDiTConfig, sh: StepShape, s: int, stat: int | None = None) -> dict[str, int]:
    """Bytes a double-stream block saves with no checkpointing, by part: ``own`` (made and
    freed inside the block) and ``output`` (img and txt out, kept by whoever reads them)."""
    b, d, m, h, dh = sh.batch, cfg.hidden_size, cfg.mlp_hidden, cfg.num_heads, cfg.head_dim
    own = 0
    views = 0  # streams whose slice of the joint attention output the projection saves as a view
    for n in (sh.img_tokens, sh.txt_tokens):
        rows = b * n
        # The projection flattens its (B, n, D) slice of the joint output o (B, Li+Lt, D):
        # a view when B == 1 or n == 1, else a copy of the slice.  A view keeps all of o.
        if b == 1 or n == 1:
            views += 1
        else:
            own += rows * d * s  # the copied slice
        own += 7 * rows * d * s  # 2 LN outs, 2 modulated inputs, proj out, residual, fc2 out
        own += 2 * rows * m * s  # fc1 out (GELU input), GELU out (fc2 input)
        own += 9 * b * d * s  # SiLU(vec), adaLN out (6D), two (1 + scale)
        own += 4 * rows * (stat or s)  # LayerNorm mean and rstd, twice
        own += 2 * b * h * n * 4  # RMSNorm rrms of q and k (float32)
        own += 2 * n * dh * 8  # RoPE 2x2 rotation tables of q and k (float32)
        own += _qk_extra(rows, d, s) + (3 * rows * d * s if s == 4 else 0)  # float32: q/k are views of qkv
    rows = b * sh.tokens
    own += 4 * rows * d * s + b * h * sh.tokens * 4  # cat q, k, v; attention out + logsumexp
    own += rows * d * s if views else 0  # o itself, kept whole by a viewed slice
    return {"own": own, "output": rows * d * s}


def single_block_bytes(cfg: MMDiTConfig, sh: StepShape, s: int, stat: int | None = None) -> dict[str, int]:
    """Bytes a single-stream block saves with no checkpointing (see :func:`double_block_bytes`)."""
    b, d, m, h, dh = sh.batch, cfg.hidden_size, cfg.mlp_hidden, cfg.num_heads, cfg.head_dim
    n = sh.tokens
    rows = b * n
    own = 6 * rows * d * s  # LN out, modulated input, q and k after RoPE, attention out, linear2 out
    own += rows * (3 * d + m) * s  # linear1 out (q k v | mlp; GELU reads it)
    own += rows * (d + m) * s  # cat(attn, GELU(mlp)), linear2's input
    own += b * h * n * 4  # attention logsumexp
    own += 5 * b * d * s  # SiLU(vec), adaLN out (3D), (1 + scale)
    own += 2 * rows * (stat or s) + 2 * b * h * n * 4 + 2 * n * dh * 8  # LN stats, rrms, RoPE tables
    own += _qk_extra(rows, d, s)
    return {"own": own, "output": rows * d * s}


def selective_cache_bytes(cfg: MMDiTConfig, sh: StepShape, s: int, kind: str, policy: str) -> int:
    """What a selective ``policy`` caches in one block: matmul and/or attention outputs."""
    b, d, m, h = sh.batch, cfg.hidden_size, cfg.mlp_hidden, cfg.num_heads
    fams = SELECTIVE_POLICIES[policy]
    out = 0
    if "matmul" in fams:
        if kind == "double":
            for n in (sh.img_tokens, sh.txt_tokens):
                out += 6 * b * d * s + b * n * (3 * d + d + m + d) * s  # adaLN, qkv, proj, fc1, fc2
        else:
            out += 3 * b * d * s + b * sh.tokens * ((3 * d + m) + d) * s  # adaLN, linear1, linear2
    if "attention" in fams:
        out += b * sh.tokens * d * s + b * h * sh.tokens * 4
    return out


def saved_bytes_formula(
    cfg: MMDiTConfig, sh: StepShape, dtype: str | torch.dtype, policy: str | None = None, device_type: str = "cpu"
) -> dict[str, int]:
    """Bytes kept for the backward after the forward of one rectified-flow step, per region,
    from the config alone (device bytes: under ``offload`` what sits in host memory is left
    out).  Equals :func:`measure_saved` exactly on CPU for every policy in
    :data:`FORMULA_POLICIES` (tests).  ``device_type="cuda"`` keeps LayerNorm statistics in
    float32 as CUDA's kernels do (CPU keeps them in the input dtype); flash attention's few
    RNG-state bytes are left out."""
    policy = policy or cfg.activation_checkpoint
    check_choice("activation_checkpoint", policy, FORMULA_POLICIES)
    s = parse_dtype("dtype", dtype).itemsize
    stat = s if device_type == "cpu" else 4
    b, d, c = sh.batch, cfg.hidden_size, cfg.in_channels
    li, lt, n = sh.img_tokens, sh.txt_tokens, sh.tokens
    nd, ns = cfg.depth_double, cfg.depth_single
    offload = policy == "offload"
    out: dict[str, int] = {}
    kinds = [("double", i) for i in range(nd)] + [("single", i) for i in range(ns)]
    for kind, i in kinds:
        parts = (double_block_bytes if kind == "double" else single_block_bytes)(cfg, sh, s, stat)
        treated = block_policy(policy, kind, i)
        if not treated:
            own = parts["own"]
        elif policy in SELECTIVE_POLICIES:
            own = selective_cache_bytes(cfg, sh, s, kind, policy)
        else:
            own = 0
        # The output is kept by the next block (saved, or kept as a checkpoint input) or
        # by the final layer; the last double block's outputs are only concatenated.
        last_double = kind == "double" and i == nd - 1
        last_single = kind == "single" and i == ns - 1
        if last_double:
            kept = 0
        elif offload:
            kept = parts["output"] if last_single else 0
        else:
            kept = parts["output"]
        out[f"{kind}_blocks.{i}"] = own + kept
    # img_in / txt_in outputs are kept by the first double block; with no double block they
    # are only concatenated (cat saves nothing) and the joint sequence is counted in "model".
    first_keeps = nd > 0 and not offload
    out["img_in"] = b * li * d * s if first_keeps else 0
    out["txt_in"] = b * lt * d * s if first_keeps else 0
    for name in ("time_in", "vector_in") + (("guidance_in",) if cfg.guidance_embed else ()):
        out[name] = 2 * b * d * s
    cat_kept = not (offload and ns > 0)
    out["model"] = b * d * s + (2 if cfg.guidance_embed else 1) * b * 256 * s + (b * n * d * s if cat_kept else 0)
    ckpt_inputs = policy in RECOMPUTE_POLICIES and any(block_policy(policy, k, i) for k, i in kinds)
    out["pe_embedder"] = 4 * n * cfg.head_dim if ckpt_inputs else 0
    out["final_layer"] = 2 * b * d * s + 2 * b * li * stat + 2 * b * li * d * s + (b * li * c * 4 if s == 4 else 0)
    out["loss"] = b * li * c * s + (1 if s == 4 else 2) * b * li * c * 4
    out["input"] = b * lt * cfg.context_dim * s + b * cfg.pooled_dim * s
    return {k: v for k, v in out.items() if v}


def bytes_per_token_per_block(
    cfg: MMDiTConfig,
    dtype: str | torch.dtype,
    kind: str = "single",
    img_tokens: int = 4096,
    txt_tokens: int = 512,
    device_type: str = "cuda",
) -> float:
    """Saved bytes of one block with no checkpointing (batch 1) per token of its sequence of
    ``img_tokens + txt_tokens`` tokens; LayerNorm statistics in float32 on ``cuda``, in the
    activation dtype on ``cpu`` (see :func:`saved_bytes_formula`)."""
    check_choice("kind", kind, ("double", "single"))
    check_int("img_tokens", img_tokens, min=1)
    check_int("txt_tokens", txt_tokens, min=1)
    check_choice("device_type", device_type, ("cpu", "cuda"))
    sh = StepShape(1, img_tokens, txt_tokens)
    s = parse_dtype("dtype", dtype).itemsize
    stat = s if device_type == "cpu" else 4
    parts = (double_block_bytes if kind == "double" else single_block_bytes)(cfg, sh, s, stat)
    return (parts["own"] + parts["output"]) / sh.tokens


def pixels_of(cfg: MMDiTConfig, sh: StepShape) -> tuple[int, int]:
    """Height and width in pixels of ``sh``'s image tokens (the squarest grid that holds them)."""
    ppt = cfg.pixels_per_token
    h = int(math.isqrt(sh.img_tokens))
    while sh.img_tokens % h:
        h -= 1
    return h * ppt, sh.img_tokens // h * ppt


def batch_for(cfg: MMDiTConfig, sh: StepShape, dt: torch.dtype, dev: torch.device, gen=None):
    """A synthetic batch of ``sh`` (square-ish grid: img_tokens = 1 x img_tokens when not square)."""
    height, width = pixels_of(cfg, sh)
    return synthetic_batch(
        cfg, sh.batch, height=height, width=width, txt_len=sh.txt_tokens, generator=gen, device=dev, dtype=dt
    )
