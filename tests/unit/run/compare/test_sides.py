"""lab_utils.run.compare.sides on records written here: a side's device and run id from its
context, an interrupted run's folder (records per notebook, no gathered file) read with each
notebook's parameters, and rows that repeat a key numbered in order of appearance."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lab_utils.run.compare.sides import Side, as_samples, baseline_kind, load_side, normalise, resolve_source

CONTEXT = {"device": "Test CPU 9000", "device_kind": "cpu", "torch_version": "2.13.0", "commit": "aaaa"}


def value_row(lab: str, variant: str, value: float, metric: str = "params") -> dict:
    return dict(lab=lab, experiment="count", variant=variant, shape="", dtype="", metric=metric,
                statistic="value", value=value, unit="", samples=None, extra="")  # fmt: skip


@pytest.mark.parametrize(
    "context, device", [({"device": "NVIDIA H200"}, "NVIDIA H200"), ({"device": None}, ""), ({}, "")]
)
def test_a_sides_device_is_its_contexts_or_empty(context, device):
    assert Side(label="base", source="x", rows=pd.DataFrame(), context=context).device == device


def test_a_sides_run_id_is_its_contexts_then_its_baselines_then_its_folders_name():
    def run_id(context, meta):
        return Side(label="base", source="/r/20261203-smoke", rows=pd.DataFrame(), context=context, meta=meta).run_id

    assert run_id({"run_id": "ctx"}, {"run_id": "meta"}) == "ctx"
    assert run_id({}, {"run_id": "meta"}) == "meta"
    assert run_id({}, {}) == "20261203-smoke"


@pytest.mark.parametrize(
    "context, kind",
    [
        ({"device_kind": "cpu", "device": "AMD EPYC 9654"}, "cpu"),  # every CPU shares one baseline
        ({"device_kind": "cuda", "device": "NVIDIA H200"}, "cuda-nvidia-h200"),
        ({"device_kind": "cuda"}, "cuda-unknown"),
        ({}, "unknown-unknown"),
    ],
)
def test_a_baseline_kind_is_cpu_or_the_device_kind_and_model(context, kind):
    assert baseline_kind(context) == kind


def interrupted_run(folder: Path) -> Path:
    """Ctrl-C's folder: two finished notebooks' own records files (one ran with parameters, one
    without), no gathered records, the interruption's note."""
    for lab, params, n in (("01_a", {"reps": 10}, 2), ("02_b", None, 3)):
        d = folder / "records" / lab
        d.mkdir(parents=True)
        ctx = {**CONTEXT, **({"params": params} if params else {})}
        rows = [value_row(lab, f"v{i}", float(i)) for i in range(n)]
        (d / "records.json").write_text(json.dumps({"context": ctx, "rows": rows}))
    (folder / "INTERRUPTED.txt").write_text("interrupted during 03_c\n")
    return folder


def test_an_interrupted_run_reads_each_notebooks_records_and_parameters(tmp_path):
    side = load_side(interrupted_run(tmp_path / "r1-interrupted"), "candidate")
    assert len(side.rows) == 2 + 3
    assert side.rows.groupby("notebook").size().to_dict() == {"01_a": 2, "02_b": 3}
    assert side.context["notebooks"] == [
        {"notebook": "01_a", "params": {"reps": 10}},
        {"notebook": "02_b", "params": {}},  # a notebook without parameters: none, not unknown
    ]
    assert side.context["params_source"] == "records"
    assert side.context["device"] == "Test CPU 9000" and side.device == "Test CPU 9000"
    assert side.meta["interrupted"] == "interrupted during 03_c"
    assert side.run_id == "r1-interrupted"  # no run id recorded: the folder's name


def test_a_folder_with_gathered_records_reads_them_not_the_notebooks(tmp_path):
    folder = interrupted_run(tmp_path / "r2")
    (folder / "INTERRUPTED.txt").unlink()
    gathered = pd.DataFrame([value_row("09_z", "only", 7.0)])
    for c, v in CONTEXT.items():
        gathered[c] = v
    (folder / "records.json").write_text(gathered.to_json(orient="records"))
    side = load_side(folder, "base")
    assert list(side.rows["lab"]) == ["09_z"] and "notebooks" not in side.context


def test_rows_repeating_a_key_are_numbered_in_order_of_appearance():
    rows = normalise(
        pd.DataFrame(
            [
                value_row("01_a", "v", 1.0),
                value_row("01_a", "w", 5.0),
                value_row("01_a", "v", 2.0),
                value_row("01_a", "v", 3.0),
            ]
        )  # fmt: skip
    )
    assert list(rows["occurrence"]) == [1, 1, 2, 3]
    assert list(rows[rows["variant"] == "v"]["value"]) == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "x, kept",
    [
        (None, None),
        (float("nan"), None),
        ([], None),
        ([float("nan"), float("inf")], None),  # nothing finite: no samples
        ([1.0, float("nan"), 2.0], [1.0, 2.0]),
        ([[1.0], [3.0]], [1.0, 3.0]),
        ("not numbers", None),
    ],
)
def test_samples_keep_their_finite_values_or_are_none(x, kept):
    a = as_samples(x)
    if kept is None:
        assert a is None
    else:
        np.testing.assert_array_equal(a, kept)


def test_a_baseline_reference_resolves_to_its_kinds_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFLAB_BASELINES", str(tmp_path / "baselines"))
    assert resolve_source("baseline:cuda-nvidia-h200") == tmp_path / "baselines" / "cuda-nvidia-h200"
    assert resolve_source("baseline:cpu") == tmp_path / "baselines" / "cpu"
    assert resolve_source(tmp_path / "r1") == tmp_path / "r1"  # a folder as given


def test_normalised_rows_have_every_key_column_as_text():
    """Records without a shape or dtype column, and with a missing variant, match on empty text."""
    rows = normalise(pd.DataFrame([dict(lab="01_a", experiment="e", variant=None, metric="params", statistic="value",
                                        value=1.0)]))  # fmt: skip
    assert rows.loc[0, ["variant", "shape", "dtype", "unit"]].tolist() == ["", "", "", ""]
    assert rows.loc[0, "lab"] == "01_a" and rows.loc[0, "occurrence"] == 1
