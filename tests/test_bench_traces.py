"""benchmarks/bench_traces.py: its measuring subprocess runs (it once died on the parent's
required --traces, and every cell of the table was that error), and a run with a failed
measurement exits 1 without overwriting the stored result."""

from __future__ import annotations

import importlib.util
import json

import pytest
from test_trace_cli import job

from lab_utils.run.runner import ROOT


@pytest.fixture
def bench(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_traces", ROOT / "benchmarks" / "bench_traces.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "OUT", tmp_path / "out" / "bench_traces.json")
    return mod


def _jobs(tmp_path):
    root = tmp_path / "traces"
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        job(root / name / "rank0.json", steps=3)
    return root


def test_the_measuring_subprocess_reads_and_times_a_job(bench, tmp_path):
    got = bench._measure("perflab", [_jobs(tmp_path) / "a"], 1)
    assert "error" not in got, got
    assert got["seconds"] > 0 and got["repeats"] == 1 and got["rss_after_imports_mb"] > 0, got


def test_a_failed_measurement_exits_1_and_keeps_the_stored_result(bench, tmp_path, monkeypatch, capsys):
    root = _jobs(tmp_path)
    ok = {"seconds": 1.0, "peak_mb": 10.0, "children_peak_mb": 0.0, "rss_after_imports_mb": 100.0, "repeats": 1}
    monkeypatch.setattr(bench, "_measure", lambda tool, folders, repeats: ok if tool == "perflab" else {"error": "x"})
    assert bench.main(["--traces", str(root)]) == 1
    assert "3 measurement(s) failed" in capsys.readouterr().err and not bench.OUT.exists()
    monkeypatch.setattr(bench, "_measure", lambda tool, folders, repeats: ok)
    assert bench.main(["--traces", str(root)]) == 0
    rows = json.loads(bench.OUT.read_text())["rows"]
    assert [r["trace"] for r in rows] == ["a", "b", "all 2 jobs (one process)"]
    assert "| a | " in capsys.readouterr().out


def test_traces_is_required_of_the_parent(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main([])
    assert e.value.code == 2 and "--traces" in capsys.readouterr().err
