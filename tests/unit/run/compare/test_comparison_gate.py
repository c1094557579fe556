"""The regression gate cannot pass by omission, never compares unlike timings, and a stored
baseline reads back exactly.

Synthetic report folders, shaped like the runner's (records, context with the notebooks'
parameters, status), in tmp_path."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from lab_utils.core import ceilings as ceilings_module
from lab_utils.core import records
from lab_utils.core.config import ConfigError
from lab_utils.core.records import CONTEXT_COLUMNS, ROW_COLUMNS, load_records
from lab_utils.run import cli, report, runner
from lab_utils.run import compare as C

CPU = {
    "device": "Test CPU 9000",
    "device_kind": "cpu",
    "torch_version": "2.13.0",
    "triton_version": "3.9.0",
    "cuda_version": None,
    "python_version": "3.12.1",
    "commit": "aaaa",
    "timestamp": "2026-12-02T12:00:00+0000",
    "suite": "smoke",
    "overrides": {},
}
LABS = ("00_ceilings", "02_fused", "04_lowp")


def timing(lab, variant, median_ms, *, rng, threads=2, n=25, noise=0.02, bytes=None):
    """Rows like Recorder.add_timing writes (median with samples, p20, p80, GB/s), threads in extra."""
    s = median_ms * np.exp(rng.normal(0, noise, n))
    med = float(np.median(s))
    extra = json.dumps({"threads": threads, "attempts": 1})
    base = dict(lab=lab, experiment="sweep", variant=variant, shape="64x96", dtype="float32", extra=extra)
    base.update(stable=True, stability="p80/p20 = 1.03")
    rows = [
        dict(base, metric="time", unit="ms", value=med, statistic="median", samples=s.tolist()),
        dict(base, metric="time", unit="ms", value=float(np.quantile(s, 0.2)), statistic="p20", samples=None),
        dict(base, metric="time", unit="ms", value=float(np.quantile(s, 0.8)), statistic="p80", samples=None),
    ]
    if bytes:
        rows.append(dict(base, metric="bandwidth", unit="GB/s", value=bytes / med / 1e6, statistic="median"))
    return rows


def value(lab, variant, metric, v, unit="", shape="64x96"):
    return dict(
        lab=lab,
        experiment="check",
        variant=variant,
        shape=shape,
        dtype="float32",
        metric=metric,
        value=v,
        unit=unit,
        statistic="value",
        samples=None,
        extra="",
    )


def lab_rows(lab, *, seed=0, slow=1.0, threads=2, err=1e-3, shape="64x96"):
    rng = np.random.default_rng(seed)
    return (
        timing(lab, "triton", 2.0 * slow, rng=rng, threads=threads, bytes=4e8)
        + timing(lab, "eager", 5.0, rng=rng, threads=threads)
        + [value(lab, "triton", "max_abs_err", err), value(lab, "model", "params", 12345.0, shape=shape)]
    )


def write_run(folder: Path, rows: list[dict], ctx: dict | None = None, *, params=None, status=None) -> Path:
    """A folder shaped like a finished report: records.json, context.json (with each notebook's
    parameters, as the runner writes them) and status.json."""
    ctx = dict(ctx or CPU)
    folder.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows).reindex(columns=ROW_COLUMNS)
    for c in CONTEXT_COLUMNS:
        df[c] = ctx.get(c, "")
    df["notebook"] = df["lab"]
    df["run_id"] = folder.name
    rows_out = [
        {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
        for r in df.to_dict("records")
    ]
    (folder / "records.json").write_text(json.dumps(rows_out))  # exact floats, as the report writes them
    labs = sorted(set(df["lab"]))
    params = params or {}
    ctx["notebooks"] = [{"notebook": lab, "status": "ok", "params": params.get(lab, {"reps": 10})} for lab in labs]
    (folder / "context.json").write_text(json.dumps({**ctx, "run_id": folder.name}))
    st = status or [{"notebook": lab, "status": "ok", "error": None} for lab in labs]
    (folder / "status.json").write_text(json.dumps(st))
    return folder


def full_run(folder, **kw):
    return write_run(folder, [r for lab in LABS for r in lab_rows(lab, seed=LABS.index(lab))], **kw)


def only(cmp, **kw) -> pd.Series:
    df = cmp.rows
    for k, v in kw.items():
        df = df[df[k] == v]
    assert len(df) == 1, f"expected one row for {kw}, got {len(df)}:\n{cmp.rows[['lab', 'variant', 'metric']]}"
    return df.iloc[0]


# --------------------------------------------------------------------------- no pass by omission
def test_a_lab_that_did_not_run_fails_the_gate_unless_narrowed(tmp_path, capsys):
    base = full_run(tmp_path / "base")
    cand = write_run(tmp_path / "cand", lab_rows("00_ceilings", seed=0))  # a run of lab 00 only
    cmp = C.compare(base, cand)
    assert cmp.missing_labs == ["02_fused", "04_lowp"]
    assert cmp.exit_code == C.EXIT_REGRESSION and not len(cmp.regressions)
    assert "did not run: 02_fused, 04_lowp" in cmp.result_line() and cmp.result_line().startswith("FAIL")
    assert "the lab did not run in the candidate" in only(cmp, lab="02_fused", variant="triton", metric="time")["note"]
    # narrowed explicitly: both sides compared on lab 00 only, and the base's other labs are not listed
    narrowed = C.compare(base, cand, labs=("00_ceilings",))
    assert narrowed.exit_code == C.EXIT_OK and set(narrowed.rows["lab"]) == {"00_ceilings"}
    assert set(narrowed.rows["verdict"]) == {"same"}
    # the command line: a path names the lab; a lab of neither run is refused, naming the parameter
    out = str(tmp_path / "o")
    assert C.main([str(base), str(cand), "--out", out, "--quiet"]) == C.EXIT_REGRESSION
    assert C.main([str(base), str(cand), "--only", "labs/00_ceilings.ipynb", "--out", out, "--quiet"]) == C.EXIT_OK
    capsys.readouterr()
    assert C.main([str(base), str(cand), "--only", "09_nope", "--out", out]) == C.EXIT_USAGE
    assert "'only' = '09_nope'" in capsys.readouterr().err


def test_rows_missing_from_the_candidate_fail_the_gate(tmp_path):
    base = full_run(tmp_path / "base")
    rows = [r for lab in LABS for r in lab_rows(lab, seed=LABS.index(lab))]
    rows = [r for r in rows if not (r["lab"] == "04_lowp" and r["metric"] == "max_abs_err")]
    cmp = C.compare(base, write_run(tmp_path / "cand", rows))
    assert cmp.exit_code == C.EXIT_REGRESSION and not len(cmp.regressions)
    assert len(cmp.missing) == 1 and "1 row(s) of the base missing from the candidate (in 04_lowp)" in cmp.result_line()
    assert cmp.to_html().count(" ⚑") == 1  # the missing row is marked as failing the gate
    assert C.compare(base, write_run(tmp_path / "c2", rows), gate="none").exit_code == C.EXIT_OK
    # rows only in the candidate are new, not a failure
    extra = rows + lab_rows("04_lowp", seed=2)[-1:] + [value("04_lowp", "new", "max_abs_err", 1e-3)]
    extra = [r for r in extra if not (r["lab"] == "04_lowp" and r["metric"] == "params")] + [
        value("04_lowp", "model", "params", 12345.0),
        value("04_lowp", "triton", "max_abs_err", 1e-3),
    ]
    cmp = C.compare(base, write_run(tmp_path / "c3", extra))
    assert (cmp.rows["verdict"] == "only in candidate").sum() == 1 and cmp.exit_code == C.EXIT_OK


def test_baseline_check_of_a_one_lab_run_fails_unless_narrowed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PERFLAB_BASELINES", str(tmp_path / "baselines"))
    base = full_run(tmp_path / "base")
    assert C.baseline_main(["refresh", "--report", str(base), "--timing-free"]) == 0
    cand = write_run(tmp_path / "cand", lab_rows("00_ceilings", seed=0))
    out = ["--out", str(tmp_path / "o"), "--quiet"]
    assert C.baseline_main(["check", "--report", str(cand), *out]) == C.EXIT_REGRESSION
    assert "did not run: 02_fused, 04_lowp" in capsys.readouterr().out
    assert C.baseline_main(["check", "--report", str(cand), "--only", "labs/00_ceilings.ipynb", *out]) == C.EXIT_OK


def test_runs_of_other_parameters_or_suites_are_flagged_not_matched(tmp_path):
    base = full_run(tmp_path / "base")
    cand = full_run(tmp_path / "cand", params={"02_fused": {"reps": 3}})
    cmp = C.compare(base, cand)
    assert cmp.exit_code == C.EXIT_INCOMPARABLE
    assert "parameters differ (02_fused: reps 10 in the base, 3 in the candidate)" in cmp.result_line()
    assert any(f.startswith("PARAMETERS DIFFER in 02_fused") for f in cmp.flags)
    lab2 = cmp.rows[cmp.rows["lab"] == "02_fused"]
    assert set(lab2["verdict"]) == {C.NOT_COMPARABLE}
    assert set(cmp.rows[cmp.rows["lab"] != "02_fused"]["verdict"]) == {"same"}
    asked = C.compare(base, cand, allow_context_diff=("params",))
    assert asked.exit_code == C.EXIT_OK and C.NOT_COMPARABLE not in set(asked.rows["verdict"])
    # an older record without per-notebook parameters: the suite and the overrides are compared
    for f in (base, cand):
        ctx = json.loads((f / "context.json").read_text())
        del ctx["notebooks"]
        (f / "context.json").write_text(json.dumps(ctx if f == base else {**ctx, "suite": "gpu"}))
    cmp = C.compare(base, cand)
    assert cmp.exit_code == C.EXIT_INCOMPARABLE and "suite smoke in the base, gpu in the candidate" in cmp.result_line()


# --------------------------------------------------------------------------- what a timing measures
def test_timings_with_other_thread_counts_are_not_comparable(tmp_path):
    """A run on a busy machine timed with 1 thread where the base had 2: 2-3x slower, never 'slower'."""
    base = full_run(tmp_path / "base")
    rows = [r for lab in LABS for r in lab_rows(lab, seed=LABS.index(lab) + 7, slow=2.5, threads=1)]
    cand = write_run(tmp_path / "cand", rows)
    cmp = C.compare(base, cand)
    t = only(cmp, lab="02_fused", variant="triton", metric="time")
    assert t["verdict"] == C.NOT_COMPARABLE and not t["regression"]
    assert "1 in the candidate" in t["note"] and "--allow-context-diff threads" in t["note"]
    assert only(cmp, lab="02_fused", variant="triton", metric="bandwidth")["verdict"] == C.NOT_COMPARABLE
    assert only(cmp, lab="02_fused", metric="max_abs_err")["verdict"] == "same"  # accuracy: not a timing
    assert "slower" not in set(cmp.rows["verdict"])
    assert cmp.exit_code == C.EXIT_INCOMPARABLE and "timing threads differ" in cmp.result_line()
    assert any(f.startswith("TIMING THREADS DIFFER") for f in cmp.flags)
    asked = C.compare(base, cand, allow_context_diff=("threads",))
    assert only(asked, lab="02_fused", variant="triton", metric="time")["verdict"] == "slower"
    assert asked.exit_code == C.EXIT_REGRESSION
    out = str(tmp_path / "o")
    assert C.main([str(base), str(cand), "--allow-context-diff", "threads", "--out", out, "--quiet"]) == 1
    with pytest.raises(ConfigError, match="allow_context_diff"):
        C.Options(allow_context_diff=("weather",))


def test_other_software_makes_timings_not_comparable(tmp_path):
    base = full_run(tmp_path / "base")
    cand = full_run(tmp_path / "cand", ctx={**CPU, "torch_version": "2.14.0", "commit": "bbbb"})
    cmp = C.compare(base, cand)
    assert only(cmp, lab="02_fused", variant="eager", metric="time")["verdict"] == C.NOT_COMPARABLE
    assert only(cmp, lab="02_fused", metric="max_abs_err")["verdict"] == "same"
    assert cmp.exit_code == C.EXIT_INCOMPARABLE and "software differs (torch 2.13.0 -> 2.14.0)" in cmp.result_line()
    assert C.compare(base, cand, allow_context_diff="software").exit_code == C.EXIT_OK


def test_a_compile_parameter_is_its_own_category(tmp_path):
    base = full_run(tmp_path / "base", params={lab: {"reps": 10, "compile": False} for lab in LABS})
    cand = full_run(tmp_path / "cand", params={lab: {"reps": 10, "compile": lab == "04_lowp"} for lab in LABS})
    cmp = C.compare(base, cand)
    assert "--allow-context-diff compile" in only(cmp, lab="04_lowp", variant="triton", metric="time")["note"]
    assert C.compare(base, cand, allow_context_diff=("compile",)).exit_code == C.EXIT_OK
    assert C.compare(base, cand, allow_context_diff=("params",)).exit_code == C.EXIT_INCOMPARABLE


def test_a_run_whose_threads_were_cut_says_so_at_the_top(tmp_path, monkeypatch):
    monkeypatch.delenv("PERFLAB_TIMING_THREADS", raising=False)
    rows = lab_rows("02_fused", threads=1) + lab_rows("04_lowp", threads=4)
    df = pd.DataFrame(rows).reindex(columns=ROW_COLUMNS)
    busy = {"timing": {"cpu_threads": {"threads": 1, "policy": "auto", "cores": 4, "busy": 3.2}}}
    note = records.thread_cut_note(df, busy)
    assert note.startswith("THREADS CUT") and "2 of 4 CPU timings" in note and "4 usable cores" in note
    assert records.thread_cut_note(df, {"timing": {"cpu_threads": {"policy": "argument", "cores": 4}}}) == ""
    assert (
        records.thread_cut_note(pd.DataFrame(lab_rows("04_lowp", threads=4)).reindex(columns=ROW_COLUMNS), busy) == ""
    )
    # the report's index: the banner right under the verdict, before the context table
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    df.to_parquet(run_dir / "records.parquet", index=False)
    real = report.run_context
    monkeypatch.setattr(report, "run_context", lambda params: {**real(params), **busy})
    monkeypatch.setattr(report, "get_ceilings", lambda **k: (_ for _ in ()).throw(RuntimeError("not measured here")))
    st = SimpleNamespace(notebook="02_fused", status="ok", params={}, html=None, ipynb=None, error=None, seconds=1.0)
    st.rows, st.timings, st.unstable = len(rows), 4, 0
    page = report.write_index(run_dir, SimpleNamespace(name="smoke", description="d"), [st], "r1", {}).read_text()
    assert 'id="threads-cut"' in page and page.index("THREADS CUT") < page.index("<h2>Context</h2>")


# --------------------------------------------------------------------------- exact baselines
def test_records_round_trip_exactly_inf_and_nan_too(tmp_path):
    vals = [1 / 3 * 1e-7, 0.1 + 0.2, 123456.78901234567, 5e-324, math.inf, -math.inf, math.nan, 2.0**-40 / 3]
    df = pd.DataFrame(
        dict(lab="l", metric="m", value=vals, samples=[[v, 1 / 7] for v in vals], stable=None, extra="")
    ).reindex(columns=ROW_COLUMNS)
    back = load_records(records.write_records_json(df, tmp_path / "records.json"))
    for a, b in zip(vals, back["value"], strict=True):
        assert (math.isnan(a) and math.isnan(b)) or a == b, (a, b)
    assert [float(s[0]) for s in back["samples"][:4]] == vals[:4]
    json.loads((tmp_path / "records.json").read_text())  # strict JSON: no NaN / Infinity tokens


def test_a_report_checks_unchanged_against_its_own_stored_baseline(tmp_path, monkeypatch):
    """3,768 of 3,787 'changed' rows were values cut to 10 decimals on the way into the baseline."""
    monkeypatch.setenv("PERFLAB_BASELINES", str(tmp_path / "baselines"))
    rng = np.random.default_rng(5)
    figures = [value("04_lowp", f"v{i}", "grad_norm_ratio", float(x)) for i, x in enumerate(rng.random(50) / 3e3)]
    base = write_run(tmp_path / "base", lab_rows("04_lowp") + figures)
    assert C.baseline_main(["refresh", "--report", str(base), "--timing-free"]) == 0
    stored = tmp_path / "baselines" / "cpu"
    cmp = C.compare(stored, base, only="accuracy")  # what `baseline check` compares with a timing-free one
    assert set(cmp.rows["verdict"]) == {"same"} and cmp.exit_code == C.EXIT_OK
    assert (cmp.rows["candidate"] == cmp.rows["base"]).all()  # bit for bit
    assert json.loads((stored / "context.json").read_text())["notebooks"][0]["params"] == {"reps": 10}
    meta = json.loads((stored / "baseline.json").read_text())
    assert meta["command"] == f"perflab baseline refresh --report {base} --timing-free"  # not "refresh refresh"


def test_direction_less_metrics_allow_float_noise():
    o = C.Options()
    d = C.direction("grad_norm_ratio", "")
    assert d == C.NEUTRAL
    assert C.judge(1 + 4e-16, math.nan, math.nan, math.nan, math.nan, d, o)[0] == "same"
    assert C.judge(1 + 1e-6, math.nan, math.nan, math.nan, math.nan, d, o)[0] == "changed"
    assert C.judge(1 + 1e-6, math.nan, math.nan, math.nan, math.nan, d, C.Options(neutral_tolerance=1e-5))[0] == "same"
    with pytest.raises(ConfigError, match="neutral_tolerance"):
        C.Options(neutral_tolerance=-1)


# --------------------------------------------------------------------------- overrides, one-sided rows
def test_overrides_are_shown_and_one_sided_rows_explained_by_the_parameter(tmp_path):
    base = write_run(tmp_path / "base", lab_rows("02_fused", shape="64x96"), params={"02_fused": {"seq": 96}})
    ctx = {**CPU, "overrides": {"seq": 128}}
    cand = write_run(tmp_path / "cand", lab_rows("02_fused", shape="64x128"), ctx, params={"02_fused": {"seq": 128}})
    cmp = C.compare(base, cand, allow_context_diff=("params",))
    gone = only(cmp, lab="02_fused", metric="params", verdict="only in base")
    assert "02_fused ran with seq 96 in the base, 128 in the candidate" in gone["note"]
    assert not gone["missing"] and cmp.exit_code == C.EXIT_OK  # explained, and this comparison was asked for
    txt = cmp.summary_text()
    assert "suite smoke, overrides none" in txt and "suite smoke, overrides seq=128" in txt
    page = cmp.to_html()
    assert "overrides seq=128" in page and "02_fused parameters" in page and "seq=96" in page


def test_an_interrupted_run_is_read(tmp_path):
    """Ctrl-C keeps the finished notebooks in <run-id>-interrupted/ (records per notebook, no gathered file)."""
    base = full_run(tmp_path / "base")
    run = tmp_path / "20261203-120000-smoke-p1-abc123-interrupted"
    for lab in LABS[:2]:
        d = run / "records" / lab
        d.mkdir(parents=True)
        ctx = {**{k: CPU[k] for k in CONTEXT_COLUMNS}, "params": {"reps": 10}}
        rows = [dict(r, samples=r.get("samples")) for r in lab_rows(lab, seed=LABS.index(lab))]
        (d / "records.json").write_text(json.dumps({"context": ctx, "rows": rows}))
    (run / "status.json").write_text(json.dumps([{"notebook": lab, "status": "ok"} for lab in LABS[:2]]))
    (run / "INTERRUPTED.txt").write_text("run r was interrupted during 04_lowp; these notebooks had finished: ...")
    cmp = C.compare(base, run)
    assert cmp.missing_labs == ["04_lowp"] and cmp.exit_code == C.EXIT_REGRESSION
    assert any("candidate is an interrupted run" in f for f in cmp.flags)
    narrowed = C.compare(base, run, labs=LABS[:2])
    assert narrowed.exit_code == C.EXIT_OK and set(narrowed.rows["verdict"]) == {"same"}


# --------------------------------------------------------------------------- the command line
def test_run_only_accepts_a_notebook_path(monkeypatch, tmp_path, capsys):
    seen = {}

    def fake_run_suite(suite, **kw):
        seen.update(kw)
        return SimpleNamespace(statuses=[], index=tmp_path / "index.html", path=tmp_path, ok=True)

    monkeypatch.setattr(runner, "run_suite", fake_run_suite)
    assert cli.main(["run", "smoke", "--only", "labs/05_memory.ipynb", "--only", "02_fused_kernels"]) == 0
    assert seen["only"] == ["05_memory", "02_fused_kernels"]


def test_ceilings_without_force_show_the_cache(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PERFLAB_CACHE", str(tmp_path))
    calls = []

    def fake_measure(dev, *, quick=False, progress=False):
        calls.append(quick)
        return ceilings_module.Ceilings(
            device=ceilings_module.device_info(dev).as_dict(),
            copy_gbs=10.0,
            copy_bytes=1,
            matmul_tflops={"fp32": 0.5},
            matmul_n={"fp32": 64},
            measured_at="2026-12-03",
            quick=quick,
        )

    monkeypatch.setattr(ceilings_module, "measure_ceilings", fake_measure)
    ceilings_module.get_ceilings(quick=True)  # what a smoke run leaves in the cache
    assert calls == [True]
    assert cli.main(["ceilings"]) == 0
    assert calls == [True], "perflab ceilings re-measured although ceilings were cached"
    assert "cached; --force re-measures" in capsys.readouterr().out
    assert cli.main(["ceilings", "--force"]) == 0 and calls == [True, False]


def test_the_setup_lets_a_cuda_torch_bring_its_triton_and_the_readme_says_what_it_installs():
    """From PyPI, torch 2.13.0 is the CUDA 13.0 build and requires triton==3.7.1 (its metadata:
    'triton==3.7.1; platform_system == "Linux"'): a project pin of another triton made `make setup`
    fail on such a machine, while the README said it brought the CUDA build."""
    import tomllib
    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parents[4]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["lab"]
    triton = next(Requirement(d) for d in deps if Requirement(d).name == "triton")
    assert triton.specifier.contains("3.7.1") and triton.specifier.contains("3.9.0"), triton
    lock = (root / "requirements" / "lab.txt").read_text().splitlines()
    triton = next(Requirement(d) for d in lock if d.startswith("triton"))
    assert triton.specifier.contains("3.7.1") and triton.specifier.contains("3.9.0"), triton
    assert "pip install -q triton==3.9.0" in (root / "Makefile").read_text()  # the CPU build brings none
    readme = (root / "README.md").read_text()
    assert "CUDA 13.0" in readme and "580" in readme, "the README must say which CUDA (driver) the GPU path needs"


def test_a_baseline_says_which_commits_its_rows_come_from(tmp_path, monkeypatch, capsys):
    """The stored CPU baseline's rows came from 3 commits, two of them dirty, and nothing said so."""
    monkeypatch.setenv("PERFLAB_BASELINES", str(tmp_path / "baselines"))
    clean = write_run(tmp_path / "clean", lab_rows("04_lowp"), {**CPU, "commit": "abc123"})
    assert C.baseline_main(["refresh", "--report", str(clean)]) == 0
    assert "WARNING" not in capsys.readouterr().err
    assert json.loads((tmp_path / "baselines" / "cpu" / "baseline.json").read_text())["commits"] == ["abc123"]
    mixed = write_run(tmp_path / "mixed", lab_rows("04_lowp"), {**CPU, "commit": "abc123"})
    df = load_records(mixed)
    df.loc[df.index[:3], "commit"] = "def456-dirty"
    df.to_parquet(mixed / "records.parquet", index=False)
    assert C.baseline_main(["refresh", "--report", str(mixed)]) == 0
    assert "rows come from abc123, def456-dirty" in capsys.readouterr().err
    C.baseline_main(["show"])
    assert "commit abc123, def456-dirty" in capsys.readouterr().out
