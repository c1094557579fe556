"""Compare two runs (a baseline and a candidate) row by row, and gate on regressions.

Design note
-----------
* Rows are matched on ``KEY = (lab, experiment, variant, shape, dtype, metric,
  statistic)``.  Rows sharing a key are told apart by the categorical ``extra`` fields
  that differ between them (a mask, a layout; never outcomes such as ``verdict`` or
  floats), and what still repeats is numbered (``#2``) in order and flagged, never
  averaged.  ``p20``/``p80`` rows are summaries of the same samples as the
  ``median`` row and are left out unless asked for (``--statistics all``).
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
  a side whose rows come from several devices is refused.  Software differences
  (torch, triton, CUDA, commit) are shown, since comparing them is often the point.
* Performance rows without samples (and no time row to borrow from) get a verdict from
  the threshold alone but never fail the gate: with no noise estimate a load swing on
  the machine would.  Error figures without samples are deterministic (fixed seeds) and
  do gate.
* Exit codes: 0 no regression; 1 a regression beyond the threshold (including a row
  that ran in the base and failed in the candidate); 2 bad arguments / unreadable
  inputs; 3 not comparable (device mismatch on performance rows).

Baselines live in ``parameterized/baselines/<kind>/`` (``records.json``,
``context.json``, ``baseline.json``) with ``<kind>`` = ``cpu`` or
``cuda-<gpu-model>`` (``baseline_kind()``), written by ``perflab baseline refresh``.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
KEY = ["lab", "experiment", "variant", "shape", "dtype", "metric", "statistic"]
QUANTILE_STATISTICS = ("p20", "p80")
EXIT_OK, EXIT_REGRESSION, EXIT_USAGE, EXIT_INCOMPARABLE = 0, 1, 2, 3


class CompareError(ValueError):
    """Inputs that cannot be compared (unreadable, mixed devices, ...)."""


# ---------------------------------------------------------------- direction table
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

#: Metric-name rules, checked first (regex on the metric, case-insensitive).
METRIC_RULES: list[tuple[str, Direction]] = [
    (r"sqnr", HIGHER_DB),
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


# ---------------------------------------------------------------- inputs
@dataclass
class Side:
    """One side of a comparison: its rows, context and where it came from."""

    label: str
    source: str
    rows: pd.DataFrame
    context: dict = field(default_factory=dict)
    status: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @property
    def device(self) -> str:
        return str(self.context.get("device") or "")

    @property
    def run_id(self) -> str:
        return str(self.context.get("run_id") or self.meta.get("run_id") or Path(self.source).name)


def baselines_root() -> Path:
    return ROOT / "parameterized" / "baselines"


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(s).lower()).strip("-") or "unknown"


def baseline_kind(context: dict) -> str:
    """``cpu`` for any CPU (CPU baselines are meant for accuracy and counts; timings
    there are flagged by device name), ``cuda-<model>`` for a GPU, e.g. ``cuda-nvidia-h200``."""
    kind = str(context.get("device_kind") or "unknown")
    if kind == "cpu":
        return "cpu"
    return f"{_slug(kind)}-{_slug(context.get('device') or 'unknown')}"


def resolve_source(ref: str | Path) -> Path:
    """A report folder, a records file, ``latest`` (reports/latest) or
    ``baseline[:KIND]`` (parameterized/baselines/KIND, KIND defaulting to this machine's)."""
    s = str(ref)
    if s == "latest":
        return ROOT / "reports" / "latest"
    if s == "baseline" or s.startswith("baseline:"):
        kind = s.partition(":")[2] or baseline_kind(_this_machine_context())
        return baselines_root() / kind
    return Path(s)


def _this_machine_context() -> dict:
    from ..device import device_info

    info = device_info(None)
    return {"device": info.name, "device_kind": info.kind}


def _first_value(df: pd.DataFrame, col: str) -> str:
    if col not in df.columns or not len(df):
        return ""
    vals = [v for v in df[col].dropna().astype(str).unique() if v]
    return vals[0] if vals else ""


def load_side(ref: str | Path, label: str) -> Side:
    from ..records import CONTEXT_COLUMNS, load_records

    path = resolve_source(ref)
    if not path.exists():
        raise CompareError(
            f"{label}: {ref} does not exist (give a report folder, records.json/.parquet, "
            f"'latest' or 'baseline[:KIND]')"
        )
    try:
        rows = load_records(path)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise CompareError(f"{label}: cannot read records from {path}: {e}") from None
    folder = path if path.is_dir() else path.parent
    ctx: dict = {}
    if (folder / "context.json").exists():
        try:
            ctx = json.loads((folder / "context.json").read_text())
        except (OSError, ValueError):
            ctx = {}
    if not path.is_dir() and path.suffix == ".json":  # a single notebook's records file carries its context
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict) and isinstance(data.get("context"), dict):
                ctx = {**data["context"], **ctx}
        except (OSError, ValueError):
            pass
    for c in CONTEXT_COLUMNS:
        if not ctx.get(c):
            ctx[c] = _first_value(rows, c)
    if not ctx.get("run_id"):
        ctx["run_id"] = _first_value(rows, "run_id")
    status = []
    if (folder / "status.json").exists():
        try:
            status = json.loads((folder / "status.json").read_text())
        except (OSError, ValueError):
            status = []
    meta = {}
    if (folder / "baseline.json").exists():
        try:
            meta = json.loads((folder / "baseline.json").read_text())
        except (OSError, ValueError):
            meta = {}
    if "device" in rows.columns:
        devices = sorted({str(d) for d in rows["device"].dropna() if str(d)})
        if len(devices) > 1:
            raise CompareError(
                f"{label}: {path} holds rows from {len(devices)} devices ({'; '.join(devices)}); "
                f"comparing it would mix them - split it into one records file per device"
            )
        if devices and not ctx.get("device"):
            ctx["device"] = devices[0]
    mixed = {}
    for c in ("torch_version", "triton_version", "cuda_version", "commit"):
        if c in rows.columns:
            vals = sorted({str(v) for v in rows[c].dropna() if str(v)})
            if len(vals) > 1:
                mixed[c] = vals
    side = Side(label=label, source=str(path), rows=_normalise(rows), context=ctx, status=status, meta=meta)
    side.mixed = mixed  # type: ignore[attr-defined]
    return side


def _samples(x: Any) -> np.ndarray | None:
    if x is None:
        return None
    if isinstance(x, float) and math.isnan(x):
        return None
    try:
        a = np.asarray(x, dtype=float).ravel()
    except (TypeError, ValueError):
        return None
    a = a[np.isfinite(a)]
    return a if a.size else None


def _normalise(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    for c in KEY + ["unit"]:
        if c not in df.columns:
            df[c] = ""
        df[c] = df[c].fillna("").astype(str)
    if "value" not in df.columns:
        df["value"] = np.nan
    df["value"] = pd.to_numeric(df["value"], errors="coerce")
    if "samples" not in df.columns:
        df["samples"] = None
    df["samples"] = [_samples(s) for s in df["samples"]]
    # a failed timing is matched against the base's median row: it is that row, failing
    df["failed"] = df["statistic"] == "failed"
    df.loc[df["failed"], "statistic"] = "median"
    dup = df.groupby(KEY, sort=False).cumcount()
    df["occurrence"] = dup + 1
    return df.reset_index(drop=True)


#: ``extra`` keys that describe how a row came about, not which measurement it is.
#: Outcomes ("verdict", "ok", ...) must not be identity either: a row whose check starts
#: failing has to meet its old self and be judged, not fall apart into two one-sided rows.
VOLATILE_EXTRA = {
    "reason",
    "failure_kind",
    "method",
    "formula",
    "bound",
    "note",
    "error",
    "traceback",
    "seconds",
    "timestamp",
    "path",
    "samples",
    "verdict",
    "ok",
    "passed",
    "status",
    "result",
    "outcome",
    "why",
    "why_not",
    "message",
    "skipped",
}


def _extra_dict(x: Any) -> dict:
    if isinstance(x, dict):
        return x
    if isinstance(x, str) and x.startswith("{"):
        try:
            d = json.loads(x)
            return d if isinstance(d, dict) else {}
        except ValueError:
            return {}
    return {}


def identity_keys(*frames: pd.DataFrame) -> list[str]:
    """``extra`` keys that tell apart rows sharing a KEY (e.g. a mask or a sequence length
    a lab keeps in ``extra``): those whose values differ inside such a group."""
    keys: set[str] = set()
    for df in frames:
        dup = df[df.duplicated(KEY, keep=False)]
        for _, g in dup.groupby(KEY, sort=False):
            ex = [_extra_dict(e) for e in g["extra"]]
            for k in set().union(*ex) - VOLATILE_EXTRA:
                vals = [e.get(k) for e in ex]
                # identity is categorical (names, sizes, lists); floats are measured or derived figures
                if any(isinstance(v, float) or isinstance(v, bool) for v in vals):
                    continue
                if len({json.dumps(v, sort_keys=True, default=str) for v in vals}) > 1:
                    keys.add(k)
    return sorted(keys)


def _with_identity(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    df = df.copy()
    if "extra" not in df.columns:
        df["extra"] = ""
    df["ident"] = [" ".join(f"{k}={e[k]}" for k in keys if k in e) for e in map(_extra_dict, df["extra"])]
    df["occurrence"] = df.groupby(KEY + ["ident"], sort=False).cumcount() + 1
    return df


# ---------------------------------------------------------------- statistics
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
    from scipy.stats import mannwhitneyu

    if base.size < 2 or cand.size < 2:
        return math.nan, math.nan

    def p(x, y, alt):
        if np.ptp(np.concatenate([x, y])) == 0:
            return 1.0
        return float(mannwhitneyu(x, y, alternative=alt).pvalue)

    if better == "lower":  # worse: cand > base * factor
        return p(cand, base * factor, "greater"), p(cand, base / factor, "less")
    return p(cand, base / factor, "less"), p(cand, base * factor, "greater")


# ---------------------------------------------------------------- the comparison
@dataclass(frozen=True)
class Options:
    threshold: float = 0.05  # performance and memory: relative change that counts
    accuracy_threshold: float = 0.10  # error figures (ratio metrics)
    db_threshold: float = 0.5  # SQNR and other dB figures: absolute change in dB
    confidence: float = 0.99
    method: str = "bootstrap"  # "bootstrap" | "rank"
    bootstrap: int = 2000
    min_samples: int = 3
    statistics: str = "default"  # "default" (no p20/p80) | "all"
    only: str = "all"  # "all" | "performance" | "accuracy" (accuracy + other)
    gate: str = "all"  # which kinds fail the gate: "all" | "performance" | "accuracy" | "none"
    allow_device_mismatch: bool = False

    def __post_init__(self):
        from ..config import ConfigError

        for name in ("threshold", "accuracy_threshold", "db_threshold"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
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
        if not (isinstance(self.bootstrap, int) and self.bootstrap >= 100):
            raise ConfigError("bootstrap", self.bootstrap, "an integer >= 100")


OUT_COLUMNS = [
    "lab",
    "experiment",
    "variant",
    "shape",
    "dtype",
    "metric",
    "statistic",
    "ident",
    "occurrence",
    "unit",
    "kind",
    "better",
    "base",
    "candidate",
    "ratio",
    "gain",
    "lo",
    "hi",
    "p_value",
    "n_base",
    "n_cand",
    "noise",
    "verdict",
    "note",
    "regression",
    "improvement",
    "base_samples",
    "cand_samples",
]
WORSE_VERDICTS = ("slower", "less accurate", "more memory", "failed")


def _kind_selected(kind: str, only: str) -> bool:
    if only == "all":
        return True
    if only == "performance":
        return kind in ("performance", "memory")
    return kind in ("accuracy", "other")


@dataclass
class Comparison:
    base: Side
    cand: Side
    options: Options
    rows: pd.DataFrame  # one row per matched or one-sided key
    flags: list[str]
    device_mismatch: bool
    failed_notebooks: list[str] = field(default_factory=list)  # ran in base, failed in candidate

    # --- verdict summary
    @property
    def regressions(self) -> pd.DataFrame:
        return self.rows[self.rows["regression"]]

    @property
    def improvements(self) -> pd.DataFrame:
        return self.rows[self.rows["improvement"]]

    def counts(self) -> dict[str, int]:
        return {str(k): int(v) for k, v in self.rows["verdict"].value_counts().items()}

    @property
    def exit_code(self) -> int:
        if len(self.regressions) or (self.failed_notebooks and self.options.gate != "none"):
            return EXIT_REGRESSION
        if self.device_mismatch and (self.rows["verdict"] == "device differs").any():
            return EXIT_INCOMPARABLE
        return EXIT_OK

    def result_line(self) -> str:
        n = len(self.regressions)
        if n or self.exit_code == EXIT_REGRESSION:
            nb = (
                f"; notebook(s) that ran in the base failed in the candidate: {', '.join(self.failed_notebooks)}"
                if self.failed_notebooks
                else ""
            )
            return f"FAIL: {n} regression{'s' * (n != 1)} beyond threshold{nb} (exit {EXIT_REGRESSION})"
        if self.exit_code == EXIT_INCOMPARABLE:
            return (
                f"NOT COMPARABLE: devices differ ({self.base.device} vs {self.cand.device}); performance rows "
                f"were not compared (--allow-device-mismatch to compare them) (exit {EXIT_INCOMPARABLE})"
            )
        return "OK: no regression beyond threshold (exit 0)"

    # --- outputs
    def summary_text(self, limit: int = 40) -> str:
        return summary_text(self, limit=limit)

    def to_html(self) -> str:
        return render_html(self)

    def to_json(self) -> dict:
        cols = [c for c in self.rows.columns if c not in ("base_samples", "cand_samples")]
        recs = json.loads(self.rows[cols].to_json(orient="records"))
        return {
            "base": _side_json(self.base),
            "candidate": _side_json(self.cand),
            "options": self.options.__dict__,
            "flags": self.flags,
            "counts": self.counts(),
            "exit_code": self.exit_code,
            "result": self.result_line(),
            "rows": recs,
        }

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"html": out / "compare.html", "text": out / "summary.txt", "json": out / "compare.json"}
        paths["html"].write_text(self.to_html(), encoding="utf-8")
        paths["text"].write_text(self.summary_text(limit=10_000), encoding="utf-8")
        paths["json"].write_text(json.dumps(self.to_json(), indent=1, default=str), encoding="utf-8")
        return paths


def _side_json(s: Side) -> dict:
    keep = (
        "device",
        "device_kind",
        "torch_version",
        "triton_version",
        "cuda_version",
        "python_version",
        "commit",
        "timestamp",
        "run_id",
        "suite",
        "host",
    )
    return {
        "label": s.label,
        "source": s.source,
        "context": {k: s.context.get(k) for k in keep if k in s.context},
        "meta": s.meta,
    }


SOFTWARE_FIELDS = ("torch_version", "triton_version", "cuda_version", "python_version", "triton_interpret")


def context_flags(base: Side, cand: Side) -> tuple[list[str], bool]:
    flags = []
    bd, cd = base.context.get("device", ""), cand.context.get("device", "")
    mismatch = bool(bd and cd and bd != cd) or (
        base.context.get("device_kind")
        and cand.context.get("device_kind")
        and base.context.get("device_kind") != cand.context.get("device_kind")
    )
    if mismatch:
        flags.append(
            f"DEVICE DIFFERS: base ran on {bd or '?'} ({base.context.get('device_kind')}), candidate on "
            f"{cd or '?'} ({cand.context.get('device_kind')})"
        )
    bi, ci = base.context.get("device_info") or {}, cand.context.get("device_info") or {}
    if not mismatch and bi and ci:
        for k in ("units", "memory_bytes", "capability", "threads"):
            if k in bi and k in ci and bi[k] != ci[k]:
                flags.append(f"device setup differs: {k} {bi[k]} -> {ci[k]}")
    for k in SOFTWARE_FIELDS:
        b, c = base.context.get(k), cand.context.get(k)
        if (b or c) and str(b) != str(c):
            flags.append(f"software differs: {k.replace('_version', '')} {b} -> {c}")
    b, c = base.context.get("commit"), cand.context.get("commit")
    if b and c and b != c:
        flags.append(f"commit differs: {b} -> {c}")
    for side in (base, cand):
        for k, vals in getattr(side, "mixed", {}).items():
            flags.append(
                f"{side.label}: its rows come from different {k.replace('_version', '')} values "
                f"({', '.join(vals)}): a run that spanned commits, or records gathered from several runs?"
            )
        bad = [s.get("notebook") for s in side.status if s.get("status") != "ok"]
        if bad:
            flags.append(f"{side.label}: notebook(s) failed, their rows are missing: {', '.join(map(str, bad))}")
    return flags, bool(mismatch)


def _judge(
    gain: float, lo: float, hi: float, pw: float, pb: float, d: Direction, o: Options, *, delta: float | None = None
) -> tuple[str, str]:
    """(verdict, note).  ``gain`` is oriented (> 1: candidate better), ``lo``/``hi`` its
    interval and ``pw``/``pb`` the rank tests' p-values for worse / better beyond the
    threshold (NaN when there are no samples).  A verdict needs the change beyond the
    threshold *with confidence*: the whole interval beyond it, or p < 1 - confidence."""
    better_w, worse_w = d.words
    if d.kind == "other":
        changed = (gain != 1) if math.isfinite(gain) else True
        return ("changed", "no better direction for this metric") if changed else ("same", "")
    if d.scale == "db":
        oriented = delta if d.better == "higher" else -delta
        if abs(oriented) <= o.db_threshold:
            return "same", "within threshold" if oriented else ""
        return (better_w if oriented > 0 else worse_w), "no samples: threshold only"
    thr = o.accuracy_threshold if d.kind == "accuracy" else o.threshold
    bound = 1 + thr
    point_better, point_worse = gain > bound, gain < 1 / bound
    rank = o.method == "rank" and not (math.isnan(pw) or math.isnan(pb))
    boot = not (math.isnan(lo) or math.isnan(hi))
    if not (rank or boot):
        if point_better or point_worse:
            return (better_w if point_better else worse_w), "no samples: threshold only"
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


def compare(base: Side | str | Path, cand: Side | str | Path, options: Options | None = None, **kw) -> Comparison:
    """Compare two runs.  ``base``/``cand``: a ``Side`` or anything ``load_side`` reads."""
    o = options or Options(**kw)
    if not isinstance(base, Side):
        base = load_side(base, "base")
    if not isinstance(cand, Side):
        cand = load_side(cand, "candidate")
    flags, mismatch = context_flags(base, cand)
    b, c = base.rows, cand.rows
    if o.statistics == "default":
        b = b[~b["statistic"].isin(QUANTILE_STATISTICS)]
        c = c[~c["statistic"].isin(QUANTILE_STATISTICS)]
    ids = identity_keys(b, c)
    b, c = _with_identity(b, ids), _with_identity(c, ids)
    key = KEY + ["ident", "occurrence"]
    m = b.merge(c, on=key, how="outer", suffixes=("_b", "_c"), indicator=True)
    if ids:
        flags.append(f"rows sharing a key are told apart by their extra field(s): {', '.join(ids)}")
    for side_df, lab in ((b, "base"), (c, "candidate")):
        dups = side_df[side_df["occurrence"] > 1]
        if len(dups):
            flags.append(
                f"{lab}: {len(dups)} row(s) repeat a key (lab, experiment, variant, shape, dtype, metric, "
                f"statistic, extra); they are matched in order of appearance and numbered, not averaged"
            )

    # noise of time rows, borrowed by the per-time rows of the same group
    out = []
    group_cols = ["lab", "experiment", "variant", "shape", "dtype", "ident", "occurrence"]
    time_gain: dict[tuple, tuple[float, float, float, float, bool]] = {}

    def row_base(r) -> dict:
        unit = next((u for u in (r.get("unit_b"), r.get("unit_c")) if isinstance(u, str) and u), "")
        d = direction(r["metric"], unit)
        return dict(
            lab=r["lab"],
            experiment=r["experiment"],
            variant=r["variant"],
            shape=r["shape"],
            dtype=r["dtype"],
            metric=r["metric"],
            statistic=r["statistic"],
            ident=r["ident"],
            occurrence=int(r["occurrence"]),
            unit=unit,
            kind=d.kind,
            better=d.better,
            base=r.get("value_b"),
            candidate=r.get("value_c"),
            ratio=math.nan,
            gain=math.nan,
            lo=math.nan,
            hi=math.nan,
            p_value=math.nan,
            n_base=0,
            n_cand=0,
            noise="",
            verdict="",
            note="",
            regression=False,
            improvement=False,
            base_samples=None,
            cand_samples=None,
        ), d

    pending_derived = []
    for _, r in m.iterrows():
        row, d = row_base(r)
        if not _kind_selected(d.kind, o.only):
            continue
        if r["_merge"] == "left_only":
            row.update(verdict="only in base", note="missing in candidate", base=r["value_b"], candidate=math.nan)
            out.append(row)
            continue
        if r["_merge"] == "right_only":
            row.update(verdict="only in candidate", note="new in candidate", base=math.nan, candidate=r["value_c"])
            out.append(row)
            continue
        fb, fc = bool(r["failed_b"]), bool(r["failed_c"])
        if fb or fc:
            v = {(True, True): "failed both", (False, True): "failed", (True, False): "fixed"}[(fb, fc)]
            row.update(
                verdict=v,
                note="ran in base, failed in candidate"
                if v == "failed"
                else ("failed in base, runs in candidate" if v == "fixed" else ""),
            )
            out.append(row)
            continue
        if mismatch and d.kind in ("performance", "memory") and not o.allow_device_mismatch:
            row.update(verdict="device differs", note="not compared: runs on different devices")
            out.append(row)
            continue
        vb, vc = float(r["value_b"]), float(r["value_c"])
        sb, sc = r["samples_b"], r["samples_c"]
        row.update(
            n_base=0 if sb is None else int(sb.size),
            n_cand=0 if sc is None else int(sc.size),
            base_samples=sb,
            cand_samples=sc,
        )
        if not (math.isfinite(vb) and math.isfinite(vc)):
            row.update(verdict="no value", note="a value is NaN or infinite")
            out.append(row)
            continue
        delta = None
        if d.scale == "db":
            delta = vc - vb
            row["ratio"] = vc / vb if vb != 0 else math.nan
            gain = 10 ** ((delta if d.better == "higher" else -delta) / 10)
        elif vb == 0 or vc == 0:
            if vb == vc:
                gain, row["ratio"] = 1.0, 1.0
            else:
                row["ratio"] = math.inf if vb == 0 else 0.0
                worse = (vc > vb) if d.better == "lower" else (vc < vb)
                gain = 0.0 if worse else math.inf
        else:
            row["ratio"] = vc / vb
            gain = vb / vc if d.better == "lower" else vc / vb
        row["gain"] = gain
        have = sb is not None and sc is not None and sb.size >= o.min_samples and sc.size >= o.min_samples
        lo = hi = pw = pb = math.nan
        if have and d.scale == "ratio" and vb > 0 and vc > 0:
            rlo, rhi = bootstrap_ratio(sb, sc, n=o.bootstrap, confidence=o.confidence)
            lo, hi = (1 / rhi, 1 / rlo) if d.better == "lower" else (rlo, rhi)
            if o.method == "rank":
                thr = o.accuracy_threshold if d.kind == "accuracy" else o.threshold
                pw, pb = rank_pvalues(sb, sc, 1 + thr, d.better)
            row["noise"] = f"bootstrap {int(o.confidence * 100)}%" + (" + rank test" if o.method == "rank" else "")
            time_gain[tuple(r[c] for c in group_cols) + (r["metric"],)] = (gain, lo, hi, pw, pb)
        elif have:
            row["note"] = "samples kept but not usable for a ratio"
        if d.kind == "performance" and not have and r["metric"].endswith(PER_TIME_SUFFIXES):
            pending_derived.append((row, d, delta, r))
            out.append(row)
            continue
        verdict, note = _judge(gain, lo, hi, pw, pb, d, o, delta=delta)
        row.update(lo=lo, hi=hi, p_value=min(pw, pb), verdict=verdict, note=note or row["note"])
        out.append(row)

    for row, d, delta, r in pending_derived:
        suffix = next(s for s in PER_TIME_SUFFIXES if r["metric"].endswith(s))
        tkey = tuple(r[c] for c in group_cols) + (r["metric"][: -len(suffix)] + "time",)
        lo = hi = pw = pb = math.nan
        if tkey in time_gain:
            tg, tlo, thi, tpw, tpb = time_gain[tkey]
            g = row["gain"]
            if math.isfinite(g) and g > 0 and tg > 0:
                # same bytes (flops) over the same times: the ratio moves with the time's ratio
                lo, hi, pw, pb = g * tlo / tg, g * thi / tg, tpw, tpb
                row["noise"] = "from the time row's samples"
        verdict, note = _judge(row["gain"], lo, hi, pw, pb, d, o, delta=delta)
        row.update(lo=lo, hi=hi, p_value=min(pw, pb), verdict=verdict, note=note)

    df = pd.DataFrame(out, columns=OUT_COLUMNS)
    if len(df):
        gated = df["kind"].map(
            lambda k: (
                o.gate == "all"
                or (o.gate == "performance" and k in ("performance", "memory"))
                or (o.gate == "accuracy" and k == "accuracy")
            )
        )
        # a performance figure without kept samples has no noise estimate: shown, never gated
        # (a machine-load swing would fail the gate); deterministic accuracy figures do gate
        unmeasured_noise = (
            df["kind"].isin(("performance", "memory")) & (df["noise"] == "") & (df["verdict"] != "failed")
        )
        df.loc[unmeasured_noise & df["verdict"].isin(WORSE_VERDICTS), "note"] = (
            "no samples, so no noise estimate: not gated"
        )
        df["regression"] = df["verdict"].isin(WORSE_VERDICTS) & gated & ~unmeasured_noise
        df["improvement"] = df["verdict"].isin(("faster", "more accurate", "less memory", "fixed"))
        order = {
            "failed": 0,
            "slower": 1,
            "less accurate": 1,
            "more memory": 1,
            "changed": 2,
            "device differs": 3,
            "only in base": 4,
            "only in candidate": 5,
            "no value": 6,
            "failed both": 6,
            "faster": 7,
            "more accurate": 7,
            "less memory": 7,
            "fixed": 7,
            "same": 8,
        }
        df["_o"] = df["verdict"].map(order).fillna(9)
        df = (
            df.sort_values(["_o", "lab", "experiment", "variant", "shape", "dtype", "metric"], kind="stable")
            .drop(columns="_o")
            .reset_index(drop=True)
        )
    n_b, n_c = (df["verdict"] == "only in base").sum(), (df["verdict"] == "only in candidate").sum()
    if n_b or n_c:
        flags.append(f"{n_b} row(s) only in base, {n_c} only in candidate: listed, not compared")
    return Comparison(
        base=base,
        cand=cand,
        options=o,
        rows=df,
        flags=flags,
        device_mismatch=mismatch,
        failed_notebooks=_newly_failed(base, cand),
    )


def _newly_failed(base: Side, cand: Side) -> list[str]:
    """Notebooks that failed in the candidate but ran (or left rows) in the base."""
    ok_in_base = {s.get("notebook") for s in base.status if s.get("status") == "ok"}
    if "notebook" in base.rows.columns:
        ok_in_base |= {str(n) for n in base.rows["notebook"].dropna().unique()}
    ok_in_base |= {str(n) for n in base.rows["lab"].unique()}
    return sorted(
        str(s.get("notebook")) for s in cand.status if s.get("status") != "ok" and s.get("notebook") in ok_in_base
    )


# ---------------------------------------------------------------- text
def row_label(r) -> str:
    parts = [r["lab"], r["experiment"], r["variant"]]
    tail = " ".join(x for x in (r["shape"], r["dtype"], f"[{r['ident']}]" if r.get("ident") else "") if x)
    stat = r["statistic"] if r["statistic"] not in ("value", "") else ""
    lab = "/".join(str(p) for p in parts if p)
    metric = r["metric"] + (f"[{stat}]" if stat else "") + (f" #{r['occurrence']}" if r["occurrence"] > 1 else "")
    return f"{lab} {tail} {metric}".replace("  ", " ").strip()


def _num(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return f"{float(v):.4g}"


def _ratio_text(r) -> str:
    if r["unit"] == "dB" and math.isfinite(r["base"]) and math.isfinite(r["candidate"]):
        return f"{r['candidate'] - r['base']:+.2f} dB"
    if not math.isfinite(r["ratio"]) and not (isinstance(r["ratio"], float) and math.isinf(r["ratio"])):
        return ""
    s = f"x{_num(r['ratio'])}"
    if math.isfinite(r["lo"]) and math.isfinite(r["hi"]):
        # interval shown in the same orientation as the ratio (candidate / base)
        lo, hi = (1 / r["hi"], 1 / r["lo"]) if r["better"] == "lower" else (r["lo"], r["hi"])
        s += f" [{lo:.3g}, {hi:.3g}]"
    return s


def _side_line(s: Side) -> str:
    c = s.context
    bits = [
        f"{c.get('device') or '?'} ({c.get('device_kind') or '?'})",
        f"torch {c.get('torch_version') or '?'}",
        f"triton {c.get('triton_version') or '?'}",
    ]
    if c.get("cuda_version"):
        bits.append(f"CUDA {c['cuda_version']}")
    bits.append(f"commit {c.get('commit') or '?'}")
    return f"{s.source} [{s.run_id}]: " + ", ".join(bits)


def summary_text(cmp: Comparison, limit: int = 40) -> str:
    o = cmp.options
    noise = (
        f"{int(o.confidence * 100)}% bootstrap interval of the ratio of medians ({o.bootstrap} resamples)"
        if o.method == "bootstrap"
        else f"Mann-Whitney U test at p < {1 - o.confidence:.3g}"
    )
    lines = [
        "perflab compare",
        f"  base:      {_side_line(cmp.base)}",
        f"  candidate: {_side_line(cmp.cand)}",
        f"  rule:      a verdict needs the difference beyond the threshold (±{o.threshold:.0%} performance "
        f"and memory, ±{o.accuracy_threshold:.0%} error figures, ±{o.db_threshold:g} dB) and, where samples "
        f"were kept, significant by the {noise}",
    ]
    if cmp.flags:
        lines.append("flags:")
        lines += [f"  ! {f}" for f in cmp.flags]
    counts = cmp.counts()
    lines.append("verdicts: " + (", ".join(f"{v} {k}" for k, v in counts.items()) or "no rows"))

    def section(title: str, df: pd.DataFrame):
        if not len(df):
            return
        lines.append(f"{title} ({len(df)}):")
        for _, r in df.head(limit).iterrows():
            unit = f" {r['unit']}" if r["unit"] else ""
            lines.append(
                f"  {row_label(r)}: {_num(r['base'])} -> {_num(r['candidate'])}{unit}  {_ratio_text(r)}  "
                f"{r['verdict'].upper()}" + (f" ({r['note']})" if r["note"] else "")
            )
        if len(df) > limit:
            lines.append(f"  ... {len(df) - limit} more (see compare.html / compare.json)")

    rows = cmp.rows
    section("REGRESSIONS beyond threshold", cmp.regressions)
    if len(rows):
        section("worse but not gated", rows[rows["verdict"].isin(WORSE_VERDICTS) & ~rows["regression"]])
        section("improvements", cmp.improvements)
        section("possible changes, not confident (not gated)", rows[rows["note"].str.startswith("possibly")])
        section("changed (no better direction)", rows[rows["verdict"] == "changed"])
        section("not compared: device differs", rows[rows["verdict"] == "device differs"])
        section("only in base", rows[rows["verdict"] == "only in base"])
        section("only in candidate", rows[rows["verdict"] == "only in candidate"])
        section("no value", rows[rows["verdict"].isin(("no value", "failed both"))])
    lines.append("result: " + cmp.result_line())
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- HTML
VERDICT_COLOURS = {
    "faster": "#1a7f37",
    "more accurate": "#1a7f37",
    "less memory": "#1a7f37",
    "fixed": "#1a7f37",
    "slower": "#cf222e",
    "less accurate": "#cf222e",
    "more memory": "#cf222e",
    "failed": "#cf222e",
    "same": "#6e7781",
    "changed": "#9a6700",
    "device differs": "#9a6700",
}

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em;color:#222;max-width:1400px}
table{border-collapse:collapse;margin:1em 0;font-size:90%}td,th{border:1px solid #ccc;padding:3px 7px;text-align:left;
vertical-align:top}th{background:#f3f3f3}th.sortable{cursor:pointer;user-select:none}th.sortable:after{content:" \\2195";
color:#999}td.num{text-align:right;font-variant-numeric:tabular-nums}.flag{color:#9a6700}.bad{color:#cf222e;
font-weight:600}.good{color:#1a7f37;font-weight:600}.muted{color:#666}code{font-family:ui-monospace,Menlo,monospace}
#filter{padding:4px;width:30em}
"""

_JS = """
(function(){
  function cellValue(td){ var v = td.getAttribute('data-v'); if (v === null) v = td.textContent.trim();
    var n = parseFloat(v); return (v !== '' && !isNaN(n) && isFinite(v)) ? n : v.toLowerCase(); }
  document.querySelectorAll('table.sortable').forEach(function(table){
    table.querySelectorAll('th').forEach(function(th, col){
      th.classList.add('sortable');
      th.addEventListener('click', function(){
        var tbody = table.tBodies[0], rows = Array.prototype.slice.call(tbody.rows);
        var asc = th.getAttribute('data-dir') !== 'asc';
        table.querySelectorAll('th').forEach(function(h){ h.removeAttribute('data-dir'); });
        th.setAttribute('data-dir', asc ? 'asc' : 'desc');
        rows.sort(function(a, b){ var x = cellValue(a.cells[col]), y = cellValue(b.cells[col]);
          if (typeof x === typeof y) return (x < y ? -1 : x > y ? 1 : 0) * (asc ? 1 : -1);
          return (typeof x === 'number' ? -1 : 1) * (asc ? 1 : -1); });
        rows.forEach(function(r){ tbody.appendChild(r); });
      });
    });
  });
  var f = document.getElementById('filter');
  if (f) f.addEventListener('input', function(){ var q = f.value.toLowerCase();
    document.querySelectorAll('#rows tbody tr').forEach(function(tr){
      tr.style.display = tr.textContent.toLowerCase().indexOf(q) >= 0 ? '' : 'none'; }); });
})();
"""


def _ratio_plot(cmp: Comparison, max_rows: int = 300):
    """Bokeh plot of the oriented gain (> 1: candidate better) with its interval, one row per key."""
    from bokeh.models import BoxAnnotation, ColumnDataSource, HoverTool, Span
    from bokeh.plotting import figure

    df = cmp.rows
    if not len(df):
        return None
    df = df[np.isfinite(df["gain"].astype(float)) & (df["gain"].astype(float) > 0)].copy()
    if not len(df):
        return None
    df["_dev"] = np.abs(np.log(df["gain"].astype(float)))
    if len(df) > max_rows:
        df = df.sort_values("_dev", ascending=False).head(max_rows)
    df = df.sort_values(["lab", "experiment", "variant", "shape", "dtype", "metric"], ascending=False)
    labels = [row_label(r) for _, r in df.iterrows()]
    # labels must be unique factors
    seen: dict[str, int] = {}
    uniq = []
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
        uniq.append(lab if seen[lab] == 1 else f"{lab} ({seen[lab]})")
    lo = df["lo"].astype(float).where(np.isfinite(df["lo"].astype(float)), df["gain"].astype(float))
    hi = df["hi"].astype(float).where(np.isfinite(df["hi"].astype(float)), df["gain"].astype(float))
    src = ColumnDataSource(
        dict(
            label=uniq,
            gain=df["gain"].astype(float).tolist(),
            lo=lo.tolist(),
            hi=hi.tolist(),
            verdict=df["verdict"].tolist(),
            base=df["base"].astype(float).tolist(),
            cand=df["candidate"].astype(float).tolist(),
            unit=df["unit"].tolist(),
            noise=df["noise"].tolist(),
            colour=[VERDICT_COLOURS.get(v, "#6e7781") for v in df["verdict"]],
        )
    )
    vals = np.concatenate([lo.to_numpy(), hi.to_numpy(), df["gain"].astype(float).to_numpy()])
    t = cmp.options.threshold
    xmin = min(float(vals.min()), 1 / (1 + t)) / 1.15
    xmax = max(float(vals.max()), 1 + t) * 1.15
    p = figure(
        y_range=uniq,
        x_axis_type="log",
        x_range=(xmin, xmax),
        height=max(220, 24 * len(uniq) + 90),
        width=1100,
        title="candidate vs base: gain (> 1 = candidate better), with interval",
        x_axis_label="gain = base/candidate for lower-is-better, candidate/base for higher-is-better (dB: 10^(Δ/10))",
        tools="pan,wheel_zoom,box_zoom,reset,save",
        toolbar_location="above",
    )
    p.add_layout(BoxAnnotation(left=1 / (1 + t), right=1 + t, fill_alpha=0.12, fill_color="#6e7781"))
    p.add_layout(Span(location=1, dimension="height", line_color="black", line_dash="dashed"))
    p.segment(x0="lo", x1="hi", y0="label", y1="label", source=src, line_color="colour", line_width=3)
    r = p.scatter(x="gain", y="label", source=src, size=9, fill_color="colour", line_color="black")
    p.add_tools(
        HoverTool(
            renderers=[r],
            tooltips=[
                ("row", "@label"),
                ("verdict", "@verdict"),
                ("base", "@base{0.0000g} @unit"),
                ("candidate", "@cand{0.0000g} @unit"),
                ("gain", "@gain{0.000} [@lo{0.000}, @hi{0.000}]"),
                ("noise", "@noise"),
            ],
        )
    )
    p.yaxis.major_label_text_font_size = "9pt"
    return p


def _inline_bokeh(Resources) -> str:
    """BokehJS inline.  Once panel has been imported in the process it registers its own
    extension scripts by relative URL (e.g. es-module-shims); this page uses none of them,
    so any <script src=...> is dropped to keep the page self-contained."""
    import re

    return re.sub(r"<script[^>]*\bsrc=[^>]*>\s*</script>", "", Resources(mode="inline", components=["bokeh"]).render())


def render_html(cmp: Comparison) -> str:
    """One self-contained page: BokehJS inline, no request to anything outside the file."""
    from bokeh.embed import components
    from bokeh.resources import Resources

    esc = html.escape
    o = cmp.options
    plot = _ratio_plot(cmp)
    script, div = components(plot) if plot is not None else ("", "<p class='muted'>no comparable rows to plot</p>")
    ctx_rows = ""
    for k in (
        "device",
        "device_kind",
        "torch_version",
        "triton_version",
        "cuda_version",
        "python_version",
        "commit",
        "timestamp",
        "run_id",
    ):
        b, c = cmp.base.context.get(k, ""), cmp.cand.context.get(k, "")
        cls = ' class="flag"' if str(b) != str(c) and k not in ("timestamp", "run_id") else ""
        ctx_rows += f"<tr{cls}><th>{esc(k)}</th><td>{esc(str(b))}</td><td>{esc(str(c))}</td></tr>"
    ctx_rows += f"<tr><th>source</th><td>{esc(cmp.base.source)}</td><td>{esc(cmp.cand.source)}</td></tr>"
    flags = "".join(f'<li class="flag">{esc(f)}</li>' for f in cmp.flags) or "<li class='muted'>none</li>"
    counts = ", ".join(f"{v} {esc(k)}" for k, v in cmp.counts().items()) or "no rows"
    body = []
    for _, r in cmp.rows.iterrows():
        colour = VERDICT_COLOURS.get(r["verdict"], "#6e7781")
        lo_hi = ""
        if math.isfinite(r["lo"]) and math.isfinite(r["hi"]):
            lo_hi = f"[{r['lo']:.3g}, {r['hi']:.3g}]"

        def num(v, cls="num"):
            fv = float(v) if v is not None else math.nan
            dv = "" if math.isnan(fv) else (repr(fv) if math.isfinite(fv) else ("1e308" if fv > 0 else "-1e308"))
            return f'<td class="{cls}" data-v="{dv}">{_num(fv)}</td>'

        body.append(
            f'<tr data-verdict="{esc(r["verdict"])}">'
            + "".join(
                f"<td>{esc(str(r[c]))}</td>"
                for c in ("lab", "experiment", "variant", "shape", "dtype", "ident", "metric", "statistic")
            )
            + num(r["base"])
            + num(r["candidate"])
            + f"<td>{esc(r['unit'])}</td>"
            + num(r["ratio"])
            + num(r["gain"])
            + f"<td>{lo_hi}</td><td>{esc(r['noise'])}</td>"
            + f'<td style="color:{colour};font-weight:600">{esc(r["verdict"])}'
            + (" ⚑" if r["regression"] else "")
            + f"</td><td>{esc(r['note'])}</td></tr>"
        )
    dir_rows = "".join(
        f"<tr><td><code>{esc(d['rule'])}</code></td><td>{d['better']}</td><td>{d['kind']}</td>"
        f"<td>{d['compared by']}</td></tr>"
        for d in direction_table()
    )
    result_cls = "bad" if cmp.exit_code else "good"
    noise = (
        f"{int(o.confidence * 100)}% bootstrap interval of the ratio of medians ({o.bootstrap} resamples, fixed seed)"
        if o.method == "bootstrap"
        else f"Mann-Whitney U test, p &lt; {1 - o.confidence:.3g}"
    )
    title = f"perflab compare: {cmp.cand.run_id} vs {cmp.base.run_id}"
    return f"""<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>{_CSS}</style>
{_inline_bokeh(Resources)}
</head><body>
<h1>{esc(title)}</h1>
<p class="{result_cls}">{esc(cmp.result_line())}</p>
<p>Verdicts: {counts}.</p>
<p class="muted">A verdict other than <i>same</i> needs the difference beyond the threshold (±{o.threshold:.0%}
performance and memory, ±{o.accuracy_threshold:.0%} error figures, ±{o.db_threshold:g} dB) and, where samples were
kept, significance by the {noise}. GB/s, TFLOP/s and % of ceiling borrow their time row's interval.
<i>gain</i> &gt; 1 means the candidate is better; <i>ratio</i> is candidate / base.</p>
<h2>Flags</h2><ul>{flags}</ul>
<h2>Runs</h2><table><tr><th></th><th>base</th><th>candidate</th></tr>{ctx_rows}</table>
<h2>Gains with intervals</h2>
{div}
<h2>Rows</h2>
<p><input id="filter" placeholder="filter rows (any text)"> <span class="muted">click a column header to sort</span></p>
<table id="rows" class="sortable"><thead><tr><th>lab</th><th>experiment</th><th>variant</th><th>shape</th><th>dtype</th>
<th>extra</th><th>metric</th><th>statistic</th><th>base</th><th>candidate</th><th>unit</th><th>ratio</th><th>gain</th>
<th>interval (gain)</th><th>noise</th><th>verdict</th><th>note</th></tr></thead>
<tbody>{"".join(body)}</tbody></table>
<details><summary><b>Which way is better</b> (first matching rule)</summary>
<table><tr><th>rule</th><th>better</th><th>kind</th><th>compared by</th></tr>{dir_rows}</table></details>
{script}
<script>{_JS}</script>
</body></html>"""


# ---------------------------------------------------------------- CLI
def _add_compare_options(ap: argparse.ArgumentParser) -> None:
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
        "--out",
        default=None,
        help="folder for compare.html, summary.txt, compare.json (default .perflab/compare/<candidate>-vs-<base>/)",
    )
    ap.add_argument("--limit", type=int, default=40, help="rows per section in the printed summary")
    ap.add_argument("--quiet", action="store_true", help="print only the result line")


def _options_from(a) -> Options:
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
    )


def _default_out(cmp: Comparison) -> Path:
    return ROOT / ".perflab" / "compare" / f"{_slug(cmp.cand.run_id)}-vs-{_slug(cmp.base.run_id)}"


def _finish(cmp: Comparison, a, prog: str) -> int:
    paths = cmp.write(a.out or _default_out(cmp))
    if a.quiet:
        print(cmp.result_line())
    else:
        print(cmp.summary_text(limit=a.limit), end="")
    print(f"{prog}: wrote {paths['html']} (and summary.txt, compare.json)")
    return cmp.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """``perflab compare BASE CANDIDATE``; exit 0 ok, 1 regression, 2 bad input, 3 not comparable."""
    from ..config import ConfigError

    ap = argparse.ArgumentParser(
        prog="perflab compare",
        description="Compare a candidate run with a base run row by row; exit 1 on a regression beyond the threshold. "
        "BASE / CANDIDATE: a report folder, a records.json/.parquet, 'latest' or 'baseline[:KIND]'.",
        epilog="exit codes: 0 no regression, 1 regression, 2 bad arguments or inputs, 3 devices differ "
        "(performance rows not compared)",
    )
    ap.add_argument("base")
    ap.add_argument("candidate")
    _add_compare_options(ap)
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cmp = compare(a.base, a.candidate, _options_from(a))
    except (CompareError, ConfigError) as e:
        print(f"perflab compare: {e}", file=sys.stderr)
        return EXIT_USAGE
    return _finish(cmp, a, "perflab compare")


# ---------------------------------------------------------------- baselines
PERFORMANCE_KINDS = ("performance", "memory")


def timing_free(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows that do not depend on machine load: accuracy figures, counts, shapes."""
    keep = [direction(m, u).kind not in PERFORMANCE_KINDS for m, u in zip(rows["metric"], rows["unit"].fillna(""))]
    return rows[keep]


def store_baseline(
    report: str | Path,
    *,
    kind: str | None = None,
    timing_free_only: bool = False,
    allow_failed: bool = False,
    root: Path | None = None,
    command: str = "",
) -> Path:
    """Copy a finished report's records into ``parameterized/baselines/<kind>/``."""
    from ..records import load_records

    report = Path(report)
    if not report.is_dir() or not ((report / "records.json").exists() or (report / "records.parquet").exists()):
        raise CompareError(f"{report} is not a finished report folder (no records.json / records.parquet)")
    ctx = json.loads((report / "context.json").read_text()) if (report / "context.json").exists() else {}
    status = json.loads((report / "status.json").read_text()) if (report / "status.json").exists() else []
    failed = [s.get("notebook") for s in status if s.get("status") != "ok"]
    if failed and not allow_failed:
        raise CompareError(
            f"{report}: notebook(s) failed ({', '.join(map(str, failed))}); a baseline must come from "
            f"a clean run (or pass --allow-failed)"
        )
    rows = load_records(report)
    if not ctx.get("device_kind"):
        ctx["device_kind"] = _first_value(rows, "device_kind")
        ctx["device"] = _first_value(rows, "device")
    kind = kind or baseline_kind(ctx)
    if timing_free_only:
        rows = timing_free(rows)
    rows = rows.copy()
    if "samples" in rows.columns:
        rows["samples"] = [
            None
            if s is None or (isinstance(s, float) and math.isnan(s))
            else [float(x) for x in np.asarray(s, dtype=float).ravel()]
            for s in rows["samples"]
        ]
    dest = (root or baselines_root()) / kind
    tmp = dest.with_name(f".tmp-{kind}")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / "records.json").write_text(rows.to_json(orient="records", indent=0) + "\n")
    keep_ctx = {k: v for k, v in ctx.items() if k not in ("notebooks",)}
    (tmp / "context.json").write_text(json.dumps(keep_ctx, indent=1, default=str) + "\n")
    (tmp / "status.json").write_text(json.dumps(status, indent=1) + "\n")
    meta = {
        "kind": kind,
        "run_id": ctx.get("run_id") or report.name,
        "suite": ctx.get("suite"),
        "device": ctx.get("device"),
        "timing_free": timing_free_only,
        "rows": int(len(rows)),
        "stored": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": str(report),
        "command": command or "perflab baseline refresh",
    }
    (tmp / "baseline.json").write_text(json.dumps(meta, indent=1) + "\n")
    if dest.exists():
        import shutil

        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def _run_suite(suite: str, params: list[str] | None, out: str | None, only: list[str] | None = None):
    from .runner import parse_overrides, run_suite

    return run_suite(suite, overrides=parse_overrides(params), out_dir=out, only=only)


def baseline_main(argv: Sequence[str] | None = None) -> int:
    """``perflab baseline refresh|check|show``."""
    from ..config import ConfigError

    ap = argparse.ArgumentParser(
        prog="perflab baseline", description="Stored baselines per device kind in parameterized/baselines/<kind>/."
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser(
        "refresh", help="run a suite (or take a finished report) and store it as this device kind's baseline"
    )
    r.add_argument("--suite", default="smoke")
    r.add_argument("--report", default=None, help="store this finished report instead of running the suite")
    r.add_argument("--param", action="append", metavar="KEY=VALUE", help="parameter override for the run")
    r.add_argument("--only", action="append", metavar="NOTEBOOK", help="run only this notebook of the suite")
    r.add_argument("--kind", default=None, help="baseline kind (default: cpu or cuda-<gpu model> of the run)")
    r.add_argument(
        "--timing-free",
        action="store_true",
        help="store only rows that do not depend on machine load (accuracy figures, counts)",
    )
    r.add_argument("--allow-failed", action="store_true", help="store even if some notebooks failed")
    r.add_argument("--out", default=None, help="reports folder for the run (default reports/)")
    c = sub.add_parser(
        "check", help="compare a fresh run (or --report) with the stored baseline; exit 1 on a regression"
    )
    c.add_argument("--suite", default="smoke")
    c.add_argument("--report", default=None, help="compare this finished report instead of running the suite")
    c.add_argument("--param", action="append", metavar="KEY=VALUE")
    c.add_argument(
        "--only",
        action="append",
        metavar="NOTEBOOK",
        help="run only this notebook of the suite (the baseline's other notebooks then show as 'only in base')",
    )
    c.add_argument("--kind", default=None, help="baseline kind (default: the candidate's)")
    c.add_argument("--run-out", default=None, help="reports folder for the fresh run (default reports/)")
    _add_compare_options(c)
    s = sub.add_parser("show", help="list stored baselines")
    s.add_argument("--kind", default=None)
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if a.cmd == "show":
            root = baselines_root()
            kinds = [a.kind] if a.kind else sorted(p.name for p in root.glob("*") if (p / "baseline.json").exists())
            if not kinds:
                print(f"no baselines under {root}")
            for k in kinds:
                f = root / k / "baseline.json"
                if not f.exists():
                    print(f"{k}: no baseline ({f} missing)")
                    continue
                m = json.loads(f.read_text())
                print(
                    f"{k}: {m.get('rows')} rows from run {m.get('run_id')} (suite {m.get('suite')}, "
                    f"{'timing-free' if m.get('timing_free') else 'full'}) on {m.get('device')}, stored "
                    f"{m.get('stored')}"
                )
            return EXIT_OK
        if a.cmd == "refresh":
            report = a.report
            if report is None:
                res = _run_suite(a.suite, a.param, a.out, a.only)
                report = res.path
                if not res.ok and not a.allow_failed:
                    print(
                        f"perflab baseline: the run {res.run_id} had failures; baseline not stored (see {res.index})",
                        file=sys.stderr,
                    )
                    return EXIT_REGRESSION
            cmdline = "perflab baseline refresh " + " ".join(argv if argv is not None else sys.argv[1:])
            dest = store_baseline(
                report,
                kind=a.kind,
                timing_free_only=a.timing_free,
                allow_failed=a.allow_failed,
                command=cmdline.strip(),
            )
            m = json.loads((dest / "baseline.json").read_text())
            print(f"perflab baseline: stored {m['rows']} rows of {m['run_id']} as {dest}")
            return EXIT_OK
        # check
        if a.report is None:
            res = _run_suite(a.suite, a.param, a.run_out, a.only)
            cand_ref = res.path
        else:
            cand_ref = a.report
        cand = load_side(cand_ref, "candidate")
        kind = a.kind or baseline_kind(cand.context)
        bdir = baselines_root() / kind
        if not (bdir / "baseline.json").exists():
            print(
                f"perflab baseline: no stored baseline for kind {kind!r} ({bdir}); create one with "
                f"`perflab baseline refresh`",
                file=sys.stderr,
            )
            return EXIT_USAGE
        base = load_side(bdir, "baseline")
        o = _options_from(a)
        if base.meta.get("timing_free") and o.only == "all":
            o = Options(**{**o.__dict__, "only": "accuracy"})
            print(f"perflab baseline: the {kind} baseline is timing-free: comparing accuracy rows only")
        cmp = compare(base, cand, o)
        return _finish(cmp, a, "perflab baseline check")
    except (CompareError, ConfigError) as e:
        print(f"perflab baseline: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # the runner's SuiteError etc.
        from .runner import SuiteError

        if isinstance(e, SuiteError):
            print(f"perflab baseline: {e}", file=sys.stderr)
            return EXIT_USAGE
        raise
