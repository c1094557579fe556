"""Pins of what the comparison treats as comparable, matched or timing-free, on hand-made rows and
contexts.

* A CUDA version on one side only (a CUDA torch against a CPU build) is a software difference;
  a Triton version missing on one side is not (older records lack it).
* Rows sharing a key are told apart by categorical ``extra`` fields (a sequence length), never
  by measured floats or outcome flags: a row whose figure changed must still meet its old self.
* A timing-free baseline keeps accuracy figures and counts, and drops timings and memory.
* ``perflab baseline refresh`` warns when the rows are not one clean commit's, and stores
  nothing from a run that failed unless asked to.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from lab_utils.run.compare import baselines as baselines_module
from lab_utils.run.compare.baselines import baseline_main, timing_free
from lab_utils.run.compare.coverage import context_diff
from lab_utils.run.compare.options import Options
from lab_utils.run.compare.rules import EXIT_OK, EXIT_REGRESSION
from lab_utils.run.compare.sides import Side, identity_keys


def _side(label: str, **context) -> Side:
    return Side(label=label, source=label, rows=pd.DataFrame(), context=context)


def test_a_cuda_version_on_one_side_only_is_a_software_difference():
    base = _side("base", cuda_version="12.4", torch_version="2.9", triton_version="3.5")
    cand = _side("cand", cuda_version="", torch_version="2.9", triton_version="")
    diff = context_diff(base, cand, Options(), device_differs=False)
    assert diff.software == ["cuda 12.4 -> "]
    # the same pair on different devices: the device difference covers the CUDA stack
    assert context_diff(base, cand, Options(), device_differs=True).software == []


def _rows(extras: list[dict]) -> pd.DataFrame:
    key = dict(lab="03", experiment="attn", variant="triton", shape="", dtype="bf16", metric="time", statistic="median")
    return pd.DataFrame([{**key, "extra": json.dumps(e)} for e in extras])


def test_identity_keys_are_categorical_fields_only():
    df = _rows(
        [
            {"seq": 64, "mask": "causal", "gbs": 1.25, "fused": True, "verdict": "ok"},
            {"seq": 128, "mask": "causal", "gbs": 2.5, "fused": False, "verdict": "slow"},
        ]
    )
    assert identity_keys(df) == ["seq"]


def test_timing_free_keeps_accuracy_and_counts_only():
    rows = pd.DataFrame(
        {
            "metric": ["time", "peak_memory", "rel_error", "sqnr", "flops", "bandwidth"],
            "unit": ["ms", "MiB", "", "dB", "", "GB/s"],
        }
    )
    assert timing_free(rows)["metric"].tolist() == ["rel_error", "sqnr", "flops"]


def test_timing_free_judges_a_row_by_its_unit_and_its_declaration_too():
    """A metric named for nothing is judged by its unit (``step`` in ms is a timing), and a row
    declaring itself reported (a share of the step) moves with the timings: both are dropped."""
    rows = pd.DataFrame(
        {
            "metric": ["step", "tokens", "overlap_of_streams", "max_abs_err"],
            "unit": ["ms", "", "", ""],
            "extra": ["", "", json.dumps({"reported": True}), ""],
        }
    )
    assert timing_free(rows)["metric"].tolist() == ["tokens", "max_abs_err"]


def write_report(folder: Path, commits: list[str]) -> Path:
    """A finished report of one lab: one row per commit given (a run over several commits)."""
    folder.mkdir(parents=True)
    rows = [
        dict(lab="02_b", experiment="count", variant=f"v{i}", shape="", dtype="", metric="params", statistic="value",
             value=float(i), unit="", samples=None, extra="", commit=c, device="Test CPU", device_kind="cpu")
        for i, c in enumerate(commits)
    ]  # fmt: skip
    (folder / "records.json").write_text(json.dumps(rows))
    (folder / "context.json").write_text(json.dumps({"device": "Test CPU", "device_kind": "cpu", "run_id": "r1"}))
    (folder / "status.json").write_text(json.dumps([{"notebook": "02_b", "status": "ok"}]))
    return folder


@pytest.mark.parametrize(
    "commits, warned",
    [(["aaaa"], False), (["aaaa", "bbbb"], True), (["aaaa-dirty"], True), (["aaaa", "bbbb", "cccc"], True)],
)
def test_a_refresh_warns_when_its_rows_are_not_one_clean_commits(tmp_path, monkeypatch, capsys, commits, warned):
    monkeypatch.setenv("PERFLAB_BASELINES", str(tmp_path / "baselines"))
    report = write_report(tmp_path / "r1", commits)
    assert baseline_main(["refresh", "--report", str(report)]) == EXIT_OK
    err = capsys.readouterr().err
    assert ("WARNING" in err) == warned
    if warned:
        assert f"its rows come from {', '.join(sorted(commits))};" in err
    meta = json.loads((tmp_path / "baselines" / "cpu" / "baseline.json").read_text())
    assert meta["commits"] == sorted(commits) and meta["rows"] == len(commits)


def test_a_refresh_whose_run_failed_stores_nothing_and_exits_1(tmp_path, monkeypatch, capsys):
    report = write_report(tmp_path / "r1", ["aaaa"])
    monkeypatch.setenv("PERFLAB_BASELINES", str(tmp_path / "baselines"))
    failed = SimpleNamespace(path=report, ok=False, run_id="r1", index=report / "index.html")
    monkeypatch.setattr(baselines_module, "run_for_baseline", lambda *a, **k: failed)
    assert baseline_main(["refresh", "--suite", "smoke"]) == EXIT_REGRESSION == 1
    assert "had failures; baseline not stored" in capsys.readouterr().err
    assert not (tmp_path / "baselines" / "cpu").exists()
    assert baseline_main(["refresh", "--suite", "smoke", "--allow-failed"]) == EXIT_OK  # asked for: stored
    assert (tmp_path / "baselines" / "cpu" / "baseline.json").exists()


def test_the_baseline_command_reads_the_command_line_without_a_list(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PERFLAB_BASELINES", str(tmp_path / "none"))
    monkeypatch.setattr(sys, "argv", ["perflab-baseline", "show"])
    assert baseline_main() == EXIT_OK
    assert capsys.readouterr().out == f"no baselines under {tmp_path / 'none'}\n"
