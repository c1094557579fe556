"""``perflab compare BASE CANDIDATE``: options, the command line and its outputs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lab_utils.core.config import ConfigError
from lab_utils.run.compare.comparison import Comparison, compare
from lab_utils.run.compare.options import CONTEXT_DIFFS, Options, lab_name
from lab_utils.run.compare.rules import EXIT_USAGE, CompareError
from lab_utils.run.compare.sides import slug
from lab_utils.run.runner import ROOT


def add_compare_options(ap: argparse.ArgumentParser) -> None:
    d = Options()
    ap.add_argument(
        "--threshold",
        type=float,
        default=d.threshold,
        help=f"relative change that counts for performance and memory rows (default {d.threshold})",
    )
    ap.add_argument(
        "--accuracy-threshold",
        type=float,
        default=d.accuracy_threshold,
        help=f"relative change that counts for error figures (default {d.accuracy_threshold})",
    )
    ap.add_argument(
        "--db-threshold",
        type=float,
        default=d.db_threshold,
        help=f"change in dB that counts for SQNR-like rows (default {d.db_threshold})",
    )
    ap.add_argument(
        "--confidence", type=float, default=d.confidence, help=f"interval / test level (default {d.confidence})"
    )
    ap.add_argument(
        "--method",
        choices=("bootstrap", "rank"),
        default=d.method,
        help="noise test for rows with samples: bootstrap interval of the ratio of medians, "
        "or a Mann-Whitney rank test",
    )
    ap.add_argument("--bootstrap", type=int, default=d.bootstrap, help="bootstrap resamples (default 2000)")
    ap.add_argument(
        "--statistics", choices=("default", "all"), default=d.statistics, help="'all' also compares p20/p80 rows"
    )
    ap.add_argument(
        "--rows",
        choices=("all", "performance", "accuracy"),
        default=d.only,
        help="compare only these kinds of rows (performance: time, rates, memory; accuracy: error "
        "figures, SQNR and counts)",
    )
    ap.add_argument(
        "--gate",
        choices=("all", "performance", "accuracy", "none"),
        default=d.gate,
        help="which kinds of regression make the exit code non-zero",
    )
    ap.add_argument(
        "--allow-device-mismatch",
        action="store_true",
        help="compare performance rows even when the runs' devices differ",
    )
    ap.add_argument(
        "--allow-context-diff",
        action="append",
        default=None,
        metavar="|".join(CONTEXT_DIFFS),
        help="compare rows even though the runs differ in this (repeat, or comma-separate): device, software "
        "(torch, triton, CUDA, Python), threads (the CPU threads a timing ran with), compile (a compile "
        "parameter), params (other notebook parameters, or the suite); without it such rows are "
        "'not comparable' (exit 3)",
    )
    ap.add_argument(
        "--max-unstable-share",
        type=float,
        default=d.max_unstable_share,
        help="a run with a larger share of unstable timings is not comparable: exit 3, performance rows not "
        f"gated (default {d.max_unstable_share})",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="folder for compare.html, summary.txt, compare.json (default .perflab/compare/<candidate>-vs-<base>/)",
    )
    ap.add_argument("--limit", type=int, default=40, help="rows per section in the printed summary")
    ap.add_argument("--quiet", action="store_true", help="print only the result line")


def options_from(a) -> Options:
    return Options(
        threshold=a.threshold,
        accuracy_threshold=a.accuracy_threshold,
        db_threshold=a.db_threshold,
        confidence=a.confidence,
        method=a.method,
        bootstrap=a.bootstrap,
        statistics=a.statistics,
        only=a.rows,
        gate=a.gate,
        allow_device_mismatch=a.allow_device_mismatch,
        max_unstable_share=a.max_unstable_share,
        labs=tuple(lab_name(x) for x in (getattr(a, "only", None) or ())),
        allow_context_diff=tuple(
            x.strip() for v in (a.allow_context_diff or ()) for x in str(v).split(",") if x.strip()
        ),
    )


def default_out(cmp: Comparison) -> Path:
    return ROOT / ".perflab" / "compare" / f"{slug(cmp.cand.run_id)}-vs-{slug(cmp.base.run_id)}"


def finish(cmp: Comparison, a, prog: str) -> int:
    paths = cmp.write(a.out or default_out(cmp))
    if a.quiet:
        print(cmp.result_line())
    else:
        print(cmp.summary_text(limit=a.limit), end="")
    print(f"{prog}: wrote {paths['html']} (and summary.txt, compare.json)")
    return cmp.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """``perflab compare BASE CANDIDATE``; exit 0 ok, 1 regression, 2 bad input, 3 not comparable."""
    ap = argparse.ArgumentParser(
        prog="perflab compare",
        description="Compare a candidate run with a base run row by row; exit 1 on a regression beyond the threshold. "
        "BASE / CANDIDATE: a report folder (an interrupted run's <run-id>-interrupted/ too), a records.json/"
        ".parquet, 'latest' or 'baseline[:KIND]'.",
        epilog="exit codes: 0 no regression, 1 regression (or a notebook that failed, a lab or rows of the base "
        "missing from the candidate), 2 bad arguments or inputs, 3 not comparable: device, software, timing "
        "threads or parameters differ (those rows not compared), or too many unstable timings",
    )
    ap.add_argument("base")
    ap.add_argument("candidate")
    ap.add_argument(
        "--only",
        action="append",
        metavar="LAB",
        help="compare only this lab (a name like 05_memory or a path like labs/05_memory.ipynb; repeat for more); "
        "without it a lab of the base that the candidate did not run fails the gate",
    )
    add_compare_options(ap)
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cmp = compare(a.base, a.candidate, options_from(a))
    except (CompareError, ConfigError) as e:
        print(f"perflab compare: {e}", file=sys.stderr)
        return EXIT_USAGE
    return finish(cmp, a, "perflab compare")
