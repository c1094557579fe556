"""Lab 06 across machines: one ``torchrun`` per node, meeting through the c10d rendezvous.

On a SLURM cluster ``srun`` starts one task per node (``perflab run --executor slurm --nodes N``
submits such a job through submitit); each task runs :func:`run_node`, which starts this node's
``torchrun --nnodes N --rdzv-backend c10d --rdzv-endpoint HEAD:PORT`` (``HEAD`` = the job's
first node).  torchrun numbers the ranks, each rank runs ``python -m lab_utils.distributed worker``
and writes its ``result-rank{r}.json`` into its node's folder; :func:`gather` then copies every
node's files into one folder, checks that each rank 0..world-1 reported exactly once, and returns
the :class:`~.launch.DistResult` that the lab checks against the single-process run
(:func:`check_against_single_process`, the same :func:`.verify.compare` as on one machine).

On one machine the same path runs as ``nnodes`` tasks of one submitit local job, each a torchrun
launch rendezvousing on ``127.0.0.1`` (``perflab run --executor local --nodes 2``; what the tests
run, gloo, one rank per launch).  Node 0's launch hosts the rendezvous store
(``--rdzv-conf is_host=1``), the others join it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..core.config import ConfigError
from .launch import GRACE_S, DistResult, DistRunError
from .spec import DistConfig

ROOT = Path(__file__).resolve().parents[2]
#: files a node's ranks leave that the gathered folder keeps
GATHERED = ("result-rank*.json", "error-rank*.txt", "log-rank*.txt", "trace-rank*.json", "grads.pt")


def torchrun_command(
    spec: Path, out: Path, *, nnodes: int, nproc_per_node: int, endpoint: str, rdzv_id: str, is_host: bool
) -> list[str]:
    """The torchrun line one node runs (``python -m torch.distributed.run`` = ``torchrun``)."""
    if nnodes < 1 or nproc_per_node < 1:
        raise ConfigError("nodes", (nnodes, nproc_per_node), "at least 1 node and 1 process per node")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf=is_host={int(is_host)}",
        "--max-restarts=0",
        f"--log-dir={out / 'torchelastic'}",  # not a torchelastic_* folder of its own under /tmp, left there
        "-m",
        "lab_utils.distributed",
        "worker",
        "--spec",
        str(spec),
        "--out",
        str(out),
    ]


def srun_line(spec: str, out: str, *, nodes: int, gpus_per_node: int, port: int = 29500, python: str = "python") -> str:
    """The sbatch-script lines of the same launch, for running lab 06's spec by hand on a cluster.
    The batch shell finds the first node's address (``NodeAddr``: its name need not resolve) and
    the job id once; ``\\$SLURM_NODEID`` is left for the ``bash -c`` that srun starts on each node,
    so that every node writes its own folder, and only node 0 hosts the rendezvous (nodes whose
    addresses coincide, as on a one-machine test cluster, would otherwise all try to)."""
    return (
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        "ADDR=$(scontrol show node \"$HEAD\" -o | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')\n"
        f'srun --nodes={nodes} --ntasks-per-node=1 bash -c "{python} -m torch.distributed.run --nnodes={nodes} '
        f"--nproc-per-node={gpus_per_node} --rdzv-backend=c10d --rdzv-endpoint=$ADDR:{port} "
        "--rdzv-id=$SLURM_JOB_ID --rdzv-conf=is_host=\\$((SLURM_NODEID == 0)) "
        f"--log-dir={out}/node\\$SLURM_NODEID/torchelastic "
        f'-m lab_utils.distributed worker --spec {spec} --out {out}/node\\$SLURM_NODEID"'
    )


def node_address(name: str) -> str:
    """The address SLURM reaches node ``name`` at (``scontrol show node``'s NodeAddr; a site's node
    names need not resolve), else the name itself."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", "-o", name], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return name
    m = re.search(r"\bNodeAddr=(\S+)", out)
    return m.group(1) if m else name


def _start(cmd: list[str], out: Path) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    with (out / "torchrun.log").open("w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _end(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every launch's process group (torchrun and its ranks), SIGKILL after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + GRACE_S
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.05))
            except subprocess.TimeoutExpired:
                pass


def run_node(
    spec: Path, out: Path, *, node: int, nnodes: int, nproc_per_node: int, endpoint: str, rdzv_id: str, timeout_s: float
) -> int:
    """This node's torchrun (one SLURM task): its exit code, ``out/exit.json`` written for the gatherer."""
    cmd = torchrun_command(
        spec, out, nnodes=nnodes, nproc_per_node=nproc_per_node, endpoint=endpoint, rdzv_id=rdzv_id, is_host=node == 0
    )
    proc = _start(cmd, out)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = -int(signal.SIGKILL)
    finally:
        _end([proc])
    (out / "exit.json").write_text(json.dumps({"node": node, "code": code}))
    return code


def _log_tail(d: Path, n: int = 3000) -> str:
    f = d / "torchrun.log"
    return f.read_text(errors="replace")[-n:] if f.exists() else "(no torchrun.log)"


def gather(cfg: DistConfig, node_dirs: list[Path], out: Path, wall_s: float = float("nan")) -> DistResult:
    """Copy every node's rank files into ``out`` and read them in rank order; a missing or
    duplicated rank raises :class:`DistRunError` naming the nodes' torchrun logs."""
    out.mkdir(parents=True, exist_ok=True)
    seen: dict[int, Path] = {}
    for d in node_dirs:
        for f in sorted(p for pat in GATHERED for p in d.glob(pat)):
            if f.name.startswith("result-rank"):
                r = int(f.stem.removeprefix("result-rank"))
                if r in seen:
                    raise DistRunError("raised", f"rank {r} reported by two nodes: {seen[r]} and {d}", r, out)
                seen[r] = d
            shutil.copy2(f, out / f.name)
    missing = [r for r in range(cfg.world_size) if r not in seen]
    if missing:
        logs = "\n".join(f"--- {d.name} torchrun.log:\n{_log_tail(d)}" for d in node_dirs)
        raise DistRunError("raised", f"ranks {missing} of {cfg.world_size} wrote no result\n{logs}", missing[0], out)
    ranks = [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(cfg.world_size)]
    return DistResult(cfg, out, wall_s, ranks)


def check_against_single_process(res: DistResult, ref_dir: Path):
    """The gathered run against the single-process reference (:func:`.verify.compare`), as the lab checks."""
    import torch  # noqa: PLC0415

    from .verify import compare  # noqa: PLC0415
    from .worker import single_process_run  # noqa: PLC0415

    ref = single_process_run(res.cfg, ref_dir)
    ref_losses = [ref["losses"][k] for k in sorted(ref["losses"], key=int)]
    ref_grads = torch.load(ref_dir / "grads.pt") if (ref_dir / "grads.pt").exists() else None
    grads = res.grads() if (res.out / "grads.pt").exists() else None
    return compare(res.cfg, res.losses, grads, ref_losses, ref_grads)
