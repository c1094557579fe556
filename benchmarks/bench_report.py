"""How long does `make report` (the smoke suite, headless) take?  Rerun: `python benchmarks/bench_report.py`.

Method: run the suite `--repeats` times in fresh kernels (ceilings already cached after the
first, as on a developer's machine), record the wall time of the whole run and of each
notebook, and write the median and spread to benchmarks/results/report_<suite>_<device>.json.
The README quotes this file; the smoke suite must stay under 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from lab_utils.core.device import device_info
from lab_utils.core.records import git_commit
from lab_utils.run.runner import run_suite


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--suite", default="smoke")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    runs = []
    for i in range(a.repeats):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            res = run_suite(a.suite, out_dir=d, progress=True, run_id=f"bench-{i}")
            wall = time.perf_counter() - t0
        runs.append(
            {
                "wall_s": wall,
                "ok": res.ok,
                "notebooks": {s.notebook: {"seconds": s.seconds, "status": s.status} for s in res.statuses},
            }
        )
        print(f"run {i}: {wall:.1f} s ({'ok' if res.ok else 'FAILED'})")
    info = device_info()
    walls = [r["wall_s"] for r in runs]
    out = {
        "suite": a.suite,
        "device": info.name,
        "units": f"{info.units} {info.units_name}",
        "torch": info.torch_version,
        "commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "method": "wall clock of run_suite (papermill, fresh kernel per notebook, HTML export included); "
        "median over repeats; ceilings cached",
        "median_wall_s": statistics.median(walls),
        "min_wall_s": min(walls),
        "max_wall_s": max(walls),
        "per_notebook_median_s": {
            nb: statistics.median(r["notebooks"][nb]["seconds"] for r in runs) for nb in runs[0]["notebooks"]
        },
        "runs": runs,
    }
    path = Path(a.out or Path(__file__).parent / "results" / f"report_{a.suite}_{info.kind}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"median {out['median_wall_s']:.1f} s over {len(walls)} runs -> {path}")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
