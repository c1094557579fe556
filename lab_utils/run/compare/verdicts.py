"""One merged row's verdict, in stages: present on one side only (a ranked list's item by the
top-N rule), failed, skipped on both sides, not comparable (device or context), no value (a
row skipped on one side only is one: a NaN against a figure), then the gain and its noise
(an error figure on its tolerance or roundoff scale); per-time rows without samples borrow the
noise of their time row once every row has been seen (:class:`RowJudge`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from lab_utils.core.records import RANKED_LIST
from lab_utils.run.compare.coverage import ContextDiff
from lab_utils.run.compare.options import Options
from lab_utils.run.compare.rules import (
    NOT_COMPARABLE,
    PER_TIME_SUFFIXES,
    SKIPPED,
    Direction,
    direction,
    error_scale,
    extra_dict,
    judge_error,
    judge_membership,
    ranked_member,
    skipped_row,
)
from lab_utils.run.compare.stats import NO_SAMPLES_NOTE, bootstrap_ratio, judge, rank_pvalues

#: the note of a row both sides kept samples of that no ratio of samples can use (a value of zero, a dB figure)
UNUSABLE_SAMPLES_NOTE = "samples kept but not usable for a ratio"

#: the fields that tell one case apart: a time row and its per-time rows share them
GROUP_COLS = ["lab", "experiment", "variant", "shape", "dtype", "ident", "occurrence"]


def kind_selected(kind: str, only: str) -> bool:
    if only == "all":
        return True
    if only == "performance":
        return kind in ("performance", "memory", "reported")
    return kind in ("accuracy", "other")


def row_label_short(r) -> str:
    return f"{r['lab']} {r['experiment']}/{r['variant']} {r['shape']} {r['metric']}".strip()


def stable_flag(v) -> bool | None:
    """True / False / None (not a timing, or not judged) from a merged column's value."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return bool(v)


def reason_text(v) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)


def row_base(r) -> tuple[dict, Direction]:
    """The output row of merged row ``r`` before any verdict, and its metric's direction."""
    unit = next((u for u in (r.get("unit_b"), r.get("unit_c")) if isinstance(u, str) and u), "")
    extra = next((e for e in (r.get("extra_b"), r.get("extra_c")) if isinstance(e, str) and e), "")
    d = direction(r["metric"], unit, extra)
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
        base_stable=stable_flag(r.get("stable_b")),
        cand_stable=stable_flag(r.get("stable_c")),
        base_stability=reason_text(r.get("stability_b")),
        cand_stability=reason_text(r.get("stability_c")),
        base_samples=None,
        cand_samples=None,
    ), d


def point_gain(d: Direction, vb: float, vc: float) -> tuple[float, float, float | None]:
    """(gain, ratio, delta) of two finite values: gain > 1 is better for the candidate; delta
    (candidate - base) only for dB figures, whose gain is a power ratio."""
    delta = None
    if d.scale == "db":
        delta = vc - vb
        ratio = vc / vb if vb != 0 else math.nan
        gain = 10 ** ((delta if d.better == "higher" else -delta) / 10)
    elif vb == 0 or vc == 0:
        if vb == vc:
            gain, ratio = 1.0, 1.0
        else:
            ratio = math.inf if vb == 0 else 0.0
            worse = (vc > vb) if d.better == "lower" else (vc < vb)
            gain = 0.0 if worse else math.inf
    else:
        ratio = vc / vb
        gain = vb / vc if d.better == "lower" else vc / vb
    return gain, ratio, delta


def sample_interval(sb, sc, d: Direction, o: Options) -> tuple[float, float, float, float]:
    """(lo, hi, p_worse, p_better) of the gain from both sides' samples."""
    rlo, rhi = bootstrap_ratio(sb, sc, n=o.bootstrap, confidence=o.confidence)
    lo, hi = (1 / rhi, 1 / rlo) if d.better == "lower" else (rlo, rhi)
    pw = pb = math.nan
    if o.method == "rank":
        thr = o.accuracy_threshold if d.kind == "accuracy" else o.threshold
        pw, pb = rank_pvalues(sb, sc, 1 + thr, d.better)
    return lo, hi, pw, pb


@dataclass
class RowJudge:
    """Judges the merged rows of one comparison, in order (:meth:`rows`)."""

    o: Options
    cdiff: ContextDiff
    mismatch: bool
    not_run: list[str]
    #: (group + metric) of a time row -> (gain, lo, hi, p_worse, p_better), for its per-time rows
    time_gain: dict[tuple, tuple[float, float, float, float, float]] = field(default_factory=dict)
    #: per-time rows without samples, judged once every time row is known
    pending: list = field(default_factory=list)
    #: (ranked list, side) -> (distinct items, share of its lightest item or None): ``list_cutoffs``
    lists: dict[tuple, tuple[int, float | None]] = field(default_factory=dict)

    def rows(self, m: pd.DataFrame) -> list[dict]:
        out = []
        self.lists = list_cutoffs(m)
        for _, r in m.iterrows():
            row, d = row_base(r)
            if not kind_selected(d.kind, self.o.only):
                continue
            out.append(row)
            if (
                self.one_sided(row, r)
                or self.failed(row, r)
                or self.skipped_both(row, r)
                or self.not_comparable(row, r, d)
            ):
                continue
            self.measured(row, r, d)
        for row, d, delta, r in self.pending:
            self.derived(row, d, delta, r)
        return out

    def one_sided(self, row: dict, r) -> bool:
        if r["_merge"] not in ("left_only", "right_only"):
            return False
        left = r["_merge"] == "left_only"
        member = ranked_member(r["extra_b"] if left else r["extra_c"])
        if member is not None and r["lab"] not in self.not_run:
            n, cutoff = self.lists.get((list_key(r, r["extra_b"] if left else r["extra_c"]), not left), (0, None))
            verdict, note = judge_membership(member, left, cutoff if n >= member.n else 0.0)
            row.update(
                verdict=verdict,
                note=note,
                base=r["value_b"] if left else math.nan,
                candidate=math.nan if left else r["value_c"],
            )
            return True
        why = (
            "the lab did not run in the candidate"
            if r["lab"] in self.not_run
            else self.cdiff.explain_one_sided(r["lab"])
        )
        row.update(
            verdict="only in base" if left else "only in candidate",
            note=("missing in candidate" if left else "new in candidate") + (f": {why}" if why else ""),
            base=r["value_b"] if left else math.nan,
            candidate=math.nan if left else r["value_c"],
        )
        return True

    @staticmethod
    def failed(row: dict, r) -> bool:
        fb, fc = bool(r["failed_b"]), bool(r["failed_c"])
        if not (fb or fc):
            return False
        v = {(True, True): "failed both", (False, True): "failed", (True, False): "fixed"}[(fb, fc)]
        row.update(
            verdict=v,
            note="ran in base, failed in candidate"
            if v == "failed"
            else ("failed in base, runs in candidate" if v == "fixed" else ""),
        )
        return True

    @staticmethod
    def skipped_both(row: dict, r) -> bool:
        """A row its lab skipped in both runs: nothing was measured to compare (never gated)."""
        if not (skipped_row(r.get("extra_b")) and skipped_row(r.get("extra_c"))):
            return False
        row.update(verdict=SKIPPED, note="skipped in base and candidate: nothing to compare")
        return True

    def not_comparable(self, row: dict, r, d: Direction) -> bool:
        if self.mismatch and d.kind in ("performance", "memory") and not self.o.allows("device"):
            row.update(verdict="device differs", note="not compared: runs on different devices")
            return True
        blockers = self.cdiff.blockers(r["lab"], d.kind, r.get("extra_b"), r.get("extra_c"))
        blocked = self.cdiff.not_allowed(blockers)
        if blocked:
            self.cdiff.count_blocked(blocked, row_label_short(r))
            cats = ",".join(c for c, _ in blocked)
            row.update(
                verdict=NOT_COMPARABLE,
                note=f"not compared: {'; '.join(w for _, w in blocked)} (--allow-context-diff {cats} to compare)",
            )
            return True
        if blockers:
            row["note"] = "compared as asked although " + "; ".join(w for _, w in blockers)
        return False

    def measured(self, row: dict, r, d: Direction) -> None:
        """The verdict of a row present, run and comparable on both sides."""
        o = self.o
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
            return
        gain, row["ratio"], delta = point_gain(d, vb, vc)
        row["gain"] = gain
        have = sb is not None and sc is not None and sb.size >= o.min_samples and sc.size >= o.min_samples
        lo = hi = pw = pb = math.nan
        if have and d.scale == "ratio" and vb > 0 and vc > 0:
            lo, hi, pw, pb = sample_interval(sb, sc, d, o)
            row["noise"] = f"bootstrap {int(o.confidence * 100)}%" + (" + rank test" if o.method == "rank" else "")
            self.time_gain[tuple(r[c] for c in GROUP_COLS) + (r["metric"],)] = (gain, lo, hi, pw, pb)
        elif have:
            row["note"] = UNUSABLE_SAMPLES_NOTE
        if d.kind == "performance" and not have and r["metric"].endswith(PER_TIME_SUFFIXES):
            self.pending.append((row, d, delta, r))
            return
        if d.kind == "accuracy" and d.scale == "ratio" and d.better == "lower":
            scale = error_scale(r.get("extra_b"), r.get("extra_c"), r["dtype"]) if min(vb, vc) >= 0 else None
            if scale is not None:
                verdict, note = judge_error(vb, vc, gain, o.accuracy_threshold, scale)
                row.update(verdict=verdict, note=note)
                return
        verdict, note = judge(gain, lo, hi, pw, pb, d, o, delta=delta)
        if have and note == NO_SAMPLES_NOTE:  # judged by the threshold although samples were kept
            note = f"{UNUSABLE_SAMPLES_NOTE}: threshold only"
        if d.kind == "accuracy" and d.scale == "ratio":
            note = f"{note}; rule: threshold" if note else "rule: threshold"
        row.update(lo=lo, hi=hi, p_value=min(pw, pb), verdict=verdict, note=note or row["note"])

    def derived(self, row: dict, d: Direction, delta, r) -> None:
        """A per-time row (bytes or FLOPs per second) without samples: its interval follows
        the time row of the same case."""
        suffix = next(s for s in PER_TIME_SUFFIXES if r["metric"].endswith(s))
        tkey = tuple(r[c] for c in GROUP_COLS) + (r["metric"][: -len(suffix)] + "time",)
        lo = hi = pw = pb = math.nan
        if tkey in self.time_gain:
            tg, tlo, thi, tpw, tpb = self.time_gain[tkey]
            g = row["gain"]
            if math.isfinite(g) and g > 0 and tg > 0:
                # same bytes (flops) over the same times: the ratio moves with the time's ratio
                lo, hi, pw, pb = g * tlo / tg, g * thi / tg, tpw, tpb
                row["noise"] = "from the time row's samples"
        verdict, note = judge(row["gain"], lo, hi, pw, pb, d, self.o, delta=delta)
        row.update(lo=lo, hi=hi, p_value=min(pw, pb), verdict=verdict, note=note)


#: the fields a ranked list's rows share (their items differ in variant or metric)
LIST_FIELDS = ("lab", "shape", "dtype", "statistic")


def list_key(r, extra) -> tuple:
    """A ranked list's name: its ``list`` from ``extra`` (default: the row's experiment), lab,
    shape, dtype and statistic."""
    name = extra_dict(extra).get(RANKED_LIST) or r["experiment"]
    return (str(name),) + tuple(str(r[c]) for c in LIST_FIELDS)


def list_cutoffs(m: pd.DataFrame) -> dict[tuple, tuple[int, float | None]]:
    """For each ranked list on each side (True: base): how many distinct items it holds and the
    share of its lightest one (None when an item has no share)."""
    items: dict[tuple, dict[tuple, float | None]] = {}
    for side, suffix, present in ((True, "_b", ("both", "left_only")), (False, "_c", ("both", "right_only"))):
        for _, r in m[m["_merge"].isin(present)].iterrows():
            member = ranked_member(r["extra" + suffix])
            if member is None:
                continue
            items.setdefault((list_key(r, r["extra" + suffix]), side), {})[(r["variant"], r["metric"])] = member.share
    out = {}
    for k, shares in items.items():
        vals = list(shares.values())
        out[k] = (len(shares), None if any(v is None for v in vals) else min(vals))
    return out
