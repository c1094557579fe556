"""The live explorers in a real JupyterLab (headless Chromium from Debian, no network).

A JupyterLab of our own (``browser_util.jupyter_lab``) opens a notebook, runs all its
cells, and the test drives the explorer's ipywidgets like a person would: changing a
control runs a new measurement in the kernel, the table gains a row and the plot
redraws; a configuration that cannot run shows its reason in the widget; and no request
leaves the machine (panel's stylesheets included: ``plots.init`` inlines them).

* lab 01 (``labs/01_training_step.ipynb``: its parameters, set-up, profile and explorer
  cells), at smaller parameters: the UI is under test, not the numbers;
* lab 02's explorer in a scratch notebook written into a tmp dir (the same call as the
  cell the lab carries).

``PERFLAB_EXPLORER_SCREENSHOT=path.png`` saves a screenshot of lab 02's explorer (and of
lab 01's beside it, ``path-01.png``).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import browser_util as B
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP = B.skip_reason()
pytestmark = [pytest.mark.browser, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]
PROMPTS_JS = "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(e => e.textContent.trim())"
ROWS_JS = "() => document.querySelectorAll('.perflab-explore-table tbody tr').length"
STATUS_JS = "() => (document.querySelector('.perflab-explore-status') || {}).innerText || ''"


@pytest.fixture(scope="module")
def chrome(tmp_path_factory):
    with B.browser(tmp_path_factory.mktemp("chromium-profile-explore")) as ctx:
        yield ctx


def _kernel_idle(srv) -> bool:
    with urllib.request.urlopen(f"{srv.url}/api/sessions?token={srv.token}", timeout=5) as r:
        sessions = json.load(r)
    return bool(sessions) and all(s["kernel"]["execution_state"] == "idle" for s in sessions)


def _wait(page, what: str, cond, timeout_s: float, srv=None):
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            log = srv.log.read_text()[-2000:] if srv is not None else ""
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{log}")
        page.wait_for_timeout(250)


def _select(page, control: str):
    """The <select> of an explorer's dropdown, found by its label."""
    box = page.locator(".perflab-explorer .widget-dropdown", has=page.locator(f"label:text-is('{control}')"))
    return box.locator("select").first


def _run_all(page, srv, timeout_s: float = 240):
    page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=90_000)

    def started():
        dialog = page.get_by_role("button", name="Select", exact=True)
        if dialog.count() and dialog.first.is_visible():
            dialog.first.click()
        return _kernel_idle(srv)

    _wait(page, "the kernel to start", started, 90, srv)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()

    def all_ran():
        prompts = page.evaluate(PROMPTS_JS)
        return prompts and all(p[1:-2].isdigit() for p in prompts)

    _wait(page, "every cell to run", all_ran, timeout_s, srv)
    tracebacks = page.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.error']")
    assert tracebacks.count() == 0, f"a cell raised: {tracebacks.first.inner_text()[:2000]}"


def _explore(page, srv, watch, change: dict, unavailable: dict, *, timeout_s: float, screenshot: str | None = None):
    """Change controls (``change``: label -> option) and see a new row and a redrawn plot;
    then pick ``unavailable`` and see its reason; nothing may leave the machine."""
    _wait(page, "the explorer's widgets", lambda: page.locator(".perflab-explorer select").count() > 0, 60, srv)
    ps = B.wait_for_plots(page, 1, timeout_s=60)
    assert ps and not B.undrawn(ps), f"the explorer's plots are not drawn: {ps}"
    rows0 = page.evaluate(ROWS_JS)
    assert rows0 >= 1, "the explorer shows no measured row after run-all"
    before = page.evaluate(B.CANVAS_PRINT_JS)
    for label, option in change.items():
        _select(page, label).select_option(label=str(option))
    _wait(page, "a new row in the explorer's table", lambda: page.evaluate(ROWS_JS) > rows0, timeout_s, srv)
    _wait(page, "the explorer's plot to redraw", lambda: page.evaluate(B.CANVAS_PRINT_JS) != before, 30, srv)
    assert "measured" in page.evaluate(STATUS_JS)
    if screenshot:
        page.locator(".jp-Cell", has=page.locator(".perflab-explorer")).last.screenshot(path=screenshot)
    rows1 = page.evaluate(ROWS_JS)
    for label, option in unavailable.items():
        _select(page, label).select_option(label=str(option))
    reason = page.locator(".perflab-explore-reason")
    _wait(page, "the reason a configuration cannot run", lambda: reason.count() > 0, timeout_s, srv)
    assert "cannot run" in reason.first.inner_text()
    assert page.evaluate(ROWS_JS) == rows1, "a configuration that cannot run added a row"
    assert not watch.outside, f"JupyterLab requested outside addresses: {watch.outside}"
    assert not watch.errors, f"JupyterLab console errors: {watch.errors}"


def _open_lab(chrome, srv, name: str):
    page = chrome.new_page()
    watch = B.Watch.on(page)
    page.goto(f"{srv.url}/lab/tree/{name}?token={srv.token}&reset", wait_until="load")
    return page, watch


FUSED_CELLS = [
    "from lab_utils.core.ceilings import get_ceilings\n"
    "from lab_utils.core.plots import init\n"
    "from lab_utils.core.records import Recorder\n"
    "from lab_utils.studies.explore.fused_kernels import FusedExplorer\n\n"
    "hv = init()\n"
    'ceilings = get_ceilings("cpu", quick=True)\n'
    'rec = Recorder(lab="02_fused_kernels", ceilings=ceilings)',
    'print("records written to", rec.save())',  # the lab's save cells, before and after its explorer
    "FusedExplorer(rec, ceilings=ceilings).show()",
    'print("records (with the explored points) written to", rec.save())',
]


def _assert_explored_kept(work: Path, op: str):
    """The choice made after Run All is in the lab's one records file of the session."""
    files = sorted((work / ".perflab" / "records").glob("02_fused_kernels-*.json"))
    assert len(files) == 1, f"Run All's two saves and the exploration piled up files: {[f.name for f in files]}"
    rows = json.loads(files[0].read_text())["rows"]
    explored = {json.loads(r["extra"]).get("op") for r in rows if r["experiment"] == "explore" and r["extra"]}
    assert op in explored, f"the explored {op} never reached {files[0].name} (explored ops there: {explored})"


def test_lab02_explorer_in_jupyterlab(chrome, tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in FUSED_CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    work = tmp_path / "nb"
    work.mkdir()
    nbformat.write(nb, work / "explore_02.ipynb")
    with B.jupyter_lab(work, tmp_path / "jupyter") as srv:
        page, watch = _open_lab(chrome, srv, "explore_02.ipynb")
        try:
            _run_all(page, srv)
            _explore(
                page,
                srv,
                watch,
                {"op": "gelu_tanh"},
                {"variant": "torch"},
                timeout_s=60,
                screenshot=os.environ.get("PERFLAB_EXPLORER_SCREENSHOT"),
            )
            _assert_explored_kept(work, "gelu_tanh")
        finally:
            page.close()
    assert srv.proc.poll() is not None, "the JupyterLab server is still running"


LAB01 = "01_training_step"
LAB01_OVERRIDES = "\nsteps = 1\nwarmup_steps = 0\nnum_samples = 8\n"


def test_lab01_explorer_in_jupyterlab(chrome, tmp_path):
    src = ROOT / "labs" / f"{LAB01}.ipynb"
    nb = nbformat.read(src, as_version=4)
    assert any("explore" in c.source for c in nb.cells), f"labs/{LAB01}.ipynb has lost its explorer cell"
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source += LAB01_OVERRIDES
    # the lab's own cells that the explorer needs (parameters, set-up, the profile that makes
    # ``rec``) and the explorer's cells; the checked facts in between are nbval's business
    code = [c for c in nb.cells if c.cell_type == "code"]
    keep = [code[0], code[1]] + [c for c in code[2:] if "profile_step" in c.source or "explore" in c.source]
    nb.cells = keep
    work = tmp_path / "labs"
    work.mkdir()
    nbformat.write(nb, work / src.name)
    with B.jupyter_lab(work, tmp_path / "jupyter") as srv:
        page, watch = _open_lab(chrome, srv, src.name)
        try:
            _run_all(page, srv, timeout_s=300)
            shot = os.environ.get("PERFLAB_EXPLORER_SCREENSHOT")
            shot = str(Path(shot).with_name(Path(shot).stem + "-01.png")) if shot else None
            _explore(page, srv, watch, {"batch": 1}, {"attention path": "efficient"}, timeout_s=90, screenshot=shot)
            # every timing row shows its verdict; the lab's own step is row #1
            heads = page.locator(".perflab-explore-table thead th").all_inner_texts()
            assert "step_stability" in heads and "unstable_phases" in heads, heads
            cells = page.locator(".perflab-explore-table tbody tr").first.inner_text()
            assert "stable:" in cells or "UNSTABLE:" in cells, cells
        finally:
            page.close()
    assert srv.proc.poll() is not None, "the JupyterLab server is still running"


PLAN_CELLS = [
    "from lab_utils.core.plots import init\n"
    "from lab_utils.core.records import Recorder\n"
    "from lab_utils.plan.planner import ALL_PHASES, StepProfile, build_plan\n"
    "from lab_utils.studies import plan as study\n"
    "from lab_utils.studies.explore.plan import PlanExplorer\n\n"
    "hv = init()\n"
    'cfg = study.PlanLabConfig(preset="tiny", device="cpu", buckets=[[64, 64]], num_samples=16)\n'
    "rec = study.recorder(cfg)\n\n\n"
    "def synthetic(c):  # a machine whose phase times are known: precomputed encoders take 0 ms\n"
    "    enc = 0.0 if c.encoders == 'precomputed' else 1.0\n"
    "    ph = dict.fromkeys(ALL_PHASES, 0.0) | dict(text_encoding=10 * enc, image_encoding=20 * enc, forward=30.0)\n"
    "    samples = (60.0, 60.5, 59.8, 60.2)\n"
    "    return StepProfile(ph, dict.fromkeys(ph, 0.1), 80.0, 1e9, 32.0, samples, '', c.to_dict())\n\n\n"
    'res = build_plan(cfg.train, ["encoders"], measure=synthetic)\n'
    'print("records written to", rec.save())',
    "PlanExplorer.for_lab(cfg, res, rec, measure_fn=synthetic).show()",
]


def test_lab08_plan_explorer_in_jupyterlab(chrome, tmp_path):
    """Pick a lever -> its predicted plan lands as a row at once; tick 'measure it'
    -> the plan is measured and its row shows the measured step and the timing's verdict."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in PLAN_CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    work = tmp_path / "nb"
    work.mkdir()
    nbformat.write(nb, work / "explore_08.ipynb")
    with B.jupyter_lab(work, tmp_path / "jupyter") as srv:
        page, watch = _open_lab(chrome, srv, "explore_08.ipynb")
        try:
            _run_all(page, srv)
            _wait(page, "the plan explorer", lambda: page.locator(".perflab-explorer select").count() > 0, 60, srv)
            rows0 = page.evaluate(ROWS_JS)
            _select(page, "encoders").select_option(label="precomputed")
            _wait(page, "the predicted plan's row", lambda: page.evaluate(ROWS_JS) > rows0, 60, srv)
            table = page.locator(".perflab-explore-table")
            assert (
                "encoders=precomputed" in table.inner_text()
                and "predicted from the measured step" in table.inner_text()
            )
            page.locator(".perflab-explorer .widget-checkbox", has=page.locator("text=measure it")).locator(
                "input"
            ).click()
            _wait(page, "the measured plan's row", lambda: page.evaluate(ROWS_JS) > rows0 + 1, 60, srv)
            last = table.locator("tbody tr").last.inner_text()
            assert "stable:" in last and "encoders=precomputed" in last, last
            assert not watch.outside, f"JupyterLab requested outside addresses: {watch.outside}"
            assert not watch.errors, f"JupyterLab console errors: {watch.errors}"
        finally:
            page.close()
    files = list((work / ".perflab" / "records").glob("08_plan-*.json"))
    assert len(files) == 1 and "step_time" in files[0].read_text(), "the measured plan did not reach the records file"
