"""``perflab run SUITE``: its arguments (light; running is ``lab_utils.run.runner``)."""

from __future__ import annotations

import argparse

from lab_utils.run.commands.export import TARGETS, add_export_options
from lab_utils.run.parallel import add_job_options

HELP = "run a suite of notebooks headless into reports/<run-id>/"
DESCRIPTION = (
    "Run a suite's notebooks headless (papermill) into one self-contained report, reports/<run-id>/. "
    "Unknown suites, unknown parameters and bad values are refused before anything runs."
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("suite", nargs="?", help="a suite of parameterized/ (see --list) or a suite file")
    ap.add_argument("--list", action="store_true", help="list suites and their notebooks")
    ap.add_argument("--param", action="append", metavar="KEY=VALUE", help="override a parameter (YAML value)")
    ap.add_argument(
        "--only",
        action="append",
        metavar="NOTEBOOK",
        help="run only this notebook of the suite (a name like 05_memory or a path like labs/05_memory.ipynb)",
    )
    ap.add_argument("--out", default=None, help="reports folder (default: reports/)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--timing-threads",
        default=None,
        metavar="N|auto",
        help="CPU threads every lab times with (default: auto, the cores other processes leave free; "
        "recorded in each report's context)",
    )
    ap.add_argument(
        "--keep-traces",
        action="store_true",
        help="keep the labs' profiler traces in the report's artifacts/ (default: each trace is gzipped, "
        "and traces beyond a report's budget are dropped after the lab has read them)",
    )
    add_job_options(ap)
    g = ap.add_argument_group("export (see `perflab export --help`)")
    g.add_argument(
        "--export",
        action="append",
        choices=TARGETS,
        default=None,
        help="also export the finished report's records to MLflow or TensorBoard (repeat for both)",
    )
    add_export_options(g)
