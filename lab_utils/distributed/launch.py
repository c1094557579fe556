"""Start the ranks of a run on this machine, watch them, and collect what they wrote.

:func:`launch` is what the notebook and ``python -m lab_utils.distributed run`` call.
It starts ``world_size`` processes of ``python -m lab_utils.distributed worker`` with
the environment torchrun would give them (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``; ``OMP_NUM_THREADS=1``), each in its
own session so that the whole process group of a rank can be ended.  While they run it
tails their progress files (live progress bar) and ends the run, reporting why, when

* a rank exits with an error: its traceback (``error-rank{r}.txt``) is the report;
* a rank has not started (joined the process group: its ``init`` progress event) within
  ``startup_timeout_s`` of the launch: start-up (Python, torch's import, the rendezvous) is
  not held to the hang watchdog, since on a loaded node it alone can take tens of seconds;
* once every rank has started, no rank reports progress for ``hang_timeout_s`` (watchdog: a
  hung rank stalls every collective, so the whole run stops progressing);
* the run exceeds ``timeout_s``.

Every rank is then sent SIGTERM, and SIGKILL after a grace period; :func:`launch`
returns only when every process it started has exited.

More than one machine: the same worker runs under torchrun's rendezvous, e.g. on each
of 2 nodes with 8 GPUs::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HEAD_NODE:29500 --rdzv-id perflab-06 \\
        -m lab_utils.distributed worker --spec spec.json --out runs/fsdp

with ``spec.json`` from ``DistConfig(...).to_json()`` (``world_size`` = nodes x GPUs), e.g.
``python -c "from lab_utils.distributed import DistConfig; print(DistConfig(strategy='fsdp',
world_size=16, backend='nccl').to_json())" > spec.json`` (it is validated there, once).  Each
node's ranks write ``result-rank{r}.json`` (losses, step times, collectives) into that node's
``--out``; rank 0 also writes ``grads.pt`` (full gradients after step 1).  To check the run,
copy the result files of all nodes into one folder and compare rank 0's losses and
``grads.pt`` with :func:`.worker.single_process_run` of the same spec through
:func:`.verify.compare`, as the lab does; :func:`check_local_devices` applies to one machine
only and is not called under torchrun.

Without ``out`` the ranks write into a temporary folder, removed when a run fails or is
interrupted; the lab and the command line remove theirs once read unless asked to keep them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lab_utils.core.config import ConfigError, check_int_list, device_target
from lab_utils.core.device import cuda_devices, no_cuda_reason
from lab_utils.distributed.comm import CollectiveEvent
from lab_utils.distributed.spec import DistConfig

GRACE_S = 3.0
POLL_S = 0.1


class DistRunError(RuntimeError):
    """A run that ended early: ``kind`` is "raised" (a rank exited with an error), "killed" (a rank
    was ended by a signal it did not get from the launcher), "hang" or "timeout"; ``rank`` the
    failing rank if known; ``statuses`` every rank's exit status in words, rank order."""

    def __init__(
        self,
        kind: str,
        message: str,
        rank: int | None = None,
        out: Path | None = None,
        codes: list[int | None] | None = None,
    ):
        self.kind, self.rank, self.out = kind, rank, out
        self.codes = codes  # each rank's exit code when the failure was seen (None: still running)
        self.statuses: list[str] = []
        self.pids: list[int] = []  # the ranks' process ids (each leads its own process group), all ended
        super().__init__(message)


@dataclass
class DistResult:
    cfg: DistConfig
    out: Path
    wall_s: float
    ranks: list[dict] = field(default_factory=list)  # result-rank{r}.json, in rank order
    pids: list[int] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        lo = self.ranks[0]["losses"]
        return [lo[k] for k in sorted(lo, key=int)]

    def grads(self) -> dict[str, torch.Tensor]:
        return torch.load(self.out / "grads.pt")

    def collectives(self, rank: int) -> list[CollectiveEvent]:
        return [CollectiveEvent(**c) for c in self.ranks[rank].get("collectives", [])]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _signal_running(procs: list[subprocess.Popen], sig: int) -> None:
    """Send ``sig`` to the process group of every rank still running."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def _kill_all(procs: list[subprocess.Popen]) -> None:
    _signal_running(procs, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.05))
        except subprocess.TimeoutExpired:
            pass
    _signal_running(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _status(seen: int | None, final: int | None) -> str:
    """A rank's exit status in words: ``seen`` when the failure was noticed, ``final`` after the launcher's end."""
    if seen is None:
        return "running, ended by the launcher" + (f" ({_status(final, final)})" if final is not None else "")
    if seen < 0:
        return f"killed by {_signal_name(seen)} (exit status {seen})"
    return f"exit code {seen}"


def _failure(out: Path, world: int, codes: list[int | None]) -> DistRunError:
    """Which rank caused a failed run.  A rank killed by a signal (SIGKILL from the OOM killer or a
    user, SIGSEGV) writes no error file, and its peers then fail on closed connections and do write
    one: so a rank ended by a signal is the cause first; otherwise the earliest error file."""
    killed = [r for r, c in enumerate(codes) if c is not None and c < 0]
    if killed:
        r = killed[0]
        log = (out / f"log-rank{r}.txt").read_text().strip()[-2000:]
        tail = f"\nlast output of rank {r}:\n{log}" if log else f"\nrank {r} wrote no output before it died"
        return DistRunError(
            "killed",
            f"rank {r} was killed by {_signal_name(codes[r])} and the run was ended (the other ranks' errors "
            f"follow from it: their peer disappeared){tail}",
            r,
            out,
            codes,
        )

    # a rank's failure makes its peers fail too (closed connections); the earliest error file is the cause
    def written(rank: int) -> float:
        f = out / f"error-rank{rank}.txt"
        return f.stat().st_mtime if f.exists() else math.inf

    failed = {r for r, c in enumerate(codes) if c not in (None, 0)}
    errs = {k for k in range(world) if (out / f"error-rank{k}.txt").exists()}
    r = min(failed | errs, key=lambda k: (written(k), k))
    err = out / f"error-rank{r}.txt"
    if err.exists():
        return DistRunError(
            "raised", f"rank {r} failed and the run was ended:\n{err.read_text().strip()}", r, out, codes
        )
    log = (out / f"log-rank{r}.txt").read_text()[-4000:]
    return DistRunError(
        "raised", f"rank {r} exited with code {codes[r]} and the run was ended; its output:\n{log}", r, out, codes
    )


class _Tail:
    """New lines of the ranks' progress files since the last call."""

    def __init__(self, out: Path, world: int):
        self.files = [out / f"progress-rank{r}.jsonl" for r in range(world)]
        self.offsets = [0] * world

    def read(self) -> list[dict]:
        events = []
        for i, f in enumerate(self.files):
            if not f.exists():
                continue
            with f.open() as fh:
                fh.seek(self.offsets[i])
                chunk = fh.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            self.offsets[i] += len(complete)
            events += [json.loads(line) for line in complete.splitlines() if line.strip()]
        return events


AUTO_WORLD = ("auto", "all")


def local_world_sizes(values) -> list[int]:
    """World sizes with ``auto`` / ``all`` resolved to every visible GPU (the GPU set's "every local GPU");
    a ConfigError names the value when none is visible or an entry is not a positive integer."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise ConfigError("world_sizes", values, "a list of integers >= 1 or 'auto' (every local GPU)")
    gpus = cuda_devices()
    out = []
    for v in values:
        if isinstance(v, str) and v.lower() in AUTO_WORLD:
            if gpus == 0:
                local = device_target() is None
                where = "local GPU and none is visible" if local else f"GPU of a node ({no_cuda_reason()})"
                why = f"integers: {v!r} means every {where}"
                raise ConfigError("world_sizes", values, why)
            v = gpus
        out.append(v)
    check_int_list("world_sizes", out, min=1)
    return out


def check_local_devices(cfg: DistConfig) -> None:
    """Refuse, before any rank starts, a run this machine cannot host: NCCL without a CUDA GPU, or more
    ranks than visible GPUs when the ranks would use them (each rank takes ``cuda:LOCAL_RANK``).  A
    spec for several nodes under torchrun is not checked here: its world spans the nodes' GPUs."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.backend == "nccl" and gpus == 0:
        raise ConfigError("backend", cfg.backend, "'gloo' or 'auto' on a machine without a CUDA GPU (NCCL needs one)")
    if cfg.backend in ("nccl", "auto") and gpus and cfg.world_size > gpus:
        raise ConfigError(
            "world_size",
            cfg.world_size,
            f"at most {gpus} (the visible GPUs, one per rank) with backend {cfg.backend!r}; "
            "backend 'gloo' runs more ranks on the CPU",
        )


def launch(cfg: DistConfig, out: str | Path | None = None, *, progress: bool = True, desc: str = "") -> DistResult:
    """Run ``cfg`` on ``cfg.world_size`` local processes; raise :class:`DistRunError` when it fails."""
    return launch_cases([cfg], out, progress=progress, desc=desc)[0]


def launch_cases(
    cfgs: list[DistConfig], out: str | Path | None = None, *, progress: bool = True, desc: str = ""
) -> list[DistResult]:
    """Run several cases of one world size in one spawn (the ranks join the process group once and
    run the cases in order); the run's timeout is the sum of the cases', its watchdog the longest.

    The ranks write into ``out``; without it, into a temporary folder that the caller owns when the
    run succeeds (``DistResult.out``) and that is removed when it fails or is interrupted (the
    error carries the cause)."""
    if not cfgs or len({c.world_size for c in cfgs}) != 1:
        raise ConfigError("world_size", [c.world_size for c in cfgs], "one world size shared by every case")
    for c in cfgs:
        check_local_devices(c)
    if out is not None:
        return _launch_cases(cfgs, Path(out), progress, desc)
    tmp = Path(tempfile.mkdtemp(prefix="perflab-dist-"))
    try:
        return _launch_cases(cfgs, tmp, progress, desc)
    except BaseException as e:
        if isinstance(e, DistRunError):
            e.out = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _stalled(world: int, started: set[int], since_launch: float, startup_s: float, since_progress: float,
             hang_s: float, last_step: dict) -> str | None:  # fmt: skip
    """Why the watchdog ends the run now, or None: a rank not started within ``startup_s`` of the
    launch; once all have, no progress for ``hang_s``."""
    if len(started) < world:
        if since_launch <= startup_s:
            return None
        missing = [r for r in range(world) if r not in started]
        return (f"watchdog: ranks {missing} did not start (join the process group) within startup_timeout_s = "
                f"{startup_s:g} s; the run was ended")  # fmt: skip
    if since_progress > hang_s:
        return (f"watchdog: no rank reported progress for {hang_s:g} s (last (case, step) per rank: {last_step}); "
                "the run was ended")  # fmt: skip
    return None


def _launch_cases(cfgs: list[DistConfig], out: Path, progress: bool, desc: str) -> list[DistResult]:
    cfg = cfgs[0]
    timeout_s, hang_s = sum(c.timeout_s for c in cfgs), max(c.hang_timeout_s for c in cfgs)
    startup_s = max(c.startup_timeout_s for c in cfgs)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*-rank*.*"), *out.glob("case*/*-rank*.*")]:
        old.unlink()
    spec = out / "spec.json"
    spec.write_text(json.dumps([json.loads(c.to_json()) for c in cfgs]))
    port, world = free_port(), cfg.world_size
    root = Path(__file__).resolve().parents[2]
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    bar = None
    if progress:
        from tqdm.auto import tqdm  # noqa: PLC0415  (progress bar only when asked; tqdm imports ipywidgets in notebooks)

        bar = tqdm(total=sum(c.steps for c in cfgs) * world, desc=desc or f"{cfg.strategy} x{world}", leave=False)
    try:
        for r in range(world):
            env = {
                **os.environ,
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
            }
            log = (out / f"log-rank{r}.txt").open("w")
            cmd = [sys.executable, "-m", "lab_utils.distributed", "worker", "--spec", str(spec), "--out", str(out)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        tail = _Tail(out, world)
        last_progress = time.monotonic()
        last_step = dict.fromkeys(range(world), (0, 0))  # (case, step)
        started: set[int] = set()  # ranks that joined the process group
        while True:
            time.sleep(POLL_S)
            now = time.monotonic()
            for ev in tail.read():
                last_progress = now
                if ev["event"] == "init":
                    started.add(ev["rank"])
                elif ev["event"] == "step":
                    last_step[ev["rank"]] = (ev.get("case", 0), ev["step"])
                    if bar is not None:
                        bar.update(1)
                        if ev["rank"] == 0:
                            bar.set_postfix(loss=f"{ev['loss']:.4f}")
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                raise _failure(out, world, codes)
            if all(c == 0 for c in codes):
                break
            stalled = _stalled(world, started, now - t0, startup_s, now - last_progress, hang_s, last_step)
            if stalled:
                raise DistRunError("hang", stalled, None, out, codes)
            if now - t0 > timeout_s:
                raise DistRunError(
                    "timeout", f"the run exceeded timeout_s = {timeout_s:g} s and was ended", None, out, codes
                )
    except DistRunError as e:
        e.pids = [p.pid for p in procs]
        _kill_all(procs)
        e.statuses = [_status(c, p.returncode) for c, p in zip(e.codes or [None] * world, procs)]
        head, _, rest = e.args[0].partition("\n")
        listed = "exit status per rank: " + "; ".join(f"rank {r}: {s}" for r, s in enumerate(e.statuses))
        e.args = ("\n".join([head, listed, *([rest] if rest else [])]),)
        raise
    finally:
        _kill_all(procs)
        if bar is not None:
            bar.close()
    wall = time.monotonic() - t0
    results = []
    for i, c in enumerate(cfgs):
        d = out / f"case{i}" if len(cfgs) > 1 else out
        ranks = [json.loads((d / f"result-rank{r}.json").read_text()) for r in range(world)]
        results.append(DistResult(c, d, wall, ranks, [p.pid for p in procs]))
    return results
