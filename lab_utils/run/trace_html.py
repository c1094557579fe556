"""``trace.html``: the one self-contained page ``perflab trace`` writes (BokehJS inline, no script
loaded from anywhere else), from :func:`lab_utils.run.trace_cli.figures`' tables.

Reading order: the headline verdicts as sentences (:func:`headline`); the timeline of one step
per rank and stream (:mod:`lab_utils.traces.timeline`, drawn by :mod:`lab_utils.core.lanes`);
where each rank's and step's time went; then the tables.  Every table prints times in ms or µs
with a handful of digits (:func:`fmt_us`), counts with thousands separators and never a number
in scientific notation; the legends sit right of their plots, outside the drawing area.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence

import pandas as pd
from bokeh.embed import components
from bokeh.layouts import column
from bokeh.resources import Resources

from lab_utils.core.lanes import lanes_figure, stacked_bars, step_lines
from lab_utils.traces import TraceAnalysis
from lab_utils.traces.sequences import short_name
from lab_utils.traces.timeline import CATEGORY_COLORS, HOVER, PART_COLORS, Timeline

#: columns whose values are microseconds (printed as µs / ms / s)
TIME_KEYS = {"span", "busy", "idle", "compute", "communication", "memory", "other", "non_compute", "kernel_time",
             "total", "mean", "min", "max", "dur", "host_wait", "other_wait", "kernel_wait", "gpu_us", "cpu_us",
             "length", "self", "gap"}  # fmt: skip
esc = html.escape


def fmt_num(v) -> str:
    """A number with a few significant digits, thousands separated, never in scientific notation."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    v = float(v)
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    decimals = min(max(0, 2 - math.floor(math.log10(a))), 9)
    return f"{v:.{decimals}f}"


def fmt_us(v) -> str:
    """Microseconds as µs, ms or s with three or four significant digits."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    v = float(v)
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:,.2f} s"
    if a >= 1e3:
        return f"{v / 1e3:,.{2 if a < 1e5 else 1}f} ms"
    return f"{fmt_num(v)} µs" if v else "0"


def fmt_pct(v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return f"{float(v):.1f}%"


def fmt_bytes(v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    v = float(v)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(v) >= scale:
            return f"{fmt_num(v / scale)} {unit}"
    return f"{int(v):,} B"


def _kind(key: str, value) -> str:
    k = key.lower()
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, str) or value is None and not k.endswith(("_us", "_pct", "_ms")):
        return "text"
    if k.endswith("_ms"):
        return "ms"
    if k.endswith("_us") or k in TIME_KEYS or k.startswith("wait_us"):
        return "us"
    if k.endswith("_pct") or k in ("pct", "share_of_step", "overlap") or k.startswith("share_"):
        return "pct"
    if k.endswith("_share") or k.endswith("share_of_idle"):
        return "share"
    if k in ("bytes",) or k.endswith("_bytes"):
        return "bytes"
    if k.endswith("gbps"):
        return "gbps"
    return "num"


def cell(key: str, value) -> str:
    """One table cell, formatted by what its column holds (see the module note)."""
    kind = _kind(key, value)
    if kind == "text":
        return esc("" if value is None else str(value))
    if kind == "bool":
        return fmt_num(value)
    if kind == "us":
        return fmt_us(value)
    if kind == "ms":
        return fmt_us(None if value is None else float(value) * 1e3)
    if kind == "pct":
        return fmt_pct(value)
    if kind == "share":
        return fmt_pct(None if value is None else 100.0 * float(value))
    if kind == "bytes":
        return fmt_bytes(value)
    if kind == "gbps":
        return f"{fmt_num(value)} GB/s" if value is not None else "–"
    return fmt_num(value)


def table(rows: list[dict], cols: Sequence[str] | None = None, limit: int = 50, labels: dict | None = None) -> str:
    """An HTML table of ``rows`` (``cols``: which columns, in order; default all)."""
    if not rows:
        return "<p class='muted'>none</p>"
    cols = [c for c in (cols or rows[0].keys()) if any(c in r for r in rows)]
    labels = labels or {}
    sample = {c: next((r[c] for r in rows if r.get(c) is not None), None) for c in cols}
    right = {c: _kind(c, sample[c]) not in ("text",) for c in cols}
    head = "".join(f"<th class='{'r' if right[c] else ''}'>{esc(labels.get(c, c))}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td class='{'r' if right[c] else ''}'>{cell(c, r.get(c))}</td>" for c in cols) + "</tr>"
        for r in rows[:limit]
    )
    more = f"<p class='muted'>{len(rows) - limit:,} more rows in trace.json</p>" if len(rows) > limit else ""
    return f"<table><tr>{head}</tr>{body}</table>{more}"


def inline_bokeh() -> str:
    """BokehJS inline, any ``<script src=...>`` another import registered dropped (as the compare page)."""
    return re.sub(r"<script[^>]*\bsrc=[^>]*>\s*</script>", "", Resources(mode="inline", components=["bokeh"]).render())


# -- the headline, as sentences ----------------------------------------------------------------
def _by_rank(rows: list[dict]) -> dict[int, dict]:
    return {int(r["rank"]): r for r in rows}


def rank_sentence(r: int, t: dict, device: str | None, idle: dict | None, overlap: float | None) -> str:
    """What one rank's step time went to, as one sentence."""
    parts = [f"computes {fmt_pct(t.get('compute_pct'))}"]
    if (t.get("communication_pct") or 0) > 0.05:
        parts.append(f"waits on communication not hidden by compute {fmt_pct(t.get('communication_pct'))}")
    if (t.get("memory_pct") or 0) > 0.05:
        parts.append(f"copies memory {fmt_pct(t.get('memory_pct'))}")
    idle_part = f"is idle {fmt_pct(t.get('idle_pct'))}"
    if idle and (idle.get("idle") or 0) > 0:
        idle_part += f" (of which {100 * (idle.get('host_wait') or 0) / idle['idle']:.0f}% waiting for the host)"
    parts.append(idle_part)
    text = f"Rank {r} ({device or 'device not recorded'}): over {fmt_us(t.get('span'))} of steps the GPU "
    text += ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1] + "."
    if overlap is not None and isinstance(overlap, float) and math.isfinite(overlap):
        text += f" Compute hides {overlap:.0f}% of its communication time."
    return text


def launch_sentence(r: int, row: dict) -> str:
    """The launch-bound verdict of one rank as a sentence."""
    reason = re.sub(r"^not launch-bound:\s*", "", str(row.get("reason", "")).strip())
    verdict = "is launch-bound" if row.get("launch_bound") else "is not launch-bound"
    return f"Rank {r} {verdict}: {reason}".rstrip(".") + "."


def _sentence(text: str) -> str:
    text = text.strip()
    return (text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")) if text else text


def headline(fig: dict, max_ranks: int = 4) -> list[str]:
    """The page's and the summary's headline verdicts, one sentence each (see the module note)."""
    out = []
    temporal, idle = _by_rank(fig["temporal"]), _by_rank(fig["idle"])
    overlap = {int(r["rank"]): r.get("overlap_pct") for r in fig["overlap"]}
    launch = _by_rank(fig["launch"])
    ranks = sorted(temporal)
    shown = ranks if len(ranks) <= max_ranks else []
    for r in shown:
        out.append(rank_sentence(r, temporal[r], fig["devices"].get(str(r)), idle.get(r), overlap.get(r)))
        if r in launch:
            out.append(launch_sentence(r, launch[r]))
    if not shown and ranks:
        idle_pct = pd.Series({r: temporal[r].get("idle_pct") for r in ranks}, dtype=float)
        comp = pd.Series({r: temporal[r].get("compute_pct") for r in ranks}, dtype=float)
        worst = int(idle_pct.idxmax())
        out.append(
            f"Over {len(ranks)} ranks the GPU computes a median {comp.median():.1f}% of the steps and is idle "
            f"{idle_pct.median():.1f}%; the most idle is rank {worst} ({idle_pct.max():.1f}%)."
        )
        bound = [r for r in ranks if launch.get(r, {}).get("launch_bound")]
        out.append(f"Of the {len(ranks)} ranks, {len(bound)} are launch-bound" + (f": {bound[:8]}." if bound else "."))
    if "straggler" in fig:
        out.append(_sentence(str(fig["straggler"].get("verdict", ""))))
    out += analysis_sentences(fig, shown)
    tops = fig.get("top_kernels", {})
    lead = shown[:1] or sorted(int(r) for r in tops)[:1]  # one rank's top kernel: the first shown, else the first
    for r, rows in tops.items():
        if rows and int(r) in lead:
            k = rows[0]
            out.append(
                f"The top kernel of rank {r} is {short_name(k['name'])[:80]} ({k['category']}): "
                f"{fmt_us(k['total'])} over "
                f"{int(k['count']):,} calls, {fmt_pct(k.get('pct'))} of its kernel time."
            )
    return [s for s in out if s]


BOUND_WORDS = {"cpu_bound": "host work", "gpu_compute_bound": "GPU compute",
               "gpu_communication_bound": "GPU communication", "gpu_kernel_launch_overhead": "launch delays",
               "gpu_kernel_kernel_overhead": "gaps between kernels"}  # fmt: skip


def path_sentence(r: str, cp: dict) -> str:
    """One rank's critical path as a sentence."""
    parts = sorted(cp["by_bound"].items(), key=lambda kv: -kv[1])
    split = ", ".join(f"{v:.0f}% {BOUND_WORDS.get(k, k)}" for k, v in parts if v >= 0.5) or "nothing on it"
    share = f" ({cp['share_of_step']:.0f}% of the step's {fmt_us(cp['window_us'])})" if cp["share_of_step"] else ""
    text = f"The critical path of step {cp['step']} on rank {r} is {fmt_us(cp['length_us'])}{share}: {split}"
    top = next((e for e in cp["events"] if e["name"]), None)
    if top:
        text += f"; the most of it is {short_name(top['name'])[:80]} ({fmt_us(top['us'])}, {top['pct']:.0f}%)"
    return text + "."


def analysis_sentences(fig: dict, shown: list[int]) -> list[str]:
    """The critical path and the costliest repeated kernel sequence of each rank shown (the first
    rank when there are many)."""
    out = []
    for r, a in fig.get("analyses", {}).items():
        if shown and int(r) not in shown or not shown and r != str(fig.get("analysed_ranks", [r])[0]):
            continue
        if a.get("critical_path"):
            out.append(path_sentence(r, a["critical_path"]))
        if a.get("sequences"):
            s = a["sequences"][0]
            out.append(
                f"The costliest repeated kernel sequence on rank {r} is {s['short'][:160]}: {s['count']:,} times, "
                f"{fmt_us(s['total_us'])} of kernels and {fmt_us(s['gap_us'])} of gaps between them "
                "(a fusion candidate)."
            )
    return out


# -- plots -------------------------------------------------------------------------------------
PARTS = ["compute", "communication", "memory", "other", "idle"]


def timeline_figure(tl: Timeline, width: int = 1100):
    """The step's timeline (see :mod:`lab_utils.traces.timeline`) as a bokeh figure."""
    return lanes_figure(tl.bars, tl.lanes, CATEGORY_COLORS, hover=HOVER, width=width, legend_title="category",
                        title=tl.title + " (scroll to zoom, drag to pan)")  # fmt: skip


def series_plots(fig: dict, width: int = 1100) -> list:
    """The launch queue per stream and the memory bandwidth in flight over the page's step, one line
    per rank and stream (or memory kind) of the analysed ranks; none where no rank has the series."""
    queue, bw, step = {}, {}, None
    for r, a in fig.get("analyses", {}).items():
        s = a.get("series")
        if not s:
            continue
        step = s["step"]
        for rows, out, key, value, name in ((s["queue"], queue, "stream", "queue_length", "stream {}"),
                                            (s["memory_bw"], bw, "kind", "gbps", "{}")):  # fmt: skip
            for k, g in pd.DataFrame(rows, columns=["ts", key, value]).groupby(key, sort=True):
                out[f"r{r} · {name.format(k)}"] = (g["ts"].to_numpy(), g[value].to_numpy())
    when = f"step {step}" if step is not None else "the trace's one window"
    plots = []
    if queue:
        plots.append(step_lines(queue, title=f"launch queue per stream over {when} (ms after its start)",
                                y_label="queued", width=width))  # fmt: skip
    if bw:
        plots.append(step_lines(bw, title=f"memory bandwidth in flight over {when} (ms after its start)",
                                y_label="GB/s", width=width))  # fmt: skip
    return plots


def _time_plots(fig: dict):
    t = pd.DataFrame(fig["temporal"])
    plots = []
    if len(t):
        t = t.assign(rank=[f"rank {r}" for r in t["rank"]])
        for p in PARTS:
            t[p] = t[p] / 1e3 if p in t else 0.0
        plots.append(stacked_bars(t, "rank", PARTS, PART_COLORS, title="per rank: where the steps' span went (ms)"))
    s = pd.DataFrame(fig["temporal_by_step"])
    if len(s):
        s = s.assign(label=[f"rank {r} · step {st}" for r, st in zip(s["rank"], s["step"])])
        for p in PARTS:
            s[p] = s[p] / 1e3 if p in s else 0.0
        plots.append(stacked_bars(s, "label", PARTS, PART_COLORS, title="per rank and step (ms)"))
    return plots


# -- the page ----------------------------------------------------------------------------------
STYLE = (
    "body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1400px}"
    "table{border-collapse:collapse;font-size:12px;margin-bottom:1em}"
    "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}"
    "td.r,th.r{text-align:right;font-variant-numeric:tabular-nums}.muted{color:#777}"
    "pre{background:#f6f6f6;padding:1em;white-space:pre-wrap;word-break:break-word}"
    "ul.verdicts li{margin:.3em 0;line-height:1.4}.note{color:#555;font-size:13px}"
)


def sections(fig: dict) -> list[tuple[str, str]]:
    """The tables of the page, in order, as (heading, HTML)."""
    out = [
        ("launch statistics and verdict", table(fig["launch"])),
        ("overlap of communication by compute", table(fig["overlap"])),
        ("idle split", table(fig["idle"])),
        ("HolisticTraceAnalysis kernel types (% of kernel time)", table(fig["shares"])),
        ("categories", table(fig["categories"], ["rank", "category", "count", "total", "pct"])),
    ]
    out += [(f"top kernels, rank {r}", table(rows)) for r, rows in fig["top_kernels"].items()]
    out += [("phases (GPU time per step)", table(fig["phases"])), ("windows", table(fig["windows"]))]
    out += [(f"roofline, rank {r}", table(rows)) for r, rows in fig["roofline"].items() if rows]
    out.append(("collectives", table(fig["collectives"])))
    if "skew" in fig:
        out.append(("skew across ranks", table(fig["skew"])))
    out += analysis_sections(fig)
    return out


def tree_table(rows: list[dict], limit: int = 120) -> str:
    """The call tree as an indented table: each row's name under its parent, GPU total and self."""
    if not rows:
        return "<p class='muted'>none</p>"
    body = "".join(
        f"<tr><td title='{esc(r['path'])}'>{'&nbsp;' * 4 * int(r['depth'])}{esc(str(r['name'])[:100])}</td>"
        f"<td>{esc(r['kind'])}</td><td class='r'>{fmt_num(r['count'])}</td>"
        f"<td class='r'>{fmt_us(r['gpu_total_us'])}</td>"
        f"<td class='r'>{fmt_us(r['gpu_self_us'])}</td><td class='r'>{fmt_pct(r['gpu_pct'])}</td>"
        f"<td class='r'>{fmt_us(r['cpu_us'])}</td></tr>"
        for r in rows[:limit]
    )
    head = "<tr><th>name</th><th>kind</th><th class='r'>count</th><th class='r'>GPU total</th>"
    head += "<th class='r'>GPU self</th><th class='r'>% of GPU time</th><th class='r'>CPU</th></tr>"
    return f"<table>{head}{body}</table>"


def analysis_sections(fig: dict) -> list[tuple[str, str]]:
    """Sections of the critical path, call tree, sequences, idle per stream, launches and counters."""
    out = []
    for r, a in fig.get("analyses", {}).items():
        cp = a.get("critical_path")
        if cp:
            html_ = f"<p>{esc(path_sentence(r, cp))}</p>" + table(cp["by_category"], ["category", "us", "pct", "edges"])
            html_ += table(cp["events"], ["name", "us", "pct"], labels={"name": "charged to", "us": "time on the path"})
            out.append((f"critical path, rank {r}, step {cp['step']}", html_))
        out.append((f"call tree, rank {r} (GPU time up the host's ranges, modules and operators)",
                    tree_table(a["hierarchy"])))  # fmt: skip
        out.append((f"repeated kernel sequences, rank {r} (fusion candidates)",
                    table(a["sequences"], ["short", "length", "count", "total_us", "mean_us", "gap_us", "ops"],
                          labels={"short": "sequence"}, limit=20)))  # fmt: skip
        lo = a["launch_outliers"]
        text = (f"<p>{lo['launches']:,} launch calls; {lo['runtime_outliers']:,} took over 50 µs, "
                f"{lo['delay_outliers']:,} waited over 100 µs to start, {lo['gpu_shorter_than_cpu']:,} ran "
                "shorter than their own launch call.</p>")  # fmt: skip
        worst = table(lo["worst"], ["name", "op", "stream", "step", "cpu_us", "gpu_us", "delay_us", "outlier"])
        out.append((f"launch outliers, rank {r}", text + worst))
        out.append((f"launch queue per stream, rank {r}", table(a["queue_length"])))
        if a["memory_bw"]:
            out.append((f"memory bandwidth of copies and fills, rank {r} (GB/s in flight)", table(a["memory_bw"])))
    if fig.get("stream_idle"):
        cols = ["rank", "stream", "activities", "host_wait", "kernel_wait", "other", "idle", "host_wait_pct"]
        out.append(("idle per stream (host wait, kernel wait under 30 µs, other)", table(fig["stream_idle"], cols)))
    return out


def render_html(ta: TraceAnalysis, fig: dict, summary: str, timeline: Timeline | None = None) -> str:
    """One self-contained page: BokehJS inline, no script loaded from anywhere else."""
    plots = []
    note = ""
    if timeline is not None and len(timeline.bars):
        plots.append(timeline_figure(timeline))
        n = len(timeline.steps)
        how = f"step {timeline.step} (one of {n} steps)" if n > 1 else f"step {timeline.step} (the trace's only window)"
        note = (
            f"<p class='note'>The timeline shows {how} (the median-duration step unless <code>--step N</code> "
            f"chose it), {len(timeline.bars):,} bars. {esc(timeline.note)}"
            + (f" Ranks without step {timeline.step}: {timeline.missing}." if timeline.missing else "")
            + " <code>trace.perfetto.json.gz</code> beside this page opens in Perfetto (ui.perfetto.dev).</p>"
        )
    plots += series_plots(fig) + _time_plots(fig)
    script, div = components(column(*plots)) if plots else ("", "")
    verdicts = "".join(f"<li>{esc(s)}</li>" for s in headline(fig))
    body = "".join(f"<h2>{esc(h)}</h2>{t}" for h, t in sections(fig))
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>perflab trace {esc(ta.path)}</title>'
        f"{inline_bokeh()}<style>{STYLE}</style></head><body><h1>perflab trace</h1>"
        f"<p class='muted'>{esc(ta.path)}: {len(ta.ranks)} rank(s)</p>"
        f"<h2>In one look</h2><ul class='verdicts'>{verdicts}</ul>{note}{div}{body}"
        f"<details><summary>the text summary</summary><pre>{esc(summary)}</pre></details>{script}</body></html>"
    )


__all__ = [
    "cell",
    "fmt_num",
    "fmt_us",
    "headline",
    "inline_bokeh",
    "render_html",
    "series_plots",
    "table",
    "timeline_figure",
]
