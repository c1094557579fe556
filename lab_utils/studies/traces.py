"""Lab 09 (``labs/09_traces.ipynb``): profiler traces read, attributed and compared.

The reading and every figure are :mod:`lab_utils.traces`' (:class:`~lab_utils.traces.TraceAnalysis`);
this module holds the lab's parameters, the traces it records itself when it is given none
(:mod:`lab_utils.profiling.record`: the tiny training step, and gloo ranks for the communication
views), the checked facts (which assert), the tables and the plots, which read the analysis'
tables and never measure.

Which traces: ``trace_path`` set -> that file or folder (one job) alone.  ``trace_path = None`` ->
the lab's own: ``step`` (lab 01's tiny step on ``device``, ``steps`` active steps after
``warmup_steps``) and, with ``ranks >= 2``, ``gloo`` (``ranks`` processes all-reducing ``numel``
float32 elements per step).  On CPU both are read by the CPU rule (:mod:`lab_utils.traces.cpu`).

Roofline peaks: a GPU named in the trace -> its datasheet row; the lab's own CPU traces -> this
machine's measured ceilings (:func:`lab_utils.core.ceilings.get_ceilings`, quick); a CPU trace
given by path (recorded on a machine we do not know) -> no peaks, the rates alone.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import holoviews as hv
import numpy as np
import pandas as pd
import panel as pn
import torch

from lab_utils.core.ceilings import Ceilings, get_ceilings
from lab_utils.core.config import ConfigError, LabConfig, check_choice, check_int, check_int_list
from lab_utils.core.datasheets import DatasheetPeak, check_part
from lab_utils.core.lanes import lanes_figure
from lab_utils.core.plots import roofline_plot
from lab_utils.core.records import Recorder
from lab_utils.model import PRESETS
from lab_utils.model.train import TrainConfig, Trainer
from lab_utils.profiling.profiler import profile_training
from lab_utils.profiling.record import record_gloo_ranks
from lab_utils.studies.headline import Figure, fmt, register, rows
from lab_utils.traces import TraceAnalysis
from lab_utils.traces.analysis import SCOPES, TEMPORAL
from lab_utils.traces.counters import queue_summary
from lab_utils.traces.cpu import RULE
from lab_utils.traces.hierarchy import top_levels
from lab_utils.traces.timeline import CATEGORY_COLORS, HOVER, PART_COLORS, Timeline, check_step, representative_step

LAB = "09_traces"
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class TracesLabConfig(LabConfig):
    """Parameters of ``labs/09_traces.ipynb`` (see the module note)."""

    trace_path: str | None = None  # a trace file or a folder of per-rank files; None: record the lab's own
    device: str = "cpu"  # where the lab's own step is recorded: "cpu" | "cuda" | "auto"
    preset: str = "tiny"  # the MMDiT preset of the lab's own step
    steps: int = 3  # active (analysed) steps of the lab's own traces
    warmup_steps: int = 1
    ranks: int = 2  # gloo ranks of the lab's own communication trace; 0: none
    numel: tuple = (4096, 65536)  # float32 elements of each all-reduce per step (gloo ranks)
    scope: str = "steps"  # "steps" | "hta" | "all" (TraceAnalysis' scopes)
    top_n: int = 10
    gpu: str | None = None  # the GPU of a given trace that names none (its datasheet row); None: as the trace says
    timeline_step: int | None = None  # the ProfilerStep the timeline and the critical path show; None: the median one

    def __post_init__(self):
        super().__post_init__()
        if self.trace_path is not None:
            if not isinstance(self.trace_path, str) or not Path(self.trace_path).exists():
                raise ConfigError("trace_path", self.trace_path, "None (record the lab's own) or an existing path")
        check_choice("device", self.device, DEVICES)
        check_choice("preset", self.preset, tuple(PRESETS))
        check_int("steps", self.steps, min=1)
        check_int("warmup_steps", self.warmup_steps, min=0)
        check_int("ranks", self.ranks, min=0)
        if self.ranks == 1:
            raise ConfigError("ranks", self.ranks, "0 (no communication trace) or at least 2")
        check_int_list("numel", list(self.numel), min=1)
        check_choice("scope", self.scope, SCOPES)
        check_int("top_n", self.top_n, min=1)
        check_part("gpu", self.gpu)
        if self.timeline_step is not None:
            check_int("timeline_step", self.timeline_step, min=0)


@dataclass
class LabTraces:
    """The lab's traces by name (``step``, ``gloo``, or ``trace`` for a given path), analysed."""

    analyses: dict[str, TraceAnalysis]
    paths: dict[str, Path]
    own: bool  # recorded here by the lab (so this machine's ceilings apply to its CPU traces)
    device: str = "cpu"
    tmp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", device, "cpu or auto here: this machine has no CUDA device")
    return device


def record_training_step(out_dir: str | Path, *, steps: int = 3, warmup: int = 1, **train) -> Path:
    """Lab 01's tiny MMDiT step (``train``: :class:`TrainConfig` fields over the tiny CPU defaults),
    ``warmup + steps`` steps profiled, ``steps`` active, operators' shapes recorded; the trace's path."""
    params = dict(preset="tiny", device="cpu", batch_size=2, buckets=[[64, 64]], num_samples=8) | train
    trainer = Trainer(TrainConfig(**params))
    try:
        report = profile_training(
            trainer, active=steps, warmup=warmup, out_dir=out_dir, name="09_traces", memory=False, record_shapes=True
        )
    finally:
        trainer.close()
    return Path(report.trace_path)


def load(cfg: TracesLabConfig, out_dir: str | Path | None = None) -> LabTraces:
    """Read ``cfg.trace_path``, or record the lab's own traces into ``out_dir`` (a temporary
    folder by default) and read them."""
    if cfg.trace_path is not None:
        path = Path(cfg.trace_path)
        return LabTraces({"trace": TraceAnalysis(path, gpu=cfg.gpu)}, {"trace": path}, own=False)
    device = _resolve_device(cfg.device)
    tmp = None
    if out_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="perflab-09-")
        out_dir = tmp.name
    out = Path(out_dir)
    step = record_training_step(
        out / "step", steps=cfg.steps, warmup=cfg.warmup_steps, device=device, preset=cfg.preset
    )
    paths = {"step": step}
    if cfg.ranks >= 2:
        paths["gloo"] = record_gloo_ranks(out / "gloo", ranks=cfg.ranks, steps=cfg.steps, numel=tuple(cfg.numel))
    return LabTraces({k: TraceAnalysis(p, workers=1) for k, p in paths.items()}, paths, True, device, tmp)


def source_lines(lt: LabTraces) -> list[str]:
    """What each trace is and how it is read (deterministic: no paths, no times)."""
    out = []
    for name, ta in lt.analyses.items():
        rules = sorted({ta.rule(r) for r in ta.ranks})
        how = "CPU rule (leaf CPU operators as kernels)" if rules == [RULE] else "GPU activities"
        origin = "recorded by the lab" if lt.own else "given by trace_path"
        out.append(f"{name}: {len(ta.ranks)} rank(s), {origin}, read by: {how}")
    return out


def summary_text(lt: LabTraces) -> str:
    """Every trace's :meth:`TraceAnalysis.summary`, under its name."""
    return "\n\n".join(f"[{name}]\n{ta.summary()}" for name, ta in lt.analyses.items())


# --------------------------------------------------------------------------------------
# Checked facts (each asserts)
# --------------------------------------------------------------------------------------


def rule_lines(lt: LabTraces) -> list[str]:
    """The CPU rule is applied to a rank iff its trace has no GPU activity; one line per rank."""
    out = []
    for name, ta in lt.analyses.items():
        for r in ta.ranks:
            gpu = len(ta.traces[r].gpu)
            applied = ta.rule(r) == RULE
            assert applied == (gpu == 0), f"{name} rank {r}: {gpu} GPU activities, rule {ta.rule(r)!r}"
            what = "no GPU activity -> CPU rule" if applied else "GPU activities -> read as recorded"
            out.append(f"{name} rank {r}: {what}")
    return out


def total_lines(lt: LabTraces, cfg: TracesLabConfig) -> list[str]:
    """Per rank: the steps found are the steps recorded (the lab's own traces), the per-step
    activity time adds up to the rank's total, the temporal parts and the HTA shares each sum
    to 100 %.  Asserts each; one line per rank."""
    out = []
    for name, ta in lt.analyses.items():
        temporal = ta.temporal(scope="steps").set_index("rank")
        shares = ta.shares(scope="steps").set_index("rank")
        for r in ta.ranks:
            k = ta.kernels(r, "steps")
            n = len(ta.steps(r)) if ta.attributed(r).has_steps else 0
            if lt.own:
                assert n == cfg.steps, f"{name} rank {r}: {n} ProfilerStep ranges found, {cfg.steps} recorded"
            per_step = k.groupby("step")["dur"].sum()
            assert np.isclose(per_step.sum(), k["dur"].sum(), rtol=1e-9), (name, r)
            parts = sum(temporal.loc[r, f"{c}_pct"] for c in TEMPORAL)
            assert np.isclose(parts, 100.0), f"{name} rank {r}: temporal parts sum to {parts}"
            share = sum(shares.loc[r, c] for c in ("COMPUTATION", "COMMUNICATION", "MEMORY", "OTHER"))
            assert np.isclose(share, 100.0) or not len(k), f"{name} rank {r}: shares sum to {share}"
            out.append(
                f"{name} rank {r}: {n} steps, {len(per_step)} with activities; per-step totals add up to "
                "the rank's total; temporal parts and HTA shares each sum to 100%"
            )
    return out


def main_name(lt: LabTraces) -> str:
    """The trace the single-trace views show: the given one, else the lab's own step."""
    return "trace" if "trace" in lt.analyses else "step"


def comm_analysis(lt: LabTraces) -> TraceAnalysis:
    """The trace the communication views show: the lab's gloo ranks, else the main trace."""
    return lt.analyses.get("gloo") or lt.analyses[main_name(lt)]


def communication_lines(lt: LabTraces, cfg: TracesLabConfig) -> list[str]:
    """On the lab's own gloo ranks: every rank communicates, and each all-reduce's size is the
    tensor the lab all-reduced (4 bytes per float32 element).  Asserts; empty without them."""
    ta = lt.analyses.get("gloo")
    if ta is None and lt.own:
        return ["no communication trace (ranks = 0)"]
    if ta is None:  # a trace given by path: what it holds, nothing to hold it to
        c = comm_analysis(lt).collectives()
        return [f"rank {r}: {int((c['rank'] == r).sum())} collective calls" for r in comm_analysis(lt).ranks]
    assert (ta.shares(scope="steps")["COMMUNICATION"] > 0).all(), "a rank without communication"
    calls = ta.collectives()
    calls = calls[(calls["collective"] == "all_reduce") & (calls["window"] == "step")]
    want = sorted(4 * int(n) for n in cfg.numel)
    out = []
    for r in ta.ranks:
        got = sorted(set(calls.loc[calls["rank"] == r, "bytes"].astype(int)))
        assert got == want, f"rank {r}: all-reduce sizes {got} bytes, the lab all-reduced {want}"
        out.append(f"gloo rank {r}: {int((calls['rank'] == r).sum())} all-reduces in the steps, sizes {got} bytes")
    return out


# --------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------


def temporal_table(ta: TraceAnalysis, scope: str = "steps") -> pd.DataFrame:
    df = ta.temporal(scope=scope)
    cols = ["rank", "rule", "span"] + [f"{c}_pct" for c in TEMPORAL] + ["kernel_time"]
    out = df[cols].copy()
    out["span_ms"] = out.pop("span") / 1e3
    out["kernel_ms"] = out.pop("kernel_time") / 1e3
    return out.round(2)


def temporal_tables(lt: LabTraces, scope: str = "steps") -> pd.DataFrame:
    """:func:`temporal_table` of every trace of the lab, one block per trace."""
    parts = {name: temporal_table(ta, scope) for name, ta in lt.analyses.items()}
    return pd.concat(parts, names=["trace"]).reset_index(level=0).reset_index(drop=True)


def category_table(ta: TraceAnalysis, scope: str = "steps") -> pd.DataFrame:
    df = ta.categories(scope)
    df["ms"] = df.pop("total") / 1e3
    return df[["rank", "category", "count", "ms", "pct"]].round(3)


def top_table(ta: TraceAnalysis, rank: int | None = None, n: int = 10, scope: str = "steps") -> pd.DataFrame:
    df = ta.top_kernels(rank, n, scope)
    for c in ("total", "mean", "min", "max"):
        df[f"{c}_us"] = df.pop(c)
    df["name"] = df["name"].str.slice(0, 90)
    return df.round(2)


def launch_table(ta: TraceAnalysis, scope: str = "steps") -> pd.DataFrame:
    cols = ["rank", "rule", "activities", "short_share", "queue_delay_median_us", "queue_length_median"]
    return ta.launch_stats(scope)[cols + ["launch_bound", "reason"]]


def collective_table(ta: TraceAnalysis) -> pd.DataFrame:
    c = ta.collectives()
    cols = ["rank", "step", "window", "name", "collective", "bytes", "dur", "exposed_us", "hidden_us", "busbw_gbps"]
    return c[cols].round(3)


def skew_table(ta: TraceAnalysis) -> pd.DataFrame:
    return ta.skew().round(1)


def phase_table(ta: TraceAnalysis, scope: str = "steps") -> pd.DataFrame:
    """Per rank and phase: median ms per step over the steps."""
    ph = ta.phases(scope)
    if not len(ph):
        return pd.DataFrame(columns=["rank", "phase", "ms_per_step", "steps"])
    g = ph.groupby(["rank", "phase"])["gpu_us"]
    out = pd.DataFrame({"ms_per_step": g.median() / 1e3, "steps": g.count()}).reset_index()
    return out.round(3)


# --------------------------------------------------------------------------------------
# Plots (read the analysis' tables)
# --------------------------------------------------------------------------------------


def _parts(df: pd.DataFrame, key: str) -> pd.DataFrame:
    long = df.melt(id_vars=[key], value_vars=list(TEMPORAL), var_name="part", value_name="us")
    long["ms"] = long.pop("us") / 1e3
    long[key] = long[key].astype(str)
    return long


def temporal_bars(ta: TraceAnalysis, title: str, scope: str = "steps"):
    """Per rank, stacked: idle, compute, exposed communication, memory, other (ms)."""
    long = _parts(ta.temporal(scope=scope), "rank")
    return hv.Bars(long, ["rank", "part"], "ms").opts(
        stacked=True, cmap=PART_COLORS, tools=["hover"], title=title, legend_position="right", width=720
    )


def temporal_layout(lt: LabTraces, scope: str = "steps"):
    """:func:`temporal_bars` of every trace of the lab, one under the other."""
    bars = [temporal_bars(ta, f"{name}: where the time of each rank went", scope) for name, ta in lt.analyses.items()]
    return hv.Layout(bars).cols(1)


def step_bars(ta: TraceAnalysis, title: str):
    """Per step, stacked, one frame per rank (a slider in the exported page)."""
    per = ta.temporal(by="step")
    frames = {int(r): _step_frame(g, title) for r, g in per.groupby("rank")}
    return hv.HoloMap(frames, kdims="rank")


def _step_frame(g: pd.DataFrame, title: str):
    return hv.Bars(_parts(g, "step"), ["step", "part"], "ms").opts(
        stacked=True, cmap=PART_COLORS, tools=["hover"], title=title, legend_position="right", width=720
    )


def phase_bars(ta: TraceAnalysis, title: str, scope: str = "steps"):
    ph = ta.phases(scope).copy()
    ph["ms"] = ph.pop("gpu_us") / 1e3
    ph["rank_step"] = "r" + ph["rank"].astype(str) + " s" + ph["step"].astype(str)
    return hv.Bars(ph, ["rank_step", "phase"], "ms").opts(
        stacked=True, tools=["hover"], title=title, legend_position="right", width=720, xrotation=45
    )


def ceilings_for(lt: LabTraces, name: str) -> tuple[Ceilings | None, DatasheetPeak | None, str]:
    """The peaks one trace's roofline is held to, and where they come from (see the module note)."""
    ta = lt.analyses[name]
    r = ta.ranks[0]
    if ta.rule(r) == RULE:
        if not lt.own:
            return None, None, "a CPU trace given by path: no peaks (the machine that recorded it is not known here)"
        c = get_ceilings("cpu", quick=True)
        fp32 = c.matmul("fp32")
        peak = DatasheetPeak(f"{c.device_name} (measured)", fp32, None, None, fp32, c.copy_gbs, 0, "measured", fp32)
        return c, peak, f"this machine's measured CPU ceilings (copy {c.copy_gbs:.0f} GB/s, fp32 matmul)"
    sheet = ta.datasheet(r)
    if sheet is None:
        return None, None, f"no datasheet row for {ta.device(r)!r}: rates without peaks"
    c = Ceilings(
        device={"name": sheet.name},
        copy_gbs=sheet.hbm_gbs,
        copy_bytes=0,
        matmul_tflops={k: sheet.matmul_tflops("fp32" if k == "tf32" else k) for k in ("fp32", "tf32", "fp16", "bf16")},
        matmul_n={},
    )
    return c, sheet, f"the datasheet of {sheet.name} ({sheet.source})"


def roofline_view(lt: LabTraces, name: str, scope: str = "steps"):
    """The per-op roofline of a trace's first rank: (table, plot or None, where the peaks come from)."""
    ta = lt.analyses[name]
    ceilings, peak, source = ceilings_for(lt, name)
    df = ta.roofline(ta.ranks[0], scope, peak=peak)
    if not len(df):
        return df, None, "no operator with recorded shapes (record_shapes=True) launched work: no roofline"
    plot = None
    if ceilings is not None:
        pts = df.assign(time_ms=df["gpu_us"] / 1e3, gbs=df["gbps"], shape=df["shapes"])
        pts = pts[np.isfinite(pts["intensity"]) & (pts["tflops"] > 0)]
        plot = roofline_plot(pts, ceilings, dtype="fp32", label_col="kind", title=f"Per-op roofline of {name}")
    return df.round(4), plot, source


# --------------------------------------------------------------------------------------
# The timeline and the analyses of HolisticTraceAnalysis and TraceLens
# --------------------------------------------------------------------------------------


def timeline_step(ta: TraceAnalysis, step: int | None) -> int:
    """``step`` when the trace has it (else ``ConfigError`` naming ``timeline_step``), or the median one."""
    if step is None:
        return representative_step(ta.attributed(ta.ranks[0]))
    check_step(step, {r: ta.attributed(r) for r in ta.ranks}, "timeline_step")
    return step


def timeline(ta: TraceAnalysis, step: int | None = None) -> Timeline:
    """The timeline of one step per rank and stream, each rank's critical path on its own lane."""
    step = timeline_step(ta, step)
    return ta.timeline(step, paths={r: cp.edges for r, cp in ta.critical_paths(step).items()})


def timeline_view(tl: Timeline):
    """The timeline as trace.html draws it (:func:`lab_utils.core.lanes.lanes_figure`), in a panel pane."""
    fig = lanes_figure(tl.bars, tl.lanes, CATEGORY_COLORS, hover=HOVER, title=tl.title, legend_title="category",
                       width=980)  # fmt: skip
    return pn.pane.Bokeh(fig)


def critical_path_view(ta: TraceAnalysis, step: int | None = None, rank: int | None = None):
    """One rank's critical path of the step: (a sentence, its parts, the events it is charged to)."""
    rank = ta.ranks[0] if rank is None else rank
    cp = ta.critical_path(rank, timeline_step(ta, step) if ta.attributed(rank).has_steps else None)
    parts = ", ".join(f"{v:.0f}% {k}" for k, v in sorted(cp.by_bound().items(), key=lambda kv: -kv[1]) if v >= 0.5)
    text = (f"rank {rank}, step {cp.step}: critical path {cp.length_us / 1e3:.3f} ms of a {cp.window_us / 1e3:.3f} ms "
            f"step ({parts or 'empty'})")  # fmt: skip
    return text, cp.by_category().round(2), cp.by_event(10).round(2)


def hierarchy_table(ta: TraceAnalysis, rank: int | None = None, depth: int = 4, scope: str = "steps") -> pd.DataFrame:
    """The call tree down to ``depth`` levels, rows holding at least 0.5 % of the GPU time, names indented."""
    t = top_levels(ta.hierarchy(rank, scope), depth, 0.5).copy()
    t["name"] = ["  " * d + str(n)[:80] for d, n in zip(t["depth"], t["name"])]
    for c in ("gpu_total_us", "gpu_self_us", "cpu_us"):
        t[c.replace("_us", "_ms")] = t.pop(c) / 1e3
    return t[["name", "kind", "count", "gpu_total_ms", "gpu_self_ms", "cpu_ms", "gpu_pct"]].round(3)


def sequence_table(ta: TraceAnalysis, rank: int | None = None, n: int = 10, scope: str = "steps") -> pd.DataFrame:
    """The repeated kernel sequences with the most time (fusion candidates)."""
    sq = ta.sequences(rank, scope, top=n)
    return sq[["short", "length", "count", "total_us", "mean_us", "gap_us", "ops"]].round(2)


def stream_table(ta: TraceAnalysis, scope: str = "steps") -> pd.DataFrame:
    """Per rank and stream: idle as host wait, kernel wait and other (us), with the launch queue's summary."""
    idle = ta.stream_idle(scope)
    queues = [queue_summary(ta.queue_length(r, scope)).assign(rank=r) for r in ta.ranks]
    q = pd.concat(queues, ignore_index=True).rename(columns={"mean": "queue_mean", "max": "queue_max"})
    out = idle.merge(q[["rank", "stream", "queue_mean", "queue_max"]], on=["rank", "stream"], how="left")
    return out.drop(columns=[c for c in out if c.endswith("_pct")]).round(2)


def analysis_lines(ta: TraceAnalysis, name: str, step: int | None = None) -> list[str]:
    """Checked facts of the analyses, one line per rank (asserts): the critical path's parts add up
    to its length and it is no longer than the step's work allows (its length is at most the window
    plus the GPU's lag past it); the call tree's top rows add up to the kernel time; the idle per
    stream's three kinds add up to its idle time."""
    out = []
    for r in ta.ranks:
        cp = ta.critical_path(r, timeline_step(ta, step) if ta.attributed(r).has_steps else None)
        parts = cp.edges["weight"].sum()
        assert np.isclose(parts, cp.length_us), f"{name} rank {r}: parts {parts} vs length {cp.length_us}"
        assert np.isclose(sum(cp.by_bound().values()), 100.0) or cp.length_us == 0
        k = ta.kernels(r)
        tree = ta.hierarchy(r)
        top = tree[tree["depth"] == 0]["gpu_total_us"].sum()
        assert np.isclose(top, k["dur"].sum()), f"{name} rank {r}: call tree {top} vs kernels {k['dur'].sum()}"
        idle = ta.stream_idle().query("rank == @r")
        assert np.allclose(idle[["host_wait", "kernel_wait", "other"]].sum(axis=1), idle["idle"])
        out.append(f"{name} rank {r}: the critical path's parts add up to its length; the call tree's top rows add "
                   "up to the kernel time; each stream's idle kinds add up to its idle time")  # fmt: skip
    return out


# --------------------------------------------------------------------------------------
# Records and the takeaway
# --------------------------------------------------------------------------------------


def record(lt: LabTraces, rec: Recorder) -> Recorder:
    """Every trace's per-step figures (:meth:`TraceAnalysis.record`), experiment = the trace's name."""
    for name, ta in lt.analyses.items():
        ta.record(rec, experiment=name)
        if name == "gloo" or len(ta.ranks) > 1:
            st = ta.straggler()
            if np.isfinite(st.median_skew_us):
                rec.add(name, "job", "median_skew", st.median_skew_us / 1e3, "ms", statistic="median")
    return rec


@register(LAB)
def headline(df: pd.DataFrame) -> list[Figure]:
    figs = []
    for name in ("step", "trace", "gloo"):
        span = rows(df, experiment=name, variant="rank0", metric="span")
        if not len(span):
            continue
        total = float(span["value"].iloc[0])
        parts = {"communication": "exposed_comm_share"} if name == "gloo" else {"compute": "compute_share",
                                                                                "idle": "idle_share"}  # fmt: skip
        for part, metric in parts.items():
            r = rows(df, experiment=name, variant="rank0", metric=metric)
            if len(r) and total > 0:
                pct = float(r["value"].iloc[0])
                figs.append(Figure(f"{name} rank 0 {part}", fmt(pct, "%"), f"of a {fmt(total, 'ms')} step (median)"))
    return figs
