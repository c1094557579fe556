"""``perflab nb refresh LAB.ipynb ...``: its arguments (light; refreshing is ``lab_utils.run.nbtools``)."""

from __future__ import annotations

import argparse

HELP = "notebook maintenance: `perflab nb refresh labs/NN_x.ipynb`"
DESCRIPTION = "Keep the committed labs stripped: execute a lab at its defaults and keep only its checked outputs."


def add_arguments(ap: argparse.ArgumentParser) -> None:
    sub = ap.add_subparsers(dest="nbcmd", required=True)
    rf = sub.add_parser("refresh", help="execute a lab at its defaults and keep only checked outputs")
    rf.add_argument("paths", nargs="+")
