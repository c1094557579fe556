"""Per-rank summaries: every figure ``perflab trace`` shows, records or compares, small enough to
send from a worker process, and the job they make together.

A rank's tables (:class:`~lab_utils.traces.reader.RankTrace`, its attribution) grow with its trace;
its summary does not grow with the file beyond what it reports: one row per step, per kernel name,
per launching operator with recorded shapes and per collective call.  A folder of ranks is read
one rank per job (``perflab trace --executor pool|local|slurm``): each job reads, attributes and
summarises its file and only the :class:`RankSummary` comes back; the cross-rank figures (skew,
straggler) are computed from the ranks' collective calls in :class:`JobSummary`.

Records (:meth:`JobSummary.record`), one row per figure and rank, its steps as samples in step
order (so two traces compare by step index relative to their first step, never by step number):

* **gated** (times: lower is better): ``span`` (a step's GPU span), ``kernel_time``, and the GPU
  time per step of every ``category:``, ``phase:``, ``kernel:`` (every kernel name, not only the
  top ones) and ``op:`` (the operator that launched it; not for a CPU trace, whose operators are
  its kernels), in ms;
* **reported, never gated** (shares, which a speed-up elsewhere moves): ``idle_share``,
  ``compute_share``, ``exposed_comm_share``, ``memcpy_share`` and ``other_share`` of the span,
  ``comm_overlap`` (of communication time) and ``share:<HTA type>`` (of kernel time), in units
  ``perflab compare`` gives no better direction ("% of span" ...), so they read "changed" or
  "same" and never fail a gate: a kernel made 2x faster raises the idle share, and that is no
  regression.

The rows of a GPU trace carry ``stable=True``: the profiler measured them on the job's GPU, and
their spread across steps is the job's own, which the bootstrap interval of ``perflab compare``
carries (the timing primitive's stability rules are for timings taken on a busy machine).  A
CPU trace's rows (the CPU rule, timed on whatever machine recorded them) are judged by those
rules from their samples.

A kernel name longer than 200 characters is cut to its first 180 and the first 8 hex digits of the
SHA-1 of the whole name, so that two long templated names stay two metrics.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from lab_utils.core.records import Recorder
from lab_utils.traces import breakdown, collectives, cpu
from lab_utils.traces.reader import texts

#: the reported shares of the span (see the module note) and the temporal part each one is
SHARE_OF_SPAN = {"idle_share": "idle", "compute_share": "compute", "exposed_comm_share": "communication",
                 "memcpy_share": "memory", "other_share": "other"}  # fmt: skip
UNIT_OF_SPAN, UNIT_OF_COMM, UNIT_OF_KERNELS = "% of span", "% of communication", "% of kernel time"
GPU_STEPS = "per-step GPU figure of a profiler trace: its spread is the job's, carried by the bootstrap interval"
#: the tables of a rank summary, each one row per (rank, ...)
TABLES = ("temporal", "temporal_by_step", "shares", "categories", "overlap", "idle", "launch", "phases",
          "windows", "kernels", "roofline", "collectives")  # fmt: skip


def metric_name(prefix: str, name: str) -> str:
    """``prefix:name``, a name over 200 characters cut to 180 + a hash of the whole (module note)."""
    if len(name) > 200:
        name = f"{name[:180]}…{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return f"{prefix}:{name}"


@dataclass
class RankSummary:
    """One rank's figures (see the module note): its tables and its per-step record values."""

    rank: int
    path: str
    t0_us: int
    device: str | None  # the GPU the trace names, or the one given for it (``gpu=``)
    properties: dict
    world_size: int | None
    rule: str  # "gpu" | "cpu" (lab_utils.traces.cpu)
    steps: int  # ProfilerStep windows found (0: none, the trace is one window)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    #: metric, unit, step_index (0 = the first step), value (ms or %), step
    per_step: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: what ``perflab trace`` adds for its page (lab_utils.run.trace_analyses: the timeline's bars,
    #: Perfetto events, the critical path, call tree, sequences ...), empty elsewhere
    extras: dict = field(default_factory=dict)

    def meta(self) -> dict:
        d = asdict(self)
        d.pop("tables"), d.pop("per_step"), d.pop("extras")
        return d


def summarise(ta, rank: int) -> RankSummary:
    """The summary of ``rank`` of ``ta`` (a :class:`~lab_utils.traces.analysis.TraceAnalysis`)."""
    t = ta.traces[rank]
    one = lambda df: df[df["rank"] == rank].reset_index(drop=True)  # noqa: E731 - a one-rank view
    k = ta.kernels(rank, "steps")
    tables = {
        "temporal": one(ta.temporal()),
        "temporal_by_step": one(ta.temporal(by="step")),
        "shares": one(ta.shares()),
        "categories": one(ta.categories()),
        "overlap": one(ta.overlap()),
        "idle": one(ta.idle()),
        "launch": one(ta.launch_stats()),
        "phases": one(ta.phases()),
        "windows": one(ta.windows()),
        "kernels": breakdown.top_kernels(k, len(k)),
        "roofline": ta.roofline(rank),
        "collectives": ta.collectives_of(rank),
    }
    a = ta.attributed(rank)
    steps = len(a.steps) if a.has_steps else 0
    return RankSummary(rank, t.path, t.t0_us, ta.device(rank), ta.device_properties(rank), t.world_size,
                       ta.rule(rank), steps, tables, per_step_values(ta, rank))  # fmt: skip


def per_step_values(ta, rank: int) -> pd.DataFrame:
    """The record values of one rank per step (see the module note), long: one row per (metric, step)."""
    cols = ["metric", "unit", "step_index", "value"]
    k = ta.kernels(rank, "steps")
    per = breakdown.per_step(k)
    if not len(per):
        return pd.DataFrame(columns=cols)
    steps = per["step"].to_numpy()
    names: list[str] = []  # one (metric, unit) per row of ``values``: the table is built once, at the end
    units: list[str] = []
    values: list[np.ndarray] = []

    def add(metric: str, unit: str, v) -> None:
        names.append(metric)
        units.append(unit)
        values.append(np.asarray(v, dtype=np.float64))

    add("span", "ms", per["span"] / 1e3)
    add("kernel_time", "ms", per["kernel_time"] / 1e3)
    span = per["span"].where(per["span"] > 0)
    for metric, part in SHARE_OF_SPAN.items():
        add(metric, UNIT_OF_SPAN, 100.0 * per[part] / span)
    add("comm_overlap", UNIT_OF_COMM, per["overlap_pct"])
    for col in [c for c in per.columns if c.startswith("share_")]:
        add(f"share:{col[len('share_') :].upper()}", UNIT_OF_KERNELS, per[col])

    def text(col: pd.Series) -> pd.Series:
        return pd.Series(texts(col), index=col.index, dtype=object)

    groups = [("category", text(k["category"])), ("phase", text(k["phase"].fillna("(none)"))),
              ("kernel", text(k["name"]))]  # fmt: skip
    if ta.rule(rank) != cpu.RULE:  # a CPU trace's operators are its kernels: no second row for them
        launched = k[texts(k["op"]) != ""]
        groups.append(("op", text(launched["op"])))
    for prefix, key in groups:
        sel = k if len(key) == len(k) else k.loc[key.index]
        g = sel.groupby([key, sel["step"]], observed=True)["dur"].sum().unstack(fill_value=0.0)
        g = g.reindex(columns=steps, fill_value=0.0)
        for name, row in zip(g.index, g.to_numpy() / 1e3):
            add(metric_name(prefix, str(name)), "ms", row)
    n = len(steps)
    df = pd.DataFrame({"metric": np.repeat(np.array(names, dtype=object), n),
                       "unit": np.repeat(np.array(units, dtype=object), n),
                       "step_index": np.tile(np.arange(n), len(values)),
                       "value": np.concatenate(values)})  # fmt: skip
    df["step"] = steps[df["step_index"].to_numpy()]
    return df[df["value"].notna()][cols + ["step"]].reset_index(drop=True)


class JobSummary:
    """One job from its ranks' summaries: the per-rank tables side by side, the cross-rank figures."""

    def __init__(self, ranks: list[RankSummary] | dict[int, RankSummary], path: str = "<traces>"):
        items = ranks.values() if isinstance(ranks, dict) else ranks
        self.ranks_: dict[int, RankSummary] = {r.rank: r for r in sorted(items, key=lambda r: r.rank)}
        self.path = path

    @classmethod
    def of(cls, ta) -> JobSummary:
        return cls([summarise(ta, r) for r in ta.ranks], ta.path)

    @property
    def ranks(self) -> list[int]:
        return list(self.ranks_)

    def device(self, rank: int) -> str | None:
        return self.ranks_[rank].device

    def table(self, name: str) -> pd.DataFrame:
        """Table ``name`` (:data:`TABLES`) of every rank, one after the other, with a ``rank`` column."""
        parts = []
        for r, s in self.ranks_.items():
            df = s.tables.get(name, pd.DataFrame())
            parts.append(df if "rank" in df.columns else df.assign(rank=r))
        parts = [p for p in parts if len(p.columns)]
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()

    def top_kernels(self, rank: int, n: int = 10) -> pd.DataFrame:
        return self.ranks_[rank].tables["kernels"].head(n).reset_index(drop=True)

    def world_size(self) -> int | None:
        sizes = {s.world_size for s in self.ranks_.values() if s.world_size}
        return max(sizes) if sizes else None

    def collectives(self) -> pd.DataFrame:
        """Every rank's collective calls; with more than one rank, each call's ``wait_us`` for the last
        arrival, its ``transfer_us`` and ``busbw_transfer_gbps`` (:func:`~lab_utils.traces.collectives.aligned`)."""
        parts = []
        per = {r: s.tables["collectives"] for r, s in self.ranks_.items()}
        extra = ["wait_us", "transfer_us", "busbw_transfer_gbps"]
        al = collectives.aligned(per, {r: float(s.t0_us) for r, s in self.ranks_.items()}) if len(per) > 1 else None
        for r, c in per.items():
            c = c.assign(rank=r)
            if al is not None and len(c):
                mine = al[al["rank"] == r].set_index("row")[extra]
                c = c.join(mine)
            parts.append(c)
        parts = [p for p in parts if len(p.columns)]
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()

    def skew(self) -> pd.DataFrame:
        """Across the ranks: per collective call, arrival skew, transfer and per-rank wait (us)."""
        per = {r: s.tables["collectives"] for r, s in self.ranks_.items()}
        return collectives.skew(per, {r: float(s.t0_us) for r, s in self.ranks_.items()})

    def straggler(self) -> collectives.Straggler:
        return collectives.straggler(self.skew(), len(self.ranks_), self.world_size())

    def summary(self) -> str:
        """A short text report: per rank, the temporal split, overlap, top kernels, verdict."""
        lines = [f"{self.path}: {len(self.ranks_)} rank(s)"]
        for r, s in self.ranks_.items():
            row = s.tables["temporal"].iloc[0] if len(s.tables["temporal"]) else pd.Series(dtype=float)
            ov = s.tables["overlap"]["overlap_pct"].iloc[0] if len(s.tables["overlap"]) else float("nan")
            device = "CPU" if s.rule == cpu.RULE else s.device or "device not recorded"
            if s.rule == cpu.RULE:
                lines.append(f"rank {r}: {cpu.RULE_TEXT}")
            pct = {c: row.get(f"{c}_pct", float("nan")) for c in ("idle", "compute", "communication", "memory")}
            lines.append(
                f"rank {r} ({device}, {s.steps or 'no'} steps): span {row.get('span', 0.0) / 1e3:.1f} ms, "
                f"idle {pct['idle']:.1f}%, compute {pct['compute']:.1f}%, exposed comm {pct['communication']:.1f}%, "
                f"memory {pct['memory']:.1f}%, comm overlapped {ov:.1f}%"
            )
            launch = s.tables["launch"]
            if len(launch):
                lines.append(f"  {launch['reason'].iloc[0]}")
            for tk in self.top_kernels(r, 5).itertuples():
                lines.append(f"  {tk.total / 1e3:9.2f} ms {tk.count:6d}x {tk.category:<22} {tk.name[:70]}")
        return "\n".join(lines)

    def record(self, rec: Recorder, experiment: str = "trace", variants: dict[int, str] | None = None) -> Recorder:
        """Add every rank's per-step figures to ``rec`` (median over steps, the steps as samples);
        ``variants``: rank -> the row's variant (default ``rank<N>``); ranks given the same variant
        are pooled, their steps side by side."""
        variants = variants or {r: f"rank{r}" for r in self.ranks_}
        by_variant: dict[str, list[RankSummary]] = {}
        for r, s in self.ranks_.items():
            if r in variants and len(s.per_step):
                by_variant.setdefault(variants[r], []).append(s)
        for variant, ranks in by_variant.items():
            df = pd.concat([s.per_step for s in ranks], ignore_index=True)
            # a GPU trace's per-step figure was measured by the profiler on the job's GPU: its spread across
            # steps is the job's own, which the comparison's bootstrap interval carries; a CPU trace's
            # (the CPU rule) was timed on a machine that may have been busy: judged from its samples
            gpu = all(s.rule != cpu.RULE for s in ranks)
            how = dict(stable=True, stability=GPU_STEPS) if gpu else {}
            for (metric, unit), g in df.groupby(["metric", "unit"], sort=False):
                vals = g["value"].to_numpy(dtype=np.float64)
                vals = vals[np.isfinite(vals)]
                if not len(vals):
                    continue
                rec.add(experiment, variant, metric, float(np.median(vals)), unit, statistic="median",
                        samples=vals.tolist(), **how)  # fmt: skip
        return rec


__all__ = ["JobSummary", "RankSummary", "TABLES", "metric_name", "per_step_values", "summarise"]
