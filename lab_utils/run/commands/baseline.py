"""``perflab baseline refresh|check|show|migrate``: its arguments (light; the work is
``lab_utils.run.compare.baselines``)."""

from __future__ import annotations

import argparse

from lab_utils.run.commands.compare import add_compare_options

HELP = "stored baselines: refresh, check, show, migrate (see `perflab baseline --help`)"
DESCRIPTION = "Stored baselines per device kind in parameterized/baselines/<kind>/."


def add_arguments(ap: argparse.ArgumentParser) -> None:
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser(
        "refresh", help="run a suite (or take a finished report) and store it as this device kind's baseline"
    )
    r.add_argument("--suite", default="smoke")
    r.add_argument("--report", default=None, help="store this finished report instead of running the suite")
    r.add_argument("--param", action="append", metavar="KEY=VALUE", help="parameter override for the run")
    r.add_argument("--only", action="append", metavar="NOTEBOOK", help="run only this notebook of the suite")
    r.add_argument("--kind", default=None, help="baseline kind (default: cpu or cuda-<gpu model> of the run)")
    r.add_argument(
        "--timing-free",
        action="store_true",
        help="store only rows that do not depend on machine load (accuracy figures, counts)",
    )
    r.add_argument("--allow-failed", action="store_true", help="store even if some notebooks failed")
    r.add_argument("--out", default=None, help="reports folder for the run (default reports/)")
    c = sub.add_parser(
        "check", help="compare a fresh run (or --report) with the stored baseline; exit 1 on a regression"
    )
    c.add_argument("--suite", default="smoke")
    c.add_argument("--report", default=None, help="compare this finished report instead of running the suite")
    c.add_argument("--param", action="append", metavar="KEY=VALUE")
    c.add_argument(
        "--only",
        action="append",
        metavar="NOTEBOOK",
        help="run only this notebook of the suite (a name or a path like labs/05_memory.ipynb); the baseline is "
        "then compared on these notebooks only",
    )
    c.add_argument("--kind", default=None, help="baseline kind (default: the candidate's)")
    c.add_argument("--run-out", default=None, help="reports folder for the fresh run (default reports/)")
    add_compare_options(c)
    s = sub.add_parser("show", help="list stored baselines")
    s.add_argument("--kind", default=None)
    m = sub.add_parser(
        "migrate", help="rename parameters a lab has renamed in stored baselines' context.json (idempotent)"
    )
    m.add_argument("--kind", default=None, help="one baseline kind (default: every stored one)")
