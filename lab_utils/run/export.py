"""A report's records where teams already look: MLflow runs and TensorBoard event files.

``perflab export REPORT --to mlflow|tensorboard`` (and ``perflab run ... --export``):

* **MLflow**: one run per lab in an experiment (``--experiment``, default ``perflab``) of a
  tracking store (``--tracking-uri``: ``sqlite:///mlflow.db``, a server; default
  ``$MLFLOW_TRACKING_URI``): the lab's parameters as params, one metric per record key, the
  lab's HTML page (``html/``) and records (``records/<lab>/records.json``) as artifacts, and the
  report's run id, suite, commit, device and the lab's status as ``perflab.*`` tags.  A lab of a
  report that is already in the experiment is not exported twice.
* **TensorBoard**: one run per lab, ``<logdir>/<lab>/<run-id>/``: the same metrics as scalars, the
  parameters as a text summary, and the lab's profiler traces where TensorBoard's profile plugin
  reads them (``plugins/profile/<run-id>/<name>.pt.trace.json``; a report keeps its traces only
  when run with ``--keep-traces``, or ``perflab run --export tensorboard``).  Written with
  TensorBoard's own event writer: no torch needed.

Metric names come from the records' key fields (``experiment/metric/variant[/shape][/dtype]/statistic``,
the fields ``perflab compare`` matches rows on), never from values, so one figure has one name in
every run and lines up across runs.  Rows that share a key (a figure per step or per block) are
that metric's steps 0, 1, ... in the records' order; values that are not finite (a failed timing)
are left out and counted.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from lab_utils.core.config import ConfigError
from lab_utils.core.records import load_records
from lab_utils.run.commands.export import TARGETS
from lab_utils.run.footprint import is_trace
from lab_utils.run.suites import ROOT

#: the record fields a metric is named by, in this order (empty ones are left out)
NAME_FIELDS = ("experiment", "metric", "variant", "shape", "dtype", "statistic")
#: what MLflow accepts in a metric or param key; anything else becomes "_"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\- /]")
MAX_KEY = 250  # MLflow's limit on a metric key


def metric_name(row: dict | pd.Series) -> str:
    """The stable name of a record's figure: its key fields joined by "/", made safe for MLflow."""
    parts = [str(row.get(f) or "").strip() for f in NAME_FIELDS]
    name = "/".join(_UNSAFE.sub("_", p) for p in parts if p and p.lower() != "nan")
    return name[:MAX_KEY]


@dataclass
class LabSeries:
    """One lab of a report: its parameters, status, page and figures (name -> values in order)."""

    lab: str
    params: dict
    status: str
    html: Path | None
    records: Path | None
    series: dict[str, list[float]] = field(default_factory=dict)
    skipped: int = 0  # values that were not finite


def resolve_report(report: str | Path) -> Path:
    """A report folder, or ``latest`` (``reports/latest``); refused unless it is a finished report."""
    path = ROOT / "reports" / "latest" if str(report) == "latest" else Path(report)
    if not (path / "context.json").is_file() or not (path / "status.json").is_file():
        raise ConfigError("report", str(report), "a finished report folder (reports/<run-id>/ with context.json)")
    return path.resolve()


def lab_series(report: Path) -> tuple[dict, list[LabSeries]]:
    """The report's context and, per lab, its figures named by :func:`metric_name`."""
    ctx = json.loads((report / "context.json").read_text())
    status = {s["notebook"]: s for s in json.loads((report / "status.json").read_text())}
    params = {n["notebook"]: n.get("params") or {} for n in ctx.get("notebooks", []) if isinstance(n, dict)}
    df = load_records(report)
    labs = []
    for lab, st in status.items():
        page = report / st["html"] if st.get("html") else None
        rec = report / "records" / lab / "records.json"
        one = LabSeries(lab, params.get(lab, st.get("params") or {}), st.get("status", ""), page,
                        rec if rec.is_file() else None)  # fmt: skip
        rows = df[df["notebook"] == lab] if "notebook" in df.columns else df[df["lab"] == lab]
        for row in rows.to_dict(orient="records"):
            v = row.get("value")
            if v is None or not math.isfinite(float(v)):
                one.skipped += 1
                continue
            one.series.setdefault(metric_name(row), []).append(float(v))
        labs.append(one)
    return ctx, labs


def _tags(ctx: dict, lab: LabSeries) -> dict[str, str]:
    return {
        "perflab.run_id": str(ctx.get("run_id", "")),
        "perflab.lab": lab.lab,
        "perflab.suite": str(ctx.get("suite", "")),
        "perflab.commit": str(ctx.get("commit", "")),
        "perflab.device": str(ctx.get("device", "")),
        "perflab.status": lab.status,
        "mlflow.runName": lab.lab,
    }


def _param_value(v) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s[:6000]  # MLflow's limit on a param value


def to_mlflow(report: Path, *, tracking_uri: str | None = None, experiment: str = "perflab") -> list[str]:
    """One MLflow run per lab of ``report``; returns the run ids (labs already exported are skipped)."""
    # mlflow: perflab[export]; seconds to import, and only an export to MLflow needs it
    from mlflow.entities import Metric, Param, RunTag  # noqa: PLC0415  (heavy optional: perflab[export])
    from mlflow.tracking import MlflowClient  # noqa: PLC0415  (heavy optional: perflab[export])

    ctx, labs = lab_series(report)
    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
    ids = []
    now = int(time.time() * 1000)
    for lab in labs:
        tags = _tags(ctx, lab)
        found = client.search_runs(
            [exp_id], f"tags.`perflab.run_id` = '{tags['perflab.run_id']}' and tags.`perflab.lab` = '{lab.lab}'"
        )
        if found:
            ids.append(found[0].info.run_id)
            continue
        run = client.create_run(exp_id, run_name=lab.lab, tags=tags)
        rid = run.info.run_id
        params = [Param(_UNSAFE.sub("_", str(k))[:MAX_KEY], _param_value(v)) for k, v in sorted(lab.params.items())]
        metrics = [Metric(k, v, now, step) for k, vs in lab.series.items() for step, v in enumerate(vs)]
        for i in range(0, max(len(params), 1), 100):
            client.log_batch(rid, params=params[i : i + 100])
        for i in range(0, len(metrics), 1000):
            client.log_batch(rid, metrics=metrics[i : i + 1000], tags=[RunTag("perflab.skipped", str(lab.skipped))])
        if lab.html is not None and lab.html.is_file():
            client.log_artifact(rid, str(lab.html), artifact_path="html")
        if lab.records is not None:
            client.log_artifact(rid, str(lab.records), artifact_path="records")
        client.set_terminated(rid, status="FINISHED" if lab.status == "ok" else "FAILED")
        ids.append(rid)
    return ids


def _text_tensor(text: str):
    from tensorboard.compat.proto.tensor_pb2 import TensorProto  # noqa: PLC0415  (heavy optional: perflab[export])
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto  # noqa: PLC0415  (as above)

    shape = TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)])
    return TensorProto(dtype=7, string_val=[text.encode()], tensor_shape=shape)  # 7: DT_STRING


def trace_name(path: Path) -> str:
    """A trace's file name as TensorBoard's profile plugin looks for it (``*.pt.trace.json[.gz]``)."""
    name, gz = (path.name[:-3], ".gz") if path.name.endswith(".gz") else (path.name, "")
    for suffix in (".pt.trace.json", ".trace.json", ".json"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return f"{name}.pt.trace.json{gz}"


def to_tensorboard(report: Path, *, logdir: str | Path = "runs") -> list[Path]:
    """One TensorBoard run per lab of ``report`` under ``logdir/<lab>/<run-id>/``; returns the run folders."""
    # tensorboard's own writer and protos: perflab[export]; no torch needed
    from tensorboard.compat.proto.event_pb2 import Event  # noqa: PLC0415  (heavy optional: perflab[export])
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata  # noqa: PLC0415  (as above)
    from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: PLC0415  (as above)

    ctx, labs = lab_series(report)
    run_id = str(ctx.get("run_id") or report.name)
    text_meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
    out = []
    for lab in labs:
        folder = Path(logdir) / lab.lab / run_id
        folder.mkdir(parents=True, exist_ok=True)
        w = EventFileWriter(str(folder))
        now = time.time()
        params = "\n".join(f"| {k} | `{_param_value(v)}` |" for k, v in sorted(lab.params.items()))
        head = f"perflab run {run_id}, lab {lab.lab} ({lab.status}), commit {ctx.get('commit', '')}\n\n"
        table = head + "| parameter | value |\n|---|---|\n" + params
        text = Summary.Value(tag="perflab/params", metadata=text_meta, tensor=_text_tensor(table))
        w.add_event(Event(wall_time=now, step=0, summary=Summary(value=[text])))
        for name, values in lab.series.items():
            for step, v in enumerate(values):
                scalar = Summary(value=[Summary.Value(tag=name, simple_value=v)])
                w.add_event(Event(wall_time=now, step=step, summary=scalar))
        w.close()
        profile = folder / "plugins" / "profile" / run_id
        art = report / "artifacts" / lab.lab
        for p in sorted(art.rglob("*")) if art.is_dir() else []:
            if p.is_file() and is_trace(p):
                profile.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, profile / trace_name(p))
        out.append(folder)
    return out


def export_report(
    report: str | Path,
    targets: Sequence[str],
    *,
    tracking_uri: str | None = None,
    experiment: str = "perflab",
    logdir: str | Path = "runs",
) -> list[str]:
    """Export ``report`` to each of ``targets`` (:data:`TARGETS`); returns one line per target."""
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise ConfigError("to", bad[0], f"one of {', '.join(TARGETS)}")
    path = resolve_report(report)
    lines = []
    if "mlflow" in targets:
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "MLflow's default store"
        ids = to_mlflow(path, tracking_uri=tracking_uri, experiment=experiment)
        lines.append(f"mlflow: {len(ids)} run(s) in experiment {experiment!r} at {uri}")
    if "tensorboard" in targets:
        runs = to_tensorboard(path, logdir=logdir)
        traces = sum(1 for r in runs for _ in (r / "plugins" / "profile").rglob("*.pt.trace.json*"))
        lines.append(
            f"tensorboard: {len(runs)} run(s) under {logdir} ({traces} profiler trace(s)); "
            f"tensorboard --logdir {logdir}"
        )
    return lines
