"""Suites, parameter sets and overrides read before anything runs (``suites``): what a suite file yields,
each error it is refused with, a notebook's parameters read from its source, and a config class's
renamed parameters followed through its bases without importing it."""

from __future__ import annotations

import shlex
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
import yaml

from lab_utils.run import suites
from lab_utils.run.nbtools import make_notebook
from lab_utils.run.suites import SuiteError


def _nb(path: Path, params: str = "reps = 3\nsizes: list = [1, 2]\nname = 'x'\nf = len([1])", config=None) -> Path:
    path.write_text(
        nbformat.writes(make_notebook([("md", "# t"), ("params", params), ("code", "x = 1")], config=config))
    )
    return path


@pytest.fixture
def pdir(tmp_path, monkeypatch):
    """A parameterized/ folder of its own: suite files, and sets for notebook ``lab``."""
    monkeypatch.setenv("PERFLAB_PARAMETERIZED", str(tmp_path))
    (tmp_path / "sets" / "lab").mkdir(parents=True)
    (tmp_path / "sets" / "lab" / "smoke.yaml").write_text("reps: 1\nsizes: [4]\n")
    _nb(tmp_path / "lab.ipynb")
    return tmp_path


def _suite(pdir: Path, name: str, data) -> Path:
    (pdir / f"{name}.yaml").write_text(yaml.safe_dump(data))
    return pdir / f"{name}.yaml"


def test_a_suite_file_gives_each_entry_its_notebook_set_and_params(pdir):
    nb = str(pdir / "lab.ipynb")
    _suite(pdir, "s", {"description": "d", "notebooks": [
        {"notebook": nb, "set": "smoke", "params": {"reps": 7}}, {"notebook": nb, "name": "again"}, nb]})  # fmt: skip
    with pytest.raises(SuiteError, match="'lab' runs twice; give one a distinct 'name'"):
        suites.load_suite("s")
    _suite(pdir, "s", {"description": "d", "notebooks": [
        {"notebook": nb, "set": "smoke", "params": {"reps": 7}}, {"notebook": nb, "name": "again"}]})  # fmt: skip
    s = suites.load_suite("s")
    assert (s.name, s.description, s.path) == ("s", "d", pdir / "s.yaml")
    first, second = s.entries
    assert (first.notebook, first.set, first.params, first.name, first.stem) == (
        Path(nb), "smoke", {"reps": 7, "sizes": [4]}, "", "lab"
    )  # fmt: skip
    assert (second.set, second.params, second.stem) == (None, {}, "again")
    assert suites.list_suites() == ["s"]
    assert suites.load_suite(pdir / "s.yaml").entries == s.entries  # a suite file's path


def test_a_notebook_alone_is_a_suite_at_its_defaults(pdir):
    s = suites.load_suite(pdir / "lab.ipynb")
    assert (s.name, s.path, len(s.entries)) == ("lab", pdir / "lab.ipynb", 1)
    assert (s.entries[0].notebook, s.entries[0].set, s.entries[0].params) == (pdir / "lab.ipynb", None, {})
    with pytest.raises(SuiteError, match="notebook 'nope.ipynb' does not exist"):
        suites.load_suite("nope.ipynb")


def test_each_malformed_suite_is_refused_naming_what_is_wrong(pdir):
    nb = str(pdir / "lab.ipynb")
    with pytest.raises(SuiteError, match="suite 'gone' does not exist; known suites: none"):
        suites.load_suite("gone")
    for data in ({"notebooks": []}, ["a"], {"description": "no list"}):
        _suite(pdir, "bad", data)
        with pytest.raises(SuiteError, match="must be a mapping with a non-empty list 'notebooks'"):
            suites.load_suite("bad")
    _suite(pdir, "bad", {"notebooks": [{"set": "smoke"}]})
    with pytest.raises(SuiteError, match=r"notebooks\[0\] must be a mapping with a 'notebook' key"):
        suites.load_suite("bad")
    _suite(pdir, "bad", {"notebooks": [nb, str(pdir / "missing.ipynb")]})
    with pytest.raises(SuiteError, match=r"notebooks\[1\]: notebook '.*missing.ipynb' does not exist"):
        suites.load_suite("bad")
    _suite(pdir, "bad", {"notebooks": [{"notebook": nb, "set": "full"}]})
    with pytest.raises(SuiteError, match="parameter set 'full' for lab does not exist .* known sets: smoke"):
        suites.load_suite("bad")


def test_overrides_parse_as_yaml_values_and_malformed_ones_are_refused():
    assert suites.parse_overrides(["dtype=bfloat16", "sizes=[256, 512]", " reps =3", "x=a=b"]) == {
        "dtype": "bfloat16", "sizes": [256, 512], "reps": 3, "x": "a=b"
    }  # fmt: skip
    assert suites.parse_overrides(None) == {}
    for bad, msg in (("reps", "not of the form key=value"), ("2x=1", "is not a parameter name"),
                     ("s=[1", "value does not parse")):  # fmt: skip
        with pytest.raises(SuiteError, match=msg):
            suites.parse_overrides([bad])


def test_a_notebooks_parameters_are_read_from_its_tagged_cell(tmp_path):
    got = suites.notebook_parameters(_nb(tmp_path / "a.ipynb"))
    assert got == {"reps": 3, "sizes": [1, 2], "name": "x", "f": "len([1])"}  # a non-literal as its text
    assert suites.notebook_parameters(_nb(tmp_path / "b.ipynb", "a = b = 1\nc = 2")) == {"c": 2}
    nb = make_notebook([("code", "reps = 1")])
    (tmp_path / "c.ipynb").write_text(nbformat.writes(nb))
    with pytest.raises(SuiteError, match="c.ipynb has no cell tagged 'parameters'"):
        suites.notebook_parameters(tmp_path / "c.ipynb")
    with pytest.raises(SuiteError, match="its parameters cell does not parse"):
        suites.notebook_parameters(_nb(tmp_path / "d.ipynb", "reps = = 1"))
    (tmp_path / "e.ipynb").write_text("not json")
    with pytest.raises(SuiteError, match="cannot be read as a notebook"):
        suites.notebook_parameters(tmp_path / "e.ipynb")


def test_overrides_no_notebook_has_and_an_unknown_only_are_refused(pdir):
    _suite(pdir, "s", {"notebooks": [str(pdir / "lab.ipynb")]})
    s = suites.load_suite("s")
    suites.check_overrides(s, {"reps": 2, "sizes": [1]}, only=["lab"])
    with pytest.raises(SuiteError, match="--param steps, lr: no notebook of suite s has such a parameter"):
        suites.check_overrides(s, {"reps": 2, "steps": 1, "lr": 0.1})
    with pytest.raises(SuiteError, match="--only 'other' is not a notebook of suite s: lab"):
        suites.check_overrides(s, {}, only=["other"])


def test_where_a_module_is_found_without_importing_it():
    assert suites._module_file("shlex") == Path(shlex.__file__)
    assert suites._module_file("no_such_top_level_module_here") is None
    assert suites._module_file("lab_utils.run.suites") == Path(suites.__file__)
    assert suites._module_file("lab_utils.run.no_such") is None


@pytest.fixture
def cfg_modules(tmp_path, monkeypatch):
    """Config classes in modules on the path (read as source, never imported)."""

    def write(name: str, src: str) -> None:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(src))

    monkeypatch.syspath_prepend(str(tmp_path))
    chain = "from lab_utils.core.config import LabConfig\n\nclass C0(LabConfig):\n    RENAMED = {'old': 'new'}\n"
    chain += "".join(f"\nclass C{i}(C{i - 1}):\n    pass\n" for i in range(1, 12))
    write("m3_chain", chain)
    write("m3_two", "class A:\n    RENAMED = {'a': 'b'}\n\nclass B:\n    RENAMED: dict = {'c': 'd'}\n")
    write("m3_loop_a", "from m3_loop_b import Cfg\n")
    write("m3_loop_b", "from m3_loop_a import Cfg\n")
    write("m3_import", "from m3_two import A\nfrom m3_two import B as Renamed\n")
    write("m3_plain", "from lab_utils.core.config import LabConfig\n\nclass P(LabConfig):\n    x: int = 1\n")
    write("m3_odd", "RENAMED = {}\n\nclass Q:\n    RENAMED = dict(a='b')\n\nclass R(A, B):\n    pass\n")
    yield
    for m in ("m3_chain", "m3_two", "m3_import", "m3_loop_a", "m3_loop_b", "m3_plain", "m3_odd"):
        assert m not in sys.modules, f"{m} was imported"


def test_renamed_parameters_are_followed_through_ten_bases_and_no_further(cfg_modules):
    assert suites.static_renamed("m3_chain", "C0") == {"old": "new"}
    assert suites.static_renamed("m3_chain", "C10") == {"old": "new"}  # ten bases up
    assert suites.static_renamed("m3_chain", "C11") is None  # eleven: past the limit, the import tells


def test_renamed_parameters_read_from_the_class_named_and_its_source_only(cfg_modules):
    assert suites.static_renamed("m3_two", "A") == {"a": "b"}
    assert suites.static_renamed("m3_two", "B") == {"c": "d"}
    assert suites.static_renamed("m3_plain", "P") == {}  # LabConfig's own table: none
    assert suites.static_renamed("lab_utils.core.config", "LabConfig") == {}
    assert suites.static_renamed("m3_loop_a", "Cfg") is None  # imported from each other: no end to follow
    assert suites.static_renamed("m3_odd", "Q") is None  # a computed table
    assert suites.static_renamed("m3_odd", "R") is None  # two bases
    assert suites.static_renamed("m3_two", "Missing") is None


def test_a_class_imported_from_another_module_is_read_there(cfg_modules):
    assert suites.static_renamed("m3_import", "A") == {"a": "b"}
    assert suites.static_renamed("m3_import", "Renamed") == {"c": "d"}  # imported under another name


def test_an_override_a_config_renamed_is_taken_under_its_former_name(pdir, cfg_modules):
    nb = _nb(pdir / "cfg.ipynb", "reps = 1", config="m3_import:A")
    assert suites.notebook_config_spec(nb) == "m3_import:A"
    assert suites.notebook_config_spec(pdir / "lab.ipynb") is None
    s = suites.load_suite(nb)
    suites.check_overrides(s, {"reps": 2, "a": 1})  # 'a': the former name of 'b'
    with pytest.raises(SuiteError, match="--param z: no notebook"):
        suites.check_overrides(s, {"z": 1})


def test_a_notebook_named_relative_to_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _nb(tmp_path / "here.ipynb")
    s = suites.load_suite("here.ipynb")
    assert s.name == "here" and s.entries[0].notebook == tmp_path / "here.ipynb"
