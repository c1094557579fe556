"""Fused-op sweep: op × variant × (tokens × hidden from the model presets) × dtype × direction,
plus whole MMDiT blocks (double and single stream) forward + backward per provider.

Rerun on a GPU (the figures that go in the repo; H100/H200):
    python benchmarks/bench_kernels.py --out benchmarks/results/kernels_h200.parquet
CPU smoke (small; Triton excluded — the interpreter is never timed):
    python benchmarks/bench_kernels.py --preset cpu --out /tmp/kernels_cpu.parquet

Method: ``lab_utils.fused.ops`` — every (op, variant, dtype) checked against float64 (forward
and gradients, irregular shape) before it is timed (the script exits non-zero if one
fails), inputs drawn once per case, every timeable variant
through the lab's one timing primitive (``lab_utils.core.timing.bench``: first call — compile,
autotune — out of the statistics, L2 flushed on CUDA), median with p20/p80.  GB/s from the
bytes each op must move (each input read once, each output written once; formulas in each
op module's docstring and ``lab_utils.core.flops.fused_bytes``), % of the *measured* copy ceiling
(``lab_utils.core.ceilings``), speedup over eager, peak memory above the inputs (CUDA).  The
summary printed at the end lists, per op/direction/dtype, each variant's GB/s and % of the
copy ceiling at the largest size (the target: Triton >= 85% there).

Rows are the tidy Recorder columns (``.parquet``, ``.csv`` or ``.json`` by the suffix of
``--out``), with the run's context (device, versions, commit, ceilings) merged on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from lab_utils.core.ceilings import get_ceilings
from lab_utils.core.device import device_info, pick_device
from lab_utils.core.records import Recorder, run_context
from lab_utils.core.session import Session
from lab_utils.fused import blocks as fused_blocks
from lab_utils.fused import ops as kb
from lab_utils.studies.fused_kernels import BLOCK_TOLERANCE, sweep_frame

PRESETS = {
    # FLUX-dev widths (hidden 3072, MLP 12288, head dim 128); 1024² image = 4096 tokens (+512 text).
    "gpu": dict(
        presets=["flux-dev", "medium"],
        tokens=[1024, 4096, 8192, 16384],
        batch=1,
        dtypes=["bfloat16", "float32"],
        directions=["fwd", "bwd", "fwd+bwd"],
        variants=None,
        reps=20,
        budget_s=60.0,
        block_preset="flux-dev",
        block_img_tokens=4096,
        block_txt_tokens=512,
        block_dtype="bfloat16",
        block_providers=["eager", "compile", "triton", "triton+compile"],
    ),
    "cpu": dict(
        presets=["small"],
        tokens=[128, 512],
        batch=1,
        dtypes=["float32"],
        directions=["fwd", "fwd+bwd"],
        variants=["eager", "torch"],
        reps=5,
        budget_s=10.0,
        block_preset="tiny",
        block_img_tokens=64,
        block_txt_tokens=16,
        block_dtype="float32",
        block_providers=["eager"],
    ),
}


def _write(df, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        d = df.copy()
        d["samples"] = d["samples"].map(lambda s: json.dumps(s) if s is not None else None)
        d.to_parquet(out, index=False)
    elif out.suffix == ".csv":
        df.to_csv(out, index=False)
    else:
        out.write_text(df.to_json(orient="records", indent=1))


def summary(df, ceilings) -> str:
    """Per op/direction/dtype: each variant's GB/s and % of the copy ceiling at the largest size."""
    sw = sweep_frame(df)
    if sw.empty:
        return "no timed rows"
    lines = [f"copy ceiling {ceilings.copy_gbs:.0f} GB/s (measured); largest size per op:"]
    for (op, dr, dt), g in sw.groupby(["op", "direction", "dtype"]):
        big = g[g["bytes"] == g["bytes"].max()]
        parts = [f"{r.variant} {r.gbs:.0f} GB/s ({100 * r.gbs / ceilings.copy_gbs:.0f}%)" for r in big.itertuples()]
        lines.append(f"  {op:20s} {dr:8s} {dt:9s} {big['shape'].iloc[0]:>18s}: " + ", ".join(parts))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=tuple(PRESETS), default="gpu" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, help="rows file (.parquet, .csv or .json)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--ops", nargs="+", choices=kb.OP_NAMES, default=list(kb.OP_NAMES))
    ap.add_argument("--model-presets", nargs="+", help="model presets whose widths are swept")
    ap.add_argument("--tokens", type=int, nargs="+")
    ap.add_argument("--dtypes", nargs="+", choices=tuple(kb.DTYPES))
    ap.add_argument("--directions", nargs="+", choices=kb.DIRECTIONS)
    ap.add_argument("--variants", nargs="+", help="variant names (default: every timeable one)")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--no-block", action="store_true", help="skip the whole-block comparison")
    ap.add_argument("--full-ceilings", action="store_true", help="measure the full (not quick) ceilings")
    a = ap.parse_args(argv)
    p = dict(PRESETS[a.preset])
    for k, v in (
        ("presets", a.model_presets),
        ("tokens", a.tokens),
        ("dtypes", a.dtypes),
        ("directions", a.directions),
        ("variants", a.variants),
        ("reps", a.reps),
    ):
        if v is not None:
            p[k] = v
    dev = pick_device(a.device)
    info = device_info(dev)
    out = a.out or Path("benchmarks/results") / f"kernels_{info.kind}_{a.preset}.parquet"
    t0 = time.perf_counter()
    ceil = get_ceilings(dev, quick=not a.full_ceilings)
    rec = Recorder(lab="bench_kernels", params={"preset": a.preset, **p, "ops": a.ops}, device=dev, ceilings=ceil)
    problems = kb.problems_for(p["presets"], p["tokens"], batch=p["batch"])
    print(f"{info.name}: {len(a.ops)} ops x {len(problems)} sizes x {p['dtypes']} x {p['directions']}", flush=True)
    for op in a.ops:
        kb.sweep(
            kb.OpGrid([op], problems, p["dtypes"], p["directions"], p["variants"]),
            Session(dev, rec),
            reps=p["reps"],
            budget_s=p["budget_s"],
            check=kb.Problem(1, 37, 781, 62),
        )
        print(f"  {op} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    if not a.no_block:
        cases = fused_blocks.block_cases(
            p["block_preset"],
            providers=p["block_providers"],
            img_tokens=p["block_img_tokens"],
            txt_tokens=p["block_txt_tokens"],
            dtype=kb.as_dtype(p["block_dtype"]),
            device=dev,
        )
        tol = BLOCK_TOLERANCE[p["block_dtype"]]
        for r in fused_blocks.block_agreement(cases):
            if r["max_abs_diff"] > tol:
                raise AssertionError(f"{r['kind']}/{r['provider']} block differs from eager by {r['max_abs_diff']:.3g}")
            rec.add(
                "block_agreement",
                r["provider"],
                "max_abs_diff_vs_eager",
                r["max_abs_diff"],
                kind=r["kind"],
                max_abs_ref=r["max_abs_ref"],
            )
        fused_blocks.block_compare(
            rec,
            cases,
            device=dev,
            dtype=kb.as_dtype(p["block_dtype"]),
            reps=p["reps"],
            budget_s=max(p["budget_s"], 60.0),
        )
        print(f"  blocks done ({time.perf_counter() - t0:.0f} s)", flush=True)
    df = rec.frame()
    ctx = run_context(rec.params, dev, ceilings=ceil)
    for c in ("device", "device_kind", "torch_version", "triton_version", "cuda_version", "commit", "timestamp"):
        df[c] = ctx.get(c, "")
    _write(df, out)
    print(summary(df, ceil))
    print(f"{len(df)} rows -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
