"""Real ``fully_shard`` AdamW steps on gloo (``python -m lab_utils.memory fsdp PRESET SIZES OUT``):
per-rank and per-parameter bytes that FSDP allocates, beside the projection.

One spawn serves every world size asked for: ``max(sizes)`` processes join one gloo group,
and each world size ``N`` runs on a subgroup of ranks ``0..N-1`` (a ``DeviceMesh`` made from
it), so uneven shards (3, 5, 6 ranks over rows that are powers of two) cost no extra spawn."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from lab_utils.core.config import ConfigError, check_int_list
from lab_utils.memory.budget import fsdp_rank_params, fsdp_rank_state
from lab_utils.memory.saved import storage_bytes, storage_key
from lab_utils.model import build_model
from lab_utils.model.train import rf_loss, synthetic_batch

#: The per-rank figures a real run reports and the projection predicts, in bytes.
FSDP_FIGURES = ("parameters", "parameters_held", "gradients", "optimizer")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _unique_bytes(ts: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``ts`` (a storage several views share counts once)."""
    seen = {}
    for t in ts:
        seen[storage_key(t)] = storage_bytes(t)
    return sum(seen.values())


def _one_world(preset: str, mesh: DeviceMesh, rank: int, world_size: int) -> dict:
    """fully_shard every block and the root over ``mesh``, one AdamW step, then this rank's
    bytes per class and per parameter (elements held, elements of the parameter's storage)."""
    model = build_model(preset, seed=0)
    for blk in model.blocks():
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = synthetic_batch(preset, 1, height=32, width=32, txt_len=4, generator=torch.Generator().manual_seed(rank))
    rf_loss(model, batch, torch.Generator().manual_seed(rank)).backward()
    opt.step()
    named = list(model.named_parameters())
    moments = [v for st in opt.state.values() for k, v in st.items() if k != "step" and torch.is_tensor(v)]
    return dict(
        rank=rank,
        world_size=world_size,
        # what fully_shard allocates: the padded sharded parameters, the reduce-scatter
        # outputs the gradients view, the optimizer's moments
        parameters=_unique_bytes(_local(p) for _, p in named),
        parameters_held=sum(_local(p).numel() * p.element_size() for _, p in named),
        gradients=_unique_bytes(_local(p.grad) for _, p in named),
        optimizer=_unique_bytes(_local(v) for v in moments),
        params={
            n: dict(
                numel=_local(p).numel(),
                padded_numel=storage_bytes(_local(p)) // p.element_size(),
                grad_numel=_local(p.grad).numel(),
                moment_numel=_local(opt.state[p]["exp_avg"]).numel(),
            )
            for n, p in named
        },
    )


def _fsdp_worker(rank: int, world: int, sizes: list[int], preset: str, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for ws in sizes:
            group = dist.new_group(list(range(ws)))  # every rank takes part in making the group
            if rank < ws:
                got = _one_world(preset, DeviceMesh.from_group(group, "cpu"), rank, ws)
                Path(out_dir, f"ws{ws}-rank{rank}.json").write_text(json.dumps(got))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def run_fsdp(preset: str = "tiny", world_sizes: int | Iterable[int] = 2, timeout_s: float | None = None) -> list[dict]:
    """Per-rank state bytes of a real ``fully_shard`` AdamW step at each of ``world_sizes``
    (one spawn of ``max(world_sizes)`` gloo processes, ``python -m lab_utils.memory fsdp``),
    with the projection beside each figure (``projected_<figure>``, and per parameter
    ``projected_params``).  The process group is killed on timeout (by default 60 s plus 40 s
    per process, for a shared 2-core machine), so no process is left behind."""
    sizes = [world_sizes] if isinstance(world_sizes, int) else list(world_sizes)
    check_int_list("world_sizes", sizes, min=1)
    if max(sizes) > 16:
        raise ConfigError("world_sizes", sizes, "world sizes of at most 16 (gloo processes on this machine)")
    sizes = sorted(set(sizes))
    timeout_s = timeout_s if timeout_s is not None else 60.0 + 40.0 * max(sizes)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "lab_utils.memory", "fsdp", preset, ",".join(map(str, sizes)), tmp]
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise RuntimeError(f"FSDP run at world sizes {sizes} timed out after {timeout_s} s") from None
        if proc.returncode:
            raise RuntimeError(f"FSDP run at world sizes {sizes} failed:\n{log.decode()[-3000:]}")
        got = [json.loads(Path(tmp, f"ws{ws}-rank{r}.json").read_text()) for ws in sizes for r in range(ws)]
    model = build_model(preset, device="meta")
    for row in got:
        ws, rank = row["world_size"], row["rank"]
        proj = fsdp_rank_state(model, ws, rank)
        shards = fsdp_rank_params(model, ws, rank)
        for k in ("parameters", "gradients", "optimizer"):
            row[f"projected_{k}"] = proj[k]
        row["projected_parameters_held"] = sum(
            shards[n]["numel"] * p.element_size() for n, p in model.named_parameters()
        )
        row["projected_params"] = {n: dict(numel=v["numel"], padded_numel=v["padded_numel"]) for n, v in shards.items()}
    return got


def fsdp_mismatches(row: dict) -> list[str]:
    """What a real rank's figures and per-parameter sizes get wrong against the projection
    (empty = all equal): per class, then per parameter the elements held (parameter, gradient
    and moments alike) and the elements its padded storage allocates."""
    bad = [
        f"{k} {row[k]} != projected {row[f'projected_{k}']}" for k in FSDP_FIGURES if row[k] != row[f"projected_{k}"]
    ]
    for name, got in row["params"].items():
        want = row["projected_params"].get(name)
        if want is None:
            bad.append(f"{name}: not in the projection")
            continue
        held = {got["numel"], got["grad_numel"], got["moment_numel"]}
        if held != {want["numel"]} or got["padded_numel"] != want["padded_numel"]:
            bad.append(f"{name}: real {got} != projected {want}")
    return bad


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> None:
    if len(argv) == 5 and argv[1] == "fsdp":
        sizes = [int(x) for x in argv[3].split(",")]
        check_int_list("world_sizes", sizes, min=1)
        args = (max(sizes), sizes, argv[2], _free_port(), argv[4])
        mp.start_processes(_fsdp_worker, args=args, nprocs=max(sizes), start_method="spawn")
    else:
        sys.exit("usage: python -m lab_utils.memory fsdp PRESET WORLD_SIZES(comma-separated) OUT_DIR")
