"""The regression gate's promise, on real runs of the labs: unchanged code passes, a real
regression fails, on any CPU of the kind.

1. Two runs of one commit on one machine compare clean: the session's smoke report against a second
   run of the labs whose keys held results (lab 01's top ops and explorer copies, lab 04's measured
   share, lab 08's ranked plans): no row missing, none changed beyond float noise (``slow``).
   Every key field's number is a parameter of its lab, never a measured value (the whole report).
2. A run on another CPU model passes ``perflab baseline check``: the committed CPU baseline against
   itself with every float32-rounding-level error figure redrawn as another machine's summation
   order would give it (x0.5 .. x2, a zero becoming a rounding error); and the CPU baseline stored on
   an Intel Xeon (``tests/data/cpu-baseline-intel-xeon``, commit f321163, the committed baseline
   before the keys were fixed) against this machine's smoke run: no regression among the rows they
   share.
3. Planted regressions fail with exit 1 naming them: a 1.5x slower op with stable timings, an error
   figure past its check's tolerance, a lab that did not run.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lab_utils.core.records import CONTEXT_COLUMNS, load_records
from lab_utils.run import compare as C
from lab_utils.run.compare.options import Options
from lab_utils.run.runner import ROOT, run_suite

BASELINE = ROOT / "parameterized" / "baselines" / "cpu"
INTEL = ROOT / "tests" / "data" / "cpu-baseline-intel-xeon"
#: the labs whose row keys held measured results: run a second time for the same-commit check
UNSTABLE_KEY_LABS = ("01_training_step", "04_low_precision", "08_plan")
KEY_FIELDS = ["experiment", "variant", "shape", "dtype", "metric", "statistic"]
NUMBER = re.compile(r"(?<![\w.])\d+\.\d+(?:e[-+]?\d+)?|(?<![\w.])\d+e[-+]?\d+")


def numbers_in(x) -> set[float]:
    """Every number in a parameter value (nested lists and dicts too)."""
    if isinstance(x, bool):
        return set()
    if isinstance(x, (int, float)):
        return {float(x)}
    if isinstance(x, dict):
        return set().union(*(numbers_in(v) for v in x.values())) if x else set()
    if isinstance(x, (list, tuple)):
        return set().union(*(numbers_in(v) for v in x)) if x else set()
    if isinstance(x, str):
        return {float(t) for t in NUMBER.findall(x)}
    return set()


def test_no_key_field_holds_a_measured_number(smoke_report):
    """A decimal number in a key field (lab 07's ``eps=1e-08 beta2=0.999``) must be one of its lab's
    parameters: a measured share or time there makes two runs of one commit miss each other."""
    ctx = json.loads((smoke_report / "context.json").read_text())
    params = {n["notebook"]: numbers_in(n.get("params") or {}) for n in ctx["notebooks"]}
    df = load_records(smoke_report)
    bad = []
    for r in df[["notebook", *KEY_FIELDS]].drop_duplicates().itertuples(index=False):
        allowed = params.get(r.notebook, set())
        for field in KEY_FIELDS:
            for tok in NUMBER.findall(str(getattr(r, field))):
                if not any(math.isclose(float(tok), p, rel_tol=1e-9) for p in allowed):
                    bad.append(f"{r.notebook} {field}={getattr(r, field)!r}: {tok} is no parameter of the lab")
    assert not bad, "\n".join(bad[:20])


def test_a_headless_run_records_no_explorer_copy_of_a_lab(smoke_report):
    """An explorer measures its default configuration headless: lab 01's is the lab's own profile,
    which it must not copy (``explore_*`` rows) into the records."""
    df = load_records(smoke_report)
    lab01 = df[df["lab"] == "01_training_step"]
    assert len(lab01) and not lab01["experiment"].str.startswith("explore").any(), sorted(set(lab01.experiment))
    assert (lab01["experiment"] == "top_ops").sum() >= 5


@pytest.fixture(scope="module")
def second_run(tmp_path_factory) -> Path:
    res = run_suite(
        "smoke", out_dir=tmp_path_factory.mktemp("second-run"), progress=False, only=list(UNSTABLE_KEY_LABS)
    )
    assert res.ok, f"the second run failed: {res.index}"
    return res.path


@pytest.mark.slow
def test_two_runs_of_one_commit_compare_clean(smoke_report, second_run):
    """Every row of one run meets its twin in the other, and nothing without a better direction
    changed beyond float noise.  Timings are judged as always, but whether they pass depends on the
    machine's load (a busy machine cuts threads, makes timings unstable, slows a run): the exit code
    is asserted with timings out of the gate (``gate="accuracy"``), the rows all the same."""
    cmp = C.compare(smoke_report, second_run, Options(labs=UNSTABLE_KEY_LABS, gate="accuracy"))
    text = cmp.summary_text(limit=30)
    one_sided = cmp.rows[cmp.rows["verdict"].isin(("only in base", "only in candidate"))]
    assert one_sided.empty, text
    assert not ((cmp.rows["verdict"] == "changed") & (cmp.rows["kind"] == "other")).any(), text
    assert cmp.exit_code in (C.EXIT_OK, C.EXIT_INCOMPARABLE), text
    for why in cmp.incomparable():  # machine load only
        assert "timing threads differ" in why or "unstable timings" in why, why
    # the ranked lists matched as sets: their heaviest items on both sides
    top = cmp.rows[cmp.rows["experiment"] == "top_ops"]
    assert (top["verdict"] != "only in base").all() and (top["base"].notna() & top["candidate"].notna()).sum() >= 5


def write_side(folder: Path, rows: pd.DataFrame, source: Path, *, drop_labs=()) -> Path:
    """A report-shaped folder of ``rows`` with ``source``'s context and status (less ``drop_labs``)."""
    folder.mkdir(parents=True)
    rows = rows[~rows["lab"].isin(drop_labs)]
    rows.to_parquet(folder / "records.parquet", index=False)
    ctx = json.loads((source / "context.json").read_text())
    ctx["notebooks"] = [n for n in ctx.get("notebooks", []) if n["notebook"] not in drop_labs]
    (folder / "context.json").write_text(json.dumps(ctx))
    status = [s for s in json.loads((source / "status.json").read_text()) if s["notebook"] not in drop_labs]
    (folder / "status.json").write_text(json.dumps(status))
    return folder


def another_cpu(rows: pd.DataFrame, rng: np.random.Generator) -> tuple[pd.DataFrame, int]:
    """The rows as another CPU model gives them: every error figure of a float computation against
    its reference (unit-less; not a % error of predicted byte counts, which are integers) at float32
    rounding level (< 1e-5) redrawn x0.5 .. x2 (another summation order), a zero one becoming a
    rounding error."""
    out = rows.copy()
    kinds = [C.direction(m, u).kind for m, u in zip(out["metric"], out["unit"].fillna(""), strict=True)]
    err = (pd.Series(kinds, index=out.index) == "accuracy") & (out["unit"].fillna("") == "")
    tiny = err & out["value"].between(0, 1e-5)
    vals = out.loc[tiny, "value"].to_numpy()
    factor = np.exp(rng.uniform(np.log(0.5), np.log(2.0), len(vals)))
    out.loc[tiny, "value"] = np.where(vals > 0, vals * factor, rng.uniform(0, 2e-7, len(vals)))
    return out, int(tiny.sum())


def check(report: Path, out: Path, *extra: str) -> int:
    return C.baseline_main(["check", "--report", str(report), "--kind", "cpu", "--out", str(out), *extra])


def test_another_cpus_float_noise_passes_the_stored_baseline(tmp_path, capsys):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"redraw seed {seed}")
    base = load_records(BASELINE)
    cand, n = another_cpu(base, np.random.default_rng(seed))
    assert n >= 50, f"only {n} error figures at float32 rounding level in the CPU baseline"
    code = check(write_side(tmp_path / "cand", cand, BASELINE), tmp_path / "out")
    text = capsys.readouterr().out
    assert code == C.EXIT_OK, f"seed {seed}:\n{text}"
    # the same check sees an error figure past its check's tolerance
    i = base.index[(base["lab"] == "03_attention") & (base["metric"] == "max_abs_err") & base["value"].gt(0)][0]
    tol = json.loads(base.at[i, "extra"])["tolerance"]
    cand.loc[i, "value"] = 1.01 * tol
    code = check(write_side(tmp_path / "past", cand, BASELINE), tmp_path / "out2")
    text = capsys.readouterr().out
    assert code == C.EXIT_REGRESSION and "past its tolerance" in text, text
    assert base.at[i, "variant"] in text.split("REGRESSIONS")[1].splitlines()[1]


def test_the_intel_xeon_baseline_passes_this_machines_smoke_run(smoke_report):
    """The CPU baseline as stored on an Intel Xeon, against this machine's run: the fp32 attention
    errors and DDP gradient differences that failed it (4.9e-7 -> 6.6e-7) are float noise."""
    cmp = C.compare(INTEL, smoke_report, Options(only="accuracy"))
    assert cmp.regressions.empty, cmp.summary_text(limit=20)
    base_err = cmp.rows[cmp.rows["kind"] == "accuracy"]
    matched = base_err[~base_err["verdict"].isin(("only in base", "only in candidate"))]
    assert len(matched) >= 0.9 * (base_err["verdict"] != "only in candidate").sum(), cmp.summary_text(limit=20)
    assert len(matched) >= 150


def stable_timing(lab: str, op: str, ms: float, rng, ctx: dict, n: int = 15) -> list[dict]:
    s = (ms * np.exp(rng.normal(0, 0.01, n))).tolist()
    row = dict(lab=lab, experiment="ops", variant=op, shape="1823x781", dtype="float32", metric="time", unit="ms",
               extra=json.dumps({"threads": 1}), stable=True, stability="p80/p20 = 1.02", notebook=lab)  # fmt: skip
    out = [dict(row, value=float(np.median(s)), statistic="median", samples=s)]
    return [{**r, **{c: ctx.get(c, "") for c in CONTEXT_COLUMNS}} for r in out]


def test_planted_regressions_fail_the_gate_naming_them(tmp_path, capsys):
    rng = np.random.default_rng(7)
    base = load_records(BASELINE)
    ctx = json.loads((BASELINE / "context.json").read_text())
    lab, op = "02_fused_kernels", "rms_norm/triton"
    with_op = lambda ms: pd.concat([base, pd.DataFrame(stable_timing(lab, op, ms, rng, ctx))], ignore_index=True)  # noqa: E731
    b = with_op(1.0)
    past = with_op(1.0)
    i = past.index[(past["lab"] == "06_distributed") & (past["metric"] == "grad_rel_error")][0]
    past.loc[i, "value"] = 1.2 * json.loads(past.at[i, "extra"])["tolerance"]
    bdir = write_side(tmp_path / "base", b, BASELINE)

    def gate(name: str, rows: pd.DataFrame, drop=()) -> tuple[int, str]:
        cdir = write_side(tmp_path / name, rows, BASELINE, drop_labs=drop)
        code = C.main([str(bdir), str(cdir), "--out", str(tmp_path / f"out-{name}")])
        return code, capsys.readouterr().out

    code, text = gate("same", with_op(1.0))
    assert code == C.EXIT_OK, text
    code, text = gate("slower", with_op(1.5))
    assert code == C.EXIT_REGRESSION and f"{lab}/ops/{op} 1823x781 float32 time[median]" in text, text
    assert "SLOWER" in text.split("REGRESSIONS")[1].split("worse but not gated")[0]
    code, text = gate("past", past)
    assert code == C.EXIT_REGRESSION, text
    assert f"06_distributed/agreement/{past.at[i, 'variant']} grad_rel_error" in text and "past its tolerance" in text
    code, text = gate("missing", b, drop=("05_memory",))
    assert code == C.EXIT_REGRESSION and "the candidate did not run: 05_memory" in text, text
