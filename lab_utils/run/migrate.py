"""Renamed parameters in stored runs and baselines: old names -> the names the labs use now.

A lab's config lists its renamed parameters (``RENAMED = {old: new}`` on its
:class:`~lab_utils.core.config.LabConfig`); the notebooks, YAML sets and ``perflab run
--param`` accept an old name for one release.  A run stored before the rename keeps the old
names in its ``context.json`` (``notebooks[].params``), so a check against it would report the
parameter as changed.  :func:`migrate_context` renames them from the same ``RENAMED`` tables;
``perflab baseline`` applies it when it stores a baseline and when it reads one
(``perflab baseline migrate`` rewrites a stored baseline's ``context.json`` once).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lab_utils.run.suites import ROOT, notebook_config_class


def renamed_params(notebook: str, labs: Path | None = None) -> dict[str, str]:
    """``{old: new}`` of the lab ``notebook`` (a stem like ``05_memory``); {} for an unknown lab."""
    path = (labs or ROOT / "labs") / f"{notebook}.ipynb"
    if not path.exists():
        return {}
    cls = notebook_config_class(path)
    return dict(getattr(cls, "RENAMED", None) or {})


def migrate_params(notebook: str, params: dict[str, Any], labs: Path | None = None) -> tuple[dict, list[str]]:
    """``params`` under the lab's current names, and one line per renamed key ("old -> new")."""
    ren = renamed_params(notebook, labs)
    out, done = {}, []
    for k, v in params.items():
        new = ren.get(k)
        if new is None:
            out.setdefault(k, v)
            continue
        out[new] = v  # the old name's value: a run that has it never had the new one
        done.append(f"{notebook}: {k} -> {new}")
    return out, done


def migrate_context(ctx: dict[str, Any], labs: Path | None = None) -> tuple[dict[str, Any], list[str]]:
    """A run's ``context.json`` with every notebook's parameters under their current names."""
    nbs = ctx.get("notebooks")
    if not isinstance(nbs, list):
        return ctx, []
    out, done = dict(ctx), []
    out["notebooks"] = []
    for n in nbs:
        if isinstance(n, dict) and n.get("notebook") and isinstance(n.get("params"), dict):
            params, d = migrate_params(str(n["notebook"]), n["params"], labs)
            n = {**n, "params": params}
            done += d
        out["notebooks"].append(n)
    return out, done


def migrate_baseline(folder: Path, labs: Path | None = None) -> list[str]:
    """Rewrite ``folder/context.json`` (a stored baseline) under the current names; the renames done."""
    path = Path(folder) / "context.json"
    ctx = json.loads(path.read_text())
    new, done = migrate_context(ctx, labs)
    if done:
        path.write_text(json.dumps(new, indent=1, default=str) + "\n")
    return done
