"""The ``perflab`` command.

perflab run SUITE|NOTEBOOK [--param key=value ...] [--only NOTEBOOK ...] [--out DIR] [--timing-threads N|auto]
            [--parallel N] [--devices 0,1,...] [--executor local|slurm] [--partition P] [--nodes N] ...
            (jobs: lab_utils.run.parallel, docs/cluster.md)
perflab run --list
perflab ceilings [--force] [--quick]
perflab nb refresh LAB.ipynb ...
perflab lab [--reset [NAME ...]] [-- JUPYTER-ARGS]  (lab_utils.run.workspace: JupyterLab on work/labs/)
perflab compare BASE CANDIDATE [...]      (lab_utils.run.compare)
perflab baseline refresh|check [...]      (lab_utils.run.compare.baselines)
perflab numdiff A B [--variant-a V] [...]  (lab_utils.stability.numdiff: where two runs' telemetry parts)
perflab trace PATH | trace diff A B [...]  (lab_utils.run.trace_cli: profiler traces, files or folders)
"""

from __future__ import annotations

import argparse
import json
import sys

from lab_utils.core.ceilings import cached_ceilings, get_ceilings
from lab_utils.core.config import ConfigError
from lab_utils.core.records import load_records, thread_cut_note
from lab_utils.run.compare import baseline_main, lab_name
from lab_utils.run.compare import main as compare_main
from lab_utils.run.nbtools import refresh
from lab_utils.run.parallel import add_job_options, job_options
from lab_utils.run.runner import RunInterrupted, SuiteError, list_suites, load_suite, parse_overrides, run_suite
from lab_utils.run.workspace import main as lab_main
from lab_utils.stability.numdiff import numdiff_main


def _cmd_run(a) -> int:
    if a.list:
        for name in list_suites():
            try:
                s = load_suite(name)
            except SuiteError as e:
                print(f"{name}: BROKEN: {e}")
                continue
            print(f"{name}: {s.description}")
            for e in s.entries:
                extra = f" {e.params}" if e.params else ""
                print(f"  - {e.stem} (set {e.set or 'defaults'}){extra}")
        return 0
    if not a.suite:
        print("perflab run: give a SUITE (see `perflab run --list`)", file=sys.stderr)
        return 2
    try:
        res = run_suite(
            a.suite,
            overrides=parse_overrides(a.param),
            out_dir=a.out,
            only=[lab_name(x) for x in a.only] if a.only else None,
            progress=not a.no_progress,
            timing_threads=a.timing_threads,
            jobs=job_options(a),
        )
    except (SuiteError, ConfigError, ValueError) as e:
        print(f"perflab run: {e}", file=sys.stderr)
        return 2
    except RunInterrupted as e:
        print(f"perflab run: {e}", file=sys.stderr)
        return 130
    for s in res.statuses:
        line = f"  {s.status:6s} {s.notebook} ({s.seconds:.1f} s, {s.rows} records)"
        if s.error:
            line += f"\n         {s.error.splitlines()[0][:300]}"
        print(line)
    print(f"report: {res.index}")
    note = _threads_note(res.path)
    if note:
        print(f"perflab run: {note}", file=sys.stderr)
    if not res.ok:
        print(f"perflab run: {sum(s.status != 'ok' for s in res.statuses)} notebook(s) failed", file=sys.stderr)
        return 1
    return 0


def _threads_note(path) -> str:
    """The report's line on timings whose thread count the busy machine cut ("" if none)."""
    try:
        ctx = json.loads((path / "context.json").read_text())
        return thread_cut_note(load_records(path), ctx)
    except (OSError, ValueError):
        return ""


def _cmd_ceilings(a) -> int:
    # without --force, what is cached (the full measurement, else the quick one smoke runs take) is shown
    c = None if (a.force or a.quick) else cached_ceilings(a.device)
    if c is None:
        c = get_ceilings(a.device, force=a.force, quick=a.quick, progress=True)
        how = "measured now" if a.force else "cached or measured now"
    else:
        how = "cached; --force re-measures"
    print(f"{c.device_name} (measured {c.measured_at}{', quick' if c.quick else ''}; {how})")
    for r in c.summary_rows():
        ds = f"{r['datasheet']:.4g}" if r["datasheet"] else "—"
        me = f"{r['measured']:.4g}" if r["measured"] else "—"
        print(f"  {r['quantity']:16s} measured {me:>10s}  datasheet {ds:>8s} {r['unit']}  {r['note']}")
    return 0


def _cmd_nb(a) -> int:
    for p in a.paths:
        refresh(p)
        print(f"refreshed {p}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    if argv and argv[0] == "baseline":
        return baseline_main(argv[1:])
    if argv and argv[0] == "numdiff":
        return numdiff_main(argv[1:])
    if argv and argv[0] == "lab":
        return lab_main(argv[1:])
    if argv and argv[0] == "trace":
        from lab_utils.run.trace_cli import main as trace_main  # noqa: PLC0415  (holoviews: seconds to import)

        return trace_main(argv[1:])
    ap = argparse.ArgumentParser(
        prog="perflab", description="perflab: a performance lab for diffusion-transformer training"
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a suite of notebooks headless into reports/<run-id>/")
    r.add_argument("suite", nargs="?", help="a suite's name or file, or a notebook's path (labs/05_memory.ipynb)")
    r.add_argument("--list", action="store_true", help="list suites and their notebooks")
    r.add_argument("--param", action="append", metavar="KEY=VALUE", help="override a parameter (YAML value)")
    r.add_argument(
        "--only",
        action="append",
        metavar="NOTEBOOK",
        help="run only this notebook of the suite (a name like 05_memory or a path like labs/05_memory.ipynb)",
    )
    r.add_argument("--out", default=None, help="reports folder (default: reports/)")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument(
        "--timing-threads",
        default=None,
        metavar="N|auto",
        help="CPU threads every lab times with (default: auto, the cores other processes leave free; "
        "recorded in each report's context)",
    )
    add_job_options(r)
    r.set_defaults(fn=_cmd_run)
    c = sub.add_parser("ceilings", help="measure (or show cached) copy and matmul ceilings")
    c.add_argument("--force", action="store_true", help="re-measure even if cached (without it, the cache is shown)")
    c.add_argument("--quick", action="store_true", help="the smaller sizes CPU smoke runs use (cached separately)")
    c.add_argument("--device", default=None)
    c.set_defaults(fn=_cmd_ceilings)
    n = sub.add_parser("nb", help="notebook maintenance")
    nsub = n.add_subparsers(dest="nbcmd", required=True)
    rf = nsub.add_parser("refresh", help="execute a lab at its defaults and keep only checked outputs")
    rf.add_argument("paths", nargs="+")
    rf.set_defaults(fn=_cmd_nb)
    sub.add_parser("compare", help="compare two reports (see `perflab compare --help`)")
    sub.add_parser("baseline", help="stored baselines (see `perflab baseline --help`)")
    sub.add_parser("lab", help="JupyterLab on git-ignored working copies of labs/ (see `perflab lab --help`)")
    sub.add_parser("trace", help="analyse profiler traces: `perflab trace PATH`, `perflab trace diff A B`")
    sub.add_parser("numdiff", help="where two reports' telemetry first differs (see `perflab numdiff --help`)")
    a = ap.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
