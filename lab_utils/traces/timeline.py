"""The timeline of one step: what ran where, per rank and stream, as bars a plot draws.

Which step: :func:`representative_step` is the step of median host duration (of the ``n`` steps
sorted by duration, the ``(n - 1) // 2``-th: the shorter of the two middle ones when ``n`` is
even), read on the job's first rank; a trace without ``ProfilerStep`` ranges is one window
(step 0).  Every rank shows the same step number, so the ranks line up on the shared clock.

What is drawn (:func:`step_timeline`), per rank, on lanes from top to bottom:

* ``ranges L``: the user ranges (``record_function``, ``## forward ##``, nn.Module ranges) of the
  step's main thread that lie inside the step window, one lane per nesting level ``L`` (1 is the
  outermost under ``ProfilerStep``), coloured by their phase (:mod:`lab_utils.traces.phases`;
  category ``phase: forward`` ..., ``phase: none`` for a range without one);
* ``CPU ops``: the outermost CPU operators of the main thread inside the window (``aten::linear``,
  ``Optimizer.step`` ...): what the host was doing while it launched;
* ``critical path`` (when given, :mod:`lab_utils.traces.critical_path`): the step's critical path,
  one bar per stretch of it with time, coloured by what bounds it (CPU, GPU compute, GPU
  communication, launch delay, kernel gap);
* ``stream S``: the activities (kernels, memcpy, memset) *launched in the step*
  (:mod:`lab_utils.traces.attribute`) on stream ``S``, coloured by perflab's category; the NCCL
  kernels of a stream get their own lane, ``stream S · NCCL``.

Times are milliseconds from the earliest start of the step over the ranks drawn.

Bounded payload: a big step holds hundreds of thousands of kernels.  When the bars exceed
``max_bars`` (default 20,000), the longest ``max_bars // 2`` activities are kept as they are and
every shorter one is merged, per lane, into one bar per ``1 / bins`` of the step (default 1,000
bins): the merged bar spans its activities' first start to last end and carries their count and
summed busy time.  :attr:`Timeline.note` says how many were merged below which duration; the
page prints it.  The CPU-op and range lanes are bounded the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from lab_utils.core.config import ConfigError
from lab_utils.traces.attribute import Attributed
from lab_utils.traces.phases import PHASES, PhaseTable
from lab_utils.traces.reader import RankTrace

MAX_BARS = 20_000
BINS = 1_000
MERGED = "merged (short)"
#: one colour per perflab category (kernels), CPU op, merged bars and phase (range bars)
CATEGORY_COLORS = {
    "matmul": "#1f77b4", "attention": "#9467bd", "normalization": "#17becf", "elementwise/activation": "#2ca02c",
    "reduction": "#bcbd22", "copy/cast": "#8c564b", "embedding": "#e377c2", "communication": "#d62728",
    "optimizer": "#ff7f0e", "memcpy": "#7f7f7f", "memset": "#c7c7c7", "fused (triton)": "#aec7e8", "other": "#dbdb8d",
    "CPU op": "#a0a0a0", MERGED: "#969696",
}  # fmt: skip
_PHASE_COLORS = ("#fdd0a2", "#c6dbef", "#c7e9c0", "#fcbba1", "#dadaeb", "#d9d9d9", "#f4a582", "#eeeeee")
CATEGORY_COLORS |= dict(zip([f"phase: {p}" for p in PHASES + ("none",)], _PHASE_COLORS))
#: the fields a bar's hover shows (bokeh's tooltip form: label, @column)
HOVER = [("name", "@name"), ("category", "@category"), ("lane", "@lane"), ("start", "@start_ms{0,0.000} ms"),
         ("duration", "@dur_us{0,0.0} µs"), ("op", "@op"), ("phase", "@phase"), ("count", "@count")]  # fmt: skip
#: what bounds a stretch of the critical path (HTA's bound_by) -> its bar's category
PATH_CATEGORIES = {"cpu_bound": "path: CPU", "gpu_compute_bound": "path: GPU compute",
                   "gpu_communication_bound": "path: GPU communication",
                   "gpu_kernel_launch_overhead": "path: launch delay",
                   "gpu_kernel_kernel_overhead": "path: kernel gap"}  # fmt: skip
CATEGORY_COLORS |= dict(zip(PATH_CATEGORIES.values(), ("#252525", "#08519c", "#a50f15", "#fd8d3c", "#fdae6b")))
#: the temporal breakdown's parts (lab_utils.traces.breakdown.temporal)
PART_COLORS = {"idle": "#c7c7c7", "compute": "#1f77b4", "communication": "#d62728", "memory": "#ff7f0e",
               "other": "#9467bd"}  # fmt: skip
COLUMNS = ["rank", "lane", "kind", "name", "category", "phase", "op", "stream", "start_ms", "end_ms", "dur_us",
           "count", "launch_ms", "on_step"]  # fmt: skip


@dataclass
class Timeline:
    """Bars of one step (see the module note): ``bars`` has :data:`COLUMNS`; ``lanes`` their order."""

    step: int
    steps: list[int]
    t0_us: float  # absolute trace time (us) the ms axis starts at
    bars: pd.DataFrame
    lanes: list[str]
    merged: int = 0  # activities merged into the short bars
    merged_below_us: float = 0.0
    bins: int = BINS
    ranks: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)  # ranks without this step

    @property
    def title(self) -> str:
        return f"step {self.step}: per rank, the critical path, user ranges and CPU ops above each GPU stream"

    @property
    def note(self) -> str:
        """One sentence on what was merged, or ''."""
        if not self.merged:
            return ""
        shown = int((self.bars["kind"] == "merged").sum())
        return (
            f"{self.merged:,} activities shorter than {_us_text(self.merged_below_us)} are merged into {shown:,} "
            f"bars (one per lane per 1/{self.bins:,} of the step), to keep the page small; each merged bar's "
            "hover gives its count and busy time"
        )


def _us_text(us: float) -> str:
    return f"{us / 1e3:.3g} ms" if us >= 1e3 else f"{us:.3g} µs"


def representative_step(att: Attributed) -> int:
    """The step of median host duration (see the module note); 0 for a trace without steps."""
    if not att.has_steps or not len(att.steps):
        return 0
    return median_step(att.steps)


def median_step(steps: pd.DataFrame) -> int:
    """The step of median ``dur`` of a table of step windows (the lower median; ties by step number)."""
    s = steps.sort_values(["dur", "step"], kind="stable")
    return int(s["step"].iloc[(len(s) - 1) // 2])


def check_step(step: int, atts: dict[int, Attributed], param: str = "step") -> None:
    """``ConfigError`` naming ``param`` unless some rank has step ``step``."""
    check_steps(param, step, [all_steps([a]) for a in atts.values()])


def check_steps(param: str, step: int, steps: list[list[int]]) -> None:
    """``ConfigError`` naming ``param`` unless one of the ranks' step lists holds ``step``."""
    have = sorted({int(s) for st in steps for s in st})
    if step not in have:
        shown = have if len(have) <= 12 else have[:6] + ["..."] + have[-3:]
        raise ConfigError(param, step, f"a ProfilerStep number of the trace: {shown}")


def _lane_depths(ts: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Nesting level (0 outermost) of intervals sorted by (ts, -dur)."""
    depth = np.zeros(len(ts), dtype=np.int64)
    stack: list[float] = []
    for i, (a, b) in enumerate(zip(ts, end)):
        while stack and stack[-1] <= a:
            stack.pop()
        depth[i] = len(stack)
        stack.append(b)
    return depth


def _host_bars(rank: int, trace: RankTrace, att: Attributed, lo: float, hi: float, phases: PhaseTable):
    host = trace.host
    if att.main_tid is None or not len(host):
        return []
    h = host[(host["tid"].astype(str) == att.main_tid) & (host["ts"] >= lo) & (host["end"] <= hi)]
    h = h[h["dur"] > 0]
    out = []
    cat = h["cat"].astype(str)
    ann = h[cat.eq("user_annotation") | cat.eq("python_function")]
    ann = ann[~ann["name"].astype(str).str.match(r"^ProfilerStep\s*#")]
    ann = ann.sort_values(["ts", "dur"], ascending=[True, False])
    if len(ann):
        depth = _lane_depths(ann["ts"].to_numpy(), ann["end"].to_numpy())
        names = ann["name"].astype(str).to_numpy()
        out.append(
            pd.DataFrame({"rank": rank, "lane": [f"r{rank} · ranges {d + 1}" for d in depth], "kind": "range",
                          "name": names, "category": [f"phase: {phases.phase(n) or 'none'}" for n in names],
                          "phase": [phases.phase(n) for n in names], "op": None, "stream": -1,
                          "ts": ann["ts"].to_numpy(), "end": ann["end"].to_numpy(), "count": 1, "launch": np.nan})
        )  # fmt: skip
    ops = h[cat.eq("cpu_op")].sort_values(["ts", "dur"], ascending=[True, False])
    if len(ops):
        top = _lane_depths(ops["ts"].to_numpy(), ops["end"].to_numpy()) == 0
        ops = ops[top]
        out.append(
            pd.DataFrame({"rank": rank, "lane": f"r{rank} · CPU ops", "kind": "op", "name": ops["name"].astype(str),
                          "category": "CPU op", "phase": None, "op": ops["name"].astype(str), "stream": -1,
                          "ts": ops["ts"].to_numpy(), "end": ops["end"].to_numpy(), "count": 1, "launch": np.nan})
        )  # fmt: skip
    return out


def _path_bars(rank: int, edges: pd.DataFrame) -> pd.DataFrame:
    e = edges[edges["weight"] > 0]
    return pd.DataFrame({"rank": rank, "lane": f"r{rank} · critical path", "kind": "path",
                         "name": [n or k for n, k in zip(e["name"], e["kind"])],
                         "category": [PATH_CATEGORIES.get(b, "path: CPU") for b in e["bound_by"]], "phase": None,
                         "op": None, "stream": e["stream"].to_numpy(), "ts": e["start_us"].to_numpy(),
                         "end": e["end_us"].to_numpy(), "count": 1, "launch": np.nan})  # fmt: skip


def _gpu_bars(rank: int, k: pd.DataFrame) -> pd.DataFrame:
    comm = k["category"].astype(str).eq("communication").to_numpy()
    streams = k["stream"].to_numpy()
    lanes = [f"r{rank} · stream {s}" + (" · NCCL" if c else "") for s, c in zip(streams, comm)]
    return pd.DataFrame({"rank": rank, "lane": lanes, "kind": "kernel", "name": k["name"].astype(str).to_numpy(),
                         "category": k["category"].astype(str).to_numpy(), "phase": k["phase"].to_numpy(),
                         "op": k["op"].to_numpy(), "stream": streams, "ts": k["ts"].to_numpy(),
                         "end": k["end"].to_numpy(), "count": 1, "launch": k["launch_ts"].to_numpy()})  # fmt: skip


def _decimate(bars: pd.DataFrame, max_bars: int, bins: int, lo: float, hi: float) -> tuple[pd.DataFrame, int, float]:
    """Keep the longest ``max_bars // 2`` bars, merge the rest per lane and time bin (module note)."""
    if len(bars) <= max_bars:
        return bars, 0, 0.0
    dur = (bars["end"] - bars["ts"]).to_numpy()
    keep_n = max(max_bars // 2, 1)
    order = np.argsort(-dur, kind="stable")
    threshold = float(dur[order[keep_n - 1]])
    keep = np.zeros(len(bars), dtype=bool)
    keep[order[:keep_n]] = True
    short = bars[~keep].copy()
    width = max((hi - lo) / bins, 1e-9)
    short["bin"] = np.floor((short["ts"] - lo) / width).astype(np.int64)
    g = short.groupby(["rank", "lane", "bin"], sort=False, observed=True)
    merged = g.agg(ts=("ts", "min"), end=("end", "max"), count=("count", "sum"), stream=("stream", "first"),
                   busy=("dur_busy", "sum")).reset_index()  # fmt: skip
    merged = merged.assign(kind="merged", category=MERGED, phase=None, op=None, launch=np.nan)
    merged["name"] = [f"{int(c):,} merged, busy {_us_text(b)}" for c, b in zip(merged["count"], merged["busy"])]
    merged["dur_busy"] = merged.pop("busy")
    out = pd.concat([bars[keep], merged.drop(columns=["bin"])], ignore_index=True)
    return out, int(short["count"].sum()), threshold


@dataclass
class RankBars:
    """One rank's bars of a step on the shared clock (absolute us), before they meet the others'."""

    rank: int
    bars: pd.DataFrame
    lo: float  # the step's window, absolute us
    hi: float
    merged: int = 0
    merged_below_us: float = 0.0


def rank_bars(
    rank: int,
    trace: RankTrace,
    att: Attributed,
    step: int,
    *,
    phases: PhaseTable | None = None,
    path: pd.DataFrame | None = None,
    max_bars: int = MAX_BARS,
) -> RankBars | None:
    """The bars of ``step`` on one rank (see the module note), merged past ``max_bars``; None when
    the rank has no such step.  ``path``: the edges of its critical path (``CriticalPath.edges``)."""
    w = att.steps[att.steps["step"] == step]
    if not len(w):
        return None
    lo, hi = float(w["ts"].iloc[0]), float(w["end"].iloc[0])
    k = att.kernels
    k = k[(k["window"] == "step") & (k["step"] == step)]
    gpu = _gpu_bars(rank, k)
    parts = _host_bars(rank, trace, att, lo, hi, phases or PhaseTable()) + ([gpu] if len(gpu) else [])
    if path is not None and len(path):
        parts.insert(0, _path_bars(rank, path))
    t0 = float(trace.t0_us)
    if not parts:
        return RankBars(rank, pd.DataFrame(columns=COLUMNS), lo + t0, hi + t0)
    b = pd.concat(parts, ignore_index=True)
    b[["ts", "end", "launch"]] += t0  # absolute: ranks on the shared clock
    lo, hi = min(lo + t0, float(b["ts"].min())), max(hi + t0, float(b["end"].max()))
    b["dur_busy"] = b["end"] - b["ts"]
    b, merged, below = _decimate(b, max_bars, BINS, lo, hi)
    return RankBars(rank, b, lo, hi, merged, below)


def assemble(
    parts: list[RankBars], step: int, steps: list[int], ranks: list[int], *, max_bars: int = MAX_BARS, bins: int = BINS
) -> Timeline:
    """The ranks' bars of one step as one :class:`Timeline`, merged again past ``max_bars``."""
    missing = sorted(set(ranks) - {p.rank for p in parts})
    parts = [p for p in parts if len(p.bars)]
    if not parts:
        return Timeline(step, steps, 0.0, pd.DataFrame(columns=COLUMNS), [], ranks=ranks, missing=missing)
    lo, hi = min(p.lo for p in parts), max(p.hi for p in parts)
    bars = pd.concat([p.bars for p in parts], ignore_index=True)
    bars, merged, below = _decimate(bars, max_bars, bins, lo, hi)
    merged += sum(p.merged for p in parts)
    below = max([below] + [p.merged_below_us for p in parts])
    bars["start_ms"] = (bars["ts"] - lo) / 1e3
    bars["end_ms"] = (bars["end"] - lo) / 1e3
    bars["launch_ms"] = (bars["launch"] - lo) / 1e3
    bars["dur_us"] = bars["end"] - bars["ts"]
    bars["on_step"] = step
    lanes = sorted(bars["lane"].unique(), key=_lane_key)
    bars = bars[COLUMNS].sort_values(["lane", "start_ms"], key=_sort_key).reset_index(drop=True)
    return Timeline(step, steps, float(lo), bars, lanes, merged, below, bins, ranks, missing)


def step_timeline(
    traces: dict[int, RankTrace],
    atts: dict[int, Attributed],
    step: int | None = None,
    *,
    ranks: list[int] | None = None,
    phases: PhaseTable | None = None,
    max_bars: int = MAX_BARS,
    bins: int = BINS,
    paths: dict[int, pd.DataFrame] | None = None,
) -> Timeline:
    """The bars of ``step`` (default :func:`representative_step` of the first rank) on ``ranks``;
    ``paths``: per rank, the edges of that step's critical path (``CriticalPath.edges``)."""
    ranks = sorted(ranks if ranks is not None else atts)
    if not ranks:
        raise ConfigError("ranks", ranks, "at least one rank of the trace")
    if step is None:
        step = representative_step(atts[ranks[0]])
    check_step(step, {r: atts[r] for r in ranks})
    paths = paths or {}
    parts = [rank_bars(r, traces[r], atts[r], step, phases=phases, path=paths.get(r), max_bars=1 << 62) for r in ranks]
    return assemble([p for p in parts if p is not None], step, all_steps(atts.values()), ranks, max_bars=max_bars,
                    bins=bins)  # fmt: skip


def all_steps(atts) -> list[int]:
    """The step numbers any of ``atts`` has (0 for a trace without steps)."""
    return sorted({int(s) for a in atts for s in (a.steps["step"] if a.has_steps else [0])})


def _lane_key(lane: str) -> tuple:
    """Rank, then ranges (by level), CPU ops, streams (by number, NCCL after its stream)."""
    rank_part, _, rest = lane.partition(" · ")
    rank = int(rank_part[1:])
    if rest.startswith("ranges"):
        return (rank, 0, int(rest.split()[-1]), 0)
    if rest == "critical path":
        return (rank, -1, 0, 0)
    if rest == "CPU ops":
        return (rank, 1, 0, 0)
    num = rest.split(" · ")[0].split()[-1]
    return (rank, 2, int(num) if num.lstrip("-").isdigit() else 1 << 30, int(rest.endswith("NCCL")))


def _sort_key(col: pd.Series) -> pd.Series:
    return col.map(_lane_key) if col.name == "lane" else col
