"""``pip install perflab[traces]`` beside a training stack changes nothing installed and ``perflab trace``
runs there: the built wheel, resolved (no ``--no-deps``) into a fresh venv that already holds numpy,
pandas and pyarrow of other versions than the lab's pins, and torch as a team has it (the CPU wheel
on this machine's disk; no torch at all where there is none: a CUDA torch is never downloaded)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "data" / "gpu-traces"
#: a training stack's versions, none of them the lab's pins (requirements/lab.txt)
STACK = ["numpy==1.26.4", "pandas==2.2.3", "pyarrow==17.0.0"]
LOCAL_TORCH = (
    sorted(Path("/opt/wheels").glob("torch-2.13.0+cpu-cp311-*.whl")) if sys.version_info[:2] == (3, 11) else []
)
#: packages ``perflab trace`` must leave unimported (pandas 2.2 itself imports pyarrow where it is installed)
NOT_IMPORTED = ("torch", "triton", "nbformat", "papermill", "scipy", "jupyter_client", "lab_kernels")


def pip(py: Path, *args: str, timeout: int = 1500) -> str:
    p = subprocess.run([str(py), "-m", "pip", *args], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"pip {' '.join(args)}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def freeze(py: Path) -> set[str]:
    return {ln.strip() for ln in pip(py, "freeze", "--all").splitlines() if ln.strip() and not ln.startswith("#")}


def small_trace(path: Path) -> Path:
    ev = []
    for s in range(3):
        t0, c = s * 1000, s + 1
        ev += [
            {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1, "ts": t0,
             "dur": 1000},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t0 + 10, "dur": 20},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t0 + 15,
             "dur": 4, "args": {"correlation": c}},
            {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "pid": 0, "tid": 7, "ts": t0 + 50, "dur": 300,
             "args": {"correlation": c, "stream": 7, "device": 0}},
        ]  # fmt: skip
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": ev}))
    return path


PROBE = """
import json, sys
from lab_utils.run.cli import main
rc = main(sys.argv[1:])
print("PERFLAB-MODULES", json.dumps({"rc": rc, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def trace_in(py: Path, trace: Path, out: Path) -> set[str]:
    p = subprocess.run([str(py), "-c", PROBE, "trace", str(trace), "--out", str(out)], capture_output=True, text=True,
                       timeout=900, cwd=out.parent)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("PERFLAB-MODULES "))
    data = json.loads(line.split(" ", 1)[1])
    assert data["rc"] == 0 and (out / "trace.html").is_file() and (out / "records.json").is_file()
    assert "per step (ms)" in p.stdout
    return set(data["modules"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """perflab's wheel, built from this tree (the build alone skips dependencies; the install below resolves them)."""
    out = tmp_path_factory.mktemp("wheel")
    pip(Path(sys.executable), "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT))  # isolated: setuptools>=69
    (whl,) = out.glob("perflab-*.whl")
    return whl


@pytest.mark.slow
def test_the_traces_extra_installs_beside_a_training_stack_and_changes_nothing(wheel, tmp_path):
    env = tmp_path / "stack"
    venv.create(env, with_pip=True)
    py = env / "bin" / "python"
    stack = [*STACK, *(str(w) for w in LOCAL_TORCH)]
    pip(py, "install", "-q", "--no-compile", *stack)
    before = freeze(py)
    assert any(ln.startswith("pandas==2.2.3") for ln in before)
    pip(py, "install", "-q", "--no-compile", f"{wheel}[traces]")
    after = freeze(py)
    changed = sorted(before - after)
    assert not changed, f"installing perflab[traces] changed what the training stack had: {changed}"
    added = {re.split(r"==| @ ", ln)[0].lower() for ln in after - before}  # perflab: "perflab @ file://..."
    assert "perflab" in added and not added & {"torch", "triton", "papermill", "nbformat", "scipy"}, sorted(added)
    names = {re.split(r"==| @ ", ln)[0].lower() for ln in after}
    assert ("torch" in names) == bool(LOCAL_TORCH), "torch is what the stack had, no more"
    # perflab trace runs there, on a trace written here and on a real GPU job's trace
    mods = trace_in(py, small_trace(tmp_path / "small.pt.trace.json"), tmp_path / "out-small")
    assert not set(NOT_IMPORTED) & mods, sorted(set(NOT_IMPORTED) & mods)
    real = TRACES / "mi250_rocm"
    if real.is_dir():
        mods = trace_in(py, real, tmp_path / "out-real")
        assert not set(NOT_IMPORTED) & mods
        rows = json.loads((tmp_path / "out-real" / "records.json").read_text())["rows"]
        assert rows and {r["lab"] for r in rows} == {"trace"}
    # the command's help answers there too
    p = subprocess.run([str(env / "bin" / "perflab"), "--help"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "perflab trace" not in p.stderr and "trace" in p.stdout
