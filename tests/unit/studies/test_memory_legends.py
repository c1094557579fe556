"""Legends beside the data, not over it: lab 05's bytes-per-class bars and
its Pareto plot put their legend to the right of the axes."""

from __future__ import annotations

import holoviews as hv
import pandas as pd

from lab_utils.memory import CLASSES
from lab_utils.studies import memory as lab05
from lab_utils.studies import memory_formula

hv.extension("bokeh")


def _opts(el) -> dict:
    return el.opts.get().kwargs


def test_class_bars_legend_is_outside_the_bars():
    rows = [dict(preset="tiny", dtype="bfloat16", policy=p, **dict.fromkeys(CLASSES, 1e9)) for p in ("none", "full")]
    frame = memory_formula.class_bars(pd.DataFrame(rows)).last
    assert _opts(frame)["legend_position"] == "right"
    fig = hv.render(frame)
    assert fig.legend and fig.legend[0] in fig.right  # drawn in the right panel, not on the plot area


def test_pareto_legend_is_outside_the_points():
    df = pd.DataFrame(
        dict(
            policy=["none", "full", "selective"],
            time_ms=[10.0, 14.0, 12.0],
            peak_bytes=[9e8, 4e8, 6e8],
            saved_bytes=[8e8, 2e8, 5e8],
            recomputed_flops=[0.0, 3e9, 1e9],
        )
    )
    plot = lab05.pareto_plot(df)
    assert _opts(plot)["legend_position"] == "right"
    fig = hv.render(plot)
    assert fig.legend and fig.legend[0] in fig.right
