"""The comparison: options, flags, gating and the exit code; each row's verdict is in ``verdicts``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from lab_utils.core.records import StabilitySummary, stability_summary
from lab_utils.run.compare.coverage import (
    ContextDiff,
    context_diff,
    context_flags,
    failed_labs,
    labs_of,
    narrow_both,
    newly_failed,
)
from lab_utils.run.compare.html import render_html
from lab_utils.run.compare.options import Options
from lab_utils.run.compare.rules import (
    EXIT_INCOMPARABLE,
    EXIT_OK,
    EXIT_REGRESSION,
    KEY,
    MEMBERSHIP_VERDICTS,
    NOISY,
    NOT_COMPARABLE,
    QUANTILE_STATISTICS,
    SIDE_CONTEXT_KEYS,
    SKIPPED,
    WORSE_VERDICTS,
)
from lab_utils.run.compare.sides import Side, identity_by_group, load_side, with_identity
from lab_utils.run.compare.text import summary_text
from lab_utils.run.compare.verdicts import UNUSABLE_SAMPLES_NOTE, RowJudge, stable_flag

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
    "base_stable",
    "cand_stable",
    "base_stability",
    "cand_stability",
    "base_samples",
    "cand_samples",
    "missing",
]


@dataclass
class Comparison:
    base: Side
    cand: Side
    options: Options
    rows: pd.DataFrame  # one row per matched or one-sided key
    flags: list[str]
    device_mismatch: bool
    failed_notebooks: list[str] = field(default_factory=list)  # ran in base, failed in candidate
    stability: dict[str, StabilitySummary] = field(default_factory=dict)  # side label -> its timings' stability
    missing_labs: list[str] = field(default_factory=list)  # labs of the base the candidate did not run
    context: ContextDiff | None = None  # how the runs differ in what their timings measure

    @property
    def too_noisy(self) -> dict[str, StabilitySummary]:
        """Sides whose share of unstable timings is over ``max_unstable_share`` (when
        performance rows are compared at all)."""
        if self.options.only == "accuracy":
            return {}
        return {k: v for k, v in self.stability.items() if v.share > self.options.max_unstable_share}

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
    def missing(self) -> pd.DataFrame:
        """Rows of the base missing from the candidate that fail the gate (see ``compare``)."""
        if "missing" not in self.rows.columns:
            return self.rows.iloc[:0]
        return self.rows[self.rows["missing"]]

    def failures(self) -> list[str]:
        """Why the gate fails (exit 1), one item each; empty when it does not."""
        gating = self.options.gate != "none"
        out = []
        if self.failed_notebooks and gating:
            out.append(f"notebook(s) that ran in the base failed in the candidate: {', '.join(self.failed_notebooks)}")
        if self.missing_labs and gating:
            out.append(
                f"lab(s) of the base that the candidate did not run: {', '.join(self.missing_labs)} "
                f"(--only LAB compares the labs that ran)"
            )
        m = self.missing
        if len(m):
            labs = ", ".join(sorted(set(m["lab"])))
            out.append(f"{len(m)} row(s) of the base missing from the candidate (in {labs})")
        return out

    def incomparable(self) -> list[str]:
        """Why part of the comparison could not be made (exit 3), one item each."""
        out = []
        if self.device_mismatch and (self.rows["verdict"] == "device differs").any():
            out.append(
                f"devices differ ({self.base.device} vs {self.cand.device}); performance rows were not compared "
                f"(--allow-device-mismatch to compare them)"
            )
        if self.context is not None:
            out += self.context.incomparable_reasons()
        if self.too_noisy:
            sides = "; ".join(f"{k}: {v}" for k, v in self.too_noisy.items())
            out.append(
                f"too many unstable timings ({sides}; limit {self.options.max_unstable_share:.0%}); their machine "
                f"was too busy to time on, performance rows were not gated"
            )
        return out

    @property
    def exit_code(self) -> int:
        if len(self.regressions) or self.failures():
            return EXIT_REGRESSION
        if self.incomparable():
            return EXIT_INCOMPARABLE
        return EXIT_OK

    def result_line(self) -> str:
        n = len(self.regressions)
        code = self.exit_code
        if code == EXIT_REGRESSION:
            why = "".join(f"; {f}" for f in self.failures())
            also = "".join(f"; also not comparable: {f}" for f in self.incomparable())
            return f"FAIL: {n} regression{'s' * (n != 1)} beyond threshold{why}{also} (exit {EXIT_REGRESSION})"
        if code == EXIT_INCOMPARABLE:
            return f"NOT COMPARABLE: {'; '.join(self.incomparable())} (exit {EXIT_INCOMPARABLE})"
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
            "base": side_json(self.base),
            "candidate": side_json(self.cand),
            "options": self.options.__dict__,
            "flags": self.flags,
            "counts": self.counts(),
            "exit_code": self.exit_code,
            "result": self.result_line(),
            "missing_labs": self.missing_labs,
            "failures": self.failures(),
            "not_comparable": self.incomparable(),
            "stability": {
                k: {"timings": v.timings, "unstable": v.unstable, "share": v.share, "examples": list(v.examples)}
                for k, v in self.stability.items()
            },
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


def side_json(s: Side) -> dict:
    keep = (*SIDE_CONTEXT_KEYS, "host", "notebooks")
    return {
        "label": s.label,
        "source": s.source,
        "context": {k: s.context.get(k) for k in keep if k in s.context},
        "meta": s.meta,
    }


def compare(base: Side | str | Path, cand: Side | str | Path, options: Options | None = None, **kw) -> Comparison:
    """Compare two runs.  ``base``/``cand``: a ``Side`` or anything ``load_side`` reads."""
    o = options or Options(**kw)
    if not isinstance(base, Side):
        base = load_side(base, "base")
    if not isinstance(cand, Side):
        cand = load_side(cand, "candidate")
    base, cand = narrow_both(base, cand, o.labs)
    flags, mismatch = context_flags(base, cand)
    cdiff = context_diff(base, cand, o, device_differs=bool(mismatch))
    flags += cdiff.flags_before()
    for side in (base, cand):
        if side.meta.get("interrupted"):
            flags.append(f"{side.label} is an interrupted run: {side.meta['interrupted']}")
    m, merge_flags = merge_sides(base, cand, o)
    flags += merge_flags
    not_run = sorted(labs_of(base, ran_only=True) - labs_of(cand))
    df = pd.DataFrame(RowJudge(o, cdiff, mismatch, not_run).rows(m), columns=OUT_COLUMNS)
    stability = {side.label: stability_summary(side.rows) for side in (base, cand)}
    too_noisy = o.only != "accuracy" and any(v.share > o.max_unstable_share for v in stability.values())
    flags += stability_flags(stability, o)
    if len(df):
        explained = {lab for lab in set(df["lab"]) if cdiff.param_categories(lab)}
        df = gate(df, o, too_noisy, not_gated=failed_labs(cand) | set(not_run) | explained)
    n_b, n_c = (df["verdict"] == "only in base").sum(), (df["verdict"] == "only in candidate").sum()
    if n_b or n_c:
        flags.append(f"{n_b} row(s) only in base, {n_c} only in candidate: listed, not compared")
    if not_run:
        flags.append(f"MISSING: lab(s) of the base that did not run in the candidate: {', '.join(not_run)}")
    flags += cdiff.flags_after()
    if "missing" not in df.columns:
        df["missing"] = pd.Series(dtype=bool)
    return Comparison(
        base=base,
        cand=cand,
        options=o,
        rows=df,
        flags=flags,
        device_mismatch=mismatch,
        failed_notebooks=newly_failed(base, cand),
        stability=stability,
        missing_labs=not_run,
        context=cdiff,
    )


def merge_sides(base: Side, cand: Side, o: Options) -> tuple[pd.DataFrame, list[str]]:
    """Both sides' rows matched on their key (outer join, ``_merge`` tells one-sided rows),
    and the flags that say how rows sharing a key were told apart."""
    flags = []
    b, c = base.rows, cand.rows
    if o.statistics == "default":
        b = b[~b["statistic"].isin(QUANTILE_STATISTICS)]
        c = c[~c["statistic"].isin(QUANTILE_STATISTICS)]
    by_group = identity_by_group(b, c)
    ids = sorted(set().union(*by_group.values()))
    b, c = with_identity(b, by_group), with_identity(c, by_group)
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
    return m, flags


def stability_flags(stability: dict[str, StabilitySummary], o: Options) -> list[str]:
    """One flag per side with unstable timings: noisy rows, or a run too noisy to gate."""
    flags = []
    for label, v in stability.items():
        if v.unstable:
            over = v.share > o.max_unstable_share
            flags.append(
                f"{label}: {v}"
                + (
                    f", over the limit of {o.max_unstable_share:.0%}: not comparable, performance rows not gated"
                    if over
                    else ": their rows are 'noisy', never slower or faster"
                )
            )
    return flags


#: the order rows are listed in: failures and regressions first, unchanged rows last
VERDICT_ORDER = {
    "failed": 0,
    "slower": 1,
    "less accurate": 1,
    "more memory": 1,
    "changed": 2,
    NOISY: 2,
    "device differs": 3,
    NOT_COMPARABLE: 3,
    "only in base": 4,
    "only in candidate": 5,
    "left the top N": 5,
    "entered the top N": 5,
    "disappeared": 1,
    "appeared": 1,
    "no value": 6,
    "failed both": 6,
    SKIPPED: 6,
    "faster": 7,
    "more accurate": 7,
    "less memory": 7,
    "fixed": 7,
    "same": 8,
}


def gate(df: pd.DataFrame, o: Options, too_noisy: bool, not_gated: set[str]) -> pd.DataFrame:
    """Mark noisy rows, the regressions, improvements and missing rows the gate counts, and
    sort.  ``not_gated``: labs whose one-sided rows are explained elsewhere (failed, not run,
    or run with other parameters)."""
    mark_noisy(df)
    gated = df["kind"].map(
        lambda k: (
            o.gate == "all"
            or (o.gate == "performance" and k in ("performance", "memory"))
            or (o.gate == "accuracy" and k == "accuracy")
        )
    )
    # a performance figure without kept samples has no noise estimate: shown, never gated
    # (a machine-load swing would fail the gate); deterministic accuracy figures do gate
    # (an item that entered or left a ranked list is judged by its share, not by a noise estimate)
    unmeasured_noise = (
        df["kind"].isin(("performance", "memory"))
        & (df["noise"] == "")
        & ~df["verdict"].isin(("failed", *MEMBERSHIP_VERDICTS))
    )
    unmeasured_worse = unmeasured_noise & df["verdict"].isin(WORSE_VERDICTS)
    # samples kept on both sides that no ratio could use (a value of zero): no noise estimate either
    kept = (df["n_base"] >= o.min_samples) & (df["n_cand"] >= o.min_samples)
    df.loc[unmeasured_worse & ~kept, "note"] = "no samples, so no noise estimate: not gated"
    df.loc[unmeasured_worse & kept, "note"] = f"{UNUSABLE_SAMPLES_NOTE}, so no noise estimate: not gated"
    df["regression"] = df["verdict"].isin(WORSE_VERDICTS) & gated & ~unmeasured_noise
    if too_noisy:  # timings of a run this noisy are no evidence; accuracy figures still gate
        df.loc[df["kind"] == "performance", "regression"] = False
    df["improvement"] = df["verdict"].isin(("faster", "more accurate", "less memory", "fixed"))
    # a row of the base that the candidate lacks fails the gate like a regression: a gate must not
    # pass by omission.  Not counted here: rows of a lab that failed (``failed_notebooks``) or did
    # not run at all (``missing_labs``), and rows of a lab whose parameters differ (explained by them)
    df["missing"] = (df["verdict"] == "only in base") & gated & ~df["lab"].isin(not_gated)
    df["_o"] = df["verdict"].map(VERDICT_ORDER).fillna(9)
    return (
        df.sort_values(["_o", "lab", "experiment", "variant", "shape", "dtype", "metric"], kind="stable")
        .drop(columns="_o")
        .reset_index(drop=True)
    )


#: verdicts a noisy timing does not override: they are about the row's presence or failure
KEEP_VERDICTS = (
    "failed",
    "fixed",
    "failed both",
    "only in base",
    "only in candidate",
    "device differs",
    NOT_COMPARABLE,
    "no value",
    SKIPPED,
    *MEMBERSHIP_VERDICTS,
)


def mark_noisy(df: pd.DataFrame) -> None:
    """Performance rows whose timing was unstable on either side get the verdict "noisy"
    (never slower/faster); the note names the side and the reason, and what the point
    estimate alone would have said."""
    for i in df.index:
        r = df.loc[i]
        if r["kind"] not in ("performance", "reported") or r["verdict"] in KEEP_VERDICTS:
            continue
        bad = [side for side in ("base", "cand") if stable_flag(r[f"{side}_stable"]) is False]
        if not bad:
            continue
        why = "; ".join(
            f"{'base' if side == 'base' else 'candidate'}: {r[f'{side}_stability'] or 'unstable'}" for side in bad
        )
        was = f" (the point estimate alone: {r['verdict']})" if r["verdict"] not in ("same", "") else ""
        df.at[i, "verdict"] = NOISY
        df.at[i, "note"] = f"unstable timing, not judged{was}: {why}"
