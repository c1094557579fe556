"""What the stability telemetry costs on a training step.

Rerun (the figure the README quotes; goal: under 5% at ``small`` sampling every 10 steps):
    python benchmarks/bench_telemetry.py --preset small --every 1 10
GPU:
    python benchmarks/bench_telemetry.py --preset small --device cuda --batch-size 8 --resolution 256

Method: one MMDiT training step as the lab runs it (rectified-flow loss, backward, gradient
clipping, :class:`lab_utils.stability.training.StabilityAdamW`), timed by the one timing primitive
(``lab_utils.core.timing.bench``: first call out of the statistics, samples judged for stability).
One sample is ``block`` consecutive steps (the largest ``--every``), so a sample holds the same
number of sampled steps every time.  Variants: telemetry off, and attached with sampling every
N steps (hooks stay registered on the other steps and return at once).  The overhead is the
ratio of medians minus one; a row whose timing the machine disturbed says so (``stable``), and
an overhead computed from an unstable timing, or while the baseline (measured first and last)
moved by more than 3%, is not a measurement.  Rows:
benchmarks/results/telemetry_<device-kind>_<preset>.json (tidy rows, like every Recorder).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lab_utils.core.device import device_info, pick_device
from lab_utils.core.records import Recorder
from lab_utils.core.timing import bench
from lab_utils.model.mmdit import build_model
from lab_utils.model.train import rf_loss, synthetic_batch
from lab_utils.stability.telemetry import Telemetry
from lab_utils.stability.training import StabilityAdamW


class StepLoop:
    """``block`` training steps on fixed batches, with or without telemetry."""

    def __init__(self, a, every: int | None):
        self.dev = pick_device(a.device)
        self.model = build_model(a.preset, self.dev, seed=0).train()
        self.tel = Telemetry(self.model, every=every, head_groups=1) if every else None
        self.params = list(self.model.parameters())
        self.opt = StabilityAdamW(self.params, lr=1e-4)
        g = torch.Generator().manual_seed(0)
        self.batches = [
            synthetic_batch(
                a.preset, a.batch_size, height=a.resolution, width=a.resolution, txt_len=a.txt_len, generator=g
            ).to(self.dev)
            for _ in range(4)
        ]
        self.gen = torch.Generator(self.dev).manual_seed(1)
        self.autocast = a.autocast and self.dev.type == "cuda"
        self.block, self.i = a.block, 0

    def step(self):
        tel, i = self.tel, self.i
        if tel:
            tel.begin_step(i)
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.autocast):
            parts = rf_loss(self.model, self.batches[i % len(self.batches)], self.gen, return_parts=True)
        parts.loss.backward()
        if tel:
            tel.after_backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.track = bool(tel and tel.active)
        self.opt.step()
        if tel:
            tel.after_step(self.opt.last_stats)
            per = (parts.pred.detach().float() - parts.target.float()).square().mean(dim=(1, 2))
            tel.log_loss(parts.t, per)
            tel.end_step()
            tel.rows.clear()  # a long run would drain rows to records; here they are dropped
        self.opt.zero_grad(set_to_none=True)
        self.i += 1
        return parts.loss.detach()

    def __call__(self):
        out = None
        for _ in range(self.block):
            out = self.step()
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--resolution", type=int, default=128)
    ap.add_argument("--txt-len", type=int, default=32)
    ap.add_argument("--every", type=int, nargs="+", default=[1, 10], help="sampling intervals to measure")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--autocast", action="store_true", help="bf16 autocast (CUDA only)")
    ap.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (1: steady on a shared box)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    a.block = max(a.every)
    dev = pick_device(a.device)
    info = device_info(dev)
    if dev.type == "cpu":
        torch.set_num_threads(a.threads)  # the un-timed first call too, not only the samples
    rec = Recorder("bench_telemetry", params=vars(a), device=dev)
    shape = (a.batch_size, a.resolution, a.resolution)
    medians = {}
    # "off" is measured first and last: a load that changed in between shows as two different
    # baselines, and then no overhead of this run is a measurement
    for every in [None, *a.every, None]:
        name = "off" if every is None else f"every={every}"
        name = "off (again)" if name in medians else name
        loop = StepLoop(a, every)
        t = bench(
            loop, name=name, device=dev, reps=a.reps, warmup_ms=0.0, budget_s=a.budget_s, retries=1, threads=a.threads
        )
        medians[name] = t
        rec.add_timing("telemetry_overhead", name, t, shape=shape, preset=a.preset, steps_per_sample=a.block)
        print(
            f"{name:10s} {t.median_ms / a.block:9.2f} ms/step  (p20 {t.p20_ms / a.block:.2f}, "
            f"p80 {t.p80_ms / a.block:.2f}; {t.stability})"
        )
        if loop.tel:
            loop.tel.close()
    base, again = medians["off"], medians["off (again)"]
    drift = abs(again.median_ms / base.median_ms - 1)
    print(f"baseline moved by {100 * drift:.1f}% between the first and the last measurement")
    for name, t in medians.items():
        if name.startswith("off"):
            continue
        overhead = t.median_ms / base.median_ms - 1
        stable = bool(t.stable and base.stable and again.stable and drift < 0.03)
        rec.add(
            "telemetry_overhead",
            name,
            "overhead",
            100 * overhead,
            "%",
            shape=shape,
            stable=stable,
            formula="median(with) / median(off) - 1",
            preset=a.preset,
        )
        verdict = "" if stable else "  (NOT a measurement: a timing was unstable or the baseline moved > 3%)"
        print(f"overhead {name}: {100 * overhead:+.1f}% of the step{verdict}")
    out = Path(a.out or Path(__file__).parent / "results" / f"telemetry_{info.kind}_{a.preset}.json")
    print("rows:", rec.save(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
