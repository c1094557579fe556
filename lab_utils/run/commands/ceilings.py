"""``perflab ceilings``: its arguments (light; measuring is ``lab_utils.core.ceilings``)."""

from __future__ import annotations

import argparse

HELP = "measure (or show cached) copy and matmul ceilings"
DESCRIPTION = "This machine's measured copy bandwidth and matmul throughput beside the datasheet peaks."


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--force", action="store_true", help="re-measure even if cached (without it, the cache is shown)")
    ap.add_argument("--quick", action="store_true", help="the smaller sizes CPU smoke runs use (cached separately)")
    ap.add_argument("--device", default=None, help="cpu, cuda or auto (default: auto)")
