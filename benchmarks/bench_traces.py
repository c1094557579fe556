"""perflab's trace analysis against HolisticTraceAnalysis 0.5, and how both grow with trace size.

Rerun: ``pip install -e .[hta]`` (HTA is the extra ``hta``), then

* ``python benchmarks/bench_traces.py --traces DIR [--repeats N]``: the real jobs.  For every job
  folder of ``DIR`` (one file per rank) and for the whole set, each tool reads and summarises the
  traces in a fresh subprocess: perflab's ``TraceAnalysis`` (``temporal``, ``shares``, ``overlap``,
  ``idle``, ``top_kernels``), HTA's ``TraceAnalysis(include_last_profiler_step=True)`` with
  ``HTA_DISABLE_NS_ROUNDING=1`` (``get_temporal_breakdown``, ``get_comm_comp_overlap``,
  ``get_gpu_kernel_breakdown``, ``get_idle_time_breakdown``).  Measured: wall time of read +
  summarise (imports excluded), and peak memory as the growth of the process's peak resident set
  over its size after the imports; the median over ``--repeats``.  Writes
  ``benchmarks/results/bench_traces.json``.
* ``python benchmarks/bench_traces.py --scale [--sizes 50,200,800,2000] [--ranks 8,32,128]
  [--rank-mb 20] [--work /tmp/perflab-bench-traces] [--tools perflab,hta,decompress,parse,floor]``:
  synthetic traces (``benchmarks/synth_traces.py``: the event mix of a CUDA training step)
  generated under ``--work`` (never in the repository; reused when already there), one rank of each
  size in MB of JSON and folders of that many ranks of ``--rank-mb`` each.  Each measurement is
  the whole command a user waits for, in a fresh process, imports included (of compiled modules:
  the project's bytecode is written first, as an installed perflab has it):
  ``perflab trace PATH`` (``--workers`` = the CPUs), HTA's script above, and this machine's limit
  on the same bytes: ``decompress`` (gzip, one process, the files one after the other),
  ``parse`` (decompress and ``msgspec.json.decode`` of each whole file into Python objects) and
  ``floor``, the reader's own floor (one process: decompress, cut and msgspec's typed decoding
  of the fields perflab reads, ``lab_utils.traces.reader``'s streaming, with no table built and no
  analysis: what no change to the tables or the analyses can go below without a faster parser).
  Measured: wall time (with ``--repeats N``, the median of N runs and their range), the peak of
  the summed resident memory of the process and its children (sampled every 25 ms) and the load
  average around it.  Results go to
  ``benchmarks/results/bench_traces_scale.json`` after each measurement, so a run can be stopped
  and resumed: a measurement already there is kept (``--force`` redoes it).  A measurement that
  fails (HTA out of memory on 128 ranks, say) is recorded as such and the run goes on.

Timings on a shared machine are noisy: the machine's load is recorded with every figure.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "bench_traces.json"
TOOLS = ("perflab", "hta")


def compile_project() -> None:
    """Write the project's bytecode before timing anything: a user's installed perflab imports
    compiled modules (an editable install writes them on its first run), and with
    ``PYTHONDONTWRITEBYTECODE`` set no run would, so every timed run would compile lab_utils from
    source (~0.3 s) while the installed HTA imports its compiled wheel."""
    for pkg in ("lab_utils", "lab_kernels"):
        compileall.compile_dir(ROOT / pkg, quiet=1)


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
    from hta.trace_analysis import TraceAnalysis  # noqa: PLC0415 - optional dependency (extra "hta")

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
        import hta.trace_analysis  # noqa: F401, PLC0415 - optional dependency (extra "hta")
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


# ------------------------------------------------------------------------------ --scale
SCALE_OUT = ROOT / "benchmarks" / "results" / "bench_traces_scale.json"
SCALE_TOOLS = ("perflab", "hta", "decompress", "parse", "floor")
SIZES = (50, 200, 800, 2000)
RANKS = (8, 32, 128)
#: each tool as a whole process on one folder (argv[1]), imports included
_HTA = """
import logging, os, sys
os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
ta = TraceAnalysis(trace_dir=sys.argv[1], include_last_profiler_step=True)
ta.get_temporal_breakdown(visualize=False)
ta.get_comm_comp_overlap(visualize=False)
ta.get_gpu_kernel_breakdown(visualize=False)
ta.get_idle_time_breakdown(ranks=ta.t.get_ranks(), visualize=False)
"""
_DECOMPRESS = """
import gzip, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    with gzip.open(f) as fh:
        while fh.read(1 << 20):
            pass
"""
_PARSE = """
import gzip, pathlib, sys, msgspec
for f in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    with gzip.open(f) as fh:
        doc = msgspec.json.decode(fh.read())
    del doc
"""
_FLOOR = """
import pathlib, sys
from lab_utils.traces import reader


class Discard:  # the reader's sink, keeping nothing
    seen = n = 0

    def add(self, events):
        self.seen += len(events)


sink = Discard()
for f in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    with reader._open_bytes(f) as fh:
        reader._stream_events(fh, sink)
print(sink.seen, "events")
"""


def synth():
    """benchmarks/synth_traces.py, beside this script (loaded by path: the tests load this one so)."""
    spec = importlib.util.spec_from_file_location("synth_traces", Path(__file__).resolve().parent / "synth_traces.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("synth_traces", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def scale_inputs(work: Path, sizes, ranks, rank_mb: float) -> list[dict]:
    """The synthetic inputs, generated under ``work`` where missing (a folder per input: HTA reads
    folders); each with what was written (``written.json``: events, kernels, their time)."""
    st = synth()
    out = []
    jobs = [(f"1 rank, {mb:g} MB", work / f"rank-{mb:g}MB", 1, float(mb)) for mb in sizes]
    jobs += [(f"{n} ranks x {rank_mb:g} MB", work / f"ranks-{n}x{rank_mb:g}MB", n, rank_mb) for n in ranks]
    for label, folder, n, mb in tqdm(jobs, desc="synthetic traces", file=sys.stderr):
        meta = folder / "written.json"
        if not meta.exists():
            folder.mkdir(parents=True, exist_ok=True)
            written = [st.write_rank(folder / "data" / f"rank-{r}.json.gz", mb, rank=r, world=n, seed=r).as_dict()
                       for r in range(n)]  # fmt: skip
            meta.write_text(json.dumps(written, indent=1))
        written = json.loads(meta.read_text())
        out.append({"input": label, "path": str(folder / "data"), "ranks": n,
                    "json_mb": sum(w["json_bytes"] for w in written) / 1e6,
                    "gz_mb": sum(Path(w["path"]).stat().st_size for w in written) / 1e6,
                    "events": sum(w["events"] for w in written)})  # fmt: skip
    return out


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return out


def tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants, summed (MB)."""
    total = 0
    for p in _tree(pid):
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_measured(cmd: list[str], timeout_s: float) -> dict:
    """``cmd`` in a fresh process: wall time, the peak of its process tree's summed resident memory."""
    load = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    peak, stop = [0.0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], tree_rss_mb(proc.pid))
            stop.wait(0.025)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        err = f"timed out after {timeout_s:g} s"
    seconds = time.perf_counter() - t0
    stop.set()
    th.join()
    out = {"seconds": seconds, "peak_mb": peak[0], "rc": proc.returncode, "loadavg_before": load,
           "loadavg_after": os.getloadavg()}  # fmt: skip
    if proc.returncode != 0:
        out["error"] = (err or "").strip().splitlines()[-1] if (err or "").strip() else f"exit {proc.returncode}"
    return out


def repeated(runs: list[dict]) -> dict:
    """Several runs of one measurement as one row: the median time and the range of the times, the
    largest peak, the load before the first and after the last; a failed run is the row."""
    if "error" in runs[-1]:
        return runs[-1]
    secs = [r["seconds"] for r in runs]
    out = {"seconds": statistics.median(secs), "samples_s": secs, "peak_mb": max(r["peak_mb"] for r in runs), "rc": 0}
    return out | {"loadavg_before": runs[0].get("loadavg_before"), "loadavg_after": runs[-1].get("loadavg_after")}


def tool_command(tool: str, path: str, out_dir: Path, *, workers: int, mem_gb: float) -> list[str]:
    if tool == "perflab":
        exe = Path(sys.executable).parent / "perflab"
        return [str(exe), "trace", path, "--out", str(out_dir), "--workers", str(workers), "--mem-gb", str(mem_gb)]
    script = {"hta": _HTA, "decompress": _DECOMPRESS, "parse": _PARSE, "floor": _FLOOR}[tool]
    return [sys.executable, "-c", script, path]


def scale_main(args) -> int:
    """``--scale`` (see the module note): measure what is missing, store after each measurement."""
    bad = [t for t in args.tools if t not in SCALE_TOOLS]
    if bad:
        print(f"--tools: {bad[0]!r} is not allowed: expected some of {', '.join(SCALE_TOOLS)}", file=sys.stderr)
        return 2
    if min(args.sizes + args.ranks + [args.rank_mb], default=1) <= 0:
        print("--sizes, --ranks and --rank-mb: numbers > 0", file=sys.stderr)
        return 2
    compile_project()
    work = Path(args.work)
    inputs = scale_inputs(work, args.sizes, args.ranks, args.rank_mb)
    out = Path(args.out)
    done = json.loads(out.read_text()) if out.exists() else {"rows": []}
    done["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    have = {(r["input"], r["tool"]): r for r in done["rows"]}
    for inp in tqdm(inputs, desc="inputs", file=sys.stderr):
        for tool in args.tools:
            key = (inp["input"], tool)
            if key in have and not args.force and "error" not in have[key]:
                continue
            runs = []
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory(prefix="perflab-bench-") as tmp:
                    cmd = tool_command(tool, inp["path"], Path(tmp), workers=args.workers, mem_gb=args.mem_gb)
                    runs.append(run_measured(cmd, args.timeout))
                if "error" in runs[-1]:
                    break
            row = {**{k: v for k, v in inp.items() if k != "path"}, "tool": tool, **repeated(runs)}
            have[key] = row
            done["rows"] = list(have.values())
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp_out = out.with_name(out.name + ".tmp")
            tmp_out.write_text(json.dumps(done, indent=1) + "\n")
            tmp_out.replace(out)  # a stopped run leaves the last complete file
    print(scale_table(list(have.values())))
    return 0


def scale_table(rows: list[dict]) -> str:
    """One line per input: each tool's seconds and peak MB, perflab against HTA and the machine's limit."""
    by: dict[str, dict] = {}
    for r in rows:
        by.setdefault(r["input"], {"meta": r})[r["tool"]] = r
    lines = ["| input | JSON MB | perflab s | HTA s | perflab / HTA speed-up | decompress s | perflab / decompress | "
             "decompress + parse s | read floor s | perflab peak MB | HTA peak MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip

    def cell(r, k="seconds"):
        if r is None:
            return "not run"
        if "error" in r:
            return r.get("error", "failed")[:40]
        if k != "seconds":
            return f"{r[k]:.0f}"
        spread = r.get("samples_s", [])
        return f"{r[k]:.1f}" + (f" ({min(spread):.1f}-{max(spread):.1f})" if len(spread) > 1 else "")

    def ratio(a, b):
        ok = a and b and "error" not in a and "error" not in b
        return f"{b['seconds'] / a['seconds']:.1f}x" if ok else ""

    for name, t in by.items():
        p, h, d, q, f = (t.get(k) for k in ("perflab", "hta", "decompress", "parse", "floor"))
        vs_dec = f"{p['seconds'] / d['seconds']:.1f}x" if p and d and "error" not in p and "error" not in d else ""
        lines.append(f"| {name} | {t['meta']['json_mb']:.0f} | {cell(p)} | {cell(h)} | {ratio(p, h)} | {cell(d)} | "
                     f"{vs_dec} | {cell(q)} | {cell(f)} | {cell(p, 'peak_mb')} | {cell(h, 'peak_mb')} |")  # fmt: skip
    return "\n".join(lines)


def _numbers(text: str, kind=float) -> list:
    return [kind(x) for x in str(text).split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # not argparse-required: the measuring subprocesses call this script with --one only
    parser.add_argument("--traces", type=Path, help="a folder of job folders, one profiler trace file per rank in each")
    parser.add_argument("--repeats", type=int, default=1, help="runs per measurement: their median (and range)")
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--scale", action="store_true", help="synthetic traces of growing size (see the module note)")
    parser.add_argument("--sizes", type=lambda t: _numbers(t), default=list(SIZES), help="MB of JSON per lone rank")
    parser.add_argument("--ranks", type=lambda t: _numbers(t, int), default=list(RANKS), help="ranks per folder")
    parser.add_argument("--rank-mb", type=float, default=20.0, help="MB of JSON per rank of a folder")
    parser.add_argument("--tools", type=lambda t: [x.strip() for x in t.split(",")], default=list(SCALE_TOOLS))
    parser.add_argument("--work", default="/tmp/perflab-bench-traces", help="where the synthetic traces are made")
    parser.add_argument("--out", default=str(SCALE_OUT), help="the --scale results (JSON), written as it goes")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="perflab's --workers")
    parser.add_argument("--mem-gb", type=float, default=8.0, help="perflab's --mem-gb (per worker)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one measurement may take")
    parser.add_argument("--force", action="store_true", help="redo measurements already in --out")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one(args.one[0], args.one[1:])))
        return 0
    if args.repeats < 1:
        print(f"--repeats: {args.repeats} is not allowed: expected an integer >= 1", file=sys.stderr)
        return 2
    if args.scale:
        return scale_main(args)
    if args.traces is None:
        parser.error("the following arguments are required: --traces (or --scale)")
    if not args.traces.is_dir():
        print(f"--traces: {args.traces} is not a folder of job folders", file=sys.stderr)
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
