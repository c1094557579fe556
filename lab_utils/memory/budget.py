"""State per class, the predicted peak of a step, per-rank bytes under FSDP, what fits a
device (predicted, and on CUDA bisected to the OOM edge)."""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from lab_utils.core.config import ConfigError, check_float, check_int
from lab_utils.core.datasheets import DATASHEET, PART_HELP, identify
from lab_utils.core.dtypes import parse_dtype
from lab_utils.memory.fits import oom_bisect
from lab_utils.memory.formula import (
    StepShape,
    batch_for,
    double_block_bytes,
    saved_bytes_formula,
    single_block_bytes,
    step_shape,
)
from lab_utils.memory.master import MasterAdamW
from lab_utils.model import MMDiTConfig, build_model
from lab_utils.model.checkpointing import RECOMPUTE_POLICIES
from lab_utils.model.train import rf_loss

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


@functools.lru_cache(maxsize=16)
def meta_model(cfg: MMDiTConfig) -> nn.Module:
    """The model of ``cfg`` on ``meta`` (float32; no memory), built once per config."""
    return build_model(cfg, device="meta")


def state_totals(cfg: MMDiTConfig, dtype: str | torch.dtype) -> dict[str, int]:
    """Parameter, gradient, optimizer and master-weight bytes of a preset (built on meta)."""
    tot = dict.fromkeys(CLASSES[:4], 0)
    for row in state_bytes(meta_model(cfg), dtype).values():
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
    """Per class, the predicted peak of one AdamW step on one rank: with ``shards`` > 1 the
    state is what ``fully_shard`` allocates on the fullest rank (rank 0, padding included:
    :func:`fsdp_rank_state`), activations are not sharded.  ``state`` (per class) replaces
    the state computed from ``cfg`` (callers pass it to reuse it across shapes)."""
    check_int("shards", shards, min=1)
    dev_type = "cuda"
    pol = "none" if policy == "compile_budget" else policy  # the partitioner's choice: bounded by none
    if state is None:
        state = state_totals(cfg, dtype) if shards == 1 else fsdp_rank_state(meta_model(cfg), shards, 0, dtype)
    out = {k: int(state[k]) for k in CLASSES[:4]}
    out["activations"] = sum(saved_bytes_formula(cfg, sh, dtype, pol, device_type=dev_type).values())
    out["transient"] = transient_bytes(cfg, sh, dtype, pol)
    out["total"] = sum(out[k] for k in CLASSES)
    return out


# --------------------------------------------------------------------------------------
# FSDP per-rank projection
# --------------------------------------------------------------------------------------


def fsdp_shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """(rows held, rows allocated) of one parameter's dim-0 shard on ``rank`` under
    ``fully_shard``: the rows are split as ``torch.chunk`` splits them (``ceil(rows / N)``-row
    chunks, so the last ranks may hold fewer rows, or none), and every rank allocates a
    padded shard of ``ceil(rows / N)`` rows (the all-gather needs equal sizes)."""
    check_int("world_size", world_size, min=1)
    check_int("rank", rank, min=0, max=world_size - 1)
    chunk = -(-rows // world_size)
    return max(0, min(chunk, rows - rank * chunk)), chunk


def fsdp_rank_params(model: nn.Module, world_size: int, rank: int = 0) -> dict[str, dict[str, int]]:
    """Per parameter name: the elements ``rank`` holds (``numel``, what the optimizer's
    moments are made like) and the elements its padded shard allocates (``padded_numel``:
    the sharded parameter's storage, and its share of the reduce-scattered gradient)."""
    out = {}
    for name, p in model.named_parameters():
        rows = p.shape[0] if p.dim() else 1
        per_row = p.numel() // max(rows, 1)
        held, padded = fsdp_shard_rows(rows, world_size, rank)
        out[name] = dict(rows=held, padded_rows=padded, numel=held * per_row, padded_numel=padded * per_row)
    return out


def fsdp_rank_state(model: nn.Module, world_size: int, rank: int = 0, dtype=None) -> dict[str, int]:
    """Per-rank bytes ``fully_shard`` allocates over ``world_size`` ranks, per class:
    parameters and gradients padded to ``ceil(rows / N)`` rows of every parameter on every
    rank (the sharded parameter's storage; the reduce-scatter output the gradients view),
    AdamW's fp32 moments and the fp32 master weights (16-bit parameters) only for the rows
    the rank holds (made like the unpadded local shard).  See :func:`fsdp_shard_rows`."""
    out = dict.fromkeys(CLASSES[:4], 0)
    shards = fsdp_rank_params(model, world_size, rank)
    for name, p in model.named_parameters():
        sh, s = shards[name], (parse_dtype("dtype", dtype) if dtype is not None else p.dtype).itemsize
        out["parameters"] += sh["padded_numel"] * s
        out["gradients"] += sh["padded_numel"] * s
        out["optimizer"] += 2 * sh["numel"] * 4
        out["master_weights"] += sh["numel"] * 4 if s < 4 else 0
    return out


def gpus_needed(
    cfg: MMDiTConfig, sh: StepShape, dtype, policy: str, device_bytes: int, max_gpus: int = 64
) -> int | None:
    """Fewest ranks (FSDP: state sharded, activations not) whose per-rank peak fits ``device_bytes``."""
    check_float("device_memory_gb", device_bytes, min=0, min_exclusive=True)
    for n in range(1, max_gpus + 1):
        if predicted_peak(cfg, sh, dtype, policy, shards=n)["total"] <= device_bytes:
            return n
    return None


# --------------------------------------------------------------------------------------
# What fits
# --------------------------------------------------------------------------------------

#: Memory of one H200 (141 GB, decimal) when no device is given and none is here.
H200_BYTES = 141 * 10**9
#: GPUs a what-fits may be asked for by name: every datasheet part with its memory (GB, as the vendor states it).
NAMED_GPUS = {k: v for k, v in DATASHEET.items() if v.memory_gib}


def default_device_bytes() -> int:
    """The current CUDA device's memory, else one H200's (141 GB)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return H200_BYTES


def device_memory(value, param: str = "device_memory_gb") -> tuple[int, str]:
    """Bytes and a description of the device a what-fits is asked for: a number of GB (decimal,
    as GPUs are sold), a GPU name (the datasheet memory of the part it names,
    :func:`lab_utils.core.datasheets.identify`: "H100 NVL" 94 GB, "H200" 141 GB, "B200" 180 GB; a
    family's name alone is its first part, "H100" the SXM5's 80 GB, and the label names the
    others), or 0: this GPU, else an H200."""
    if isinstance(value, str):
        found = identify(value.strip())
        if found is None or not found.peak.memory_gib:
            raise ConfigError(
                param, value, f"a number of GB, 0 (this GPU, else an H200) or a GPU with a datasheet row: {PART_HELP}"
            )
        sheet = found.peak  # a family's name alone: its first part (identify), the others named
        other = [p for p in DATASHEET.values() if p.family == sheet.family and p.memory_gib != sheet.memory_gib]
        which = f"; assumed for {value!r}, also {', '.join(f'{p.name} {p.memory_gib:g} GB' for p in other)}"
        return int(sheet.memory_gib * 1e9), f"{sheet.name}, {sheet.memory_gib:g} GB (its datasheet" + (
            f"{which})" if found.assumed and other else ")"
        )
    check_float(param, value, min=0)
    if value > 0:
        return int(value * 1e9), f"{value:g} GB (given)"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(props.total_memory), f"this GPU ({props.name}, {props.total_memory / 1e9:.0f} GB)"
    return H200_BYTES, "an H200, 141 GB (no GPU here: name one with device_memory_gb)"


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
    check_int("shards", shards, min=1)
    st = state_totals(cfg, dtype) if shards == 1 else fsdp_rank_state(meta_model(cfg), shards, 0, dtype)
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


@dataclass(frozen=True)
class FitEdge:
    """The largest batch a real step ran (``edge``), how many OOMs the bisection met, and the
    state bytes per class held after the last step that ran (parameters, gradients, the
    optimizer's moments, master weights): the state the prediction counts."""

    edge: int
    ooms: int
    state: dict


def fit_state(model: nn.Module, opt: MasterAdamW) -> dict[str, int]:
    """Bytes of the parameters, their gradients and the optimizer's state, per class."""
    params = [p for p in model.parameters() if p.requires_grad]
    return dict(
        parameters=sum(p.untyped_storage().nbytes() for p in params),
        gradients=sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None),
        **opt.state_bytes(),
    )


def bisect_fit(
    cfg: MMDiTConfig, policy: str, resolution: int, txt_len: int, hi: int = 64, *, device: str = "cuda"
) -> FitEdge:
    """The largest batch whose real bf16 training step runs, by bisection over [0, hi]; each
    OOM is caught (counted, memory released) and the search goes on.  The step holds the
    state the prediction assumes (:class:`MasterAdamW`: fp32 master weights and moments beside
    the bf16 weights and gradients), not ``torch.optim.AdamW``'s bf16 moments.  On CPU (tests)
    nothing runs out of memory: the edge is ``hi``."""
    check_int("hi", hi, min=0)
    dev = torch.device(device)
    model = build_model(cfg.replace(activation_checkpoint=policy), device=dev, dtype=torch.bfloat16)
    model.train()
    opt = MasterAdamW(model.parameters(), lr=1e-5)
    sh1 = step_shape(cfg, 1, resolution, resolution, txt_len)
    state: dict = {}

    def one_step(b: int) -> None:
        batch = None
        try:
            batch = batch_for(cfg, StepShape(b, sh1.img_tokens, txt_len), torch.bfloat16, dev)
            rf_loss(model, batch).backward()
            opt.step()
            state.clear()
            state.update(fit_state(model, opt))
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        finally:
            batch = None
            opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    edge, ooms = oom_bisect(one_step, hi)
    return FitEdge(edge, ooms, state)
