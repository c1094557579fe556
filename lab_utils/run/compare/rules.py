"""Which way is better for a metric, and the names every part of compare shares.

The direction is decided once, by metric name first and unit second (``direction()``;
the table is ``METRIC_RULES`` + ``UNIT_RULES``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KEY = ["lab", "experiment", "variant", "shape", "dtype", "metric", "statistic"]
QUANTILE_STATISTICS = ("p20", "p80")
EXIT_OK, EXIT_REGRESSION, EXIT_USAGE, EXIT_INCOMPARABLE = 0, 1, 2, 3
WORSE_VERDICTS = ("slower", "less accurate", "more memory", "failed")
#: a performance row whose timing was unstable on either side: never "slower" or "faster"
NOISY = "noisy"
#: a row whose runs differ in what it measures (software, timing threads, parameters): never judged
NOT_COMPARABLE = "not comparable"


class CompareError(ValueError):
    """Inputs that cannot be compared (unreadable, mixed devices, ...)."""


@dataclass(frozen=True)
class Direction:
    better: str  # "lower" | "higher" | "none"
    kind: str  # "performance" | "accuracy" | "memory" | "other"
    scale: str = "ratio"  # "ratio" | "db" (compared by difference)

    @property
    def words(self) -> tuple[str, str]:
        """(word when the candidate is better, word when worse)."""
        return {
            "performance": ("faster", "slower"),
            "accuracy": ("more accurate", "less accurate"),
            "memory": ("less memory", "more memory"),
        }.get(self.kind, ("changed", "changed"))


LOWER_TIME = Direction("lower", "performance")
HIGHER_PERF = Direction("higher", "performance")
LOWER_ERROR = Direction("lower", "accuracy")
HIGHER_DB = Direction("higher", "accuracy", "db")
LOWER_MEMORY = Direction("lower", "memory")
NEUTRAL = Direction("none", "other")
#: The error of a model of timings (a fitted alpha-beta curve, a plan's predicted step time):
#: it moves with the machine's load like the timings it is computed from, so it is compared as
#: performance (and left out of timing-free baselines), not as a format's accuracy.
TIMING_MODEL_ERROR = Direction("lower", "performance")

#: A run's context fields shown beside each side (the HTML page, compare.json).
SIDE_CONTEXT_KEYS = (
    "device",
    "device_kind",
    "torch_version",
    "triton_version",
    "cuda_version",
    "python_version",
    "commit",
    "timestamp",
    "run_id",
)

#: Metric-name rules, checked first (regex on the metric, case-insensitive).
METRIC_RULES: list[tuple[str, Direction]] = [
    (r"sqnr", HIGHER_DB),
    (r"^fit_\w*error|^model_\w*error|prediction_error", TIMING_MODEL_ERROR),
    (
        r"(^|_)(err|error|errors|mse|rmse|mae|ulp|ulps|mismatch(es)?|max_abs|max_rel|abs_diff|rel_diff|nan|inf)(_|$)",
        LOWER_ERROR,
    ),
    (r"(rel|abs)_?err", LOWER_ERROR),
    (r"(^|_)(time|latency|duration)(_|$)", LOWER_TIME),
    (r"(^|_)(speedup|bandwidth|throughput|tflops|gbs|pct_of_ceiling)(_|$)", HIGHER_PERF),
    (r"(^|_)(memory|mem|peak_bytes|allocated|reserved)(_|$)", LOWER_MEMORY),
]
#: Unit rules (exact unit string), used when no metric rule matches.
UNIT_RULES: dict[str, Direction] = {
    **{u: LOWER_TIME for u in ("ms", "s", "us", "µs", "ns")},
    **{
        u: HIGHER_PERF
        for u in (
            "GB/s",
            "TB/s",
            "MB/s",
            "TFLOP/s",
            "GFLOP/s",
            "PFLOP/s",
            "%",
            "x",
            "×",
            "tokens/s",
            "samples/s",
            "img/s",
            "images/s",
            "steps/s",
            "it/s",
        )
    },
    "dB": HIGHER_DB,
    **{u: LOWER_MEMORY for u in ("B", "bytes", "KB", "KiB", "MB", "MiB", "GB", "GiB")},
}
#: Metrics derived as ``something / time``: they borrow the time row's noise.
PER_TIME_SUFFIXES = ("bandwidth", "throughput", "pct_of_ceiling")


def direction(metric: str, unit: str) -> Direction:
    """Which way is better for one metric: the first metric-name rule that matches,
    else the unit's rule, else no direction (see the module note for the table)."""
    m = str(metric or "").lower()
    for pat, d in METRIC_RULES:
        if re.search(pat, m):
            return d
    return UNIT_RULES.get(str(unit or "").strip(), NEUTRAL)


def direction_table() -> list[dict]:
    """The table as rows (for docs and the HTML page)."""
    rows = [
        {"rule": f"metric ~ /{p}/", "better": d.better, "kind": d.kind, "compared by": d.scale} for p, d in METRIC_RULES
    ]
    rows += [
        {"rule": f"unit = {u}", "better": d.better, "kind": d.kind, "compared by": d.scale}
        for u, d in UNIT_RULES.items()
    ]
    rows.append({"rule": "anything else", "better": "none", "kind": "other", "compared by": "ratio"})
    return rows
