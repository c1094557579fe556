"""One rank of a distributed run: ``python -m lab_utils.distributed worker --spec FILE --out DIR``.

The rank reads its identity from the environment torchrun (or :mod:`.launch`) sets
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), joins the
process group, builds the MMDiT with the single-process seed, wraps it per strategy,
and trains ``steps`` steps on deterministic synthetic batches: every rank draws the
*global* batch, noise and timesteps of step ``s`` from the same seed and keeps its
data-parallel rows and context-parallel token shards, so the run is comparable with
the single-process one element by element.

It writes into DIR: ``progress-rank{r}.jsonl`` (one line per event, read live by the
launcher's watchdog), ``result-rank{r}.json`` (losses, step times, communication),
``trace-rank{r}.json`` (profiler trace of the last step), ``grads.pt`` (rank 0: full
gradients after step 1) and, on failure, ``error-rank{r}.txt`` with the traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from lab_utils.core.config import ConfigError
from lab_utils.distributed import comm
from lab_utils.distributed.checkpoint import load_checkpoint, save_checkpoint
from lab_utils.distributed.context_parallel import check_against_sdpa, check_shape
from lab_utils.distributed.parallel import build_parallel, full_gradients, sync_grads
from lab_utils.distributed.spec import DistConfig
from lab_utils.model import resolve_config
from lab_utils.model.train import sample_timesteps, synthetic_batch


class Progress:
    """Append-only JSON lines the launcher tails (progress bar and watchdog)."""

    def __init__(self, out: Path, rank: int):
        self.path = out / f"progress-rank{rank}.jsonl"
        self.rank = rank

    def __call__(self, event: str, **kw) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"rank": self.rank, "event": event, "t": time.time(), **kw}) + "\n")


def step_inputs(cfg: DistConfig, step: int, rank: int, device: torch.device) -> dict:
    """This rank's slice of step ``step``'s global batch (see the module note)."""
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    b = synthetic_batch(
        cfg.preset, cfg.batch_size, height=cfg.height, width=cfg.width, txt_len=cfg.txt_len, generator=g
    )
    t = sample_timesteps(cfg.batch_size, g)
    noise = torch.randn(b.img.shape, generator=g)
    tt = t[:, None, None]
    x_t = (1 - tt) * b.img + tt * noise
    target = noise - b.img
    mesh = cfg.mesh
    r, s, c, _ = mesh.coords(rank)
    d = r * mesh.dp_shard + s
    bl = cfg.batch_size // mesh.dp
    rows = slice(d * bl, (d + 1) * bl)
    li, lt = b.img.shape[1] // mesh.cp, b.txt.shape[1] // mesh.cp
    img_tok, txt_tok = slice(c * li, (c + 1) * li), slice(c * lt, (c + 1) * lt)
    dt = torch.float32 if cfg.dtype == "float32" else torch.bfloat16

    def mv(x):
        return x.to(device)

    return dict(
        img=mv(x_t[rows, img_tok].to(dt)),
        img_ids=mv(b.img_ids[img_tok]),
        txt=mv(b.txt[rows, txt_tok].to(dt)),
        txt_ids=mv(b.txt_ids[txt_tok]),
        timesteps=mv(t[rows]),
        y=mv(b.y[rows].to(dt)),
        guidance=mv(b.guidance[rows]) if b.guidance is not None else None,
        target=mv(target[rows, img_tok]),
    )


def train_step(pm, inputs: dict) -> torch.Tensor:
    """Forward + backward of one step on this rank's shard; returns the local loss (detached)."""
    target = inputs.pop("target")
    pred = pm.module(**inputs)
    loss = torch.nn.functional.mse_loss(pred.float(), target.float())
    loss.backward()
    sync_grads(pm)
    return loss.detach()


def _optimizer(cfg: DistConfig, params):
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)


def _inject(cfg: DistConfig, rank: int, step: int) -> None:
    if cfg.fault == "none" or rank != cfg.fault_rank or step != cfg.fault_step:
        return
    if cfg.fault == "raise":
        raise RuntimeError(f"injected fault: rank {rank} raised at step {step}")
    if cfg.fault == "kill":  # no traceback, no error file: what the OOM killer or `kill -9` leaves
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # "hang": never returns; the launcher's watchdog must end the run
        time.sleep(1.0)


def run(cfgs: list[DistConfig], out: Path) -> None:
    """Join the process group once and run every case in ``cfgs`` (results under ``out/case{i}``
    when there are several), so one spawn serves many strategies."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    progress = Progress(out, rank)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for cfg in cfgs:
        if world != cfg.world_size:
            raise RuntimeError(f"WORLD_SIZE={world} but the spec asks for world_size={cfg.world_size}")
    backend = cfgs[0].backend
    use_cuda = backend == "nccl" or (backend == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=max(c.timeout_s for c in cfgs))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    progress("init", backend=dist.get_backend())
    for i, cfg in enumerate(cfgs):
        case_out = out / f"case{i}" if len(cfgs) > 1 else out
        case_out.mkdir(parents=True, exist_ok=True)
        result = run_case(cfg, case_out, device, lambda ev, _i=i, **kw: progress(ev, case=_i, **kw))
        (case_out / f"result-rank{rank}.json").write_text(json.dumps(result))
    progress("done")
    dist.barrier()
    dist.destroy_process_group()


def attention_check_shape(cfg: DistConfig) -> tuple[int, int, int, int]:
    """The problem of a CP run's attention self-check: the heads its attention has on a TP rank and
    their head dim, split over its CP degree (:func:`~lab_utils.distributed.context_parallel.check_shape`)."""
    parts = cfg.parts
    if not any(p in parts for p in ("cp_ring", "cp_ulysses")):
        raise ConfigError("strategy", cfg.strategy, "a strategy with cp_ring or cp_ulysses (the self-check is CP's)")
    m, mesh = resolve_config(cfg.preset), cfg.mesh
    return check_shape("ring" if "cp_ring" in parts else "ulysses", m.num_heads // mesh.tp, m.head_dim, mesh.cp)


def run_case(cfg: DistConfig, out: Path, device: torch.device, progress=None) -> dict:
    """Train ``cfg.steps`` steps with ``cfg``'s strategy; return this rank's result.  Without an
    initialised process group (``single`` in the caller's process) no collective is called."""
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    progress = progress or (lambda *a, **k: None)
    pm = build_parallel(cfg, device)
    opt = _optimizer(cfg, pm.module.parameters())
    result: dict = {
        "rank": rank,
        "world_size": world,
        "strategy": cfg.strategy,
        "mesh": list(cfg.mesh.shape),
        "device": device.type,
    }
    if pm.cp_mode is not None:
        _, heads, _, head_dim = attention_check_shape(cfg)
        result["attention_check"] = check_against_sdpa(
            pm.cp_group, pm.cp_mode.scheme, heads=heads, head_dim=head_dim, seed=cfg.seed
        )
    start = 0
    if cfg.resume:
        start = load_checkpoint(pm, opt, Path(cfg.ckpt_dir))
        progress("resumed", step=start)
    losses, step_ms = {}, {}
    for step in range(start + 1, cfg.steps + 1):
        _inject(cfg, rank, step)
        inputs = step_inputs(cfg, step, rank, device)
        prof = None
        if cfg.profile and step == cfg.steps:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            prof = profile(activities=acts, record_shapes=True)
            prof.__enter__()
        if distributed:
            dist.barrier()
        t0 = time.perf_counter()
        with record_function(comm.STEP_MARK):
            loss = train_step(pm, inputs)
            if step == 1 and cfg.keep_grads:
                grads = full_gradients(pm)
                if rank == 0:
                    torch.save(grads, out / "grads.pt")
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        step_ms[step] = (time.perf_counter() - t0) * 1e3
        if prof is not None:
            prof.__exit__(None, None, None)
            trace = out / f"trace-rank{rank}.json"
            prof.export_chrome_trace(str(trace))
            events = comm.load_trace(trace)
            result["overlap"] = comm.summary_dict(comm.overlap(events))
            result["collectives"] = [vars(c) for c in comm.collectives(events)]
        if distributed:
            dist.all_reduce(loss)
        losses[step] = float(loss) / world
        progress("step", step=step, loss=losses[step], ms=step_ms[step])
        if step == cfg.save_step:
            save_checkpoint(pm, opt, Path(cfg.ckpt_dir), step)
            progress("saved", step=step)
    if cfg.comm_sweep and distributed:
        result["sweep"] = _profiled_sweep(cfg, out, rank, device)
        progress("swept")
    result |= {"losses": losses, "step_ms": step_ms}
    return result


def _profiled_sweep(cfg: DistConfig, out: Path, rank: int, device: torch.device) -> list[dict]:
    sizes = [1 << k for k in range(12, 23, 2)]  # 4 KiB .. 4 MiB
    comm.sweep_collectives(sizes[:1], 1, device)  # first calls set up buffers and connections
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        comm.sweep_collectives(sizes, cfg.sweep_reps, device)
    trace = out / f"sweep-rank{rank}.json"
    prof.export_chrome_trace(str(trace))
    return [vars(c) for c in comm.collectives(comm.load_trace(trace))]


def single_process_run(cfg: DistConfig, out: Path) -> dict:
    """The reference: ``cfg``'s model, batches and optimizer in this process, no process group."""
    out.mkdir(parents=True, exist_ok=True)
    ref = dataclasses.replace(cfg, strategy="single", world_size=1, mixed_precision=False, profile=False)
    return run_case(ref, out, torch.device("cpu"))


@dataclasses.dataclass
class EmulatedStep:
    """Step 1 of a data-parallel run, emulated in one process (:func:`emulated_dp_step`)."""

    loss: float
    grads: dict[str, torch.Tensor]


def emulated_dp_step(cfg: DistConfig) -> EmulatedStep:
    """The loss and gradients of step 1 that ``cfg``'s data-parallel ranks should agree on, computed
    in this process: each rank's rows run one after another through the same wrapping at world
    size 1 (FSDP2's bf16 casts included), their gradients accumulate in float32 and are averaged.
    That is what a float32 reduction of the ranks' gradients gives, up to float32 rounding; a
    bfloat16 reduction rounds the sum once more (about 1e-3 relative per parameter).

    Data parallelism only (no tp/cp), on the CPU: the reference of CPU (gloo) ranks; needs no
    process group (it makes a one-rank gloo group of its own and destroys it)."""
    m = cfg.mesh
    if m.tp != 1 or m.cp != 1:
        raise ConfigError("strategy", cfg.strategy, "a data-parallel strategy only (ddp, fsdp, hsdp) to emulate")
    if dist.is_initialized():
        raise RuntimeError("emulated_dp_step makes its own one-rank process group; one is already initialized")
    one = dataclasses.replace(cfg, world_size=1, replicate_degree=0, profile=False)
    device = torch.device("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks (OMP_NUM_THREADS=1): same kernels, same rounding
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pm = build_parallel(one, device)
        losses: dict[tuple[int, int], float] = {}
        for rank in range(cfg.world_size):
            r, s, _, _ = m.coords(rank)
            if (r, s) not in losses:
                with warnings.catch_warnings():
                    # FSDP2 warns that the root returns a view (an in-place op on it would skip a hook);
                    # train_step only reads it (mse_loss of pred.float())
                    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
                    losses[r, s] = float(train_step(pm, step_inputs(cfg, 1, rank, device)))
        n = len(losses)
        return EmulatedStep(sum(losses.values()) / n, {k: g / n for k, g in full_gradients(pm).items()})
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def load_spec(path: Path) -> list[DistConfig]:
    data = json.loads(path.read_text())
    return [DistConfig(**d) for d in (data if isinstance(data, list) else [data])]


def main(spec: Path, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    try:
        run(load_spec(spec), out)
    except BaseException:  # noqa: BLE001 - reported to the launcher, then the rank exits
        (out / f"error-rank{rank}.txt").write_text(traceback.format_exc())
        return 1
    return 0
