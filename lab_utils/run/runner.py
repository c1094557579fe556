"""Headless runs: a suite of parameterized notebooks -> one self-contained report.

A suite (``parameterized/<suite>.yaml``) lists entries, each a notebook and a
parameter set (``set: smoke`` -> ``parameterized/sets/<notebook-stem>/smoke.yaml``)
plus optional inline ``params``.  ``--param key=value`` overrides apply to every
notebook that has that parameter.

Everything is validated before anything runs: the suite exists, every parameter is
one the notebook declares in its ``parameters`` cell, and the lab's config class
(notebook metadata ``perflab.config``) accepts the values.  Notebooks then run one
after another with papermill; a failing notebook is recorded (status, error) and the
suite goes on; the command exits non-zero if any failed.  The report is written to
``reports/.tmp-<run-id>/`` and renamed to ``reports/<run-id>/`` only when complete.
"""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


class SuiteError(ValueError):
    """A suite, notebook or parameter that cannot be run; raised before anything runs."""


def params_dir() -> Path:
    return Path(os.environ.get("PERFLAB_PARAMETERIZED", ROOT / "parameterized"))


@dataclass(frozen=True)
class Entry:
    notebook: Path
    set: str | None
    params: dict

    @property
    def stem(self) -> str:
        return self.notebook.stem


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
        entries.append(Entry(nb, set_name, params))
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


def notebook_parameters(path: Path) -> dict[str, Any]:
    """The defaults of a notebook's ``parameters`` cell, as Python values."""
    import papermill

    info = papermill.inspect_notebook(str(path))
    if not info:
        raise SuiteError(f"notebook {path.name} has no cell tagged 'parameters'")
    out = {}
    for name, p in info.items():
        try:
            out[name] = ast.literal_eval(p["default"])
        except (ValueError, SyntaxError):
            out[name] = p["default"]
    return out


def notebook_config_class(path: Path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    spec = nb.metadata.get("perflab", {}).get("config")
    if not spec:
        return None
    mod, _, cls = spec.partition(":")
    return getattr(importlib.import_module(mod), cls)


@dataclass
class Planned:
    entry: Entry
    params: dict  # only the values that differ from/override the notebook's defaults
    resolved: dict  # defaults + params (what the notebook will see)


def plan(suite: Suite, overrides: dict | None = None, only: list[str] | None = None) -> list[Planned]:
    """Validate the whole suite before anything runs."""
    overrides = overrides or {}
    entries = list(suite.entries)
    if only:
        stems = {e.stem for e in entries}
        for o in only:
            if o not in stems:
                raise SuiteError(f"--only {o!r} is not a notebook of suite {suite.name}: {', '.join(sorted(stems))}")
        entries = [e for e in entries if e.stem in only]
    planned, used = [], set()
    for e in entries:
        defaults = notebook_parameters(e.notebook)
        for k in e.params:
            if k not in defaults:
                raise SuiteError(
                    f"parameter {k!r} (suite {suite.name}, {e.stem}) is not a parameter of "
                    f"{e.notebook.name}; its parameters: {', '.join(defaults)}"
                )
        params = dict(e.params)
        for k, v in overrides.items():
            if k in defaults:
                params[k] = v
                used.add(k)
        resolved = {**defaults, **params}
        cls = notebook_config_class(e.notebook)
        if cls is not None:
            try:
                cls.from_params(resolved)
            except ConfigError as err:
                raise ConfigError(err.param, err.value, f"{err.allowed} (in {e.stem})") from None
            except TypeError as err:
                raise SuiteError(f"{e.stem}: its config {cls.__name__} does not accept the parameters: {err}") from None
        planned.append(Planned(e, params, resolved))
    unused = [k for k in overrides if k not in used]
    if unused:
        raise SuiteError(f"--param {', '.join(unused)}: no notebook of suite {suite.name} has such a parameter")
    return planned


@dataclass
class NotebookStatus:
    notebook: str
    path: str
    status: str = "pending"
    error: str | None = None
    seconds: float = 0.0
    html: str | None = None
    ipynb: str | None = None
    rows: int = 0
    params: dict = field(default_factory=dict)


@dataclass
class RunResult:
    run_id: str
    path: Path
    statuses: list[NotebookStatus]

    @property
    def ok(self) -> bool:
        return all(s.status == "ok" for s in self.statuses)

    @property
    def index(self) -> Path:
        return self.path / "index.html"


def _error_of(exc: BaseException) -> str:
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    return f"{ename}: {evalue}".strip()


def run_suite(
    suite: str | Suite,
    *,
    overrides: dict | None = None,
    out_dir: str | Path | None = None,
    only: list[str] | None = None,
    progress: bool = True,
    timeout_s: int = 1800,
    run_id: str | None = None,
) -> RunResult:
    """Run every notebook of a suite and write the report.  Validation errors raise
    before anything runs; notebook failures are recorded and the suite goes on."""
    import papermill as pm
    from tqdm.auto import tqdm

    from . import report

    s = suite if isinstance(suite, Suite) else load_suite(suite)
    planned = plan(s, overrides, only)
    out_dir = Path(out_dir or ROOT / "reports")
    run_id = run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{s.name}"
    final = out_dir / run_id
    if final.exists():
        raise SuiteError(f"report folder {final} already exists")
    tmp = out_dir / f".tmp-{run_id}"
    if tmp.exists():
        shutil.rmtree(tmp)
    for sub in ("notebooks", "html", "records", "artifacts"):
        (tmp / sub).mkdir(parents=True)

    statuses: list[NotebookStatus] = []
    bar = tqdm(planned, desc=f"perflab {s.name}", unit="notebook", disable=not progress, file=sys.stderr)
    saved_env = {
        k: os.environ.get(k) for k in ("PERFLAB_RECORDS_DIR", "PERFLAB_ARTIFACTS_DIR", "PERFLAB_RUN_ID", "TQDM_DISABLE")
    }
    # Inside headless kernels progress bars would be frozen widgets in the report; the
    # runner's own bar shows progress instead.
    os.environ["TQDM_DISABLE"] = "1"
    try:
        for p in bar:
            stem = p.entry.stem
            bar.set_postfix_str(stem)
            st = NotebookStatus(
                notebook=stem,
                path=str(p.entry.notebook.relative_to(ROOT))
                if p.entry.notebook.is_relative_to(ROOT)
                else str(p.entry.notebook),
                params=p.resolved,
            )
            rec_dir, art_dir = tmp / "records" / stem, tmp / "artifacts" / stem
            rec_dir.mkdir(parents=True)
            art_dir.mkdir(parents=True)
            os.environ["PERFLAB_RECORDS_DIR"] = str(rec_dir)
            os.environ["PERFLAB_ARTIFACTS_DIR"] = str(art_dir)
            os.environ["PERFLAB_RUN_ID"] = run_id
            out_nb = tmp / "notebooks" / f"{stem}.ipynb"
            t0 = time.perf_counter()
            try:
                pm.execute_notebook(
                    str(p.entry.notebook),
                    str(out_nb),
                    parameters=p.params,
                    cwd=str(p.entry.notebook.parent),
                    kernel_name="python3",
                    progress_bar=False,
                    execution_timeout=timeout_s,
                    log_output=False,
                    report_mode=False,
                )
                st.status = "ok"
            except Exception as e:  # noqa: BLE001 - a failing notebook is recorded, the suite goes on
                st.status = "failed"
                st.error = _error_of(e)
            st.seconds = time.perf_counter() - t0
            if out_nb.exists():
                st.ipynb = f"notebooks/{stem}.ipynb"
                try:
                    report.export_html(out_nb, tmp / "html" / f"{stem}.html", title=stem)
                    st.html = f"html/{stem}.html"
                except Exception as e:  # noqa: BLE001
                    st.error = (st.error + "; " if st.error else "") + f"HTML export failed: {_error_of(e)}"
                    st.status = "failed"
            statuses.append(st)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    try:
        report.gather_records(tmp, statuses, run_id)
        report.write_index(tmp, s, statuses, run_id, overrides or {})
    except Exception:  # noqa: BLE001 - a report we cannot finish is not passed off as finished
        (tmp / "REPORT_INCOMPLETE.txt").write_text(traceback.format_exc())
        raise
    tmp.rename(final)
    latest = out_dir / "latest"
    try:
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(run_id)
    except OSError:
        pass
    return RunResult(run_id, final, statuses)
