"""Bars on named lanes (a Gantt chart: a trace's timeline), drawn with bokeh alone.

No holoviews: ``perflab trace`` draws its page with this without importing the notebook stack,
and lab 09 shows the same figure.  The figure zooms and pans along time (wheel, drag, box),
keeps its legend outside the plot area (right of it, one entry per colour), and shows each
bar's fields on hover.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from bokeh.models import ColumnDataSource, FactorRange, HoverTool, Legend, LegendItem, Range1d
from bokeh.plotting import figure

FALLBACK = "#bbbbbb"
#: line colours (Okabe-Ito, then greys)
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000", "#999999")
LANE_PX = 22  # height of one lane


def lanes_figure(
    bars: pd.DataFrame,
    lanes: list[str],
    colors: dict[str, str],
    *,
    color_by: str = "category",
    hover: list[tuple[str, str]] | None = None,
    title: str = "",
    width: int = 1100,
    legend_title: str = "",
):
    """A bokeh figure of ``bars`` (columns ``lane``, ``start_ms``, ``end_ms``, ``color_by`` and the
    ``hover`` fields) on ``lanes`` (top to bottom, :data:`LANE_PX` each), one colour per value of
    ``color_by``; time in ms along x."""
    n_keys = bars[color_by].nunique() if len(bars) else 0
    height = max(160, 60 + LANE_PX * max(len(lanes), 1), 60 + 21 * n_keys)  # room for the legend beside it
    lo = float(bars["start_ms"].min()) if len(bars) else 0.0
    hi = float(bars["end_ms"].max()) if len(bars) else 1.0
    pad = max((hi - lo) * 0.01, 1e-6)
    fig = figure(
        y_range=FactorRange(*reversed(lanes)) if lanes else FactorRange("(empty)"),
        x_range=Range1d(lo - pad, hi + pad, bounds=(lo - 10 * pad, hi + 10 * pad)),
        width=width,
        height=height,
        title=title,
        tools="xpan,xwheel_zoom,box_zoom,reset,save",
        active_scroll="xwheel_zoom",
        active_drag="xpan",
        x_axis_label="ms",
        output_backend="canvas",
    )
    items = []
    keys = list(dict.fromkeys(bars[color_by].astype(str))) if len(bars) else []
    keys.sort(key=lambda k: (list(colors).index(k) if k in colors else len(colors), k))
    for key in keys:
        part = bars[bars[color_by].astype(str) == key]
        data = {c: _column(part[c]) for c in part.columns}
        r = fig.hbar(
            y="lane",
            left="start_ms",
            right="end_ms",
            height=0.8,
            source=ColumnDataSource(data),
            fill_color=colors.get(key, FALLBACK),
            line_color=None,
        )
        items.append(LegendItem(label=key, renderers=[r]))
    if hover:
        fig.add_tools(HoverTool(tooltips=hover, renderers=[i.renderers[0] for i in items]))
    if items:
        legend = Legend(items=items, title=legend_title or None, click_policy="hide", label_text_font_size="10px")
        fig.add_layout(legend, "right")
    fig.ygrid.grid_line_color = None
    fig.yaxis.major_label_text_font_size = "10px"
    return fig


def step_lines(series: dict[str, tuple], *, title: str = "", y_label: str = "", width: int = 1100, height: int = 260):
    """One step line per entry of ``series`` (label -> (x in ms, y): each y holds until the next x),
    zoomable along x, the legend outside, right of the plot (a click hides a line)."""
    fig = figure(width=width, height=max(height, 60 + 21 * len(series)), title=title, x_axis_label="ms",
                 y_axis_label=y_label, tools="xpan,xwheel_zoom,box_zoom,reset,save", active_scroll="xwheel_zoom",
                 output_backend="canvas")  # fmt: skip
    items = []
    for i, (label, (x, y)) in enumerate(series.items()):
        src = ColumnDataSource({"x": np.asarray(x, dtype=np.float64), "y": np.asarray(y, dtype=np.float64)})
        r = fig.step("x", "y", source=src, mode="after", line_width=1.5, color=PALETTE[i % len(PALETTE)])
        items.append(LegendItem(label=label, renderers=[r]))
    fig.add_tools(HoverTool(tooltips=[("ms", "@x{0,0.000}"), (y_label or "value", "@y{0,0.00}")]))
    if items:
        fig.add_layout(Legend(items=items, click_policy="hide", label_text_font_size="10px"), "right")
    return fig


def _column(col: pd.Series) -> list | np.ndarray:
    """A column for the hover: text columns with their missing values shown empty; numbers as an
    array (bokeh sends it as one binary buffer, not a list of numbers to encode one by one)."""
    if col.dtype == object:
        return ["" if v is None or (isinstance(v, float) and v != v) else v for v in col]
    if pd.api.types.is_numeric_dtype(col.dtype) and not pd.api.types.is_bool_dtype(col.dtype):
        return col.to_numpy(dtype=np.float64 if pd.api.types.is_float_dtype(col.dtype) else None)
    return col.tolist()


def stacked_bars(
    table: pd.DataFrame,
    category: str,
    parts: list[str],
    colors: dict[str, str],
    *,
    title: str = "",
    x_label: str = "ms",
    width: int = 720,
    bar_px: int = 26,
):
    """Horizontal stacked bars: one bar per value of ``category`` (top to bottom in the table's
    order), one segment per column of ``parts``; the legend outside, right of the plot."""
    rows = [str(v) for v in table[category]]
    fig = figure(
        y_range=FactorRange(*reversed(rows)) if rows else FactorRange("(empty)"),
        width=width,
        height=max(70 + 21 * len(parts), 70 + bar_px * max(len(rows), 1)),
        title=title,
        tools="xpan,xwheel_zoom,reset,save",
        x_axis_label=x_label,
    )
    data = {"row": rows} | {p: table[p].astype(float).tolist() for p in parts}
    rs = fig.hbar_stack(parts, y="row", height=0.7, source=ColumnDataSource(data),
                        color=[colors.get(p, FALLBACK) for p in parts], line_color="white")  # fmt: skip
    fig.add_tools(HoverTool(tooltips=[("", "@row"), ("part", "$name"), ("value", "@$name{0,0.000}")]))
    legend = Legend(items=[LegendItem(label=p, renderers=[r]) for p, r in zip(parts, rs)], label_text_font_size="10px")
    fig.add_layout(legend, "right")
    fig.ygrid.grid_line_color = None
    return fig
