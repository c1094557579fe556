"""perflab's trace analysis against HolisticTraceAnalysis 0.5 on the same files, side by side.

Rerun: ``pip install -e .[traces]`` then ``python benchmarks/bench_traces.py [--traces DIR] [--repeats N]``.

For every job folder of the folder ``--traces`` names (one file per rank) and for the whole
set, each tool reads the traces and summarises them, in a fresh subprocess per measurement:

* perflab: ``TraceAnalysis(folder)`` then ``temporal()``, ``shares()``, ``overlap()``,
  ``idle()`` and ``top_kernels`` of every rank;
* HTA: ``TraceAnalysis(trace_dir=folder, include_last_profiler_step=True)`` (with
  ``HTA_DISABLE_NS_ROUNDING=1``) then ``get_temporal_breakdown``, ``get_comm_comp_overlap``,
  ``get_gpu_kernel_breakdown`` and ``get_idle_time_breakdown`` of every rank.

Measured per run: wall time of read + summarise (imports excluded), and peak memory as the
growth of the process's peak resident set over its size after the imports (``ru_maxrss``;
worker processes of a pool are reported apart as ``children_peak_mb``).  The median over
``--repeats`` runs is kept.  Writes ``benchmarks/results/bench_traces.json`` and prints a
markdown table.  Timings on a shared machine are noisy: the machine's load is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "bench_traces.json"
TOOLS = ("perflab", "hta")


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _perflab(folders: list[Path]) -> None:
    from lab_utils.traces import TraceAnalysis  # noqa: PLC0415 - imported before the clock starts (see _one)

    for f in folders:
        ta = TraceAnalysis(f)
        ta.temporal(), ta.shares(), ta.overlap(), ta.idle()
        for r in ta.ranks:
            ta.top_kernels(r, 10)


def _hta(folders: list[Path]) -> None:
    from hta.trace_analysis import TraceAnalysis  # noqa: PLC0415 - optional dependency (extra "traces")

    for f in folders:
        ta = TraceAnalysis(trace_dir=str(f), include_last_profiler_step=True)
        ta.get_temporal_breakdown(visualize=False)
        ta.get_comm_comp_overlap(visualize=False)
        ta.get_gpu_kernel_breakdown(visualize=False)
        ta.get_idle_time_breakdown(ranks=ta.t.get_ranks(), visualize=False)


def _one(tool: str, folders: list[str]) -> dict:
    """Run inside the measuring subprocess: import, then time read + summarise."""
    os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
    import logging  # noqa: PLC0415 - the subprocess's own setup

    logging.disable(logging.WARNING)
    if tool == "perflab":
        import lab_utils.traces  # noqa: F401, PLC0415 - imports outside the timed region
    else:
        import hta.trace_analysis  # noqa: F401, PLC0415 - optional dependency (extra "traces")
    base = _rss_mb()
    t0 = time.perf_counter()
    (_perflab if tool == "perflab" else _hta)([Path(f) for f in folders])
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"seconds": seconds, "peak_mb": peak - base, "children_peak_mb": children, "rss_after_imports_mb": base}


def _measure(tool: str, folders: list[Path], repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        cmd = [sys.executable, __file__, "--one", tool, *map(str, folders)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
        if out.returncode != 0:
            return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"repeats": repeats}


def _table(rows: list[dict]) -> str:
    lines = [
        "| trace | JSON MB | perflab s | HTA s | speed-up | perflab peak MB | HTA peak MB | memory ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p, h = r["perflab"], r["hta"]
        if "error" in p or "error" in h:
            lines.append(f"| {r['trace']} | {r['json_mb']:.1f} | {p.get('error', '')} | {h.get('error', '')} | | | | |")
            continue
        lines.append(
            f"| {r['trace']} | {r['json_mb']:.1f} | {p['seconds']:.2f} | {h['seconds']:.2f} | "
            f"{h['seconds'] / p['seconds']:.1f}x | {p['peak_mb']:.0f} | {h['peak_mb']:.0f} | "
            f"{p['peak_mb'] / max(h['peak_mb'], 1e-9):.2f} |"
        )
    return "\n".join(lines)


def _json_mb(folder: Path) -> float:
    import gzip  # noqa: PLC0415 - only the parent needs it

    total = 0
    for f in folder.iterdir():
        with gzip.open(f) if f.suffix == ".gz" else open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                total += len(chunk)
    return total / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # not argparse-required: the measuring subprocesses call this script with --one only
    parser.add_argument("--traces", type=Path, help="a folder of job folders, one profiler trace file per rank in each")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one(args.one[0], args.one[1:])))
        return 0
    if args.traces is None:
        parser.error("the following arguments are required: --traces")
    if not args.traces.is_dir():
        print(f"--traces: {args.traces} is not a folder of job folders", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"--repeats: {args.repeats} is not allowed: expected an integer >= 1", file=sys.stderr)
        return 2
    jobs = sorted(p for p in args.traces.iterdir() if p.is_dir())
    rows = []
    load0 = os.getloadavg()
    for job in tqdm(jobs + [None], desc="bench traces"):
        folders = [job] if job is not None else jobs
        row = {"trace": job.name if job else f"all {len(jobs)} jobs (one process)"}
        row["json_mb"] = sum(_json_mb(f) for f in folders)
        for tool in TOOLS:
            row[tool] = _measure(tool, folders, args.repeats)
        rows.append(row)
    out = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_before": load0},
        "loadavg_after": os.getloadavg(),
        "note": "shared machine: timings are noisy; peak_mb = growth of ru_maxrss over the RSS after imports",
        "rows": rows,
    }
    print(_table(rows))
    failed = [f"{r['trace']} ({t})" for r in rows for t in TOOLS if "error" in r[t]]
    if failed:  # a table with holes is not the benchmark's result: the stored one is kept
        print(f"\n{len(failed)} measurement(s) failed: {', '.join(failed)}; {OUT} not written", file=sys.stderr)
        return 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nload average before {load0[0]:.1f}, after {out['loadavg_after'][0]:.1f} on {os.cpu_count()} CPUs; {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
