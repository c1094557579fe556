"""Lab 01 on any step: where its time and memory go.

The step runs :func:`lab_utils.step.contract.run_step` (phases ``data_loading``, ``forward``,
``backward``, ``optimizer``, each a ``record_function`` range, plus the factory's own ranges
nested inside them) under ``torch.profiler`` for ``warmup + steps`` steps; the trace of the
active steps is written and analysed by :func:`lab_utils.profiling.traces.analyse_trace`
(kernel categories, top operators, allocated memory), the phases are read from the same file
(the factory's own phases too, each with the step phase that holds it).  FLOPs of one step:
the factory's ``flops(batch)``, else ``FlopCounterMode`` over one real forward + backward.
MFU = FLOPs / step time against the datasheet peak (:class:`ProfileReport`'s rule)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from lab_utils.core.config import check_int
from lab_utils.core.noise import quiet_stderr_fd
from lab_utils.core.timing import judge_samples
from lab_utils.model.train import artifacts_dir
from lab_utils.profiling.profiler import ProfileReport, count_flops
from lab_utils.profiling.traces import analyse_trace
from lab_utils.step.contract import STEP_PHASES, StepFactory, StepIdentity, identity, run_step


def step_flops(step: StepFactory, k: int = 1) -> tuple[float, str]:
    """FLOPs of one forward + backward of batch ``k`` and where the figure comes from."""
    batch = step.make_batch(k)
    if step.flops is not None:
        return float(step.flops(batch)), "the factory's flops(batch)"
    step.optimizer.zero_grad(set_to_none=True)
    total, _ = count_flops(lambda: step.loss(step.model, batch).backward())
    step.optimizer.zero_grad(set_to_none=True)
    return float(total), "FlopCounterMode over one forward + backward"


def trace_phases(path: str | Path, names: tuple[str, ...]) -> pd.DataFrame:
    """Per profiled step, the summed time of each named ``record_function`` range (host
    side) and the step phase that holds it (``within``: "" for the step phases themselves)."""
    raw = json.loads(Path(path).read_text())
    evs = raw["traceEvents"] if isinstance(raw, dict) else raw
    xs = [e for e in evs if e.get("ph") == "X" and e.get("cat") == "user_annotation" and "dur" in e]
    steps = sorted((e for e in xs if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    tops = [e for e in xs if e["name"] in STEP_PHASES]
    rows = []
    for i, s in enumerate(steps):
        lo, hi = s["ts"], s["ts"] + s["dur"]
        for e in xs:
            if e["name"] in names and lo <= e["ts"] < hi:
                within = ""
                if e["name"] not in STEP_PHASES:
                    holder = [t for t in tops if t["ts"] <= e["ts"] and e["ts"] + e["dur"] <= t["ts"] + t["dur"]]
                    within = holder[0]["name"] if holder else "(none)"
                rows.append(dict(step=i, phase=e["name"], within=within, ms=e["dur"] / 1e3))
    df = pd.DataFrame(rows, columns=["step", "phase", "within", "ms"])
    return df.groupby(["step", "phase", "within"], as_index=False, sort=False)["ms"].sum()


@dataclass
class GenericProfile:
    """One profiled step: the report (its analysis holds the step phases only, so nothing is
    counted twice), every phase with its holder, the FLOPs and their source, the identity."""

    report: ProfileReport
    phases: pd.DataFrame  # step, phase, within, ms
    flops: float
    flops_source: str
    ident: StepIdentity

    @property
    def phase_set(self) -> set[str]:
        return set(self.phases.phase)

    def phase_table(self) -> pd.DataFrame:
        """Median ms per phase over the profiled steps, share of the median step, holder."""
        step_ms = float(self.report.analysis.steps.step_ms.median())
        t = self.phases.groupby(["phase", "within"], as_index=False, sort=False)["ms"].median()
        t["pct_of_step"] = 100 * t.ms / step_ms
        return t

    @property
    def peak_bytes(self) -> float:
        r = self.report
        return r.cuda_peak_bytes if r.cuda_peak_bytes is not None else r.analysis.peak_allocated_bytes


def profile_step(step: StepFactory, *, steps: int = 3, warmup: int = 1, out_dir=None) -> GenericProfile:
    """Profile ``warmup + steps`` steps of ``step`` (steps 1, 2, ...) and analyse the active ones."""
    check_int("steps", steps, min=1)
    check_int("warmup_steps", warmup, min=0)
    dev = next(step.model.parameters()).device
    cuda = dev.type == "cuda"
    out = Path(out_dir) if out_dir is not None else artifacts_dir() / "traces"
    out.mkdir(parents=True, exist_ok=True)
    ident = identity(step)
    safe = "".join(c if c.isalnum() else "_" for c in ident.factory)[-60:]
    trace = out / f"step-{safe}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.trace.json"
    flops, source = step_flops(step)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with (
        quiet_stderr_fd(),
        profile(
            activities=acts,
            schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
            profile_memory=True,
            on_trace_ready=lambda p: p.export_chrome_trace(str(trace)),
        ) as prof,
    ):
        for k in range(1, warmup + steps + 1):
            run_step(step, k)
            if cuda:
                torch.cuda.synchronize(dev)
            prof.step()
    peak = float(torch.cuda.max_memory_allocated(dev)) if cuda else None
    analysis = analyse_trace(trace, "cuda" if cuda else "cpu")
    phases = trace_phases(trace, STEP_PHASES + tuple(step.phases))
    top = phases[phases.within == ""]
    # the report's analysis keeps the step phases only: the factory's own ranges nest in them
    st = analysis.steps.copy()
    st["phase_sum_ms"] = [float(top[top.step == i].ms.sum()) for i in range(len(st))]
    st["coverage"] = st.phase_sum_ms / st.step_ms
    analysis = dataclasses.replace(analysis, phases=top[["step", "phase", "ms"]].reset_index(drop=True), steps=st)
    report = ProfileReport(analysis, trace, [int(flops)] * steps, cuda_peak_bytes=peak)
    return GenericProfile(report, phases, flops, source, ident)


def record_profile(rec, prof: GenericProfile, *, datasheet=None, dtype: str = "fp32") -> None:
    """Rows of the generic profile; each variant starts with the step's identity key, so rows
    of two models never match in ``perflab compare``."""
    key = prof.ident.key
    ex = dict(model_class=prof.ident.model_class, parameters=prof.ident.parameters, config=prof.ident.config_hash)
    ms = prof.report.amortised_step_ms
    v = judge_samples(ms)
    rec.add("step_profile", key, "step_time", float(pd.Series(ms).median()), "ms", statistic="median",
            samples=ms, stable=v.stable, stability=v.reason, **ex)  # fmt: skip
    for r in prof.phase_table().itertuples():
        per = prof.phases[prof.phases.phase == r.phase].ms.to_numpy(float)
        pv = judge_samples(per) if len(per) >= 3 else None
        rec.add("step_profile", f"{key} · {r.phase}", "phase_time", r.ms, "ms", statistic="median", samples=per,
                stable=pv.stable if pv else None, stability=pv.reason if pv else "", within=r.within, **ex)  # fmt: skip
    for r in prof.report.analysis.categories.itertuples():
        rec.add("step_profile", f"{key} · {r.category}", "category_time", r.ms, "ms", **ex)
    rec.add("step_profile", key, "flops", prof.flops, "FLOP", source=prof.flops_source, **ex)
    rec.add("step_profile", key, "peak_allocated", prof.peak_bytes / 2**20, "MiB", **ex)
    mfu = prof.report.mfu(None, datasheet, dtype)
    for r in mfu.itertuples():
        value, unit = (r.pct, "%") if r.pct is not None and r.pct == r.pct else (r.tflops, "TFLOP/s")
        rec.add("step_profile", f"{key} · {r.quantity}", "mfu" if unit == "%" else "throughput", value, unit, **ex)
