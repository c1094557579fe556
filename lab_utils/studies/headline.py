"""Each lab's takeaway: the two or three figures that matter, read from its records only.

A study module registers its lab's ``headline(df) -> list[Figure]`` with :func:`register`
(the lab's name is its notebook's stem, e.g. ``"01_training_step"``).  The same function
fills the lab's takeaway cell (:func:`takeaway`, shown right after the lab's main
measurement) and the report index's headline row per lab (:func:`headlines`, from the run's
gathered ``records.json``), so the two always agree.  Every headline ends with the lab's
share of unstable timings; a figure whose timing was unstable says so.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
from IPython.display import display

from lab_utils.core.records import Recorder, fill_stability, stability_summary


@dataclass(frozen=True)
class Figure:
    """One headline figure: what it is, its value with its unit, and a short qualifier."""

    label: str
    value: str
    note: str = ""

    def __str__(self) -> str:
        return f"{self.label}: {self.value}" + (f" ({self.note})" if self.note else "")


Headline = Callable[[pd.DataFrame], list[Figure]]
HEADLINES: dict[str, Headline] = {}


def register(lab: str) -> Callable[[Headline], Headline]:
    """Decorator: ``fn`` gives ``lab``'s headline figures from its records (a DataFrame)."""

    def deco(fn: Headline) -> Headline:
        HEADLINES[lab] = fn
        return fn

    return deco


def frame_of(records) -> pd.DataFrame:
    """Rows of a :class:`Recorder` or a records DataFrame, stability filled from kept samples."""
    df = records.frame() if isinstance(records, Recorder) else records
    return fill_stability(df) if len(df) else df


#: A variant keyed by a step's identity (``Recorder.scope``): "<package.module:function>/<module.Class> · <variant>".
SCOPED = re.compile(r"^[\w.]+:\w+/[\w.]+(?: · |$)")


def unscoped(variant) -> str:
    """A row's variant without the step identity key a non-default step's rows start with."""
    return SCOPED.sub("", str(variant))


def rows(df: pd.DataFrame, **eq) -> pd.DataFrame:
    """The rows whose columns equal the given values (a missing column matches nothing); a
    variant is compared without the step identity key (:func:`unscoped`)."""
    m = pd.Series(True, index=df.index)
    for k, v in eq.items():
        if k not in df.columns:
            return df.iloc[0:0]
        col = df[k].map(unscoped) if k == "variant" else df[k].astype(str)
        m &= col == str(v)
    return df[m & pd.to_numeric(df["value"], errors="coerce").notna()]


def fmt(v: float, unit: str = "", digits: int = 3) -> str:
    """A value with its unit, to ``digits`` significant digits."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    v = float(v)
    text = f"{v:,.0f}" if abs(v) >= 10**digits else f"{v:.{digits}g}"  # 7,170 ms, not 7.17e+03 ms
    return text + (f" {unit}" if unit else "")


def fmt_bytes(n: float, digits: int = 3) -> str:
    """A size in MiB below 1 GiB, in GiB from there (binary units, as allocators count)."""
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "n/a"
    return fmt(n / 2**30, "GiB", digits) if abs(n) >= 2**30 else fmt(n / 2**20, "MiB", digits)


def verdict(r) -> str:
    """'' for a stable or unjudged figure, 'UNSTABLE' for one whose timing was unstable (a
    Python or a numpy False: a records column with a verdict on every row is of dtype bool)."""
    s = r.get("stable")
    return "UNSTABLE" if s is not None and not pd.isna(s) and not s else ""


def unstable_figure(df: pd.DataFrame) -> Figure:
    s = stability_summary(df)
    if not s.timings:
        return Figure("unstable timings", "none judged")
    return Figure("unstable timings", f"{s.unstable} of {s.timings} ({s.share:.0%})")


def headline(lab: str, records) -> list[Figure]:
    """``lab``'s headline figures from ``records`` (a Recorder, or rows of one or many labs)."""
    df = frame_of(records)
    if len(df):
        col = "notebook" if "notebook" in df.columns and df["notebook"].notna().any() else "lab"
        df = df[df[col].astype(str) == lab]
    fn = HEADLINES.get(lab)
    figs = list(fn(df)) if fn is not None and len(df) else []
    return [*figs, unstable_figure(df)]


def headlines(df: pd.DataFrame, labs) -> dict[str, list[Figure]]:
    """Each lab's headline from a report's gathered records; a lab whose headline cannot be
    built says why instead of failing the index."""
    out = {}
    for lab in labs:
        try:
            out[lab] = headline(lab, df)
        except Exception as e:  # noqa: BLE001 - one lab's odd records must not cost the index
            out[lab] = [Figure("headline", "not available", f"{type(e).__name__}: {e}")]
    return out


def figures_html(figs: list[Figure]) -> str:
    """Figures as one line of HTML (``label: <b>value</b> (note)``, separated by ' · ')."""
    return " · ".join(
        f"{html.escape(f.label)}: <b>{html.escape(f.value)}</b>"
        + (f' <span class="muted">({html.escape(f.note)})</span>' if f.note else "")
        for f in figs
    )


@dataclass(frozen=True)
class Takeaway:
    """A lab's takeaway cell: markdown-like text in a terminal, a small HTML box in a notebook."""

    lab: str
    figures: tuple

    def __str__(self) -> str:
        return "Takeaway: " + ("; ".join(str(f) for f in self.figures) or PENDING)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        if not self.figures:
            return f'<p class="perflab-takeaway"><i>{html.escape(PENDING)}</i></p>'
        items = "".join(
            f"<li>{html.escape(f.label)}: <b>{html.escape(f.value)}</b>"
            + (f" <i>({html.escape(f.note)})</i>" if f.note else "")
            + "</li>"
            for f in self.figures
        )
        return (
            '<div class="perflab-takeaway" style="border-left:4px solid #1f77b4;padding:4px 12px;margin:6px 0">'
            f"<b>Takeaway</b><ul style='margin:4px 0'>{items}</ul></div>"
        )


PENDING = "the takeaway fills in here when the lab has run (its last cell)"


class Board:
    """The takeaway near the top of a lab: shown empty when the lab starts, filled from the
    lab's records by :meth:`update` in its last cell (a display that is updated in place, so the
    executed notebook and its HTML report open with the answer)."""

    def __init__(self, lab: str):
        self.lab = lab
        self.handle = display(Takeaway(lab, ()), display_id=True)

    def update(self, records: Recorder) -> None:
        """Fill the takeaway shown near the top with the lab's records (returns nothing, so the
        last cell does not show it a second time)."""
        t = takeaway(records, self.lab)
        if self.handle is not None:
            self.handle.update(t)


def board(lab: str) -> Board:
    """Show ``lab``'s (still empty) takeaway; its last cell calls ``.update(rec)``."""
    return Board(lab)


def takeaway(records: Recorder, lab: str | None = None) -> Takeaway:
    """A lab's takeaway cell from its records so far (``lab``: the recorder's by default)."""
    lab = lab or records.lab
    return Takeaway(lab, tuple(headline(lab, records)))


__all__ = [
    "HEADLINES",
    "Board",
    "board",
    "Figure",
    "Takeaway",
    "figures_html",
    "fmt",
    "fmt_bytes",
    "frame_of",
    "headline",
    "headlines",
    "register",
    "rows",
    "takeaway",
    "unscoped",
    "unstable_figure",
    "verdict",
]
