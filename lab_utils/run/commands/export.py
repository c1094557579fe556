"""``perflab export REPORT --to mlflow|tensorboard``: its arguments, shared with ``perflab run --export``
(light; the export is ``lab_utils.run.export``)."""

from __future__ import annotations

import argparse

#: where a report's records can go
TARGETS = ("mlflow", "tensorboard")

HELP = "export a report's records to MLflow or TensorBoard (see `perflab export --help`)"
DESCRIPTION = """\
Export a finished report (a reports/<run-id>/ folder, or `latest`) where teams already look:

  mlflow       one MLflow run per lab: its parameters, one metric per record key
               (experiment/variant/metric/statistic, shape and dtype), the lab's HTML page and
               the run's records as artifacts, tagged with the report's run id, commit, device
  tensorboard  one event-file run per lab under --logdir: the same metrics as scalars, the
               lab's parameters as text, and the lab's profiler traces where TensorBoard's
               profile plugin reads them (<logdir>/<lab>/plugins/profile/<run>/*.pt.trace.json)

Metric names come from the records' key fields, never from their values, so the same figure of
two runs has the same name and lines up across runs."""


def add_export_options(ap) -> None:
    """Where the records go: MLflow's tracking store, TensorBoard's log folder, the experiment."""
    ap.add_argument(
        "--tracking-uri",
        default=None,
        metavar="URI",
        help="MLflow tracking store (sqlite:///mlflow.db, file:///path/mlruns, http://host:5000; "
        "default: $MLFLOW_TRACKING_URI, else MLflow's own default)",
    )
    ap.add_argument("--experiment", default="perflab", help="MLflow experiment the runs go into (default: perflab)")
    ap.add_argument(
        "--logdir", default="runs", metavar="DIR", help="TensorBoard log folder (default: runs, as SummaryWriter)"
    )


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("report", help="a report folder (reports/<run-id>/) or 'latest'")
    ap.add_argument("--to", action="append", required=True, choices=TARGETS, help="where to export (repeat for both)")
    add_export_options(ap)
