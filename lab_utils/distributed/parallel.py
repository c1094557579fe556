"""Apply a :class:`~lab_utils.distributed.spec.DistConfig` strategy to an MMDiT on a DeviceMesh.

Design note
-----------
Everything is applied from outside the model, by module names:

* TP (``parallelize_module``): ``qkv`` / ``fc1`` / ``linear1`` column-wise, ``proj`` /
  ``fc2`` / ``linear2`` row-wise.  The fused projections stack (q, k, v[, mlp]) along
  their output rows; a column-wise shard must give each rank *its heads* of q, k and v,
  so the rows (and ``linear2``'s input columns) are first permuted into per-rank blocks
  and the blocks' public ``heads`` / ``dim`` / ``mlp_hidden`` attributes set to their
  local share.  The per-head QK-norm weights stay replicated; each TP rank sees only its
  heads, so their gradients are summed over the TP group after the backward.
  :func:`full_gradients` undoes the permutation, so gradients compare name by name with
  the single-process model.
* SP (with TP): in the single-stream blocks the norm, modulation and gated residual run on
  the rank's token shard (``linear1`` all-gathers the tokens, ``linear2`` reduce-scatters);
  the modulation's weights and ``vec`` then get per-shard partial gradients, summed over TP.
  The double-stream blocks stay TP only: they slice the RoPE table at the text length they
  see, which a token shard would change (sharding them needs that length passed in).
* FSDP2: ``fully_shard`` per block and at the root, with ``reshard_after_forward``, an
  optional ``MixedPrecisionPolicy(bf16, fp32 reduce)`` and explicit prefetch of the next
  block (forward) / previous block (backward).  HSDP passes a 2-D (replicate, shard) mesh.
  With CP, the data-parallel mesh is the flattened (shard x cp) mesh, so gradients are
  averaged over every rank that saw different tokens.
* DDP over the (replicate x cp) ranks.
* CP: :class:`~lab_utils.distributed.context_parallel.ContextParallelAttention` around each
  block's forward; without a data-parallel wrapper the gradients are averaged over the CP group here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from lab_utils.core.dtypes import DTYPES
from lab_utils.distributed.context_parallel import ContextParallelAttention
from lab_utils.distributed.spec import DistConfig
from lab_utils.model import MMDiT, build_model, resolve_config

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelModel:
    """The wrapped model and what the step needs to know about how it was wrapped."""

    module: nn.Module  # what to call (DDP / FSDP / plain)
    model: MMDiT  # the underlying MMDiT (same object for FSDP2, .module for DDP)
    mesh: DeviceMesh | None
    cfg: DistConfig
    cp_group: object | None = None
    tp_group: object | None = None
    cp_mode: ContextParallelAttention | None = None
    # param name -> (dim, permutation) applied before TP sharding
    permutations: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    tp_partial_grads: list[str] = field(default_factory=list)  # replicated params with per-rank partial grads
    manual_grad_avg_group: object | None = None  # CP without a data-parallel wrapper


def qkv_permutation(dim: int, heads: int, n: int, extra: int = 0) -> torch.Tensor:
    """Row order putting rank r's (q_r, k_r, v_r[, extra_r]) blocks together; rows are
    (k h d) + ``extra`` trailing MLP rows in the unpermuted layout."""
    dh, hl, el = dim // heads, heads // n, extra // n
    rows = []
    for r in range(n):
        for k in range(3):
            start = k * dim + r * hl * dh
            rows.append(torch.arange(start, start + hl * dh))
        if extra:
            rows.append(torch.arange(3 * dim + r * el, 3 * dim + (r + 1) * el))
    return torch.cat(rows)


def linear2_permutation(dim: int, mlp: int, n: int) -> torch.Tensor:
    """Input-column order of the single block's linear2 ([attn D | mlp M]) in per-rank blocks."""
    dl, ml = dim // n, mlp // n
    cols = []
    for r in range(n):
        cols.append(torch.arange(r * dl, (r + 1) * dl))
        cols.append(torch.arange(dim + r * ml, dim + (r + 1) * ml))
    return torch.cat(cols)


def _permute_(lin: nn.Linear, dim: int, perm: torch.Tensor) -> None:
    with torch.no_grad():
        lin.weight.copy_(lin.weight.index_select(dim, perm))
        if dim == 0 and lin.bias is not None:
            lin.bias.copy_(lin.bias.index_select(0, perm))


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the TP group (the tokens of a
    sequence-parallel block each contribute only their rows to d(vec))."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def apply_sequence_parallel(blk: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Sequence parallelism for a single-stream block: its norm, modulation and gated residual
    run on this rank's token shard; ``linear1`` all-gathers the tokens, ``linear2``
    reduce-scatters them.  The block's input and output stay replicated at its boundary."""
    group = tp_mesh.get_group()

    def enter(module, args):
        x, vec, *rest = args
        x = DTensor.from_local(x, tp_mesh, [Replicate()]).redistribute(tp_mesh, [Shard(1)]).to_local()
        return (x, _SumGradOverTP.apply(vec, group), *rest)

    def leave(module, args, out):
        return DTensor.from_local(out, tp_mesh, [Shard(1)]).redistribute(tp_mesh, [Replicate()]).to_local()

    blk.register_forward_pre_hook(enter)
    blk.register_forward_hook(leave)


def apply_tp(pm: ParallelModel, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    model, n = pm.model, tp_mesh.size()
    cfg = model.cfg
    d, h, m = cfg.hidden_size, cfg.num_heads, cfg.mlp_hidden
    for i, blk in enumerate(model.double_blocks):
        plan = {}
        for stream in ("img", "txt"):
            attn = getattr(blk, f"{stream}_attn")
            perm = qkv_permutation(d, h, n)
            _permute_(attn.qkv, 0, perm)
            pm.permutations[f"double_blocks.{i}.{stream}_attn.qkv.weight"] = (0, perm)
            if attn.qkv.bias is not None:
                pm.permutations[f"double_blocks.{i}.{stream}_attn.qkv.bias"] = (0, perm)
            attn.heads = h // n
            pm.tp_partial_grads += [
                f"double_blocks.{i}.{stream}_attn.q_norm",
                f"double_blocks.{i}.{stream}_attn.k_norm",
            ]
            plan |= {
                f"{stream}_attn.qkv": ColwiseParallel(),
                f"{stream}_attn.proj": RowwiseParallel(),
                f"{stream}_mlp.fc1": ColwiseParallel(),
                f"{stream}_mlp.fc2": RowwiseParallel(),
            }
        parallelize_module(blk, tp_mesh, plan)
    for i, blk in enumerate(model.single_blocks):
        p1, p2 = qkv_permutation(d, h, n, extra=m), linear2_permutation(d, m, n)
        _permute_(blk.linear1, 0, p1)
        _permute_(blk.linear2, 1, p2)
        pm.permutations[f"single_blocks.{i}.linear1.weight"] = (0, p1)
        pm.permutations[f"single_blocks.{i}.linear1.bias"] = (0, p1)
        pm.permutations[f"single_blocks.{i}.linear2.weight"] = (1, p2)
        blk.heads, blk.dim, blk.mlp_hidden = h // n, d // n, m // n
        pm.tp_partial_grads += [f"single_blocks.{i}.q_norm", f"single_blocks.{i}.k_norm"]
        if sequence_parallel:
            plan = {
                "linear1": ColwiseParallel(input_layouts=Shard(1)),
                "linear2": RowwiseParallel(output_layouts=Shard(1)),
            }
            parallelize_module(blk, tp_mesh, plan)
            apply_sequence_parallel(blk, tp_mesh)
            pm.tp_partial_grads += [
                f"single_blocks.{i}.modulation.lin.weight",
                f"single_blocks.{i}.modulation.lin.bias",
            ]
        else:
            parallelize_module(blk, tp_mesh, {"linear1": ColwiseParallel(), "linear2": RowwiseParallel()})


def attach_cp(model: MMDiT, mode: ContextParallelAttention) -> None:
    """Enter ``mode`` around every block's forward.  Hooks on the blocks (not a mode around
    the whole step) also cover the forward that activation checkpointing recomputes inside
    the backward, where a mode entered by the caller is not active."""

    def enter(module, args):
        mode.__enter__()

    def leave(module, args, out):
        mode.__exit__(None, None, None)

    for blk in model.blocks():
        blk.register_forward_pre_hook(enter)
        blk.register_forward_hook(leave)


def apply_fsdp(model: MMDiT, dp_mesh: DeviceMesh, cfg: DistConfig) -> None:
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.mixed_precision
        else MixedPrecisionPolicy()
    )
    blocks = model.blocks()
    for blk in blocks:
        fully_shard(blk, mesh=dp_mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=mp)
    if cfg.prefetch:
        for i, blk in enumerate(blocks):
            if i + 1 < len(blocks):
                blk.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                blk.set_modules_to_backward_prefetch([blocks[i - 1]])


def _flat(mesh: DeviceMesh, dims: tuple[str, ...]) -> DeviceMesh:
    """The sub-mesh over ``dims`` as one dimension (the ranks that share a role)."""
    if len(dims) == 1:
        return mesh[dims[0]]
    # DeviceMesh has no public flatten yet; torchtitan uses the same call for its dp_shard_cp mesh.
    return mesh[dims]._flatten("_".join(dims))


def build_parallel(cfg: DistConfig, device: torch.device) -> ParallelModel:
    """Build the tiny-to-flux MMDiT with the single-process seed and wrap it per ``cfg``."""
    parts, mesh_deg = cfg.parts, cfg.mesh
    mcfg = resolve_config(cfg.preset, activation_checkpoint=cfg.activation_checkpoint)
    model = build_model(mcfg, device=device, dtype=DTYPES[cfg.dtype], seed=cfg.seed)
    if cfg.strategy == "single":
        return ParallelModel(module=model, model=model, mesh=None, cfg=cfg)
    mesh = init_device_mesh(device.type, mesh_deg.shape, mesh_dim_names=MESH_DIMS)
    pm = ParallelModel(module=model, model=model, mesh=mesh, cfg=cfg)
    if mesh_deg.tp > 1:
        pm.tp_group = mesh["tp"].get_group()
        apply_tp(pm, mesh["tp"], sequence_parallel="sp" in parts)
    if mesh_deg.cp > 1:
        pm.cp_group = mesh["cp"].get_group()
        pm.cp_mode = ContextParallelAttention(pm.cp_group, "ring" if "cp_ring" in parts else "ulysses")
        attach_cp(model, pm.cp_mode)
    if "fsdp" in parts or "hsdp" in parts:
        shard_dims = ("dp_shard", "cp") if mesh_deg.cp > 1 else ("dp_shard",)
        dp_mesh = _flat(mesh, shard_dims)
        if "hsdp" in parts:  # 2-D (replicate, shard) mesh from the same root as the TP mesh
            dp_mesh = mesh[("dp_replicate", "_".join(shard_dims) if len(shard_dims) > 1 else "dp_shard")]
        apply_fsdp(model, dp_mesh, cfg)
    elif "ddp" in parts:
        group = _flat(mesh, ("dp_replicate", "cp") if mesh_deg.cp > 1 else ("dp_replicate",)).get_group()
        pm.module = DistributedDataParallel(model, process_group=group)
    elif mesh_deg.cp > 1:
        pm.manual_grad_avg_group = pm.cp_group
    return pm


def sync_grads(pm: ParallelModel) -> None:
    """Finish what the wrappers do not: sum the partial QK-norm grads over TP, average over CP
    when no data-parallel wrapper did."""
    named = dict(pm.model.named_parameters())
    if pm.tp_group is not None:
        for name in pm.tp_partial_grads:
            g = named[name].grad
            if g is not None:
                dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=pm.tp_group)
    if pm.manual_grad_avg_group is not None:
        n = dist.get_world_size(pm.manual_grad_avg_group)
        for p in pm.model.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(g, group=pm.manual_grad_avg_group)
                g.div_(n)


def full_gradients(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient in the single-process layout (collective: every rank calls it)."""
    out = {}
    for name, p in pm.model.named_parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            g = g.full_tensor()
        g = g.detach().float().cpu()
        if name in pm.permutations:
            dim, perm = pm.permutations[name]
            g = g.index_select(dim, torch.argsort(perm))
        out[name] = g
    return out
