"""The comparison's rules in one place: which way is better for a metric, when an error figure's
change is float noise, how a ranked (top-N) list is compared, and the names every part shares.

* Direction: decided once, by a row's own declaration (``reported``), its metric name, then its
  unit (``direction()``; the table is ``METRIC_RULES`` + ``UNIT_RULES``).
* Error figures (``error_scale``, ``judge_error``): judged against the tolerance of the lab's own
  check where the row carries it (rule "tolerance"), else against the unit roundoff of the dtype
  whose machine arithmetic made it at the problem's scale (rule "roundoff"), else by the ratio
  threshold alone (rule "threshold"); the verdict's note names the rule.
* Ranked lists (``ranked_member``, ``judge_membership``): the rows of a top-N list are compared
  as a set; an item that entered or left the list is reported, and gates only when it is heavy.
* Reported rows (``REPORTED``): compared and shown, never gated.

The ``extra`` fields a row declares these with are named in ``lab_utils.core.records``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from lab_utils.core import records

KEY = ["lab", "experiment", "variant", "shape", "dtype", "metric", "statistic"]
QUANTILE_STATISTICS = ("p20", "p80")
EXIT_OK, EXIT_REGRESSION, EXIT_USAGE, EXIT_INCOMPARABLE = 0, 1, 2, 3
#: a heavy item of a ranked list that the candidate lacks / that is new in it (``judge_membership``)
DISAPPEARED, APPEARED = "disappeared", "appeared"
#: an item that crossed a ranked list's cut-off: reported, never gated
LEFT_TOP_N, ENTERED_TOP_N = "left the top N", "entered the top N"
WORSE_VERDICTS = ("slower", "less accurate", "more memory", "failed", DISAPPEARED, APPEARED)
MEMBERSHIP_VERDICTS = (DISAPPEARED, APPEARED, LEFT_TOP_N, ENTERED_TOP_N)
#: a performance row whose timing was unstable on either side: never "slower" or "faster"
NOISY = "noisy"
#: a row whose runs differ in what it measures (software, timing threads, parameters): never judged
NOT_COMPARABLE = "not comparable"
#: a row its lab skipped in both runs (a check that cannot run on the device): shown, never judged or gated
SKIPPED = "skipped"


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
#: A measured figure that is shown and compared (beyond the performance threshold and its noise:
#: "changed") but never gates: an idle time, a share of a step, an overlap fraction.  They move
#: whenever anything else does (a kernel made 2x faster raises the step's idle share), so a gate on
#: them fails pure speed-ups; the times they are made of gate on their own rows.
REPORTED = Direction("none", "reported")
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
    (r"(^|[_:])(share|shares|idle)([_:/]|$)|^(overlap|overlap_fraction|overlap_pct)$", REPORTED),
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
            "1/s",
        )
    },
    "dB": HIGHER_DB,
    **{u: LOWER_MEMORY for u in ("B", "bytes", "KB", "KiB", "MB", "MiB", "GB", "GiB")},
}
#: Metrics derived as ``something / time``: they borrow the time row's noise.
PER_TIME_SUFFIXES = ("bandwidth", "throughput", "pct_of_ceiling")


def skipped_row(extra) -> bool:
    """Whether a row's ``extra`` says its lab skipped it (``verdict`` "skipped": a check that
    cannot run here, such as a Triton path on a CPU, recorded with no value)."""
    return str(extra_dict(extra).get("verdict", "")).strip().lower() == SKIPPED


def extra_dict(x) -> dict:
    """A row's ``extra`` (a JSON object as text, or a dict) as a dict; anything else is empty."""
    if isinstance(x, dict):
        return x
    if isinstance(x, str) and x.startswith("{"):
        try:
            d = json.loads(x)
            return d if isinstance(d, dict) else {}
        except ValueError:
            return {}
    return {}


def direction(metric: str, unit: str, extra=None) -> Direction:
    """Which way is better for one metric: ``REPORTED`` where the row declares it (``extra``),
    else the first metric-name rule that matches, else the unit's rule, else no direction (see
    the module note for the table)."""
    if extra_dict(extra).get(records.REPORTED) is True:
        return REPORTED
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


# --------------------------------------------------------------------------------------------
# Error figures: float noise or a loss of accuracy
# --------------------------------------------------------------------------------------------

#: An error figure held to its check's tolerance changes only when its share of that tolerance
#: moves by more than this.  perflab's checks leave a margin of 10-100x over the rounding error
#: they expect (fp32 attention: atol 1e-5 + rtol 1e-4 against errors of 5e-7), and float noise
#: between machines moves such errors by up to ~1.5x (the CPU baseline's attention errors, Intel
#: Xeon -> AMD EPYC: 4.9e-7 -> 6.6e-7), a few percent of the tolerance; a quarter of it is many
#: times that noise and a quarter of the margin the check's author left.  Past the tolerance the
#: check fails: always a regression.
TOLERANCE_SHARE = 0.25
#: A figure made by a machine's own float sums (a BLAS product, whose order and FMA use the
#: machine picks) changes only beyond this many unit roundoffs of its dtype times sqrt(reduction):
#: a sum of n rounded terms errs by about sqrt(n) unit roundoffs (the random-walk model of rounding
#: error, Higham, Accuracy and Stability of Numerical Algorithms, 2.8), and two machines summing in
#: different orders draw two such errors; 4x covers their spread.
ROUNDOFF_ULPS = 4.0
#: Unit roundoff (half the machine epsilon) of the dtypes machines compute in.
UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "tf32": 2.0**-11,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}
DTYPE_ALIASES = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16"}


def unit_roundoff(dtype) -> float | None:
    """Unit roundoff of a compute dtype name (``float32``, ``torch.bfloat16``, ``fp16``), else None."""
    name = str(dtype or "").removeprefix("torch.").lower()
    return UNIT_ROUNDOFF.get(DTYPE_ALIASES.get(name, name))


@dataclass(frozen=True)
class ErrorScale:
    """What an error figure's change is measured against: ``rule`` "tolerance" (``base``/``cand``:
    each side's tolerance) or "roundoff" (both: the float-noise floor); ``what`` says it in words."""

    rule: str
    base: float
    cand: float
    what: str


def positive(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) and f > 0 else None


def error_scale(extra_b, extra_c, dtype: str = "") -> ErrorScale | None:
    """The scale an error figure is judged on: its check's ``tolerance`` (a side without one takes
    the other's), else ``ROUNDOFF_ULPS`` unit roundoffs of its ``roundoff_dtype`` (default: the
    row's dtype) times sqrt(``reduction``) where the row names the reduction; None: neither."""
    eb, ec = extra_dict(extra_b), extra_dict(extra_c)
    tb, tc = positive(eb.get(records.TOLERANCE)), positive(ec.get(records.TOLERANCE))
    if tb or tc:
        tb, tc = tb or tc, tc or tb
        what = f"its check's tolerance {tc:.3g}" if tb == tc else f"its check's tolerance ({tb:.3g} / {tc:.3g})"
        return ErrorScale("tolerance", tb, tc, what)
    ex = ec if records.REDUCTION in ec else eb
    n = positive(ex.get(records.REDUCTION))
    u = unit_roundoff(ex.get(records.ROUNDOFF_DTYPE) or dtype)
    if n is None or u is None:
        return None
    floor = ROUNDOFF_ULPS * u * math.sqrt(n)
    name = str(ex.get(records.ROUNDOFF_DTYPE) or dtype).removeprefix("torch.")
    return ErrorScale("roundoff", floor, floor, f"{ROUNDOFF_ULPS:g} x {name} roundoff x sqrt({n:g}) = {floor:.3g}")


def judge_error(vb: float, vc: float, gain: float, threshold: float, scale: ErrorScale) -> tuple[str, str]:
    """(verdict, note) of a lower-is-better error figure (finite ``vb``, ``vc`` >= 0; ``gain`` > 1:
    the candidate is better) on its ``scale``: a change counts when it is beyond the ratio
    ``threshold`` *and* beyond float noise on that scale; past its tolerance always counts."""
    bound = 1 + threshold
    beyond = gain > bound or gain < 1 / bound
    if scale.rule == "tolerance":
        sb, sc = vb / scale.base, vc / scale.cand
        shares = f"{sb:.1%} -> {sc:.1%} of {scale.what}"
        if sc > 1 >= sb:
            return "less accurate", f"past its tolerance: {shares} (rule: tolerance)"
        if sb > 1 >= sc:
            return "more accurate", f"back within its tolerance: {shares} (rule: tolerance)"
        if beyond and abs(sc - sb) > TOLERANCE_SHARE:
            return ("more accurate" if gain > 1 else "less accurate"), f"{shares} (rule: tolerance)"
        noise = f"moved by under {TOLERANCE_SHARE:.0%} of it" if beyond else "within threshold"
        return "same", f"{shares}: {noise} (rule: tolerance)"
    delta = vc - vb
    if beyond and abs(delta) > scale.base:
        return ("more accurate" if gain > 1 else "less accurate"), f"{delta:+.3g}, beyond {scale.what} (rule: roundoff)"
    noise = f"float noise: {delta:+.3g} within {scale.what}" if beyond else "within threshold"
    return "same", f"{noise} (rule: roundoff)"


# --------------------------------------------------------------------------------------------
# Ranked lists (top N): compared as sets
# --------------------------------------------------------------------------------------------

#: An item that entered or left a top-N list gates only when its share of the whole is beyond the
#: other side's cut-off (the share of that list's lightest item, or 0 when the list held every
#: item) by more than this: it then moved the whole by at least this much, what the performance
#: threshold (5%) calls slower for a time.  Near the cut-off items trade places from noise alone
#: (lab 01's 15th op holds ~0.1% of a CPU step; two runs of one commit swapped four of them):
#: those changes are reported, never gated.
TOP_N_HEAVY_SHARE = 0.05


@dataclass(frozen=True)
class Ranked:
    """A row's membership of a ranked list: the list holds the ``n`` heaviest items (``share``: this
    item's fraction of the whole, or None)."""

    n: int
    share: float | None


def ranked_member(extra) -> Ranked | None:
    """The row's ``top_n`` membership, or None when it is not part of a ranked list."""
    e = extra_dict(extra)
    n = e.get(records.TOP_N)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return None
    s = e.get(records.SHARE)
    share = float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) else None
    return Ranked(n, share)


def judge_membership(member: Ranked, in_base: bool, other_cutoff: float | None) -> tuple[str, str]:
    """(verdict, note) of an item on one side of a ranked list only (``in_base``: the base has it).
    ``other_cutoff``: the share of the other side's lightest listed item, 0 when its list held
    fewer than N items (so this item is absent there), None when unknown (no shares)."""
    where = "the candidate" if in_base else "the base"
    if member.share is None or other_cutoff is None:
        v = LEFT_TOP_N if in_base else ENTERED_TOP_N
        return v, f"not in {where}'s top {member.n}: membership is a result, reported (rule: top-N, no shares)"
    moved = member.share - other_cutoff
    cut = f"{where}'s list ends at {other_cutoff:.1%}" if other_cutoff > 0 else f"absent from {where}"
    text = f"holds {member.share:.1%} of the whole; {cut}"
    if moved > TOP_N_HEAVY_SHARE:
        return (DISAPPEARED if in_base else APPEARED), (
            f"{text}: its share moved by at least {moved:.1%}, over {TOP_N_HEAVY_SHARE:.0%} (rule: top-N)"
        )
    return (LEFT_TOP_N if in_base else ENTERED_TOP_N), (
        f"{text}: moved by under {TOP_N_HEAVY_SHARE:.0%} of the whole, reported (rule: top-N)"
    )
