"""``perflab trace PATH`` and ``perflab trace diff A B``: their arguments and help (light: the reading
and the page are ``lab_utils.run.trace_cli``)."""

from __future__ import annotations

import argparse

from lab_utils.core.datasheets import PART_HELP
from lab_utils.run.executors import MAP_EXECUTORS

HELP = "analyse profiler traces: `perflab trace PATH`, `perflab trace diff A B`"
DESCRIPTION = """\
Read a torch profiler trace (.json, .json.gz, .pt.trace.json[.gz]) or a folder that is one job
with one trace file per rank, and print per rank and per step where the time went: the breakdown
(compute, communication, memory, idle), top kernels, GPU-only overlap, idle split into host wait
and the rest, launch statistics with a launch-bound verdict, a per-op roofline where shapes were
recorded, and collectives with bus bandwidth, skew and a straggler verdict.

Beyond the breakdown: the critical path of a step, GPU time up the call tree (ranges, modules,
operators, kernels), repeated kernel sequences (fusion candidates), idle per stream (host wait,
kernel wait, other), launch outliers, the launch queue and copy bandwidth.

Into --out it writes records.json (the rows `perflab compare` reads), trace.json (every figure as
JSON), trace.html (one self-contained page: the verdicts as sentences, the timeline of one step per
rank and stream, the tables) and trace.perfetto.json.gz (the attributed trace for Perfetto). A
folder's ranks are read in parallel (--executor pool|local|slurm)."""
EPILOG = "perflab trace diff A B: compare two traces or jobs (see `perflab trace diff --help`)"
DIFF_DESCRIPTION = """\
Read both sides (trace files or folders of ranks), pair their ranks (the same ranks rank by rank,
one rank each, as many ranks by position, else pooled) and compare every kernel, launching
operator, category and phase per step as `perflab compare` does (a row only one side ran is 0 ms
on the other): verdicts (faster, slower, same, noisy) come from the spread across steps; only the
times gate, shares and idle are reported. The device shown is each trace's GPU. Exit 0 (no
regression), 1 (regression), 2 (bad input), 3 (not comparable)."""


def _common(ap: argparse.ArgumentParser, out: str) -> None:
    ap.add_argument("--out", default=out, help=f"folder for the records and the HTML page (default: {out})")
    ap.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
    ap.add_argument("--executor", default="pool", choices=MAP_EXECUTORS, help="where a folder's ranks are read")
    ap.add_argument("--workers", type=int, default=2, help="ranks read at once (default 2)")
    ap.add_argument("--mem-gb", type=float, default=4.0, help="memory bound per rank job in GB (default 4)")
    ap.add_argument("--gpu", default=None, help="the GPU of traces that name none (its datasheet row): " + PART_HELP)
    g = ap.add_argument_group("SLURM (--executor slurm: the ranks as one job array; defaults from perflab.slurm.yaml, "
                              "docs/cluster.md)")  # fmt: skip
    g.add_argument("--partition", default=None, help="sbatch --partition (default: the site's default partition)")
    g.add_argument("--account", default=None, help="sbatch --account")
    g.add_argument("--time-limit", type=int, default=None, metavar="MIN", help="each rank job's limit (sbatch --time)")
    g.add_argument("--cluster-config", default=None, metavar="YAML", help="defaults for these (perflab.slurm.yaml)")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``perflab trace PATH``."""
    ap.add_argument("path", help="a trace file (.json, .json.gz) or a folder of per-rank trace files")
    ap.add_argument("--top", type=int, default=10, help="top kernels per rank")
    ap.add_argument(
        "--step",
        type=int,
        default=None,
        help="the ProfilerStep the timeline and critical path show (default: the median-duration step)",
    )
    ap.add_argument(
        "--max-bars",
        type=int,
        default=20_000,
        help="bars in the timeline before the shortest activities are merged (default 20000)",
    )
    ap.add_argument("--perfetto", default="step", choices=("step", "all", "none"),
                    help="write trace.perfetto.json.gz: the timeline's step (default), the whole attributed "
                         "trace, or nothing")  # fmt: skip
    _common(ap, ".perflab/trace")


def add_diff_arguments(ap: argparse.ArgumentParser) -> None:
    """``perflab trace diff A B``."""
    ap.add_argument("base")
    ap.add_argument("candidate")
    ap.add_argument("--threshold", type=float, default=0.05, help="relative change called a difference")
    ap.add_argument("--limit", type=int, default=40, help="rows in the printed summary")
    ap.add_argument("--allow-device-mismatch", action="store_true",
                    help="compare the time rows of traces from different GPUs all the same")  # fmt: skip
    _common(ap, ".perflab/trace-diff")


def parser(diff: bool = False) -> argparse.ArgumentParser:
    """The parser of ``perflab trace`` (or ``perflab trace diff``), help as plain text."""
    fmt = argparse.RawDescriptionHelpFormatter
    if diff:
        ap = argparse.ArgumentParser(prog="perflab trace diff", description=DIFF_DESCRIPTION, formatter_class=fmt)
        add_diff_arguments(ap)
    else:
        ap = argparse.ArgumentParser(prog="perflab trace", description=DESCRIPTION, epilog=EPILOG, formatter_class=fmt)
        add_arguments(ap)
    return ap
