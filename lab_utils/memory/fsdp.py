"""Real ``fully_shard`` AdamW steps on gloo (``python -m lab_utils.memory fsdp PRESET N OUT``):
per-rank parameter, gradient and optimizer bytes beside the projection."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from ..config import check_int
from ..model import build_model
from ..model.train import rf_loss, synthetic_batch
from .budget import fsdp_rank_state


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


def main(argv: list[str]) -> None:
    if len(argv) == 5 and argv[1] == "fsdp":
        ws = int(argv[3])
        mp.start_processes(_fsdp_worker, args=(ws, argv[2], _free_port(), argv[4]), nprocs=ws, start_method="spawn")
    else:
        sys.exit("usage: python -m lab_utils.memory fsdp PRESET WORLD_SIZE OUT_DIR")
