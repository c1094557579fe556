"""Memory over one step: the profiler's categorized memory events on CPU, the allocator
snapshot on CUDA; downsampling for plots; what is live at the peak."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from collections import defaultdict
from pathlib import Path

import pandas as pd
import torch

from lab_utils.core.noise import quiet_stderr_fd
from lab_utils.memory.saved import SavedReport, SavedTensor
from lab_utils.step.contract import StepFactory

# --------------------------------------------------------------------------------------
# Timelines
# --------------------------------------------------------------------------------------

#: Categories of the profiler's memory timeline (torch.profiler's memory profile).
TIMELINE_CATEGORIES = (
    "parameters",
    "optimizer",
    "inputs",
    "temporaries",
    "activations",
    "gradients",
    "autograd",
    "unknown",
)


def profiled_timeline(fn, path: str | Path) -> pd.DataFrame:
    """Run ``fn()`` under the profiler's memory events (``profile_memory=True``), categorized by
    torch's memory profile; the full timeline is written to ``path`` (JSON) and returned as a
    frame: time (ms from the first event) and live bytes per category."""
    with (
        quiet_stderr_fd(),  # kineto's profiler_start/stop markers
        torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
        ) as prof,
    ):
        fn()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # deprecated for CUDA in favour of the snapshot, which CPU lacks
        warnings.simplefilter("ignore", FutureWarning)
        prof.export_memory_timeline(str(path), device="cpu")
    times, sizes = json.loads(path.read_text())
    # each row: a leading unused slot, then one column per category in torch's order
    df = pd.DataFrame([row[1 : 1 + len(TIMELINE_CATEGORIES)] for row in sizes], columns=list(TIMELINE_CATEGORIES))
    df.insert(0, "time_ms", (pd.Series(times, dtype=float) - (times[0] if times else 0)) / 1e3)
    return df


def cpu_timeline(step: StepFactory, path: str | Path, k: int = 1) -> pd.DataFrame:
    """Step ``k``'s categorized memory timeline on CPU (its batch made before; forward, backward,
    optimizer step; see :func:`profiled_timeline`)."""
    batch = step.make_batch(k)

    def one():
        step.loss(step.model, batch).backward()
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)

    return profiled_timeline(one, path)


def cuda_timeline(step: StepFactory, path: str | Path, k: int = 1) -> pd.DataFrame:
    """Step ``k`` under ``torch.cuda.memory._record_memory_history``; the snapshot goes to
    ``path`` (pickle, for pytorch.org/memory_viz) and its trace is categorized by address:
    parameters, gradients and optimizer state are known tensors, the rest is activations
    (alive at the end of the forward) or temporaries."""
    model, opt, dev = step.model, step.optimizer, step.device
    batch = step.make_batch(k)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        loss = step.loss(model, batch)
        marker = torch.empty(1, device=dev)  # its allocation marks the end of the forward in the trace
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize(dev)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(snap))
    known = {}
    for p in model.parameters():
        known[p.data_ptr()] = "parameters"
        if p.grad is not None:
            known[p.grad.data_ptr()] = "gradients"
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.is_cuda:
                known[v.data_ptr()] = "optimizer"
    param_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())  # allocated before recording
    return categorize_trace(snap, known, marker.data_ptr(), param_bytes)


def categorize_trace(snap: dict, known: dict[int, str], marker: int, param_bytes: int = 0) -> pd.DataFrame:
    """Live bytes per category after every alloc/free of a CUDA memory snapshot's trace:
    the last allocation at an address in ``known`` (gradients, optimizer state: alive at the
    end) takes its category;
    other allocations made before the marker's allocation (end of the forward) are
    activations, later ones temporaries.  ``param_bytes`` were allocated before recording."""
    totals = defaultdict(int)
    totals["parameters"] = param_bytes
    live: dict[int, tuple[str, int]] = {}
    rows = []
    t0 = None
    trace = [ev for tr in snap.get("device_traces", []) for ev in tr if ev["action"] in ("alloc", "free_completed")]
    fwd_end = max(
        (i for i, ev in enumerate(trace) if ev["action"] == "alloc" and ev["addr"] == marker),
        default=len(trace),
    )
    last = {ev["addr"]: i for i, ev in enumerate(trace) if ev["action"] == "alloc"}
    for i, ev in enumerate(trace):
        t = ev.get("time_us", 0)
        t0 = t if t0 is None else t0
        addr, size = ev["addr"], ev["size"]
        if ev["action"] == "alloc":
            cat = known[addr] if addr in known and last[addr] == i else None
            cat = cat or ("activations" if i < fwd_end else "temporaries")
            live[addr] = (cat, size)
            totals[cat] += size
        elif addr in live:
            cat, size = live.pop(addr)
            totals[cat] -= size
        rows.append({"time_ms": (t - t0) / 1e3, **{c: totals[c] for c in CUDA_CATEGORIES}})
    return pd.DataFrame(rows, columns=["time_ms", *CUDA_CATEGORIES])


def alloc_conf() -> str:
    """The CUDA caching allocator's settings (``expandable_segments:True`` cuts fragmentation)."""
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))


CUDA_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")


def downsample(df: pd.DataFrame, max_points: int = 2000) -> pd.DataFrame:
    """At most ``max_points`` rows for a plot, keeping each bucket's maximum total (peaks survive)."""
    if len(df) <= max_points:
        return df
    cats = [c for c in df.columns if c != "time_ms"]
    bucket = (pd.Series(range(len(df))) * max_points // len(df)).to_numpy()
    total = df[cats].sum(axis=1).to_numpy()
    keep = pd.DataFrame({"b": bucket, "t": total}).groupby("b")["t"].idxmax().to_numpy()
    return df.iloc[keep].reset_index(drop=True)


def largest_live(report: SavedReport, top: int = 10) -> list[SavedTensor]:
    """The largest storages kept for the backward (what is live at the end of the forward,
    where an AC step's memory peaks), with the region and op that made them."""
    return sorted(report.tensors, key=lambda t: -t.nbytes)[:top]
