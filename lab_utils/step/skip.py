"""Sections of a lab that measure perflab's MMDiT only (a formula, a projection, the MMDiT's own
policies): on another step (``step`` not the default) they are skipped, each with one line saying
why, instead of run.  A skipped function returns a :class:`Skipped`, which the lab's cells print,
display, index or plot unchanged."""

from __future__ import annotations

import functools
from collections.abc import Callable

from lab_utils.step.load import DEFAULT_STEP


class Skipped:
    """What a default-step-only function returns on another step: one line saying why.  Printed
    (``to_string``), displayed, indexed or given to a table or plot, it stays that line; it has
    no rows (``len`` 0)."""

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return self.reason

    def to_string(self, *args, **kwargs) -> str:
        return self.reason

    def __getitem__(self, key) -> Skipped:
        return self

    def __len__(self) -> int:
        return 0


def skipped(spec: str, why: str) -> Skipped | None:
    """None on the default step (perflab's MMDiT); else the line naming ``why`` and the step."""
    if spec == DEFAULT_STEP:
        return None
    return Skipped(f"skipped: {why}; this run measures {spec} through the step contract (section 'Your step')")


def default_step_only(why: str) -> Callable:
    """A decorator: ``fn(cfg, ...)`` runs when ``cfg.step`` is the default step; on another it
    returns :func:`skipped` (``why``: the reason, e.g. "the formula ... are MMDiT-only")."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(cfg, *args, **kwargs):
            skip = skipped(cfg.step, why)
            return skip if skip is not None else fn(cfg, *args, **kwargs)

        return run

    return wrap


def passes_skipped(fn: Callable) -> Callable:
    """A table or plot of a default-step-only result: a :class:`Skipped` one is passed through."""

    @functools.wraps(fn)
    def run(df, *args, **kwargs):
        return df if isinstance(df, Skipped) else fn(df, *args, **kwargs)

    return run
