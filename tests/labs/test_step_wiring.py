"""Labs 01, 05, 07 and 08 take ``step``: each lab's config defaults it to perflab's MMDiT and
checks its form; each notebook's parameters cell names it and the first cell after it loads it
(``page.load``: a factory that does not import is refused there, naming ``step``), and no other
cell loads or builds a step, so each section measures that one; the smoke suite
runs lab 05 once more with diffusers' FLUX, under its own name (a notebook that runs twice in a
suite without one is refused); records keyed by the step's identity keep two models apart in
perflab compare and match two builds of one."""

from __future__ import annotations

import re

import nbformat
import pytest

from lab_utils.core.config import ConfigError
from lab_utils.core.records import Recorder
from lab_utils.run.compare import compare
from lab_utils.run.runner import ROOT, SuiteError, load_suite, notebook_parameters, plan
from lab_utils.step.contract import identity
from lab_utils.step.load import DEFAULT_STEP, load_step
from lab_utils.studies import page
from lab_utils.studies.memory import MemoryLabConfig, state_table
from lab_utils.studies.plan import PlanLabConfig
from lab_utils.studies.stability import StabilityLabConfig
from lab_utils.studies.training_step import TrainingStepLabConfig

LABS = {
    "01_training_step": TrainingStepLabConfig,
    "05_memory": MemoryLabConfig,
    "07_stability": StabilityLabConfig,
    "08_plan": PlanLabConfig,
}


@pytest.mark.parametrize("lab", list(LABS))
def test_each_lab_takes_step_defaulting_to_the_mmdit_and_refuses_a_bad_one(lab):
    cls = LABS[lab]
    assert cls(device="cpu").step == DEFAULT_STEP
    assert notebook_parameters(ROOT / "labs" / f"{lab}.ipynb")["step"] == DEFAULT_STEP
    ok = cls.from_params({"device": "cpu", "step": "lab_utils.step.examples:llama_step"})
    assert ok.step == "lab_utils.step.examples:llama_step"
    with pytest.raises(ConfigError) as e:
        cls.from_params({"device": "cpu", "step": "no such form"})
    assert e.value.param == "step"
    late = cls.from_params({"device": "cpu", "step": "no_such_module_xyz:f"})  # the form is right
    with pytest.raises(ConfigError) as e:
        page.load(late)
    assert e.value.param == "step" and "importing 'no_such_module_xyz' failed" in str(e.value)
    # the notebook: the first cell after the parameters builds the config and loads the step
    nb = nbformat.read(ROOT / "labs" / f"{lab}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", [])]
    assert "from_params(globals())" in code[0].source and "step = page.load(cfg, rec)" in code[0].source
    # one step a run: every section measures the step loaded there; no cell loads or builds another
    whole = "\n".join(c.source for c in code)
    assert re.findall(r"\w+\.load\(", whole) == ["page.load("], lab
    assert not re.findall(r"\b(load_step|build_step|build_model|Trainer|synthetic_step)\b", whole), lab


def test_the_smoke_suite_runs_lab_05_once_more_with_flux():
    suite = load_suite("smoke")
    by = {e.stem: e for e in suite.entries}
    flux = by["05_memory_flux"]
    assert flux.notebook == by["05_memory"].notebook
    assert flux.params["step"] == "lab_utils.step.examples:flux_step"
    planned = {p.entry.stem: p for p in plan(suite, only=["05_memory", "05_memory_flux"])}
    assert planned["05_memory"].resolved["step"] == DEFAULT_STEP
    assert planned["05_memory_flux"].resolved["step"] == "lab_utils.step.examples:flux_step"


def test_a_notebook_twice_in_a_suite_needs_a_name(tmp_path):
    f = tmp_path / "twice.yaml"
    f.write_text("notebooks:\n  - notebook: labs/05_memory.ipynb\n  - notebook: labs/05_memory.ipynb\n")
    with pytest.raises(SuiteError, match="'05_memory' runs twice; give one a distinct 'name'"):
        load_suite(f)
    f.write_text(
        "notebooks:\n  - notebook: labs/05_memory.ipynb\n  - notebook: labs/05_memory.ipynb\n    name: again\n"
    )
    assert [e.stem for e in load_suite(f).entries] == ["05_memory", "again"]


def test_compare_keeps_two_models_apart_and_matches_two_builds_of_one(tmp_path):
    files = {}
    good, wider = "unit.step.test_load:good", "unit.step.test_load:wider"  # factories of tests/unit/step/test_load.py
    for tag, spec in (("a", good), ("b", good), ("c", wider)):
        rec = Recorder(lab="05_memory", params={"step": spec}, device="cpu")
        step = load_step(spec)
        rec.scope(identity(step).key, **identity(step).extra())
        state_table(step, rec)
        files[tag] = rec.save(tmp_path / f"{tag}.json")
    same = compare(files["a"], files["b"])
    assert set(same.rows.verdict) == {"same"} and len(same.rows) == 3
    other = compare(files["a"], files["c"], allow_context_diff=("params",))
    assert set(other.rows.verdict) == {"only in base", "only in candidate"}, other.rows.verdict.tolist()
