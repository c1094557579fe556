"""How fast ``perflab`` answers: ``--help``, a subcommand's ``--help``, a refused bad argument and
``perflab trace`` on a small trace, each timed over N fresh processes.

    .venv/bin/python benchmarks/bench_cli.py [--n 15] [--json benchmarks/results/cli.json]

Method: each case runs ``--n`` times in a fresh interpreter (``.venv/bin/perflab``, the console
script a user runs), after one untimed warm-up run of each (the page cache holds the files);
wall time from spawn to exit (``time.perf_counter`` around ``subprocess.run``), reported as
median with p20/p80. The floor it is compared with: ``python -c pass`` (the interpreter's own
start-up) and ``python -c "import lab_utils"``. The goal: ``--help`` and a refused argument well
under a second. Run it on an idle machine; a loaded one measures the load.
"""

from __future__ import annotations

import argparse
import compileall
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def perflab_cmd() -> list[str]:
    script = Path(sys.executable).with_name("perflab")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lab_utils.run.cli"]


def small_trace(path: Path, steps: int = 4) -> Path:
    """A Kineto trace of ``steps`` ProfilerSteps, each launching a GEMM and an add on stream 7."""
    ev = []
    for s in range(steps):
        t0, c = s * 1000, s * 10 + 1

        def x(cat, name, ts, dur, pid=1, tid=1, **args):
            return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}

        ev += [
            x("user_annotation", f"ProfilerStep#{s + 1}", t0, 1000),
            x("cpu_op", "aten::mm", t0 + 20, 20, **{"External id": c}),
            x("cuda_runtime", "cudaLaunchKernel", t0 + 25, 4, correlation=c),
            x("kernel", "sm80_xmma_gemm", t0 + 50, 200, pid=0, tid=7, correlation=c, stream=7, device=0),
            x("cpu_op", "aten::add", t0 + 500, 20, **{"External id": c + 1}),
            x("cuda_runtime", "cudaLaunchKernel", t0 + 505, 4, correlation=c + 1),
            x("kernel", "elementwise_add", t0 + 600, 50, pid=0, tid=7, correlation=c + 1, stream=7, device=0),
        ]
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": ev}))
    return path


def time_runs(cmd: list[str], n: int, cwd: Path, want_rc: int) -> list[float]:
    subprocess.run(cmd, cwd=cwd, capture_output=True, timeout=600)  # warm-up, untimed
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, timeout=600)
        out.append(time.perf_counter() - t0)
        if p.returncode != want_rc:
            raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}, expected {want_rc}: {p.stderr.decode()[-500:]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=15, help="fresh processes per case (default 15)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args()
    for pkg in ("lab_utils", "lab_kernels"):  # time compiled imports, as an installed perflab runs them
        compileall.compile_dir(ROOT / pkg, quiet=1)
    tmp = Path(tempfile.mkdtemp(prefix="perflab-bench-cli-"))
    try:
        trace = small_trace(tmp / "small.pt.trace.json")
        pl = perflab_cmd()
        cases = [
            ("python -c pass (floor)", [sys.executable, "-c", "pass"], 0),
            ("python -c 'import lab_utils'", [sys.executable, "-c", "import lab_utils"], 0),
            ("perflab --help", [*pl, "--help"], 0),
            ("perflab trace --help", [*pl, "trace", "--help"], 0),
            ("perflab run nosuch (refused)", [*pl, "run", "nosuch"], 2),
            ("perflab run smoke --param nosuch=1 (refused)", [*pl, "run", "smoke", "--param", "nosuch=1"], 2),
            ("perflab trace small.pt.trace.json", [*pl, "trace", str(trace), "--out", str(tmp / "out")], 0),
        ]
        rows = []
        print(f"{'case':48s} {'median s':>9s} {'p20':>7s} {'p80':>7s}  (n={a.n} fresh processes each)")
        for name, cmd, rc in cases:
            t = sorted(time_runs(cmd, a.n, ROOT, rc))
            q = statistics.quantiles(t, n=10, method="inclusive")
            row = dict(case=name, median_s=statistics.median(t), p20_s=q[1], p80_s=q[7], n=a.n, samples_s=t)
            rows.append(row)
            print(f"{name:48s} {row['median_s']:9.3f} {row['p20_s']:7.3f} {row['p80_s']:7.3f}")
        if a.json:
            Path(a.json).write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=1) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
