"""The lab's exact pins (requirements/lab.txt), pyproject's ranges and environment.yml describe one
environment: every dependency pinned once, every pin inside its range, and the installs use the pins."""

from pathlib import Path

import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "lab.txt"


def lock() -> dict[str, Requirement]:
    reqs = [Requirement(line.split("#")[0]) for line in LOCK.read_text().splitlines() if line.split("#")[0].strip()]
    names = [canonicalize_name(r.name) for r in reqs]
    assert len(names) == len(set(names)), f"pinned twice: {sorted({n for n in names if names.count(n) > 1})}"
    return dict(zip(names, reqs))


def project() -> tuple[list[Requirement], dict[str, list[Requirement]]]:
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {k: [Requirement(r) for r in v] for k, v in py.get("optional-dependencies", {}).items()}
    return [Requirement(r) for r in py["dependencies"]], extras


def test_every_dependency_is_a_range_with_its_pin_inside():
    base, extras = project()
    pins = lock()
    deps = [r for r in base + sum(extras.values(), []) if canonicalize_name(r.name) != "perflab"]
    for r in deps:
        ops = {s.operator for s in r.specifier}
        assert ops and "==" not in ops and ops & {">=", ">", "~="}, f"{r}: a range with a lower bound, not a pin"
        pin = pins.get(canonicalize_name(r.name))
        assert pin is not None, f"{r.name} is a dependency but requirements/lab.txt does not pin it"
        exact = [s.version for s in pin.specifier if s.operator == "=="]
        for v in exact:
            assert r.specifier.contains(v, prereleases=True), f"lab pin {pin} falls outside pyproject's {r}"
    unused = sorted(set(pins) - {canonicalize_name(r.name) for r in deps})
    assert not unused, f"pinned in requirements/lab.txt but no dependency of pyproject.toml: {unused}"


def test_the_lab_pins_are_exact_and_torch_stays_pinned():
    pins = lock()
    loose = [str(r) for n, r in pins.items() if n != "triton" and [s.operator for s in r.specifier] != ["=="]]
    assert not loose, f"requirements/lab.txt pins exactly (triton alone is a range, pinned by torch): {loose}"
    assert str(pins["torch"].specifier) == "==2.13.0", "torch must stay pinned (a bare torch pulls a CUDA build)"
    assert pins["triton"].specifier.contains("3.7.1") and pins["triton"].specifier.contains("3.9.0")


def test_the_trace_extra_brings_no_torch_and_no_notebook_package():
    _, extras = project()
    names = {canonicalize_name(r.name) for r in extras["traces"]}
    assert {"numpy", "pandas", "msgspec", "bokeh", "holoviews"} <= names
    assert not names & {"torch", "triton", "papermill", "nbformat", "jupyterlab", "scipy", "pyarrow"}, names
    base, _ = project()
    assert {canonicalize_name(r.name) for r in base} == {"pyyaml", "tqdm"}, "the command alone needs only these"
    assert {"lab", "traces", "export", "dev", "hta"} <= set(extras)


def test_make_setup_and_environment_yml_install_the_pins():
    make = (ROOT / "Makefile").read_text()
    assert "LOCK    := requirements/lab.txt" in make and "-c $(LOCK) torch" in make
    assert "-c $(LOCK) -e '.[lab,export,dev]'" in make and "$(STAMP): pyproject.toml $(LOCK)" in make
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert pip == ["-r requirements/lab.txt"], pip
    assert env["dependencies"][0].startswith("python=3.1")
