"""Headless runs: a suite of parameterized notebooks -> one self-contained report.

A suite (``parameterized/<suite>.yaml``, read by ``lab_utils.run.suites``) lists entries, each a
notebook and a parameter set plus optional inline ``params``.  ``--param key=value`` overrides
apply to every notebook that has that parameter.

Everything is validated before anything runs: the suite exists, every parameter is
one the notebook declares in its ``parameters`` cell, and the lab's config class
(notebook metadata ``perflab.config``) accepts the values.  Notebooks then run one
after another with papermill; a failing notebook is recorded (status, error) and the
suite goes on; the command exits non-zero if any failed.  The report is written to
``reports/.tmp-<run-id>/`` (created exclusively; run ids carry the pid and a random
suffix, so two runs started in the same second never share it) and renamed to
``reports/<run-id>/`` only when complete; paths written while running (records' ``path``
fields, printed trace locations) are rewritten to the final folder.  ``latest`` is
repointed atomically, and only to a complete report.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import papermill as pm
from tqdm.auto import tqdm

from lab_utils.core.config import ConfigError, validating_for
from lab_utils.core.cpu_threads import THREADS_ENV, choose_cpu_threads
from lab_utils.run import footprint, parallel, report
from lab_utils.run.nbtools import IPCKernelManager, drop_absent, strip_noise
from lab_utils.run.suites import (
    ROOT,
    Entry,
    Refused,
    Suite,
    SuiteError,
    check_overrides,
    load_suite,
    notebook_config_class,
    notebook_parameters,
)
from lab_utils.step import STEP_PATH_ENV

#: where reports go when ``--out`` is not given (default: the repository's ``reports/``)
REPORTS_ENV = "PERFLAB_REPORTS_DIR"


@dataclass
class Planned:
    entry: Entry
    params: dict  # only the values that differ from/override the notebook's defaults
    resolved: dict  # defaults + params (what the notebook will see)


def plan(suite: Suite, overrides: dict | None = None, only: list[str] | None = None) -> list[Planned]:
    """Validate the whole suite before anything runs."""
    overrides = overrides or {}
    check_overrides(suite, overrides, only)  # names first, before any lab is imported
    entries = [e for e in suite.entries if not only or e.stem in only]
    planned, used = [], set()
    for e in entries:
        defaults = notebook_parameters(e.notebook)
        cls = notebook_config_class(e.notebook)
        # a renamed parameter is accepted under its former name (a warning names both); the
        # notebook gets, and the records keep, the new name
        renamed = dict(getattr(cls, "RENAMED", None) or {})
        params = cls.renamed_params(e.params, old_wins=False) if renamed else dict(e.params)
        for k in params:
            if k not in defaults:
                raise SuiteError(
                    f"parameter {k!r} (suite {suite.name}, {e.stem}) is not a parameter of "
                    f"{e.notebook.name}; its parameters: {', '.join(defaults)}"
                )
        ours = {k: v for k, v in overrides.items() if renamed.get(k, k) in defaults}
        params.update(cls.renamed_params(ours, old_wins=False) if renamed else ours)
        used.update(ours)
        resolved = {**defaults, **params}
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
    timings: int = 0  # timing rows (median) with a stability verdict
    unstable: int = 0  # of which unstable
    ran_on: str = ""  # as a job (lab_utils.run.parallel): the devices / job that ran it
    log: str | None = None  # as a job: its log in the report (logs/<lab>.job.log)


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


def new_run_id(suite_name: str) -> str:
    """``<date>-<time>-<suite>-<pid>-<random>``: unique even for runs started in the same second."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{suite_name}-p{os.getpid()}-{secrets.token_hex(3)}"


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C; the message says what was interrupted and what was kept."""


def _make_run_dir(out_dir: Path, run_id: str | None, suite_name: str) -> tuple[str, Path]:
    """Create ``.tmp-<run-id>`` exclusively (never reuse another run's folder)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(5):
        rid = run_id or new_run_id(suite_name)
        if (out_dir / rid).exists():
            if run_id:
                raise SuiteError(f"report folder {out_dir / rid} already exists")
            continue
        tmp = out_dir / f".tmp-{rid}"
        try:
            tmp.mkdir()
        except FileExistsError:
            if run_id:
                raise SuiteError(f"another run is writing {tmp} (run id {rid!r} is in use)") from None
            continue
        for sub in ("notebooks", "html", "records", "artifacts"):
            (tmp / sub).mkdir()
        return rid, tmp
    raise SuiteError(f"could not create a fresh report folder under {out_dir}")


def _point_latest(out_dir: Path, run_id: str) -> None:
    """Repoint ``latest`` atomically (a new link renamed over the old one)."""
    latest = out_dir / "latest"
    tmp_link = out_dir / f".latest-{run_id}"
    try:
        tmp_link.symlink_to(run_id)
        os.replace(tmp_link, latest)
    except OSError:
        with contextlib.suppress(OSError):
            tmp_link.unlink()


def _keep_finished(tmp: Path, out_dir: Path, run_id: str, statuses, current: str | None) -> Path | None:
    """After an interrupt: drop the notebook that was running, keep the finished ones in
    ``<run-id>-interrupted/`` (never ``latest``), remove the temporary folder."""
    if current:
        for part in (
            f"notebooks/{current}.ipynb",
            f"html/{current}.html",
            f"records/{current}",
            f"artifacts/{current}",
        ):
            f = tmp / part
            if f.is_dir():
                shutil.rmtree(f, ignore_errors=True)
            elif f.exists():
                f.unlink()
    if not statuses:
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    (tmp / "status.json").write_text(
        json.dumps([{k: v for k, v in vars(s).items() if k != "params"} for s in statuses], indent=1)
    )
    (tmp / "INTERRUPTED.txt").write_text(
        f"run {run_id} was interrupted{f' during {current}' if current else ''}; "
        f"these notebooks had finished: {', '.join(s.notebook for s in statuses)}\n"
    )
    keep = out_dir / f"{run_id}-interrupted"
    tmp.rename(keep)
    return keep


def run_suite(
    suite: str | Suite,
    *,
    overrides: dict | None = None,
    out_dir: str | Path | None = None,
    only: list[str] | None = None,
    progress: bool = True,
    timeout_s: int = 1800,
    run_id: str | None = None,
    timing_threads: int | str | None = None,
    jobs: dict | None = None,
    keep_traces: bool = False,
) -> RunResult:
    """Run every notebook of a suite and write the report.  Validation errors raise
    before anything runs; notebook failures are recorded and the suite goes on.

    ``timing_threads``: the CPU thread count every lab times with ("auto": chosen from
    the cores free when each timing starts; see ``lab_utils.core.timing.choose_cpu_threads``).
    ``jobs``: run the labs as jobs, side by side or on a cluster, into the same report (the
    options of ``lab_utils.run.parallel.plan_jobs``: executor, parallel, devices, cluster).
    Ctrl-C raises :class:`RunInterrupted` after cleaning up: ``latest`` is untouched, the
    temporary folder is gone, finished notebooks are kept in ``<run-id>-interrupted/``.
    ``keep_traces``: keep the labs' profiler traces in ``artifacts/`` (by default they are removed
    once the labs have read them, and listed: ``lab_utils.run.footprint``)."""
    s = suite if isinstance(suite, Suite) else load_suite(suite)
    # job options first (on SLURM checked against the site): the labs' device-dependent parameters
    # are then checked against where the jobs will run, not the machine submitting them
    prep = parallel.prepare(**jobs) if jobs else None
    with validating_for(prep.target() if prep else None):
        planned = plan(s, overrides, only)
    if timing_threads is not None:
        choose_cpu_threads(timing_threads)  # validates before anything runs
    job_plan = parallel.plan_jobs(planned, JOB_HOOKS, prep, timing_threads=timing_threads) if prep else None
    out_dir = Path(out_dir or os.environ.get(REPORTS_ENV) or ROOT / "reports")
    run_id, tmp = _make_run_dir(out_dir, run_id, s.name)
    final = out_dir / run_id

    statuses: list[NotebookStatus] = []
    current: str | None = None
    saved_env = {k: os.environ.get(k) for k in RUN_ENV}
    # Inside headless kernels progress bars would be frozen widgets in the report; the
    # runner's own bar shows progress instead.
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["PERFLAB_RUN_ID"] = run_id
    # a lab's step factory may live in the folder the run started in, or beside the labs
    os.environ[STEP_PATH_ENV] = step_path(saved_env.get(STEP_PATH_ENV), planned)
    if timing_threads is not None:
        os.environ[THREADS_ENV] = str(timing_threads)
    if job_plan is not None:
        # each lab times with its share of the budget: the run's context (and so its thread-cut
        # line) records that share as set on purpose, not as a cut forced by a busy machine
        os.environ.update(parallel.thread_env(job_plan, planned))
    try:
        if job_plan is not None:
            current = "the jobs"
            parallel.run_jobs(planned, job_plan, tmp, final, timeout_s, progress, statuses)
        else:
            bar = tqdm(planned, desc=f"perflab {s.name}", unit="notebook", disable=not progress, file=sys.stderr)
            for p in bar:
                current = p.entry.stem
                bar.set_postfix_str(current)
                statuses.append(_run_one(p, tmp, final, timeout_s))
                current = None
        current = "the report (index, gathered records)"
        report.gather_records(tmp, statuses, run_id, relocate=(tmp, final))
        if not keep_traces:
            footprint.prune_traces(tmp)
        report.write_index(tmp, s, statuses, run_id, overrides or {})
        current = None
    except KeyboardInterrupt:
        running = current if current and current in {p.entry.stem for p in planned} else None
        kept = _keep_finished(tmp, out_dir, run_id, statuses, running)
        where = (
            f"the {len(statuses)} finished notebook(s) ({', '.join(st.notebook for st in statuses)}) are in {kept}"
            if kept
            else "no notebook had finished, nothing was kept"
        )
        raise RunInterrupted(
            f"run {run_id} interrupted during {current or 'start-up'} "
            f"({len(statuses)} of {len(planned)} notebooks done); {where}; {out_dir / 'latest'} is unchanged"
        ) from None
    except Exception:  # a report we cannot finish is not passed off as finished
        (tmp / "REPORT_INCOMPLETE.txt").write_text(traceback.format_exc())
        raise
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    refused = [st for st in statuses if st.status == "refused"]
    if refused and len(refused) == len(statuses):  # nothing was measured: nothing is kept
        shutil.rmtree(tmp, ignore_errors=True)
        raise Refused("; ".join(f"{st.notebook}: {st.error}" for st in refused) + " (nothing was run or written)")
    tmp.rename(final)
    _point_latest(out_dir, run_id)
    if refused:
        raise Refused(
            "; ".join(f"{st.notebook}: {st.error}" for st in refused)
            + f" (refused before measuring; the other notebooks' report: {final / 'index.html'})"
        )
    return RunResult(run_id, final, statuses)


def step_path(existing: str | None, planned: list[Planned]) -> str:
    """``PERFLAB_STEP_PATH`` for the kernels: what it held, the working directory the run started
    in, and each notebook's folder (a kernel runs in its notebook's folder)."""
    dirs = [*(existing or "").split(os.pathsep), os.getcwd(), *(str(p.entry.notebook.parent) for p in planned)]
    return os.pathsep.join(dict.fromkeys(d for d in dirs if d))


RUN_ENV = (
    STEP_PATH_ENV,
    "PERFLAB_RECORDS_DIR",
    "PERFLAB_ARTIFACTS_DIR",
    "PERFLAB_RUN_ID",
    "TQDM_DISABLE",
    THREADS_ENV,
    parallel.SHARE_ENV,
)


def _refused_in_first_cell(exc: BaseException, nb_path: Path) -> bool:
    """Whether a notebook raised a ``ConfigError`` in its first cell after the parameters (where
    a lab builds its config and loads its step): a refusal of its input, not a failure."""
    if getattr(exc, "ename", "") != "ConfigError" or not nb_path.exists():
        return False
    skip = {"parameters", "injected-parameters"}
    cells = nbformat.read(nb_path, as_version=4).cells
    code = [c for c in cells if c.cell_type == "code" and not skip & set(c.metadata.get("tags", []))]
    return bool(code) and any(o.get("ename") == "ConfigError" for o in code[0].get("outputs", []))


def _move_noise(nb_path: Path, log: Path) -> None:
    """Known library log lines leave the executed notebook (and so its report page) for ``log``;
    the sections the lab's step had no capability for leave it too (its footnote names them)."""
    nb = nbformat.read(nb_path, as_version=4)
    removed = strip_noise(nb)
    if removed:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("\n".join(removed) + "\n", encoding="utf-8")
    if drop_absent(nb) or removed:
        nbformat.write(nb, nb_path)


def _run_one(p: Planned, tmp: Path, final: Path, timeout_s: int) -> NotebookStatus:
    """Execute one notebook into ``tmp`` and export its HTML, paths already pointing into ``final``."""
    stem = p.entry.stem
    st = NotebookStatus(
        notebook=stem,
        path=str(p.entry.notebook.relative_to(ROOT))
        if p.entry.notebook.is_relative_to(ROOT)
        else str(p.entry.notebook),
        params=p.resolved,
    )
    rec_dir, art_dir = tmp / "records" / stem, tmp / "artifacts" / stem
    rec_dir.mkdir(parents=True, exist_ok=True)  # exist: a job SLURM requeued runs the notebook again
    art_dir.mkdir(parents=True, exist_ok=True)
    os.environ["PERFLAB_RECORDS_DIR"] = str(rec_dir)
    os.environ["PERFLAB_ARTIFACTS_DIR"] = str(art_dir)
    out_nb = tmp / "notebooks" / f"{stem}.ipynb"
    t0 = time.perf_counter()
    try:
        pm.execute_notebook(
            str(p.entry.notebook),
            str(out_nb),
            parameters=p.params,
            cwd=str(p.entry.notebook.parent),
            kernel_name="python3",
            kernel_manager_class=IPCKernelManager,
            progress_bar=False,
            execution_timeout=timeout_s,
            log_output=False,
            report_mode=False,
        )
        st.status = "ok"
    except Exception as e:  # noqa: BLE001 - a failing notebook is recorded, the suite goes on
        st.status = "refused" if _refused_in_first_cell(e, out_nb) else "failed"
        st.error = _error_of(e)
    st.seconds = time.perf_counter() - t0
    if out_nb.exists():
        st.ipynb = f"notebooks/{stem}.ipynb"
        _move_noise(out_nb, tmp / "logs" / f"{stem}.noise.txt")
        report.relocate_file(out_nb, tmp, final)
        try:
            note = report.lab_threads_note(rec_dir / "records.json")
            report.export_html(out_nb, tmp / "html" / f"{stem}.html", title=stem, banner=note)
            st.html = f"html/{stem}.html"
            footprint.strip_plot_payloads(out_nb)  # the page keeps the plots; the notebook its text
        except Exception as e:  # noqa: BLE001
            st.error = (st.error + "; " if st.error else "") + f"HTML export failed: {_error_of(e)}"
            st.status = "failed"
    return st


#: what ``perflab run --parallel/--executor`` jobs take from here (lab_utils.run.parallel)
JOB_HOOKS = parallel.RunnerHooks(run_one=_run_one, status=NotebookStatus, config_class=notebook_config_class)
