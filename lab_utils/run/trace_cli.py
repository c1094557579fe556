"""``perflab trace PATH`` and ``perflab trace diff A B``: real profiler traces from the command line.

``perflab trace PATH`` (a trace file or a folder holding one file per rank) prints the
summary of :class:`lab_utils.traces.TraceAnalysis` (per rank and per step breakdown, top
kernels, overlap, idle split, launch verdict, collectives when present) and writes into
``--out`` the records ``perflab compare`` reads (``records.json``), the figures as JSON
(``trace.json``) and one self-contained HTML page (``trace.html``, BokehJS inline).  ``--json``
prints the figures as JSON instead of the text summary.

A folder's ranks are read and attributed in parallel by
:func:`lab_utils.run.executors.map_jobs` (``--executor pool|local|slurm``), one job per rank
file, then reduced to one job.

``perflab trace diff A B`` records both sides (files or folders) and compares them with
:func:`lab_utils.run.compare.compare`: per category, phase, step and top kernel, each per-step
figure carrying its steps as samples, so the verdicts (faster, slower, same, noisy) come from
the spread across steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from lab_utils.core.config import ConfigError
from lab_utils.core.records import Recorder, json_value
from lab_utils.run.compare import compare
from lab_utils.run.compare.rules import CompareError
from lab_utils.run.executors import MAP_EXECUTORS, MapOptions, map_jobs
from lab_utils.run.trace_analyses import MAX_RANKS, analysis_figures, summary_lines
from lab_utils.run.trace_html import headline, render_html
from lab_utils.traces import PhaseTable, TraceAnalysis
from lab_utils.traces.attribute import Attributed, attribute
from lab_utils.traces.perfetto import perfetto_trace, write_perfetto
from lab_utils.traces.reader import RankTrace, read_rank, trace_files
from lab_utils.traces.timeline import check_step, representative_step, step_timeline

LAB = "trace"
EXIT_USAGE = 2
PERFETTO = "trace.perfetto.json.gz"  # the attributed trace for Perfetto (lab_utils.traces.perfetto)


# -- reading a job: map per rank, reduce to one TraceAnalysis ------------------------------
def analyse_rank(item: tuple[str, int, bool]) -> tuple[RankTrace, Attributed]:
    """One rank file read and attributed (a job of :func:`map_jobs`): ``(path, index, alone)``."""
    path, index, alone = item
    trace = read_rank(path, index, alone=alone)
    return trace, attribute(trace, PhaseTable())


def load_job(
    path: str | Path, *, executor: str = "pool", workers: int = 2, mem_gb: float | None = 4.0, progress: bool = False
) -> TraceAnalysis:
    """``path`` (file or folder) as one :class:`TraceAnalysis`; a folder's ranks through ``map_jobs``."""
    files = trace_files(path)
    items = [(str(f), i, len(files) == 1) for i, f in enumerate(files)]
    if len(files) == 1:
        outs = [analyse_rank(items[0])]
    else:
        with tempfile.TemporaryDirectory(prefix="perflab-trace-") as tmp:
            opts = MapOptions(executor, workers=min(workers, len(files)), mem_gb=mem_gb)
            done = map_jobs(analyse_rank, items, opts, Path(tmp) / "jobs", progress=progress, desc="ranks")
        failed = [(f, o.error) for f, o in zip(files, done) if o.state != "ok"]
        if failed:
            f, err = failed[0]
            raise ConfigError("path", str(f), f"a readable trace file ({len(failed)} rank file(s) failed; {err})")
        outs = [o.value for o in done]
    traces: dict[int, RankTrace] = {}
    attributed: dict[int, Attributed] = {}
    for trace, attr in outs:
        if trace.rank in traces:
            raise ConfigError("path", str(path), f"one file per rank (rank {trace.rank}: {traces[trace.rank].path} "
                              f"and {trace.path})")  # fmt: skip
        traces[trace.rank], attributed[trace.rank] = trace, attr
    ta = TraceAnalysis(dict(sorted(traces.items())), attributed=attributed)
    ta.path = str(path)
    return ta


# -- figures ---------------------------------------------------------------------------------
def _frame(df: pd.DataFrame) -> list[dict]:
    return [{k: json_value(v) for k, v in row.items()} for row in df.to_dict(orient="records")]


def figures(ta: TraceAnalysis, top: int = 10, step: int | None = None, paths=None) -> dict[str, list[dict] | dict]:
    """Every figure of the job as JSON-ready tables (one list of rows per table); ``step``: the
    step the critical path is drawn for (default the median-duration one), ``paths`` those paths
    when already drawn (``TraceAnalysis.critical_paths``)."""
    out: dict = {
        "path": ta.path,
        "ranks": ta.ranks,
        "devices": {str(r): ta.device(r) for r in ta.ranks},
        "temporal": _frame(ta.temporal()),
        "temporal_by_step": _frame(ta.temporal(by="step")),
        "shares": _frame(ta.shares()),
        "categories": _frame(ta.categories()),
        "overlap": _frame(ta.overlap()),
        "idle": _frame(ta.idle()),
        "launch": _frame(ta.launch_stats()),
        "phases": _frame(ta.phases()),
        "windows": _frame(ta.windows()),
        "top_kernels": {str(r): _frame(ta.top_kernels(r, top)) for r in ta.ranks},
        "roofline": {str(r): _frame(ta.roofline(r)) for r in ta.ranks},
    }
    calls = ta.collectives()
    out["collectives"] = _frame(calls)
    if len(calls) and len(ta.ranks) > 1:
        out["skew"] = _frame(ta.skew())
        out["straggler"] = {k: json_value(v) for k, v in vars(ta.straggler()).items()}
    out |= analysis_figures(ta, step, paths) | {"timeline_step": step}
    return out


def summary_text(ta: TraceAnalysis, fig: dict) -> str:
    """``TraceAnalysis.summary`` plus the per step breakdown, idle split and collectives."""
    lines = [ta.summary(), "", "in one look:"] + [f"  {s}" for s in headline(fig)]
    lines += ["", "per step (ms): rank step span busy idle compute communication memory"]
    for row in fig["temporal_by_step"]:
        vals = " ".join(f"{(row.get(c) or 0) / 1e3:8.3f}" for c in ("span", "busy", "idle", "compute",
                                                                      "communication", "memory"))  # fmt: skip
        lines.append(f"  {row['rank']:4d} {row['step']:4d} {vals}")
    for row in fig["idle"]:
        lines.append(f"rank {row['rank']} idle split (ms): " + ", ".join(
            f"{k} {(v or 0) / 1e3:.3f}" for k, v in row.items() if k not in ("rank", "rule")))  # fmt: skip
    calls = fig["collectives"]
    if calls:
        df = pd.DataFrame(calls)
        g = df.groupby(["rank", "collective"]).agg(calls=("collective", "size"), total_us=("dur", "sum"))
        lines.append("collectives (rank, collective, calls, total ms):")
        lines += [f"  {r} {c:<20} {int(v.calls):5d} {v.total_us / 1e3:9.3f}" for (r, c), v in g.iterrows()]
        if "straggler" in fig:
            lines.append(f"straggler: {fig['straggler']['verdict']}")
    else:
        lines.append("collectives: none in this trace")
    return "\n".join(lines + summary_lines(fig))


# -- records and the two commands ------------------------------------------------------------
def records(ta: TraceAnalysis) -> Recorder:
    """Per-step figures of ``ta`` as rows (no path among the parameters, so two traces compare)."""
    devices = sorted({str(ta.device(r) or "not recorded") for r in ta.ranks})
    rec = ta.record(Recorder(LAB, params={"trace_devices": devices, "ranks": len(ta.ranks)}))
    # a figure that is zero at every step (no communication at all) has no spread to judge: kept
    # in trace.json and the summary, left out of the compared rows
    rec.rows = [r for r in rec.rows if any(abs(float(v)) > 1e-12 for v in (r.get("samples") or [r["value"]]))]
    return rec


def _job(a, path: str) -> TraceAnalysis:
    return load_job(path, executor=a.executor, workers=a.workers, mem_gb=a.mem_gb, progress=not a.json)


def cmd_trace(a) -> int:
    if a.max_bars < 2:
        raise ConfigError("--max-bars", a.max_bars, "at least 2 bars")
    ta = _job(a, a.path)
    atts = {r: ta.attributed(r) for r in ta.ranks}
    if a.step is not None:
        check_step(a.step, atts, "--step")
    step = a.step if a.step is not None else representative_step(atts[ta.ranks[0]])
    paths = ta.critical_paths(step, MAX_RANKS)
    fig = figures(ta, a.top, step, paths)
    timeline = step_timeline(ta.traces, atts, step, max_bars=a.max_bars, paths={r: p.edges for r, p in paths.items()})
    text = summary_text(ta, fig)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rec_path = records(ta).save(out / "records.json")
    (out / "trace.json").write_text(json.dumps(fig, indent=1, default=str), encoding="utf-8")
    if a.perfetto != "none":
        doc = perfetto_trace(ta.traces, atts, steps=None if a.perfetto == "all" else timeline.step)
        write_perfetto(doc, out / PERFETTO)
    (out / "trace.html").write_text(render_html(ta, fig, text, timeline), encoding="utf-8")
    if a.json:
        print(json.dumps(fig, default=str))
    else:
        print(text)
        extra = f", {PERFETTO} ({a.perfetto})" if a.perfetto != "none" else ""
        print(f"perflab trace: wrote {out / 'trace.html'}, {rec_path}, trace.json{extra}")
    return 0


def cmd_diff(a) -> int:
    out = Path(a.out)
    sides = {}
    for name, path in (("base", a.base), ("candidate", a.candidate)):
        sides[name] = records(_job(a, path)).save(out / name / "records.json")
    cmp = compare(sides["base"], sides["candidate"], threshold=a.threshold)
    paths = cmp.write(out)
    if a.json:
        print(json.dumps(cmp.to_json(), default=str))
    else:
        print(cmp.summary_text(limit=a.limit), end="")
        print(f"perflab trace diff: wrote {paths['html']} (and summary.txt, compare.json)")
    return cmp.exit_code


def _common(ap: argparse.ArgumentParser, out: str) -> None:
    ap.add_argument("--out", default=out, help=f"folder for the records and the HTML page (default: {out})")
    ap.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
    ap.add_argument("--executor", default="pool", choices=MAP_EXECUTORS, help="where a folder's ranks are read")
    ap.add_argument("--workers", type=int, default=2, help="ranks read at once (default 2)")
    ap.add_argument("--mem-gb", type=float, default=4.0, help="memory bound per rank job in GB (default 4)")


def main(argv: Sequence[str] | None = None) -> int:
    """``perflab trace PATH`` or ``perflab trace diff A B``; exit 2 on a bad path or argument."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "diff":
        ap = argparse.ArgumentParser(prog="perflab trace diff", description=__doc__.split("\n\n")[3])
        ap.add_argument("base")
        ap.add_argument("candidate")
        ap.add_argument("--threshold", type=float, default=0.05, help="relative change called a difference")
        ap.add_argument("--limit", type=int, default=40, help="rows in the printed summary")
        _common(ap, ".perflab/trace-diff")
        a, fn = ap.parse_args(argv[1:]), cmd_diff
    else:
        ap = argparse.ArgumentParser(prog="perflab trace", description=__doc__.split("\n\n")[1],
                                     epilog="perflab trace diff A B: compare two traces (see its --help)")  # fmt: skip
        ap.add_argument("path", help="a trace file (.json, .json.gz) or a folder of per-rank trace files")
        ap.add_argument("--top", type=int, default=10, help="top kernels per rank")
        ap.add_argument("--step", type=int, default=None, help="the ProfilerStep the timeline shows (default: "
                        "the median-duration step)")  # fmt: skip
        ap.add_argument("--max-bars", type=int, default=20_000, help="bars in the timeline before short "
                        "activities are merged (default 20000)")  # fmt: skip
        ap.add_argument("--perfetto", default="step", choices=("step", "all", "none"), help=f"write {PERFETTO}: "
                        "the timeline's step (default), the whole attributed trace, or nothing")  # fmt: skip
        _common(ap, ".perflab/trace")
        a, fn = ap.parse_args(argv), cmd_trace
    try:
        return fn(a)
    except (ConfigError, CompareError) as e:
        print(f"{ap.prog}: {e}", file=sys.stderr)
        return EXIT_USAGE


__all__ = ["analyse_rank", "figures", "load_job", "main", "records", "summary_text"]
