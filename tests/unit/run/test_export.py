"""``perflab export`` into a real local MLflow tracking store (SQLite, made here) and TensorBoard event
files, read back with MLflow's own client and TensorBoard's own event reader; metric names come from
the records' key fields, so two reports' figures line up."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from lab_utils.core.records import load_records
from lab_utils.run import export
from lab_utils.run.cli import main as perflab

mlflow = pytest.importorskip("mlflow", reason="perflab[export] (mlflow-skinny) is not installed")
pytest.importorskip("tensorboard", reason="perflab[export] (tensorboard) is not installed")
from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing import event_accumulator as ea  # noqa: E402

#: the tiny lab's figures by hand (tests/conftest.py TINY_LAB): name -> values in order
WANT = {
    "sweep/time/eager/64x128/float32/median": [1.5],
    "sweep/time/eager/64x128/float32/p80": [1.9],
    "telemetry/grad_norm/base/value": [0.5, 1.5, 2.5],
}


def test_metric_names_come_from_the_key_fields_never_the_values():
    row = dict(experiment="sweep", metric="time", variant="tri+ton (v2)", shape="64x128", dtype="bf16",
               statistic="median", value=3.0)  # fmt: skip
    assert export.metric_name(row) == "sweep/time/tri_ton _v2_/64x128/bf16/median"
    assert export.metric_name({**row, "value": 99.0, "samples": [1, 2]}) == export.metric_name(row)
    assert export.metric_name({**row, "shape": "", "dtype": None}) == "sweep/time/tri_ton _v2_/median"
    assert len(export.metric_name({**row, "variant": "v" * 400})) == export.MAX_KEY
    assert export.trace_name(export.Path("a/step.trace.json")) == "step.pt.trace.json"
    assert export.trace_name(export.Path("trace-rank1.json")) == "trace-rank1.pt.trace.json"
    assert export.trace_name(export.Path("x.pt.trace.json.gz")) == "x.pt.trace.json.gz"


def test_lab_series_by_hand(tiny_reports):
    ctx, labs = export.lab_series(tiny_reports["kept"])
    (lab,) = labs
    assert lab.lab == "tiny" and lab.status == "ok" and lab.params["reps"] == 4
    assert lab.series == WANT and lab.skipped == 1  # the failed (NaN) timing is left out, and counted
    assert lab.html.name == "tiny.html" and lab.records.name == "records.json"
    # independent of the export: every finite row of the records is in exactly one series
    df = load_records(tiny_reports["kept"])
    finite = [v for v in df["value"] if math.isfinite(v)]
    assert sum(len(v) for v in lab.series.values()) == len(finite)


@pytest.mark.slow
def test_mlflow_runs_in_a_real_sqlite_store_read_back_with_mlflows_client(tiny_reports, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rep = tiny_reports["kept"]
    args = ["export", str(rep), "--to", "mlflow", "--tracking-uri", uri, "--experiment", "perf"]
    assert perflab(args) == 0
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("perf")
    (run,) = client.search_runs([exp.experiment_id])
    ctx = json.loads((rep / "context.json").read_text())
    assert run.data.tags["perflab.run_id"] == ctx["run_id"] and run.data.tags["perflab.lab"] == "tiny"
    assert run.data.tags["mlflow.runName"] == "tiny" and run.info.status == "FINISHED"
    assert run.data.params["reps"] == "4" and run.data.params["device"] == "cpu"
    assert set(run.data.metrics) == set(WANT)
    for name, values in WANT.items():
        hist = sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)
        assert [(m.step, m.value) for m in hist] == list(enumerate(values)), name
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "html")}
    assert arts == {"html/tiny.html"}
    page = client.download_artifacts(run.info.run_id, "html/tiny.html", str(tmp_path / "dl"))
    assert open(page).read() == (rep / "html" / "tiny.html").read_text()
    # the same report again: no second run
    assert perflab(args) == 0
    assert len(client.search_runs([exp.experiment_id])) == 1
    # another report of the same lab: a second run whose metrics have the same names
    other = tmp_path / "other"
    shutil.copytree(tiny_reports["default"], other)
    assert perflab(["export", str(other), "--to", "mlflow", "--tracking-uri", uri, "--experiment", "perf"]) == 0
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 2 and all(set(r.data.metrics) == set(WANT) for r in runs)


def test_tensorboard_scalars_and_traces_read_back_with_tensorboards_reader(tiny_reports, tmp_path, capsys):
    rep = tiny_reports["kept"]
    logdir = tmp_path / "tb"
    assert perflab(["export", str(rep), "--to", "tensorboard", "--logdir", str(logdir)]) == 0
    assert "1 profiler trace(s)" in capsys.readouterr().out
    run_id = json.loads((rep / "context.json").read_text())["run_id"]
    folder = logdir / "tiny" / run_id
    acc = ea.EventAccumulator(str(folder), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(WANT)
    for name, values in WANT.items():
        got = [(e.step, e.value) for e in acc.Scalars(name)]
        assert got == [(i, pytest.approx(v, rel=1e-6)) for i, v in enumerate(values)], name  # float32 on disk
    (text,) = acc.Tensors("perflab/params")
    assert "| reps | `4` |" in text.tensor_proto.string_val[0].decode()
    trace = folder / "plugins" / "profile" / run_id / "step.pt.trace.json"
    assert trace.read_text() == (rep / "artifacts" / "tiny" / "traces" / "step.trace.json").read_text()
    # a report that kept no traces exports its scalars and no profile
    assert perflab(["export", str(tiny_reports["default"]), "--to", "tensorboard", "--logdir", str(logdir)]) == 0
    other = logdir / "tiny" / json.loads((tiny_reports["default"] / "context.json").read_text())["run_id"]
    assert list(other.glob("events.out.tfevents.*")) and not (other / "plugins").exists()


def test_run_exports_its_traces_to_tensorboard_then_keeps_none(tiny_suite, tmp_path, capsys):
    """``perflab run --export tensorboard``: the traces reach TensorBoard's profile folder, then leave
    the report as a run without --keep-traces would."""
    tb = tmp_path / "tb"
    args = ["run", str(tiny_suite), "--out", str(tmp_path / "r"), "--no-progress", "--export", "tensorboard"]
    assert perflab([*args, "--logdir", str(tb)]) == 0
    out = capsys.readouterr().out
    assert "perflab run: tensorboard: 1 run(s)" in out and "(1 profiler trace(s))" in out
    (rep,) = [p for p in (tmp_path / "r").iterdir() if p.is_dir() and not p.is_symlink()]
    assert list(tb.glob("tiny/*/plugins/profile/*/step.pt.trace.json"))
    assert not list((rep / "artifacts").rglob("*.trace.json"))
    assert "artifacts/tiny/traces/step.trace.json" in (rep / "artifacts" / "TRACES_NOT_KEPT.txt").read_text()
    assert 'id="traces-not-kept"' in (rep / "index.html").read_text()


def test_a_folder_that_is_no_report_is_refused(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert perflab(["export", str(tmp_path / "x"), "--to", "tensorboard", "--logdir", str(tmp_path / "tb")]) == 2
    assert "a finished report folder" in capsys.readouterr().err
    assert not (tmp_path / "tb").exists()
