"""Small CPU traces of perflab's own, for lab 09 (when it is given no trace) and the CPU rule's tests.

(Lab 09's training-step trace is lab 01's tiny MMDiT step through
:func:`lab_utils.profiling.profiler.profile_training`, recorded by ``lab_utils.studies.traces``.)

* :func:`record_tiny_step`: a two-layer MLP step (``forward``/``backward``/``optimizer`` ranges)
  under a ``torch.profiler`` schedule: the same kind of trace in well under a second.
* :func:`record_gloo_ranks`: ``ranks`` processes (``torch.multiprocessing`` spawn) on the gloo
  backend; each step multiplies two small matrices (``forward``) and all-reduces ``numel`` float32
  elements; one trace per rank (``rank{r}.trace.json``, ``distributedInfo`` recorded by torch), so
  a folder that :class:`lab_utils.traces.TraceAnalysis` reads as one job.

All are recorded with CPU activity only: :mod:`lab_utils.traces.cpu` reads them.  This module
imports torch and the core only: the spawned ranks start in seconds.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from lab_utils.core.config import ConfigError, check_int
from lab_utils.core.noise import quiet_stderr_fd


def _check(steps: int, warmup: int) -> None:
    check_int("steps", steps, min=1)
    check_int("warmup_steps", warmup, min=0)


def _tiny_step(model, opt, x) -> None:
    with record_function("forward"):
        loss = model(x).square().mean()
    with record_function("backward"):
        loss.backward()
    with record_function("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)


def record_tiny_step(out_dir: str | Path, *, steps: int = 3, warmup: int = 1, width: int = 64, seed: int = 0) -> Path:
    """A two-layer MLP step under ``schedule(warmup, active=steps)``; the trace's path."""
    _check(steps, warmup)
    check_int("width", width, min=1)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, width)
    path = Path(out_dir) / "tiny_step.trace.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with (
        quiet_stderr_fd(),
        profile(
            activities=[ProfilerActivity.CPU],
            schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
            record_shapes=True,
            on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
        ) as prof,
    ):
        for _ in range(warmup + steps):
            _tiny_step(model, opt, x)
            prof.step()
    return path


def _gloo_rank(rank: int, world: int, port: int, out: str, steps: int, numel: tuple[int, ...], width: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(rank)
        a, b = torch.randn(width, width), torch.randn(width, width)
        tensors = [torch.ones(n) for n in numel]
        path = Path(out) / f"rank{rank}.trace.json"
        with (
            quiet_stderr_fd(),  # kineto's profiler_start/stop markers, written by each rank
            profile(
                activities=[ProfilerActivity.CPU],
                schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                record_shapes=True,
                on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
            ) as prof,
        ):
            for _ in range(1 + steps):
                with record_function("forward"):
                    (a @ b).sum()
                for t in tensors:
                    dist.all_reduce(t)
                prof.step()
        # no rank leaves before every rank is done: rank 0 holds the rendezvous store, and a rank
        # still tearing down gloo when it goes away aborts ("terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Its trace is written and the group is gone.  Left to the interpreter's exit, a rank that
    # profiled gloo collectives aborts now and then in C++ teardown ("terminate called without an
    # active exception", SIGABRT: 1 run in 10 to 20 of two ranks here, both ranks having returned):
    # the rank leaves at once.  An exception above still reaches the parent as the rank's error.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A TCP port free on this machine now (the rendezvous of the gloo ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record_gloo_ranks(
    out_dir: str | Path, *, ranks: int = 2, steps: int = 3, numel: tuple[int, ...] = (4096, 65536), width: int = 64
) -> Path:
    """``ranks`` gloo processes, ``steps`` steps each of a matmul and an all-reduce per size in
    ``numel`` (float32 elements) after one warm-up step; the folder holding one trace per rank."""
    check_int("ranks", ranks, min=2)
    check_int("steps", steps, min=1)
    if not numel or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in numel):
        raise ConfigError("numel", numel, "a non-empty list of positive integers (elements per all-reduce)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    args = (ranks, free_port(), str(out), steps, tuple(numel), width)
    mp.start_processes(_gloo_rank, args=args, nprocs=ranks, join=True, start_method="spawn")
    return out
