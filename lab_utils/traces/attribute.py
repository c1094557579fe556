"""Every GPU kernel, memcpy and memset to what launched it: op, step, user ranges, phase.

Rules (each pinned by a test in tests/unit/traces/test_collectives.py):

* **launch**: the runtime/driver call (``cudaLaunchKernel``, ``hipExtModuleLaunchKernel``,
  ``cudaMemcpyAsync`` ...) with the activity's ``correlation`` id.  Its start is the launch time,
  its thread the launch thread.  An activity whose launch is not in the trace keeps
  ``window = "no launch"`` (HolisticTraceAnalysis drops these; perflab keeps and reports them).
* **op**: the ``cpu_op`` whose ``External id`` the activity carries (Kineto stamps the launching
  operator's id on the runtime call and the kernel), else the innermost ``cpu_op`` on the
  launch thread that encloses the launch.
* **step**: the ``ProfilerStep#N`` range (host side) that encloses the *launch*, not the kernel's
  run: a GPU running 100 ms behind the host still charges each kernel to the step that issued it.
  Launches before the first step are ``window = "before"``, after the last ``"after"``, between
  two steps ``"gap"``; all are reported apart from the steps.  An activity without a launch in
  the trace whose correlation id is below every launch's (ids grow with time) was launched before
  the trace began: also ``"before"`` (its ``launch_ts`` is NaN).  A trace without ``ProfilerStep``
  ranges is one window, step 0, covering the whole trace.
* **ranges**: the user ranges (``user_annotation``) enclosing the launch on the launch thread;
  a launch on another thread (autograd's backward thread, a comms thread) also gets the ranges
  of the *main* thread (the one holding ``ProfilerStep``) that enclose it in time, the launch
  thread's own ranges taking precedence.  ``range`` is the innermost such range, ``phase`` the
  innermost one with a phase (:mod:`lab_utils.traces.phases`), ``block`` the innermost MMDiT block.
* **CPU traces**: a rank whose trace has no GPU activity is read by the CPU rule
  (:mod:`lab_utils.traces.cpu`): its leaf operators (and its collectives, whole) stand as the
  activities, each launched by itself, then attributed to steps and ranges as above;
  ``Attributed.rule`` is ``"cpu"`` (``"gpu"`` otherwise).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from lab_utils.traces import cpu
from lab_utils.traces.categories import category, hta_type, operator_category, operator_hta_type
from lab_utils.traces.phases import PhaseTable, block_of
from lab_utils.traces.reader import RankTrace, per_text, texts

WINDOWS = ("step", "before", "after", "gap", "no launch")
_STEP = re.compile(r"^ProfilerStep\s*#\s*(\d+)$")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver", "Runtime")


@dataclass
class Attributed:
    """One rank's GPU activities with their attribution, and its step windows."""

    rank: int
    kernels: pd.DataFrame  # reader's gpu columns + launch_ts, launch_tid, op, step, window, range, phase, block, ...
    steps: pd.DataFrame  # step, ts, end, dur (host-side windows, us after t0)
    has_steps: bool
    main_tid: str | None
    rule: str = "gpu"  # "cpu": no GPU activity, read by the CPU rule (lab_utils.traces.cpu)


def step_windows(host: pd.DataFrame) -> pd.DataFrame:
    """``ProfilerStep#N`` ranges of the host timeline: step, ts, end, dur (sorted by ts)."""
    if not len(host):
        return pd.DataFrame(columns=["step", "ts", "end", "dur", "tid"])
    number = per_text(host["name"], _step_number, np.int64)
    keep = (number >= 0) & host["cat"].eq("user_annotation").to_numpy()
    rows = host[keep].copy()
    rows["step"] = number[keep]
    rows = rows.sort_values("ts").drop_duplicates("step")
    return rows[["step", "ts", "end", "dur", "tid"]].reset_index(drop=True)


def _step_number(name: str) -> int:
    m = _STEP.match(name)
    return int(m.group(1)) if m else -1


def _paint(times: np.ndarray, ranges: pd.DataFrame, labels: np.ndarray, out: np.ndarray) -> None:
    """For each range (outermost first), write its label on the ``times`` inside [ts, end):
    inner ranges overwrite outer ones, so ``out`` ends with the innermost label."""
    if not len(ranges) or not len(times):
        return
    order = np.argsort(times, kind="stable")
    st = times[order]
    by_len = np.argsort(-ranges["dur"].to_numpy(), kind="stable")
    lo = np.searchsorted(st, ranges["ts"].to_numpy()[by_len], side="left")
    hi = np.searchsorted(st, ranges["end"].to_numpy()[by_len], side="left")
    lab = labels[by_len]
    for a, b, v in zip(lo, hi, lab):
        if b > a:
            out[order[a:b]] = v


def _launches(host: pd.DataFrame) -> pd.DataFrame:
    rt = host[host["cat"].isin(_LAUNCH_CATS) & (host["correlation"] >= 0)]
    rt = rt.drop_duplicates("correlation")
    return pd.DataFrame(
        {
            "correlation": rt["correlation"].to_numpy(),
            "launch_ts": rt["ts"].to_numpy(),
            "launch_dur": rt["dur"].to_numpy(),
            "launch_tid": texts(rt["tid"]),
            "launch_name": texts(rt["name"]),
        }
    )


def _ops(host: pd.DataFrame, k: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Launching operator (host row index, name): by External id, else the innermost cpu_op
    enclosing the launch on its thread."""
    ops = host[host["cat"].eq("cpu_op")]
    by_ext = pd.Series(ops.index, index=ops["external_id"].to_numpy())
    by_ext = by_ext[by_ext.index >= 0]
    by_ext = by_ext[~by_ext.index.duplicated()]
    idx = k["external_id"].map(by_ext).to_numpy(dtype=np.float64).copy()
    missing = np.isnan(idx) & k["launch_ts"].notna().to_numpy()
    if missing.any():
        for tid, grp in ops.groupby(texts(ops["tid"]), observed=True):
            sel = np.flatnonzero(missing & (k["launch_tid"].to_numpy() == tid))
            if len(sel):
                lab = np.full(len(sel), np.nan)
                _paint(k["launch_ts"].to_numpy()[sel], grp, grp.index.to_numpy(dtype=np.float64), lab)
                idx[sel] = lab
    op_index = np.where(np.isnan(idx), -1, idx).astype(np.int64)
    if not len(host):  # GPU activities only (a profile of ProfilerActivity.CUDA alone): no operator
        return op_index, np.full(len(op_index), "", dtype=object)
    names = texts(host["name"].take(np.clip(op_index, 0, None)))
    return op_index, np.where(op_index >= 0, names, "").astype(object)


def _window(launch: np.ndarray, steps: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    n = len(launch)
    step = np.full(n, -1, dtype=np.int64)
    window = np.full(n, "no launch", dtype=object)
    ok = ~np.isnan(launch)
    starts, ends = steps["ts"].to_numpy(), steps["end"].to_numpy()
    i = np.searchsorted(starts, launch[ok], side="right") - 1
    inside = (i >= 0) & (launch[ok] < ends[np.clip(i, 0, None)])
    w = np.where(i < 0, "before", np.where(inside, "step", np.where(launch[ok] >= ends.max(), "after", "gap")))
    s = np.where(inside, steps["step"].to_numpy()[np.clip(i, 0, None)], -1)
    step[ok], window[ok] = s, w
    return step, window


def _ranges(host: pd.DataFrame, k: pd.DataFrame, main_tid: str | None, phases: PhaseTable) -> dict[str, np.ndarray]:
    ann = host[host["cat"].eq("user_annotation")]
    ann = ann[per_text(ann["name"], _step_number, np.int64) < 0]
    names = texts(ann["name"])
    ph = np.array([phases.phase(n) for n in names], dtype=object)
    blk = np.array([block_of(n) for n in names], dtype=object)
    n = len(k)
    out = {key: np.full(n, None, dtype=object) for key in ("range", "phase", "block")}
    launch = k["launch_ts"].to_numpy()
    ltid = k["launch_tid"].to_numpy()
    ok = ~np.isnan(launch)
    tids = texts(ann["tid"])
    passes = [(main_tid, ok)] if main_tid is not None else []
    passes += [(t, ok & (ltid == t)) for t in pd.unique(tids)]
    for tid, sel_mask in passes:
        sel = np.flatnonzero(sel_mask)
        mine = tids == tid
        if not len(sel) or not mine.any():
            continue
        for key, lab in (("range", names), ("phase", ph), ("block", blk)):
            use = mine & (lab != None)  # noqa: E711 - elementwise on an object array
            cur = out[key][sel].copy()
            _paint(launch[sel], ann[use], lab[use], cur)
            out[key][sel] = cur
    return out


def _categories(k: pd.DataFrame) -> np.ndarray:
    """Each activity's category (:func:`category` of its name, kind and launching op), worked out
    once per distinct triple."""
    if not len(k):
        return np.zeros(0, dtype=object)
    names, cats, ops = texts(k["name"]), texts(k["cat"]), k["op"].to_numpy(dtype=object)
    parts = [pd.factorize(v)[0].astype(np.int64) for v in (names, cats, ops)]
    key = (parts[0] * (parts[1].max() + 2) + parts[1] + 1) * (parts[2].max() + 2) + parts[2] + 1
    first, inv = np.unique(key, return_index=True, return_inverse=True)[1:]
    out = np.empty(len(first), dtype=object)
    out[:] = [category(names[i], cats[i], ops[i]) for i in first]
    return out[inv.ravel()]


def attribute(trace: RankTrace, phases: PhaseTable | None = None) -> Attributed:
    """Attribute one rank's GPU activities (see the module note)."""
    phases = phases or PhaseTable()
    host, gpu = trace.host, trace.gpu
    steps = step_windows(host)
    has_steps = bool(len(steps))
    if not has_steps:
        lo = min(host["ts"].min() if len(host) else np.inf, gpu["ts"].min() if len(gpu) else np.inf)
        hi = max(host["end"].max() if len(host) else -np.inf, gpu["end"].max() if len(gpu) else -np.inf)
        lo, hi = (0.0, 0.0) if not np.isfinite(lo) else (lo, hi)
        steps = pd.DataFrame(
            {"step": [0], "ts": [lo], "end": [np.nextafter(hi, np.inf)], "dur": [hi - lo], "tid": [None]}
        )
    main_tid = None
    if has_steps:
        main_tid = str(steps["tid"].astype(str).mode().iloc[0])
    elif len(host):
        ops = host[host["cat"].eq("cpu_op")]
        main_tid = str(pd.Series(texts(ops["tid"])).mode().iloc[0]) if len(ops) else None
    rule = cpu.RULE if cpu.applies(trace) else "gpu"
    if rule == cpu.RULE:
        k = cpu.launch_columns(cpu.activities(trace))
    else:
        k = gpu.merge(_launches(host), on="correlation", how="left")
        k["op_index"], k["op"] = _ops(host, k) if len(k) else (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=object))
    launch = k["launch_ts"].to_numpy(dtype=np.float64)
    if not has_steps:  # one window: every launched activity is in step 0; with no host events, every one
        unplaced = np.isnan(launch) & bool(len(host))
        k["step"] = np.where(unplaced, -1, 0)
        k["window"] = np.where(unplaced, "no launch", "step")
    else:
        k["step"], k["window"] = _window(launch, steps)
    launched = k["correlation"][~np.isnan(launch)]
    if len(launched):  # correlation ids grow with time: below every launch in the trace = launched before it began
        early = np.isnan(launch) & (k["correlation"].to_numpy() < launched.min()) & (k["correlation"].to_numpy() >= 0)
        k.loc[early, "window"] = "before"
    for key, arr in _ranges(host, k, main_tid, phases).items():
        k[key] = arr
    if rule == cpu.RULE:
        k["hta_type"] = per_text(k["name"], operator_hta_type)
        k["category"] = per_text(k["name"], operator_category)
    else:
        k["hta_type"] = per_text(k["name"], hta_type)
        k["category"] = _categories(k)
    k["queue_delay"] = k["ts"] - k["launch_ts"]
    return Attributed(trace.rank, k, steps.drop(columns="tid"), has_steps, main_tid, rule)
