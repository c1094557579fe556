"""The README's "Your model" section works as written: its Python block,
saved as a module, is a factory the labs accept (imported by name, its first step checked)
and the generic measurements run on it at its tiny size."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from lab_utils.step.contract import blocks
from lab_utils.step.load import load_step
from lab_utils.step.memory import grads_of, measure_saved
from lab_utils.step.stability import locate

README = Path(__file__).resolve().parents[1] / "README.md"


def section() -> str:
    text = README.read_text()
    start = text.index("## Your model\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section(), flags=re.S)


@pytest.fixture(scope="module")
def doc_step(tmp_path_factory):
    (py,) = code_blocks("python")
    pkg = tmp_path_factory.mktemp("doc") / "my_models"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "flux.py").write_text(py)
    sys.path.insert(0, str(pkg.parent))
    try:
        yield load_step("my_models.flux:flux_step", device="cpu", batch_size=2)
    finally:
        sys.path.remove(str(pkg.parent))
        for m in [m for m in sys.modules if m == "my_models" or m.startswith("my_models.")]:
            del sys.modules[m]


def test_the_doc_names_the_factory_it_defines():
    (sh,) = code_blocks("bash")
    assert "--param step=my_models.flux:flux_step" in sh
    assert "my_models/flux.py" in section()


def test_the_doc_example_is_a_factory_the_labs_accept(doc_step):
    assert type(doc_step.model).__name__ == "FluxTransformer2DModel"
    assert doc_step.name == "my_models.flux:flux_step" and doc_step.phases == ("noising",)
    assert len(blocks(doc_step)) == 4
    assert measure_saved(doc_step, "none").total > 0
    ref, got = grads_of(doc_step, "none"), grads_of(doc_step, "full")
    assert all(torch.allclose(got[k], ref[k], atol=1e-6, rtol=0) for k in ref)
    fwd, _ = locate(doc_step, 1, module="transformer_blocks.0", phase="forward")
    assert fwd is not None and fwd.module == "transformer_blocks.0"
