"""The analyses beyond the breakdown in ``perflab trace``: their figures in ``trace.json`` and their
lines in the text summary (trace.html draws the same figures: :mod:`lab_utils.run.trace_html`).

Per rank, for the first :data:`MAX_RANKS` ranks: the critical path of the timeline's step
(:mod:`lab_utils.traces.critical_path`), the call tree down to :data:`TREE_DEPTH` levels
(:mod:`lab_utils.traces.hierarchy`), the repeated kernel sequences (:mod:`lab_utils.traces.sequences`),
the launch outliers, the queue length and memory bandwidth summaries; for every rank the idle time
per stream (:mod:`lab_utils.traces.streams`, :mod:`lab_utils.traces.counters`).
"""

from __future__ import annotations

from dataclasses import asdict

import pandas as pd

from lab_utils.core.records import json_value
from lab_utils.traces import TraceAnalysis, counters
from lab_utils.traces.critical_path import CriticalPath
from lab_utils.traces.hierarchy import top_levels

MAX_RANKS = 8
TREE_DEPTH = 5
TREE_MIN_PCT = 0.5


def rows(df: pd.DataFrame) -> list[dict]:
    return [{k: json_value(v) for k, v in r.items()} for r in df.to_dict(orient="records")]


def rank_figures(ta: TraceAnalysis, rank: int, cp: CriticalPath | None) -> dict:
    """The analyses of one rank as JSON-ready tables (see the module note); ``cp``: its critical path."""
    seq = ta.sequences(rank)
    lo = ta.launch_outliers(rank)
    outliers = lo.table[lo.table["outlier"] != ""].sort_values("delay_us", ascending=False).head(10)
    path = None
    if cp is not None:
        path = {
            "step": cp.step,
            "length_us": cp.length_us,
            "window_us": cp.window_us,
            "share_of_step": 100.0 * cp.length_us / cp.window_us if cp.window_us > 0 else None,
            "by_bound": cp.by_bound(),
            "by_category": rows(cp.by_category()),
            "events": rows(cp.by_event(10)),
        }
    return {
        "critical_path": path,
        "hierarchy": rows(top_levels(ta.hierarchy(rank), TREE_DEPTH, TREE_MIN_PCT).head(300)),
        "sequences": rows(seq.drop(columns=["names"])),
        "launch_outliers": {
            **{k: json_value(v) for k, v in asdict(lo).items() if k != "table"},
            "worst": rows(outliers),
        },  # fmt: skip
        "queue_length": rows(counters.queue_summary(ta.queue_length(rank))),
        "memory_bw": rows(counters.memory_bw_summary(ta.memory_bw(rank))),
    }


def analysis_figures(ta: TraceAnalysis, step: int | None, paths: dict[int, CriticalPath] | None = None) -> dict:
    """``{"analyses": {rank: ...}, "stream_idle": [...]}`` for ``trace.json`` (see the module note);
    ``paths``: the critical paths already drawn (default: ``TraceAnalysis.critical_paths(step)``)."""
    ranks = ta.ranks[:MAX_RANKS]
    paths = ta.critical_paths(step, MAX_RANKS) if paths is None else paths
    return {
        "analyses": {str(r): rank_figures(ta, r, paths.get(r)) for r in ranks},
        "analysed_ranks": ranks,
        "stream_idle": rows(ta.stream_idle()),
    }


def _ms(us) -> str:
    return f"{(us or 0) / 1e3:.3f} ms"


def summary_lines(fig: dict) -> list[str]:
    """The text summary's lines for these analyses."""
    out = []
    for r, a in fig.get("analyses", {}).items():
        cp = a["critical_path"]
        if cp is None:
            out.append(f"rank {r}: no step {fig.get('timeline_step')} here, no critical path")
            cp = {"by_bound": {}, "share_of_step": None, "step": None, "length_us": 0, "events": []}
        bound = ", ".join(f"{k} {v:.1f}%" for k, v in sorted(cp["by_bound"].items(), key=lambda kv: -kv[1]))
        share = f" ({cp['share_of_step']:.0f}% of the step)" if cp["share_of_step"] is not None else ""
        out.append(f"rank {r} critical path of step {cp['step']}: {_ms(cp['length_us'])}{share}: {bound or 'empty'}")
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
