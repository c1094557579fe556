"""The one recording API: tidy rows plus the run's context.

A row is one number: (lab, experiment, variant, shape, dtype, metric, value, unit,
statistic), optionally the raw ``samples`` it summarises and ``extra`` keys (JSON).
Rows that come from a timing carry its stability verdict: ``stable`` (True/False) and
``stability`` (the reason, ``lab_utils.core.timing.judge_samples``); other rows leave both
empty (None / "").  Older records without these columns still load (they read as empty).
The context (device, ceilings, versions, commit, timestamp, parameters) is stored
once per notebook run and merged onto every row when a report gathers records.

A row's key fields (lab, experiment, variant, shape, dtype, metric, statistic, and the categorical
``extra`` fields that tell rows sharing them apart) say *what* was measured, never a result: a
measured share, the op that came out heaviest or the assumption that dominated go in ``extra`` or
the value.  ``extra`` fields that ``perflab compare`` reads (``lab_utils.run.compare.rules``):

* ``tolerance``: the bound the lab's own check holds an error figure to (the check passes while
  value <= tolerance); the gate judges the figure against it, not by its ratio alone.
* ``roundoff_dtype`` and ``reduction``: an error figure made by a machine's own float arithmetic
  (a BLAS fp32 sum, whose order the machine picks) names that dtype and the length of the sums
  behind it: its float noise is that dtype's unit roundoff at that scale.
* ``top_n`` (and ``share``): the row is one member of a ranked list of the N heaviest items (the
  top ops of a profile), so which items it holds is a result; ``share`` is the item's fraction of
  the whole (0..1).  A list shorter than N holds every item.  Its rows share lab, shape, dtype,
  statistic and ``list`` (default: the experiment); the item is named by the variant or metric.
* ``reported``: a measured figure that is shown and compared but never gates (an idle time).

In a headless run the runner sets ``PERFLAB_RECORDS_DIR``; ``Recorder.save()``
writes there.  Interactively it writes one file per lab and kernel session,
``.perflab/records/<lab>-<session start>.json``, which every later save rewrites (a Run All
rewrites it too); a rerun's recorder takes the next name (``-2``) only when the file holds
another recorder's explored results, so nothing explored is overwritten.  An explorer saves
after each measurement once its recorder has a file (``explore.base``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from lab_utils.core.device import HOST, device_info
from lab_utils.core.roofline import roofline
from lab_utils.core.samples import BenchFailure, Timing, judge_samples, timing_context

ROW_COLUMNS = [
    "lab",
    "experiment",
    "variant",
    "shape",
    "dtype",
    "metric",
    "value",
    "unit",
    "statistic",
    "samples",
    "extra",
    "stable",
    "stability",
]
CONTEXT_COLUMNS = ["device", "device_kind", "torch_version", "triton_version", "cuda_version", "commit", "timestamp"]
RECORDS_FILE = "records.json"
#: the experiment name of the rows an explorer adds (kept across a rerun of the lab: ``Recorder.save``)
EXPLORE = "explore"
#: ``extra`` fields the comparison reads (see the module note)
TOLERANCE, ROUNDOFF_DTYPE, REDUCTION = "tolerance", "roundoff_dtype", "reduction"
TOP_N, SHARE, RANKED_LIST, REPORTED = "top_n", "share", "list", "reported"
#: this interpreter's (kernel's) start: the interactive records file of each lab is named by it
SESSION = time.strftime("%Y%m%d-%H%M%S")
_WRITERS: dict[Path, weakref.ref] = {}  # interactive records file -> the recorder that writes it
_SAVE_LOCK = threading.Lock()  # an explorer's worker thread and the kernel may save at once


def fmt_shape(shape: Any) -> str:
    if shape is None:
        return ""
    if isinstance(shape, str):
        return shape
    if isinstance(shape, (tuple, list)):  # torch.Size is a tuple
        return "x".join(str(int(s)) if not isinstance(s, str) else s for s in shape)
    return str(shape)


def fmt_dtype(dtype: Any) -> str:
    if dtype is None:
        return ""
    return str(dtype).replace("torch.", "")


def git_commit(root: str | Path | None = None) -> str:
    root = Path(root or Path(__file__).resolve().parents[1])
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return (sha or "unknown") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_context(params: dict | None = None, device=None, *, ceilings=None) -> dict:
    """Everything needed to reproduce and compare a run's numbers, including how timings
    were taken (``timing``: the CPU thread policy and its current choice, the stability rules)."""
    info = device_info(device)
    ctx = {
        "device": info.name,
        "device_kind": info.kind,
        "device_info": info.as_dict(),
        "torch_version": info.torch_version,
        "triton_version": info.triton_version,
        "cuda_version": info.cuda_version,
        "python_version": info.python_version,
        "commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "params": _jsonable(params or {}),
        "triton_interpret": _triton_interpret(device),
        "timing": _timing_context(info, device),
    }
    if ceilings is not None:
        ctx["ceilings"] = ceilings.as_dict()
    return ctx


def _triton_interpret(device) -> str:
    """``TRITON_INTERPRET`` as the kernels see it ("1": Triton runs through its interpreter)."""
    if not (isinstance(device, str) and device == HOST):
        # a measured run: lab_kernels decides the switch on import (CPU-only machine: "1")
        import lab_kernels  # noqa: F401, PLC0415  (torch and triton: only a measured run's context needs them)
    return os.environ.get("TRITON_INTERPRET", "0")


def _timing_context(info, device) -> dict:
    """How timings were taken: CPU thread policy and stability rules, do_bench on CUDA; nothing
    for records read rather than measured here (``device=HOST``: a profiler trace from a file)."""
    if isinstance(device, str) and device == HOST:
        return {"method": "none: read, not measured here"}
    return _jsonable(timing_context()) if info.kind == "cpu" else {"method": "triton.testing.do_bench"}


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    if isinstance(x, float):
        # JSON has no NaN/Inf: a missing value is null; +-Inf keep their sign as text.
        return x if math.isfinite(x) else (None if math.isnan(x) else str(x))
    torch = sys.modules.get("torch")  # a torch dtype or device exists only where torch was imported
    if torch is not None and isinstance(x, (torch.dtype, torch.device)):
        return str(x)
    if hasattr(x, "item") and callable(x.item):
        try:
            return _jsonable(x.item())
        except (ValueError, RuntimeError):
            pass
    return str(x)


@dataclass
class Recorder:
    lab: str
    params: dict = field(default_factory=dict)
    device: Any = None
    ceilings: Any = None
    rows: list[dict] = field(default_factory=list)
    #: the file ``save`` writes (set by the first save; later saves rewrite it)
    path: Path | None = field(default=None, repr=False, compare=False)

    def add(
        self,
        experiment: str,
        variant: str,
        metric: str,
        value: float,
        unit: str = "",
        *,
        shape: Any = "",
        dtype: Any = "",
        statistic: str = "value",
        samples: Iterable[float] | None = None,
        stable: bool | None = None,
        stability: str = "",
        **extra: Any,
    ) -> dict:
        """One row.  ``stable``/``stability``: the verdict of the timing the value comes
        from (``add_timing`` fills them); None / "" for values that are not timings."""
        row = dict(
            lab=self.lab,
            experiment=experiment,
            variant=str(variant),
            shape=fmt_shape(shape),
            dtype=fmt_dtype(dtype),
            metric=metric,
            value=float(value) if value is not None else math.nan,
            unit=unit,
            statistic=statistic,
            samples=[float(s) for s in samples] if samples is not None else None,
            extra=json.dumps(_jsonable(extra), sort_keys=True) if extra else "",
            stable=None if stable is None else bool(stable),
            stability=str(stability or ""),
        )
        self.rows.append(row)
        return row

    def add_timing(
        self,
        experiment: str,
        variant: str,
        timing: Timing | BenchFailure,
        *,
        shape: Any = "",
        dtype: Any = "",
        bytes: float | None = None,
        flops: float | None = None,
        ceilings=None,
        metric_prefix: str = "",
        **extra: Any,
    ):
        """Rows for one timing: time median (samples kept) / p20 / p80, and GB/s, TFLOP/s and
        % of the measured ceiling when bytes / flops are given, each carrying the timing's
        stability verdict (and, on CPU, the thread count used).  A failure becomes one
        ``failed`` row carrying its reason."""
        p = metric_prefix
        if not getattr(timing, "ok", False):
            return self.add(
                experiment,
                variant,
                p + "time",
                math.nan,
                "ms",
                shape=shape,
                dtype=dtype,
                statistic="failed",
                failure_kind=timing.kind,
                reason=timing.reason,
                **extra,
            )
        verdict = timing.stability
        how = {k: timing.meta[k] for k in ("threads", "attempts") if k in timing.meta}
        kw = dict(shape=shape, dtype=dtype, stable=verdict.stable, stability=verdict.reason, **how, **extra)
        self.add(
            experiment,
            variant,
            p + "time",
            timing.median_ms,
            "ms",
            statistic="median",
            samples=timing.samples_ms,
            method=timing.method,
            **kw,
        )
        self.add(experiment, variant, p + "time", timing.p20_ms, "ms", statistic="p20", **kw)
        self.add(experiment, variant, p + "time", timing.p80_ms, "ms", statistic="p80", **kw)
        if bytes:
            self.add(
                experiment,
                variant,
                p + "bandwidth",
                bytes / (timing.median_ms * 1e-3) / 1e9,
                "GB/s",
                statistic="median",
                formula="bytes / time",
                bytes=bytes,
                **kw,
            )
        if flops:
            self.add(
                experiment,
                variant,
                p + "throughput",
                flops / (timing.median_ms * 1e-3) / 1e12,
                "TFLOP/s",
                statistic="median",
                formula="flops / time",
                flops=flops,
                **kw,
            )
        c = ceilings or self.ceilings
        if c is not None and (bytes or flops):
            pt = roofline(timing, bytes=bytes or 0, flops=flops or 0, ceilings=c, dtype=dtype or "fp32")
            self.add(
                experiment,
                variant,
                p + "pct_of_ceiling",
                pt.pct_of_ceiling,
                "%",
                statistic="median",
                bound=pt.bound,
                **kw,
            )
        return timing

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=ROW_COLUMNS) if self.rows else pd.DataFrame(columns=ROW_COLUMNS)

    def context(self) -> dict:
        return run_context(self.params, self.device, ceilings=self.ceilings)

    def save(self, path: str | Path | None = None) -> Path:
        """Write rows + context as JSON (atomically) and return the file: ``path``, else the
        runner's ``PERFLAB_RECORDS_DIR/records.json``, else this recorder's file of the session
        (the same file at every save: see the module's docstring)."""
        with _SAVE_LOCK:
            if path is None:
                d = os.environ.get("PERFLAB_RECORDS_DIR")
                path = Path(d) / RECORDS_FILE if d else self.path or self._session_path()
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            rows = list(self.rows)  # an explorer's thread may add rows meanwhile
            # under the runner, compact (a report's records are read by tools); interactive files indented
            compact = bool(os.environ.get("PERFLAB_RECORDS_DIR"))
            doc = {"context": self.context(), "rows": _jsonable(rows)}
            tmp.write_text(json.dumps(doc, indent=None if compact else 1, separators=(",", ":") if compact else None))
            tmp.replace(path)
            if not os.environ.get("PERFLAB_RECORDS_DIR"):
                self.path = path
            return path

    def _session_path(self) -> Path:
        """``.perflab/records/<lab>-<SESSION>.json``, or ``-2``, ``-3``, ... when that file holds
        another recorder's explored rows (a rerun of the lab in the same kernel keeps them)."""
        base = Path(".perflab") / "records"
        for n in range(1, 10_000):
            p = (base / f"{self.lab}-{SESSION}{'' if n == 1 else f'-{n}'}.json").resolve()
            ref = _WRITERS.get(p)
            other = ref() if ref is not None else None
            if ref is None or other is self or not _holds_explored(other, p):
                if other is not None and other is not self:
                    other.path = None  # its next save finds a name of its own
                _WRITERS[p] = weakref.ref(self)
                return p
        raise RuntimeError(f"no free records file name under {base} for {self.lab}")


def _holds_explored(rec: Recorder | None, path: Path) -> bool:
    if rec is not None:
        rows = list(rec.rows)
    else:
        try:
            rows = json.loads(path.read_text()).get("rows", [])
        except (OSError, ValueError):
            return False
    return any(r.get("experiment") == EXPLORE for r in rows)


def json_value(x: Any) -> Any:
    """One cell of a records file as JSON that reads back to the same value: floats as Python
    writes them (the shortest text that round-trips bit for bit, unlike a fixed number of
    decimals), arrays as lists, NaN as null and +-Inf as "inf" / "-inf" (JSON has no
    non-finite numbers; ``load_records`` reads them back as floats)."""
    if isinstance(x, dict):
        return {str(k): json_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_value(v) for v in x]
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):  # numpy arrays and scalars
        return json_value(x.tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else (None if math.isnan(x) else ("inf" if x > 0 else "-inf"))
    if x is None or isinstance(x, (str, int, bool)):
        return x
    if x is pd.NA or x is pd.NaT:
        return None
    return str(x)


def write_records_json(df: pd.DataFrame, path: str | Path, *, indent: int | None = None) -> Path:
    """Rows as a JSON list of records that round-trip exactly (``json_value``), written atomically.
    (pandas' ``to_json`` keeps 10 significant decimals by default: a value read back then differs
    from the one measured, and a comparison calls it changed.)"""
    path = Path(path)
    cols = list(df.columns)
    rows = [{c: json_value(v) for c, v in zip(cols, vals, strict=True)} for vals in df.itertuples(index=False)]
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    seps = None if indent is not None else (",", ":")  # compact unless asked to indent
    tmp.write_text(json.dumps(rows, indent=indent, separators=seps, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def write_records_parquet(df: pd.DataFrame, path: str | Path) -> Path:
    """Rows as Parquet, written atomically: floats bit for bit (+-inf and NaN too), samples as
    lists of floats, nulls kept; the context columns repeat on every row, so a file is a
    fiftieth of its JSON (a stored baseline: 3.8 MB of JSON, 72 kB of Parquet)."""
    path = Path(path)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    df.to_parquet(tmp, index=False)
    tmp.replace(path)
    return path


def _float(x: Any) -> float:
    try:
        return math.nan if x is None else float(x)
    except (TypeError, ValueError):
        return math.nan


def _numeric_values(df: pd.DataFrame) -> pd.DataFrame:
    """``value`` and ``samples`` as floats: null is NaN, "inf" / "-inf" (how JSON keeps them) are +-Inf."""
    if "value" in df.columns:
        df["value"] = pd.to_numeric(df["value"], errors="coerce").astype(float)
    if "samples" in df.columns:
        df["samples"] = [[_float(x) for x in s] if isinstance(s, list) else s for s in df["samples"]]
    return df


def load_records(path: str | Path) -> pd.DataFrame:
    """Rows of a records JSON (one notebook) or of a report's gathered records
    (``records.json`` / ``records.parquet`` / a report folder), context merged in."""
    path = Path(path)
    if path.is_dir():
        for name in ("records.parquet", "records.json"):
            if (path / name).exists():
                return load_records(path / name)
        raise FileNotFoundError(f"no records.parquet or records.json in {path}")
    if path.suffix == ".parquet":
        return _with_stability_columns(pd.read_parquet(path))
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "rows" in data:
        df = _numeric_values(pd.DataFrame(data["rows"], columns=ROW_COLUMNS))
        ctx = data.get("context", {})
        for c in CONTEXT_COLUMNS:
            df[c] = ctx.get(c, "")
        return _with_stability_columns(df)
    return _with_stability_columns(_numeric_values(pd.DataFrame(data)))


def _stable_value(v: Any) -> bool | None:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, str):
        return {"true": True, "false": False}.get(v.strip().lower())
    return bool(v)


def _with_stability_columns(df: pd.DataFrame) -> pd.DataFrame:
    """Records written before rows carried a stability verdict read as "not judged"."""
    df["stable"] = [_stable_value(v) for v in df["stable"]] if "stable" in df.columns else None
    df["stability"] = [v if isinstance(v, str) else "" for v in df["stability"]] if "stability" in df.columns else ""
    return df


#: columns that identify the timing a derived row (GB/s, TFLOP/s, % of ceiling) comes from
TIMING_GROUP = ["lab", "experiment", "variant", "shape", "dtype", "extra"]


def fill_stability(df: pd.DataFrame) -> pd.DataFrame:
    """Rows with kept samples but no verdict (records older than the verdict) are judged
    from their samples (``judge_samples``, default rules); rows derived from the same
    timing (same lab, experiment, variant, shape, dtype and extra; GB/s, % of ceiling, ...)
    take that verdict."""
    df = _with_stability_columns(df.copy())
    if "samples" not in df.columns or not len(df):
        return df
    missing = df["stable"].isna()
    for i in df.index[missing]:
        s = df.at[i, "samples"]
        if s is None or (isinstance(s, float) and math.isnan(s)):
            continue
        vals = [float(v) for v in s]
        if len(vals) >= 3:
            v = judge_samples(vals)
            df.at[i, "stable"], df.at[i, "stability"] = v.stable, f"judged from the kept samples: {v.reason}"
    judged = df[df["stable"].notna() & (df["metric"].astype(str).str.endswith("time"))]
    verdicts = {}
    for _, r in judged.iterrows():
        verdicts.setdefault(tuple(str(r[c]) for c in TIMING_GROUP) + (str(r["metric"])[: -len("time")],), r)
    for i in df.index[df["stable"].isna()]:
        r = df.loc[i]
        metric = str(r["metric"])
        for suffix in ("bandwidth", "throughput", "pct_of_ceiling", "speedup_vs_eager"):
            if metric.endswith(suffix):
                src = verdicts.get(tuple(str(r[c]) for c in TIMING_GROUP) + (metric[: -len(suffix)],))
                if src is not None:
                    df.at[i, "stable"], df.at[i, "stability"] = src["stable"], src["stability"]
                break
    return df


@dataclass(frozen=True)
class StabilitySummary:
    """How many timings of a set of records were judged, and how many were unstable."""

    timings: int
    unstable: int
    examples: tuple[str, ...]

    @property
    def share(self) -> float:
        return self.unstable / self.timings if self.timings else 0.0

    def __str__(self) -> str:
        return f"{self.unstable} of {self.timings} timings unstable ({self.share:.0%})"


def stability_summary(df: pd.DataFrame, *, examples: int = 5) -> StabilitySummary:
    """Count the timings (time rows with statistic ``median``) that carry a verdict and
    those that are unstable."""
    if not len(df) or "stable" not in df.columns:
        return StabilitySummary(0, 0, ())
    t = df[df["metric"].astype(str).str.endswith("time") & (df["statistic"] == "median") & df["stable"].notna()]
    bad = t[t["stable"] == False]  # noqa: E712 - an object column of True/False/None
    ex = tuple(
        f"{r['lab']} {r['experiment']}/{r['variant']} {r['shape']} {r['dtype']}: {r['stability']}"
        for _, r in bad.head(examples).iterrows()
    )
    return StabilitySummary(len(t), len(bad), ex)


def unstable_timings(df: pd.DataFrame) -> pd.DataFrame:
    """The timings (median rows) the timing primitive judged unstable, with the reason: what a
    lab shows right under its timing tables so that no disturbed figure passes for a result.
    Empty (with the same columns) when every timing was stable."""
    cols = ["experiment", "variant", "shape", "dtype", "value", "unit", "stability"]
    if not len(df) or "stable" not in df.columns:
        return pd.DataFrame(columns=cols)
    t = df[df["metric"].astype(str).str.endswith("time") & (df["statistic"] == "median")]
    bad = t[t["stable"] == False]  # noqa: E712 - an object column of True/False/None
    return bad[cols].rename(columns={"value": "median"}).reset_index(drop=True)


def stability_note(df: pd.DataFrame) -> str:
    """One line on the run's timings: all stable, or how many were not (shown, never hidden)."""
    s = stability_summary(df)
    if not s.timings:
        return "no timings judged"
    if not s.unstable:
        return f"all {s.timings} timings stable"
    return f"{s}: the machine disturbed them; the table below lists them (not results, not compared)"


def thread_cut_note(df: pd.DataFrame, context: dict) -> str:
    """A run's CPU timings that ran with fewer threads than the usable cores because the automatic
    thread policy found the machine busy (``lab_utils.core.cpu_threads``: each timing records its
    ``threads`` in ``extra``, the run's context the policy and the usable cores): one line saying
    so, or "" when none was cut (or the thread count was set by hand)."""
    policy = ((context.get("timing") or {}).get("cpu_threads") or {}) if isinstance(context, dict) else {}
    cores = policy.get("cores") or (context.get("device_info") or {}).get("units")
    if policy.get("policy", "auto") != "auto" or not cores or not len(df) or "extra" not in df.columns:
        return ""
    t = df[df["metric"].astype(str).str.endswith("time") & (df["statistic"] == "median")]
    threads = []
    for e in t["extra"]:
        try:
            n = (json.loads(e) if isinstance(e, str) and e.startswith("{") else e if isinstance(e, dict) else {}).get(
                "threads"
            )
        except ValueError:
            n = None
        if isinstance(n, int):
            threads.append(n)
    cut = [n for n in threads if n < int(cores)]
    if not cut:
        return ""
    counts = ", ".join(f"{cut.count(n)} with {n}" for n in sorted(set(cut)))
    return (
        f"THREADS CUT: the machine was busy: {len(cut)} of {len(threads)} CPU timings ran with fewer threads than "
        f"the {cores} usable cores ({counts}), because other processes kept cores busy when they started. Their "
        f"times are not comparable with a run that had every core (perflab compare calls such rows 'not "
        f"comparable'); rerun on a quiet machine or fix the count with --timing-threads N."
    )
