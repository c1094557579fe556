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
- ``top_kernels``: the five names with the largest summed duration (name, count, total).

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
        except Exception as exc:  # HTA raises on some traces; the figure is then recorded as missing
            fig["idle_breakdown_us"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
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
