"""What ``perflab trace`` adds to each rank's summary for its page, and how the ranks' parts meet.

Each rank's job (:func:`lab_utils.run.trace_cli.analyse_rank`) reads its file once; beside the
summary of :mod:`lab_utils.traces.summary` it keeps, in ``RankSummary.extras`` (:func:`rank_extras`):

* for every rank: the idle time per stream (:mod:`lab_utils.traces.streams`) and, for the first
  :data:`MAX_RANKS` rank files, the critical path's length and parts per step (at most
  :data:`PATH_STEPS` steps; records ``critical_path`` in ms, which ``perflab trace diff`` gates as a
  time, and ``critical_path:<bound_by>`` in % of the path, which it reports but never gates: when a
  kernel gets faster the path's other parts take a larger share of it and may even lengthen, as
  what the kernel hid comes onto the path);
* for the first :data:`MAX_RANKS` rank files (``page=True``), for the step the page shows: the
  timeline's bars (:func:`lab_utils.traces.timeline.rank_bars`, merged past the bar limit), the
  Perfetto events (that step, or the whole trace), the critical path's figures
  (:mod:`lab_utils.traces.critical_path`), the call tree down to :data:`TREE_DEPTH` levels
  (:mod:`lab_utils.traces.hierarchy`), the repeated kernel sequences
  (:mod:`lab_utils.traces.sequences`), the launch outliers, the queue length and memory
  bandwidth summaries (:mod:`lab_utils.traces.counters`).

The step: ``--step N``, else the median-duration step of the folder's first file, read ahead from
its step annotations alone (:func:`lab_utils.run.trace_cli.page_job`), so each file is read once;
a job left without that step (its own choice when the look-ahead failed) is read again for it.
"""

from __future__ import annotations

from dataclasses import asdict

import pandas as pd

from lab_utils.core.records import json_value
from lab_utils.traces import TraceAnalysis, counters
from lab_utils.traces.critical_path import CriticalPath
from lab_utils.traces.hierarchy import top_levels
from lab_utils.traces.perfetto import perfetto_trace, rank_events
from lab_utils.traces.timeline import Timeline, all_steps, assemble, rank_bars, representative_step

MAX_RANKS = 8
PATH_STEPS = 8
#: unit of a part of the critical path: a share, no better direction for `perflab compare`
UNIT_OF_PATH = "% of critical path"
TREE_DEPTH = 5
TREE_MIN_PCT = 0.5
SERIES_POINTS = 2000  # per stream or memory kind, over the page's step
PERFETTO_MODES = ("step", "all", "none")


def rows(df: pd.DataFrame) -> list[dict]:
    return [{k: json_value(v) for k, v in r.items()} for r in df.to_dict(orient="records")]


def path_figures(cp: CriticalPath) -> dict:
    return {
        "step": cp.step,
        "length_us": cp.length_us,
        "window_us": cp.window_us,
        "share_of_step": 100.0 * cp.length_us / cp.window_us if cp.window_us > 0 else None,
        "by_bound": cp.by_bound(),
        "by_category": rows(cp.by_category()),
        "events": rows(cp.by_event(10)),
    }


def rank_figures(ta: TraceAnalysis, rank: int, cp: CriticalPath | None) -> dict:
    """The analyses of one rank as JSON-ready tables (see the module note); ``cp``: its critical path."""
    lo = ta.launch_outliers(rank)
    outliers = lo.table[lo.table["outlier"] != ""].sort_values("delay_us", ascending=False).head(10)
    return {
        "critical_path": path_figures(cp) if cp is not None else None,
        "hierarchy": rows(top_levels(ta.hierarchy(rank), TREE_DEPTH, TREE_MIN_PCT).head(300)),
        "sequences": rows(ta.sequences(rank).drop(columns=["names"])),
        "launch_outliers": {
            **{k: json_value(v) for k, v in asdict(lo).items() if k != "table"},
            "worst": rows(outliers),
        },  # fmt: skip
        "queue_length": rows(counters.queue_summary(ta.queue_length(rank))),
        "memory_bw": rows(counters.memory_bw_summary(ta.memory_bw(rank))),
    }


def step_series(ta: TraceAnalysis, rank: int, step: int | None, max_points: int = SERIES_POINTS) -> dict:
    """The launch queue per stream and the memory bandwidth per kind over one step (``None``: the
    trace's one window) as JSON-ready rows, ts in ms after the step's start (see
    :func:`lab_utils.traces.counters.in_window`)."""
    att = ta.attributed(rank)
    w = att.steps if step is None else att.steps[att.steps["step"] == step]
    lo, hi = float(w["ts"].iloc[0]), float(w["end"].iloc[0])
    out = {"step": step, "start_us": lo, "end_us": hi}
    for name, series, key, value in (("queue", ta.queue_length(rank, "all"), "stream", "queue_length"),
                                     ("memory_bw", ta.memory_bw(rank, "all"), "kind", "gbps")):  # fmt: skip
        part = counters.in_window(series, key, value, lo, hi, max_points)
        out[name] = rows(part.assign(ts=(part["ts"] - lo) / 1e3))
    return out


def path_values(ta: TraceAnalysis, rank: int, steps: list[int] | None = None) -> pd.DataFrame:
    """The critical path per step as record values (``RankSummary.per_step``'s columns): its
    length in ms and its part per ``bound_by`` in % of it; the first :data:`PATH_STEPS` steps."""
    att = ta.attributed(rank)
    if not att.has_steps:
        return pd.DataFrame(columns=["metric", "unit", "step_index", "value", "step"])
    steps = (steps if steps is not None else att.steps["step"].tolist())[:PATH_STEPS]
    out = []
    for i, s in enumerate(steps):
        cp = ta.critical_path(rank, s)
        out.append({"metric": "critical_path", "unit": "ms", "step_index": i, "value": cp.length_us / 1e3, "step": s})
        for b, pct in cp.by_bound().items():
            out.append({"metric": f"critical_path:{b}", "unit": UNIT_OF_PATH, "step_index": i,
                        "value": pct, "step": s})  # fmt: skip
    df = pd.DataFrame(out, columns=["metric", "unit", "step_index", "value", "step"])
    # a part a step's path lacks is 0 ms there, not a missing sample
    full = df.pivot_table(index="metric", columns="step_index", values="value", aggfunc="first").fillna(0.0)
    long = full.stack().rename("value").reset_index()
    long["unit"] = [("ms" if m == "critical_path" else UNIT_OF_PATH) for m in long["metric"]]
    long["step"] = [steps[int(i)] for i in long["step_index"]]
    return long[["metric", "unit", "step_index", "value", "step"]]


def rank_extras(ta: TraceAnalysis, rank: int, step: int | None, *, page: bool, max_bars: int, perfetto: str) -> dict:
    """``RankSummary.extras`` of one rank (see the module note)."""
    att = ta.attributed(rank)
    chosen = step if step is not None else representative_step(att)
    extras: dict = {"stream_idle": rows(ta.stream_idle().query("rank == @rank")), "step": chosen,
                    "steps": all_steps([att])}  # fmt: skip
    if not page:
        return extras
    has = not att.has_steps or chosen in set(att.steps["step"])
    cp = ta.critical_path(rank, chosen if att.has_steps else None) if has else None
    extras["figures"] = rank_figures(ta, rank, cp)
    extras["figures"]["series"] = step_series(ta, rank, chosen if att.has_steps else None) if has else None
    extras["bars"] = (rank_bars(rank, ta.traces[rank], att, chosen if att.has_steps else 0, phases=ta.phase_table,
                                path=cp.edges, max_bars=max_bars) if cp is not None else None)  # fmt: skip
    if perfetto != "none":
        steps = None if perfetto == "all" or not att.has_steps else chosen
        extras["perfetto"] = rank_events(rank, ta.traces[rank], att, steps)
    return extras


def job_timeline(job, step: int, max_bars: int) -> Timeline:
    """The timeline of ``step`` from the ranks' bars (``extras["bars"]``)."""
    shown = [r for r in job.ranks if "bars" in job.ranks_[r].extras]
    parts = [job.ranks_[r].extras["bars"] for r in shown if job.ranks_[r].extras["bars"] is not None]
    steps = sorted({s for r in job.ranks for s in job.ranks_[r].extras.get("steps", [])})
    return assemble(parts, step, steps, shown, max_bars=max_bars)


def job_perfetto(job) -> dict | None:
    """The Perfetto document of the ranks that carry their events."""
    events = [e for r in job.ranks for e in job.ranks_[r].extras.get("perfetto") or []]
    return perfetto_trace({}, {}) | {"traceEvents": events} if events else None


def analysis_figures(job, step: int | None) -> dict:
    """``{"analyses": {rank: ...}, "stream_idle": [...]}`` for ``trace.json`` (see the module note)."""
    out = {r: job.ranks_[r].extras["figures"] for r in job.ranks if "figures" in job.ranks_[r].extras}
    idle = [row for r in job.ranks for row in job.ranks_[r].extras.get("stream_idle", [])]
    return {"analyses": {str(r): v for r, v in out.items()}, "analysed_ranks": list(out), "stream_idle": idle,
            "timeline_step": step}  # fmt: skip


def _ms(us) -> str:
    return f"{(us or 0) / 1e3:.3f} ms"


def summary_lines(fig: dict) -> list[str]:
    """The text summary's lines for these analyses."""
    out = []
    for r, a in fig.get("analyses", {}).items():
        cp = a["critical_path"]
        if cp is None:
            out.append(f"rank {r}: no step {fig.get('timeline_step')} here, no critical path")
        else:
            bound = ", ".join(f"{k} {v:.1f}%" for k, v in sorted(cp["by_bound"].items(), key=lambda kv: -kv[1]))
            share = f" ({cp['share_of_step']:.0f}% of the step)" if cp["share_of_step"] is not None else ""
            out.append(f"rank {r} critical path of step {cp['step']}: {_ms(cp['length_us'])}{share}: "
                       f"{bound or 'empty'}")  # fmt: skip
            for e in cp["events"][:3]:
                out.append(f"    {_ms(e['us']):>12} {e['pct']:5.1f}%  {(e['name'] or '(launch delays)')[:80]}")
        tree = [t for t in a["hierarchy"] if 0 < t["depth"] <= 2 and t["kind"] != "kernel"][:5]
        if tree:
            out.append(f"rank {r} call tree (GPU time, total / self):")
            out += [f"    {_ms(t['gpu_total_us']):>12} / {_ms(t['gpu_self_us']):>12}  {t['path'][:90]}" for t in tree]
        for s in a["sequences"][:3]:
            out.append(f"rank {r} repeated: {s['short'][:90]} x{s['count']} ({_ms(s['total_us'])})")
        lo = a["launch_outliers"]
        out.append(f"rank {r} launches: {lo['launches']} calls, {lo['runtime_outliers']} over 50 us, "
                   f"{lo['delay_outliers']} with a launch delay over 100 us")  # fmt: skip
    idle = pd.DataFrame(fig.get("stream_idle", []))
    if len(idle):
        out.append("idle per stream (ms): rank stream host_wait kernel_wait other")
        out += [f"  {int(r.rank):4d} {int(r.stream):6d} {r.host_wait / 1e3:9.3f} {r.kernel_wait / 1e3:11.3f} "
                f"{r.other / 1e3:9.3f}" for r in idle.head(32).itertuples()]  # fmt: skip
    return out
