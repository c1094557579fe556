"""``perflab compare BASE CANDIDATE``: the comparison of parsed arguments and its outputs.

The arguments and :class:`~lab_utils.run.commands.compare.Options` are ``lab_utils.run.commands.compare``
(light, so ``perflab compare --help`` answers at once); this module runs the comparison.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lab_utils.core.config import ConfigError
from lab_utils.run.commands.compare import DESCRIPTION, EPILOG, add_arguments, add_compare_options, options_from
from lab_utils.run.compare.comparison import Comparison, compare
from lab_utils.run.compare.rules import EXIT_USAGE, CompareError
from lab_utils.run.compare.sides import slug
from lab_utils.run.suites import ROOT

__all__ = ["add_compare_options", "command", "default_out", "finish", "main", "options_from"]


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


def command(a: argparse.Namespace) -> int:
    """``perflab compare`` on parsed arguments; exit 0 ok, 1 regression, 2 bad input, 3 not comparable."""
    try:
        cmp = compare(a.base, a.candidate, options_from(a))
    except (CompareError, ConfigError) as e:
        print(f"perflab compare: {e}", file=sys.stderr)
        return EXIT_USAGE
    return finish(cmp, a, "perflab compare")


def main(argv: Sequence[str] | None = None) -> int:
    """``perflab compare BASE CANDIDATE`` from a list of arguments (what ``perflab compare`` runs)."""
    ap = argparse.ArgumentParser(prog="perflab compare", description=DESCRIPTION, epilog=EPILOG)
    add_arguments(ap)
    return command(ap.parse_args(list(sys.argv[1:] if argv is None else argv)))
