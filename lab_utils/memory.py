"""Where a training step's memory goes: exact accounting of the MMDiT's state and saved
activations, an analytic model that the measurement confirms, timelines, what fits.

Design note
-----------
* **State** (parameters, gradients, AdamW's two moments, fp32 master weights when the
  parameters are in a 16-bit dtype) is counted from the model's parameters, per block
  and per class; it is exact by construction and works on ``meta``.
* **Saved activations** are measured with ``torch.autograd.graph.saved_tensors_hooks``
  over one forward of the rectified-flow loss: every tensor autograd saves is seen,
  parameters are skipped (they are state, not activations), and each *storage* is
  counted once (views share storage, and what a view keeps alive is its whole base).
  A checkpointed block keeps its inputs and, under a selective policy, the outputs torch
  caches; ``lab_utils.model.checkpointing.capture`` reports both.  Each storage is
  attributed to the region (block, embedder, final layer, loss) and the aten op that
  *made* it, observed by a ``TorchDispatchMode``.  Everything works on ``meta`` tensors.
* The **analytic model** (:func:`saved_bytes_formula`) writes the same bytes as a formula
  of width, heads, MLP ratio, sequence lengths and dtype, per region; tests assert it
  equals the measurement exactly for ``tiny`` and ``small`` under every policy that
  ``torch.utils.checkpoint`` or ``save_on_cpu`` implements (``compile_budget`` is the
  partitioner's choice and is measured only).
* **FSDP** shards parameters, gradients and optimizer state over N ranks (each flat
  parameter padded to a multiple of N rows, as ``fully_shard`` does on dim 0);
  activations are not sharded.  :func:`fsdp_rank_state` is checked against real
  ``fully_shard`` runs on gloo (``python -m lab_utils.memory fsdp``).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode
from tqdm.auto import tqdm

from .config import ConfigError, check_choice, check_float, check_int
from .dtypes import dtype_name, parse_dtype
from .model import CHECKPOINT_POLICIES, MMDiTConfig, build_model, resolve_config
from .model.checkpointing import RECOMPUTE_POLICIES, SELECTIVE_POLICIES, block_policy, capture
from .model.train import rf_loss, synthetic_batch
from .timing import try_bench

#: The dtypes the memory lab accounts for (parameters and activations in one dtype).
MEMORY_DTYPES = ("float32", "bfloat16")
#: Memory of one H200 (141 GB, decimal) when no device is given.
H200_BYTES = 141 * 10**9
#: Top-level modules of the MMDiT outside the blocks, each its own region.
EMBED_REGIONS = ("img_in", "txt_in", "time_in", "vector_in", "guidance_in", "pe_embedder", "final_layer")
#: Policies whose saved bytes the analytic model predicts exactly.
FORMULA_POLICIES = tuple(p for p in CHECKPOINT_POLICIES if p != "compile_budget")


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (the same for every view of it, also on ``meta``)."""
    return t.untyped_storage()._cdata


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


# --------------------------------------------------------------------------------------
# Regions: which part of the model is running
# --------------------------------------------------------------------------------------


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


class RegionTracker:
    """A stack of the model's regions, kept by forward pre/post hooks registered from outside
    (blocks by ``named_modules`` name, the embedders and final layer by name); outside the
    model the region is ``outside`` (the loss)."""

    def __init__(self, model: nn.Module, outside: str = "loss"):
        self.stack: list[str] = [outside]
        self.handles = []
        names = set(EMBED_REGIONS) | {n for n, _ in model.named_modules() if n.count(".") == 1 and "blocks." in n}
        for name, mod in model.named_modules():
            if name in names:
                self.handles.append(mod.register_forward_pre_hook(self._enter(name)))
                self.handles.append(mod.register_forward_hook(self._leave(name), always_call=True))
        self.handles.append(model.register_forward_pre_hook(self._enter("model")))
        self.handles.append(model.register_forward_hook(self._leave("model"), always_call=True))

    def _enter(self, name):
        def hook(mod, args):
            self.stack.append(name)

        return hook

    def _leave(self, name):
        def hook(mod, args, out):
            if self.stack[-1] == name:
                self.stack.pop()

        return hook

    @property
    def current(self) -> str:
        return self.stack[-1]

    def remove(self):
        for h in self.handles:
            h.remove()


class CreatorMode(TorchDispatchMode):
    """Remembers, for every storage an op creates, the region and aten op that made it.
    Outputs that share an input's storage (views, in-place ops) keep their creator."""

    def __init__(self, regions: RegionTracker):
        super().__init__()
        self.regions = regions
        self.made: dict[int, tuple[str, str]] = {}
        self.events: list[tuple[str, str, int, int]] = []  # (region, op, storage key, bytes) per new storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                k = storage_key(t)
                if k not in ins:
                    where = (self.regions.current, func.overloadpacket.__name__)
                    self.made[k] = where
                    self.events.append((*where, k, storage_bytes(t)))
        return out


# --------------------------------------------------------------------------------------
# Saved-tensor measurement
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SavedTensor:
    region: str  # "double_blocks.0", "single_blocks.3", "img_in", "model", "loss", "input"
    op: str  # the aten op that made the storage ("input" for tensors made outside the step)
    how: str  # "saved" (autograd), "kept_input" (checkpoint), "selective_cache"
    nbytes: int  # of the whole storage
    shape: tuple
    dtype: str


@dataclass
class SavedReport:
    """The storages kept for the backward after one forward, each counted once."""

    tensors: list[SavedTensor] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def by_region(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for t in self.tensors:
            out[t.region] += t.nbytes
        return dict(out)

    def by_op(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = defaultdict(int)
        for t in self.tensors:
            out[(t.region, t.op)] += t.nbytes
        return dict(out)

    def rows(self) -> list[dict]:
        return [
            dict(region=t.region, op=t.op, how=t.how, bytes=t.nbytes, shape=t.shape, dtype=t.dtype)
            for t in self.tensors
        ]


@contextmanager
def saved_tensor_probe(model: nn.Module) -> Iterator[SavedReport]:
    """Inside: every storage autograd saves (parameters and buffers skipped), every input a
    checkpointed block keeps and every output a selective policy caches, counted once,
    attributed to the region and op that made it.  The report is complete on exit."""
    report = SavedReport()
    state = {storage_key(p) for p in model.parameters()} | {storage_key(b) for b in model.buffers()}
    regions = RegionTracker(model)
    creators = CreatorMode(regions)
    seen: dict[int, tuple[torch.Tensor, str]] = {}

    def note(t: torch.Tensor, how: str) -> None:
        k = storage_key(t)
        if k not in state and k not in seen:
            seen[k] = (t, how)

    def pack(t):
        note(t, "saved")
        return t

    try:
        with capture() as cap, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), creators:
            yield report
        for _, _, ts in cap.kept_inputs:
            for t in ts:
                note(t, "kept_input")
        for _, _, storage in cap.selective_caches:
            for t in tree_leaves(storage):
                t = getattr(t, "val", t)
                if isinstance(t, torch.Tensor):
                    note(t, "selective_cache")
    finally:
        regions.remove()
    for k, (t, how) in seen.items():
        region, op = creators.made.get(k, ("input", "input"))
        report.tensors.append(
            SavedTensor(region, op, how, storage_bytes(t), tuple(t.shape), str(t.dtype).replace("torch.", ""))
        )


# --------------------------------------------------------------------------------------
# The analytic model of saved activations
# --------------------------------------------------------------------------------------


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
    for n in (sh.img_tokens, sh.txt_tokens):
        rows = b * n
        own += 8 * rows * d * s  # 2 LN outs, 2 modulated inputs, attn out slice, proj out, residual, fc2 out
        own += 2 * rows * m * s  # fc1 out (GELU input), GELU out (fc2 input)
        own += 9 * b * d * s  # SiLU(vec), adaLN out (6D), two (1 + scale)
        own += 4 * rows * (stat or s)  # LayerNorm mean and rstd, twice
        own += 2 * b * h * n * 4  # RMSNorm rrms of q and k (float32)
        own += 2 * n * dh * 8  # RoPE 2x2 rotation tables of q and k (float32)
        own += _qk_extra(rows, d, s) + (3 * rows * d * s if s == 4 else 0)  # float32: q/k are views of qkv
    rows = b * sh.tokens
    own += 4 * rows * d * s + b * h * sh.tokens * 4  # cat q, k, v; attention out + logsumexp
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
    policy = policy or cfg.checkpoint
    check_choice("checkpoint", policy, FORMULA_POLICIES)
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
    first_offloaded = offload and nd > 0
    out["img_in"] = 0 if first_offloaded else b * li * d * s
    out["txt_in"] = 0 if first_offloaded else b * lt * d * s
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
    cfg: MMDiTConfig, dtype: str | torch.dtype, kind: str = "single", tokens: int = 4096, txt_tokens: int = 512
) -> float:
    """Saved bytes of one block with no checkpointing per token of its sequence (batch 1)."""
    sh = StepShape(1, tokens - txt_tokens, txt_tokens)
    s = parse_dtype("dtype", dtype).itemsize
    parts = (double_block_bytes if kind == "double" else single_block_bytes)(cfg, sh, s)
    return (parts["own"] + parts["output"]) / tokens


def measure_saved(
    cfg: MMDiTConfig | str,
    sh: StepShape,
    dtype: str | torch.dtype = "float32",
    policy: str | None = None,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    model: nn.Module | None = None,
) -> SavedReport:
    """Run the forward of one rectified-flow step (batch built outside the probe) and return
    what it keeps for the backward.  ``device="meta"`` works for every preset."""
    cfg = resolve_config(cfg)
    if policy is not None:
        cfg = cfg.replace(checkpoint=policy)
    dt = parse_dtype("dtype", dtype)
    dev = torch.device(device)
    if model is None:
        model = build_model(cfg, device=dev, dtype=dt, seed=seed)
    model.train()
    gen = torch.Generator(device="cpu").manual_seed(seed) if dev.type != "meta" else None
    batch = batch_for(cfg, sh, dt, dev, gen)
    with saved_tensor_probe(model) as report:
        loss = rf_loss(model, batch, gen)
    del loss
    return report


def batch_for(cfg: MMDiTConfig, sh: StepShape, dt: torch.dtype, dev: torch.device, gen=None):
    """A synthetic batch of ``sh`` (square-ish grid: img_tokens = 1 x img_tokens when not square)."""
    ppt = cfg.pixels_per_token
    h = int(math.isqrt(sh.img_tokens))
    while sh.img_tokens % h:
        h -= 1
    w = sh.img_tokens // h
    return synthetic_batch(
        cfg, sh.batch, height=h * ppt, width=w * ppt, txt_len=sh.txt_tokens, generator=gen, device=dev, dtype=dt
    )


# --------------------------------------------------------------------------------------
# State: parameters, gradients, optimizer
# --------------------------------------------------------------------------------------

#: Memory classes of a training step, in stacking order.
CLASSES = ("parameters", "gradients", "optimizer", "master_weights", "activations", "transient")


def block_of(param_name: str) -> str:
    """Region of a parameter name: "double_blocks.3", "single_blocks.0", "img_in", ..."""
    parts = param_name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("double_blocks", "single_blocks") else parts[0]


def state_bytes(model: nn.Module, dtype: str | torch.dtype | None = None) -> dict[str, dict[str, int]]:
    """Per region: parameter, gradient and AdamW bytes (two fp32 moments and, for 16-bit
    parameters, fp32 master weights the optimizer updates).  Works on ``meta``."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(CLASSES[:4], 0))
    for name, p in model.named_parameters():
        dt = parse_dtype("dtype", dtype) if dtype is not None else p.dtype
        n, s = p.numel(), dt.itemsize
        row = out[block_of(name)]
        row["parameters"] += n * s
        row["gradients"] += n * s
        row["optimizer"] += 2 * n * 4  # moments live beside the fp32 (master) weights
        row["master_weights"] += n * 4 if s < 4 else 0
    return dict(out)


def state_totals(cfg: MMDiTConfig, dtype: str | torch.dtype) -> dict[str, int]:
    """Parameter, gradient, optimizer and master-weight bytes of a preset (built on meta)."""
    model = build_model(cfg, device="meta", dtype=parse_dtype("dtype", dtype))
    tot = dict.fromkeys(CLASSES[:4], 0)
    for row in state_bytes(model).values():
        for k, v in row.items():
            tot[k] += v
    return tot


def transient_bytes(cfg: MMDiTConfig, sh: StepShape, dtype: str | torch.dtype, policy: str) -> int:
    """Model of the transient peak above the saved activations during the backward: the
    gradients of the widest activation (in and out, 2 x B·L·(3D+M)) plus, when a block is
    recomputed, that block's re-materialised activations."""
    s = parse_dtype("dtype", dtype).itemsize
    rows = sh.batch * sh.tokens
    widest = rows * (3 * cfg.hidden_size + cfg.mlp_hidden) * s
    recompute = 0
    if policy in RECOMPUTE_POLICIES or policy == "offload":
        recompute = max(
            single_block_bytes(cfg, sh, s)["own"] if cfg.depth_single else 0,
            double_block_bytes(cfg, sh, s)["own"] if cfg.depth_double else 0,
        )
    return 2 * widest + recompute


def predicted_peak(
    cfg: MMDiTConfig, sh: StepShape, dtype: str | torch.dtype, policy: str, *, shards: int = 1, state=None
) -> dict[str, int]:
    """Per class, the predicted peak of one AdamW step (state sharded over ``shards`` ranks)."""
    dev_type = "cuda"
    pol = "none" if policy == "compile_budget" else policy  # the partitioner's choice: bounded by none
    st = state if state is not None else state_totals(cfg, dtype)
    out = {k: int(math.ceil(v / shards)) for k, v in st.items()}
    out["activations"] = sum(saved_bytes_formula(cfg, sh, dtype, pol, device_type=dev_type).values())
    out["transient"] = transient_bytes(cfg, sh, dtype, pol)
    out["total"] = sum(out[k] for k in CLASSES)
    return out


# --------------------------------------------------------------------------------------
# FSDP per-rank projection
# --------------------------------------------------------------------------------------


def fsdp_rank_state(model: nn.Module, world_size: int, rank: int = 0, dtype=None) -> dict[str, int]:
    """Per-rank parameter, gradient and AdamW bytes under ``fully_shard`` over ``world_size``
    ranks: each parameter is split on dim 0 in ``ceil(rows / N)``-row chunks (the last ranks
    may hold fewer rows, or none)."""
    check_int("world_size", world_size, min=1)
    check_int("rank", rank, min=0, max=world_size - 1)
    out = dict.fromkeys(CLASSES[:4], 0)
    for p in model.parameters():
        dt = parse_dtype("dtype", dtype) if dtype is not None else p.dtype
        rows = p.shape[0] if p.dim() else 1
        per_row = p.numel() // max(rows, 1)
        chunk = math.ceil(rows / world_size)
        mine = max(0, min(chunk, rows - rank * chunk))
        n, s = mine * per_row, dt.itemsize
        out["parameters"] += n * s
        out["gradients"] += n * s
        out["optimizer"] += 2 * n * 4
        out["master_weights"] += n * 4 if s < 4 else 0
    return out


def gpus_needed(
    cfg: MMDiTConfig, sh: StepShape, dtype, policy: str, device_bytes: int, max_gpus: int = 64
) -> int | None:
    """Fewest ranks (FSDP: state sharded, activations not) whose per-rank peak fits ``device_bytes``."""
    check_float("device_memory_gb", device_bytes, min=0, min_exclusive=True)
    st = state_totals(cfg, dtype)
    for n in range(1, max_gpus + 1):
        if predicted_peak(cfg, sh, dtype, policy, shards=n, state=st)["total"] <= device_bytes:
            return n
    return None


# --------------------------------------------------------------------------------------
# What fits
# --------------------------------------------------------------------------------------


def default_device_bytes() -> int:
    """The current CUDA device's memory, else one H200's (141 GB)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return H200_BYTES


def what_fits(
    cfg: MMDiTConfig,
    dtype,
    policy: str,
    device_bytes: int,
    resolutions: Iterable[int] = (256, 512, 768, 1024, 1536, 2048),
    txt_len: int = 512,
    max_batch: int = 1024,
    shards: int = 1,
) -> list[dict]:
    """For each square resolution, the largest batch whose predicted peak fits (0 = none)."""
    check_float("device_memory_gb", device_bytes, min=0, min_exclusive=True)
    st = state_totals(cfg, dtype)
    rows = []
    for res in resolutions:
        sh1 = step_shape(cfg, 1, res, res, txt_len)
        lo, hi = 0, max_batch
        while lo < hi:  # largest b with peak(b) <= device_bytes
            mid = (lo + hi + 1) // 2
            peak = predicted_peak(cfg, StepShape(mid, sh1.img_tokens, txt_len), dtype, policy, shards=shards, state=st)
            lo, hi = (mid, hi) if peak["total"] <= device_bytes else (lo, mid - 1)
        best = lo
        peak = predicted_peak(
            cfg, StepShape(max(best, 1), sh1.img_tokens, txt_len), dtype, policy, shards=shards, state=st
        )
        rows.append(
            dict(
                preset=cfg.preset,
                policy=policy,
                resolution=res,
                img_tokens=sh1.img_tokens,
                max_batch=best,
                predicted_peak_bytes=peak["total"] if best else None,
            )
        )
    return rows


def _fsdp_worker(rank: int, world_size: int, preset: str, port: int, out_dir: str) -> None:
    """One rank: fully_shard every block and the root, one AdamW step on gloo, then write
    this rank's local parameter, gradient and optimizer-state bytes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = build_model(preset, seed=0)
        for blk in model.blocks():
            fully_shard(blk)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = synthetic_batch(
            preset, 1, height=32, width=32, txt_len=4, generator=torch.Generator().manual_seed(rank)
        )
        rf_loss(model, batch, torch.Generator().manual_seed(rank)).backward()
        opt.step()
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        got = dict(
            rank=rank,
            world_size=world_size,
            parameters=sum(local(p).numel() * p.element_size() for p in model.parameters()),
            gradients=sum(local(p.grad).numel() * p.grad.element_size() for p in model.parameters()),
            optimizer=sum(
                local(v).numel() * v.element_size()
                for st in opt.state.values()
                for k, v in st.items()
                if k != "step" and torch.is_tensor(v)
            ),
        )
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def run_fsdp(preset: str = "tiny", world_size: int = 2, timeout_s: float = 180.0) -> list[dict]:
    """Per-rank state bytes of a real ``fully_shard`` AdamW step over ``world_size`` gloo
    processes (``python -m lab_utils.memory fsdp``), with the projection beside each.  The
    process group is killed on timeout, so no process is left behind."""
    check_int("world_size", world_size, min=1, max=16)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "lab_utils.memory", "fsdp", preset, str(world_size), tmp]
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise RuntimeError(f"FSDP run at world_size={world_size} timed out after {timeout_s} s") from None
        if proc.returncode:
            raise RuntimeError(f"FSDP run at world_size={world_size} failed:\n{log.decode()[-3000:]}")
        got = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]
    model = build_model(preset, device="meta")
    for row in got:
        proj = fsdp_rank_state(model, world_size, row["rank"])
        for k in ("parameters", "gradients", "optimizer"):
            row[f"projected_{k}"] = proj[k]
    return got


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":  # python -m lab_utils.memory fsdp PRESET WORLD_SIZE OUT_DIR
    if len(sys.argv) == 5 and sys.argv[1] == "fsdp":
        ws = int(sys.argv[3])
        mp.start_processes(
            _fsdp_worker, args=(ws, sys.argv[2], _free_port(), sys.argv[4]), nprocs=ws, start_method="spawn"
        )
    else:
        sys.exit("usage: python -m lab_utils.memory fsdp PRESET WORLD_SIZE OUT_DIR")


# --------------------------------------------------------------------------------------
# AC policies on the same step: peak, saved bytes, time, recomputed FLOPs, gradients
# --------------------------------------------------------------------------------------

#: Gradient tolerance of a policy against no checkpointing, per dtype (atol, rtol): recompute
#: replays the same kernels, so on CPU the gradients agree to rounding of reordered sums.
GRAD_TOL = {"float32": (1e-6, 1e-5), "bfloat16": (2e-2, 2e-2)}


def step_grads(cfg: MMDiTConfig, sh: StepShape, dtype, policy: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients of one rectified-flow step under ``policy`` (same weights and batch for every policy)."""
    dt = parse_dtype("dtype", dtype)
    model = build_model(cfg.replace(checkpoint=policy), dtype=dt, seed=seed)
    model.train()
    gen = torch.Generator().manual_seed(seed)
    batch = batch_for(cfg, sh, dt, torch.device("cpu"), gen)
    rf_loss(model, batch, gen).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def grad_mismatch(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], dtype) -> list[str]:
    """Names of parameters whose gradient differs beyond :data:`GRAD_TOL` (empty = equal)."""
    atol, rtol = GRAD_TOL[dtype_name(dtype)]
    return [n for n in ref if not torch.allclose(got[n].float(), ref[n].float(), atol=atol, rtol=rtol)]


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    saved_bytes: int  # measured by the saved-tensor hooks
    formula_bytes: int | None  # the analytic model (None for compile_budget)
    peak_bytes: int  # allocator peak of one step above the state before it
    flops: float  # counted FLOPs of forward + backward
    timing: object  # lab_utils.timing Timing or BenchFailure
    grads_equal: bool


def step_flops(model: nn.Module, batch, gen_seed: int = 0) -> float:
    with FlopCounterMode(display=False) as fc:
        rf_loss(model, batch, torch.Generator(device=batch.img.device).manual_seed(gen_seed)).backward()
    model.zero_grad(set_to_none=True)
    return float(fc.get_total_flops())


def step_peak(model: nn.Module, batch, seed: int = 0) -> int:
    """Peak bytes allocated during one forward + backward above what was live before: CUDA's
    allocator statistics, or on CPU the profiler's memory events (their running sum)."""
    dev = batch.img.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        rf_loss(model, batch, gen).backward()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
    else:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            rf_loss(model, batch, gen).backward()
        events = sorted(
            (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
        )
        live = peak = 0
        for _, nbytes in events:  # +allocation / -free, in time order
            live += nbytes
            peak = max(peak, live)
    model.zero_grad(set_to_none=True)
    return int(peak)


def compare_policies(
    cfg: MMDiTConfig,
    sh: StepShape,
    dtype,
    policies: Iterable[str],
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    reps: int = 5,
    progress: bool = True,
) -> list[PolicyResult]:
    """Every policy on the same weights and batch: saved bytes (hooks and formula), allocator
    peak, counted FLOPs, step time (``lab_utils.timing``) and its gradients against no
    checkpointing (a mismatch raises)."""
    dt = parse_dtype("dtype", dtype)
    dev = torch.device(device)
    policies = list(policies)
    ref = step_grads(cfg, sh, dt, "none", seed) if dev.type == "cpu" else None
    out = []
    for pol in tqdm(policies, desc="AC policies", disable=not progress):
        pcfg = cfg.replace(checkpoint=pol)
        model = build_model(pcfg, device=dev, dtype=dt, seed=seed)
        model.train()
        batch = batch_for(pcfg, sh, dt, dev, torch.Generator(device="cpu").manual_seed(seed))
        saved = measure_saved(pcfg, sh, dt, device=dev, seed=seed, model=model).total
        formula = (
            sum(saved_bytes_formula(pcfg, sh, dt, device_type=dev.type).values()) if pol in FORMULA_POLICIES else None
        )
        peak = step_peak(model, batch, seed)
        flops = step_flops(model, batch, seed)

        def step(model=model, batch=batch):
            rf_loss(model, batch, torch.Generator(device=dev).manual_seed(seed)).backward()
            model.zero_grad(set_to_none=True)

        timing = try_bench(step, name=f"step-{pol}", device=dev, reps=reps, budget_s=60, check_finite=False)
        equal = True
        if ref is not None:
            bad = grad_mismatch(ref, step_grads(cfg, sh, dt, pol, seed), dt)
            if bad:
                raise AssertionError(f"policy {pol!r}: gradients differ from no checkpointing in {bad[:5]}")
        out.append(PolicyResult(pol, saved, formula, peak, flops, timing, equal))
    return out


# --------------------------------------------------------------------------------------
# Timelines
# --------------------------------------------------------------------------------------

#: Categories of the profiler's memory timeline (torch.profiler's memory profile).
TIMELINE_CATEGORIES = (
    "parameters",
    "optimizer",
    "inputs",
    "temporaries",
    "activations",
    "gradients",
    "autograd",
    "unknown",
)


def profiled_timeline(fn, path: str | Path) -> pd.DataFrame:
    """Run ``fn()`` under the profiler's memory events (``profile_memory=True``), categorized by
    torch's memory profile; the full timeline is written to ``path`` (JSON) and returned as a
    frame: time (ms from the first event) and live bytes per category."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        fn()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # deprecated for CUDA in favour of the snapshot, which CPU lacks
        warnings.simplefilter("ignore", FutureWarning)
        prof.export_memory_timeline(str(path), device="cpu")
    times, sizes = json.loads(path.read_text())
    # each row: a leading unused slot, then one column per category in torch's order
    df = pd.DataFrame([row[1 : 1 + len(TIMELINE_CATEGORIES)] for row in sizes], columns=list(TIMELINE_CATEGORIES))
    df.insert(0, "time_ms", (pd.Series(times, dtype=float) - (times[0] if times else 0)) / 1e3)
    return df


def cpu_timeline(model: nn.Module, batch, opt: torch.optim.Optimizer, path: str | Path, seed: int = 0) -> pd.DataFrame:
    """One AdamW step's categorized memory timeline on CPU (see :func:`profiled_timeline`)."""
    gen = torch.Generator(device=batch.img.device).manual_seed(seed)

    def step():
        rf_loss(model, batch, gen).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return profiled_timeline(step, path)


def cuda_timeline(model: nn.Module, batch, opt: torch.optim.Optimizer, path: str | Path, seed: int = 0) -> pd.DataFrame:
    """One AdamW step under ``torch.cuda.memory._record_memory_history``; the snapshot goes to
    ``path`` (pickle, for pytorch.org/memory_viz) and its trace is categorized by address:
    parameters, gradients and optimizer state are known tensors, the rest is activations
    (alive at the end of the forward) or temporaries."""
    dev = batch.img.device
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        gen = torch.Generator(device=dev).manual_seed(seed)
        loss = rf_loss(model, batch, gen)
        torch.cuda.synchronize(dev)
        fwd_end = time.monotonic_ns()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize(dev)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(snap))
    known = {}
    for p in model.parameters():
        known[p.data_ptr()] = "parameters"
        if p.grad is not None:
            known[p.grad.data_ptr()] = "gradients"
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.is_cuda:
                known[v.data_ptr()] = "optimizer"
    live: dict[int, tuple[str, int]] = {}
    rows = []
    totals = defaultdict(int)
    t0 = None
    for trace in snap.get("device_traces", []):
        for ev in trace:
            if ev["action"] not in ("alloc", "free_completed"):
                continue
            t = ev.get("time_us", 0)
            t0 = t if t0 is None else t0
            addr, size = ev["addr"], ev["size"]
            if ev["action"] == "alloc":
                cat = known.get(addr) or ("activations" if t * 1000 <= fwd_end else "temporaries")
                live[addr] = (cat, size)
                totals[cat] += size
            elif addr in live:
                cat, size = live.pop(addr)
                totals[cat] -= size
            rows.append({"time_ms": (t - t0) / 1e3, **{c: totals[c] for c in CUDA_CATEGORIES}})
    return pd.DataFrame(rows, columns=["time_ms", *CUDA_CATEGORIES])


def alloc_conf() -> str:
    """The CUDA caching allocator's settings (``expandable_segments:True`` cuts fragmentation)."""
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))


def bisect_fit(cfg: MMDiTConfig, policy: str, resolution: int, txt_len: int, hi: int = 64) -> tuple[int, int]:
    """On CUDA, the largest batch whose real bf16 AdamW step runs, by bisection over [0, hi];
    each OOM is caught (counted, memory released) and the search goes on.  (edge, OOMs)."""
    dev = torch.device("cuda")
    model = build_model(cfg.replace(checkpoint=policy), device=dev, dtype=torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    sh1 = step_shape(cfg, 1, resolution, resolution, txt_len)
    lo, ooms = 0, 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            batch = batch_for(cfg, StepShape(mid, sh1.img_tokens, txt_len), torch.bfloat16, dev)
            rf_loss(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(dev)
            lo = mid
        except torch.OutOfMemoryError:
            ooms += 1
            hi = mid - 1
        finally:
            batch = None
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    return lo, ooms


CUDA_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")


def downsample(df: pd.DataFrame, max_points: int = 2000) -> pd.DataFrame:
    """At most ``max_points`` rows for a plot, keeping each bucket's maximum total (peaks survive)."""
    if len(df) <= max_points:
        return df
    cats = [c for c in df.columns if c != "time_ms"]
    bucket = (pd.Series(range(len(df))) * max_points // len(df)).to_numpy()
    total = df[cats].sum(axis=1).to_numpy()
    keep = pd.DataFrame({"b": bucket, "t": total}).groupby("b")["t"].idxmax().to_numpy()
    return df.iloc[keep].reset_index(drop=True)


def largest_live(report: SavedReport, top: int = 10) -> list[SavedTensor]:
    """The largest storages kept for the backward (what is live at the end of the forward,
    where an AC step's memory peaks), with the region and op that made them."""
    return sorted(report.tensors, key=lambda t: -t.nbytes)[:top]
