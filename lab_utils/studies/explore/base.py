"""The machinery every lab's explorer shares: controls, on-demand measurement, cache, records.

Design note
-----------
An :class:`Explorer` is a set of :class:`Control` s (one ipywidget each), a
``measure(config, progress)`` that runs the lab's own library calls for one
configuration, and ``figures(results)`` that draw every result so far (plots read the
results' rows; they never measure).

* ``run(**changes)`` is the one entry point, used by the widgets, by tests and by a
  headless run alike: it validates the configuration (a bad value raises
  :class:`~lab_utils.core.config.ConfigError` naming the control), returns the cached result
  of an identical configuration at once, asks ``why_not`` whether this configuration
  can run here (a reason is shown, cached and returned instead of a failure), and
  otherwise measures, keeps the result and writes its rows to the lab's
  :class:`~lab_utils.core.records.Recorder`, whose file is rewritten at once (``keep``: in a
  live kernel, or once the lab has saved), so an afternoon of exploration is on disk as it is
  measured, and ``perflab compare`` can read it like a papermill run.
* Live (an IPython kernel with a front end; not ``perflab run``): ``show()`` displays
  the controls, a status line, a progress bar with a Stop button, the table and the
  plots (``DynamicMap`` s fed by a ``Pipe``).  A changed control measures in a worker
  thread, so the kernel stays free to take the Stop click; Stop is honoured at the
  measurement's next checkpoint (``Progress``).  Changes made while a measurement runs
  are queued: the latest one runs next.
* Headless (``perflab run``/papermill sets ``PERFLAB_RUN_ID``; or no IPython at all):
  ``show()`` measures the default configuration and displays a static figure, the
  table and one line saying the explorer is live in JupyterLab.
"""

from __future__ import annotations

import html
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import holoviews as hv
import ipywidgets as W
import pandas as pd
from IPython import get_ipython
from IPython.display import HTML, display

from lab_utils.core.config import ConfigError
from lab_utils.core.plots import init
from lab_utils.core.records import Recorder

LIVE_NOTE = (
    "Live in JupyterLab: run this cell in a kernel, change a control and each new configuration is "
    "measured on demand and added beside the earlier ones. This static figure shows the default "
    "configuration only."
)


class Unavailable(Exception):
    """This configuration cannot run here; ``reason`` says why in words."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Interrupted(Exception):
    """The user pressed Stop; the measurement ended at a checkpoint."""


def is_live() -> bool:
    """True in an IPython kernel that is not a headless ``perflab run`` (papermill)."""
    if os.environ.get("PERFLAB_RUN_ID"):
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def explored_scatter(data, kdim: str, vdims: list[str], *, color="label", cmap="Category20", size=11, **opts):
    """A scatter of the explored results: one colour per run, named on hover (no legend: the table names the runs)."""
    return hv.Scatter(data, kdim, vdims).opts(
        color=color, cmap=cmap, size=size, tools=["hover"], show_legend=False, **opts
    )


@dataclass(frozen=True)
class Control:
    """One parameter of an explorer: a dropdown of ``options`` or, for a bool default, a checkbox."""

    name: str
    options: tuple = ()
    default: Any = None
    label: str = ""

    def check(self, value: Any) -> Any:
        if isinstance(self.default, bool):
            if not isinstance(value, bool):
                raise ConfigError(self.name, value, "True or False")
            return value
        if value not in self.options:
            raise ConfigError(self.name, value, "one of " + ", ".join(repr(o) for o in self.options))
        return value

    def widget(self, value: Any) -> W.ValueWidget:
        desc = self.label or self.name
        style = {"description_width": "initial"}
        if isinstance(self.default, bool):
            return W.Checkbox(value=value, description=desc, indent=False, style=style)
        return W.Dropdown(
            options=[(str(o), o) for o in self.options],
            value=value,
            description=desc,
            style=style,
            layout={"width": "auto"},
        )


class Progress:
    """Passed to ``measure``: ``progress(done, total, what)`` reports and is a checkpoint
    where Stop ends the measurement (:class:`Interrupted`); ``progress.iter`` wraps a loop."""

    def __init__(self, stop: threading.Event | None = None, bar: W.IntProgress | None = None, label=None):
        self.stop = stop or threading.Event()
        self.bar, self.label = bar, label

    def __call__(self, done: int, total: int, what: str = "") -> None:
        if self.stop.is_set():
            raise Interrupted(f"stopped before {what or 'the next step'}")
        if self.bar is not None:
            self.bar.max = max(1, int(total))
            self.bar.value = min(int(done), self.bar.max)
        if self.label is not None and what:
            self.label.value = html.escape(f"{what} ({done}/{total})")

    def iter(self, items: Sequence, what: str = "") -> Iterator:
        n = len(items)
        for i, it in enumerate(items):
            self(i, n, f"{what} {it}".strip())
            yield it
        self(n, n, what)


@dataclass
class Result:
    """One measured configuration: ``row`` (the table's columns) and ``data`` (what its
    figures draw, e.g. a histogram or phase times)."""

    index: int
    config: dict
    row: dict
    data: Any = None
    seconds: float = 0.0


@dataclass
class Outcome:
    """What ``run`` did: a result (new or cached), or the reason the configuration cannot run."""

    result: Result | None
    reason: str = ""
    cached: bool = False
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return self.result is not None


def _key(cfg: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in cfg.items()))


@dataclass
class Explorer:
    """Subclasses set ``lab``, ``title``, ``controls`` and implement ``measure`` and
    ``figures`` (and ``why_not`` when some configurations cannot run here)."""

    rec: Recorder | None = None
    defaults: dict = field(default_factory=dict)
    lab: ClassVar[str] = ""
    title: ClassVar[str] = ""
    controls: ClassVar[tuple[Control, ...]] = ()
    live_help: ClassVar[str] = ""  # one line under the title: what a change measures

    def __post_init__(self):
        if self.rec is None:
            self.rec = Recorder(lab=self.lab)
        known = {c.name for c in self.controls}
        for k in self.defaults:
            if k not in known:
                raise ConfigError(k, self.defaults[k], "a control of this explorer: " + ", ".join(sorted(known)))
        self.config = self.validate({c.name: self.defaults.get(c.name, c.default) for c in self.controls})
        self.results: list[Result] = []
        self.cache: dict[tuple, Outcome] = {}
        self.status = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pending: dict | None = None
        self._worker: threading.Thread | None = None
        self._ui: dict[str, Any] = {}

    # ---------------------------------------------------------------- subclass hooks
    def why_not(self, cfg: dict) -> str | None:
        """A reason this configuration cannot run here (checked before measuring), or None."""
        return None

    def measure(self, cfg: dict, progress: Progress) -> Result:
        raise NotImplementedError

    def figures(self, results: list[Result]) -> list:
        """One holoviews element/overlay per figure; the same kinds whatever the results."""
        raise NotImplementedError

    def label(self, cfg: dict) -> str:
        """A short name of a configuration (variant of its records, x axis of its bars)."""
        return " ".join(f"{v}" if not isinstance(v, bool) else f"{k}={int(v)}" for k, v in cfg.items())

    # ---------------------------------------------------------------- the engine
    def validate(self, cfg: dict) -> dict:
        by_name = {c.name: c for c in self.controls}
        out = {}
        for k, v in cfg.items():
            if k not in by_name:
                raise ConfigError(k, v, "a control of this explorer: " + ", ".join(by_name))
            out[k] = by_name[k].check(v)
        return out

    def run(self, progress: Progress | None = None, **changes) -> Outcome:
        """Measure the current configuration with ``changes`` applied (cached when seen before)."""
        cfg = self.validate({**self.config, **changes})
        self.config = cfg
        key = _key(cfg)
        if key in self.cache:
            out = self.cache[key]
            self.status = (
                f"cannot run: {out.reason}"
                if not out.ok
                else f"cached: #{out.result.index} {self.label(cfg)} (measured in {out.result.seconds:.2f} s)"
            )
            return Outcome(out.result, out.reason, cached=True)
        reason = self.why_not(cfg)
        if reason is None:
            t0 = time.perf_counter()
            try:
                res = self.measure(cfg, progress or Progress(self._stop))
            except Unavailable as e:
                reason = e.reason
            except Interrupted as e:
                self.status = f"interrupted: {e}"
                return Outcome(None, str(e), interrupted=True)
            else:
                with self._lock:
                    res.index = len(self.results) + 1
                    res.config = dict(cfg)
                    res.seconds = time.perf_counter() - t0
                    self.results.append(res)
                self.cache[key] = Outcome(res)
                self.status = f"measured #{res.index} {self.label(cfg)} in {res.seconds:.2f} s" + self.keep()
                return Outcome(res)
        self.cache[key] = Outcome(None, reason)
        self.status = f"cannot run: {reason}"
        return Outcome(None, reason)

    def keep(self) -> str:
        """Write the records so far to the recorder's file as soon as a result is measured, once the
        recorder has a file (the lab saved before its explorer) or in a live kernel; a Run All's
        save cell rewrites the same file (``Recorder.save``).  Returns the status's suffix."""
        if self.rec.path is None and not is_live():
            return ""
        try:
            return f"; saved to {self.rec.save()}"
        except OSError as e:
            return f"; NOT saved ({type(e).__name__}: {e})"

    def table(self) -> pd.DataFrame:
        """One row per measured configuration, in the order they were measured."""
        rows = [{"#": r.index, **r.row} for r in self.results]
        return pd.DataFrame(rows)

    def figure(self):
        """The static figure of every result so far (what a headless report shows)."""
        init()
        figs = self.figures(list(self.results))
        return figs[0] if len(figs) == 1 else hv.Layout(figs).cols(1)

    # ---------------------------------------------------------------- display
    def show(self, live: bool | None = None):
        """Measure the current configuration, then display the live explorer (JupyterLab)
        or, headless, the static figure with a line saying it is live in JupyterLab."""
        init()
        live = is_live() if live is None else live
        if not self.results:
            self.run()
        if not live:
            for obj in self.static():
                display(obj)
            return None
        display(self.widget())
        display(self.live_figure())
        return None

    def static(self) -> list:
        """What a headless run displays: the note, the reason when the configuration cannot
        run, the table and the static figure."""
        if not self.results and not self.status:
            self.run()
        out = [HTML(f'<p class="perflab-explore-note"><b>{html.escape(self.title)}.</b> {LIVE_NOTE}</p>')]
        if self.status.startswith("cannot run"):
            out.append(HTML(f"<p>{html.escape(self.status)}</p>"))
        return [*out, self.table(), self.figure()]

    def widget(self) -> W.VBox:
        ui = self._ui
        ui["controls"] = {c.name: c.widget(self.config[c.name]) for c in self.controls}
        for w in ui["controls"].values():
            w.observe(self._on_change, names="value")
        ui["status"] = W.HTML(self._status_html(), layout={"width": "100%"})
        ui["status"].add_class("perflab-explore-status")
        ui["bar"] = W.IntProgress(value=0, min=0, max=1, description="", layout={"width": "260px"})
        ui["step"] = W.HTML("")
        ui["stop"] = W.Button(description="Stop", icon="stop", disabled=True, layout={"width": "80px"})
        ui["stop"].on_click(lambda _: self._stop.set())
        ui["table"] = W.HTML(self._table_html())
        ui["table"].add_class("perflab-explore-table")
        head = W.HTML(
            f"<b>{html.escape(self.title)}</b>"
            + (f" <span style='color:#555'>{html.escape(self.live_help)}</span>" if self.live_help else "")
        )
        box = W.VBox(
            [
                head,
                W.HBox(list(ui["controls"].values()), layout={"flex_flow": "row wrap"}),
                W.HBox([ui["bar"], ui["stop"], ui["step"]]),
                ui["status"],
                ui["table"],
            ]
        )
        box.add_class("perflab-explorer")
        return box

    def live_figure(self):
        """DynamicMaps that redraw from the results each time a measurement lands."""
        self._pipe = hv.streams.Pipe(data=list(self.results))
        n = len(self.figures(list(self.results)))
        maps = [hv.DynamicMap(lambda data, i=i: self.figures(data)[i], streams=[self._pipe]) for i in range(n)]
        return maps[0] if n == 1 else hv.Layout(maps).cols(1)

    def _status_html(self) -> str:
        s = html.escape(self.status)
        if self.status.startswith("cannot run"):
            return f'<span class="perflab-explore-reason" style="color:#b00">{s}</span>'
        if self.status.startswith(("failed", "interrupted")):
            return f'<span class="perflab-explore-error" style="color:#b00">{s}</span>'
        return f"<span>{s}</span>"

    def _table_html(self) -> str:
        t = self.table()
        if not len(t):
            return "<i>no measurement yet</i>"
        style = (
            "<style>.perflab-explore-rows td, .perflab-explore-rows th {padding: 1px 8px; text-align: right}</style>"
        )
        rows = t.to_html(index=False, float_format=lambda v: f"{v:.4g}", border=0, classes="perflab-explore-rows")
        return style + rows

    def _on_change(self, _change) -> None:
        cfg = {name: w.value for name, w in self._ui["controls"].items()}
        with self._lock:
            self._pending = cfg
            busy = self._worker is not None and self._worker.is_alive()
            if not busy:
                self._worker = threading.Thread(target=self._work, daemon=True, name=f"explore-{self.lab}")
                self._worker.start()

    def _work(self) -> None:
        ui = self._ui
        while True:
            with self._lock:
                cfg, self._pending = self._pending, None
                if cfg is None:
                    self._worker = None
                    return
            self._stop.clear()
            ui["stop"].disabled = False
            ui["status"].value = f"<span>measuring {html.escape(self.label(cfg))} ...</span>"
            try:
                out = self.run(Progress(self._stop, ui["bar"], ui["step"]), **cfg)
            except Exception as e:  # noqa: BLE001 - shown in the widget; the kernel stays usable
                self.status = f"failed: {type(e).__name__}: {e}"
                out = None
            ui["stop"].disabled = True
            ui["step"].value = ""
            ui["status"].value = self._status_html()
            if out is not None and out.ok and not out.cached:
                ui["table"].value = self._table_html()
                self._pipe.send(list(self.results))
