"""Noise statistics and the verdict rule.

A row with kept samples on both sides gets a bootstrap interval of the ratio of medians
(each side resampled, fixed seed) or, with ``method="rank"``, one-sided Mann-Whitney U
tests; ``judge`` turns a gain, its interval and the threshold into a verdict.
"""

from __future__ import annotations

import math

import numpy as np

from lab_utils.run.compare.options import Options
from lab_utils.run.compare.rules import Direction

#: the note of a verdict made by the threshold alone, without samples to measure the noise
NO_SAMPLES_NOTE = "no samples: threshold only"


def bootstrap_ratio(
    base: np.ndarray, cand: np.ndarray, *, n: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of median(cand) / median(base), each side resampled."""
    rng = np.random.default_rng(seed)
    b = np.median(rng.choice(base, size=(n, base.size), replace=True), axis=1)
    c = np.median(rng.choice(cand, size=(n, cand.size), replace=True), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = c / b
    r = r[np.isfinite(r)]
    if not r.size:
        return math.nan, math.nan
    a = (1 - confidence) / 2
    return float(np.quantile(r, a)), float(np.quantile(r, 1 - a))


def rank_pvalues(base: np.ndarray, cand: np.ndarray, factor: float, better: str) -> tuple[float, float]:
    """One-sided Mann-Whitney U tests that the candidate is worse / better than the base
    by more than ``factor`` (= 1 + threshold): (p_worse, p_better)."""
    if base.size < 2 or cand.size < 2:
        return math.nan, math.nan

    def p(x, y, alt):
        if np.ptp(np.concatenate([x, y])) == 0:
            return 1.0
        # scipy: perflab[lab], not the trace reader (perflab[traces]); seconds to import, and only
        # --method rank needs it
        from scipy.stats import mannwhitneyu  # noqa: PLC0415  (heavy optional: perflab[lab])

        return float(mannwhitneyu(x, y, alternative=alt).pvalue)

    if better == "lower":  # worse: cand > base * factor
        return p(cand, base * factor, "greater"), p(cand, base / factor, "less")
    return p(cand, base / factor, "less"), p(cand, base * factor, "greater")


def judge(
    gain: float, lo: float, hi: float, pw: float, pb: float, d: Direction, o: Options, *, delta: float | None = None
) -> tuple[str, str]:
    """(verdict, note).  ``gain`` is oriented (> 1: candidate better), ``lo``/``hi`` its
    interval and ``pw``/``pb`` the rank tests' p-values for worse / better beyond the
    threshold (NaN when there are no samples).  A verdict needs the change beyond the
    threshold *with confidence*: the whole interval beyond it, or p < 1 - confidence."""
    better_w, worse_w = d.words
    if d.kind == "other":
        # no better direction: any change counts, beyond float noise (``neutral_tolerance``, relative)
        if math.isfinite(gain) and abs(gain - 1) <= o.neutral_tolerance:
            return "same", (f"within {o.neutral_tolerance:g} relative (float noise)" if gain != 1 else "")
        return "changed", "no better direction for this metric"
    if d.scale == "db":
        oriented = delta if d.better == "higher" else -delta
        if abs(oriented) <= o.db_threshold:
            return "same", "within threshold" if oriented else ""
        return (better_w if oriented > 0 else worse_w), NO_SAMPLES_NOTE
    thr = o.accuracy_threshold if d.kind == "accuracy" else o.threshold
    bound = 1 + thr
    point_better, point_worse = gain > bound, gain < 1 / bound
    rank = o.method == "rank" and not (math.isnan(pw) or math.isnan(pb))
    boot = not (math.isnan(lo) or math.isnan(hi))
    if not (rank or boot):
        if point_better or point_worse:
            return (better_w if point_better else worse_w), NO_SAMPLES_NOTE
        return "same", "within threshold" if gain != 1 else ""
    alpha = 1 - o.confidence
    conf_worse = pw < alpha if rank else hi < 1 / bound
    conf_better = pb < alpha if rank else lo > bound
    if conf_worse:
        return worse_w, ""
    if conf_better:
        return better_w, ""
    if point_better or point_worse:
        how = f"rank test p={min(pw, pb):.2g}" if rank else "its interval reaches inside it"
        return "same", f"possibly {better_w if point_better else worse_w}: beyond the threshold but {how}"
    significant = (min(pw, pb) < alpha) if rank else (lo > 1 or hi < 1)
    return "same", "significant but within threshold" if significant else "within noise"
