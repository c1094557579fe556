"""The ``perflab`` command.

perflab run SUITE [--param key=value ...] [--only NOTEBOOK ...] [--out DIR] [--timing-threads N|auto]
            [--keep-traces] [--export mlflow|tensorboard] [--parallel N] [--executor local|slurm] ...
perflab run --list
perflab ceilings [--force] [--quick]
perflab nb refresh LAB.ipynb ...
perflab lab [--reset [NAME ...]] [-- JUPYTER-ARGS]
perflab compare BASE CANDIDATE [...]
perflab baseline refresh|check|show|migrate [...]
perflab numdiff A B [--variant-a V] [...]
perflab trace PATH | trace diff A B [...]
perflab export REPORT --to mlflow|tensorboard [...]

Arguments are parsed first, by the light modules of ``lab_utils.run.commands`` (one per
subcommand); a command's implementation (papermill, pandas, torch, bokeh, ...) is imported inside
its handler below, once its arguments parse, so ``--help`` and a refused argument answer at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from lab_utils.core.config import ConfigError
from lab_utils.run import workspace
from lab_utils.run.commands import baseline, ceilings, compare, export, lab, nb, numdiff, run, trace
from lab_utils.run.commands.compare import lab_name
from lab_utils.run.parallel import job_options
from lab_utils.run.suites import SuiteError, check_overrides, list_suites, load_suite, parse_overrides

Handler = Callable[[argparse.Namespace, list[str]], int]


def _run_list() -> int:
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


def _cmd_run(a: argparse.Namespace, argv: list[str]) -> int:
    if a.list:
        return _run_list()
    if not a.suite:
        print("perflab run: give a SUITE (see `perflab run --list`)", file=sys.stderr)
        return 2
    try:
        # what can be refused without importing a lab is refused here, at once
        suite = load_suite(a.suite)
        only = [lab_name(x) for x in a.only] if a.only else None
        overrides = parse_overrides(a.param)
        check_overrides(suite, overrides, only)
        jobs = job_options(a)
    except (SuiteError, ConfigError, ValueError) as e:
        print(f"perflab run: {e}", file=sys.stderr)
        return 2
    # papermill, nbformat, nbconvert and (through each lab's config) torch: seconds to import
    from lab_utils.run.runner import RunInterrupted, run_suite  # noqa: PLC0415  (heavy: after parsing)

    # TensorBoard's profile plugin shows the traces: kept until they are exported, then dropped
    traces_for_export = bool(a.export and "tensorboard" in a.export and not a.keep_traces)
    try:
        res = run_suite(
            suite,
            overrides=overrides,
            out_dir=a.out,
            only=only,
            progress=not a.no_progress,
            timing_threads=a.timing_threads,
            jobs=jobs,
            keep_traces=a.keep_traces or traces_for_export,
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
    rc = 0
    if a.export:
        rc = _export(res.path, a.export, a, "perflab run")
    if traces_for_export:
        from lab_utils.run.report import drop_traces  # noqa: PLC0415  (heavy: nbconvert; the run imported it)

        drop_traces(res.path)
    if not res.ok:
        print(f"perflab run: {sum(s.status != 'ok' for s in res.statuses)} notebook(s) failed", file=sys.stderr)
        return 1
    return rc


def _threads_note(path) -> str:
    """The report's line on timings whose thread count the busy machine cut ("" if none)."""
    from lab_utils.core.records import load_records, thread_cut_note  # noqa: PLC0415  (pandas: after the run)

    try:
        ctx = json.loads((path / "context.json").read_text())
        return thread_cut_note(load_records(path), ctx)
    except (OSError, ValueError):
        return ""


def _export(report, targets: Sequence[str], a: argparse.Namespace, prog: str) -> int:
    # mlflow / tensorboard: perflab[export]; seconds to import, and only an export needs them
    from lab_utils.run.export import export_report  # noqa: PLC0415  (heavy optional: perflab[export])

    try:
        for line in export_report(
            report, targets, tracking_uri=a.tracking_uri, experiment=a.experiment, logdir=a.logdir
        ):
            print(f"{prog}: {line}")
    except (ConfigError, OSError) as e:
        print(f"{prog}: export: {e}", file=sys.stderr)
        return 2
    return 0


def _refuse_missing(prog: str, what: dict[str, str], refs: tuple[str, ...] = (), say: str = "{arg} {path!r}") -> bool:
    """Say, before anything heavy is imported, which of ``what`` (argument -> path) does not exist
    (``refs``: names that stand for a place, such as ``latest``); True when one was refused."""
    for arg, path in what.items():
        if path not in refs and not any(path.startswith(f"{r}:") for r in refs) and not Path(path).exists():
            print(f"{prog}: {say.format(arg=arg, path=path)}: no such file or folder", file=sys.stderr)
            return True
    return False


def _cmd_export(a: argparse.Namespace, argv: list[str]) -> int:
    if _refuse_missing("perflab export", {"REPORT": a.report}, ("latest",)):
        return 2
    return _export(a.report, a.to, a, "perflab export")


def _cmd_ceilings(a: argparse.Namespace, argv: list[str]) -> int:
    # torch: the measurement itself
    from lab_utils.core.ceilings import cached_ceilings, get_ceilings  # noqa: PLC0415  (heavy: torch)

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


def _cmd_nb(a: argparse.Namespace, argv: list[str]) -> int:
    from lab_utils.run.nbtools import refresh  # noqa: PLC0415  (heavy: nbformat, nbclient, a kernel)

    for p in a.paths:
        refresh(p)
        print(f"refreshed {p}")
    return 0


def _cmd_lab(a: argparse.Namespace, argv: list[str]) -> int:
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    return workspace.launch(a, extra)


def _cmd_compare(a: argparse.Namespace, argv: list[str]) -> int:
    if _refuse_missing("perflab compare", {"BASE": a.base, "CANDIDATE": a.candidate}, ("latest", "baseline")):
        return 2
    from lab_utils.run.compare.cli import command  # noqa: PLC0415  (heavy: pandas, bokeh)

    return command(a)


def _cmd_baseline(a: argparse.Namespace, argv: list[str]) -> int:
    from lab_utils.run.compare.baselines import command  # noqa: PLC0415  (heavy: pandas, bokeh; papermill to run)

    return command(a, ["baseline", *argv])


def _cmd_numdiff(a: argparse.Namespace, argv: list[str]) -> int:
    if _refuse_missing("perflab numdiff", {"A": a.a, "B": a.b}, say="{arg}: cannot read records from {path}"):
        return 2
    from lab_utils.stability.numdiff import run_numdiff  # noqa: PLC0415  (heavy: pandas)

    floor = dict(a.floor or [])
    return run_numdiff(a.a, a.b, variant_a=a.variant_a, variant_b=a.variant_b, tol=a.tol, floor=floor, stats=a.stat)


def _cmd_trace(a: argparse.Namespace, argv: list[str]) -> int:
    prog, paths = (
        ("perflab trace diff", {"BASE": a.base, "CANDIDATE": a.candidate})
        if getattr(a, "diff", False)
        else ("perflab trace", {"PATH": a.path})
    )
    if _refuse_missing(prog, paths):
        return 2
    from lab_utils.run.trace_cli import run as trace_run  # noqa: PLC0415  (heavy: pandas, msgspec, holoviews)

    return trace_run(a)


#: the subcommands in the order ``perflab --help`` lists them: their arguments' module, their handler
COMMANDS: dict[str, tuple[ModuleType, Handler]] = {
    "run": (run, _cmd_run),
    "ceilings": (ceilings, _cmd_ceilings),
    "nb": (nb, _cmd_nb),
    "lab": (lab, _cmd_lab),
    "compare": (compare, _cmd_compare),
    "baseline": (baseline, _cmd_baseline),
    "numdiff": (numdiff, _cmd_numdiff),
    "trace": (trace, _cmd_trace),
    "export": (export, _cmd_export),
}


def parser() -> argparse.ArgumentParser:
    """``perflab``'s parser: one subparser per entry of :data:`COMMANDS`."""
    ap = argparse.ArgumentParser(
        prog="perflab", description="perflab: a performance lab for diffusion-transformer training"
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (mod, fn) in COMMANDS.items():
        sp = sub.add_parser(
            name,
            help=mod.HELP,
            description=mod.DESCRIPTION,
            epilog=getattr(mod, "EPILOG", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(sp)
        sp.set_defaults(fn=fn)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["trace", "diff"]:  # `perflab trace PATH` takes a path where `diff` stands
        a = trace.parser(diff=True).parse_args(argv[2:])
        a.diff = True
        return _cmd_trace(a, argv[2:])
    # `perflab lab ... -- JUPYTER-ARGS`: what follows `--` goes to `jupyter lab`, unparsed
    cut = argv.index("--") if argv[:1] == ["lab"] and "--" in argv else len(argv)
    a = parser().parse_args(argv[:cut])
    return a.fn(a, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
