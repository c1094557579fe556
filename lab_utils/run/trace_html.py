"""``trace.html``: the one self-contained page ``perflab trace`` writes (BokehJS inline, no script
loaded from anywhere else), from :func:`lab_utils.run.trace_cli.figures`' tables."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence

import holoviews as hv
import pandas as pd
from bokeh.embed import components
from bokeh.resources import Resources

from lab_utils.traces import TraceAnalysis


def inline_bokeh() -> str:
    """BokehJS inline, any ``<script src=...>`` another import registered dropped (as the compare page)."""
    return re.sub(r"<script[^>]*\bsrc=[^>]*>\s*</script>", "", Resources(mode="inline", components=["bokeh"]).render())


def _plots(ta: TraceAnalysis, fig: dict):
    hv.extension("bokeh", logo=False)
    t = pd.DataFrame(fig["temporal"])
    parts = ["compute", "communication", "memory", "other", "idle"]
    long = t.melt(id_vars=["rank"], value_vars=[p for p in parts if p in t], var_name="part", value_name="us")
    long["ms"], long["rank"] = long["us"] / 1e3, long["rank"].astype(str)
    per_rank = hv.Bars(long, kdims=["rank", "part"], vdims="ms").opts(
        stacked=True, width=520, height=320, title="per rank: where the span went (ms)", tools=["hover"]
    )
    s = pd.DataFrame(fig["temporal_by_step"])
    plots = [per_rank]
    if len(s):
        s["label"] = "r" + s["rank"].astype(str) + " s" + s["step"].astype(str)
        ls = s.melt(id_vars=["label"], value_vars=[p for p in parts if p in s], var_name="part", value_name="us")
        ls["ms"] = ls["us"] / 1e3
        bars = hv.Bars(ls, kdims=["label", "part"], vdims="ms")
        plots.append(bars.opts(stacked=True, width=620, height=320, title="per rank and step (ms)", xrotation=45))
    return hv.render(hv.Layout(plots).cols(2), backend="bokeh")


def _table(rows: list[dict], cols: Sequence[str] | None = None, limit: int = 50) -> str:
    if not rows:
        return "<p class='muted'>none</p>"
    cols = list(cols or rows[0].keys())
    esc = html.escape

    def cell(v) -> str:
        return f"{v:.4g}" if isinstance(v, float) else esc(str(v))

    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows[:limit])
    more = f"<p class='muted'>{len(rows) - limit} more rows in trace.json</p>" if len(rows) > limit else ""
    return f"<table><tr>{head}</tr>{body}</table>{more}"


def render_html(ta: TraceAnalysis, fig: dict, summary: str) -> str:
    """One self-contained page: BokehJS inline, no script loaded from anywhere else."""
    script, div = components(_plots(ta, fig))
    esc = html.escape
    sections = [("launch verdict", _table(fig["launch"])), ("overlap", _table(fig["overlap"])),
                ("idle split (us)", _table(fig["idle"])), ("HTA kernel types (%)", _table(fig["shares"])),
                ("categories", _table(fig["categories"]))]  # fmt: skip
    sections += [(f"top kernels, rank {r}", _table(rows)) for r, rows in fig["top_kernels"].items()]
    sections += [("phases (us)", _table(fig["phases"])), ("windows", _table(fig["windows"]))]
    sections += [(f"roofline, rank {r}", _table(rows)) for r, rows in fig["roofline"].items() if rows]
    sections.append(("collectives", _table(fig["collectives"])))
    if "skew" in fig:
        sections.append(("skew across ranks", _table(fig["skew"])))
    body = "".join(f"<h2>{esc(h)}</h2>{t}" for h, t in sections)
    style = (
        "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px}.muted{color:#777}pre{background:#f6f6f6;padding:1em}"
    )
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>perflab trace {esc(ta.path)}</title>'
        f"{inline_bokeh()}<style>{style}</style></head><body><h1>perflab trace</h1>"
        f"<pre>{esc(summary)}</pre>{div}{body}{script}</body></html>"
    )


__all__ = ["inline_bokeh", "render_html"]
