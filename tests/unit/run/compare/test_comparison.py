"""perflab compare / baseline on synthetic records: real regressions are caught, noise is
not, one-sided rows and device mismatches are flagged, exit codes gate, the HTML page is
self-contained."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from bokeh.models import HoverTool

from lab_utils.core.config import ConfigError
from lab_utils.core.records import CONTEXT_COLUMNS, ROW_COLUMNS, Recorder
from lab_utils.run import compare as C
from lab_utils.run.compare import baselines as baselines_module

CPU = {
    "device": "Test CPU 9000",
    "device_kind": "cpu",
    "torch_version": "2.13.0",
    "triton_version": "3.9.0",
    "cuda_version": None,
    "python_version": "3.12.1",
    "commit": "aaaa",
    "timestamp": "2026-12-02T12:00:00+0000",
}
GPU = {**CPU, "device": "NVIDIA H200", "device_kind": "cuda", "cuda_version": "12.8"}


def timing_rows(lab, exp, variant, median_ms, *, rng, n=25, noise=0.03, shape="1823x781", dtype="bfloat16", bytes=None):
    """Rows like Recorder.add_timing writes: median with samples, p20, p80, and GB/s."""
    s = median_ms * np.exp(rng.normal(0, noise, n))
    med = float(np.median(s))
    base = dict(lab=lab, experiment=exp, variant=variant, shape=shape, dtype=dtype, unit="ms", extra="")
    rows = [
        dict(base, metric="time", value=med, statistic="median", samples=s.tolist()),
        dict(base, metric="time", value=float(np.quantile(s, 0.2)), statistic="p20", samples=None),
        dict(base, metric="time", value=float(np.quantile(s, 0.8)), statistic="p80", samples=None),
    ]
    if bytes:
        rows.append(
            dict(
                base,
                metric="bandwidth",
                unit="GB/s",
                value=bytes / (med * 1e-3) / 1e9,
                statistic="median",
                samples=None,
            )
        )
    return rows


def value_row(lab, exp, variant, metric, value, unit="", dtype="bfloat16", shape="64x96", statistic="value"):
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
        samples=None,
        extra="",
    )


def write_report(folder: Path, rows: list[dict], ctx: dict, *, status=None, parquet=False) -> Path:
    """A folder shaped like a report (records + context + status)."""
    folder.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows).reindex(columns=ROW_COLUMNS)
    for c in CONTEXT_COLUMNS:
        df[c] = ctx.get(c, "")
    df["notebook"] = df["lab"]
    df["run_id"] = folder.name
    if parquet:
        df.to_parquet(folder / "records.parquet", index=False)
    else:
        (folder / "records.json").write_text(df.to_json(orient="records"))
    (folder / "context.json").write_text(json.dumps({**ctx, "run_id": folder.name}))
    labs = sorted(set(df["lab"]))
    st = status or [{"notebook": lab, "status": "ok", "error": None} for lab in labs]
    (folder / "status.json").write_text(json.dumps(st))
    return folder


def base_rows(seed=1):
    rng = np.random.default_rng(seed)
    rows = []
    rows += timing_rows("01_norms", "fwd", "triton", 2.0, rng=rng, bytes=4e8)
    rows += timing_rows("01_norms", "fwd", "eager", 5.0, rng=rng, bytes=4e8)
    rows += timing_rows("03_attention", "fwd", "sdpa", 10.0, rng=rng, shape="2x24x4096x128")
    rows += [
        value_row("01_norms", "check", "triton", "max_abs_err", 1.0e-3),
        value_row("04_quant", "recipe", "fp8_rowwise", "sqnr", 31.0, unit="dB"),
        value_row("04_quant", "recipe", "mxfp8", "sqnr", 28.0, unit="dB"),
        value_row("02_blocks", "count", "double_block", "params", 12345.0),
    ]
    return rows


def find(cmp, **kw) -> pd.Series:
    df = cmp.rows
    for k, v in kw.items():
        df = df[df[k] == v]
    assert len(df) == 1, f"expected one row for {kw}, got {len(df)}:\n{cmp.rows}"
    return df.iloc[0]


@pytest.fixture
def runs(tmp_path):
    """A base and a candidate: triton 30% slower, eager only noise, sdpa faster, error doubled,
    one SQNR slightly lower (within 0.5 dB), the other 3 dB better."""
    base = write_report(tmp_path / "base", base_rows(1), CPU)
    rng = np.random.default_rng(2)
    rows = []
    rows += timing_rows("01_norms", "fwd", "triton", 2.6, rng=rng, bytes=4e8)
    rows += timing_rows("01_norms", "fwd", "eager", 5.0, rng=rng, bytes=4e8)
    rows += timing_rows("03_attention", "fwd", "sdpa", 7.0, rng=rng, shape="2x24x4096x128")
    rows += [
        value_row("01_norms", "check", "triton", "max_abs_err", 2.0e-3),
        value_row("04_quant", "recipe", "fp8_rowwise", "sqnr", 30.8, unit="dB"),
        value_row("04_quant", "recipe", "mxfp8", "sqnr", 31.0, unit="dB"),
        value_row("02_blocks", "count", "double_block", "params", 12345.0),
    ]
    cand = write_report(tmp_path / "cand", rows, {**CPU, "commit": "bbbb"})
    return base, cand


def test_direction_table():
    assert C.direction("time", "ms") == C.LOWER_TIME
    assert C.direction("bandwidth", "GB/s").better == "higher"
    assert C.direction("throughput", "TFLOP/s").better == "higher"
    assert C.direction("pct_of_ceiling", "%").better == "higher"
    assert C.direction("max_abs_err", "") == C.LOWER_ERROR
    assert C.direction("rel_error", "") == C.LOWER_ERROR
    assert C.direction("mismatch_pct", "%") == C.LOWER_ERROR  # the name wins over a higher-is-better unit
    assert C.direction("sqnr", "dB") == C.HIGHER_DB
    assert C.direction("peak_memory", "GiB") == C.LOWER_MEMORY
    assert C.direction("params", "") == C.NEUTRAL
    assert C.direction("inference_tokens", "") == C.NEUTRAL  # 'inf' only as a whole word
    assert {r["kind"] for r in C.direction_table()} >= {"performance", "accuracy", "memory", "other"}


def test_verdicts_regression_noise_improvement(runs):
    base, cand = runs
    cmp = C.compare(base, cand)
    t = find(cmp, variant="triton", metric="time")
    assert t["verdict"] == "slower" and t["regression"]
    assert 1.2 < t["ratio"] < 1.4
    # the interval of the gain (base/cand) lies below 1 and contains the point estimate
    assert t["lo"] <= t["gain"] <= t["hi"] < 1
    assert find(cmp, variant="triton", metric="bandwidth")["verdict"] == "slower"  # borrows the time's noise
    assert find(cmp, variant="triton", metric="bandwidth")["noise"] == "from the time row's samples"
    e = find(cmp, variant="eager", metric="time")
    assert e["verdict"] == "same" and not e["regression"], e
    assert e["lo"] < 1 < e["hi"]
    assert find(cmp, variant="sdpa", metric="time")["verdict"] == "faster"
    assert find(cmp, metric="max_abs_err")["verdict"] == "less accurate"
    assert find(cmp, variant="fp8_rowwise")["verdict"] == "same"  # -0.2 dB < 0.5 dB
    assert find(cmp, variant="mxfp8")["verdict"] == "more accurate"  # +3 dB
    assert find(cmp, metric="params")["verdict"] == "same"
    assert not (cmp.rows["statistic"].isin(["p20", "p80"])).any()  # summaries of the same samples
    assert cmp.exit_code == C.EXIT_REGRESSION
    assert set(cmp.regressions["variant"]) == {"triton"}
    assert any("commit differs" in f for f in cmp.flags)
    txt = cmp.summary_text()
    assert "REGRESSIONS beyond threshold (3)" in txt and "FAIL" in txt
    assert re.search(r"01_norms/fwd/triton 1823x781 bfloat16 time\[median\].*SLOWER", txt)


def test_noise_only_differences_are_same(tmp_path):
    """Two draws of the same distributions, fairly noisy: nothing is a verdict."""
    for seed in range(3):
        rb, rc = np.random.default_rng(100 + seed), np.random.default_rng(200 + seed)
        b = sum((timing_rows("l", "e", f"v{i}", 1.0 + i, rng=rb, noise=0.08, n=15, bytes=1e8) for i in range(6)), [])
        c = sum((timing_rows("l", "e", f"v{i}", 1.0 + i, rng=rc, noise=0.08, n=15, bytes=1e8) for i in range(6)), [])
        cmp = C.compare(
            write_report(tmp_path / f"b{seed}", b, CPU),
            write_report(tmp_path / f"c{seed}", c, CPU),
            max_unstable_share=1.0,  # this test is about verdicts; the share of unstable rows has its own
        )
        # a draw whose own spread is over the stability rule is "noisy": still never slower/faster
        assert set(cmp.rows["verdict"]) <= {"same", "noisy"}, cmp.summary_text()
        assert cmp.exit_code == C.EXIT_OK
    # the same small shift with and without enough samples: significance needs samples
    rng = np.random.default_rng(5)
    tiny_b = timing_rows("l", "e", "v", 1.0, rng=rng, noise=0.2, n=5)
    tiny_c = timing_rows("l", "e", "v", 1.08, rng=rng, noise=0.2, n=5)
    cmp = C.compare(write_report(tmp_path / "tb", tiny_b, CPU), write_report(tmp_path / "tc", tiny_c, CPU))
    assert find(cmp, metric="time")["verdict"] in ("same", "noisy")  # never slower on 5 noisy samples


def test_threshold_is_settable(runs):
    base, cand = runs
    cmp = C.compare(base, cand, threshold=0.5, accuracy_threshold=1.5)
    assert find(cmp, variant="triton", metric="time")["note"] == "significant but within threshold"
    assert cmp.exit_code == C.EXIT_OK
    assert C.compare(base, cand, db_threshold=5.0).rows.query("variant == 'mxfp8'").iloc[0]["verdict"] == "same"


def test_rank_method_agrees(runs):
    base, cand = runs
    cmp = C.compare(base, cand, method="rank")
    t = find(cmp, variant="triton", metric="time")
    assert t["verdict"] == "slower" and t["p_value"] < 0.01
    e = find(cmp, variant="eager", metric="time")
    assert e["verdict"] == "same" and e["p_value"] > 0.05


def test_bootstrap_is_reproducible_and_covers():
    rng = np.random.default_rng(0)
    b, c = rng.lognormal(0, 0.05, 30), 1.25 * rng.lognormal(0, 0.05, 30)
    assert C.bootstrap_ratio(b, c) == C.bootstrap_ratio(b, c)
    lo, hi = C.bootstrap_ratio(b, c)
    assert lo < np.median(c) / np.median(b) < hi and lo > 1.1 and hi < 1.4


def test_one_sided_and_failed_rows(tmp_path):
    rng = np.random.default_rng(3)
    b = (
        timing_rows("l", "e", "kept", 1.0, rng=rng)
        + timing_rows("l", "e", "dropped", 1.0, rng=rng)
        + timing_rows("l", "e", "breaks", 1.0, rng=rng)
    )
    c = (
        timing_rows("l", "e", "kept", 1.0, rng=rng)
        + timing_rows("l", "e", "added", 1.0, rng=rng)
        + [
            dict(
                lab="l",
                experiment="e",
                variant="breaks",
                shape="1823x781",
                dtype="bfloat16",
                metric="time",
                value=math.nan,
                unit="ms",
                statistic="failed",
                samples=None,
                extra='{"reason": "OOM"}',
            )
        ]
    )
    cmp = C.compare(write_report(tmp_path / "b", b, CPU), write_report(tmp_path / "c", c, CPU))
    assert find(cmp, variant="dropped")["verdict"] == "only in base"
    assert find(cmp, variant="added")["verdict"] == "only in candidate"
    br = find(cmp, variant="breaks")
    assert br["verdict"] == "failed" and br["regression"]
    assert any("1 row(s) only in base, 1 only in candidate" in f for f in cmp.flags)
    assert cmp.exit_code == C.EXIT_REGRESSION
    txt = cmp.summary_text()
    assert "only in base (1):" in txt and "only in candidate (1):" in txt
    page = cmp.to_html()
    assert page.count('<tr data-verdict="only in base">') == 1 and page.count('<tr data-verdict="failed">') == 1


def test_duplicate_keys_are_numbered_not_mixed(tmp_path):
    rows = [value_row("l", "e", "v", "max_abs_err", 1e-3), value_row("l", "e", "v", "max_abs_err", 5e-3)]
    cmp = C.compare(write_report(tmp_path / "b", rows, CPU), write_report(tmp_path / "c", rows[::-1], CPU))
    assert sorted(cmp.rows["occurrence"]) == [1, 2]
    assert set(cmp.rows["verdict"]) == {"less accurate", "more accurate"}
    assert any("repeat a key" in f for f in cmp.flags)


def test_zero_errors(tmp_path):
    b = [value_row("l", "bits", "a", "max_abs_err", 0.0), value_row("l", "bits", "b", "max_abs_err", 0.0)]
    c = [value_row("l", "bits", "a", "max_abs_err", 0.0), value_row("l", "bits", "b", "max_abs_err", 1e-6)]
    cmp = C.compare(write_report(tmp_path / "b", b, CPU), write_report(tmp_path / "c", c, CPU))
    assert find(cmp, variant="a")["verdict"] == "same"
    assert find(cmp, variant="b")["verdict"] == "less accurate"


def test_device_mismatch_is_flagged_not_mixed(tmp_path, runs):
    base, _ = runs
    rng = np.random.default_rng(9)
    rows = (
        timing_rows("01_norms", "fwd", "triton", 0.01, rng=rng, bytes=4e8)
        + timing_rows("01_norms", "fwd", "eager", 0.02, rng=rng, bytes=4e8)
        + [value_row("01_norms", "check", "triton", "max_abs_err", 1.0e-3)]
    )
    gpu = write_report(tmp_path / "gpu", rows, GPU)
    cmp = C.compare(base, gpu, labs=("01_norms",))  # the GPU run ran lab 01 only
    assert cmp.device_mismatch and any(f.startswith("DEVICE DIFFERS") for f in cmp.flags)
    assert find(cmp, variant="triton", metric="time")["verdict"] == "device differs"
    assert find(cmp, metric="max_abs_err")["verdict"] == "same"  # accuracy rows still compared
    assert any("software differs: cuda" in f for f in cmp.flags)
    assert cmp.exit_code == C.EXIT_INCOMPARABLE
    assert "NOT COMPARABLE" in cmp.summary_text()
    allowed = C.compare(base, gpu, allow_device_mismatch=True, labs=("01_norms",))
    assert find(allowed, variant="triton", metric="time")["verdict"] == "faster"
    assert allowed.exit_code == C.EXIT_OK


def test_mixed_devices_in_one_side_are_refused(tmp_path, runs):
    base, _ = runs
    folder = tmp_path / "mixed"
    write_report(folder, [value_row("l", "e", "v", "max_abs_err", 1e-3)], CPU)
    df = pd.read_json(folder / "records.json")
    other = df.copy()
    other["device"] = "NVIDIA H200"
    pd.concat([df, other]).to_json(folder / "records.json", orient="records", date_format="iso")
    (folder / "context.json").unlink()
    df2 = df.copy()
    df2["torch_version"] = "2.11.0"
    pd.concat([df, df2]).to_json(tmp_path / "mixed_sw.json", orient="records", date_format="iso")
    cmp = C.compare(base, tmp_path / "mixed_sw.json")
    assert any("different torch values (2.11.0, 2.13.0)" in f for f in cmp.flags)
    with pytest.raises(C.CompareError, match="2 devices"):
        C.compare(base, folder)
    assert C.main([str(base), str(folder), "--out", str(tmp_path / "o")]) == C.EXIT_USAGE


def test_main_exit_codes_and_outputs(tmp_path, runs, capsys):
    base, cand = runs
    out = tmp_path / "out"
    assert C.main([str(base), str(cand), "--out", str(out)]) == C.EXIT_REGRESSION
    printed = capsys.readouterr().out
    assert "FAIL" in printed and "compare.html" in printed
    assert {p.name for p in out.iterdir()} == {"compare.html", "summary.txt", "compare.json"}
    data = json.loads((out / "compare.json").read_text())
    assert data["exit_code"] == 1 and data["counts"]["slower"] == 2
    # a records file reads like its folder: the same regressions are found through it
    files = [str(base / "records.json"), str(cand / "records.json"), "--out", str(out), "--quiet"]
    assert C.main(files) == C.EXIT_REGRESSION
    assert json.loads((out / "compare.json").read_text())["counts"] == data["counts"]
    # a second draw of the base (noise only), read from parquet: nothing beyond noise
    pq = write_report(tmp_path / "pq", base_rows(7), CPU, parquet=True)
    assert C.main([str(base), str(pq), "--out", str(out), "--quiet"]) == C.EXIT_OK
    again = json.loads((out / "compare.json").read_text())["counts"]
    assert again == {"same": len(C.compare(base, pq).rows)}, again
    assert C.main([str(base), str(cand), "--gate", "none", "--out", str(out), "--quiet"]) == C.EXIT_OK
    assert C.main([str(base), str(cand), "--gate", "accuracy", "--out", str(out), "--quiet"]) == C.EXIT_REGRESSION
    assert (
        C.main([str(base), str(cand), "--rows", "performance", "--gate", "accuracy", "--out", str(out), "--quiet"])
        == C.EXIT_OK
    )
    assert C.main([str(base), str(tmp_path / "nope"), "--out", str(out)]) == C.EXIT_USAGE
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        C.main([str(base)])
    assert e.value.code == 2


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"threshold": -0.1}, "threshold"),
        ({"confidence": 1.5}, "confidence"),
        ({"method": "ttest"}, "method"),
        ({"bootstrap": 10}, "bootstrap"),
        ({"gate": "some"}, "gate"),
        ({"db_threshold": math.nan}, "db_threshold"),
    ],
)
def test_bad_options_name_the_parameter(kw, param):
    with pytest.raises(ConfigError) as e:
        C.Options(**kw)
    assert param in str(e.value)


def test_cli_bad_option_value_exits_2(runs, tmp_path, capsys):
    base, cand = runs
    assert C.main([str(base), str(cand), "--threshold", "-1", "--out", str(tmp_path)]) == C.EXIT_USAGE
    assert "threshold" in capsys.readouterr().err


def test_failed_notebook_in_candidate_gates(tmp_path, runs):
    base, _ = runs
    rows = [r for r in base_rows(1) if r["lab"] != "03_attention"]
    st = [{"notebook": n, "status": "ok"} for n in ("01_norms", "02_blocks", "04_quant")] + [
        {"notebook": "03_attention", "status": "failed", "error": "RuntimeError: boom"}
    ]
    cand = write_report(tmp_path / "c", rows, CPU, status=st)
    cmp = C.compare(base, cand)
    assert cmp.failed_notebooks == ["03_attention"]
    assert cmp.exit_code == C.EXIT_REGRESSION and "03_attention" in cmp.result_line()
    assert any("candidate: notebook(s) failed" in f for f in cmp.flags)


def test_html_is_self_contained(tmp_path, runs):
    import panel  # noqa: F401  (once imported, panel adds relative-URL scripts to bokeh's resources)

    base, cand = runs
    page = C.compare(base, cand).to_html()
    assert not re.search(r"<script[^>]*\bsrc=", page), "no script may be loaded from a file beside the page"
    assert '<table id="rows" class="sortable"' in page and "Bokeh" in page
    assert "embed_items" in page
    # no tag loads anything from a URL (BokehJS itself only names a MathJax CDN in code that math text
    # would use; the browser test checks that no request leaves the file)
    assert not re.search(r"""<(script|link|img|iframe|source)\b[^>]*\b(src|href)\s*=\s*["'](https?:)?//""", page, re.I)
    assert "@import" not in page
    assert len(page) < 3_000_000
    # every row is in the table
    rows = C.compare(base, cand).rows
    assert page.count("<tr data-verdict=") == len(rows)
    assert page.count('<tr data-verdict="slower">') == (rows["verdict"] == "slower").sum() == 2


def test_baseline_refresh_check_show(tmp_path, runs, monkeypatch, capsys):
    base, cand = runs
    monkeypatch.setenv("PERFLAB_BASELINES", str(tmp_path / "baselines"))
    assert C.baseline_kind(CPU) == "cpu" and C.baseline_kind(GPU) == "cuda-nvidia-h200"
    assert C.baseline_main(["refresh", "--report", str(base)]) == 0
    stored = tmp_path / "baselines" / "cpu"
    meta = json.loads((stored / "baseline.json").read_text())
    assert meta["kind"] == "cpu" and meta["rows"] == len(base_rows(1)) and not meta["timing_free"]
    assert C.baseline_main(["check", "--report", str(base), "--out", str(tmp_path / "o1")]) == C.EXIT_OK
    assert C.baseline_main(["check", "--report", str(cand), "--out", str(tmp_path / "o2")]) == C.EXIT_REGRESSION
    assert (tmp_path / "o2" / "compare.html").exists()
    # timing-free: only load-independent rows are stored, and the check compares only those
    assert C.baseline_main(["refresh", "--report", str(base), "--timing-free", "--kind", "cpu-tf"]) == 0
    assert not (tmp_path / "baselines" / "cpu-tf" / "records.json").exists()
    tf = pd.read_parquet(tmp_path / "baselines" / "cpu-tf" / "records.parquet")
    assert set(tf["metric"]) == {"max_abs_err", "sqnr", "params"}
    capsys.readouterr()
    rc = C.baseline_main(["check", "--report", str(cand), "--kind", "cpu-tf", "--out", str(tmp_path / "o3")])
    out = capsys.readouterr().out
    assert "timing-free" in out and rc == C.EXIT_REGRESSION  # max_abs_err doubled
    assert "time[median]" not in out
    assert C.baseline_main(["show"]) == 0
    assert "cpu-tf:" in capsys.readouterr().out
    assert C.baseline_main(["check", "--report", str(cand), "--kind", "cuda-none", "--out", str(tmp_path)]) == 2
    # a report with a failed notebook is not stored without --allow-failed
    st = json.loads((cand / "status.json").read_text())
    st[0]["status"] = "failed"
    (cand / "status.json").write_text(json.dumps(st))
    assert C.baseline_main(["refresh", "--report", str(cand), "--kind", "x"]) == 2
    assert C.baseline_main(["refresh", "--report", str(cand), "--kind", "x", "--allow-failed"]) == 0


def test_performance_rows_without_samples_do_not_gate(tmp_path):
    b = [value_row("00_ceilings", "ceilings", "copy", "bandwidth", 20.0, unit="GB/s", statistic="median")]
    c = [value_row("00_ceilings", "ceilings", "copy", "bandwidth", 15.0, unit="GB/s", statistic="median")]
    cmp = C.compare(write_report(tmp_path / "b", b, CPU), write_report(tmp_path / "c", c, CPU))
    r = find(cmp, metric="bandwidth")
    assert r["verdict"] == "slower" and not r["regression"] and "not gated" in r["note"]
    assert cmp.exit_code == C.EXIT_OK
    assert "worse but not gated (1)" in cmp.summary_text()


def test_baseline_refresh_and_check_run_the_suite(tmp_path, runs, monkeypatch):
    """Without --report, refresh and check run the suite through lab_utils.run.runner.run_suite."""
    from types import SimpleNamespace

    base, cand = runs
    calls = []

    def fake_run(suite, params, out, only=None):
        calls.append((suite, params, out, only))
        path = base if len(calls) == 1 else cand
        return SimpleNamespace(path=path, ok=True, run_id=path.name, index=path / "index.html")

    monkeypatch.setenv("PERFLAB_BASELINES", str(tmp_path / "baselines"))
    monkeypatch.setattr(baselines_module, "run_for_baseline", fake_run)
    assert C.baseline_main(["refresh", "--suite", "smoke", "--param", "reps=3"]) == 0
    assert C.baseline_main(["check", "--only", "01_norms", "--out", str(tmp_path / "o")]) == C.EXIT_REGRESSION
    assert calls == [("smoke", ["reps=3"], None, None), ("smoke", None, None, ["01_norms"])]
    meta = json.loads((tmp_path / "baselines" / "cpu" / "baseline.json").read_text())
    assert meta["run_id"] == "base" and "--param reps=3" in meta["command"]


def test_rows_told_apart_by_extra(tmp_path):
    """Labs keep e.g. the mask in ``extra``: rows sharing a key match by it, whatever the order."""

    def rows(order, err_causal):
        out = []
        for mask in order:
            r = value_row(
                "03_attention", "correctness", "sdpa", "max_abs_err", err_causal if mask == "causal" else 1e-3
            )
            r["extra"] = json.dumps(
                {
                    "mask": mask,
                    "reason": f"run at {mask}",
                    "atol": 1e-3 if mask == "full" else 2e-3,
                    "verdict": "ok" if (mask, err_causal) != ("causal", 5e-3) else "FAIL",
                }
            )
            out.append(r)
        return out

    b = rows(["full", "causal", "mmdit"], 1e-3)
    c = rows(["mmdit", "causal", "full"], 5e-3)
    cmp = C.compare(write_report(tmp_path / "b", b, CPU), write_report(tmp_path / "c", c, CPU))
    assert sorted(cmp.rows["ident"]) == ["mask=causal", "mask=full", "mask=mmdit"]
    assert set(cmp.rows["occurrence"]) == {1}
    assert find(cmp, ident="mask=causal")["verdict"] == "less accurate"
    assert find(cmp, ident="mask=full")["verdict"] == "same"
    assert any("told apart by their extra field(s): mask" in f for f in cmp.flags)
    assert "[mask=causal]" in cmp.summary_text()


def flag_rows(rows: list[dict], variant: str, reason: str) -> list[dict]:
    """Mark one variant's timing rows unstable, as Recorder.add_timing does for an unstable timing."""
    out = []
    for r in rows:
        r = dict(r)
        if r["metric"] in ("time", "bandwidth"):
            bad = r["variant"] == variant
            r["stable"], r["stability"] = (False, reason) if bad else (True, "p80/p20 = 1.05")
        out.append(r)
    return out


def test_unstable_rows_are_noisy_never_slower(tmp_path):
    """A 1.5x slower timing that its own run flagged unstable is "noisy", not "slower"; a stable
    regression beside it is still caught; a record without the verdict (older schema) still reads."""
    rng = np.random.default_rng(11)
    base, cand = [], []
    for i in range(5):
        base += timing_rows("02", "sweep", f"v{i}", 1.0 + i, rng=rng, noise=0.01, bytes=1e8)
        cand += timing_rows(
            "02", "sweep", f"v{i}", (1.0 + i) * (1.5 if i in (0, 1) else 1.0), rng=rng, noise=0.01, bytes=1e8
        )
    reason = "3 of 25 samples stalled (up to 32 ms against a median of 1.5 ms)"
    cmp = C.compare(
        write_report(tmp_path / "b", flag_rows(base, "none", ""), CPU),
        write_report(tmp_path / "c", flag_rows(cand, "v0", reason), CPU),
    )
    t = find(cmp, variant="v0", metric="time")
    assert t["verdict"] == C.NOISY and not t["regression"] and "stalled" in t["note"] and "slower" in t["note"]
    assert find(cmp, variant="v0", metric="bandwidth")["verdict"] == C.NOISY
    assert find(cmp, variant="v1", metric="time")["verdict"] == "slower"  # stable: a real regression
    assert cmp.exit_code == C.EXIT_REGRESSION and set(cmp.regressions["variant"]) == {"v1"}
    assert cmp.stability["candidate"].unstable == 1 and cmp.stability["candidate"].timings == 5
    assert "noisy: unstable timings, not judged (2)" in cmp.summary_text()
    assert 'data-verdict="noisy" class="noisy"' in cmp.to_html()
    assert cmp.to_json()["stability"]["candidate"]["share"] == pytest.approx(0.2)


def test_a_run_with_many_unstable_timings_is_not_comparable(tmp_path, capsys):
    rng = np.random.default_rng(12)
    base, cand = [], []
    for i in range(4):
        base += timing_rows("02", "sweep", f"v{i}", 1.0 + i, rng=rng, noise=0.01)
        cand += timing_rows("02", "sweep", f"v{i}", (1.0 + i) * (1.6 if i == 3 else 1.0), rng=rng, noise=0.01)
    b = write_report(tmp_path / "b", base, CPU)
    flagged = flag_rows(flag_rows(cand, "v0", "dispersion p80/p20 = 3.1 > 1.2"), "v1", "bimodal")
    flagged = [
        dict(r, stable=False, stability="bimodal") if r["variant"] == "v0" and "stable" in r else r for r in flagged
    ]
    c = write_report(tmp_path / "c", flagged, CPU)  # v0 and v1 unstable: 2 of 4 timings
    cmp = C.compare(b, c)
    assert cmp.exit_code == C.EXIT_INCOMPARABLE and "candidate" in cmp.too_noisy
    assert "50%" in cmp.result_line() and "NOT COMPARABLE" in cmp.result_line()
    # the stable 1.6x slower row is shown as slower but not gated: this run's timings are no evidence
    t = find(cmp, variant="v3", metric="time")
    assert t["verdict"] == "slower" and not t["regression"]
    assert C.main([str(b), str(c), "--out", str(tmp_path / "o"), "--quiet"]) == C.EXIT_INCOMPARABLE
    assert "too many unstable timings" in capsys.readouterr().out
    assert C.compare(b, c, max_unstable_share=0.6).exit_code == C.EXIT_REGRESSION
    # accuracy rows are unaffected by a busy machine: comparing only them is fine
    assert C.compare(b, c, only="accuracy").exit_code == C.EXIT_OK
    with pytest.raises(ConfigError, match="max_unstable_share"):
        C.Options(max_unstable_share=1.5)


def test_old_records_and_the_stored_baseline_still_read(tmp_path):
    """Records written before rows carried a verdict load, and their timings are judged from samples."""
    from lab_utils.core.records import load_records

    root = Path(__file__).resolve().parents[4] / "parameterized" / "baselines" / "cpu"
    side = C.load_side(root, "baseline")
    assert len(side.rows) and "stable" in side.rows.columns
    rows = timing_rows("01_norms", "fwd", "triton", 2.0, rng=np.random.default_rng(4))
    old_dir = tmp_path / "old"
    write_report(old_dir, rows, CPU)
    recs = [
        {k: v for k, v in r.items() if k not in ("stable", "stability")}
        for r in json.loads((old_dir / "records.json").read_text())
    ]
    (old_dir / "records.json").write_text(json.dumps(recs))  # the schema before the verdict
    old = load_records(old_dir)
    assert "stable" in old.columns and old["stable"].isna().all()
    judged = C.load_side(old_dir, "old").rows
    assert judged.loc[judged["statistic"] == "median", "stable"].notna().all()


def test_errors_of_timing_models_follow_the_timings():
    """A fitted communication model's error or a plan's prediction error moves with the machine's
    load: compared as performance, and never stored in a timing-free baseline."""
    import pandas as pd

    from lab_utils.run.compare.baselines import timing_free
    from lab_utils.run.compare.rules import direction

    for metric in ("prediction_error", "rebased_prediction_error", "fit_median_error", "model_on_plan_error"):
        assert direction(metric, "%").kind == "performance", metric
    assert direction("max_abs_err", "").kind == "accuracy"
    rows = pd.DataFrame(dict(metric=["prediction_error", "max_abs_err"], unit=["%", ""]))
    assert list(timing_free(rows).metric) == ["max_abs_err"]


def test_ratio_plot_keeps_its_data_area_with_long_labels(tmp_path):
    """Long row labels widen compare.html's ratio plot instead of squeezing its
    data area (it was ~150 px of a fixed 1,100); a tick label is cut, the hover keeps the row."""
    from lab_utils.run.compare.html import LABEL_CHARS, RATIO_FRAME_WIDTH, _ratio_plot

    rng = np.random.default_rng(3)
    long = "explore_profile_with_a_rather_long_experiment_name"
    op = "aten::_scaled_dot_product_flash_attention_for_cpu_backward"

    def rows(ms):
        return timing_rows("01_training_step", long, op, ms, rng=rng)

    ctx = {"device": "cpu", "device_kind": "cpu"}
    base = write_report(tmp_path / "b", rows(10.0), ctx)
    cand = write_report(tmp_path / "c", rows(12.0), ctx)
    p = _ratio_plot(C.compare(base, cand))
    assert p.frame_width == RATIO_FRAME_WIDTH >= 600  # the data area; the labels add to the figure's width
    (full,) = p.y_range.factors
    assert len(full) > LABEL_CHARS and len(p.yaxis[0].major_label_overrides[full]) == LABEL_CHARS
    assert p.select_one({"type": HoverTool}).tooltips[0] == ("row", "@label")


def attention_check_rows(triton: dict[str, float | None]) -> list[dict]:
    """Lab 03's correctness rows as its study records them: per path and tensor the error
    against float64 with the check's verdict; a path that cannot run here (Triton in float32
    on a CPU) is "skipped" with no value.  ``triton``: tensor -> error, None for skipped."""
    rec = Recorder(lab="03_attention")
    for tensor in ("out", "dq"):
        rec.add("correctness", "sdpa", "max_abs_err", 1e-6, "", dtype="float32", tensor=tensor, verdict="ok")
    for tensor, err in triton.items():
        rec.add(
            "correctness",
            "triton",
            "max_abs_err",
            math.nan if err is None else err,
            "",
            dtype="float32",
            tensor=tensor,
            verdict="skipped" if err is None else "ok",
        )
    return rec.rows


@pytest.mark.parametrize("gate", ["all", "accuracy"])
def test_a_row_skipped_on_both_sides_reads_skipped_and_never_gates(tmp_path, gate):
    rows = attention_check_rows({"out": None, "dq": None})
    cmp = C.compare(
        write_report(tmp_path / "b", rows, CPU),
        write_report(tmp_path / "c", rows, {**CPU, "commit": "bbbb"}),
        gate=gate,
    )
    skipped = cmp.rows[cmp.rows.variant == "triton"]
    assert len(skipped) == 2 and set(skipped.verdict) == {"skipped"}
    assert not skipped.regression.any() and not skipped.improvement.any() and not skipped.missing.any()
    assert set(cmp.rows[cmp.rows.variant == "sdpa"].verdict) == {"same"}
    assert cmp.counts() == {"same": 2, "skipped": 2} and cmp.exit_code == C.EXIT_OK
    txt = cmp.summary_text()
    assert "skipped in base and candidate (not compared) (2):" in txt and "NO VALUE" not in txt
    assert "no value (" not in txt and txt.rstrip().endswith("OK: no regression beyond threshold (exit 0)")
    assert cmp.to_html().count('<tr data-verdict="skipped">') == 2


def test_a_row_skipped_on_one_side_only_has_no_value_and_does_not_gate(tmp_path):
    """Skipped in one run, measured in the other: one side has no figure, so "no value" (shown
    under its heading), never gated, whichever side skipped."""
    ran = attention_check_rows({"out": 2e-6, "dq": 3e-6})
    skipped = attention_check_rows({"out": None, "dq": None})
    for base, cand in ((skipped, ran), (ran, skipped)):
        folder = tmp_path / f"{len(list(tmp_path.iterdir()))}"
        cmp = C.compare(write_report(folder / "b", base, CPU), write_report(folder / "c", cand, CPU))
        tri = cmp.rows[cmp.rows.variant == "triton"]
        assert len(tri) == 2 and set(tri.verdict) == {"no value"} and not tri.regression.any()
        assert cmp.exit_code == C.EXIT_OK and "no value (2):" in cmp.summary_text()
    # skipped in both but one tensor measured in both: only the skipped rows read skipped
    cmp = C.compare(
        write_report(tmp_path / "mb", attention_check_rows({"out": None, "dq": 3e-6}), CPU),
        write_report(tmp_path / "mc", attention_check_rows({"out": None, "dq": 9e-6}), CPU),
    )
    tri = cmp.rows[cmp.rows.variant == "triton"].set_index("ident").verdict.to_dict()
    assert tri == {"tensor=out": "skipped", "tensor=dq": "less accurate"}
    assert cmp.exit_code == C.EXIT_REGRESSION  # the measured row still gates


def test_a_run_with_unstable_timings_at_the_limit_still_gates(tmp_path):
    """One of four timings unstable is 25%, the limit itself (``max_unstable_share``): the run is
    still comparable and a stable 1.6x slower timing beside it gates; two of four (50%) would not."""
    rng = np.random.default_rng(13)
    base, cand = [], []
    for i in range(4):
        base += timing_rows("02", "sweep", f"v{i}", 1.0 + i, rng=rng, noise=0.01)
        cand += timing_rows("02", "sweep", f"v{i}", (1.0 + i) * (1.6 if i == 3 else 1.0), rng=rng, noise=0.01)
    b = write_report(tmp_path / "b", base, CPU)
    c = write_report(tmp_path / "c", flag_rows(cand, "v0", "bimodal"), CPU)
    cmp = C.compare(b, c)
    assert (cmp.stability["candidate"].unstable, cmp.stability["candidate"].timings) == (1, 4)
    assert cmp.too_noisy == {} and cmp.incomparable() == []
    t = find(cmp, variant="v3", metric="time")
    assert t["verdict"] == "slower" and t["regression"]
    assert cmp.exit_code == C.EXIT_REGRESSION and set(cmp.regressions["variant"]) == {"v3"}


def test_rows_are_listed_worst_verdict_first_then_by_lab(tmp_path):
    """Labs named in the reverse of their verdicts' order: the listing follows the verdicts (a
    loss of accuracy, a change, a missing row, no value, the improvements, unchanged last) and
    breaks a tie (two improvements) by lab."""
    b = [
        value_row("a_same", "e", "v", "params", 1.0),
        value_row("b_more_accurate", "e", "v", "max_abs_err", 2e-3),
        value_row("c_faster", "e", "v", "time", 2.0, unit="ms"),
        value_row("d_no_value", "e", "v", "params", 1.0),
        value_row("e_only_in_base", "e", "v", "params", 1.0),
        value_row("f_changed", "e", "v", "params", 1.0),
        value_row("g_less_accurate", "e", "v", "max_abs_err", 1e-3),
    ]
    c = [
        value_row("a_same", "e", "v", "params", 1.0),
        value_row("b_more_accurate", "e", "v", "max_abs_err", 1e-3),
        value_row("c_faster", "e", "v", "time", 1.0, unit="ms"),
        value_row("d_no_value", "e", "v", "params", math.nan),
        value_row("f_changed", "e", "v", "params", 2.0),
        value_row("g_less_accurate", "e", "v", "max_abs_err", 2e-3),
    ]
    cmp = C.compare(write_report(tmp_path / "b", b, CPU), write_report(tmp_path / "c", c, CPU), labs=())
    assert list(cmp.rows["lab"]) == [
        "g_less_accurate",
        "f_changed",
        "e_only_in_base",
        "d_no_value",
        "b_more_accurate",
        "c_faster",
        "a_same",
    ]
    assert list(cmp.rows["verdict"]) == [
        "less accurate", "changed", "only in base", "no value", "more accurate", "faster", "same",
    ]  # fmt: skip


def test_a_flag_for_repeated_keys_names_the_side_and_count_only_when_a_key_repeats(tmp_path, runs):
    assert not any("repeat a key" in f for f in C.compare(*runs).flags)
    once = value_row("l", "e", "v", "max_abs_err", 1e-3)
    rows = [once, value_row("l", "e", "v", "max_abs_err", 5e-3), value_row("l", "e", "w", "max_abs_err", 1e-3)]
    cmp = C.compare(write_report(tmp_path / "b", rows, CPU), write_report(tmp_path / "c", [once], CPU))
    repeats = [f for f in cmp.flags if "repeat a key" in f]
    assert len(repeats) == 1 and repeats[0].startswith("base: 1 row(s) repeat a key")


def test_outputs_are_written_into_a_folder_made_with_its_parents(tmp_path, runs):
    out = tmp_path / "not" / "yet" / "there"
    paths = C.compare(*runs).write(out)
    assert {p.name for p in paths.values()} == {"compare.html", "summary.txt", "compare.json"}
    assert all(p.parent == out and p.stat().st_size > 0 for p in paths.values())


def test_a_slower_time_from_zero_with_samples_kept_is_not_gated_and_says_why(tmp_path):
    """0 ms (eight samples of 0) against 1 ms: slower by its point values, no ratio of samples to
    measure the noise with, so not gated; the note says the samples were kept."""
    t = value_row("01", "fwd", "v", "time", 0.0, unit="ms", statistic="median")
    b = [dict(t, samples=[0.0] * 8, stable=True, stability="ok")]
    c = [dict(t, value=1.0, samples=[1.0] * 8, stable=True, stability="ok")]
    cmp = C.compare(write_report(tmp_path / "b", b, CPU), write_report(tmp_path / "c", c, CPU))
    r = find(cmp, metric="time")
    assert (r["verdict"], r["regression"]) == ("slower", False)
    assert r["note"] == "samples kept but not usable for a ratio, so no noise estimate: not gated"
