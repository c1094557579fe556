"""Lab 06's checked refusals and faults: what the launcher refuses before any process starts, and a
raising, a killed and a hanging rank each ending the run with its cause named and no process left."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lab_utils.core.config import ConfigError
from lab_utils.distributed import DistConfig, DistRunError, launch


def bad_input_lines() -> list[str]:
    """What the launcher refuses before any process starts (the parameter each error names)."""
    cases = [
        dict(strategy="fsdp+tp", world_size=3),
        dict(strategy="tp", world_size=3),
        dict(strategy="cp_ring", world_size=2, txt_len=7),
        dict(strategy="pipeline", world_size=2),
    ]
    out = []
    for kw in cases:
        try:
            DistConfig(**kw)
        except ConfigError as e:
            out.append(f"{kw}: refused, parameter {e.param!r}")
        else:
            raise AssertionError(f"{kw} was accepted")
    return out


def fault_lines(cfg, out: str | Path | None = None) -> list[str]:
    """A raising, a killed (SIGKILL) and a hanging rank at world size 2: each run ends, the cause is
    named, no process is left. ``cfg``: the lab's DistributedLabConfig (fault_demo, preset,
    hang_timeout_s, timeout_s)."""
    if not cfg.fault_demo:
        return ["fault demo skipped (fault_demo = False)"]
    if out is None:
        with tempfile.TemporaryDirectory(prefix="perflab-06-faults-") as tmp:
            return fault_lines(cfg, tmp)
    out = Path(out)
    lines = []
    for fault, rank, hang in (("raise", 1, cfg.hang_timeout_s), ("kill", 1, cfg.hang_timeout_s), ("hang", 0, 5.0)):
        c = DistConfig(
            strategy="ddp",
            world_size=2,
            preset=cfg.preset,
            steps=2,
            profile=False,
            fault=fault,
            fault_rank=rank,
            fault_step=2,
            hang_timeout_s=hang,
            timeout_s=cfg.timeout_s,
        )
        try:
            launch(c, out / fault, progress=False)
        except DistRunError as e:
            gone = all(_gone(p) for p in e.pids)
            if not gone:
                raise AssertionError(f"fault {fault!r}: processes left behind: {e.pids}") from e
            first = str(e).splitlines()[0].split(" (")[0].split(" and the run")[0]
            lines.append(f"fault {fault!r} on rank {rank}: run ended ({e.kind}: {first}); processes left: 0")
        else:
            raise AssertionError(f"fault {fault!r} did not end the run")
    return lines


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False
