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
import html
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import holoviews as hv
import pandas as pd
from bokeh.embed import components
from bokeh.resources import Resources

from lab_utils.core.config import ConfigError
from lab_utils.core.records import Recorder, json_value
from lab_utils.run.cluster import ClusterOptions, cluster_options, resolve_site
from lab_utils.run.compare import compare
from lab_utils.run.compare.rules import CompareError
from lab_utils.run.executors import MAP_EXECUTORS, MapOptions, map_jobs
from lab_utils.traces import PhaseTable, TraceAnalysis
from lab_utils.traces.attribute import Attributed, attribute
from lab_utils.traces.reader import RankTrace, read_rank, trace_files

LAB = "trace"
EXIT_USAGE = 2


# -- reading a job: map per rank, reduce to one TraceAnalysis ------------------------------
def analyse_rank(item: tuple[str, int, bool]) -> tuple[RankTrace, Attributed]:
    """One rank file read and attributed (a job of :func:`map_jobs`): ``(path, index, alone)``."""
    path, index, alone = item
    trace = read_rank(path, index, alone=alone)
    return trace, attribute(trace, PhaseTable())


def load_job(
    path: str | Path,
    *,
    executor: str = "pool",
    workers: int = 2,
    mem_gb: float | None = 4.0,
    progress: bool = False,
    cluster: ClusterOptions | None = None,
    jobs_dir: str | Path = ".perflab",
) -> TraceAnalysis:
    """``path`` (file or folder) as one :class:`TraceAnalysis`; a folder's ranks through ``map_jobs``
    (``cluster``: where SLURM jobs go; their files under ``jobs_dir``, on a filesystem the nodes
    share, removed at the end)."""
    files = trace_files(path)
    items = [(str(f), i, len(files) == 1) for i, f in enumerate(files)]
    if len(files) == 1:
        outs = [analyse_rank(items[0])]
    else:
        opts = MapOptions(executor, workers=min(workers, len(files)), mem_gb=mem_gb)
        if cluster is not None:
            opts.cluster = cluster
        folder = Path(jobs_dir).resolve() / f".jobs-trace-{os.getpid()}"
        done = map_jobs(analyse_rank, items, opts, folder, progress=progress, desc="ranks")
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


def figures(ta: TraceAnalysis, top: int = 10) -> dict[str, list[dict] | dict]:
    """Every figure of the job as JSON-ready tables (one list of rows per table)."""
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
    return out


def summary_text(ta: TraceAnalysis, fig: dict) -> str:
    """``TraceAnalysis.summary`` plus the per step breakdown, idle split and collectives."""
    lines = [ta.summary(), "", "per step (ms): rank step span busy idle compute communication memory"]
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
            lines.append(f"straggler: {fig['straggler']}")
    else:
        lines.append("collectives: none in this trace")
    return "\n".join(lines)


# -- the HTML page ---------------------------------------------------------------------------
def inline_bokeh() -> str:
    """BokehJS inline, any ``<script src=...>`` another import registered dropped (as the compare page)."""
    return re.sub(r"<script[^>]*\bsrc=[^>]*>\s*</script>", "", Resources(mode="inline", components=["bokeh"]).render())


def _plots(ta: TraceAnalysis, fig: dict):
    hv.extension("bokeh", logo=False)
    t = pd.DataFrame(fig["temporal"])
    parts = ["compute", "communication", "memory", "other", "idle"]
    long = t.melt(id_vars=["rank"], value_vars=[p for p in parts if p in t], var_name="part", value_name="us")
    long["ms"], long["rank"] = long["us"] / 1e3, long["rank"].astype(str)
    per_rank = hv.Bars(long, kdims=["rank", "part"], vdims="ms").opts(
        stacked=True, width=520, height=320, title="per rank: where the span went (ms)", tools=["hover"]
    )
    s = pd.DataFrame(fig["temporal_by_step"])
    plots = [per_rank]
    if len(s):
        s["label"] = "r" + s["rank"].astype(str) + " s" + s["step"].astype(str)
        ls = s.melt(id_vars=["label"], value_vars=[p for p in parts if p in s], var_name="part", value_name="us")
        ls["ms"] = ls["us"] / 1e3
        bars = hv.Bars(ls, kdims=["label", "part"], vdims="ms")
        plots.append(bars.opts(stacked=True, width=620, height=320, title="per rank and step (ms)", xrotation=45))
    return hv.render(hv.Layout(plots).cols(2), backend="bokeh")


def _table(rows: list[dict], cols: Sequence[str] | None = None, limit: int = 50) -> str:
    if not rows:
        return "<p class='muted'>none</p>"
    cols = list(cols or rows[0].keys())
    esc = html.escape

    def cell(v) -> str:
        return f"{v:.4g}" if isinstance(v, float) else esc(str(v))

    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows[:limit])
    more = f"<p class='muted'>{len(rows) - limit} more rows in trace.json</p>" if len(rows) > limit else ""
    return f"<table><tr>{head}</tr>{body}</table>{more}"


def render_html(ta: TraceAnalysis, fig: dict, summary: str) -> str:
    """One self-contained page: BokehJS inline, no script loaded from anywhere else."""
    script, div = components(_plots(ta, fig))
    esc = html.escape
    sections = [("launch verdict", _table(fig["launch"])), ("overlap", _table(fig["overlap"])),
                ("idle split (us)", _table(fig["idle"])), ("HTA kernel types (%)", _table(fig["shares"])),
                ("categories", _table(fig["categories"]))]  # fmt: skip
    sections += [(f"top kernels, rank {r}", _table(rows)) for r, rows in fig["top_kernels"].items()]
    sections += [("phases (us)", _table(fig["phases"])), ("windows", _table(fig["windows"]))]
    sections += [(f"roofline, rank {r}", _table(rows)) for r, rows in fig["roofline"].items() if rows]
    sections.append(("collectives", _table(fig["collectives"])))
    if "skew" in fig:
        sections.append(("skew across ranks", _table(fig["skew"])))
    body = "".join(f"<h2>{esc(h)}</h2>{t}" for h, t in sections)
    style = (
        "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px}.muted{color:#777}pre{background:#f6f6f6;padding:1em}"
    )
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>perflab trace {esc(ta.path)}</title>'
        f"{inline_bokeh()}<style>{style}</style></head><body><h1>perflab trace</h1>"
        f"<pre>{esc(summary)}</pre>{div}{body}{script}</body></html>"
    )


# -- records and the two commands ------------------------------------------------------------
def records(ta: TraceAnalysis) -> Recorder:
    """Per-step figures of ``ta`` as rows (no path among the parameters, so two traces compare)."""
    devices = sorted({str(ta.device(r) or "not recorded") for r in ta.ranks})
    rec = ta.record(Recorder(LAB, params={"trace_devices": devices, "ranks": len(ta.ranks)}))
    # a figure that is zero at every step (no communication at all) has no spread to judge: kept
    # in trace.json and the summary, left out of the compared rows
    rec.rows = [r for r in rec.rows if any(abs(float(v)) > 1e-12 for v in (r.get("samples") or [r["value"]]))]
    return rec


def _cluster(a) -> ClusterOptions | None:
    """Where the ranks' jobs go (options, then perflab.slurm.yaml), checked against the site before any work."""
    if a.executor not in ("local", "slurm"):
        for name in ("partition", "account", "time_limit", "cluster_config"):
            if getattr(a, name) is not None:
                raise ConfigError(f"--{name.replace('_', '-')}", getattr(a, name), "a value only with --executor slurm")
        return None
    given = dict(partition=a.partition, account=a.account, timeout_min=a.time_limit)
    opts = cluster_options(a.executor, a.cluster_config, **given)
    try:
        return resolve_site(replace(opts, mem_gb=opts.mem_gb or a.mem_gb), gpus=0, nodes=1)
    except ConfigError as e:
        raise ConfigError("--mem-gb", e.value, e.allowed) if e.param == "mem_gb" else e from None


def _job(a, path: str) -> TraceAnalysis:
    return load_job(path, executor=a.executor, workers=a.workers, mem_gb=a.mem_gb, progress=not a.json,
                    cluster=a.cluster, jobs_dir=Path(a.out).parent)  # fmt: skip


def cmd_trace(a) -> int:
    a.cluster = _cluster(a)
    ta = _job(a, a.path)
    fig = figures(ta, a.top)
    text = summary_text(ta, fig)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rec_path = records(ta).save(out / "records.json")
    (out / "trace.json").write_text(json.dumps(fig, indent=1, default=str), encoding="utf-8")
    (out / "trace.html").write_text(render_html(ta, fig, text), encoding="utf-8")
    if a.json:
        print(json.dumps(fig, default=str))
    else:
        print(text)
        print(f"perflab trace: wrote {out / 'trace.html'}, {rec_path} and trace.json")
    return 0


def cmd_diff(a) -> int:
    a.cluster = _cluster(a)
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
    g = ap.add_argument_group("SLURM (--executor slurm; defaults from perflab.slurm.yaml, docs/cluster.md)")
    g.add_argument("--partition", default=None, help="sbatch --partition (default: the site's default partition)")
    g.add_argument("--account", default=None, help="sbatch --account")
    g.add_argument("--time-limit", type=int, default=None, metavar="MIN", help="each rank job's limit (sbatch --time)")
    g.add_argument("--cluster-config", default=None, metavar="YAML", help="defaults for these (perflab.slurm.yaml)")


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
        _common(ap, ".perflab/trace")
        a, fn = ap.parse_args(argv), cmd_trace
    try:
        return fn(a)
    except (ConfigError, CompareError) as e:
        print(f"{ap.prog}: {e}", file=sys.stderr)
        return EXIT_USAGE


__all__ = ["analyse_rank", "figures", "load_job", "main", "records", "render_html", "summary_text"]
