"""Plot helpers: holoviews on bokeh, readable in JupyterLab and offline in exported HTML.

Plots read records (DataFrames of tidy rows); they never measure.

``init()`` loads the bokeh extension with its JS/CSS *inline* so that an exported
notebook renders with no network, and tells panel (which renders holoviews objects and
their widgets) to inline its component stylesheets too: otherwise, in a live JupyterLab,
every panel widget asks panel's CDN for its stylesheet.  Interactivity that must survive export uses
``hv.HoloMap`` (every frame embedded, bokeh widgets) rather than ``DynamicMap``
(needs a live kernel) or ipywidgets.
"""

from __future__ import annotations

import math

import holoviews as hv
import pandas as pd
import panel as pn
from bokeh.models import UIElement
from bokeh.settings import settings
from panel.io.notebook import patch_inline_stylesheets
from panel.viewable import Viewable

from lab_utils.core.ceilings import dtype_key
from lab_utils.core.roofline import roofline_curve

_INITIALISED = False


def _inline_stylesheets(viewable, root) -> None:
    """Panel hook run on every model tree it renders or updates: stylesheets that point at
    panel's CDN become inline ones, read from panel's own dist folder (holoviews renders
    through panel without the inlining panel applies to its own objects)."""
    for model in root.select({"type": UIElement}):
        patch_inline_stylesheets(model)


def init(width: int = 700, height: int = 380):
    """Load holoviews + bokeh with inline resources; returns the holoviews module."""
    global _INITIALISED
    if not _INITIALISED:
        settings.resources = "inline"
        pn.config.inline = True
        if _inline_stylesheets not in Viewable._preprocessing_hooks:
            Viewable._preprocessing_hooks.append(_inline_stylesheets)
        hv.extension("bokeh", inline=True, logo=False)
        # canvas, not WebGL: the labs' plots are small, and a page that draws none with WebGL leaves
        # BokehJS's WebGL bundle (190 kB) out of its inline JavaScript (run/report.drop_unused_webgl)
        hv.renderer("bokeh").webgl = False
        hv.opts.defaults(
            hv.opts.Curve(width=width, height=height, tools=["hover"], show_grid=True),
            hv.opts.Scatter(width=width, height=height, tools=["hover"], size=8, show_grid=True),
            hv.opts.Bars(width=width, height=height, tools=["hover"], show_grid=True),
            hv.opts.HeatMap(width=width, height=height, tools=["hover"]),
            hv.opts.Overlay(width=width, height=height),
        )
        _INITIALISED = True
    return hv


def median_rows(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Rows of one metric's median statistic (what most plots draw)."""
    return df[(df.metric == metric) & (df.statistic == "median")].copy()


def roofline_plot(
    points: pd.DataFrame, ceilings, *, dtype="fp32", label_col: str = "variant", title: str | None = None
):
    """Log-log roofline of the measured ceilings with points (columns ``intensity``,
    ``tflops`` and ``label_col``); the ridge point is marked."""
    init()
    bw = ceilings.copy_gbs
    peak = ceilings.matmul(dtype) or ceilings.matmul("fp32")
    dtype = dtype_key(dtype)
    ridge = peak * 1e12 / (bw * 1e9)
    lo = min([ridge / 100] + [float(x) for x in points.get("intensity", []) if x and x > 0]) / 2
    hi = max([ridge * 100] + [float(x) for x in points.get("intensity", []) if x and math.isfinite(x)]) * 2
    x, y = roofline_curve(ceilings, dtype, lo=lo, hi=hi)
    roof = hv.Curve((x, y), "intensity", "TFLOP/s", label=f"roof ({bw:.0f} GB/s, {peak:.3g} TFLOP/s {dtype})").opts(
        color="black", line_width=2, logx=True, logy=True
    )
    ridge_pt = hv.Scatter([(ridge, peak)], "intensity", "TFLOP/s", label=f"ridge {ridge:.3g} FLOP/B").opts(
        marker="diamond", size=14, color="red"
    )
    vline = hv.VLine(ridge).opts(color="red", line_dash="dashed", line_width=1)
    layers = [roof, vline, ridge_pt]
    if len(points):
        pts = points.copy()
        for lab, g in pts.groupby(label_col, sort=False):
            vdims = ["tflops"] + [c for c in ("gbs", "time_ms", "shape", "pct_of_ceiling") if c in g.columns]
            layers.append(hv.Scatter(g, "intensity", vdims, label=str(lab)).opts(logx=True, logy=True, tools=["hover"]))
    ov = hv.Overlay(layers).opts(
        logx=True,
        logy=True,
        legend_position="bottom_right",
        title=title or f"Roofline of {ceilings.device_name}",
        xlabel="arithmetic intensity (FLOP/byte)",
        ylabel="TFLOP/s",
    )
    return ov
