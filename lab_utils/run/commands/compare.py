"""``perflab compare BASE CANDIDATE``: what a comparison may be asked for (:class:`Options`) and
its command line.  Light (no pandas, no bokeh): the comparison itself is ``lab_utils.run.compare``."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from lab_utils.core.config import ConfigError

HELP = "compare two reports row by row; exit 1 on a regression (see `perflab compare --help`)"
DESCRIPTION = (
    "Compare a candidate run with a base run row by row; exit 1 on a regression beyond the threshold. "
    "BASE / CANDIDATE: a report folder (an interrupted run's <run-id>-interrupted/ too), a records.json/"
    ".parquet, 'latest' or 'baseline[:KIND]'."
)
EPILOG = (
    "exit codes: 0 no regression, 1 regression (or a notebook that failed, a lab or rows of the base "
    "missing from the candidate), 2 bad arguments or inputs, 3 not comparable: device, software, timing "
    "threads or parameters differ (those rows not compared), or too many unstable timings"
)

#: What a timing measures besides the code: a difference in one of these makes the rows it
#: touches "not comparable" (never slower or faster) unless the comparison is asked for.
#: device: the device (name or kind); software: torch, triton, CUDA, Python, the Triton
#: interpreter; threads: the CPU threads a timing ran with; compile: a notebook parameter that
#: selects compilation; params: any other notebook parameter (or the suite).
CONTEXT_DIFFS = ("device", "software", "threads", "compile", "params")


def lab_name(value: str) -> str:
    """A lab as the runner names it: ``labs/05_memory.ipynb``, ``05_memory.ipynb`` and
    ``05_memory`` are all ``05_memory``."""
    s = str(value).strip()
    if not s:
        raise ConfigError("only", value, "a lab name such as 05_memory or a notebook path such as labs/05_memory.ipynb")
    p = Path(s)
    return p.stem if p.suffix == ".ipynb" else p.name


@dataclass(frozen=True)
class Options:
    threshold: float = 0.05  # performance and memory: relative change that counts
    accuracy_threshold: float = 0.10  # error figures (ratio metrics)
    db_threshold: float = 0.5  # SQNR and other dB figures: absolute change in dB
    #: metrics with no better direction (counts, sizes, figures of a fixed seed): a relative
    #: difference up to this is float noise (a value written and read back, summed in another
    #: order), not a change
    neutral_tolerance: float = 1e-9
    confidence: float = 0.99
    method: str = "bootstrap"  # "bootstrap" | "rank"
    bootstrap: int = 2000
    min_samples: int = 3
    statistics: str = "default"  # "default" (no p20/p80) | "all"
    only: str = "all"  # "all" | "performance" | "accuracy" (accuracy + other)
    gate: str = "all"  # which kinds fail the gate: "all" | "performance" | "accuracy" | "none"
    allow_device_mismatch: bool = False  # the same as "device" in allow_context_diff
    max_unstable_share: float = 0.25  # a side with more unstable timings than this is not comparable
    #: compare only these labs (both sides narrowed to them); empty: every lab, and a lab of
    #: the base that the candidate did not run fails the gate
    labs: tuple[str, ...] = ()
    #: context differences (``CONTEXT_DIFFS``) under which rows are compared all the same
    allow_context_diff: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("threshold", "accuracy_threshold", "db_threshold", "neutral_tolerance"):
            v = getattr(self, name)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(name, v, "a finite number >= 0")
        if not (0.5 <= self.confidence < 1):
            raise ConfigError("confidence", self.confidence, "a number in [0.5, 1)")
        if self.method not in ("bootstrap", "rank"):
            raise ConfigError("method", self.method, "'bootstrap' or 'rank'")
        if self.statistics not in ("default", "all"):
            raise ConfigError("statistics", self.statistics, "'default' or 'all'")
        if self.only not in ("all", "performance", "accuracy"):
            raise ConfigError("only", self.only, "'all', 'performance' or 'accuracy'")
        if self.gate not in ("all", "performance", "accuracy", "none"):
            raise ConfigError("gate", self.gate, "'all', 'performance', 'accuracy' or 'none'")
        v = self.max_unstable_share
        if isinstance(v, bool) or not (isinstance(v, (int, float)) and 0 <= v <= 1):
            raise ConfigError("max_unstable_share", v, "a number in [0, 1]")
        if not (isinstance(self.bootstrap, int) and self.bootstrap >= 100):
            raise ConfigError("bootstrap", self.bootstrap, "an integer >= 100")
        if isinstance(self.labs, str):
            raise ConfigError("labs", self.labs, "a list of lab names, not one string")
        object.__setattr__(self, "labs", tuple(dict.fromkeys(lab_name(x) for x in self.labs)))
        allowed = tuple(self.allow_context_diff or ())
        if isinstance(self.allow_context_diff, str):
            allowed = tuple(s.strip() for s in self.allow_context_diff.split(",") if s.strip())
        bad = [x for x in allowed if x not in CONTEXT_DIFFS]
        if bad:
            raise ConfigError("allow_context_diff", bad[0], f"one of {', '.join(CONTEXT_DIFFS)}")
        if self.allow_device_mismatch and "device" not in allowed:
            allowed += ("device",)
        object.__setattr__(self, "allow_context_diff", tuple(dict.fromkeys(allowed)))

    def allows(self, what: str) -> bool:
        """Whether rows are compared even though the runs differ in ``what`` (``CONTEXT_DIFFS``)."""
        return what in self.allow_context_diff


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


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``perflab compare``'s arguments: the two sides, ``--only`` and the comparison's options."""
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
