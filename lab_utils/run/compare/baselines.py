"""Stored baselines per device kind: ``parameterized/baselines/<kind>/`` (``records.parquet``,
``context.json``, ``status.json``, ``baseline.json``), with ``<kind>`` = ``cpu`` or
``cuda-<gpu-model>`` (``baseline_kind()``); ``perflab baseline refresh|check|show``.  Baselines
stored before the records were Parquet hold ``records.json``: they still read (``load_records``
takes a folder's ``records.parquet`` first, else its ``records.json``)."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from lab_utils.core.config import ConfigError
from lab_utils.core.records import load_records, write_records_parquet
from lab_utils.run.commands import baseline as baseline_args
from lab_utils.run.compare.cli import finish, options_from
from lab_utils.run.compare.comparison import compare
from lab_utils.run.compare.options import Options, lab_name
from lab_utils.run.compare.rules import EXIT_OK, EXIT_REGRESSION, EXIT_USAGE, CompareError, direction
from lab_utils.run.compare.sides import baseline_kind, baselines_root, first_value, load_side
from lab_utils.run.migrate import migrate_baseline, migrate_context
from lab_utils.run.suites import SuiteError, parse_overrides

#: kinds of row that move with the machine's load (a reported figure is a share or idle time of timings)
PERFORMANCE_KINDS = ("performance", "memory", "reported")


def timing_free(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows that do not depend on machine load: accuracy figures, counts, shapes."""
    extras = rows["extra"] if "extra" in rows.columns else [""] * len(rows)
    keep = [
        direction(m, u, e).kind not in PERFORMANCE_KINDS
        for m, u, e in zip(rows["metric"], rows["unit"].fillna(""), extras, strict=True)
    ]
    return rows[keep]


def store_baseline(
    report: str | Path,
    *,
    kind: str | None = None,
    timing_free_only: bool = False,
    allow_failed: bool = False,
    root: Path | None = None,
    command: str = "",
) -> Path:
    """Copy a finished report's records into ``parameterized/baselines/<kind>/``."""
    report = Path(report)
    if not report.is_dir() or not ((report / "records.json").exists() or (report / "records.parquet").exists()):
        raise CompareError(f"{report} is not a finished report folder (no records.json / records.parquet)")
    ctx = json.loads((report / "context.json").read_text()) if (report / "context.json").exists() else {}
    status = json.loads((report / "status.json").read_text()) if (report / "status.json").exists() else []
    failed = [s.get("notebook") for s in status if s.get("status") != "ok"]
    if failed and not allow_failed:
        raise CompareError(
            f"{report}: notebook(s) failed ({', '.join(map(str, failed))}); a baseline must come from "
            f"a clean run (or pass --allow-failed)"
        )
    rows = load_records(report)
    if not ctx.get("device_kind"):
        ctx["device_kind"] = first_value(rows, "device_kind")
        ctx["device"] = first_value(rows, "device")
    kind = kind or baseline_kind(ctx)
    if timing_free_only:
        rows = timing_free(rows)
    rows = rows.copy()
    if "samples" in rows.columns:
        rows["samples"] = [
            None
            if s is None or (isinstance(s, float) and math.isnan(s))
            else [float(x) for x in np.asarray(s, dtype=float).ravel()]
            for s in rows["samples"]
        ]
    dest = (root or baselines_root()) / kind
    tmp = dest.with_name(f".tmp-{kind}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    # Parquet: exact floats (pandas' to_json keeps 10 decimals: a check then finds thousands of
    # "changed" rows) and a fiftieth of the size of exact JSON, whose every row repeats the context
    write_records_parquet(rows, tmp / "records.parquet")
    # the notebooks' parameters stay (under their current names): a check against a run with
    # other parameters is flagged by them
    keep_ctx, _ = migrate_context(ctx)
    (tmp / "context.json").write_text(json.dumps(keep_ctx, indent=1, default=str) + "\n")
    (tmp / "status.json").write_text(json.dumps(status, indent=1) + "\n")
    meta = {
        "kind": kind,
        "run_id": ctx.get("run_id") or report.name,
        "suite": ctx.get("suite"),
        "device": ctx.get("device"),
        "timing_free": timing_free_only,
        "rows": int(len(rows)),
        "stored": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": str(report),
        "command": command or "perflab baseline refresh",
        # a baseline is one clean commit's numbers: several commits, or a dirty tree, are said here
        "commits": sorted({str(c) for c in rows.get("commit", pd.Series(dtype=str)).dropna() if str(c)}),
    }
    (tmp / "baseline.json").write_text(json.dumps(meta, indent=1) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def run_for_baseline(suite: str, params: list[str] | None, out: str | None, only: list[str] | None = None):
    from lab_utils.run.runner import run_suite  # noqa: PLC0415  (papermill, nbformat, torch: perflab[lab]; only a run needs them)

    return run_suite(suite, overrides=parse_overrides(params), out_dir=out, only=only)


def command_line(argv: Sequence[str] | None) -> str:
    """The command as typed, for ``baseline.json``: ``perflab baseline refresh --report ...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["baseline"]:
        args = args[1:]
    return ("perflab baseline " + shlex.join(args)).strip()


def baseline_main(argv: Sequence[str] | None = None) -> int:
    """``perflab baseline refresh|check|show|migrate`` from a list of arguments."""
    ap = argparse.ArgumentParser(prog="perflab baseline", description=baseline_args.DESCRIPTION)
    baseline_args.add_arguments(ap)
    argv = list(sys.argv[1:] if argv is None else argv)
    return command(ap.parse_args(argv), argv)


def command(a: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """``perflab baseline`` on parsed arguments (``argv``: as typed, for ``baseline.json``)."""
    try:
        if getattr(a, "only", None):
            a.only = [lab_name(x) for x in a.only]
        if a.cmd == "migrate":
            root = baselines_root()
            kinds = [a.kind] if a.kind else sorted(p.name for p in root.glob("*") if (p / "context.json").exists())
            for k in kinds:
                done = migrate_baseline(root / k)
                print(f"{k}: " + ("; ".join(done) if done else "nothing to rename"))
            return EXIT_OK
        if a.cmd == "show":
            return show_baselines(a.kind)
        if a.cmd == "refresh":
            return refresh_baseline(a, argv)
        return check_baseline(a)
    except (CompareError, ConfigError) as e:
        print(f"perflab baseline: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SuiteError as e:
        print(f"perflab baseline: {e}", file=sys.stderr)
        return EXIT_USAGE


def show_baselines(kind: str | None) -> int:
    """``perflab baseline show``: one line per stored baseline."""
    root = baselines_root()
    kinds = [kind] if kind else sorted(p.name for p in root.glob("*") if (p / "baseline.json").exists())
    if not kinds:
        print(f"no baselines under {root}")
    for k in kinds:
        f = root / k / "baseline.json"
        if not f.exists():
            print(f"{k}: no baseline ({f} missing)")
            continue
        m = json.loads(f.read_text())
        print(
            f"{k}: {m.get('rows')} rows from run {m.get('run_id')} (suite {m.get('suite')}, "
            f"{'timing-free' if m.get('timing_free') else 'full'}) on {m.get('device')}, commit "
            f"{', '.join(m.get('commits') or ['?'])}, stored {m.get('stored')}"
        )
    return EXIT_OK


def refresh_baseline(a: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``perflab baseline refresh``: run the suite (or take ``--report``) and store it."""
    report = a.report
    if report is None:
        res = run_for_baseline(a.suite, a.param, a.out, a.only)
        report = res.path
        if not res.ok and not a.allow_failed:
            print(
                f"perflab baseline: the run {res.run_id} had failures; baseline not stored (see {res.index})",
                file=sys.stderr,
            )
            return EXIT_REGRESSION
    dest = store_baseline(
        report,
        kind=a.kind,
        timing_free_only=a.timing_free,
        allow_failed=a.allow_failed,
        command=command_line(argv),
    )
    m = json.loads((dest / "baseline.json").read_text())
    print(f"perflab baseline: stored {m['rows']} rows of {m['run_id']} as {dest}")
    commits = m.get("commits") or []
    if len(commits) > 1 or any(c.endswith("-dirty") for c in commits):
        print(
            f"perflab baseline: WARNING: its rows come from {', '.join(commits)}; a baseline should be one "
            f"clean commit's run (commit the change, then refresh)",
            file=sys.stderr,
        )
    return EXIT_OK


def check_baseline(a: argparse.Namespace) -> int:
    """``perflab baseline check``: a fresh run (or ``--report``) against the stored baseline."""
    if a.report is None:
        res = run_for_baseline(a.suite, a.param, a.run_out, a.only)
        cand_ref = res.path
    else:
        cand_ref = a.report
    cand = load_side(cand_ref, "candidate")
    kind = a.kind or baseline_kind(cand.context)
    bdir = baselines_root() / kind
    if not (bdir / "baseline.json").exists():
        print(
            f"perflab baseline: no stored baseline for kind {kind!r} ({bdir}); create one with "
            f"`perflab baseline refresh`",
            file=sys.stderr,
        )
        return EXIT_USAGE
    base = load_side(bdir, "baseline")
    o = options_from(a)
    if base.meta.get("timing_free") and o.only == "all":
        o = Options(**{**o.__dict__, "only": "accuracy"})
        print(f"perflab baseline: the {kind} baseline is timing-free: comparing accuracy rows only")
    cmp = compare(base, cand, o)
    return finish(cmp, a, "perflab baseline check")
