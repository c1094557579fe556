"""The gate's rules for figures whose change is a result of noise, not of the code
(``lab_utils.run.compare.rules``), at their boundaries, on hand-made records compared by ``compare``:

* an error figure carrying its check's ``tolerance`` is judged by its share of that tolerance (a
  move of more than ``TOLERANCE_SHARE`` of it, or past it); one naming its machine arithmetic
  (``roundoff_dtype``, ``reduction``) by that dtype's unit roundoff at the problem's scale; one with
  neither by the ratio threshold; the note names the rule;
* a ranked (top-N) list is compared as a set: an item that crossed the cut-off is reported, one
  that appears or disappears with more than ``TOP_N_HEAVY_SHARE`` of the whole beyond the other
  side's cut-off gates;
* a reported figure (idle, shares) never gates;
* rows sharing a key are told apart by extra fields of their own key group only;
* a notebook's ``device='auto'`` is compared as the device it resolved to.

The thresholds are written out here, not read from the rules: a moved threshold must fail a test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lab_utils.core.records import CONTEXT_COLUMNS, ROW_COLUMNS
from lab_utils.run import compare as C
from lab_utils.run.compare import rules

CPU = {
    "device": "Test CPU 9000",
    "device_kind": "cpu",
    "torch_version": "2.13.0",
    "python_version": "3.12.1",
    "commit": "aaaa",
    "timestamp": "2026-12-06T12:00:00+0000",
}
TOL_SHARE, ULPS, HEAVY = 0.25, 4.0, 0.05
U32 = 2.0**-24


def row(lab, exp, variant, metric, value, unit="", *, dtype="", shape="", statistic="value", samples=None, **extra):
    return dict(
        lab=lab,
        experiment=exp,
        variant=variant,
        shape=shape,
        dtype=dtype,
        metric=metric,
        value=value,
        unit=unit,
        statistic=statistic,
        samples=samples,
        extra=json.dumps(extra, sort_keys=True) if extra else "",
        stable=None if samples is None else True,
        stability="" if samples is None else "p80/p20 = 1.02",
    )


def report(folder: Path, rows: list[dict], ctx: dict = CPU, *, params: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows).reindex(columns=ROW_COLUMNS)
    for c in CONTEXT_COLUMNS:
        df[c] = ctx.get(c, "")
    df["notebook"] = df["lab"]
    (folder / "records.json").write_text(df.to_json(orient="records"))
    labs = sorted(set(df["lab"]))
    context = {**ctx, "run_id": folder.name}
    if params is not None:
        context["notebooks"] = [{"notebook": lab, "params": params} for lab in labs]
    (folder / "context.json").write_text(json.dumps(context))
    (folder / "status.json").write_text(json.dumps([{"notebook": lab, "status": "ok"} for lab in labs]))
    return folder


def one(cmp, **kw) -> pd.Series:
    df = cmp.rows
    for k, v in kw.items():
        df = df[df[k] == v]
    assert len(df) == 1, f"expected one row for {kw}:\n{cmp.rows[['variant', 'metric', 'verdict', 'note']]}"
    return df.iloc[0]


def err(variant, value, **extra):
    return row("03_attention", "correctness", variant, "max_abs_err", value, dtype="float32", **extra)


def verdicts(tmp_path, pairs: list[tuple[float, float]], **extra) -> list[tuple[str, str]]:
    """Each (base, candidate) error figure as its own row with ``extra``: (verdict, note) each."""
    b = [err(f"v{i}", vb, **extra) for i, (vb, _) in enumerate(pairs)]
    c = [err(f"v{i}", vc, **extra) for i, (_, vc) in enumerate(pairs)]
    cmp = C.compare(report(tmp_path / "b", b), report(tmp_path / "c", c))
    return [tuple(one(cmp, variant=f"v{i}")[["verdict", "note"]]) for i in range(len(pairs))]


def test_an_error_figure_is_judged_by_its_share_of_its_checks_tolerance(tmp_path):
    tol = 1e-5
    got = verdicts(
        tmp_path,
        [
            (4.9e-7, 6.6e-7),  # the CPU baseline's cross-CPU move: 1.35x, but 4.9% -> 6.6% of the tolerance
            (0.0, 9.9e-8),  # 0 -> a rounding error (ratio inf): 1% of it
            (1e-6, 1e-6 + TOL_SHARE * tol),  # a quarter of the tolerance exactly: still float noise
            (1e-6, 1e-6 + TOL_SHARE * tol * 1.01),  # just beyond a quarter: a real loss of accuracy
            (0.5 * tol, tol),  # at the tolerance the check still passes (value <= tolerance); 50% moved
            (0.9 * tol, tol),  # at it, 10% moved: the check passes, float noise
            (0.9 * tol, tol * 1.0001),  # past the tolerance: the check fails, always a regression
            (1.2 * tol, 0.9 * tol),  # back within it
            (1e-6 + TOL_SHARE * tol * 1.01, 1e-6),  # the same move down
        ],
        tolerance=tol,
    )
    assert [v for v, _ in got] == [
        "same",
        "same",
        "same",
        "less accurate",
        "less accurate",
        "same",
        "less accurate",
        "more accurate",
        "more accurate",
    ], got
    assert all("(rule: tolerance)" in n for _, n in got), got
    assert "4.9% -> 6.6%" in got[0][1] and "past its tolerance" in got[6][1] and "90.0% -> 100.0%" in got[5][1]


def test_a_side_without_the_tolerance_takes_the_other_sides(tmp_path):
    """A baseline stored before its records carried tolerances is judged on the candidate's."""
    b = [err("sdpa", 4.9e-7)]
    c = [err("sdpa", 6.6e-7, tolerance=1e-5)]
    cmp = C.compare(report(tmp_path / "b", b), report(tmp_path / "c", c))
    assert one(cmp, variant="sdpa")["verdict"] == "same" and cmp.exit_code == C.EXIT_OK


def test_an_error_figure_of_machine_arithmetic_is_judged_by_its_dtypes_roundoff(tmp_path):
    k = 1024
    floor = ULPS * U32 * math.sqrt(k)  # 7.6e-6
    decl = dict(roundoff_dtype="float32", reduction=k)
    got = verdicts(
        tmp_path,
        [
            (2.5e-7, 1.2e-7),  # the CPU baseline's fp32 accumulation, Intel -> AMD: 2x, far inside
            (1e-6, 1e-6 + floor * 0.999),
            (1e-6, 1e-6 + floor * 1.01),
            (1e-2, 1.2e-2),  # a large error that moves by far more than rounding: judged
        ],
        **decl,
    )
    assert [v for v, _ in got] == ["same", "same", "less accurate", "less accurate"], got
    assert all("(rule: roundoff)" in n for _, n in got) and "float32 roundoff x sqrt(1024)" in got[2][1]
    # the row's dtype stands in for roundoff_dtype: 1e-3 -> 5e-3 over 16 terms is far beyond float32
    # rounding (err() rows are float32), and within bfloat16's (2^16 times float32's)
    (v, note) = verdicts(tmp_path / "f32", [(1e-3, 5e-3)], reduction=16)[0]
    assert v == "less accurate" and "float32 roundoff x sqrt(16)" in note, note
    b = [row("04", "acc", "bf16", "rel_error", 1e-3, dtype="bfloat16", reduction=16)]
    c = [row("04", "acc", "bf16", "rel_error", 5e-3, dtype="bfloat16", reduction=16)]
    cmp = C.compare(report(tmp_path / "b2", b), report(tmp_path / "c2", c))
    r = one(cmp, variant="bf16")
    assert r["verdict"] == "same" and "bfloat16 roundoff x sqrt(16)" in r["note"], r["note"]


def test_an_error_figure_with_neither_keeps_the_ratio_threshold_and_says_so(tmp_path):
    got = verdicts(tmp_path, [(1e-3, 1.1e-3), (1e-3, 1.1001e-3)])
    assert [v for v, _ in got] == ["same", "less accurate"]
    assert all(n.endswith("rule: threshold") for _, n in got), got


def top_ops(shares: dict[str, float], *, n=4, step_ms=100.0, seed=0) -> list[dict]:
    """A lab-01-like top-N list: one stable timing row per op (its samples), share and top_n in extra."""
    rng = np.random.default_rng(seed)
    out = []
    for name, sh in shares.items():
        s = (sh * step_ms * np.exp(rng.normal(0, 0.01, 12))).tolist()
        out.append(
            row("01_training_step", "top_ops", name, "time", float(np.median(s)), "ms", shape="b2",
                statistic="median", samples=s, top_n=n, share=sh)
        )  # fmt: skip
    return out


def test_a_top_n_list_is_compared_as_a_set(tmp_path):
    base = {"mm": 0.40, "conv": 0.30, "sqrt": 0.031, "fill": 0.010}
    # noise near the cut-off: 'fill' (1.0%) leaves, 'bmm' (1.2%) enters; membership is reported
    cand = {"mm": 0.40, "conv": 0.30, "sqrt": 0.031, "bmm": 0.012}
    cmp = C.compare(report(tmp_path / "b", top_ops(base)), report(tmp_path / "c", top_ops(cand, seed=1)))
    assert one(cmp, variant="fill")["verdict"] == rules.LEFT_TOP_N
    assert one(cmp, variant="bmm")["verdict"] == rules.ENTERED_TOP_N
    assert "(rule: top-N)" in one(cmp, variant="bmm")["note"]
    assert cmp.exit_code == C.EXIT_OK and not len(cmp.missing), cmp.summary_text()
    assert one(cmp, variant="mm")["verdict"] == "same"


@pytest.mark.parametrize(
    ("share", "verdict"),
    [
        (0.010 + HEAVY, rules.ENTERED_TOP_N),  # moved by exactly the threshold above the base's cut-off
        (0.010 + HEAVY + 1e-4, rules.APPEARED),
    ],
)
def test_a_heavy_op_that_appears_gates_at_its_threshold(tmp_path, share, verdict):
    base = {"mm": 0.40, "conv": 0.30, "sqrt": 0.031, "fill": 0.010}  # the base's list ends at 1.0%
    cand = {"mm": 0.40, "conv": 0.30, "sqrt": 0.031, "new_kernel": share}
    cmp = C.compare(report(tmp_path / "b", top_ops(base)), report(tmp_path / "c", top_ops(cand)))
    r = one(cmp, variant="new_kernel")
    assert r["verdict"] == verdict, r["note"]
    gated = verdict == rules.APPEARED
    assert cmp.exit_code == (C.EXIT_REGRESSION if gated else C.EXIT_OK)
    if gated:
        assert "new_kernel" in cmp.summary_text() and "REGRESSIONS" in cmp.summary_text()


def test_an_op_that_vanishes_from_a_list_that_held_every_op_gates(tmp_path):
    """A list shorter than N held every op: an op missing there is absent (cut-off 0)."""
    base = {"mm": 0.50, "conv": 0.30, "optimizer_step": 0.08}
    # the optimizer step stopped running: the step is 8% faster (the other ops unchanged), and wrong
    cand = {"mm": 0.50 / 0.92, "conv": 0.30 / 0.92}
    cand_rows = top_ops(cand, n=15, step_ms=92.0, seed=1)
    cmp = C.compare(report(tmp_path / "b", top_ops(base, n=15)), report(tmp_path / "c", cand_rows))
    assert set(cmp.rows.verdict) == {"same", rules.DISAPPEARED}
    r = one(cmp, variant="optimizer_step")
    assert r["verdict"] == rules.DISAPPEARED and "absent from the candidate" in r["note"], r["note"]
    assert cmp.exit_code == C.EXIT_REGRESSION and len(cmp.regressions) == 1


def test_a_ranked_list_without_shares_reports_membership_only(tmp_path):
    plans = lambda names: [  # noqa: E731
        row("08_plan", "plans", p, "step_time", 30.0 + i, "ms", statistic="predicted", rank=i + 1, top_n=3)
        for i, p in enumerate(names)
    ]
    cmp = C.compare(report(tmp_path / "b", plans(["a", "b", "c"])), report(tmp_path / "c", plans(["a", "c", "d"])))
    assert one(cmp, variant="b")["verdict"] == rules.LEFT_TOP_N
    assert one(cmp, variant="d")["verdict"] == rules.ENTERED_TOP_N
    assert cmp.exit_code == C.EXIT_OK and not len(cmp.missing)


def test_reported_figures_never_gate(tmp_path):
    """A pure speed-up raises the idle share: idle is reported, the faster op is the verdict."""
    rng = np.random.default_rng(3)

    def rows(op_ms, idle_ms):
        s = lambda m: (m * np.exp(rng.normal(0, 0.01, 12))).tolist()  # noqa: E731
        a, i = s(op_ms), s(idle_ms)
        return [
            row("09", "trace", "rank0", "kernel:gemm", float(np.median(a)), "ms", statistic="median", samples=a),
            row("09", "trace", "rank0", "idle", float(np.median(i)), "ms", statistic="median", samples=i),
            row("01", "categories", "idle/gap", "time", float(np.median(i)), "ms", statistic="median", samples=i,
                reported=True),
        ]  # fmt: skip

    cmp = C.compare(report(tmp_path / "b", rows(10.0, 1.0)), report(tmp_path / "c", rows(5.0, 5.5)))
    assert one(cmp, metric="kernel:gemm")["verdict"] == "faster"
    for metric in ("idle", "time"):
        r = one(cmp, metric=metric)
        assert r["kind"] == "reported" and r["verdict"] == "changed" and not r["regression"], r
    assert cmp.exit_code == C.EXIT_OK
    # a reported figure moves with the load: a timing-free baseline leaves it out
    kept = C.timing_free(pd.DataFrame(rows(1.0, 1.0)))
    assert kept.empty
    assert C.direction("matmul_share", "fraction") == rules.REPORTED
    assert C.direction("category:idle", "ms") == C.direction("idle_ms", "ms") == rules.REPORTED
    assert C.direction("idleness_time", "ms") == C.direction("shared_time", "ms") == C.LOWER_TIME
    assert C.direction("time", "ms", json.dumps({"reported": True})) == rules.REPORTED


def test_extra_fields_tell_apart_only_the_rows_of_their_own_key_group(tmp_path):
    """``block`` names telemetry rows apart; the drift row alone under its key holds the block where
    drift started, a result: it must not become that row's identity."""

    def rows(drift_block):
        tel = [row("07", "telemetry", "fp8", "act_max", 1.0 + i, statistic="step1", block=f"b{i}") for i in range(3)]
        return tel + [row("07", "recipe_drift", "fp8", "first_step_act_max", 9, "step", block=drift_block)]

    cmp = C.compare(report(tmp_path / "b", rows("none")), report(tmp_path / "c", rows("b1")))
    r = one(cmp, experiment="recipe_drift")
    assert r["ident"] == "" and r["verdict"] == "same"
    assert sorted(cmp.rows[cmp.rows.experiment == "telemetry"]["ident"]) == ["block=b0", "block=b1", "block=b2"]
    assert cmp.exit_code == C.EXIT_OK and not len(cmp.missing)


def test_a_notebook_runs_auto_device_compares_as_the_device_it_resolved_to(tmp_path):
    """``make lab`` records device='auto', a headless smoke set device='cpu': both ran on the CPU."""
    rows = [err("sdpa", 5e-7, tolerance=1e-5), row("03_attention", "count", "paths", "n", 5.0)]
    base = report(tmp_path / "lab", rows, params={"device": "auto", "seq": 97})
    cand = report(tmp_path / "headless", rows, params={"device": "cpu", "seq": 97})
    cmp = C.compare(base, cand)
    assert cmp.exit_code == C.EXIT_OK and not cmp.context.params, cmp.result_line()
    # a parameter that really differs is still caught, and so is another device
    other = report(tmp_path / "seq", rows, params={"device": "cpu", "seq": 128})
    assert C.compare(base, other).exit_code == C.EXIT_INCOMPARABLE
    gpu = report(
        tmp_path / "gpu",
        rows,
        {**CPU, "device": "NVIDIA H200", "device_kind": "cuda"},
        params={"device": "auto", "seq": 97},
    )
    diff = C.compare(cand, gpu).context.params["03_attention"]
    assert diff == [("device", "cpu", "cuda")]
