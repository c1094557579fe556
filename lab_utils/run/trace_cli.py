"""``perflab trace PATH`` and ``perflab trace diff A B``: real profiler traces from the command line.

``perflab trace PATH`` (a trace file or a folder holding one file per rank) prints the summary of
the job (per rank and per step breakdown, top kernels, overlap, idle split, launch verdicts,
collectives when present) and writes into ``--out`` the records ``perflab compare`` reads
(``records.json``, their context naming the traces' GPU), the figures as JSON (``trace.json``) and
one self-contained HTML page (``trace.html``, BokehJS inline).  ``--json`` prints the figures as
JSON instead of the text summary; ``--gpu NAME`` is the GPU of traces that name none.

A folder's ranks are read by :func:`lab_utils.run.executors.map_jobs` (``--executor
pool|local|slurm``; on SLURM one job array, placed by ``--partition``/``--account``/``--time-limit``
and ``perflab.slurm.yaml``, checked against the site first, its files next to ``--out``), one job per
rank file: each job reads, attributes and summarises its file
(:mod:`lab_utils.traces.summary`) and only the summary comes back, merged into one job.  A file that
cannot be read (truncated, corrupt, not a trace) stops the command before anything is written: one
line naming it, exit 2.

``perflab trace diff A B`` reads both sides (files or folders), pairs their ranks (the same ranks
rank by rank, one rank each, as many ranks by position, else pooled), records every kernel,
launching operator, category and phase per step (a row only one side ran is 0 ms on the other) and
compares them with :func:`lab_utils.run.compare.compare`: verdicts from the spread across steps, by
step index; only the times gate (``gate="performance"``), the shares and idle are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from lab_utils.core.config import ConfigError
from lab_utils.core.datasheets import check_part
from lab_utils.core.device import HOST
from lab_utils.core.records import Recorder, json_value
from lab_utils.run.cluster import ClusterOptions, cluster_options, resolve_site
from lab_utils.run.commands import trace as trace_args
from lab_utils.run.executors import ChildFailed, Forked, MapOptions, map_jobs
from lab_utils.run.trace_analyses import (
    MAX_RANKS,
    analysis_figures,
    job_perfetto,
    job_timeline,
    path_values,
    rank_extras,
    summary_lines,
)
from lab_utils.traces import TraceAnalysis
from lab_utils.traces.attribute import step_windows
from lab_utils.traces.perfetto import write_perfetto
from lab_utils.traces.reader import read_rank, read_steps, trace_files
from lab_utils.traces.summary import JobSummary, RankSummary, summarise
from lab_utils.traces.timeline import check_steps, median_step

LAB = "trace"
EXIT_USAGE = 2
PERFETTO = "trace.perfetto.json.gz"  # the attributed trace for Perfetto (lab_utils.traces.perfetto)


# -- reading a job: map per rank, reduce to one JobSummary ---------------------------------
@dataclass
class RankError:
    """A rank file that could not be read: returned by its job, not raised (any executor carries it)."""

    path: str
    message: str  # one line


def analyse_rank(item: tuple) -> RankSummary | RankError:
    """One rank file read, attributed and summarised (a job of :func:`map_jobs`):
    ``(path, index, alone, gpu[, options])``; only the summary comes back (see
    :mod:`lab_utils.traces.summary`).  ``options`` (``perflab trace``'s): ``step``, ``page`` (this rank
    on the page: its extras, :func:`lab_utils.run.trace_analyses.rank_extras`), ``max_bars``,
    ``perfetto``, ``paths`` (the critical path per step among the records), ``split`` (the page's
    analyses in a child forked after the read, :class:`~lab_utils.run.executors.Forked`, beside the
    summary: :func:`load_job` asks it of the pool's jobs where there are two cores per file)."""
    path, index, alone, gpu = item[:4]
    opts = item[4] if len(item) > 4 else {}
    try:
        trace = read_rank(path, index, alone=alone)
        ta = TraceAnalysis({trace.rank: trace}, gpu=gpu)

        def extras() -> dict:
            return rank_extras(ta, trace.rank, opts.get("step"), page=bool(opts.get("page")),
                               max_bars=opts.get("max_bars", 20_000),
                               perfetto=opts.get("perfetto", "none"))  # fmt: skip

        beside = None
        if opts.get("split") and opts.get("page"):  # the page's analyses in a child, on the core left free
            ta.attributed(trace.rank)  # what both need, made once before the fork
            beside = Forked(extras)
        summary = summarise(ta, trace.rank)
        if opts.get("paths"):
            summary.per_step = pd.concat([summary.per_step, path_values(ta, trace.rank)], ignore_index=True)
        if opts:
            summary.extras = _result_or_here(beside, extras) if beside is not None else extras()
        return summary
    except ConfigError as e:
        return RankError(path, one_line(str(e)))
    except MemoryError:
        return RankError(path, f"parameter 'path' = {path!r} is not allowed: expected a trace that fits the job's "
                               "memory (--mem-gb)")  # fmt: skip


def _result_or_here(beside: Forked, work: Callable[[], dict]) -> dict:
    """The child's value; where the child failed (killed, out of memory, a value that does not
    pickle), ``work()`` done here, so its own errors are raised as they would be without the fork."""
    try:
        return beside.result()
    except ChildFailed:
        return work()


def one_line(text: str) -> str:
    """The last non-empty line of ``text`` (a traceback's is the error itself), without its newlines."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else "no error message"


def load_job(
    path: str | Path,
    *,
    jobs: MapOptions | None = None,
    jobs_dir: str | Path = ".perflab",
    progress: bool = False,
    gpu: str | None = None,
    options: dict | None = None,
    only: list[int] | None = None,
    meanwhile: Callable[[], object] | None = None,
) -> JobSummary:
    """``path`` (file or folder) as one :class:`JobSummary`; a folder's ranks through ``map_jobs``
    (``jobs``: how, default a pool of 2 processes, 4 GB each; ``jobs.cluster``: where SLURM jobs go;
    their files under ``jobs_dir``, on a filesystem the nodes share, removed at the end).
    A rank file that cannot be read raises one ``ConfigError`` naming it (the first, in file order).
    ``options``: what each rank's job adds (:func:`analyse_rank`; ``page`` for the first
    :data:`~lab_utils.run.trace_analyses.MAX_RANKS` files); ``only``: read these files (by index) alone.
    ``meanwhile()``: work of the caller's done while the ranks are read (``perflab trace`` imports its
    page's plotting there); with it a lone file of the pool executor is read in a worker process too
    (unbounded, as in this one), so that the work overlaps."""
    files = trace_files(path)
    opts = options or {}
    first = {"page": opts.get("page", True), "paths": opts.get("paths", True)}  # the first MAX_RANKS files only
    items = [(str(f), i, len(files) == 1, gpu, opts and opts | {k: v and i < MAX_RANKS for k, v in first.items()})
             for i, f in enumerate(files)]  # fmt: skip
    if only is not None:
        files, items = [files[i] for i in only], [items[i] for i in only]
    how = jobs or MapOptions()
    if len(items) == 1 and not (meanwhile is not None and how.executor == "pool"):
        if meanwhile is not None:
            meanwhile()
        outs: list = [analyse_rank(items[0])]
    else:
        alone = len(items) == 1
        if how.executor == "pool" and how.workers >= 2 * len(items):  # two cores a file: its page's analyses beside
            items = [(*it[:4], it[4] | {"split": True}) if len(it) > 4 and it[4] else it for it in items]
        opts = replace(how, workers=min(how.workers, len(files)), mem_gb=None if alone else how.mem_gb)
        folder = Path(jobs_dir).resolve() / f".jobs-trace-{os.getpid()}"
        done = map_jobs(analyse_rank, items, opts, folder, progress=progress and not alone, desc="ranks",
                        meanwhile=meanwhile)  # fmt: skip
        outs = [o.value if o.state == "ok" else RankError(str(f), f"{o.state}: {one_line(o.error)}")
                for f, o in zip(files, done)]  # fmt: skip
    failed = [o for o in outs if isinstance(o, RankError)]
    if failed:
        of = f" ({len(failed)} of {len(files)} rank files failed)" if len(files) > 1 else ""
        msg = failed[0].message
        if msg.startswith("parameter 'path'"):
            raise ConfigError("path", failed[0].path, msg.split("expected ", 1)[-1] + of)
        raise ConfigError("path", failed[0].path, f"a trace file its job can read ({msg}){of}")
    ranks: dict[int, RankSummary] = {}
    for r in outs:
        if r.rank in ranks:
            raise ConfigError("path", str(path), f"one file per rank (rank {r.rank}: {ranks[r.rank].path} "
                              f"and {r.path})")  # fmt: skip
        ranks[r.rank] = r
    return JobSummary(ranks, str(path))


# -- figures ---------------------------------------------------------------------------------
def _frame(df: pd.DataFrame) -> list[dict]:
    return [{k: json_value(v) for k, v in row.items()} for row in df.to_dict(orient="records")]


def figures(job: JobSummary, top: int = 10, step: int | None = None) -> dict[str, list[dict] | dict]:
    """Every figure of the job as JSON-ready tables (one list of rows per table); with the ranks'
    extras (``perflab trace``), the analyses of :mod:`lab_utils.run.trace_analyses` for ``step``."""
    out: dict = {
        "path": job.path,
        "ranks": job.ranks,
        "devices": {str(r): job.device(r) for r in job.ranks},
        "temporal": _frame(job.table("temporal")),
        "temporal_by_step": _frame(job.table("temporal_by_step")),
        "shares": _frame(job.table("shares")),
        "categories": _frame(job.table("categories")),
        "overlap": _frame(job.table("overlap")),
        "idle": _frame(job.table("idle")),
        "launch": _frame(job.table("launch")),
        "phases": _frame(job.table("phases")),
        "windows": _frame(job.table("windows")),
        "top_kernels": {str(r): _frame(job.top_kernels(r, top)) for r in job.ranks},
        "roofline": {str(r): _frame(job.ranks_[r].tables["roofline"]) for r in job.ranks},
    }
    calls = job.collectives()
    out["collectives"] = _frame(calls)
    if len(calls) and len(job.ranks) > 1:
        out["skew"] = _frame(job.skew())
        out["straggler"] = {k: json_value(v) for k, v in vars(job.straggler()).items()}
    return out | analysis_figures(job, step)


def _page_modules() -> None:
    """What drawing trace.html needs beyond reading a trace (bokeh: most of the command's import time)."""
    import lab_utils.run.trace_html  # noqa: F401, PLC0415


def summary_text(job: JobSummary, fig: dict) -> str:
    """:meth:`JobSummary.summary` plus the per step breakdown, idle split and collectives."""
    from lab_utils.run.trace_html import headline  # noqa: PLC0415 - bokeh, loaded only for a page

    lines = [job.summary(), "", "in one look:"] + [f"  {s}" for s in headline(fig)]
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
        if "busbw_transfer_gbps" not in df:
            df["busbw_transfer_gbps"] = float("nan")
        g = df.groupby(["rank", "collective"]).agg(calls=("collective", "size"), total_us=("dur", "sum"),
                                                   bus=("busbw_gbps", "median"),
                                                   transfer=("busbw_transfer_gbps", "median"))  # fmt: skip
        lines.append("collectives (rank, collective, calls, total ms, median bus GB/s: with the wait for late ranks "
                     "| from the transfer alone):")  # fmt: skip
        lines += [f"  {r} {c:<20} {int(v.calls):5d} {v.total_us / 1e3:9.3f} {v.bus:9.2f} | {v.transfer:9.2f}"
                  for (r, c), v in g.iterrows()]  # fmt: skip
        if "straggler" in fig:
            lines.append(f"straggler: {fig['straggler']['verdict']}")
    else:
        lines.append("collectives: none in this trace")
    return "\n".join(lines + summary_lines(fig))


# -- records and the two commands ------------------------------------------------------------
@dataclass
class TraceRecorder(Recorder):
    """Records of a trace: their context names the GPU the trace ran on (or the ``--gpu`` given for
    it), never the machine that analysed it."""

    job: JobSummary | None = None

    def context(self) -> dict:
        ctx = super().context()
        if self.job is not None:
            ctx.update(trace_context(self.job))
        return ctx


def trace_context(job: JobSummary) -> dict:
    """``device``, ``device_kind`` and ``device_info`` of the GPU(s) a job's traces ran on."""
    devices = sorted({str(job.device(r) or "GPU not recorded") for r in job.ranks})
    rules = sorted({job.ranks_[r].rule for r in job.ranks})
    props = job.ranks_[job.ranks[0]].properties if job.ranks else {}
    info = {"name": "; ".join(devices), "units": props.get("numSms"), "memory_bytes": props.get("totalGlobalMem")}
    return {"device": "; ".join(devices), "device_kind": "cpu trace" if rules == ["cpu"] else "gpu trace",
            "device_info": {k: v for k, v in info.items() if v is not None}}  # fmt: skip


def records(job: JobSummary, variants: dict[int, str] | None = None) -> Recorder:
    """Per-step figures of ``job`` as rows (:mod:`lab_utils.traces.summary`); no path or rank among
    the parameters, so two traces compare; ``variants``: rank -> row variant (default ``rank<N>``)."""
    # device=HOST: the rows were read from the trace, not measured here (no torch asked about this machine)
    return job.record(TraceRecorder(LAB, device=HOST, job=job), variants=variants)


def pair_ranks(base: list[int], cand: list[int]) -> tuple[dict[int, str], dict[int, str], str]:
    """How two jobs' ranks meet: the same ranks -> rank by rank; one rank each -> those two; as many
    ranks -> by position; else every rank pooled.  (variants of base, of candidate, in words)."""
    if base == cand:
        return ({r: f"rank{r}" for r in base},) * 2 + (f"rank by rank ({len(base)} rank(s))",)
    if len(base) == len(cand) == 1:
        return {base[0]: "rank"}, {cand[0]: "rank"}, f"one rank each: rank {base[0]} vs rank {cand[0]}"
    if len(base) == len(cand):
        pairs = ", ".join(f"{b}-{c}" for b, c in zip(base, cand))
        return ({b: f"rank#{i}" for i, b in enumerate(base)}, {c: f"rank#{i}" for i, c in enumerate(cand)},
                f"by position ({pairs})")  # fmt: skip
    return (dict.fromkeys(base, "all ranks"), dict.fromkeys(cand, "all ranks"),
            f"pooled: {len(base)} rank(s) vs {len(cand)}, every rank's steps side by side")  # fmt: skip


#: the gated time rows a trace lacks when the kernel, operator, category or phase did not run in it
ZERO_FILLED = ("kernel:", "op:", "category:", "phase:", "critical_path:")


def zero_fill(a: Recorder, b: Recorder) -> tuple[int, int, int]:
    """Give each side the time rows (``ZERO_FILLED``) only the other has, at 0 ms per step: what did
    not run took no time.  Returns (rows in both, only in a, only in b) as recorded."""

    def index(rec: Recorder) -> dict:
        return {(r["variant"], r["metric"]): r for r in rec.rows}

    ia, ib = index(a), index(b)
    both = len(ia.keys() & ib.keys())
    for mine, theirs, rec in ((ia, ib, a), (ib, ia, b)):
        steps = {v: len(r["samples"] or []) for (v, m), r in mine.items() if m == "span"}
        for (variant, metric), row in theirs.items():
            if (variant, metric) not in mine and metric.startswith(ZERO_FILLED) and variant in steps:
                rec.add(row["experiment"], variant, metric, 0.0, row["unit"], statistic=row["statistic"],
                        samples=[0.0] * max(steps[variant], 1), stable=row["stable"],
                        stability=row["stability"])  # fmt: skip
    return both, len(ia.keys() - ib.keys()), len(ib.keys() - ia.keys())


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


def _job(a, path: str, options: dict | None = None, only: list[int] | None = None,
         meanwhile: Callable[[], object] | None = None) -> JobSummary:  # fmt: skip
    jobs = MapOptions(a.executor, workers=a.workers, mem_gb=a.mem_gb)
    cluster = getattr(a, "cluster", None) or _cluster(a)  # the commands resolve it first; a caller may not have
    if cluster is not None:
        jobs.cluster = cluster
    return load_job(path, jobs=jobs, jobs_dir=Path(a.out).parent, progress=not a.json, gpu=a.gpu, options=options,
                    only=only, meanwhile=meanwhile)  # fmt: skip


def page_job(a, meanwhile: Callable[[], object] | None = None) -> tuple[JobSummary, int]:
    """The job read with its page's extras, every page rank's for one step: ``--step``, else the
    median-duration step of the first file (found by reading only its step annotations, before the
    ranks' jobs start, so every page rank draws that step at once; a rank whose job ended on another
    step, as when that first file cannot be read here, is read again for it).  ``meanwhile``: as
    :func:`load_job`'s, for the first read."""
    step = a.step
    files = trace_files(a.path)
    if step is None and len(files) > 1:
        try:
            windows = step_windows(read_steps(files[0]).assign(end=lambda d: d["ts"] + d["dur"], tid=""))
            step = median_step(windows) if len(windows) else None
        except ConfigError:  # the rank's own job reports it, naming the file
            step = None
    opts = {"step": step, "max_bars": a.max_bars, "perfetto": a.perfetto}
    job = _job(a, a.path, opts, meanwhile=meanwhile)
    first = job.ranks_[job.ranks[0]].extras
    step = step if step is not None else first["step"]
    check_steps("--step", step, [job.ranks_[r].extras["steps"] for r in job.ranks])
    again = [i for i, r in enumerate(job.ranks) if "bars" in job.ranks_[r].extras
             and job.ranks_[r].extras["step"] != step and step in job.ranks_[r].extras["steps"]]  # fmt: skip
    if again:
        index = {str(f): i for i, f in enumerate(files)}
        redo = _job(a, a.path, opts | {"step": step}, [index[job.ranks_[job.ranks[i]].path] for i in again])
        job.ranks_.update(redo.ranks_)
    return job, step


def cmd_trace(a) -> int:
    check_part("gpu", a.gpu)
    if a.max_bars < 2:
        raise ConfigError("--max-bars", a.max_bars, "at least 2 bars")
    a.cluster = _cluster(a)
    job, step = page_job(a, meanwhile=_page_modules)  # the page's plotting loads while the ranks are read
    from lab_utils.run.trace_html import render_html  # noqa: PLC0415 - loaded by _page_modules

    fig = figures(job, a.top, step)
    timeline = job_timeline(job, step, a.max_bars)
    text = summary_text(job, fig)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rec_path = records(job).save(out / "records.json")
    (out / "trace.json").write_text(json.dumps(fig, indent=1, default=str), encoding="utf-8")
    doc = job_perfetto(job)
    if doc is not None:
        write_perfetto(doc, out / PERFETTO)
    (out / "trace.html").write_text(render_html(job, fig, text, timeline), encoding="utf-8")
    if a.json:
        print(json.dumps(fig, default=str))
    else:
        print(text)
        extra = f", {PERFETTO} ({a.perfetto})" if doc is not None else ""
        print(f"perflab trace: wrote {out / 'trace.html'}, {rec_path}, trace.json{extra}")
    return 0


def cmd_diff(a) -> int:
    """Both sides read first (a bad one is refused before anything is written), then recorded with
    their ranks paired, the rows only one side ran filled with zeros, and compared; only the time rows
    gate (``gate="performance"``: shares and idle are reported).  Records a comparison refuses:
    one line, exit 2."""
    from lab_utils.run.compare import CompareError  # noqa: PLC0415 - the comparison's report loads bokeh

    try:
        return _diff(a)
    except CompareError as e:
        print(f"perflab trace diff: {e}", file=sys.stderr)
        return EXIT_USAGE


def _diff(a) -> int:
    from lab_utils.run.compare import compare  # noqa: PLC0415 - loaded with CompareError (cmd_diff)

    check_part("gpu", a.gpu)
    a.cluster = _cluster(a)
    base, cand = (_job(a, p, {"paths": True, "page": False}) for p in (a.base, a.candidate))
    vb, vc, how = pair_ranks(base.ranks, cand.ranks)
    rb, rc = records(base, vb), records(cand, vc)
    both, only_b, only_c = zero_fill(rb, rc)
    out = Path(a.out)
    sides = {"base": rb.save(out / "base" / "records.json"), "candidate": rc.save(out / "candidate" / "records.json")}
    cmp = compare(sides["base"], sides["candidate"], threshold=a.threshold, gate="performance",
                  allow_device_mismatch=a.allow_device_mismatch)  # fmt: skip
    paths = cmp.write(out)
    total = both + only_b + only_c
    matched = (f"ranks {how}; rows recorded in both traces: {both} of {total} ({100 * both / max(total, 1):.0f}%), "
               f"{only_b} only in the base, {only_c} only in the candidate (their times shown at 0 ms on the "
               "other side)")  # fmt: skip
    if a.json:
        print(json.dumps(cmp.to_json() | {"ranks": how, "rows_in_both": both, "rows_total": total}, default=str))
    else:
        print(cmp.summary_text(limit=a.limit), end="")
        print(matched)
        print(f"perflab trace diff: wrote {paths['html']} (and summary.txt, compare.json)")
    return cmp.exit_code


def run(a: argparse.Namespace) -> int:
    """``perflab trace`` (``a.diff`` false) or ``perflab trace diff`` on parsed arguments; exit 2 on a
    bad path or argument."""
    fn, prog = (cmd_diff, "perflab trace diff") if getattr(a, "diff", False) else (cmd_trace, "perflab trace")
    try:
        return fn(a)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """``perflab trace PATH`` or ``perflab trace diff A B`` from a list of arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    diff = bool(argv) and argv[0] == "diff"
    a = trace_args.parser(diff).parse_args(argv[1:] if diff else argv)
    a.diff = diff
    return run(a)


__all__ = [
    "RankError",
    "TraceRecorder",
    "analyse_rank",
    "figures",
    "load_job",
    "main",
    "pair_ranks",
    "records",
    "run",
    "summary_text",
    "zero_fill",
]
