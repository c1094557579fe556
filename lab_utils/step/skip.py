"""Sections of a lab that measure perflab's MMDiT only (a formula, a projection, the MMDiT's own
policies, its trainer's profile, its own training loop): on another step (``step`` not the
default) they are skipped, each with one line saying why, instead of run.  A skipped function
returns a :class:`Skipped`, which the lab's cells print, display, join, index, compose or plot
unchanged: every such use gives back the same line."""

from __future__ import annotations

import functools
from collections.abc import Callable

from lab_utils.step.load import DEFAULT_STEP


class Skipped:
    """What a default-step-only function returns on another step: one line saying why.  Printed
    (``str``, ``to_string``), displayed, joined (it iterates as that one line), indexed, composed
    (``+``, ``*``), called or asked for a public attribute (``res.base.stability``, ``.round(3)``,
    ``.cols(1)``), it stays that line; it has no rows (``len`` 0).  Private and dunder names are
    not answered, so IPython, pickle and copy see a plain object."""

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return self.reason

    __str__ = __repr__

    def to_string(self, *args, **kwargs) -> str:
        return self.reason

    def __getitem__(self, key) -> Skipped:
        return self

    def __len__(self) -> int:
        return 0

    def __iter__(self):
        return iter((self.reason,))  # "\n".join(lines) of a skipped section prints its reason

    def __call__(self, *args, **kwargs) -> Skipped:
        return self

    def __add__(self, other) -> Skipped:
        return self

    __radd__ = __mul__ = __rmul__ = __add__

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return self


def skipped(spec: str, why: str) -> Skipped | None:
    """None on the default step (perflab's MMDiT); else the line naming ``why`` and the step."""
    if spec == DEFAULT_STEP:
        return None
    return Skipped(f"skipped: {why}; this run measures {spec} through the step contract (section 'Your step')")


def default_step_only(why: str, arg: int = 0) -> Callable:
    """A decorator: ``fn(cfg, ...)`` runs when ``cfg.step`` is the default step; on another it
    returns :func:`skipped` (``why``: the reason, e.g. "the formula ... are MMDiT-only").
    ``arg``: the position of the lab's config (1 under a classmethod's ``cls``); a call without
    it (``cfg`` absent or None: a test, another study) runs."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            cfg = args[arg] if len(args) > arg else kwargs.get("cfg")
            skip = skipped(cfg.step, why) if cfg is not None else None
            return skip if skip is not None else fn(*args, **kwargs)

        return run

    return wrap


def passes_skipped(fn: Callable) -> Callable:
    """A table, plot, check or record helper of default-step-only results: given a
    :class:`Skipped` (in any argument) it returns that one, without running."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        skip = next((a for a in (*args, *kwargs.values()) if isinstance(a, Skipped)), None)
        return skip if skip is not None else fn(*args, **kwargs)

    return run


def hand_on_skipped(namespace: dict, names: str) -> None:
    """Wrap each function of a module's ``namespace`` (its ``globals()``) that ``names`` names
    (space-separated) with :func:`passes_skipped`: a lab whose tables and plots all read its
    default-step-only results, listed in one place."""
    for name in names.split():
        namespace[name] = passes_skipped(namespace[name])


def default_step_only_in(namespace: dict, why: str, names: str) -> None:
    """:func:`default_step_only` (``why``) applied to each function of a module's ``namespace``
    that ``names`` names (space-separated): a lab's sections listed in one place."""
    for name in names.split():
        namespace[name] = default_step_only(why)(namespace[name])
