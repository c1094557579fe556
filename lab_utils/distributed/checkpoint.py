"""DCP checkpoints of a run in the single-process layout, so that any strategy resumes any other's.

Model and optimizer go through ``get_state_dict`` / ``set_state_dict`` (fully qualified names,
DTensor shards) and ``torch.distributed.checkpoint``, which reshards on load: a checkpoint
written by FSDP2 at world size 2 loads under DDP, TP, at world size 4 or in one process.

Tensor parallelism needs one step more.  Before sharding, :mod:`.parallel` permutes the rows
of the fused projections (``qkv``, ``linear1``) and the input columns of ``linear2`` into
per-rank blocks (each TP rank must hold *its heads* of q, k and v).  Saved as they are, these
weights and their AdamW moments would be in that order and load wrongly under any other
layout.  So each permuted tensor is saved in the unpermuted order (a DTensor sharded on its
first dimension over the same mesh, one full tensor at a time), and on load it is read in
that order and permuted back into the run's layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard

from lab_utils.distributed.parallel import ParallelModel


def _replicated(full: torch.Tensor, like: DTensor) -> DTensor:
    mesh = like.device_mesh
    return DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)


def to_unpermuted(t: DTensor, dim: int, perm: torch.Tensor) -> DTensor:
    """``t`` (in the TP layout) in the single-process order, sharded on dim 0 of its mesh's first dimension."""
    full = t.full_tensor().index_select(dim, torch.argsort(perm).to(t.device))
    mesh = t.device_mesh
    return _replicated(full, t).redistribute(mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))


def to_permuted(t: DTensor, like: DTensor, dim: int, perm: torch.Tensor) -> DTensor:
    """``t`` (single-process order) in the TP layout and placements of ``like``."""
    full = t.full_tensor().index_select(dim, perm.to(t.device))
    return _replicated(full, like).redistribute(like.device_mesh, like.placements)


def _permuted_entries(pm: ParallelModel, model_sd: dict, optim_sd: dict) -> list:
    """(container, key, dim, perm) of every permuted tensor: the parameter and its optimizer states.
    The optimizer's per-parameter state dicts in ``optim_sd`` are the optimizer's own: they are
    replaced by copies here, so that swapping a tensor in them leaves the running optimizer alone."""
    out = []
    states = optim_sd.get("state", {})
    for name, (dim, perm) in pm.permutations.items():
        out.append((model_sd, name, dim, perm))
        if name in states:
            states[name] = state = dict(states[name])
            for k, v in state.items():
                if isinstance(v, DTensor) and v.shape == model_sd[name].shape:
                    out.append((state, k, dim, perm))
    return out


def save_checkpoint(pm: ParallelModel, opt, path: Path, step: int) -> None:
    """DCP checkpoint of model + optimizer after ``step`` (collective: every rank calls it)."""
    model_sd, optim_sd = get_state_dict(pm.module, opt)
    for box, key, dim, perm in _permuted_entries(pm, model_sd, optim_sd):
        box[key] = to_unpermuted(box[key], dim, perm)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / f"step{step}"))
    if not dist.is_initialized() or dist.get_rank() == 0:
        (path / "latest").write_text(str(step))


def load_checkpoint(pm: ParallelModel, opt, path: Path) -> int:
    """Load the latest checkpoint under ``path`` into this run's layout; returns its step."""
    step = int((path / "latest").read_text())
    model_sd, optim_sd = get_state_dict(pm.module, opt)
    permuted = _permuted_entries(pm, model_sd, optim_sd)
    likes = []
    for box, key, dim, perm in permuted:  # read targets in the single-process order
        likes.append(box[key])
        box[key] = to_unpermuted(box[key], dim, perm)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / f"step{step}"))
    for (box, key, dim, perm), like in zip(permuted, likes):
        box[key] = to_permuted(box[key], like, dim, perm)
    set_state_dict(pm.module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step
