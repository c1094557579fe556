"""``perflab trace`` and ``perflab trace diff`` on small traces written here (never ../shared)."""

from __future__ import annotations

import json
import math
import re

import pytest

from lab_utils.core.config import ConfigError
from lab_utils.core.records import load_records
from lab_utils.run.cli import main as perflab
from lab_utils.traces import TraceAnalysis


def _x(cat, name, ts, dur, pid=1, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def job(path, *, gemm_us=200.0, rank=0, world=1, steps=4):
    """``steps`` ProfilerSteps of 1000 us, each launching a GEMM (``gemm_us``) and an add (50+s us)
    inside a ``## forward ##`` range; the kernels run on stream 7 of device 0."""
    ev = []
    for s in range(steps):
        t0, c, e = s * 1000, s * 10 + 1, 100 + s * 10
        ev += [
            _x("user_annotation", f"ProfilerStep#{s + 1}", t0, 1000),
            _x("user_annotation", "## forward ##", t0 + 10, 400),
            _x("cpu_op", "aten::mm", t0 + 20, 20, **{"External id": e}),
            _x("cuda_runtime", "cudaLaunchKernel", t0 + 25, 4, correlation=c, **{"External id": e}),
            _x(
                "kernel",
                "sm80_xmma_gemm",
                t0 + 50,
                gemm_us,
                pid=0,
                tid=7,
                correlation=c,
                stream=7,
                device=0,
                **{"External id": e},
            ),  # fmt: skip
            _x("cpu_op", "aten::add", t0 + 500, 20, **{"External id": e + 1}),
            _x("cuda_runtime", "cudaLaunchKernel", t0 + 505, 4, correlation=c + 1, **{"External id": e + 1}),
            _x(
                "kernel",
                "elementwise_kernel_add",
                t0 + 600,
                50 + s,
                pid=0,
                tid=7,
                correlation=c + 1,
                stream=7,
                device=0,
                **{"External id": e + 1},
            ),  # fmt: skip
        ]
    doc = {"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": world}, "traceEvents": ev}
    path.write_text(json.dumps(doc))
    return path


def test_trace_prints_the_summary_and_writes_records_html_and_json(tmp_path, capsys):
    out = tmp_path / "out"
    assert perflab(["trace", str(job(tmp_path / "a.json")), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rank 0" in text and "4 steps" in text and "sm80_xmma_gemm" in text
    assert "per step (ms)" in text and "idle split" in text and "collectives: none" in text
    rows = load_records(out / "records.json")
    kt = rows[(rows["metric"] == "kernel:sm80_xmma_gemm")].iloc[0]
    assert kt["value"] == pytest.approx(0.2) and list(kt["samples"]) == pytest.approx([0.2] * 4)
    span = rows[rows["metric"] == "kernel_time"].iloc[0]  # gemm 200 + add 50..53 us per step
    assert list(span["samples"]) == pytest.approx([0.25, 0.251, 0.252, 0.253])
    page = (out / "trace.html").read_text()
    assert "Bokeh" in page and not re.search(r"<script[^>]*\bsrc=", page), "the page loads no external script"
    assert "sm80_xmma_gemm" in page
    fig = json.loads((out / "trace.json").read_text())
    shares = fig["categories"]
    assert sum(r["pct"] for r in shares) == pytest.approx(100.0)
    assert perflab(["trace", str(tmp_path / "a.json"), "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["ranks"] == [0] and printed["top_kernels"]["0"][0]["name"] == "sm80_xmma_gemm"
    assert printed["top_kernels"]["0"][0]["count"] == 4


def test_diff_reads_slower_on_the_planted_2x_kernel_and_same_elsewhere(tmp_path, capsys):
    a, b = job(tmp_path / "a.json"), job(tmp_path / "b.json", gemm_us=400.0)
    code = perflab(["trace", "diff", str(a), str(b), "--out", str(tmp_path / "d"), "--json"])
    res = json.loads(capsys.readouterr().out)
    assert code == 1, "a 2x slower kernel is a regression"
    verdict = {r["metric"]: r["verdict"] for r in res["rows"]}
    assert verdict["kernel:sm80_xmma_gemm"] == "slower" and verdict["category:matmul"] == "slower"
    assert verdict["phase:forward"] == "slower"
    assert verdict["kernel:elementwise_kernel_add"] == "same"
    assert verdict["category:elementwise/activation"] == "same"
    assert (tmp_path / "d" / "compare.html").exists()


def test_same_trace_diffs_clean(tmp_path, capsys):
    a = job(tmp_path / "a.json")
    assert perflab(["trace", "diff", str(a), str(a), "--out", str(tmp_path / "d")]) == 0
    assert "slower" not in capsys.readouterr().out.split("verdicts:")[1].splitlines()[0]


def test_folder_of_two_ranks_is_mapped_per_rank_and_reduced_to_one_job(tmp_path, capsys):
    folder = tmp_path / "job"
    folder.mkdir()
    job(folder / "worker0.pt.trace.json", rank=0, world=2)
    job(folder / "worker1.pt.trace.json", rank=1, world=2, gemm_us=300.0)
    assert perflab(["trace", str(folder), "--out", str(tmp_path / "o"), "--executor", "pool"]) == 0
    text = capsys.readouterr().out
    assert "2 rank(s)" in text and "rank 1" in text
    rows = load_records(tmp_path / "o" / "records.json")
    gemm = rows[rows["metric"] == "kernel:sm80_xmma_gemm"].set_index("variant")["value"]
    assert gemm.to_dict() == pytest.approx({"rank0": 0.2, "rank1": 0.3})
    direct = TraceAnalysis(folder).temporal().set_index("rank")["compute"]  # the same figures read in one process
    fig = json.loads((tmp_path / "o" / "trace.json").read_text())
    assert {r["rank"]: r["compute"] for r in fig["temporal"]} == pytest.approx(direct.to_dict())


def test_a_missing_path_is_a_usage_error_naming_it(tmp_path, capsys):
    assert perflab(["trace", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "nope" in capsys.readouterr().err


def test_planner_takes_a_traces_measured_phase_times_as_its_step(tmp_path):
    from lab_utils.plan.from_trace import profile_from_trace
    from lab_utils.plan.planner import ALL_PHASES

    prof = profile_from_trace(job(tmp_path / "a.json", gemm_us=300.0))
    assert set(prof.phases) == set(ALL_PHASES)
    # the GEMM is launched inside "## forward ##"; the add outside every range: it stays in "other"
    assert prof.phases["forward"] == pytest.approx(0.3) and prof.phases["backward"] == 0.0
    assert prof.step_samples == pytest.approx((1.0,) * 4)  # four 1000 us ProfilerStep windows
    assert prof.total_ms == pytest.approx(1.0) and prof.phases["other"] == pytest.approx(0.7)
    assert prof.phase_samples["forward"] == pytest.approx([0.3] * 4)
    assert math.isnan(prof.flops)
    with pytest.raises(ConfigError, match="statistic"):
        profile_from_trace(tmp_path / "a.json", statistic="mean")
