"""``perflab lab``: its arguments (JupyterLab on git-ignored working copies: ``lab_utils.run.workspace``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lab_utils.run.workspace import WORK_DIR

HELP = "JupyterLab on git-ignored working copies of labs/ (see `perflab lab --help`)"
DESCRIPTION = "JupyterLab on git-ignored working copies of labs/ (work/labs/); arguments after -- go to `jupyter lab`"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--reset",
        nargs="*",
        metavar="NAME",
        default=None,
        help="replace the working copies (all, or the named labs) with fresh ones from labs/, then stop",
    )
    ap.add_argument("--prepare-only", action="store_true", help="make the working copies, do not start JupyterLab")
    ap.add_argument("--dir", type=Path, default=WORK_DIR, help=f"the working folder (default: {WORK_DIR})")
