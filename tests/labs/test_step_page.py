"""A lab's page around its step: a ``%%needs`` cell runs only on a step that declares the
capability, and on another shows nothing, leaves a headless report with the markdown tagged for
it, and is named once in the footnote; ``perflab run`` takes a notebook's path; the folder it
starts in is importable for a factory; a factory refused in the first cell makes it exit 2 and
write nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lab_utils.run import runner, workspace
from lab_utils.run.nbtools import drop_absent, execute
from lab_utils.run.runner import ROOT, Refused, SuiteError, load_suite, plan, run_suite, step_path
from lab_utils.step import STEP_PATH_ENV
from lab_utils.step.load import search_path

TESTS = Path(__file__).resolve().parents[1]
PERFLAB = Path(sys.executable).with_name("perflab")


def _notebook(step: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import sys\n"
            f"sys.path.insert(0, {str(TESTS)!r})\n"
            "from types import SimpleNamespace\n"
            "from lab_utils.studies import page\n"
            f"cfg = SimpleNamespace(step={step!r}, device='cpu', batch_size=2, seed=0, dtype='float32')\n"
            "step = page.load(cfg)"
        ),
        nbformat.v4.new_markdown_cell("## the formula's section", metadata={"tags": ["needs:memory_formula"]}),
        nbformat.v4.new_code_cell("%%needs memory_formula\nprint('formula ran')\n1 + 1"),
        nbformat.v4.new_code_cell("%%needs presets memory_formula\nprint('presets ran')"),
        nbformat.v4.new_markdown_cell("## any step's section"),
        nbformat.v4.new_code_cell("print('any step')"),
        nbformat.v4.new_code_cell("page.finish()"),
    ]
    return nb


def _texts(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        out.append(o.get("text", "") or "".join(o.get("data", {}).get("text/plain", "")))
        out.append("".join(o.get("data", {}).get("text/markdown", "")))
    return "".join(out)


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """The same page run on perflab's MMDiT and on a step with no capability (one kernel each)."""
    out = {}
    for name, spec in (("mmdit", "lab_utils.step.mmdit:mmdit_step"), ("tiny", "unit.step.test_load:good")):
        out[name] = execute(_notebook(spec), tmp_path_factory.mktemp(name), timeout=600)
    return out


def test_on_a_step_with_the_capability_the_cells_run_as_written(pages):
    nb = pages["mmdit"]
    assert "formula ran" in _texts(nb.cells[2]) and "2" in _texts(nb.cells[2])  # its last value shown
    assert "presets ran" in _texts(nb.cells[3])
    assert _texts(nb.cells[-1]) == ""  # nothing left out: no footnote
    assert drop_absent(nb) == [] and len(nb.cells) == 7


def test_on_a_step_without_it_the_section_shows_nothing_leaves_the_report_and_is_footnoted(pages):
    nb = pages["tiny"]
    assert "ran" not in _texts(nb.cells[2]) + _texts(nb.cells[3])
    foot = _texts(nb.cells[-1])
    assert foot.count("does not declare it") == 2, foot  # one line per capability, each once
    assert "`memory_formula`" in foot and "`presets`" in foot and "unit.step.test_load:good" in foot
    assert drop_absent(nb) == ["memory_formula", "presets"]
    kept = [c.source.splitlines()[0] for c in nb.cells]
    assert kept == [kept[0], "## any step's section", "print('any step')", "page.finish()"]


def test_a_notebook_path_is_a_suite_of_that_notebook_at_its_defaults(tmp_path, monkeypatch):
    s = load_suite("labs/05_memory.ipynb")
    assert s.name == "05_memory" and [e.notebook for e in s.entries] == [ROOT / "labs" / "05_memory.ipynb"]
    assert s.entries[0].params == {} and s.entries[0].set is None
    monkeypatch.chdir(tmp_path)  # another folder: the project's labs are found
    assert load_suite("labs/05_memory.ipynb").entries[0].notebook == ROOT / "labs" / "05_memory.ipynb"
    (planned,) = plan(s, {"step": "my_models.flux:flux_step"})
    assert planned.resolved["step"] == "my_models.flux:flux_step"  # its form checked, nothing imported
    with pytest.raises(SuiteError, match="does not exist"):
        load_suite("labs/99_nothing.ipynb")


def test_the_folder_a_run_starts_in_and_the_labs_folder_are_importable(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    planned = plan(load_suite("labs/05_memory.ipynb"))
    dirs = step_path("/already/there", planned).split(os.pathsep)
    assert dirs == ["/already/there", str(tmp_path), str(ROOT / "labs")]
    monkeypatch.setenv(STEP_PATH_ENV, os.pathsep.join(dirs))
    assert search_path()[:3] == [str(Path(d).resolve()) for d in dirs]
    env = {STEP_PATH_ENV: "/x"}
    assert workspace.step_path_env(env).split(os.pathsep) == ["/x", str(tmp_path), str(ROOT / "labs")]


@pytest.mark.slow  # one kernel start (a lab's imports): ~20 s
def test_a_factory_refused_in_the_first_cell_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "reports"
    env = {**os.environ, STEP_PATH_ENV: str(TESTS), "TQDM_DISABLE": "1"}
    bad = "unit.step.test_load:per_sample_loss"  # a loss per sample: the kernel's first cell refuses it
    cmd = [str(PERFLAB), "run", "labs/05_memory.ipynb", "--param", f"step={bad}", "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"parameter 'step' = '{bad}'" in r.stderr
    assert "is a tensor of shape [2], not a zero-dimensional tensor" in r.stderr
    assert "nothing was run or written" in r.stderr
    assert not out.exists() or not [p for p in out.iterdir() if not p.name.startswith(".")], list(out.iterdir())


def test_a_refusal_is_raised_by_the_run_not_passed_off_as_a_report(tmp_path, monkeypatch):
    """The runner's side, without a kernel: a notebook whose first cell raised a ConfigError is
    'refused'; all refused, the run folder is removed and Refused (a SuiteError: exit 2) raised."""

    def refuse(p, tmp, final, timeout_s):
        return runner.NotebookStatus(p.entry.stem, "", status="refused", error="ConfigError: parameter 'step'")

    monkeypatch.setattr(runner, "_run_one", refuse)
    with pytest.raises(Refused, match="nothing was run or written"):
        run_suite("labs/05_memory.ipynb", out_dir=tmp_path, progress=False)
    assert not list(tmp_path.iterdir())
