"""One side of a comparison: where its records come from, read and normalised.

A side is a report folder, a records file, ``latest`` or ``baseline[:KIND]``.  Rows are
matched on ``KEY``; rows sharing a key are told apart by categorical ``extra`` fields
(``identity_keys``).  Rows without a stability verdict (records older than it) are judged
from their kept samples (``lab_utils.core.records.fill_stability``).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lab_utils.core.device import device_info
from lab_utils.core.records import CONTEXT_COLUMNS, fill_stability, load_records
from lab_utils.run.compare.rules import KEY, CompareError, extra_dict
from lab_utils.run.suites import ROOT, params_dir


@dataclass
class Side:
    """One side of a comparison: its rows, context and where it came from."""

    label: str
    source: str
    rows: pd.DataFrame
    context: dict = field(default_factory=dict)
    status: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @property
    def device(self) -> str:
        return str(self.context.get("device") or "")

    @property
    def run_id(self) -> str:
        return str(self.context.get("run_id") or self.meta.get("run_id") or Path(self.source).name)


def baselines_root() -> Path:
    """``$PERFLAB_BASELINES``, else ``baselines/`` beside the suites (``parameterized/``)."""
    return Path(os.environ.get("PERFLAB_BASELINES") or params_dir() / "baselines")


def slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(s).lower()).strip("-") or "unknown"


def baseline_kind(context: dict) -> str:
    """``cpu`` for any CPU (CPU baselines are meant for accuracy and counts; timings
    there are flagged by device name), ``cuda-<model>`` for a GPU, e.g. ``cuda-nvidia-h200``."""
    kind = str(context.get("device_kind") or "unknown")
    if kind == "cpu":
        return "cpu"
    return f"{slug(kind)}-{slug(context.get('device') or 'unknown')}"


def resolve_source(ref: str | Path) -> Path:
    """A report folder (also an interrupted run's ``<run-id>-interrupted/``), a records file,
    ``latest`` (reports/latest) or ``baseline[:KIND]`` (parameterized/baselines/KIND, KIND
    defaulting to this machine's)."""
    s = str(ref)
    if s == "latest":
        return ROOT / "reports" / "latest"
    if s == "baseline" or s.startswith("baseline:"):
        kind = s.partition(":")[2] or baseline_kind(this_machine_context())
        return baselines_root() / kind
    return Path(s)


def this_machine_context() -> dict:
    info = device_info(None)
    return {"device": info.name, "device_kind": info.kind}


def first_value(df: pd.DataFrame, col: str) -> str:
    if col not in df.columns or not len(df):
        return ""
    vals = [v for v in df[col].dropna().astype(str).unique() if v]
    return vals[0] if vals else ""


def load_side(ref: str | Path, label: str) -> Side:
    path = resolve_source(ref)
    if not path.exists():
        raise CompareError(
            f"{label}: {ref} does not exist (give a report folder, records.json/.parquet, "
            f"'latest' or 'baseline[:KIND]')"
        )
    interrupted = path.is_dir() and (path / "INTERRUPTED.txt").exists()
    try:
        rows, per_notebook = read_rows(path)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise CompareError(f"{label}: cannot read records from {path}: {e}") from None
    folder = path if path.is_dir() else path.parent
    ctx: dict = {}
    if (folder / "context.json").exists():
        try:
            ctx = json.loads((folder / "context.json").read_text())
        except (OSError, ValueError):
            ctx = {}
    single = False
    if not path.is_dir() and path.suffix == ".json":  # a single notebook's records file carries its context
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict) and isinstance(data.get("context"), dict):
                ctx = {**data["context"], **ctx}
                single = True
        except (OSError, ValueError):
            pass
    if per_notebook:  # an interrupted run: no gathered context; each notebook's records carry theirs
        first = next(iter(per_notebook.values()))
        ctx = {**{k: v for k, v in first.items() if k != "params"}, **ctx}
        ctx.setdefault(
            "notebooks", [{"notebook": nb, "params": c.get("params") or {}} for nb, c in per_notebook.items()]
        )
        ctx.setdefault("params_source", "records")
    elif single and isinstance(ctx.get("params"), dict) and "notebooks" not in ctx and len(rows):
        # a single notebook's records file: its parameters are its config's
        ctx["notebooks"] = [{"notebook": first_value(rows, "lab"), "params": ctx["params"]}]
        ctx.setdefault("params_source", "records")
    for c in CONTEXT_COLUMNS:
        if not ctx.get(c):
            ctx[c] = first_value(rows, c)
    if not ctx.get("run_id"):
        ctx["run_id"] = first_value(rows, "run_id") or (path.name if interrupted else "")
    status = []
    if (folder / "status.json").exists():
        try:
            status = json.loads((folder / "status.json").read_text())
        except (OSError, ValueError):
            status = []
    meta = {}
    if (folder / "baseline.json").exists():
        try:
            meta = json.loads((folder / "baseline.json").read_text())
        except (OSError, ValueError):
            meta = {}
    if "device" in rows.columns:
        devices = sorted({str(d) for d in rows["device"].dropna() if str(d)})
        if len(devices) > 1:
            raise CompareError(
                f"{label}: {path} holds rows from {len(devices)} devices ({'; '.join(devices)}); "
                f"comparing it would mix them - split it into one records file per device"
            )
        if devices and not ctx.get("device"):
            ctx["device"] = devices[0]
    mixed = {}
    for c in ("torch_version", "triton_version", "cuda_version", "commit"):
        if c in rows.columns:
            vals = sorted({str(v) for v in rows[c].dropna() if str(v)})
            if len(vals) > 1:
                mixed[c] = vals
    if interrupted:
        meta = {**meta, "interrupted": (path / "INTERRUPTED.txt").read_text().strip()}
    side = Side(label=label, source=str(path), rows=normalise(rows), context=ctx, status=status, meta=meta)
    side.mixed = mixed  # type: ignore[attr-defined]
    return side


def read_rows(path: Path) -> tuple[pd.DataFrame, dict[str, dict]]:
    """A side's rows, and for a folder without gathered records (a run interrupted by Ctrl-C:
    ``<run-id>-interrupted/``) each finished notebook's context, its rows read from
    ``records/<notebook>/records.json``."""
    if not path.is_dir() or any((path / n).exists() for n in ("records.parquet", "records.json")):
        return load_records(path), {}
    files = sorted((path / "records").glob("*/records.json"))
    if not files:
        raise FileNotFoundError(f"no records.parquet, records.json or records/<notebook>/records.json in {path}")
    frames, contexts = [], {}
    for f in files:
        df = load_records(f)
        df["notebook"] = f.parent.name
        frames.append(df)
        data = json.loads(f.read_text())
        contexts[f.parent.name] = data.get("context", {}) if isinstance(data, dict) else {}
    return pd.concat(frames, ignore_index=True), contexts


def as_samples(x: Any) -> np.ndarray | None:
    if x is None:
        return None
    if isinstance(x, float) and math.isnan(x):
        return None
    try:
        a = np.asarray(x, dtype=float).ravel()
    except (TypeError, ValueError):
        return None
    a = a[np.isfinite(a)]
    return a if a.size else None


def normalise(df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    for c in KEY + ["unit"]:
        if c not in df.columns:
            df[c] = ""
        df[c] = df[c].fillna("").astype(str)
    if "value" not in df.columns:
        df["value"] = np.nan
    df["value"] = pd.to_numeric(df["value"], errors="coerce")
    if "samples" not in df.columns:
        df["samples"] = None
    df["samples"] = [as_samples(s) for s in df["samples"]]
    if "extra" not in df.columns:
        df["extra"] = ""
    df = fill_stability(df)
    # a failed timing is matched against the base's median row: it is that row, failing
    df["failed"] = df["statistic"] == "failed"
    df.loc[df["failed"], "statistic"] = "median"
    dup = df.groupby(KEY, sort=False).cumcount()
    df["occurrence"] = dup + 1
    return df.reset_index(drop=True)


#: ``extra`` keys that describe how a row came about, not which measurement it is.
#: Outcomes ("verdict", "ok", ...) must not be identity either: a row whose check starts
#: failing has to meet its old self and be judged, not fall apart into two one-sided rows.
VOLATILE_EXTRA = {
    "reason",
    "threads",
    "attempts",
    "stable",
    "stability",
    "failure_kind",
    "method",
    "formula",
    "bound",
    "note",
    "error",
    "traceback",
    "seconds",
    "timestamp",
    "path",
    "samples",
    "verdict",
    "ok",
    "passed",
    "status",
    "result",
    "outcome",
    "why",
    "why_not",
    "message",
    "skipped",
    # results that name a row's outcome: which assumption dominated, which tensor erred most
    "dominant",
    "worst",
    "drift_starts_in",
}


def identity_by_group(*frames: pd.DataFrame) -> dict[tuple, list[str]]:
    """For each KEY shared by several rows (on either side): the ``extra`` keys that tell them apart
    (e.g. a mask or a sequence length a lab keeps in ``extra``), those whose values differ inside
    that group.  A key's group alone: an extra field that names rows apart in one experiment (a
    block) is no identity of a row that is alone under its key (where a block is a result)."""
    out: dict[tuple, set[str]] = {}
    for df in frames:
        dup = df[df.duplicated(KEY, keep=False)]
        for k, g in dup.groupby(KEY, sort=False):
            ex = [extra_dict(e) for e in g["extra"]]
            keys = out.setdefault(tuple(k), set())
            for name in set().union(*ex) - VOLATILE_EXTRA:
                vals = [e.get(name) for e in ex]
                # identity is categorical (names, sizes, lists); floats are measured or derived figures
                if any(isinstance(v, float) or isinstance(v, bool) for v in vals):
                    continue
                if len({json.dumps(v, sort_keys=True, default=str) for v in vals}) > 1:
                    keys.add(name)
    return {k: sorted(v) for k, v in out.items() if v}


def identity_keys(*frames: pd.DataFrame) -> list[str]:
    """Every ``extra`` key that tells apart rows sharing a KEY somewhere (``identity_by_group``)."""
    return sorted(set().union(*identity_by_group(*frames).values()))


def with_identity(df: pd.DataFrame, by_group: dict[tuple, list[str]]) -> pd.DataFrame:
    """Each row's ``ident``: its KEY group's identity fields and their values ("" where none)."""
    df = df.copy()
    if "extra" not in df.columns:
        df["extra"] = ""
    keys = [by_group.get(tuple(k), ()) for k in df[KEY].itertuples(index=False, name=None)]
    df["ident"] = [
        " ".join(f"{k}={e[k]}" for k in ks if k in e) for ks, e in zip(keys, map(extra_dict, df["extra"]), strict=True)
    ]
    df["occurrence"] = df.groupby(KEY + ["ident"], sort=False).cumcount() + 1
    return df
