"""Do timings on a busy CPU say that they are disturbed?  Rerun: `python benchmarks/bench_noise.py`.

Method: lab 02's sweep (``lab_utils.studies.fused_kernels.run_sweep``, the parameters of
``parameterized/sets/02_fused_kernels/smoke.yaml``, in this process, no papermill) runs
twice: once as the machine is ("quiet"), then while a busy-loop subprocess pinned to one
core keeps that core busy ("hogged"; the hog is always killed, even on an error).  For
each run it reports the share of timing rows flagged unstable and, row by row, the ratio
of medians hogged / quiet.  Both runs' records are written (``noise_cpu/quiet`` and
``noise_cpu/hogged`` under the results folder) so that ``perflab compare QUIET HOGGED``
can be run on them; this script runs that comparison itself.

Goals (issue 11, section 1), checked and written to ``benchmarks/results/noise_cpu.json``:

1. quiet-run spread p80/p20 <= 1.15 for ops of >= 0.1 ms: only *checked* when the machine
   was quiet (other processes kept less than half a core busy while it ran); otherwise the
   figure is reported with the load, as not checked;
2. every hogged row is within 1.5x of its quiet median, or flagged unstable;
3. ``perflab compare QUIET HOGGED`` calls no flagged row "slower";
4. and it exits 0: checked when the quiet run was quiet (otherwise the pair is rightly
   "not comparable", exit 3, and the figure is reported).

Exit status: 1 if a checked goal is not met, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from lab_utils.core.cpu_threads import busy_cores, choose_cpu_threads, usable_cores
from lab_utils.core.device import device_info
from lab_utils.core.records import git_commit, stability_summary
from lab_utils.run.compare import main as compare_main
from lab_utils.run.suites import params_dir
from lab_utils.studies import fused_kernels as study

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


@contextlib.contextmanager
def cpu_hog(core: int) -> Iterator[subprocess.Popen]:
    """A busy loop pinned to ``core`` for the duration of the block; always killed."""
    p = subprocess.Popen([sys.executable, "-c", HOG, str(core)])
    try:
        time.sleep(0.5)  # let it start spinning
        if p.poll() is not None:
            raise RuntimeError(f"the CPU hog exited at once (status {p.returncode})")
        yield p
    finally:
        p.kill()
        p.wait(timeout=10)


def load_probe(seconds: float = 1.0) -> float:
    """Mean number of cores other processes keep busy, probed over ``seconds``."""
    vals = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        b = busy_cores(probes=5, interval_s=0.01)
        if b is not None:
            vals.append(b)
    return float(np.mean(vals)) if vals else float("nan")


def run_sweep(params: dict, label: str, out: Path) -> tuple[pd.DataFrame, dict]:
    """One run of lab 02's sweep; records saved to ``out/records.json``."""
    before = load_probe(0.5)
    threads = choose_cpu_threads()
    t0 = time.perf_counter()
    lab = study.start(params)
    lab.rec.params = {**lab.rec.params, "noise_run": label}
    summary = study.run_sweep(lab)
    seconds = time.perf_counter() - t0
    after = load_probe(0.5)
    out.mkdir(parents=True, exist_ok=True)
    path = lab.rec.save(out / "records.json")
    (out / "context.json").write_text(json.dumps({**lab.rec.context(), "run_id": f"noise-{label}"}, indent=1))
    df = lab.rec.frame()
    info = {
        "label": label,
        "records": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
        "seconds": round(seconds, 1),
        "sweep": summary,
        "busy_cores_before": round(before, 2),
        "busy_cores_after": round(after, 2),
        "threads_at_start": threads.as_dict(),
    }
    return df, info


def timing_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per timed (op, variant, shape, direction): median, p20, p80, verdict."""
    t = df[(df.metric == "time") & df.statistic.isin(["median", "p20", "p80"])].copy()
    for k in ("op", "direction"):
        t[k] = t["extra"].map(lambda e, k=k: json.loads(e).get(k) if e else "")
    key = ["op", "variant", "shape", "dtype", "direction"]
    wide = t.pivot_table(index=key, columns="statistic", values="value", aggfunc="first")
    verdict = t[t.statistic == "median"].set_index(key)[["stable", "stability"]]
    return wide.join(verdict).reset_index()


def check_goals(quiet: pd.DataFrame, hogged: pd.DataFrame, quiet_busy: float, cmp_json: dict, rc: int) -> dict:
    q, h = timing_table(quiet), timing_table(hogged)
    key = ["op", "variant", "shape", "dtype", "direction"]
    m = q.merge(h, on=key, suffixes=("_quiet", "_hogged"))
    m["ratio"] = m["median_hogged"] / m["median_quiet"]
    m["spread_quiet"] = m["p80_quiet"] / m["p20_quiet"]
    big = m[m["median_quiet"] >= 0.1]
    quiet_machine = bool(quiet_busy < 0.5)
    worst_spread = float(big["spread_quiet"].max()) if len(big) else float("nan")
    goal1 = {
        "goal": "quiet-run spread p80/p20 <= 1.15 for ops of >= 0.1 ms",
        "rows": int(len(big)),
        "worst_spread": round(worst_spread, 3),
        "rows_over": int((big["spread_quiet"] > 1.15).sum()),
        "met": bool(len(big) and worst_spread <= 1.15),
        "checked": quiet_machine,
        "note": ""
        if quiet_machine
        else f"the 'quiet' run was not quiet (other processes kept {quiet_busy:.1f} cores busy)",
    }
    flagged = m["stable_hogged"] == False  # noqa: E712 - True/False/None column
    within = m["ratio"] <= 1.5
    offenders = m[~within & ~flagged]
    goal2 = {
        "goal": "every hogged row within 1.5x of the quiet median, or flagged unstable",
        "rows": int(len(m)),
        "within_1.5x": int(within.sum()),
        "flagged": int(flagged.sum()),
        "neither": [
            f"{r.op}/{r.variant} {r.shape} {r.direction}: x{r.ratio:.2f} "
            f"(p20 {r.p20_hogged:.3g}, p80 {r.p80_hogged:.3g} ms)"
            for r in offenders.itertuples()
        ],
        "met": bool(len(offenders) == 0 and len(m)),
        "checked": True,
    }
    rows = cmp_json.get("rows", [])
    slower_flagged = [
        f"{r['variant']} {r['shape']} {r['metric']}"
        for r in rows
        if r.get("verdict") == "slower" and (r.get("cand_stable") is False or r.get("base_stable") is False)
    ]
    goal3 = {
        "goal": "perflab compare QUIET HOGGED: no 'slower' verdict on a flagged row",
        "result": cmp_json.get("result", ""),
        "verdicts": cmp_json.get("counts", {}),
        "slower_on_flagged_rows": slower_flagged,
        "met": not slower_flagged,
        "checked": True,
    }
    goal4 = {
        "goal": "perflab compare QUIET HOGGED exits 0",
        "exit_code": rc,
        "met": rc == 0,
        # exit 3 is the right answer when the quiet run itself was mostly unstable (not comparable)
        "checked": quiet_machine,
        "note": ""
        if quiet_machine
        else f"the quiet run was not quiet ({quiet_busy:.1f} cores busy), so compare rightly "
        f"calls the pair not comparable (exit {rc})",
    }
    table = m[key + ["median_quiet", "median_hogged", "ratio", "spread_quiet", "stable_quiet", "stable_hogged"]]
    table = table.assign(stability_hogged=m["stability_hogged"])
    return {"goals": [goal1, goal2, goal3, goal4], "rows": json.loads(table.round(4).to_json(orient="records"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", default="smoke", help="lab 02 parameter set (parameterized/sets/02_fused_kernels/)")
    ap.add_argument("--reps", type=int, default=None, help="samples per timing (default: the set's)")
    ap.add_argument("--out", default=str(RESULTS / "noise_cpu.json"))
    a = ap.parse_args(argv)
    params = yaml.safe_load((params_dir() / "sets" / study.LAB / f"{a.set}.yaml").read_text())
    params["device"] = "cpu"
    if a.reps is not None:
        params["reps"] = a.reps
    cores = usable_cores()
    hog_core = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    folder = Path(a.out).with_suffix("")
    t0 = time.perf_counter()
    print(f"quiet run (lab 02 sweep, set {a.set}) ...", flush=True)
    quiet, qinfo = run_sweep(params, "quiet", folder / "quiet")
    print(f"hogged run (a busy loop pinned to core {hog_core}) ...", flush=True)
    with cpu_hog(hog_core):
        hogged, hinfo = run_sweep(params, "hogged", folder / "hogged")
    cmp_dir = folder / "compare"
    rc = compare_main([str(folder / "quiet" / "records.json"), str(folder / "hogged" / "records.json"), "--out",
                       str(cmp_dir), "--quiet"])  # fmt: skip
    cmp_json = json.loads((cmp_dir / "compare.json").read_text())
    quiet_busy = float(np.nanmean([qinfo["busy_cores_before"], qinfo["busy_cores_after"]]))
    checked = check_goals(quiet, hogged, quiet_busy, cmp_json, rc)
    for info, df in ((qinfo, quiet), (hinfo, hogged)):
        s = stability_summary(df)
        info.update(timings=s.timings, unstable=s.unstable, unstable_share=round(s.share, 3), examples=list(s.examples))
    ratios = np.asarray([r["ratio"] for r in checked["rows"] if r["ratio"] is not None], dtype=float)
    result = {
        "what": "lab 02's sweep quiet and with a busy loop on one core: unstable share and ratio of medians",
        "command": "python benchmarks/bench_noise.py" + (f" --set {a.set}" if a.set != "smoke" else ""),
        "machine": {
            "device": device_info("cpu").name,
            "usable_cores": cores,
            "note": "shared with other work while this ran (the busy_cores figures say how much)",
        },
        "commit": git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(time.perf_counter() - t0, 1),
        "runs": {"quiet": qinfo, "hogged": hinfo},
        "ratio_of_medians_hogged_over_quiet": {
            "median": round(float(np.median(ratios)), 3) if ratios.size else None,
            "max": round(float(ratios.max()), 3) if ratios.size else None,
            "rows_over_1.5x": int((ratios > 1.5).sum()),
        },
        **checked,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"quiet: {qinfo['unstable']} of {qinfo['timings']} timings unstable, other processes kept "
        f"{quiet_busy:.1f} cores busy; hogged: {hinfo['unstable']} of {hinfo['timings']} unstable; "
        f"ratio of medians hogged/quiet: median {result['ratio_of_medians_hogged_over_quiet']['median']}, "
        f"max {result['ratio_of_medians_hogged_over_quiet']['max']}"
    )
    failed = []
    for g in checked["goals"]:
        state = ("met" if g["met"] else "NOT MET") if g["checked"] else f"not checked ({g['note']})"
        print(f"  {g['goal']}: {state}")
        if g["checked"] and not g["met"]:
            failed.append(g["goal"])
    print(f"wrote {a.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
