"""The README's "Your model" section works as written: its Python block, pasted as
``my_models/flux.py`` into a fresh folder that holds only what a clone after ``make setup`` adds to
it (``.venv``: this environment), is a factory the labs accept, and its exact command, run from
that folder in the test's environment (no ``PERFLAB_STEP_PATH``, nothing added to ``PATH``),
completes lab 05 on it with the whole page."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lab_utils.run.runner import REPORTS_ENV
from lab_utils.step.load import load_step

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def section() -> str:
    text = README.read_text()
    start = text.index("## Your model\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section(), flags=re.S)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A fresh folder holding only the README's code, where the README says to save it, and the
    environment ``make setup`` makes (``.venv``, a link to this one)."""
    (py,) = code_blocks("python")
    folder = tmp_path_factory.mktemp("my-project")
    (folder / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    (folder / "my_models").mkdir()
    (folder / "my_models" / "flux.py").write_text(py)
    return folder


def test_the_doc_names_the_file_and_the_factory_it_defines():
    (sh,) = code_blocks("bash")
    assert sh.strip() == ".venv/bin/perflab run labs/05_memory.ipynb --param step=my_models.flux:flux_step"
    assert "`my_models/flux.py`" in section() and "device_memory_gb" in section()


def test_the_doc_example_loads_from_the_project_folder(project, monkeypatch):
    monkeypatch.chdir(project)  # the folder perflab runs from is importable, nothing else set
    try:
        step = load_step("my_models.flux:flux_step", device="cpu", batch_size=2)
        assert type(step.model).__name__ == "FluxTransformer2DModel" and step.phases == ("noising",)
    finally:
        for m in [m for m in sys.modules if m == "my_models" or m.startswith("my_models.")]:
            del sys.modules[m]


@pytest.mark.slow  # lab 05 on the README's FLUX at the lab's defaults: a minute or two on 2 cores
def test_the_readmes_command_run_from_the_project_folder_completes_lab_05(project, tmp_path):
    (sh,) = code_blocks("bash")
    argv = shlex.split(sh.strip())
    assert argv[0] == ".venv/bin/perflab" and (project / argv[0]).exists(), "perflab is not in this environment"
    env = {**os.environ, REPORTS_ENV: str(tmp_path / "reports")}  # PATH as it is: the command names its perflab
    env.pop("PERFLAB_STEP_PATH", None)
    r = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = Path(re.search(r"report: (\S+)", r.stdout).group(1)).parent
    status = json.loads((report / "status.json").read_text())
    assert [s["status"] for s in status] == ["ok"], status
    nb = nbformat.read(report / "notebooks" / "05_memory.ipynb", as_version=4)
    text = "\n".join(
        o.get("text", "")
        or "".join(o.get("data", {}).get("text/plain", "")) + "".join(o.get("data", {}).get("text/markdown", ""))
        for c in nb.cells
        for o in c.get("outputs", [])
    )
    assert "step: my_models.flux:flux_step/diffusers" in text
    assert "Takeaway: peak memory, no checkpointing:" in text and "what fits" in text  # its own figures
    assert "the whole step peaked at" in text and "memory_formula" in text  # checked; the left-out section named
    assert not [c for c in nb.cells if c.source.startswith("%%needs")]  # the MMDiT's sections left the page
