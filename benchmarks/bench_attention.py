"""Attention sweep: sequence length x head dim x mask x path, forward and forward+backward.

Rerun (GPU, the numbers that go in the repo):
    python benchmarks/bench_attention.py --preset gpu
CPU smoke (small, Triton excluded — the interpreter is never timed):
    python benchmarks/bench_attention.py --preset cpu

Method: ``lab_utils.attention.attend.sweep`` — inputs (B, H, L, Dh) drawn once per case, every
path through ``attend`` (mask preprocessing cached after the first call, so timings
are attention only; the FlexAttention block-mask build is timed on its own), the one
timing primitive (``lab_utils.core.timing.bench``: first call out of the statistics,
L2 flushed on CUDA), median with p20/p80.  FLOPs are mask-aware (allowed pairs x 4 x Dh
forward; backward 2.5x, the "kernel" convention of ``lab_utils.core.flops``, recorded on every
row as ``flop_convention``); TFLOP/s and % of the *measured* matmul ceiling of the dtype
(``lab_utils.core.ceilings``).  Also writes the padding-vs-packing comparison of one
bucketed batch.  Rows: benchmarks/results/attention_<device-kind>_<dtype>.{json,csv}
(tidy rows, same columns as every Recorder) unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from lab_utils.attention import attend as A
from lab_utils.attention import varlen as V
from lab_utils.core.ceilings import get_ceilings
from lab_utils.core.device import device_info, pick_device
from lab_utils.core.dtypes import LAB_DTYPES, parse_dtype
from lab_utils.core.records import Recorder
from lab_utils.core.session import Session
from lab_utils.core.timing import BenchOptions

PRESETS = {
    # FLUX-dev: 24 heads x 128, joint sequence 512 text + 4096 image tokens at 1024^2.
    "gpu": dict(
        seq_lens=[1024, 2048, 4608, 8192, 16384],
        head_dims=[64, 128],
        heads=24,
        batch=1,
        masks=["full", "causal", "mmdit", "neighborhood", "document", "sliding_window"],
        paths=["sdpa", "flash", "efficient", "cudnn", "flex", "triton", "flash_attn", "math"],
        dtype="bfloat16",
        reps=20,
        budget_s=60.0,
        varlen_batch=8,
        varlen_heads=24,
        buckets=V.BUCKETS_1MP + [(512, 512), (640, 384), (384, 640)],
        txt_len=[64, 512],
    ),
    "cpu": dict(
        seq_lens=[128, 256, 512],
        head_dims=[64],
        heads=2,
        batch=1,
        masks=["full", "causal", "mmdit"],
        paths=["sdpa", "math", "flash", "flex_eager"],
        dtype="float32",
        reps=5,
        budget_s=10.0,
        varlen_batch=4,
        varlen_heads=2,
        buckets=V.BUCKETS_SMALL,
        txt_len=[16, 64],
    ),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=tuple(PRESETS), default="gpu" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", choices=LAB_DTYPES)
    ap.add_argument("--seq-lens", type=int, nargs="+")
    ap.add_argument("--head-dims", type=int, nargs="+")
    ap.add_argument("--masks", nargs="+")
    ap.add_argument("--paths", nargs="+")
    ap.add_argument("--directions", nargs="+", default=["fwd", "fwd+bwd"])
    ap.add_argument("--heads", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--no-varlen", action="store_true", help="skip the padding-vs-packing batch")
    ap.add_argument("--full-ceilings", action="store_true", help="measure the full (not quick) ceilings")
    ap.add_argument("--out", default=None, help="output stem (writes .json and .csv)")
    a = ap.parse_args(argv)
    p = dict(PRESETS[a.preset])
    for k in ("dtype", "seq_lens", "head_dims", "masks", "paths", "heads", "batch", "reps"):
        if getattr(a, k) is not None:
            p[k] = getattr(a, k)
    dev = pick_device(a.device)
    dtype = parse_dtype("dtype", p["dtype"], LAB_DTYPES)
    info = device_info(dev)
    ceilings = get_ceilings(dev, quick=not a.full_ceilings and dev.type == "cpu", progress=True)
    params = {**p, "directions": a.directions, "device": str(dev), "preset": a.preset}
    params.pop("buckets")
    rec = Recorder(lab="03_attention", params=params, device=dev, ceilings=ceilings)
    t0 = time.perf_counter()
    grid = A.SweepGrid(
        paths=tuple(p["paths"]),
        masks=tuple(p["masks"]),
        seq_lens=tuple(p["seq_lens"]),
        head_dims=tuple(p["head_dims"]),
        directions=tuple(a.directions),
        batch=p["batch"],
        heads=p["heads"],
        dtype=dtype,
    )
    rows = A.sweep(grid, Session(dev, rec, ceilings), A.SweepOptions(reps=p["reps"], budget_s=p["budget_s"]))
    for r in rows:
        status = f"{r['time_ms']:.4g} ms" + (
            f"  {r['tflops']:.3g} TFLOP/s" if r.get("tflops") == r.get("tflops") and "tflops" in r else ""
        )
        print(
            f"L={r['seq_len']:<6} D={r['head_dim']:<4} {r['mask']:<15} {r['path']:<17} {r['direction']:<8} "
            f"{status if r['time_ms'] == r['time_ms'] else 'skip: ' + r['note'][:90]}",
            flush=True,
        )
    if not a.no_varlen:
        batch = V.bucket_batch(p["varlen_batch"], buckets=p["buckets"], txt_len=tuple(p["txt_len"]), seed=0)
        for bwd in (False, True):
            V.time_padding_vs_packing(
                batch,
                p["varlen_heads"],
                max(p["head_dims"]),
                paths=p["paths"],
                dtype=dtype,
                session=Session(dev, rec, ceilings),
                backward=bwd,
                bench=BenchOptions(reps=p["reps"], budget_s=p["budget_s"]),
            )
    out = Path(a.out) if a.out else (Path(__file__).parent / "results" / f"attention_{info.kind}_{p['dtype']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    rec.save(out.with_suffix(".json"))
    df = rec.frame()
    df.to_csv(out.with_suffix(".csv"), index=False)
    print(
        f"{len(df)} rows in {time.perf_counter() - t0:.0f} s -> {out}.json / .csv "
        f"(device {info.name}, ceiling {ceilings.matmul(p['dtype'])} TFLOP/s {p['dtype']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
