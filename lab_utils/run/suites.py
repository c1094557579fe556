"""Suites, parameter sets and overrides: what ``perflab run`` checks before anything heavy.

A suite (``parameterized/<suite>.yaml``) lists entries, each a notebook and a parameter set
(``set: smoke`` -> ``parameterized/sets/<notebook-stem>/smoke.yaml``) plus optional inline
``params``; ``--param key=value`` overrides apply to every notebook that has that parameter.

This module reads them with YAML, JSON and ``ast`` only (no papermill, nbformat or torch), so
a bad suite name, a malformed ``--param`` or a parameter no notebook of the suite has is refused
at once: :func:`check_overrides` reads each notebook's ``parameters`` cell and its config class's
renamed parameters from the source, never importing the lab.  The runner (``lab_utils.run.runner``)
then validates the values against each lab's config class, which imports the lab.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]  # the repository: lab_utils/run/suites.py -> ../../..
#: the config class every lab's config derives from, where the renamed-parameter tables start
BASE_CONFIG = ("lab_utils.core.config", "LabConfig")


class SuiteError(ValueError):
    """A suite, notebook or parameter that cannot be run; raised before anything runs."""


def params_dir() -> Path:
    return Path(os.environ.get("PERFLAB_PARAMETERIZED", ROOT / "parameterized"))


@dataclass(frozen=True)
class Entry:
    notebook: Path
    set: str | None
    params: dict
    name: str = ""  # the suite item's ``name``: a notebook run twice in one suite needs one

    @property
    def stem(self) -> str:
        """What the run's outputs are named by: the item's ``name``, else the notebook's stem."""
        return self.name or self.notebook.stem


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    entries: tuple[Entry, ...]
    path: Path


def list_suites() -> list[str]:
    return sorted(p.stem for p in params_dir().glob("*.yaml"))


def load_suite(name: str | Path) -> Suite:
    """Load ``parameterized/<name>.yaml`` (or a path to a suite file)."""
    path = Path(name)
    if not (path.suffix in (".yaml", ".yml") and path.exists()):
        path = params_dir() / f"{name}.yaml"
    if not path.exists():
        raise SuiteError(f"suite {str(name)!r} does not exist; known suites: {', '.join(list_suites()) or 'none'}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get("notebooks"), list) or not data["notebooks"]:
        raise SuiteError(f"suite file {path} must be a mapping with a non-empty list 'notebooks'")
    entries = []
    for i, item in enumerate(data["notebooks"]):
        if isinstance(item, str):
            item = {"notebook": item}
        if not isinstance(item, dict) or "notebook" not in item:
            raise SuiteError(f"{path}: notebooks[{i}] must be a mapping with a 'notebook' key")
        nb = (ROOT / item["notebook"]) if not Path(item["notebook"]).is_absolute() else Path(item["notebook"])
        if not nb.is_absolute():
            nb = (path.parent / item["notebook"]).resolve()
        if not nb.exists() and (path.parent / item["notebook"]).exists():
            nb = (path.parent / item["notebook"]).resolve()
        if not nb.exists():
            raise SuiteError(f"{path}: notebooks[{i}]: notebook {item['notebook']!r} does not exist")
        params: dict = {}
        set_name = item.get("set")
        if set_name:
            set_path = params_dir() / "sets" / nb.stem / f"{set_name}.yaml"
            if not set_path.exists():
                sets = sorted(p.stem for p in (params_dir() / "sets" / nb.stem).glob("*.yaml"))
                raise SuiteError(
                    f"{path}: notebooks[{i}]: parameter set {set_name!r} for {nb.stem} does not exist "
                    f"(looked for {set_path}); known sets: {', '.join(sets) or 'none'}"
                )
            params.update(yaml.safe_load(set_path.read_text()) or {})
        params.update(item.get("params") or {})
        entry = Entry(nb, set_name, params, str(item.get("name") or ""))
        if any(e.stem == entry.stem for e in entries):
            raise SuiteError(f"{path}: notebooks[{i}]: {entry.stem!r} runs twice; give one a distinct 'name'")
        entries.append(entry)
    return Suite(name=path.stem, description=str(data.get("description", "")), entries=tuple(entries), path=path)


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["dtype=bfloat16", "sizes=[256, 512]"]`` -> values parsed as YAML scalars/lists."""
    out: dict[str, Any] = {}
    for it in items or []:
        if "=" not in it:
            raise SuiteError(f"--param {it!r} is not of the form key=value")
        k, v = it.split("=", 1)
        k = k.strip()
        if not k.isidentifier():
            raise SuiteError(f"--param {it!r}: {k!r} is not a parameter name")
        try:
            out[k] = yaml.safe_load(v)
        except yaml.YAMLError as e:
            raise SuiteError(f"--param {it!r}: value does not parse: {e}") from None
    return out


def _notebook(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SuiteError(f"notebook {path} cannot be read as a notebook: {e}") from None


def _tags(cell: dict) -> list:
    return list((cell.get("metadata") or {}).get("tags") or [])


def notebook_parameters(path: Path) -> dict[str, Any]:
    """The defaults of a notebook's ``parameters`` cell (the first cell tagged so, where papermill
    injects), as Python values: one top-level assignment per parameter; a value that is no
    literal is kept as its source text."""
    nb = _notebook(path)
    cell = next((c for c in nb.get("cells", []) if c.get("cell_type") == "code" and "parameters" in _tags(c)), None)
    if cell is None:
        raise SuiteError(f"notebook {Path(path).name} has no cell tagged 'parameters'")
    src = cell.get("source", "")
    src = "".join(src) if isinstance(src, list) else str(src)
    try:
        tree = ast.parse(src)
    except SyntaxError as e:
        raise SuiteError(f"notebook {Path(path).name}: its parameters cell does not parse: {e}") from None
    out: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            name, value = node.target.id, node.value
        else:
            continue
        try:
            out[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError):
            out[name] = ast.get_source_segment(src, value)
    return out


def notebook_config_spec(path: Path) -> str | None:
    """The ``module:Class`` of the lab's config that the notebook's metadata names (``perflab.config``)."""
    return ((_notebook(path).get("metadata") or {}).get("perflab") or {}).get("config") or None


def notebook_config_class(path: Path):
    """The lab's config class, imported (which imports the lab's study module)."""
    spec = notebook_config_spec(path)
    if not spec:
        return None
    mod, _, cls = spec.partition(":")
    return getattr(importlib.import_module(mod), cls)


def _module_file(module: str) -> Path | None:
    """Where ``module``'s source is, found without importing it or its packages (only the
    top-level package is located)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return Path(spec.origin) if spec is not None and spec.origin and not rest else None
    base = Path(next(iter(spec.submodule_search_locations)))
    for cand in (base.joinpath(*rest).with_suffix(".py"), base.joinpath(*rest, "__init__.py")):
        if rest and cand.is_file():
            return cand
    return None


def static_renamed(module: str, cls: str, _depth: int = 0) -> dict[str, str] | None:
    """The ``RENAMED`` table (old name -> new) of config class ``module:cls`` read from the
    source: the class's own literal, else its base's (followed through ``from X import Base``),
    ``{}`` at :data:`BASE_CONFIG`.  None where the source does not say it plainly (a computed
    table, several bases, a base defined elsewhere): then only importing the class tells."""
    if (module, cls) == BASE_CONFIG:
        return {}
    path = _module_file(module)
    if path is None or _depth > 10:
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {
        a.asname or a.name: (n.module, a.name)
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module
        for a in n.names
    }
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:
        return static_renamed(*imported[cls], _depth + 1) if cls in imported else None
    for stmt in node.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
        target = stmt.target if isinstance(stmt, ast.AnnAssign) else target
        if isinstance(target, ast.Name) and target.id == "RENAMED":
            try:
                table = ast.literal_eval(stmt.value)
            except (ValueError, SyntaxError, TypeError):
                return None
            return dict(table) if isinstance(table, dict) else None
    if len(node.bases) != 1 or not isinstance(node.bases[0], ast.Name):
        return None
    base = node.bases[0].id
    return static_renamed(*imported.get(base, (module, base)), _depth + 1)


def check_overrides(suite: Suite, overrides: dict[str, Any], only: list[str] | None = None) -> None:
    """Refuse, before anything is imported, an ``--only`` that is not a notebook of ``suite`` and an
    override that no notebook of it has (under its name or a former name its config renamed).
    Values are checked later, by each lab's config class (``runner.plan``)."""
    entries = list(suite.entries)
    if only:
        stems = {e.stem for e in entries}
        for o in only:
            if o not in stems:
                raise SuiteError(f"--only {o!r} is not a notebook of suite {suite.name}: {', '.join(sorted(stems))}")
        entries = [e for e in entries if e.stem in only]
    known: set[str] = set()
    for e in entries:
        known.update(notebook_parameters(e.notebook))
        spec = notebook_config_spec(e.notebook)
        if spec:
            renamed = static_renamed(*spec.partition(":")[::2])
            if renamed is None:
                return  # only the config class knows its former names: the runner checks
            known.update(renamed)
    unused = [k for k in overrides if k not in known]
    if unused:
        raise SuiteError(f"--param {', '.join(unused)}: no notebook of suite {suite.name} has such a parameter")
