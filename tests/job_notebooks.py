"""Tiny notebooks and suites for the job tests (tests/jobs/test_jobs.py here, tests/jobs/test_slurm.py on a real
SLURM cluster), and the process checks both make: each notebook runs in seconds."""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat
import yaml

from lab_utils.run.nbtools import make_notebook

CONFIG = "lab_utils.studies.ceilings:CeilingsLabConfig"
# an accuracy figure against float64 (timing-free) and a "time" row (a performance figure that
# depends on the thread count it was given, so it differs between the runs and must be left out)
ACC = (
    "import torch\nfrom lab_utils.core.records import Recorder\nfrom lab_utils.core.timing import choose_cpu_threads\n"
    "g = torch.Generator().manual_seed(reps)\na = torch.randn(48, 48, generator=g)\n"
    "ref = a.double() @ a.double()\nerr = float(((a @ a).double() - ref).norm() / ref.norm())\n"
    "rec = Recorder('acc', params={'reps': reps})\nrec.add('matmul', 'f32', 'rel_err', err)\n"
    "rec.add('matmul', 'f32', 'time', float(choose_cpu_threads().threads), 'ms', statistic='median')\n"
    "rec.save()"
)
# the job's pids, and how many times the notebook started (a requeued job runs it again)
STARTED = (
    "import json, os, pathlib\np = pathlib.Path(os.environ['PERFLAB_ARTIFACTS_DIR'])\n"
    "(p / 'started.json').write_text(json.dumps({'kernel': os.getpid(), 'job': os.getppid()}))\n"
    "attempt = 1 + len(list(p.glob('attempt-*')))\n(p / f'attempt-{attempt}').write_text(str(os.getppid()))\n"
)
NOTEBOOKS = {
    "acc": ACC,
    "acc7": ACC,
    "bad": "raise ValueError('deliberate failure')",
    "die": STARTED + "import signal\nos.kill(os.getppid(), signal.SIGKILL)",  # the job dies (OOM-killer style)
    "slow": STARTED + "import time\ntime.sleep(600)",
    "slow2": STARTED + "import time\ntime.sleep(600)",
    # alive 10 s after it started (a time limit that killed the job at its start leaves no alive.json)
    "limit": STARTED + "import time\ntime.sleep(10)\n(p / 'alive.json').write_text('10 s')\ntime.sleep(600)",
    # its device checked where the job runs (the config's own check, as every lab's first cell makes)
    "cuda": "from lab_utils.studies.ceilings import CeilingsLabConfig as C\ncfg = C(device=device, reps=reps)",
    # the first attempt waits to be preempted; the requeued one records and ends
    "preempt": STARTED + "import time\nwhile attempt == 1:\n    time.sleep(1)\n" + ACC,
}


def notebook(path: Path, body: str) -> str:
    nb = make_notebook([("md", "# t"), ("params", 'device = "cpu"\nreps = 5'), ("code", body)], config=CONFIG)
    path.write_text(nbformat.writes(nb))
    return str(path)


def make_suites(root: Path, suites: dict[str, list]) -> Path:
    """``suites``: name -> entries (a notebook name, or (name, params)); writes the notebooks and
    ``parameterized/<name>.yaml`` under ``root``; returns the parameterized folder."""
    pdir, labs = root / "parameterized", root / "labs"
    pdir.mkdir(exist_ok=True)
    labs.mkdir(exist_ok=True)
    for name, entries in suites.items():
        items = []
        for e in entries:
            stem, params = (e, {}) if isinstance(e, str) else e
            items.append(
                {
                    "notebook": notebook(labs / f"{stem}.ipynb", NOTEBOOKS[stem]),
                    **({"params": params} if params else {}),
                }
            )
        (pdir / f"{name}.yaml").write_text(yaml.safe_dump({"description": name, "notebooks": items}))
    return pdir


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def procs_naming(text: str) -> list[str]:
    """Command lines of running processes that mention ``text`` (a run's folder)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd and alive(int(d)):
                out.append(cmd)
    return out


def wait_gone(pids, timeout: float = 20.0) -> list[int]:
    """The pids still alive after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def key(df):
    cols = ["notebook", "experiment", "variant", "metric", "unit", "shape", "dtype", "statistic", "value"]
    return sorted(map(tuple, df[cols].astype(str).values.tolist()))
