"""benchmarks/bench_traces.py: its measuring subprocess runs (it once died on the parent's
required --traces, and every cell of the table was that error), and a run with a failed
measurement exits 1 without overwriting the stored result."""

from __future__ import annotations

import importlib.util
import json

import pytest
from unit.run.test_trace_cli_figures import job

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


def test_a_synthetic_rank_reads_back_what_was_written_and_summarises_small(bench, tmp_path):
    """``synth_traces`` writes a rank whose kernels (count, summed time) and steps are known; perflab
    reads exactly those; the summary a worker sends back is a small fraction of the trace."""
    import pickle

    from lab_utils.run.trace_cli import analyse_rank

    w = bench.synth().write_rank(tmp_path / "r.json.gz", 3.0, rank=2, world=4)
    summary = analyse_rank((w.path, 0, True, None))
    assert summary.rank == 2 and summary.steps == w.steps and summary.device == "NVIDIA H100 80GB HBM3"
    kernels = summary.tables["kernels"]
    assert int(kernels["count"].sum()) == w.kernels
    assert float(kernels["total"].sum()) == pytest.approx(w.kernel_us, rel=1e-9)
    assert len(pickle.dumps(summary)) < 0.05 * w.json_bytes
    assert summary.tables["roofline"]["part"].eq("H100 SXM5").all()


def test_scale_measures_what_is_missing_and_writes_as_it_goes(bench, tmp_path, monkeypatch, capsys):
    """``--scale`` makes the inputs under --work once, stores each measurement as soon as it is
    taken, and a second run measures only what the first did not (or failed)."""
    calls = []

    def fake(cmd, timeout_s):
        calls.append(cmd)
        failed = "hta" in " ".join(cmd) and len(calls) < 2 * len(bench.SCALE_TOOLS)
        return {"seconds": 1.0, "peak_mb": 10.0, "rc": 1 if failed else 0} | ({"error": "x"} if failed else {})

    monkeypatch.setattr(bench, "run_measured", fake)
    args = ["--scale", "--sizes", "1", "--ranks", "2", "--rank-mb", "0.5", "--work", str(tmp_path / "w"),
            "--out", str(tmp_path / "scale.json")]  # fmt: skip
    assert bench.main(args) == 0
    first = json.loads((tmp_path / "scale.json").read_text())["rows"]
    per_run = 2 * len(bench.SCALE_TOOLS)  # two inputs, every tool
    assert len(calls) == per_run and {r["tool"] for r in first} == set(bench.SCALE_TOOLS)
    assert {r["input"] for r in first} == {"1 rank, 1 MB", "2 ranks x 0.5 MB"}
    assert all(r["json_mb"] > 0 for r in first) and (tmp_path / "w" / "ranks-2x0.5MB" / "data").is_dir()
    assert bench.main(args) == 0
    assert len(calls) == per_run + 2  # only the two failed HTA measurements again
    assert "| 1 rank, 1 MB |" in capsys.readouterr().out


def test_the_read_floor_decodes_every_event_of_every_rank(bench, tmp_path):
    """The floor tool is the reader's streaming with nothing kept: it still decodes each event."""
    import subprocess

    d = tmp_path / "job"
    written = [bench.synth().write_rank(d / f"rank-{r}.json.gz", 0.3, rank=r, world=2, seed=r) for r in range(2)]
    cmd = bench.tool_command("floor", str(d), tmp_path, workers=1, mem_gb=1.0)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True, cwd=ROOT)
    assert out.stdout.split() == [str(sum(w.events for w in written)), "events"], out.stdout


def test_the_memory_of_a_process_tree_is_summed(bench):
    """A parent whose child holds 200 MB: the sampled peak counts the child."""
    import sys

    child = "import time; x = bytearray(200 << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep(0.5)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    got = bench.run_measured([sys.executable, "-c", parent], 60)
    assert got["rc"] == 0 and got["peak_mb"] > 200, got


def test_repeated_runs_are_their_median_with_the_range_and_a_failed_run_is_the_row(bench):
    runs = [{"seconds": s, "peak_mb": p, "rc": 0, "loadavg_before": [i], "loadavg_after": [i + 0.5]}
            for i, (s, p) in enumerate([(3.0, 100.0), (1.0, 300.0), (2.0, 200.0)])]  # fmt: skip
    row = bench.repeated(runs)
    assert row["seconds"] == 2.0 and row["samples_s"] == [3.0, 1.0, 2.0] and row["peak_mb"] == 300.0
    assert row["loadavg_before"] == [0] and row["loadavg_after"] == [2.5]
    table = bench.scale_table([{"input": "x", "json_mb": 1.0, "tool": "perflab", **row}])
    assert "| 2.0 (1.0-3.0) |" in table
    failed = {"seconds": 9.0, "peak_mb": 1.0, "rc": 1, "error": "boom"}
    assert bench.repeated([runs[0], failed]) == failed
