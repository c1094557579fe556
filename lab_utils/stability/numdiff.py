"""The numerics diff of two runs' telemetry: where they first differ beyond a tolerance.

:func:`numerics_diff` compares two runs' telemetry (frames or report records, as
:mod:`lab_utils.stability.telemetry` writes them) per block and statistic, and says where they first
differ beyond a tolerance.  Non-finite values are compared by class (NaN, +Inf, -Inf): finite
against non-finite is a full difference, and a row one run lacks at a step both recorded counts
as one too.  ``perflab numdiff A B`` prints it (:func:`run_numdiff`; its arguments: ``lab_utils.run.commands.numdiff``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from lab_utils.core.config import ConfigError, check_float
from lab_utils.core.records import load_records
from lab_utils.stability.telemetry import FRAME_COLUMNS, block_sort_key

#: Per statistic, the magnitude below which a difference is measured against this floor rather
#: than against the values: a fraction of lost updates of 0 in one run and 5e-5 in the other is
#: no divergence (|a-b| / max(|a|, |b|, floor) is 0.005, not 1).  Statistics not listed: DEFAULT_FLOOR.
ABS_FLOOR = {"lost_update_frac": 1e-2}
DEFAULT_FLOOR = 1e-6
KEYS = ["step", "block", "stream", "stat"]


def telemetry_frame(records: pd.DataFrame, variant: str | None = None) -> pd.DataFrame:
    """(step, block, stream, stat, value) from a telemetry frame or from report records
    (rows of experiment "telemetry", the step and block in ``extra``).  Non-finite values
    stay what they are (NaN, +Inf, -Inf)."""
    if set(FRAME_COLUMNS) <= set(records.columns):
        return records[FRAME_COLUMNS].copy()
    df = records[records["experiment"] == "telemetry"]
    if variant is not None:
        df = df[df["variant"] == variant]
    extra = [json.loads(e) if isinstance(e, str) and e else {} for e in df["extra"]]
    return pd.DataFrame(
        dict(
            step=[int(e.get("step", 0)) for e in extra],
            block=[e.get("block", "") for e in extra],
            stream=[e.get("stream", "") for e in extra],
            stat=list(df["metric"]),
            value=pd.to_numeric(df["value"], errors="coerce").astype(float).to_numpy(),
        ),
        columns=FRAME_COLUMNS,
    )


def rel_diff(a, b, floor=DEFAULT_FLOOR) -> np.ndarray:
    """|a-b| / max(|a|, |b|, floor), elementwise, with non-finite values decided by class: the
    same class in both (NaN and NaN, +Inf and +Inf, -Inf and -Inf) is no difference; a value
    finite in one and not in the other, or of another non-finite class (+Inf vs -Inf, NaN vs
    Inf), differs completely (1)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    floor = np.broadcast_to(np.asarray(floor, dtype=float), a.shape)
    fa, fb = np.isfinite(a), np.isfinite(b)
    both = fa & fb
    out = np.ones(a.shape)
    with np.errstate(invalid="ignore", divide="ignore"):
        den = np.maximum(np.maximum(np.abs(a), np.abs(b)), floor)
        out[both] = np.abs(a[both] - b[both]) / den[both]
    same_class = ~fa & ~fb & ((np.isnan(a) & np.isnan(b)) | (a == b))
    out[same_class] = 0.0
    out[both & (a == b)] = 0.0
    return out


@dataclass
class NumericsDiff:
    """Where two runs part: ``cells`` (step, block, stat, rel_diff), ``first`` (stat, block,
    first_step beyond tol or -1, max_rel_diff), ``origin`` {stat: (block, step)} of the
    earliest divergence (ties: the shallowest block).  ``one_sided``: rows (step, block, stream,
    stat, run) present in one run only, at a step both runs recorded (counted as a full
    difference); ``steps_only``: {"a": [...], "b": [...]} steps one run has and the other has
    not at all (left out: the runs differ in length or sampling there, not in numerics)."""

    tol: float
    cells: pd.DataFrame
    first: pd.DataFrame
    origin: dict[str, tuple[str, int]] = field(default_factory=dict)
    one_sided: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=[*KEYS, "run"]))
    steps_only: dict[str, list[int]] = field(default_factory=lambda: {"a": [], "b": []})
    shared: int = 0

    def lines(self, stats: Iterable[str] | None = None) -> list[str]:
        out = []
        for stat in stats or sorted(self.origin):
            if stat in self.origin:
                blk, step = self.origin[stat]
                out.append(f"{stat}: first beyond {self.tol:g} at step {step}" + (f" in {blk}" if blk else ""))
        return out


def numerics_diff(
    records_a: pd.DataFrame, records_b: pd.DataFrame, tol: float = 0.05, floors: dict[str, float] | None = None
) -> NumericsDiff:
    """Per block and statistic, the relative difference |a-b|/max(|a|,|b|,floor) of two runs'
    telemetry at every step (streams and head groups reduced by max; ``floors`` per statistic
    update :data:`ABS_FLOOR`), and the first step each (stat, block) exceeds ``tol``.

    Non-finite values count by class (:func:`rel_diff`): a step where one run went NaN or Inf
    and the other did not differs completely there.  A row present in one run only, at a step
    both runs recorded and for a series (block, stream, stat) both runs have, is a full
    difference too (a step skipped as non-finite has no update ratio; records written before
    non-finite values were kept lack the step's NaN rows).  Steps one run never recorded are
    left out and listed in ``steps_only``."""
    check_float("tol", tol, min=0, min_exclusive=True)
    fl = {**ABS_FLOOR, **(floors or {})}
    for k, v in fl.items():
        check_float(f"floor of {k}", v, min=0)
    a, b = telemetry_frame(records_a), telemetry_frame(records_b)
    a, b = a.drop_duplicates(KEYS, keep="last"), b.drop_duplicates(KEYS, keep="last")
    m = a.merge(b, on=KEYS, how="outer", suffixes=("_a", "_b"), indicator=True)
    steps_a, steps_b = set(a.step), set(b.step)
    series = ["block", "stream", "stat"]
    common_series = set(map(tuple, a[series].drop_duplicates().to_numpy())) & set(
        map(tuple, b[series].drop_duplicates().to_numpy())
    )
    in_both_steps = m.step.isin(steps_a & steps_b)
    in_both_series = pd.Series([tuple(x) in common_series for x in m[series].to_numpy()], index=m.index, dtype=bool)
    m = m[in_both_steps & in_both_series].copy()
    paired = m["_merge"] == "both"
    if not paired.any():
        raise ConfigError("records", f"{len(a)} and {len(b)} rows", "two telemetry runs sharing steps and blocks")
    floor = m["stat"].map(lambda st: fl.get(st, DEFAULT_FLOOR)).to_numpy(dtype=float)
    rel = rel_diff(m["value_a"].to_numpy(), m["value_b"].to_numpy(), floor)
    rel[~paired.to_numpy()] = 1.0  # a row one run has and the other has not
    m["rel_diff"] = rel
    one = m[~paired]
    one_sided = one[KEYS].assign(run=np.where(one["_merge"] == "left_only", "a", "b")).reset_index(drop=True)
    cells = m.groupby(["step", "block", "stat"], as_index=False)["rel_diff"].max()
    first_rows, origin = [], {}
    for (stat, blk), g in cells.groupby(["stat", "block"]):
        over = g[g["rel_diff"] > tol]
        first_rows.append(
            dict(
                stat=stat,
                block=blk,
                first_step=int(over["step"].min()) if len(over) else -1,
                max_rel_diff=float(g["rel_diff"].max()),
            )
        )
    first = pd.DataFrame(first_rows, columns=["stat", "block", "first_step", "max_rel_diff"])
    for stat, g in first[first.first_step >= 0].groupby("stat"):
        g = g.assign(key=[block_sort_key(x) for x in g.block]).sort_values(["first_step", "key"])
        origin[stat] = (str(g.iloc[0].block), int(g.iloc[0].first_step))
    order = sorted(first.block.unique(), key=block_sort_key)
    first = first.assign(_o=first.block.map({b: i for i, b in enumerate(order)})).sort_values(["stat", "_o"])
    return NumericsDiff(
        tol,
        cells,
        first.drop(columns="_o").reset_index(drop=True),
        origin,
        one_sided,
        {"a": sorted(int(x) for x in steps_a - steps_b), "b": sorted(int(x) for x in steps_b - steps_a)},
        int(paired.sum()),
    )


def unrelated_reasons(a: pd.DataFrame, b: pd.DataFrame) -> list[str]:
    """Why two runs' telemetry may not be worth diffing (empty when nothing says so).  ``a`` /
    ``b``: the runs' report records (experiment "telemetry", one variant each) or frames.
    A numerics diff means something between runs that differ in one setting from the same
    seed; runs of different experiments (another learning rate, number of steps), another
    shape, or with few shared steps and series differ in everything from step 0."""
    out = []

    def meta(r: pd.DataFrame, key: str) -> set:
        if key == "shape":
            return set(r["shape"].dropna().astype(str)) - {""} if "shape" in r.columns else set()
        if "extra" not in r.columns:
            return set()
        return {json.loads(e).get(key) for e in r["extra"] if isinstance(e, str) and e} - {None}

    for key, what in (("source", "experiment"), ("shape", "shape")):
        ma, mb = meta(a, key), meta(b, key)
        if ma and mb and ma != mb:
            out.append(
                f"A comes from {what} {', '.join(sorted(map(str, ma)))} and B from {what} "
                f"{', '.join(sorted(map(str, mb)))}: their settings differ in more than the one compared"
            )
    fa, fb = telemetry_frame(a), telemetry_frame(b)
    sa, sb = set(fa.step), set(fb.step)
    if sa and sb and len(sa & sb) < 0.5 * min(len(sa), len(sb)):
        out.append(f"A and B share {len(sa & sb)} of their {len(sa)} and {len(sb)} steps")
    ka = set(map(tuple, fa[["block", "stream", "stat"]].drop_duplicates().to_numpy()))
    kb = set(map(tuple, fb[["block", "stream", "stat"]].drop_duplicates().to_numpy()))
    if ka and kb and len(ka & kb) < 0.5 * min(len(ka), len(kb)):
        out.append(f"A and B share {len(ka & kb)} of their {len(ka)} and {len(kb)} series (block, stream, statistic)")
    return out


class _Refused(Exception):
    pass


def _load_variant(path: str, variant: str | None, side: str) -> pd.DataFrame:
    try:
        rec = load_records(path)
    except (OSError, ValueError) as e:
        raise _Refused(f"cannot read records from {path}: {e}") from None
    tel = rec[rec["experiment"] == "telemetry"] if "experiment" in rec.columns else rec.iloc[0:0]
    if tel.empty:
        raise _Refused(
            f"{path} has no telemetry records (lab 07 writes them: record_runs(..., telemetry=True)); "
            "nothing to compare"
        )
    names = sorted(tel["variant"].unique())
    if variant is None:
        if len(names) != 1:
            raise _Refused(f"{path} holds telemetry variants {names}; choose one with --{side}")
        variant = names[0]
    elif variant not in names:
        raise _Refused(f"{path} has no telemetry variant {variant!r} (it has {names})")
    return tel[tel["variant"] == variant]


def run_numdiff(
    a: str,
    b: str,
    *,
    variant_a: str | None = None,
    variant_b: str | None = None,
    tol: float = 0.05,
    floor: dict[str, float] | None = None,
    stats: list[str] | None = None,
) -> int:
    """``perflab numdiff A B``: where the telemetry of two reports (or two variants of one
    report) first differs beyond ``tol``; prints the table.  Exit 0 with the table; 2 with one line
    when a side has no telemetry (or no such variant) or the two share no rows."""
    try:
        ta = _load_variant(a, variant_a, "variant-a")
        tb = _load_variant(b, variant_b, "variant-b")
        d = numerics_diff(telemetry_frame(ta), telemetry_frame(tb), tol, dict(floor or {}))
    except (_Refused, ConfigError) as e:
        print(f"perflab numdiff: {e}", file=sys.stderr)
        return 2
    for reason in unrelated_reasons(ta, tb):
        print(f"perflab numdiff: warning: {reason}", file=sys.stderr)
    show = d.first if not stats else d.first[d.first.stat.isin(stats)]
    print(show.to_string(index=False))
    if len(d.one_sided):
        print(f"{len(d.one_sided)} rows present in one run only (counted as a full difference)")
    for side in ("a", "b"):
        if d.steps_only[side]:
            print(f"steps only {side.upper()} recorded (left out): {_ranges(d.steps_only[side])}")
    lines = d.lines(stats)
    print("\n".join(lines) if lines else f"no statistic differs beyond {tol:g}")
    return 0


def _ranges(xs: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)
