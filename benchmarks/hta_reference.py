"""HolisticTraceAnalysis's figures for the real GPU traces, stored once so CI needs no HTA.

Rerun (HTA is the optional extra ``traces``): ``pip install -e .[traces]`` then
``python benchmarks/hta_reference.py --traces FOLDER``.

For every job folder of the folder ``--traces`` names (one folder = one job, one file per
rank) this runs HolisticTraceAnalysis 0.5 in its exact mode
(``TraceAnalysis(trace_dir=job, include_last_profiler_step=True)`` with
``HTA_DISABLE_NS_ROUNDING=1`` in the environment, so ns float timestamps keep their
fraction) and writes, per rank, HTA's own figures to ``tests/data/hta_reference.json``:

- ``kernel_time_us`` / ``kernel_count``: the summed duration and count of the GPU events
  HTA keeps (its frame's rows with ``stream != -1``, as every HTA analysis selects them);
- ``kernel_time_by_step_us``: the same, grouped by HTA's ``iteration`` column (-1: none);
- ``type_time_us``: summed duration per HTA kernel type (``hta.utils.utils.get_kernel_type``);
- ``temporal``: ``get_temporal_breakdown`` (idle, compute, non-compute, span, percentages);
- ``overlap_pct``: ``get_comm_comp_overlap`` (share of communication time overlapped);
- ``idle_breakdown_us``: ``get_idle_time_breakdown`` summed over streams per category;
- ``top_kernels``: the five names with the largest summed duration (name, count, total);
- ``idle_by_stream_us``: ``get_idle_time_breakdown`` per stream and category;
- ``critical_path``: ``critical_path_analysis`` of the second CPU ``ProfilerStep`` (the first when
  there is one, the whole trace when there is none): the step, the path's length, its edge count,
  ``bound_by`` -> summed weight, the five events with the most time on it;
- ``launch_stats``: ``get_cuda_kernel_launch_stats`` (runtime cutoff 50 us, launch delay cutoff
  100 us): the launches counted, summed CPU/GPU durations and launch delays, and the outliers;
- ``queue_length``: ``get_queue_length_summary`` per stream (count, mean, max) and
  ``get_time_spent_blocked_on_full_queue`` (``max_queue_length`` 1024);
- ``memory_bw``: ``get_memory_bw_summary`` per memory kind (count, mean, max GB/s).

HolisticTraceAnalysis 0.5's critical path needs pandas < 3: under pandas 3's copy-on-write its
in-place ``fillna`` on column views does nothing, and ``DataFrame.drop(axis=1, columns=...)`` raises.
Run this script in an environment with ``pandas>=2.2,<3`` (the figures stored name the version).

Only figures are stored, never trace content beyond those five kernel names per rank.
Environment and version of HTA are stored beside them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import sys
from pathlib import Path

os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"  # before hta reads its options

import pandas as pd  # noqa: E402
from tqdm import tqdm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "data" / "hta_reference.json"


def _rank_figures(analysis, rank: int, sym_table: list[str]) -> dict:
    """HTA's figures for one rank, from HTA's own frame and analyses."""
    from hta.utils.utils import get_kernel_type  # noqa: PLC0415 - optional dependency (extra "traces")

    df = analysis.t.get_trace(rank)
    gpu = df[df["stream"].ne(-1)].copy()
    gpu["s_name"] = gpu["name"].map(lambda i: sym_table[i])
    gpu["kernel_type"] = gpu["s_name"].map(get_kernel_type)
    by_step = gpu.groupby("iteration")["dur"].sum() if "iteration" in gpu else pd.Series(dtype=float)
    by_name = gpu.groupby("s_name")["dur"].agg(["count", "sum"]).sort_values("sum", ascending=False)
    return {
        "kernel_time_us": float(gpu["dur"].sum()),
        "kernel_count": int(len(gpu)),
        "kernel_time_by_step_us": {str(int(k)): float(v) for k, v in by_step.items()},
        "type_time_us": {str(k): float(v) for k, v in gpu.groupby("kernel_type")["dur"].sum().items()},
        "top_kernels": [
            {"name": str(n), "count": int(r["count"]), "total_us": float(r["sum"])}
            for n, r in by_name.head(5).iterrows()
        ],
    }


def _critical_path(analysis, rank: int, sym_table: list[str]) -> dict:
    """HTA's critical path of the second CPU ProfilerStep of ``rank`` (see the module note)."""
    df = analysis.t.get_trace(rank)
    sym_index = analysis.t.symbol_table.get_sym_id_map()
    ids = [v for k, v in sym_index.items() if "ProfilerStep" in k]
    ann = df[df["name"].isin(ids)]
    on_host = [sym_table[int(c)] == "user_annotation" for c in ann["cat"]]  # not the GPU's mirror of the range
    cpu = ann.loc[on_host].sort_values("ts")
    if len(cpu):
        target = cpu.index[1] if len(cpu) > 1 else cpu.index[0]
        instance, name = list(ann.index).index(target), "ProfilerStep"
        step = int(sym_table[int(df.loc[target, "name"])].split("#")[1])
    else:
        instance, name, step = 0, "", None
    try:
        graph, ok = analysis.critical_path_analysis(rank=rank, annotation=name, instance_id=instance)
        edges = graph.get_critical_path_breakdown()
    except Exception as exc:  # HTA fails on some traces (an assertion on ROCm's): recorded as missing
        return {"step": step, "error": f"{type(exc).__name__}: {exc}"[:200]}
    events = edges[edges["duration"] > 0].groupby("s_name")["duration"].sum().sort_values(ascending=False)
    return {
        "step": step,
        "ok": bool(ok),
        "length_us": float(edges["duration"].sum()),
        "edges": int(len(edges)),
        "bound_by_us": {str(k): float(v) for k, v in edges.groupby("bound_by")["duration"].sum().items() if k},
        "top_events": [{"name": str(n), "us": float(v)} for n, v in events.head(5).items()],
    }


def _counters(analysis, rank: int) -> dict:
    """HTA's launch statistics, queue length and memory bandwidth summaries of ``rank``."""
    out: dict = {}
    ls = analysis.get_cuda_kernel_launch_stats(ranks=[rank], visualize=False)[rank]
    out["launch_stats"] = {
        "count": int(len(ls)),
        "cpu_us": float(ls["cpu_duration"].sum()),
        "gpu_us": float(ls["gpu_duration"].sum()),
        "launch_delay_us": float(ls["launch_delay"].sum()),
        "runtime_outliers": int((ls["cpu_duration"] > 50).sum()),
        "delay_outliers": int((ls["launch_delay"] > 100).sum()),
        "gpu_shorter_than_cpu": int((ls["gpu_duration"] < ls["cpu_duration"]).sum()),
    }
    series = analysis.get_queue_length_time_series(ranks=[rank])
    summary = analysis.get_queue_length_summary_from_time_series(series) if series else None
    out["queue_length"] = {}
    if summary is not None:
        for (_, stream), row in summary.iterrows():
            q = row["queue_length"]
            out["queue_length"][str(int(stream))] = {"count": int(q["count"]), "mean": float(q["mean"]),
                                                     "max": float(q["max"])}  # fmt: skip
        blocked = analysis.get_time_spent_blocked_on_full_queue(series)
        blocked = blocked if blocked is not None else pd.DataFrame(columns=["stream", "duration_at_max_queue_length"])
        out["blocked_on_full_queue_us"] = {
            str(int(r["stream"])): float(r["duration_at_max_queue_length"]) for _, r in blocked.iterrows()
        }
    bw = analysis.get_memory_bw_summary(ranks=[rank])
    out["memory_bw"] = {}
    if bw is not None:
        for (_, kind), row in bw.iterrows():
            m = row["memory_bw_gbps"]
            out["memory_bw"][str(kind)] = {"count": int(m["count"]), "mean": float(m["mean"]), "max": float(m["max"])}
    return out


def _job_figures(job: Path) -> dict:
    from hta.trace_analysis import TraceAnalysis  # noqa: PLC0415 - optional dependency (extra "traces")

    analysis = TraceAnalysis(trace_dir=str(job), include_last_profiler_step=True)
    sym_table = analysis.t.symbol_table.get_sym_table()
    temporal = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    ranks = {}
    for rank in analysis.t.get_ranks():
        fig = _rank_figures(analysis, rank, sym_table)
        row = temporal.loc[rank]
        fig["temporal"] = {str(k): float(v) for k, v in row.items()}
        ov = overlap.loc[rank, "comp_comm_overlap_pctg"]
        fig["overlap_pct"] = None if pd.isna(ov) else float(ov)
        try:
            idle, _ = analysis.get_idle_time_breakdown(ranks=[rank], visualize=False)
            fig["idle_breakdown_us"] = {
                str(k): float(v) for k, v in idle.groupby("idle_category")["idle_time"].sum().items()
            }
            fig["idle_by_stream_us"] = {
                str(int(s)): {str(k): float(v) for k, v in g.groupby("idle_category")["idle_time"].sum().items()}
                for s, g in idle.groupby("stream")
            }
        except Exception as exc:  # HTA raises on some traces; the figure is then recorded as missing
            fig["idle_breakdown_us"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        fig["critical_path"] = _critical_path(analysis, rank, sym_table)
        fig.update(_counters(analysis, rank))
        ranks[str(rank)] = fig
    files = sorted(p.name for p in job.iterdir() if p.is_file())
    return {"files": files, "ranks": ranks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--traces", type=Path, required=True, help="a folder of job folders, one profiler trace file per rank in each"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if not args.traces.is_dir():
        print(f"--traces: {args.traces} is not a folder (expected one folder per job)", file=sys.stderr)
        return 2
    logging.getLogger("hta").setLevel(logging.ERROR)
    jobs = sorted(p for p in args.traces.iterdir() if p.is_dir())
    out = {
        "hta_version": importlib.metadata.version("holistictraceanalysis"),
        "mode": {"include_last_profiler_step": True, "HTA_DISABLE_NS_ROUNDING": "1"},
        "pandas": pd.__version__,
        "jobs": {},
    }
    for job in tqdm(jobs, desc="HTA over jobs"):
        out["jobs"][job.name] = _job_figures(job)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out} ({len(jobs)} jobs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
