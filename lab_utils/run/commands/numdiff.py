"""``perflab numdiff A B``: its arguments (light; the diff is ``lab_utils.stability.numdiff``)."""

from __future__ import annotations

import argparse

HELP = "where two reports' telemetry first differs (see `perflab numdiff --help`)"
DESCRIPTION = (
    "Where the telemetry of two reports (or two variants of one report) first differs beyond --tol. "
    "Exit 0 with the table; 2 with one line when a side has no telemetry (or no such variant) or the two "
    "share no rows."
)
#: the floors ``lab_utils.stability.numdiff`` applies when none is given (ABS_FLOOR, DEFAULT_FLOOR),
#: as the help says them (tests/unit/run/test_cli.py holds the two to the same values)
FLOOR_HELP = "lost_update_frac 0.01, others 1e-06"


def floor_arg(text: str) -> tuple[str, float]:
    """``STAT=VALUE`` with VALUE >= 0, as ``(stat, value)``."""
    stat, _, value = text.partition("=")
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STAT=VALUE, got {text!r}") from None
    if not stat or not v >= 0:
        raise argparse.ArgumentTypeError(f"expected STAT=VALUE with VALUE >= 0, got {text!r}")
    return stat, v


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("a", help="report folder or records file (run A)")
    ap.add_argument("b", help="report folder or records file (run B)")
    ap.add_argument("--variant-a", default=None, help="telemetry variant of A (default: its only one)")
    ap.add_argument("--variant-b", default=None, help="telemetry variant of B (default: its only one)")
    ap.add_argument("--tol", type=float, default=0.05, help="relative difference that counts (default 0.05)")
    ap.add_argument(
        "--floor",
        type=floor_arg,
        action="append",
        metavar="STAT=VALUE",
        help=f"absolute floor of a statistic's difference (defaults: {FLOOR_HELP})",
    )
    ap.add_argument("--stat", action="append", help="statistics to show (default: all)")
