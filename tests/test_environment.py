"""environment.yml and pyproject.toml must describe the same environment."""

import re
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _pins(reqs):
    out = {}
    for r in reqs:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-\[\]]+)\s*(==|>=|<=|~=)?\s*([^\s;]*)\s*", r)
        assert m, f"cannot parse requirement {r!r}"
        out[m.group(1).lower().replace("_", "-")] = (m.group(2) or "") + m.group(3)
    return out


def test_environment_matches_pyproject():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    want = _pins(py["dependencies"] + sum(py.get("optional-dependencies", {}).values(), []))
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    have = _pins(pip)
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    differ = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    assert not missing, f"in pyproject.toml but not environment.yml: {missing}"
    assert not extra, f"in environment.yml but not pyproject.toml: {extra}"
    assert not differ, "pins differ: " + ", ".join(f"{k}: pyproject {want[k]} vs env {have[k]}" for k in differ)
    assert want["torch"] == "==2.13.0", "torch must stay pinned (a bare torch pulls a CUDA build)"
    py_min = env["dependencies"][0]
    assert py_min.startswith("python=3.1")
