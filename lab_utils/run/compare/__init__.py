"""Compare two runs (a baseline and a candidate) row by row, and gate on regressions.

Design note
-----------
* Rows are matched on ``KEY = (lab, experiment, variant, shape, dtype, metric,
  statistic)``: what was measured, never a result.  Rows sharing a key are told apart by
  the categorical ``extra`` fields that differ between them within that key's group (a
  mask, a layout; never outcomes such as ``verdict`` or floats), and what still repeats is
  numbered (``#2``) in order and flagged, never averaged.  ``p20``/``p80`` rows are
  summaries of the same samples as the ``median`` row and are left out unless asked for
  (``--statistics all``).
* The rules with the reason for each threshold are ``rules``: an error figure is judged on
  its check's ``tolerance`` or its dtype's unit roundoff where its row carries them; a
  ranked list (``top_n``) is compared as a set (an item crossing its cut-off is reported, a
  heavy one appearing or disappearing gates); reported figures (idle, shares) never gate.
* Which way is better is decided once, by metric name first and unit second
  (``direction()``; the table is ``METRIC_RULES`` + ``UNIT_RULES``): time is lower-is-
  better ("faster"/"slower"), GB/s, TFLOP/s, % of ceiling higher-is-better; error
  figures lower-is-better and SQNR (dB) higher-is-better ("more/less accurate");
  memory lower-is-better; anything else is only "changed"/"same" and never gates.
* Noise: a row whose kept ``samples`` exist on both sides gets a bootstrap interval of
  the ratio of medians (resampling each side, fixed seed, so a comparison is
  reproducible) or, with ``method="rank"``, a Mann-Whitney U test.  GB/s, TFLOP/s and
  % of ceiling are ``bytes / time`` style figures: they borrow the interval of their
  sibling time row.  A verdict other than "same" needs both: the difference is
  significant (interval excludes 1 / p < 1 - confidence) *and* beyond the threshold.
  Rows without samples (fixed-seed error figures, counts) are deterministic: only the
  threshold applies.
* The ratio is always ``candidate / base``; ``gain`` is the same ratio oriented so
  that > 1 means the candidate is better (``base / candidate`` for lower-is-better).
  dB figures are compared by difference and drawn as the power ratio 10^(Δ/10).
* Runs on different devices are flagged and their performance rows are *not*
  compared (verdict "device differs", exit code 3) unless ``allow_device_mismatch``;
  a side whose rows come from several devices is refused.  Rows whose runs differ in
  what a timing measures (software: torch, triton, CUDA, Python; the CPU threads a
  timing ran with; a compile parameter; any other notebook parameter or the suite) get
  the verdict "not comparable", never slower or faster (exit 3), unless that difference
  is allowed (``allow_context_diff``).  A different commit is what a comparison is for.
* Coverage: the gate cannot pass by omission.  A lab of the base that the candidate did
  not run, and rows of the base missing from a lab the candidate ran, fail it (exit 1),
  unless the comparison is narrowed to some labs (``labs``, ``--only LAB``); one-sided
  rows of a lab whose parameters differ are explained by those parameters.
* Metrics with no better direction are "changed" only beyond ``neutral_tolerance``
  (relative, 1e-9: float noise is no change).
* Performance rows without samples (and no time row to borrow from) get a verdict from
  the threshold alone but never fail the gate: with no noise estimate a load swing on
  the machine would.  Error figures without samples are deterministic (fixed seeds) and
  do gate.
* Stability: a timing row carries the verdict of the timing primitive (``stable``,
  ``stability``; older records are judged here from their kept samples).  A performance
  row that was unstable on either side gets the verdict "noisy", never "slower" or
  "faster".  A side whose share of unstable timings is over ``max_unstable_share``
  (default 25%) is not comparable: its performance rows do not gate and the exit code
  is 3, with the share in the message.
* Skipped rows: a row its lab skipped (``verdict`` "skipped" in its ``extra``: a check that
  cannot run on the device, no value) in both runs reads "skipped" and never gates; skipped in
  one run only, it is a NaN against a figure: "no value", shown, never gated.
* Exit codes: 0 no regression; 1 a regression beyond the threshold (including a row
  that ran in the base and failed in the candidate, a lab that did not run, rows
  missing); 2 bad arguments / unreadable inputs; 3 not comparable (device, software,
  timing threads or parameters differ, or too many unstable timings).

Modules: ``rules`` (directions, names), ``options``, ``sides`` (reading and normalising a side),
``stats`` (bootstrap, rank test, the verdict rule), ``coverage`` (labs and rows each side
covers, context and parameter differences), ``comparison`` (``compare``,
``Comparison``), ``text`` and ``html`` (outputs), ``cli`` (``perflab
compare``) and ``baselines`` (``perflab baseline``).

Baselines live in ``parameterized/baselines/<kind>/`` (``records.parquet``,
``context.json``, ``baseline.json``) with ``<kind>`` = ``cpu`` or
``cuda-<gpu-model>`` (``baseline_kind()``), written by ``perflab baseline refresh``.
"""

from __future__ import annotations

from lab_utils.run.compare.baselines import (
    PERFORMANCE_KINDS,
    baseline_main,
    run_for_baseline,
    store_baseline,
    timing_free,
)
from lab_utils.run.compare.cli import add_compare_options, main, options_from
from lab_utils.run.compare.comparison import OUT_COLUMNS, Comparison, compare
from lab_utils.run.compare.coverage import ContextDiff, context_flags
from lab_utils.run.compare.html import render_html
from lab_utils.run.compare.options import CONTEXT_DIFFS, Options, lab_name
from lab_utils.run.compare.rules import (
    EXIT_INCOMPARABLE,
    EXIT_OK,
    EXIT_REGRESSION,
    EXIT_USAGE,
    HIGHER_DB,
    HIGHER_PERF,
    KEY,
    LOWER_ERROR,
    LOWER_MEMORY,
    LOWER_TIME,
    METRIC_RULES,
    NEUTRAL,
    NOISY,
    NOT_COMPARABLE,
    UNIT_RULES,
    WORSE_VERDICTS,
    CompareError,
    Direction,
    direction,
    direction_table,
)
from lab_utils.run.compare.sides import Side, baseline_kind, baselines_root, identity_keys, load_side, resolve_source
from lab_utils.run.compare.stats import bootstrap_ratio, judge, rank_pvalues
from lab_utils.run.compare.text import summary_text

__all__ = [
    "EXIT_INCOMPARABLE",
    "EXIT_OK",
    "EXIT_REGRESSION",
    "EXIT_USAGE",
    "HIGHER_DB",
    "HIGHER_PERF",
    "KEY",
    "LOWER_ERROR",
    "LOWER_MEMORY",
    "LOWER_TIME",
    "METRIC_RULES",
    "NEUTRAL",
    "NOISY",
    "NOT_COMPARABLE",
    "CONTEXT_DIFFS",
    "ContextDiff",
    "OUT_COLUMNS",
    "PERFORMANCE_KINDS",
    "UNIT_RULES",
    "WORSE_VERDICTS",
    "CompareError",
    "Comparison",
    "Direction",
    "Options",
    "Side",
    "add_compare_options",
    "baseline_kind",
    "baseline_main",
    "baselines_root",
    "bootstrap_ratio",
    "compare",
    "context_flags",
    "direction",
    "direction_table",
    "identity_keys",
    "judge",
    "lab_name",
    "load_side",
    "main",
    "options_from",
    "rank_pvalues",
    "render_html",
    "resolve_source",
    "run_for_baseline",
    "store_baseline",
    "summary_text",
    "timing_free",
]
