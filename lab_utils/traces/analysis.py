"""``TraceAnalysis``: the front object over one job's traces (a file, or a folder of ranks).

Every method hands off to one module of this package and returns a DataFrame (one row per
rank, per rank and step, per kernel ...) or a small dataclass; :meth:`TraceAnalysis.record`
turns the figures into tidy record rows (:class:`lab_utils.core.records.Recorder`) that
``perflab compare`` reads, each per-step figure carrying its steps as samples.

Example (any Kineto trace; the paths are the real traces the tests use)::

    from lab_utils.traces import TraceAnalysis

    ta = TraceAnalysis("traces/my_job")  # a folder: one file per rank
    ta.ranks                      # [0, 1]
    ta.steps(0)                   # step, ts, end, dur: the ProfilerStep windows (us after the trace start)
    ta.kernels(0)                 # every kernel/memcpy/memset with launch, op, step, window, range, phase, block,
                                  # hta_type and category (lab_utils.traces.attribute)
    ta.temporal()                 # per rank: span, busy, idle, compute, communication, memory, other (us, and *_pct)
    ta.temporal(by="step")        # the same per rank and step
    ta.shares()                   # per rank: percent of kernel time per HTA type (COMPUTATION, COMMUNICATION, MEMORY)
    ta.categories()               # per rank and perflab category: count, total us, pct
    ta.top_kernels(0, n=5)        # name, category, count, total, mean, min, max
    ta.overlap()                  # per rank: percent of communication time under computation
    ta.idle()                     # per rank: idle, host_wait, other_wait (us)
    ta.launch_stats()             # per rank: queue delay, queue length, short share, launch-bound verdict
    ta.phases()                   # per rank, step and phase: GPU time (us) of the kernels launched in that phase
    ta.windows()                  # per rank: kernels in steps / launched before / after / without launch
    ta.roofline(0)                # per launching op with recorded shapes: FLOPs, bytes, TFLOP/s, % of peak, bound
    ta.collectives()              # per NCCL call: collective, algorithm, bytes, bus bandwidth, exposed/hidden us
    ta.skew()                     # across ranks: per collective call, wait (arrival skew) vs transfer; straggler
    ta.alpha_beta()               # lab 06's alpha-beta model fitted on these collectives
    ta.critical_path(0)           # the critical path of the median-duration step (or step=N): length, bound_by,
                                  # per category, the ops and kernels on it (lab_utils.traces.critical_path)
    ta.hierarchy(0)               # GPU time up the call tree: ranges/modules -> ops -> kernels, self and total
    ta.sequences(0)               # repeated kernel sequences on a stream, by total time (fusion candidates)
    ta.stream_idle()              # per rank and stream: idle split into host wait, kernel wait, other (HTA's)
    ta.launch_outliers(0)         # launch calls and delays beyond HTA's cutoffs (50 us, 100 us)
    ta.queue_length(0)            # per stream: the launch queue's length over time (a step function)
    ta.memory_bw(0)               # per memcpy/memset kind: GB/s in flight over time
    ta.timeline(step=None)        # the bars of one step per rank and stream (lab_utils.traces.timeline)
    ta.summary()                  # a short text report
    ta.record(Recorder("09_traces"))  # tidy rows for perflab compare

``scope`` (methods that summarise): ``"steps"`` (default) takes the activities launched inside
a ``ProfilerStep`` (kernels launched before, after or without a launch are reported apart by
:meth:`windows`); ``"hta"`` takes what HolisticTraceAnalysis 0.5 takes with
``include_last_profiler_step=True`` (launched in the trace, not after the last step; everything
when the trace has fewer than two steps); ``"all"`` takes every activity.

A rank whose trace has no GPU activity (recorded on CPU) is read by the CPU rule
(:mod:`lab_utils.traces.cpu`: its leaf operators stand as kernels, one stream per thread):
:meth:`TraceAnalysis.rule` says ``"cpu"`` for it, the per-rank tables carry it in their ``rule``
column, the summary says it, and the launch-bound verdict is not given (nothing is launched).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pandas as pd

from lab_utils.core.config import ConfigError, check_choice
from lab_utils.core.datasheets import DatasheetPeak, Identified, check_part, identify
from lab_utils.core.records import Recorder
from lab_utils.traces import breakdown, collectives, counters, cpu, hierarchy, sequences, streams
from lab_utils.traces.attribute import Attributed, attribute
from lab_utils.traces.critical_path import CriticalPath, PathInputs, critical_path, path_inputs
from lab_utils.traces.launches import launch_stats
from lab_utils.traces.phases import PhaseTable
from lab_utils.traces.reader import RankTrace, read_job
from lab_utils.traces.roofline import op_roofline
from lab_utils.traces.summary import JobSummary
from lab_utils.traces.timeline import Timeline, step_timeline

SCOPES = ("steps", "hta", "all")
PATH_RANKS = 8  # the critical path is drawn for the first 8 ranks (TraceAnalysis.critical_paths)
TEMPORAL = ("idle", "compute", "communication", "memory", "other")


class TraceAnalysis:
    """One job's traces, read once and attributed; see the module note for the methods."""

    def __init__(
        self,
        path: str | Path | dict[int, RankTrace],
        *,
        phases: PhaseTable | None = None,
        workers: int | None = None,
        attributed: dict[int, Attributed] | None = None,
        gpu: str | None = None,
    ):
        check_part("gpu", gpu)
        self.path = str(path) if not isinstance(path, dict) else "<traces>"
        self.traces: dict[int, RankTrace] = path if isinstance(path, dict) else read_job(path, workers=workers)
        #: ``gpu``: the GPU of the ranks whose traces name none (their datasheet row); a trace that
        #: names its GPU keeps it
        self.gpu = gpu
        for t in self.traces.values():
            if gpu is not None and not t.device_name and len(t.gpu):
                t.device_name = gpu
        self.phase_table = phases or PhaseTable()
        self._attr: dict[int, Attributed] = dict(attributed or {})  # ranks attributed elsewhere (trace_cli's jobs)
        self._paths: dict[tuple, CriticalPath] = {}
        self._path_inputs: dict[int, PathInputs] = {}

    # -- access ---------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        return sorted(self.traces)

    def _rank(self, rank: int | None) -> int:
        if rank is None:
            return self.ranks[0]
        if rank not in self.traces:
            raise ConfigError("rank", rank, f"one of the job's ranks {self.ranks}")
        return rank

    def attributed(self, rank: int | None = None) -> Attributed:
        rank = self._rank(rank)
        if rank not in self._attr:
            self._attr[rank] = attribute(self.traces[rank], self.phase_table)
        return self._attr[rank]

    def kernels(self, rank: int | None = None, scope: str = "all") -> pd.DataFrame:
        """The attributed activities of ``rank`` in ``scope`` (see the module note)."""
        check_choice("scope", scope, SCOPES)
        a = self.attributed(rank)
        k = a.kernels
        if scope == "steps":
            return k[k["window"] == "step"]
        if scope == "hta":
            if len(a.steps) < 2 or not a.has_steps:
                return k
            return k[k["launch_ts"].notna() & (k["window"] != "after")]
        return k

    def steps(self, rank: int | None = None) -> pd.DataFrame:
        return self.attributed(rank).steps

    def device(self, rank: int | None = None) -> str | None:
        return self.traces[self._rank(rank)].device_name

    def device_properties(self, rank: int | None = None) -> dict:
        """The ``deviceProperties`` entry of the device ``rank`` ran on ({} when the trace has none)."""
        t = self.traces[self._rank(rank)]
        same = [p for p in t.device_properties if p.get("name") == t.device_name]
        return same[0] if same else {}

    def part(self, rank: int | None = None) -> Identified | None:
        """Which part the GPU ``rank`` ran on is, and how that was told (:func:`lab_utils.core.datasheets.identify`)."""
        return identify(self.device(rank), self.device_properties(rank))

    def datasheet(self, rank: int | None = None) -> DatasheetPeak | None:
        """The datasheet row of the GPU ``rank`` ran on (by name, memory size, SMs), or None."""
        found = self.part(rank)
        return found.peak if found else None

    def rule(self, rank: int | None = None) -> str:
        """``"gpu"``: GPU activities; ``"cpu"``: no GPU activity, read by the CPU rule (:mod:`lab_utils.traces.cpu`)."""
        return self.attributed(rank).rule

    # -- per rank / per step figures ------------------------------------------------------
    def _per_rank(self, fn, scope: str) -> pd.DataFrame:
        return pd.DataFrame([{"rank": r, "rule": self.rule(r), **fn(self.kernels(r, scope))} for r in self.ranks])

    def temporal(self, by: str = "rank", scope: str = "steps") -> pd.DataFrame:
        """Span, busy, idle and the exclusive compute/communication/memory/other split (us and % of span)."""
        check_choice("by", by, ("rank", "step"))
        if by == "step":
            parts = [breakdown.per_step(self.kernels(r, "steps")).assign(rank=r) for r in self.ranks]
            df = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
        else:
            df = self._per_rank(breakdown.temporal, scope)
        for col in TEMPORAL + ("non_compute",):
            if col in df:
                df[f"{col}_pct"] = 100.0 * df[col] / df["span"].where(df["span"] > 0)
        return df

    def shares(self, scope: str = "steps") -> pd.DataFrame:
        return self._per_rank(breakdown.shares, scope)

    def overlap(self, scope: str = "steps") -> pd.DataFrame:
        return self._per_rank(lambda k: {"overlap_pct": breakdown.overlap_pct(k)}, scope)

    def idle(self, scope: str = "steps") -> pd.DataFrame:
        return self._per_rank(breakdown.idle_split, scope)

    def categories(self, scope: str = "steps") -> pd.DataFrame:
        parts = [breakdown.by_category(self.kernels(r, scope)).assign(rank=r) for r in self.ranks]
        return pd.concat(parts, ignore_index=True)

    def top_kernels(self, rank: int | None = None, n: int = 10, scope: str = "steps") -> pd.DataFrame:
        return breakdown.top_kernels(self.kernels(rank, scope), n)

    def launch_stats(self, scope: str = "steps", **thresholds) -> pd.DataFrame:
        """Per rank (:mod:`lab_utils.traces.launches`); a rank read by the CPU rule gets no verdict."""
        df = self._per_rank(lambda k: asdict(launch_stats(k, **thresholds)), scope)
        is_cpu = df["rule"] == cpu.RULE if len(df) else pd.Series(dtype=bool)
        if is_cpu.any():
            df.loc[is_cpu, ["host_bound", "launch_bound"]] = False
            df.loc[is_cpu, "reason"] = (
                "CPU trace (CPU rule): each operator runs where it is called, nothing is queued, "
                "so the launch-bound verdict does not apply"
            )
        return df

    def phases(self, scope: str = "steps") -> pd.DataFrame:
        """GPU time (us) per rank, step and phase (``(none)``: launched outside any phase range)."""
        rows = []
        for r in self.ranks:
            k = self.kernels(r, scope)
            g = k.groupby([k["step"], k["phase"].fillna("(none)")])["dur"].sum()
            rows += [{"rank": r, "step": int(s), "phase": p, "gpu_us": float(v)} for (s, p), v in g.items()]
        return pd.DataFrame(rows, columns=["rank", "step", "phase", "gpu_us"])

    def windows(self) -> pd.DataFrame:
        """Per rank and window (step, before, after, gap, no launch): activity count and summed us."""
        rows = []
        for r in self.ranks:
            k = self.kernels(r, "all")
            for w, grp in k.groupby("window"):
                rows.append({"rank": r, "window": w, "count": len(grp), "total_us": float(grp["dur"].sum())})
        return pd.DataFrame(rows, columns=["rank", "window", "count", "total_us"])

    # -- beyond: roofline and collectives ------------------------------------------------
    def roofline(
        self, rank: int | None = None, scope: str = "steps", peak: DatasheetPeak | None = None
    ) -> pd.DataFrame:
        """Per launching op with recorded shapes: FLOPs, bytes, TFLOP/s, GB/s, % of peak, bound.
        ``peak``: the peaks to hold them to (a CPU's measured ceilings); default the datasheet row
        of the GPU the trace names."""
        rank = self._rank(rank)
        k, host = self.kernels(rank, scope), self.traces[rank].host
        return op_roofline(k, host, self.device(rank), peak=peak, properties=self.device_properties(rank))

    def collectives(self, scope: str = "all") -> pd.DataFrame:
        """One row per NCCL/RCCL call on every rank: collective, algorithm, bytes, bus bandwidth, exposed/hidden."""
        parts = [self._calls(r, scope).assign(rank=r) for r in self.ranks]
        return pd.concat(parts, ignore_index=True)

    def collectives_of(self, rank: int, scope: str = "all") -> pd.DataFrame:
        """:meth:`collectives` of one rank."""
        return self._calls(self._rank(rank), scope).assign(rank=rank)

    def _calls(self, rank: int, scope: str = "all") -> pd.DataFrame:
        t = self.traces[rank]
        if self.rule(rank) == cpu.RULE:
            return collectives.cpu_calls(self.kernels(rank, scope), t.world_size, t.host)
        return collectives.calls(self.kernels(rank, scope), t.host, t.world_size)

    def skew(self) -> pd.DataFrame:
        """Across the ranks: per collective call, arrival skew, transfer and per-rank wait (us)."""
        per = {r: self._calls(r) for r in self.ranks}
        return collectives.skew(per, {r: float(self.traces[r].t0_us) for r in self.ranks})

    def straggler(self) -> collectives.Straggler:
        """The straggler verdict (:func:`lab_utils.traces.collectives.straggler`), saying on how many
        of the job's ranks it rests."""
        sizes = [t.world_size for t in self.traces.values() if t.world_size]
        return collectives.straggler(self.skew(), len(self.ranks), max(sizes) if sizes else None)

    def alpha_beta(self, duration: str = "dur") -> dict[str, collectives.AlphaBeta]:
        """Lab 06's alpha-beta model fitted on every rank's sized calls (``duration``: ``dur`` or ``exposed_us``)."""
        events = [e for r in self.ranks for e in collectives.events_of(self._calls(r), duration)]
        return collectives.fit_alpha_beta(events)

    # -- HTA's and TraceLens' analyses ----------------------------------------------------
    def critical_path(self, rank: int | None = None, step: int | None = None, *, hta: bool = False) -> CriticalPath:
        """The critical path of ``step`` on ``rank`` (default: the median-duration step); each is
        computed once (a page and its records ask for the same step's path)."""
        rank = self._rank(rank)
        key = (rank, step, hta)
        if key not in self._paths:
            trace, att = self.traces[rank], self.attributed(rank)
            if rank not in self._path_inputs:
                self._path_inputs[rank] = path_inputs(trace, att)
            self._paths[key] = critical_path(trace, att, step, hta=hta, inputs=self._path_inputs[rank])
        return self._paths[key]

    def critical_paths(self, step: int | None = None, max_ranks: int = PATH_RANKS) -> dict[int, CriticalPath]:
        """The critical path of ``step`` on the first ``max_ranks`` ranks that have it (a rank without
        steps: its one window)."""
        out = {}
        for r in self.ranks[:max_ranks]:
            att = self.attributed(r)
            if not att.has_steps or step is None or step in set(att.steps["step"]):
                out[r] = self.critical_path(r, step if att.has_steps else None)
        return out

    def hierarchy(self, rank: int | None = None, scope: str = "steps") -> pd.DataFrame:
        """GPU time up the call tree of ``rank`` (:mod:`lab_utils.traces.hierarchy`)."""
        rank = self._rank(rank)
        return hierarchy.tree(self.traces[rank], self.attributed(rank), self.kernels(rank, scope))

    def sequences(self, rank: int | None = None, scope: str = "steps", **options) -> pd.DataFrame:
        """Repeated kernel sequences of ``rank`` (:func:`lab_utils.traces.sequences.frequent_sequences`)."""
        return sequences.frequent_sequences(self.kernels(rank, scope), **options)

    def stream_idle(self, scope: str = "steps", kernel_wait_us: float = streams.KERNEL_WAIT_US) -> pd.DataFrame:
        """Per rank and stream: idle time as host wait, kernel wait and other (:mod:`lab_utils.traces.streams`)."""
        parts = [streams.stream_idle(self.kernels(r, scope), kernel_wait_us).assign(rank=r) for r in self.ranks]
        df = pd.concat(parts, ignore_index=True)
        return df[["rank"] + [c for c in df.columns if c != "rank"]]

    def launch_outliers(self, rank: int | None = None, scope: str = "steps", **cutoffs) -> streams.LaunchOutliers:
        return streams.launch_outliers(self.kernels(rank, scope), **cutoffs)

    def queue_length(self, rank: int | None = None, scope: str = "steps") -> pd.DataFrame:
        """The launch queue of each stream over time (:func:`lab_utils.traces.counters.queue_series`)."""
        return counters.queue_series(self.kernels(rank, scope))

    def memory_bw(self, rank: int | None = None, scope: str = "steps") -> pd.DataFrame:
        """GB/s of copies and fills in flight over time (:func:`lab_utils.traces.counters.memory_bw_series`)."""
        return counters.memory_bw_series(self.kernels(rank, scope))

    def timeline(self, step: int | None = None, ranks: list[int] | None = None, **options) -> Timeline:
        """The bars of one step per rank and stream (:func:`lab_utils.traces.timeline.step_timeline`)."""
        atts = {r: self.attributed(r) for r in (ranks or self.ranks)}
        return step_timeline(self.traces, atts, step, phases=self.phase_table, **options)

    # -- summary and records --------------------------------------------------------------
    def summary(self) -> str:
        """A short text report: per rank, the temporal split, overlap, top kernels, verdict."""
        return JobSummary.of(self).summary()

    def record(self, rec: Recorder, experiment: str = "trace") -> Recorder:
        """Add the per-step figures to ``rec`` as rows (median over steps, the steps as samples;
        which rows, and which of them a comparison gates: :mod:`lab_utils.traces.summary`)."""
        return JobSummary.of(self).record(rec, experiment)
