"""perflab compare's rules at their thresholds: every kind of figure (time, bandwidth, speedup,
memory, error figures, dB both ways, direction-less counts) at, just inside and just outside
its threshold, in one table run through one ``compare`` of two written reports.

Defaults (``Options``): performance and memory 5% (a ratio), error figures 10% (a ratio),
dB figures 0.5 dB (a difference).  At the threshold is "same"; 1e-4 beyond it is a verdict.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import binom

from lab_utils.core.records import CONTEXT_COLUMNS, ROW_COLUMNS
from lab_utils.run import compare as C
from lab_utils.run.compare import rules
from lab_utils.run.compare.options import Options
from lab_utils.run.compare.rules import Direction
from lab_utils.run.compare.stats import judge, rank_pvalues

CPU = {
    "device": "Test CPU 9000",
    "device_kind": "cpu",
    "torch_version": "2.13.0",
    "python_version": "3.12.1",
    "commit": "aaaa",
    "timestamp": "2026-12-03T12:00:00+0000",
}
# The documented defaults, written out rather than read from Options: a threshold moved in
# the code must fail here, not move the cases with it.
T, A, DB = 0.05, 0.10, 0.5
E = 1e-4  # a little beyond (or inside) a threshold

# (case name, metric, unit, base, candidate, verdict).  Ratio thresholds: the candidate at
# base·(1 + thr) is the edge; dB: base ± 0.5 dB.
CASES = [
    # time: lower is better
    ("time at +thr", "time", "ms", 1.0, 1 + T, "same"),
    ("time inside +thr", "time", "ms", 1.0, 1 + T - E, "same"),
    ("time beyond +thr", "time", "ms", 1.0, 1 + T + E, "slower"),
    ("time at -thr", "time", "ms", 1 + T, 1.0, "same"),
    ("time inside -thr", "time", "ms", 1 + T - E, 1.0, "same"),
    ("time beyond -thr", "time", "ms", 1 + T + E, 1.0, "faster"),
    ("latency by unit s", "step", "s", 1.0, 1 + T + E, "slower"),
    # bandwidth and speedup: higher is better
    ("GB/s at +thr", "bandwidth", "GB/s", 1.0, 1 + T, "same"),
    ("GB/s beyond +thr", "bandwidth", "GB/s", 1.0, 1 + T + E, "faster"),
    ("GB/s inside +thr", "bandwidth", "GB/s", 1.0, 1 + T - E, "same"),
    ("GB/s at -thr", "bandwidth", "GB/s", 1 + T, 1.0, "same"),
    ("GB/s beyond -thr", "bandwidth", "GB/s", 1 + T + E, 1.0, "slower"),
    ("TFLOP/s beyond -thr", "throughput", "TFLOP/s", 1 + T + E, 1.0, "slower"),
    ("speedup drop", "speedup_vs_eager", "x", 2 * (1 + T + E), 2.0, "slower"),
    ("speedup rise", "speedup_vs_eager", "x", 2.0, 2 * (1 + T + E), "faster"),
    ("speedup at thr", "speedup_vs_eager", "x", 2.0, 2 * (1 + T), "same"),
    # memory: lower is better, the performance threshold
    ("memory at +thr", "peak_memory", "MiB", 100.0, 100 * (1 + T), "same"),
    ("memory beyond +thr", "peak_memory", "MiB", 100.0, 100 * (1 + T + E), "more memory"),
    ("memory beyond -thr", "peak_memory", "MiB", 100 * (1 + T + E), 100.0, "less memory"),
    ("memory inside -thr", "peak_memory", "MiB", 100 * (1 + T - E), 100.0, "same"),
    # error figures: lower is better, the accuracy threshold (not the performance one)
    ("error at +thr", "max_abs_err", "", 1.0, 1 + A, "same"),
    ("error inside +thr", "max_abs_err", "", 1.0, 1 + A - E, "same"),
    ("error beyond +thr", "max_abs_err", "", 1.0, 1 + A + E, "less accurate"),
    ("error beyond perf thr only", "max_rel_err", "", 1.0, 1 + (T + A) / 2, "same"),
    ("error at -thr", "max_abs_err", "", 1 + A, 1.0, "same"),
    ("error beyond -thr", "max_abs_err", "", 1 + A + E, 1.0, "more accurate"),
    ("mismatches by name, % unit", "mismatch_pct", "%", 1.0, 1 + A + E, "less accurate"),
    ("error from zero", "max_abs_err", "", 0.0, 1e-9, "less accurate"),
    ("error to zero", "max_abs_err", "", 1e-9, 0.0, "more accurate"),
    ("zero errors", "max_abs_err", "", 0.0, 0.0, "same"),
    # dB: higher is better, compared by difference, both ways
    ("SQNR at +thr", "sqnr", "dB", 30.0, 30.0 + DB, "same"),
    ("SQNR inside +thr", "sqnr", "dB", 30.0, 30.0 + DB - 0.01, "same"),
    ("SQNR beyond +thr", "sqnr", "dB", 30.0, 30.0 + DB + 0.01, "more accurate"),
    ("SQNR at -thr", "sqnr", "dB", 30.0, 30.0 - DB, "same"),
    ("SQNR inside -thr", "sqnr", "dB", 30.0, 30.0 - DB + 0.01, "same"),
    ("SQNR drop beyond -thr", "sqnr", "dB", 30.0, 30.0 - DB - 0.01, "less accurate"),
    ("dB by unit, drop", "snr", "dB", 12.0, 12.0 - DB - 0.01, "less accurate"),
    ("dB by unit, rise", "snr", "dB", 12.0, 12.0 + DB + 0.01, "more accurate"),
    ("SQNR drop from a negative", "sqnr", "dB", -3.0, -3.0 - DB - 0.01, "less accurate"),
    # no direction: any change is "changed", none is "same"
    ("count unchanged", "params", "", 12345.0, 12345.0, "same"),
    ("count +1", "params", "", 12345.0, 12346.0, "changed"),
    ("count -1", "params", "", 12345.0, 12344.0, "changed"),
    # ... beyond float noise: 1e-9 relative (Options.neutral_tolerance)
    ("count within float noise", "params", "", 1.0, 1 + 0.9e-9, "same"),
    ("count beyond float noise", "params", "", 1.0, 1 + 1.1e-9, "changed"),
    ("count beyond float noise, down", "params", "", 1.0, 1 - 1.1e-9, "changed"),
]
GATED = {"less accurate"}  # performance and memory rows without samples are shown, not gated


def value_row(variant: str, metric: str, unit: str, value: float) -> dict:
    return dict(
        lab="rules", experiment="table", variant=variant, shape="8x8", dtype="float32", metric=metric,
        value=value, unit=unit, statistic="value", samples=None, extra="",
    )  # fmt: skip


def write_report(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True)
    df = pd.DataFrame(rows).reindex(columns=ROW_COLUMNS)
    for c in CONTEXT_COLUMNS:
        df[c] = CPU.get(c, "")
    df["notebook"], df["run_id"] = df["lab"], folder.name
    (folder / "records.json").write_text(df.to_json(orient="records"))
    (folder / "context.json").write_text(json.dumps({**CPU, "run_id": folder.name}))
    (folder / "status.json").write_text(json.dumps([{"notebook": "rules", "status": "ok", "error": None}]))
    return folder


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rules")
    base = write_report(tmp / "base", [value_row(n, m, u, b) for n, m, u, b, _, _ in CASES])
    cand = write_report(tmp / "cand", [value_row(n, m, u, c) for n, m, u, _, c, _ in CASES])
    cmp = C.compare(base, cand)
    return cmp, cmp.rows.set_index("variant")


@pytest.mark.parametrize("name,metric,unit,base,cand,verdict", CASES, ids=[c[0] for c in CASES])
def test_rule_at_and_around_its_threshold(table, name, metric, unit, base, cand, verdict):
    _, rows = table
    r = rows.loc[name]
    assert r["verdict"] == verdict, (name, base, cand, r.to_dict())
    assert bool(r["regression"]) == (verdict in GATED), r.to_dict()


def test_the_table_gates_on_the_accuracy_rows(table):
    cmp, rows = table
    assert cmp.exit_code == C.EXIT_REGRESSION
    assert set(cmp.regressions["variant"]) == {n for n, *_, v in CASES if v in GATED}


def test_db_gain_and_ratio_columns(table):
    """A dB change is a difference: its gain is 10^(Δ/10) oriented to 'higher is better'."""
    _, rows = table
    drop = rows.loc["SQNR drop beyond -thr"]
    assert drop["gain"] == pytest.approx(10 ** (-(DB + 0.01) / 10), rel=1e-9)
    assert drop["ratio"] == pytest.approx((30.0 - DB - 0.01) / 30.0, rel=1e-12)
    t = rows.loc["time beyond +thr"]
    assert t["gain"] == pytest.approx(1 / (1 + T + E), rel=1e-12) and t["ratio"] == pytest.approx(1 + T + E)


def test_thresholds_are_the_ones_set():
    """The same edge cases move with the options: 20% / 30% / 2 dB."""
    o = Options(threshold=0.2, accuracy_threshold=0.3, db_threshold=2.0)
    time, err, sqnr = C.direction("time", "ms"), C.direction("max_abs_err", ""), C.direction("sqnr", "dB")
    nan = math.nan

    def verdict(d, gain, delta=None):
        return judge(gain, nan, nan, nan, nan, d, o, delta=delta)[0]

    assert verdict(time, 1 / 1.2) == "same" and verdict(time, 1 / 1.2001) == "slower"
    assert verdict(time, 1.2) == "same" and verdict(time, 1.2001) == "faster"
    assert verdict(err, 1 / 1.3) == "same" and verdict(err, 1 / 1.3001) == "less accurate"
    assert verdict(sqnr, nan, delta=-2.0) == "same" and verdict(sqnr, nan, delta=-2.01) == "less accurate"
    assert verdict(sqnr, nan, delta=2.0) == "same" and verdict(sqnr, nan, delta=2.01) == "more accurate"
    # a dB figure where lower is better (a noise floor): the same edges, the other way round
    floor = Direction("lower", "accuracy", "db")
    assert verdict(floor, nan, delta=2.01) == "less accurate" and verdict(floor, nan, delta=-2.01) == "more accurate"
    assert verdict(floor, nan, delta=-2.0) == "same"


# (base sample, candidate sample, verdict) with five identical samples a side: the bootstrap
# interval of the ratio collapses to the point, so the edge is exact.
SAMPLED = [
    (1.0, 1 + T, "same"),
    (1.0, 1 + T + E, "slower"),
    (1 + T, 1.0, "same"),
    (1 + T + E, 1.0, "faster"),
]


@pytest.mark.parametrize("method", ["bootstrap", "rank"])
def test_timings_with_samples_at_the_threshold(tmp_path, method):
    b, c = [], []
    for i, (vb, vc, _) in enumerate(SAMPLED):
        for rows, v in ((b, vb), (c, vc)):
            t = dict(value_row(f"v{i}", "time", "ms", v), statistic="median", samples=[v] * 5)
            bw = dict(value_row(f"v{i}", "bandwidth", "GB/s", 100 / v), statistic="median")
            rows += [t, bw]
    # the same time, 20% more bytes counted: the bandwidth's interval is the time's, scaled by its own gain
    for rows, bw in ((b, 100.0), (c, 120.0)):
        rows += [
            dict(value_row("vbytes", "time", "ms", 1.0), statistic="median", samples=[1.0] * 5),
            dict(value_row("vbytes", "bandwidth", "GB/s", bw), statistic="median"),
        ]
    cmp = C.compare(write_report(tmp_path / "b", b), write_report(tmp_path / "c", c), method=method)
    rows = cmp.rows
    vb = rows[rows.variant == "vbytes"].set_index("metric")
    if method == "bootstrap":
        assert vb.loc["time", "verdict"] == "same" and vb.loc["bandwidth", "verdict"] == "faster", vb.to_dict()
        assert vb.loc["bandwidth", "lo"] == pytest.approx(1.2) and vb.loc["bandwidth", "hi"] == pytest.approx(1.2)
    else:  # the rank tests' p-values are the time's: no confident change
        assert vb.loc["bandwidth", "verdict"] == "same" and "possibly faster" in vb.loc["bandwidth", "note"]
    for i, (_, _, verdict) in enumerate(SAMPLED):
        t = rows[(rows.variant == f"v{i}") & (rows.metric == "time")].iloc[0]
        assert t["verdict"] == verdict and t["n_base"] == 5, (i, t.to_dict())
        assert bool(t["regression"]) == (verdict == "slower")
        # the bandwidth row (no samples of its own) borrows the time row's noise and verdict
        bw = rows[(rows.variant == f"v{i}") & (rows.metric == "bandwidth")].iloc[0]
        assert bw["verdict"] == verdict and bw["noise"] == "from the time row's samples", bw.to_dict()


def test_exactly_min_samples_a_side_give_a_noise_test(tmp_path):
    """Options.min_samples is 3: three samples a side are enough for the bootstrap, so a time 5.01%
    slower with no noise is a gated regression (two samples a side: threshold only, not gated)."""
    rows = {}
    for n in (3, 2):
        for side, v in (("b", 1.0), ("c", 1 + T + E)):
            rows.setdefault(side, []).append(
                dict(value_row(f"n{n}", "time", "ms", v), statistic="median", samples=[v] * n)
            )
    cmp = C.compare(write_report(tmp_path / "b", rows["b"]), write_report(tmp_path / "c", rows["c"]))
    r = cmp.rows.set_index("variant")
    assert (r.loc["n3", "n_base"], r.loc["n3", "n_cand"]) == (3, 3)
    assert r.loc["n3", "noise"] == "bootstrap 99%" and r.loc["n3", "verdict"] == "slower" and r.loc["n3", "regression"]
    assert r.loc["n2", "noise"] == "" and r.loc["n2", "verdict"] == "slower" and not r.loc["n2", "regression"]


def test_bootstrap_interval_is_two_sided_against_the_exact_bootstrap_distribution():
    """Base constant (1.0): the ratio is the median of a resample of the candidate.  For the 21
    values 1..21, the median of 21 draws is <= j with probability P(Bin(21, j/21) >= 11): 0.056
    at 7, 0.131 at 8, 0.253 at 9 (and symmetric above).  An 80% two-sided interval cuts 10% off
    each end: (8, 14); cutting 20% off each (one-sided alpha) would give (9, 13)."""
    base, cand = np.ones(5), np.arange(1.0, 22.0)
    cdf = {j: float(binom.sf(10, 21, j / 21)) for j in range(1, 22)}
    assert cdf[7] < 0.1 < cdf[8] and cdf[8] < 0.2 < cdf[9]  # where the 10% and 20% points fall
    assert C.bootstrap_ratio(base, cand, confidence=0.8) == (8.0, 14.0)


def test_only_performance_keeps_the_memory_rows(tmp_path):
    rows = [value_row("mem", "peak_memory", "MiB", 100.0), value_row("err", "max_abs_err", "", 1.0)]
    cand = [value_row("mem", "peak_memory", "MiB", 120.0), value_row("err", "max_abs_err", "", 2.0)]
    b, c = write_report(tmp_path / "b", rows), write_report(tmp_path / "c", cand)
    perf = C.compare(b, c, only="performance").rows
    assert perf.variant.tolist() == ["mem"] and perf.verdict.tolist() == ["more memory"]
    acc = C.compare(b, c, only="accuracy").rows
    assert acc.variant.tolist() == ["err"] and acc.verdict.tolist() == ["less accurate"]


def test_rank_test_of_an_error_figure_uses_the_accuracy_threshold(tmp_path):
    """An error 7% larger in every sample: beyond the performance threshold (5%), within the
    accuracy one (10%): "same" by the rank test as by the bootstrap; 12% larger is "less accurate"."""
    b, c = [], []
    for name, f in (("err7", 1.07), ("err12", 1.12)):
        b.append(dict(value_row(name, "max_abs_err", "", 1.0), statistic="median", samples=[1.0] * 5))
        c.append(dict(value_row(name, "max_abs_err", "", f), statistic="median", samples=[f] * 5))
    bp, cp = write_report(tmp_path / "b", b), write_report(tmp_path / "c", c)
    for method in ("rank", "bootstrap"):
        r = C.compare(bp, cp, method=method).rows.set_index("variant")
        assert r.loc["err7", "verdict"] == "same", (method, r.loc["err7"].to_dict())
        assert r.loc["err12", "verdict"] == "less accurate", (method, r.loc["err12"].to_dict())


def test_rank_tests_of_a_higher_is_better_figure_shift_the_base_by_the_threshold():
    """Higher is better, threshold 5 %: "better" tests the candidate against base x 1.05 and
    "worse" against base / 1.05.  Disjoint samples make the one-sided p-values extreme: 2 %
    better is beyond neither bound, 10 % better beyond the upper, 10 % worse below the lower."""
    base = np.linspace(1.0, 1.01, 10)
    pw, pb = rank_pvalues(base, base * 1.02, 1.05, "higher")
    assert pw > 0.5 and pb > 0.5
    pw, pb = rank_pvalues(base, base * 1.10, 1.05, "higher")
    assert pb < 1e-3 and pw > 0.5
    pw, pb = rank_pvalues(base, base * 0.90, 1.05, "higher")
    assert pw < 1e-3 and pb > 0.5


def test_rank_pvalues_take_two_samples_per_side(gen):
    """Two samples a side is the least a rank test takes: with every candidate above every base,
    the exact one-sided Mann-Whitney p-value is 1 / C(4, 2) = 1/6 (worse), 1 (better); one
    sample a side gives no p-value."""
    s = 1 + float(torch.rand((), generator=gen))
    base, cand = np.array([1.0, 1.1]) * s, np.array([2.0, 2.1]) * s
    pw, pb = rank_pvalues(base, cand, 1.05, "lower")
    assert pw == pytest.approx(1 / 6) and pb == pytest.approx(1.0)
    pw, pb = rank_pvalues(base, cand, 1.05, "higher")  # higher is better: the same change is better
    assert pw == pytest.approx(1.0) and pb == pytest.approx(1 / 6)
    assert all(math.isnan(x) for x in rank_pvalues(base[:1], cand[:1], 1.05, "lower"))


# --------------------------------------------------------------------------- rules on their own
@pytest.mark.parametrize(
    "dtype, finfo",
    [
        ("float64", np.finfo(np.float64)),
        ("fp32", np.finfo(np.float32)),
        ("torch.float16", np.finfo(np.float16)),
        ("bf16", torch.finfo(torch.bfloat16)),
    ],
)
def test_a_dtypes_unit_roundoff_is_half_its_machine_epsilon(dtype, finfo):
    assert rules.unit_roundoff(dtype) == float(finfo.eps) / 2


def test_tf32_rounds_like_float16_and_an_unknown_dtype_has_no_roundoff():
    """TF32 keeps float16's 10 mantissa bits (with float32's exponent)."""
    assert rules.unit_roundoff("tf32") == float(np.finfo(np.float16).eps) / 2
    assert rules.unit_roundoff("int8") is None and rules.unit_roundoff("") is None


def roundoff(floor: float) -> rules.ErrorScale:
    return rules.ErrorScale("roundoff", floor, floor, f"floor {floor:g}")


@pytest.mark.parametrize(
    "vc, verdict, why",
    [
        (1.05e-3, "same", "within threshold"),  # 5% worse: inside the 10% threshold
        (1e-3 / 1.05, "same", "within threshold"),  # 5% better
        (1e-3 * (1 + A), "same", "within threshold"),  # at the threshold
        (1.15e-3, "less accurate", "beyond"),
        (1e-3 / 1.15, "more accurate", "beyond"),
    ],
)
def test_an_error_figure_on_its_roundoff_scale_needs_the_ratio_threshold_too(vc, verdict, why):
    """Base 1e-3 against a float-noise floor of 1e-9: every move here is far beyond the floor,
    so the ratio threshold (10%) alone decides."""
    gain = 1e-3 / vc
    v, note = rules.judge_error(1e-3, vc, gain, A, roundoff(1e-9))
    assert v == verdict and why in note and note.endswith("(rule: roundoff)")


def test_an_error_figure_moved_by_exactly_its_roundoff_floor_is_float_noise():
    """float32 over a reduction of 4: 4 x 2^-24 x sqrt(4) = 2^-21.  Doubling an error of 2^-21
    moves it by 2^-21, the floor itself: float noise; a hair more is a change."""
    scale = rules.error_scale("", json.dumps({"roundoff_dtype": "float32", "reduction": 4}))
    assert (scale.rule, scale.base, scale.cand) == ("roundoff", 2.0**-21, 2.0**-21)
    f = 2.0**-21
    v, note = rules.judge_error(f, 2 * f, 0.5, A, scale)
    assert v == "same" and note.startswith("float noise")
    vc = 2 * f * (1 + 1e-9)
    assert rules.judge_error(f, vc, f / vc, A, scale)[0] == "less accurate"


def test_an_error_figure_past_its_tolerance_within_the_ratio_threshold_is_the_same():
    """Both sides already past a tolerance of 1: shares 300% -> 329% move by 29% of it (over a
    quarter) but by 9.7% as a ratio, inside the 10% threshold: no verdict."""
    scale = rules.ErrorScale("tolerance", 1.0, 1.0, "its check's tolerance 1")
    v, note = rules.judge_error(3.0, 3.29, 3.0 / 3.29, A, scale)
    assert (v, note) == ("same", "300.0% -> 329.0% of its check's tolerance 1: within threshold (rule: tolerance)")


@pytest.mark.parametrize(
    "extra, member",
    [
        ({"top_n": 1, "share": 0.3}, rules.Ranked(1, 0.3)),  # a list of one item is a list
        ({"top_n": 15}, rules.Ranked(15, None)),
        ({"top_n": 0, "share": 0.3}, None),
        ({"top_n": True}, None),
        ({"top_n": 2.0}, None),
        ({"share": 0.3}, None),
    ],
)
def test_a_ranked_lists_member_needs_a_whole_number_of_items_of_at_least_one(extra, member):
    assert rules.ranked_member(json.dumps(extra)) == member
