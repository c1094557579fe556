"""The attributed trace as Chrome trace-event JSON, for Perfetto (ui.perfetto.dev) or chrome://tracing.

What is written (:func:`perfetto_trace`; the format is the Trace Event Format's JSON object form,
``{"traceEvents": [...], "displayTimeUnit": "ms"}``):

* per rank two processes: ``rank R · host`` (pid ``2R + 1``: its threads' CPU operators, user
  ranges and runtime calls, as recorded) and ``rank R · GPU`` (pid ``2R + 2``: one thread per
  stream, ``tid`` = the stream number); each named by a ``process_name`` metadata event
  (``ph: "M"``) and ordered by ``process_sort_index``, each thread named by ``thread_name``;
* every activity (kernel, memcpy, memset) as a complete event (``ph: "X"``, ``ts`` and ``dur`` in
  microseconds on the trace's own clock, ns kept as three decimals) with its attribution in
  ``args``: ``step``, ``window``, ``phase``, ``range``, ``block``, ``category``, ``hta_type``, the
  launching ``op``, ``launch_ts``, ``queue_delay_us``, ``correlation``; a flow arrow
  (``ph: "s"``/``"f"``, ``cat: "launch"``) from its launch call to it;
* ``steps`` (an ``int`` or a list): only those steps' activities and the host events inside those
  steps' windows; default every event.

Perfetto draws the slices of one thread as a stack, so slices on a thread must nest.  Recorded
host events sometimes do not (a range closed a few ns after its parent); such an event is moved
to a thread of its own (a fresh ``tid``, named ``thread T (overlap L)``) rather than dropped, so
every event is kept and every thread nests.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd

from lab_utils.traces.attribute import Attributed
from lab_utils.traces.reader import RankTrace, texts

_ARGS = ("step", "window", "phase", "range", "block", "category", "hta_type", "op")


def host_pid(rank: int) -> int:
    return 2 * rank + 1


def gpu_pid(rank: int) -> int:
    return 2 * rank + 2


def _tid_number(tid, fallback: int) -> int:
    try:
        return int(tid)
    except (TypeError, ValueError):
        return fallback


def _nest_levels(ts: np.ndarray, end: np.ndarray) -> np.ndarray:
    """For slices sorted by (ts, -dur): the first level on which each nests properly."""
    stacks: list[list[float]] = []
    level = np.zeros(len(ts), dtype=np.int64)
    for i, (a, b) in enumerate(zip(ts, end)):
        for j, st in enumerate(stacks):
            while st and st[-1] <= a:
                st.pop()
            if not st or b <= st[-1]:
                st.append(b)
                level[i] = j
                break
        else:
            stacks.append([b])
            level[i] = len(stacks) - 1
    return level


def _meta(name: str, pid: int, tid: int | None, value) -> dict:
    ev = {"ph": "M", "name": name, "pid": pid, "args": {"name" if "name" in name else "sort_index": value}}
    if tid is not None:
        ev["tid"] = tid
    return ev


def _clean(v):
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return None
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    return v


def _step_filter(att: Attributed, steps) -> tuple[pd.DataFrame, list[tuple[float, float]]]:
    k = att.kernels
    if steps is None:
        return k, []
    want = {int(s) for s in ([steps] if isinstance(steps, int | np.integer) else steps)}
    w = att.steps[att.steps["step"].isin(want)]
    return k[(k["window"] == "step") & k["step"].isin(want)], list(zip(w["ts"], w["end"]))


def rank_events(rank: int, trace: RankTrace, att: Attributed, steps=None) -> list[dict]:
    """One rank's events (see the module note)."""
    t0 = float(trace.t0_us)
    hp, gp = host_pid(rank), gpu_pid(rank)
    k, windows = _step_filter(att, steps)
    out: list[dict] = [
        _meta("process_name", hp, None, f"rank {rank} · host"),
        _meta("process_sort_index", hp, None, hp),
        _meta("process_name", gp, None, f"rank {rank} · GPU" + (f" ({trace.device_name})" * bool(trace.device_name))),
        _meta("process_sort_index", gp, None, gp),
    ]
    host = trace.host
    if windows and len(host):
        inside = np.zeros(len(host), dtype=bool)
        for lo, hi in windows:
            inside |= (host["ts"].to_numpy() >= lo) & (host["ts"].to_numpy() < hi)
        host = host[inside]
    threads: dict[int, str] = {}
    groups = list(host.groupby(texts(host["tid"]), sort=True))
    numbers = {tid: _tid_number(tid, -1) for tid, _ in groups}
    spare = max([n for n in numbers.values()] + [0]) + 1  # tids for threads without a number, and overlaps
    for tid, grp in groups:
        if numbers[tid] < 0:
            numbers[tid], spare = spare, spare + 1
        g = grp.sort_values(["ts", "dur"], ascending=[True, False], kind="stable")
        levels = _nest_levels(g["ts"].to_numpy(), g["end"].to_numpy())
        level_tid = {0: numbers[tid]}
        for lvl in range(1, int(levels.max(initial=0)) + 1):
            level_tid[lvl], spare = spare, spare + 1
        cols = (texts(g["cat"]), texts(g["name"]), g["ts"].tolist(), g["dur"].tolist(), g["correlation"].tolist(),
                g["external_id"].tolist(), levels.tolist())  # fmt: skip
        for cat, name, ts, dur, corr, ext, lvl in zip(*cols):
            t = level_tid[lvl]
            threads.setdefault(t, f"thread {tid}" + (f" (overlap {lvl})" if lvl else ""))
            args = {"correlation": int(corr)} if corr >= 0 else {}
            if ext >= 0:
                args["External id"] = int(ext)
            out.append({"ph": "X", "cat": cat, "name": name, "pid": hp, "tid": t,
                        "ts": round(t0 + ts, 3), "dur": round(max(dur, 0.0), 3), "args": args})  # fmt: skip
    for t, name in sorted(threads.items()):
        out.append(_meta("thread_name", hp, t, name))
    streams: set[int] = set()
    launch_tid = {str(t): numbers.get(str(t), _tid_number(t, 0)) for t in k["launch_tid"].dropna().unique()}
    given = {key: [_clean(v) for v in k[key].tolist()] for key in _ARGS}
    cols = (k["stream"].tolist(), k["correlation"].tolist(), k["device"].tolist(), k["queue_delay"].tolist(),
            k["launch_ts"].tolist(), k["ts"].tolist(), k["dur"].tolist(), texts(k["cat"]), texts(k["name"]),
            k["launch_tid"].tolist())  # fmt: skip
    for i, (s, corr, device, delay, launch_ts, start, dur, cat, name, ltid) in enumerate(zip(*cols)):
        s = int(s)
        streams.add(s)
        args = {key: given[key][i] for key in _ARGS}
        args |= {"correlation": int(corr), "stream": s, "device": int(device),
                 "queue_delay_us": _clean(round(delay, 3))}  # fmt: skip
        launched = not pd.isna(launch_ts)
        if launched:
            args["launch_ts"] = round(t0 + launch_ts, 3)
        ts = round(t0 + start, 3)
        out.append({"ph": "X", "cat": cat, "name": name, "pid": gp, "tid": s, "ts": ts,
                    "dur": round(max(dur, 0.0), 3), "args": args})  # fmt: skip
        if launched and att.rule == "gpu":
            fid = rank * 10_000_000 + i
            lt = launch_tid.get(ltid, 0)
            out.append({"ph": "s", "cat": "launch", "name": "launch", "id": fid, "pid": hp, "tid": lt,
                        "ts": round(t0 + launch_ts, 3)})  # fmt: skip
            out.append({"ph": "f", "bp": "e", "cat": "launch", "name": "launch", "id": fid, "pid": gp, "tid": s,
                        "ts": ts})  # fmt: skip
    for s in sorted(streams):
        out.append(_meta("thread_name", gp, s, f"stream {s}"))
        out.append(_meta("thread_sort_index", gp, s, s))
    return out


def perfetto_trace(traces: dict[int, RankTrace], atts: dict[int, Attributed], steps=None) -> dict:
    """The job's attributed trace as a Chrome trace-event JSON object (see the module note)."""
    events: list[dict] = []
    for r in sorted(traces):
        events += rank_events(r, traces[r], atts[r], steps)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"writer": "perflab trace"}}


def write_perfetto(doc: dict, path: str | Path) -> Path:
    """Write ``doc`` as JSON; gzipped when ``path`` ends in ``.gz`` (Perfetto opens both)."""
    path = Path(path)
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path
