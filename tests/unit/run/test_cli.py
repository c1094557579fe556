"""``perflab`` answers at once: ``--help``, each subcommand's ``--help`` and a refused argument import
no heavy package (checked in fresh processes: sys.modules and ``-X importtime``); ``perflab trace FILE``
imports no torch; the light readers of suites agree with papermill and with the imported configs."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import papermill as pm
import pytest

from lab_utils.run import cli
from lab_utils.run.commands import numdiff as numdiff_args
from lab_utils.run.commands.compare import Options, options_from
from lab_utils.run.suites import (
    SuiteError,
    check_overrides,
    load_suite,
    notebook_config_class,
    notebook_config_spec,
    notebook_parameters,
    static_renamed,
)
from unit.run.test_trace_cli_figures import job

ROOT = Path(__file__).resolve().parents[3]
LABS = sorted((ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))
#: what the command must not import before its arguments are parsed and accepted
HEAVY = ("torch", "triton", "nbformat", "papermill", "nbconvert", "jupyter_client", "scipy", "pandas", "numpy",
         "bokeh", "holoviews", "panel", "msgspec", "mlflow", "tensorboard", "jsonschema", "lab_kernels")  # fmt: skip
#: ``perflab trace FILE`` needs these for trace.html and its tables, and nothing of the lab
TRACE_FORBIDDEN = ("torch", "triton", "nbformat", "papermill", "nbconvert", "jupyter_client", "scipy", "lab_kernels",
                   "mlflow", "tensorboard", "ipywidgets", "IPython")  # fmt: skip

PROBE = """
import json, sys
from lab_utils.run.cli import main
try:
    rc = main({argv!r})
except SystemExit as e:
    rc = e.code
print("PERFLAB-MODULES", json.dumps({{"rc": rc, "modules": sorted({{m.split(".")[0] for m in sys.modules}})}}))
"""


def run_fresh(argv: list[str], cwd: Path = ROOT) -> tuple[int, set[str], str, str]:
    """``perflab argv`` in a fresh interpreter with ``-X importtime``: (exit code, top-level modules
    imported, stdout, the importtime lines of the slowest imports)."""
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", PROBE.format(argv=argv)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("PERFLAB-MODULES "))
    data = json.loads(line.removeprefix("PERFLAB-MODULES "))
    times = [ln for ln in p.stderr.splitlines() if ln.startswith("import time:") and ln.split("|")[1].strip().isdigit()]
    slow = sorted(times, key=lambda ln: -int(ln.split("|")[1]))[:8]
    return data["rc"], set(data["modules"]), p.stdout, "\n".join(slow) + "\n" + p.stderr[-2000:]


@pytest.mark.parametrize(
    "argv",
    [["--help"], *([c, "--help"] for c in cli.COMMANDS), ["trace", "diff", "--help"], ["baseline", "check", "--help"]],
    ids=lambda a: " ".join(a),
)
def test_help_imports_nothing_heavy(argv):
    rc, mods, out, slow = run_fresh(argv)
    assert rc == 0, out + slow
    assert "usage: perflab" in out
    heavy = sorted(set(HEAVY) & mods)
    assert not heavy, f"`perflab {' '.join(argv)}` imported {heavy}; slowest imports:\n{slow}"


@pytest.mark.parametrize(
    "argv, says",
    [
        (["run", "nosuch"], "suite 'nosuch' does not exist"),
        (["run", "smoke", "--param", "nosuch=1"], "--param nosuch: no notebook of suite smoke has such a parameter"),
        (["run", "smoke", "--param", "reps"], "is not of the form key=value"),
        (["run", "smoke", "--only", "99_nope"], "--only '99_nope' is not a notebook of suite smoke"),
        (["run", "smoke", "--parallel", "x"], "invalid int value"),
        (["trace", "/no/such/trace.json"], "PATH '/no/such/trace.json': no such file or folder"),
        (["trace", "diff", "/no/a.json", "/no/b.json"], "BASE '/no/a.json': no such file or folder"),
        (["compare", "/no/base", "latest"], "BASE '/no/base': no such file or folder"),
        (["numdiff", "/no/a", "/no/b"], "A: cannot read records from /no/a: no such file or folder"),
        (["export", "/no/report", "--to", "mlflow"], "REPORT '/no/report': no such file or folder"),
        (["export", "latest", "--to", "wandb"], "invalid choice: 'wandb'"),
        (["nosuch"], "invalid choice: 'nosuch'"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else None,
)
def test_a_bad_argument_is_refused_before_anything_heavy(argv, says):
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", PROBE.format(argv=argv)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    data = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("PERFLAB-MODULES ")).split(" ", 1)[1])
    assert data["rc"] == 2, p.stderr[-2000:]
    assert says in p.stderr, p.stderr[-2000:]
    heavy = sorted(set(HEAVY) & set(data["modules"]))
    assert not heavy, f"refusing `perflab {' '.join(argv)}` imported {heavy}"


def test_trace_help_is_plain_text():
    rc, _, out, _ = run_fresh(["trace", "--help"])
    assert rc == 0 and "where the time went" in out
    for rst in ("``", ":func:", ":class:", ":mod:"):
        assert rst not in out, f"reStructuredText {rst!r} in `perflab trace --help`"


def test_trace_of_a_file_imports_no_torch(tmp_path):
    trace = tmp_path / "step.pt.trace.json"
    job(trace)
    rc, mods, out, slow = run_fresh(["trace", str(trace), "--out", str(tmp_path / "out")], cwd=tmp_path)
    assert rc == 0, out + slow
    assert (tmp_path / "out" / "trace.html").is_file() and (tmp_path / "out" / "records.json").is_file()
    assert not set(TRACE_FORBIDDEN) & mods, f"`perflab trace FILE` imported {sorted(set(TRACE_FORBIDDEN) & mods)}"
    ctx = json.loads((tmp_path / "out" / "records.json").read_text())["context"]
    # the device is the trace's GPU, never the analysing machine; the figures were read, not timed here
    assert ctx["device_kind"] == "gpu trace" and ctx["timing"]["method"].startswith("none")


def test_importing_lab_utils_imports_no_torch():
    code = "import sys, lab_utils, lab_utils.traces, lab_utils.core.records; print(sorted(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT).stdout
    assert "'torch'" not in out and "'triton'" not in out and "'lab_kernels'" not in out


def test_the_light_parameters_reader_agrees_with_papermill():
    for nb in LABS:
        want = {}
        for name, p in pm.inspect_notebook(str(nb)).items():
            try:
                want[name] = ast.literal_eval(p["default"])
            except (ValueError, SyntaxError):
                want[name] = p["default"]
        assert notebook_parameters(nb) == want, nb.name


def test_the_static_renamed_tables_agree_with_the_imported_configs():
    seen = 0
    for nb in LABS:
        spec = notebook_config_spec(nb)
        assert spec, nb.name
        cls = notebook_config_class(nb)
        assert static_renamed(*spec.split(":")) == dict(cls.RENAMED), nb.name
        seen += bool(cls.RENAMED)
    assert seen >= 2  # labs 05 and 06 rename a parameter: the reader is not vacuous


def test_check_overrides_accepts_former_names_and_refuses_unknown_ones():
    suite = load_suite("smoke")
    check_overrides(suite, {"policies": ["none"], "checkpoint": "none", "reps": 3})  # former names of 05, 06
    with pytest.raises(SuiteError, match="--param nosuch: no notebook of suite smoke"):
        check_overrides(suite, {"nosuch": 1})
    with pytest.raises(SuiteError, match="--only"):
        check_overrides(suite, {}, only=["99_nope"])
    assert static_renamed("lab_utils.core.config", "LabConfig") == {}
    assert static_renamed("no_such_package.mod", "X") is None


def test_the_parsers_defaults_are_the_comparisons_and_the_help_says_numdiffs_floors():
    a = cli.parser().parse_args(["compare", "a", "b"])
    assert options_from(a) == Options()
    from lab_utils.stability.numdiff import ABS_FLOOR, DEFAULT_FLOOR

    said = ", ".join(f"{k} {v:g}" for k, v in ABS_FLOOR.items()) + f", others {DEFAULT_FLOOR:g}"
    assert numdiff_args.FLOOR_HELP == said
