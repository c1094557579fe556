"""The headless runner on a throwaway suite with a deliberately failing notebook."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lab_utils.core.config import ConfigError
from lab_utils.run import cli, runner
from lab_utils.run.nbtools import make_notebook
from lab_utils.run.runner import plan, run_suite
from lab_utils.run.suites import SuiteError, load_suite, parse_overrides

CONFIG = "lab_utils.studies.ceilings:CeilingsLabConfig"  # any LabConfig with 'device' and 'reps' fields


def _write_nb(path, body, params='device = "cpu"\nreps = 5'):
    import nbformat

    nb = make_notebook([("md", "# test"), ("params", params), ("code", body)], config=CONFIG)
    path.write_text(nbformat.writes(nb))


@pytest.fixture
def suite_dir(tmp_path, monkeypatch):
    pdir = tmp_path / "parameterized"
    (pdir / "sets" / "good").mkdir(parents=True)
    nbs = tmp_path / "labs"
    nbs.mkdir()
    _write_nb(
        nbs / "good.ipynb",
        "from lab_utils.core.records import Recorder\n"
        "import holoviews as hv\nfrom lab_utils.core.plots import init\ninit()\n"
        "rec = Recorder('good', params={'reps': reps})\n"
        "rec.add('e', 'v', 'value', float(reps), 'count')\nrec.save()\n"
        "hv.Curve([(0, 0), (1, reps)])",
    )
    _write_nb(nbs / "bad.ipynb", "raise ValueError('deliberate failure ' + str(reps))")
    (pdir / "sets" / "good" / "small.yaml").write_text("reps: 7\n")
    (pdir / "mini.yaml").write_text(
        yaml.safe_dump(
            {
                "description": "test suite",
                "notebooks": [
                    {"notebook": str(nbs / "bad.ipynb")},
                    {"notebook": str(nbs / "good.ipynb"), "set": "small"},
                ],
            }
        )
    )
    monkeypatch.setenv("PERFLAB_PARAMETERIZED", str(pdir))
    return tmp_path


def test_failing_notebook_does_not_stop_the_suite(suite_dir):
    out = suite_dir / "reports"
    res = run_suite("mini", out_dir=out, progress=False)
    assert not res.ok
    st = {s.notebook: s for s in res.statuses}
    assert st["bad"].status == "failed" and "deliberate failure 5" in st["bad"].error
    assert st["good"].status == "ok" and st["good"].rows == 1
    # complete report, nothing left half-written
    assert res.path.exists() and not list(out.glob(".tmp-*"))
    assert (out / "latest").resolve() == res.path.resolve()
    for f in (
        "index.html",
        "context.json",
        "status.json",
        "records.parquet",
        "records.json",
        "notebooks/good.ipynb",
        "notebooks/bad.ipynb",
        "html/good.html",
        "html/bad.html",
    ):
        assert (res.path / f).exists(), f
    index = (res.path / "index.html").read_text()
    assert "1 of 2 FAILED" in index and "deliberate failure" in index and 'href="html/good.html"' in index
    recs = json.loads((res.path / "records.json").read_text())
    assert len(recs) == 1 and recs[0]["value"] == 7.0 and recs[0]["notebook"] == "good"
    assert recs[0]["run_id"] == res.run_id and recs[0]["device_kind"] in ("cpu", "cuda")
    ctx = json.loads((res.path / "context.json").read_text())
    assert ctx["suite"] == "mini" and ctx["notebooks"][1]["params"]["reps"] == 7
    page = (res.path / "html" / "good.html").read_text()
    assert not re.search(r"<script[^>]+src=[\"']https?://", page), "report pages must not load remote scripts"
    assert "cdn.holoviz.org" not in page and "unpkg.com" not in page


def test_cli_exit_codes_and_overrides(suite_dir, capsys):
    rc = cli.main(
        ["run", "mini", "--out", str(suite_dir / "r"), "--no-progress", "--param", "reps=4", "--only", "good"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "report:" in out and "ok     good" in out
    assert cli.main(["run", "mini", "--out", str(suite_dir / "r2"), "--no-progress"]) == 1
    assert cli.main(["run", "--list"]) == 0
    assert "mini: test suite" in capsys.readouterr().out


def test_validation_happens_before_anything_runs(suite_dir, capsys):
    out = suite_dir / "never"
    with pytest.raises(SuiteError, match="'nope' does not exist; known suites: mini"):
        run_suite("nope", out_dir=out)
    with pytest.raises(SuiteError, match="--param bogus"):
        run_suite("mini", overrides={"bogus": 1}, out_dir=out)
    with pytest.raises(ConfigError, match="'reps' = 1"):
        run_suite("mini", overrides={"reps": 1}, out_dir=out)
    with pytest.raises(SuiteError, match="--only"):
        run_suite("mini", only=["missing"], out_dir=out)
    assert not out.exists()
    assert cli.main(["run", "mini", "--param", "reps=1", "--out", str(out)]) == 2
    assert "'reps' = 1 is not allowed" in capsys.readouterr().err


def test_suite_file_errors(suite_dir):
    pdir = suite_dir / "parameterized"
    (pdir / "broken.yaml").write_text("notebooks: []\n")
    with pytest.raises(SuiteError, match="non-empty list"):
        load_suite("broken")
    (pdir / "noset.yaml").write_text(
        yaml.safe_dump({"notebooks": [{"notebook": str(suite_dir / "labs" / "good.ipynb"), "set": "huge"}]})
    )
    with pytest.raises(SuiteError, match="parameter set 'huge'.*known sets: small"):
        load_suite("noset")
    (pdir / "badparam.yaml").write_text(
        yaml.safe_dump({"notebooks": [{"notebook": str(suite_dir / "labs" / "good.ipynb"), "params": {"nonsense": 3}}]})
    )
    with pytest.raises(SuiteError, match="'nonsense'.*its parameters: device, reps"):
        plan(load_suite("badparam"))
    (pdir / "missing.yaml").write_text(yaml.safe_dump({"notebooks": ["labs/none.ipynb"]}))
    with pytest.raises(SuiteError, match="does not exist"):
        load_suite("missing")


def test_parse_overrides():
    assert parse_overrides(["a=1", "b=[1, 2]", "c=bfloat16", "d=true"]) == {
        "a": 1,
        "b": [1, 2],
        "c": "bfloat16",
        "d": True,
    }
    with pytest.raises(SuiteError, match="key=value"):
        parse_overrides(["novalue"])


def test_a_failed_notebooks_cause_reaches_its_page_and_the_index(tmp_path, monkeypatch):
    """A lab raising a named error: the index's headline row carries the one-line cause (the first
    line of the error, not only status.json), and the exported notebook shows the traceback."""
    pdir = tmp_path / "parameterized"
    pdir.mkdir()
    nb = tmp_path / "broken.ipynb"
    _write_nb(
        nb,
        "class RankCrashed(RuntimeError):\n    pass\n"
        "raise RankCrashed('rank 1 died (SIGKILL) in step ' + str(reps) + '\\nsecond line of detail')",
    )
    (pdir / "one.yaml").write_text(yaml.safe_dump({"description": "t", "notebooks": [{"notebook": str(nb)}]}))
    monkeypatch.setenv("PERFLAB_PARAMETERIZED", str(pdir))
    res = run_suite("one", out_dir=tmp_path / "reports", progress=False)
    (st,) = res.statuses
    assert st.status == "failed" and st.error.startswith("RankCrashed: rank 1 died (SIGKILL) in step 5")
    index = (res.path / "index.html").read_text()
    head = index[index.index('<table id="headlines">') : index.index("<h2>Context</h2>")]
    assert '<span class="cause">RankCrashed: rank 1 died (SIGKILL) in step 5</span>' in head
    assert "second line" not in head  # one line in the headline row; the full error is in the table below
    assert "second line of detail" in index
    assert "RankCrashed" in (res.path / "html" / "broken.html").read_text()


def test_one_line_cause_is_the_first_line_shortened():
    from lab_utils.run.report import one_line_cause

    assert one_line_cause("\n  KeyError: 'x'\n  more") == "KeyError: 'x'"
    assert one_line_cause(None) == "" and one_line_cause("") == ""
    long = one_line_cause("E: " + "x" * 500, limit=40)
    assert len(long) == 40 and long.endswith("\u2026")


def test_real_suites_are_valid():
    """Every committed suite loads and validates (parameter names and values) without running."""
    from pathlib import Path

    from lab_utils.run.suites import list_suites

    names = list_suites()
    assert "smoke" in names and "gpu" in names
    for name in names:
        s = load_suite(name)
        if name == "gpu":
            continue  # GPU parameter sets may name device='cuda', refused on a CPU machine by design
        plan(s)
    smoke = {e.stem for e in load_suite("smoke").entries}
    labs = {p.stem for p in (Path(__file__).resolve().parents[2] / "labs").glob("[0-9][0-9]_*.ipynb")}
    assert labs <= smoke, f"labs missing from the smoke suite: {sorted(labs - smoke)}"


# ------------------------------------------------------------------ run-room robustness
ART_BODY = (
    "import os, pathlib\nfrom lab_utils.core.records import Recorder\n"
    "d = pathlib.Path(os.environ['PERFLAB_ARTIFACTS_DIR']) / 'traces'\nd.mkdir(parents=True, exist_ok=True)\n"
    "trace = d / 'step.trace.json'\ntrace.write_text('{\"traceEvents\": []}')\n"
    "rec = Recorder('art', params={'reps': reps})\n"
    "rec.add('artifacts', 'profile', 'trace_file', trace.stat().st_size, 'bytes', statistic='file', path=str(trace))\n"
    "rec.save()\nprint('trace:', trace)"
)


@pytest.fixture
def art_suite(suite_dir):
    """A suite of one fast notebook that leaves a profiler-like trace under its artifacts folder."""
    _write_nb(suite_dir / "labs" / "art.ipynb", ART_BODY)
    (suite_dir / "parameterized" / "art.yaml").write_text(
        yaml.safe_dump({"description": "artifacts", "notebooks": [{"notebook": str(suite_dir / "labs" / "art.ipynb")}]})
    )
    return suite_dir


def test_artifact_links_point_into_the_final_report(art_suite):
    """The trace's path in the records, the notebook's printed path and the index link all name
    the file inside the finished report folder, not the temporary folder that is gone."""
    res = run_suite("art", out_dir=art_suite / "reports", progress=False, keep_traces=True)
    assert res.ok
    recs = json.loads((res.path / "records.json").read_text())
    path = json.loads(recs[0]["extra"])["path"]
    assert ".tmp-" not in path and Path(path).is_file() and Path(path).is_relative_to(res.path)
    for f in ("records.json", "html/art.html", "notebooks/art.ipynb", "index.html"):
        assert ".tmp-" not in (res.path / f).read_text(), f
    index = (res.path / "index.html").read_text()
    assert 'href="artifacts/art/traces/step.trace.json"' in index
    assert (
        str(res.path / "artifacts" / "art" / "traces" / "step.trace.json") in (res.path / "html/art.html").read_text()
    )


def test_run_ids_are_unique_within_a_second(art_suite, monkeypatch):
    monkeypatch.setattr(runner.time, "strftime", lambda *a, **k: "20260101-000000")
    ids = {runner.new_run_id("art") for _ in range(50)}
    assert len(ids) == 50
    out = art_suite / "r"
    rid, tmp = runner._make_run_dir(out, "fixed-id", "art")
    with pytest.raises(SuiteError, match="in use"):
        runner._make_run_dir(out, "fixed-id", "art")  # never share another run's temporary folder


def test_two_runs_started_at_once(art_suite):
    """Two `perflab run`s in the same second (the clock pinned to one second in both) each get
    their own run id, temporary folder and complete report."""
    out = art_suite / "reports"
    code = (
        "import sys, time\ntime.strftime = lambda *a, **k: '20260101-000000'\n"
        "from lab_utils.run.cli import main\n"
        f"sys.exit(main(['run', 'art', '--out', {str(out)!r}, '--no-progress']))"
    )
    root = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=1200) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    reports = sorted(p for p in out.iterdir() if p.is_dir() and not p.is_symlink())
    assert len(reports) == 2 and not list(out.glob(".tmp-*")), reports
    run_ids = set()
    for r in reports:
        recs = json.loads((r / "records.json").read_text())
        assert len(recs) == 1 and recs[0]["run_id"] == r.name  # each report holds its own run's rows only
        assert Path(json.loads(recs[0]["extra"])["path"]).is_relative_to(r)
        run_ids.add(r.name)
    assert len(run_ids) == 2 and (out / "latest").resolve().name in run_ids


def test_interrupted_run_cleans_up_and_says_where(suite_dir, monkeypatch, capsys):
    """Ctrl-C during the second notebook: `latest` still names the last complete run, no
    `.tmp-` folder is left, the finished notebook is kept, and the CLI prints one line."""
    out = suite_dir / "reports"
    calls = []

    def fake_execute(src, dst, **kw):
        calls.append(Path(src).stem)
        if len(calls) in (2, 4):  # the second notebook of each interrupted run
            raise KeyboardInterrupt
        shutil.copy(src, dst)

    first = run_suite("mini", out_dir=out, progress=False, only=["good"])  # a complete run to keep as latest
    monkeypatch.setattr(runner.pm, "execute_notebook", fake_execute)
    with pytest.raises(runner.RunInterrupted) as e:
        run_suite("mini", out_dir=out, progress=False)
    msg = str(e.value)
    assert "interrupted during good" in msg and "1 of 2 notebooks done" in msg and "unchanged" in msg
    assert (out / "latest").resolve() == first.path.resolve()
    assert not list(out.glob(".tmp-*")) and not list(out.glob(".latest-*"))
    kept = next(out.glob("*-interrupted"))
    assert str(kept) in msg and (kept / "notebooks" / "bad.ipynb").exists()
    assert not (kept / "notebooks" / "good.ipynb").exists() and not (kept / "records" / "good").exists()
    assert (kept / "INTERRUPTED.txt").exists()
    capsys.readouterr()
    assert cli.main(["run", "mini", "--out", str(out), "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "interrupted during good" in err
    assert (out / "latest").resolve() == first.path.resolve() and not list(out.glob(".tmp-*"))


def test_timing_threads_option_is_validated_and_recorded(art_suite):
    with pytest.raises(ValueError, match="timing_threads"):
        run_suite("art", out_dir=art_suite / "never", timing_threads="many")
    assert not (art_suite / "never").exists() or not any((art_suite / "never").iterdir())
    res = run_suite("art", out_dir=art_suite / "reports", progress=False, timing_threads=1)
    ctx = json.loads((res.path / "context.json").read_text())
    if ctx["device_kind"] == "cpu":
        assert ctx["timing"]["cpu_threads"] == {**ctx["timing"]["cpu_threads"], "threads": 1}
    assert "unstable timings" in (res.path / "index.html").read_text()


def _headline_records():
    """One lab's worth of rows per lab, each carrying the figure its headline shows."""
    from lab_utils.core.records import Recorder

    out = []
    r = Recorder("00_ceilings")
    r.add("ceilings", "copy", "bandwidth", 12.5, "GB/s", statistic="median")
    r.add("ceilings", "matmul-fp32", "throughput", 0.75, "TFLOP/s", statistic="median")
    out.append(r)
    r = Recorder("01_training_step")
    r.add("step", "profile", "step_time", 123.0, "ms", statistic="median", samples=[120, 123, 125], stable=True)
    r.add("mfu", "measured matmul ceiling", "pct_of_peak", 4.5, "%", statistic="total")
    r.add("memory", "profile", "peak_allocated", 321.0, "MiB", statistic="max")
    r.add("phases", "backward", "time", 61.5, "ms", statistic="median")
    out.append(r)
    r = Recorder("02_fused_kernels")
    r.add("rms_norm", "triton", "speedup_vs_eager", 2.25, "x", statistic="median", stable=True)
    r.add("rms_norm", "triton", "pct_of_ceiling", 37.0, "%", statistic="median", stable=True)
    out.append(r)
    r = Recorder("03_attention")
    r.add("sweep", "flash", "pct_of_ceiling", 55.0, "%", statistic="median", stable=True)
    r.add("sweep", "math", "pct_of_ceiling", 8.0, "%", statistic="median", stable=True)
    out.append(r)
    r = Recorder("04_low_precision")
    r.add("matmul", "fp8_row", "sqnr", 31.5, "dB")
    out.append(r)
    r = Recorder("05_memory")
    r.add("policies", "none", "peak_bytes", 64 * 2**20, "B")
    r.add("what_fits", "full", "max_batch", 17, "samples", shape="1024px")
    out.append(r)
    r = Recorder("06_distributed")
    r.add("overlap", "ddp", "overlap_fraction", 0.42, "")
    out.append(r)
    r = Recorder("07_stability")
    r.add("precision_summary", "bf16", "loss_gap_vs_fp32", 0.0123, "")
    out.append(r)
    r = Recorder("08_plan")
    r.add("base", "step", "time", 100.0, "ms", statistic="sum of phase medians")
    r.add("plans", "encoders=precomputed", "step_time", 70.0, "ms", statistic="predicted", rank=1)
    r.add("verify", "encoders=precomputed", "step_time", 80.0, "ms", statistic="measured", stable=True)
    r.add("verify", "encoders=precomputed", "prediction_error", 14.3, "%")
    out.append(r)
    return out


def test_index_leads_with_each_labs_headline(tmp_path):
    """The index of a report built from records carries a headline row per lab
    (step time and MFU, peak memory and what fits, best plan and its predicted / measured gain,
    worst kernel vs ceiling, unstable share), above the context."""
    from lab_utils.core.records import load_records
    from lab_utils.run import report
    from lab_utils.run.runner import NotebookStatus

    statuses = []
    for r in _headline_records():
        d = tmp_path / "records" / r.lab
        r.save(d / "records.json")
        statuses.append(NotebookStatus(r.lab, f"labs/{r.lab}.ipynb", status="ok"))
    statuses.append(NotebookStatus("09_broken", "labs/09_broken.ipynb", status="failed", error="boom"))
    df = report.gather_records(tmp_path, statuses, "run-1")
    assert set(df.notebook) == {s.notebook for s in statuses[:-1]}
    suite = type("S", (), {"name": "synthetic", "description": "headlines"})()
    page = report.write_index(tmp_path, suite, statuses, "run-1", {}).read_text()
    head = page[page.index('<table id="headlines">') : page.index("<h2>Context</h2>")]
    for text in (
        "copy ceiling: <b>12.5 GB/s</b>",
        "step time: <b>123 ms</b>",
        "MFU: <b>4.5 %</b>",
        "peak memory: <b>321 MiB</b>",
        "largest phase: <b>backward 50% of the step</b>",
        "best speed-up vs eager: <b>triton x2.25</b>",
        "worst kernel vs ceiling: <b>triton 37 %</b>",
        "worst path vs ceiling: <b>math 8 %</b>",
        "lowest matmul SQNR: <b>fp8_row 31.5 dB</b>",
        "what fits at 1024px: <b>batch 17 (full)</b>",
        "peak memory, no checkpointing: <b>64 MiB</b>",
        "communication overlapped: <b>42%</b>",
        "largest loss gap vs fp32: <b>bf16 +0.0123</b>",
        "best plan: <b>encoders=precomputed</b>",
        "predicted +30% step time",
        "measured gain: <b>+20%</b>",
        "prediction error: <b>14.3 %</b>",
        "unstable timings: <b>0 of 1 (0%)</b>",
    ):
        assert text in head, text
    assert head.count("<tr>") == 1 + len(statuses) and '<span class="failed">failed</span>' in head
    written = _headline_records()
    back = load_records(tmp_path)  # the gathered records read back, row for row
    assert len(back) == sum(len(r.rows) for r in written) and set(back.lab) == {r.lab for r in written}
    assert back.set_index(["lab", "experiment", "variant", "metric"]).loc[
        ("08_plan", "verify", "encoders=precomputed", "prediction_error"), "value"
    ] == pytest.approx(14.3)


def test_headline_figures_read_plainly():
    """A headline figure reads as a plain number with its unit (no 7.17e+03 ms)."""
    from lab_utils.studies.headline import fmt

    assert (fmt(7168.9, "ms"), fmt(123.0, "ms"), fmt(0.0848, "%"), fmt(float("nan"))) == (
        "7,169 ms",
        "123 ms",
        "0.0848 %",
        "n/a",
    )


def test_a_size_reads_in_mib_below_one_gib_and_in_gib_from_there():
    """Memory figures in binary units: MiB up to 1 GiB, GiB from it on (a 12B model's state in GiB)."""
    from lab_utils.studies.headline import fmt_bytes

    assert fmt_bytes(64 * 2**20) == "64 MiB" and fmt_bytes(1.5 * 2**20) == "1.5 MiB"
    assert fmt_bytes(2**30 - 2**20) == "1,023 MiB" and fmt_bytes(2**30) == "1 GiB"
    assert fmt_bytes(190e9) == "177 GiB" and fmt_bytes(float("nan")) == "n/a"
