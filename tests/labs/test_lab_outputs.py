"""Every lab runs at its defaults without an error and its ``# NBVAL_CHECK_OUTPUT`` cells print
what the committed lab holds: nbval's check (tests/nbcheck.py applies nbval's own comparison),
without running a lab a second time when the session's smoke run already ran it the same way.

A lab's smoke run stands in for the run at its defaults when (1) the report is this tree's (made
in this session, or ``$PERFLAB_REPORT`` made at this clean commit) and (2) every parameter the
smoke set injects resolves to the lab's default on this machine (``device: cpu`` for "auto" without
CUDA, ``backend: gloo`` likewise).  Otherwise the lab is executed here at its defaults, as nbval
did (papermill, the lab's folder as working directory).  ``pytest --nbval-lax labs/NN_x.ipynb``
still runs nbval itself on one lab.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbcheck
import nbformat
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
LABS = sorted((ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))


def _smoke_differs(lab: Path) -> str | None:
    """Why the smoke suite's run of ``lab`` is not the run at its defaults here (None: it is)."""
    from lab_utils.run.runner import load_suite, plan

    planned = {p.entry.stem: p for p in plan(load_suite("smoke"))}
    if lab.stem not in planned:
        return "not in the smoke suite"
    return _differs(planned[lab.stem].params, lab)


def _differs(params: dict, lab: Path) -> str | None:
    diffs = nbcheck.same_as_defaults(params, nbcheck.lab_defaults(nbcheck.read(lab)), cuda=torch.cuda.is_available())
    return f"the smoke set differs from the defaults: {', '.join(diffs)}" if diffs else None


def _from_smoke(lab: Path, smoke_run) -> tuple[nbformat.NotebookNode | None, str]:
    """The smoke run's executed lab when it is the run at the lab's defaults here, else (None, why)."""
    if smoke_run.stale:
        return None, smoke_run.stale
    status = {s["notebook"]: s for s in json.loads((smoke_run.path / "status.json").read_text())}
    st = status.get(lab.stem)
    assert st is not None, f"{lab.stem} is in the smoke suite but not in its report {smoke_run.path}"
    assert st["status"] == "ok", f"{lab.stem} failed in the smoke run: {st.get('error')}"
    executed = nbcheck.read(smoke_run.path / st["ipynb"])
    why = _differs(executed.metadata.get("papermill", {}).get("parameters", {}), lab)
    return (None, why) if why else (executed, "the smoke run")


def _run_at_defaults(lab: Path, out: Path) -> nbformat.NotebookNode:
    import papermill as pm

    pm.execute_notebook(
        str(lab), str(out), cwd=str(lab.parent), kernel_name="python3", progress_bar=False, execution_timeout=900
    )
    return nbcheck.read(out)


@pytest.mark.slow
@pytest.mark.parametrize("lab", LABS, ids=[p.stem for p in LABS])
def test_checked_outputs_match_the_committed_lab(lab, request, tmp_path):
    committed = nbcheck.read(lab)  # before anything runs: what this run is held to
    executed, how = None, _smoke_differs(lab)
    if how is None:
        executed, how = _from_smoke(lab, request.getfixturevalue("smoke_run"))
    if executed is None:
        print(f"{lab.stem}: executed here at its defaults ({how})")
        executed = _run_at_defaults(lab, tmp_path / lab.name)
    problems = nbcheck.compare_checked(committed, executed)
    assert not problems, f"{lab.name} (run: {how}):\n" + "\n\n".join(problems)


def test_the_skip_list_is_nbvals():
    """Fields nbval does not compare (read from nbval's IPyNbFile), so this check and nbval agree."""
    assert set(nbcheck.SKIP_COMPARE) == set(nbcheck.nbval_skip_compare())


def _lab(printed: str, *, run: bool = True, extra: str = "") -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('device = "auto"\nsteps = 3', metadata={"tags": ["parameters"]})
    checked = nbformat.v4.new_code_cell(f"# NBVAL_CHECK_OUTPUT\nprint({printed!r})")
    checked.outputs = [nbformat.v4.new_output("stream", name="stdout", text=printed + "\n")]
    checked.execution_count = 2 if run else None
    plain = nbformat.v4.new_code_cell(f"print('unchecked'){extra}")
    nb.cells = [params, checked, plain]
    return nb


def _executed(nb, stdout: str, *, plain_out: str = "t=123.4\n", error: bool = False):
    """``nb`` as papermill writes it: an injected-parameters cell, outputs on every cell."""
    run = nbformat.from_dict(json.loads(json.dumps(nb)))
    injected = nbformat.v4.new_code_cell('device = "cpu"', metadata={"tags": ["injected-parameters"]})
    run.cells.insert(1, injected)
    run.cells[2].outputs = [
        nbformat.v4.new_output("stream", name="stdout", text=stdout[: len(stdout) // 2]),
        nbformat.v4.new_output("stream", name="stdout", text=stdout[len(stdout) // 2 :]),
    ]
    run.cells[3].outputs = [nbformat.v4.new_output("stream", name="stdout", text=plain_out)]
    if error:
        run.cells[3].outputs.append(nbformat.v4.new_output("error", ename="ValueError", evalue="boom", traceback=[]))
    return run


def test_the_comparison_passes_equal_output_and_ignores_unchecked_cells():
    lab = _lab("max_abs_err 0.000977")
    assert nbcheck.compare_checked(lab, _executed(lab, "max_abs_err 0.000977\n")) == []


@pytest.mark.parametrize(
    "kind",
    ["changed number", "extra stderr", "missing output", "cell raised", "other code", "unrun ref with output"],
)
def test_the_comparison_fails_where_nbval_fails(kind):
    lab = _lab("max_abs_err 0.000977")
    run = _executed(lab, "max_abs_err 0.000977\n")
    want = "Cell outputs differ"
    if kind == "changed number":
        run = _executed(lab, "max_abs_err 0.000999\n")
    elif kind == "extra stderr":
        run.cells[2].outputs.append(nbformat.v4.new_output("stream", name="stderr", text="warning\n"))
    elif kind == "missing output":
        run.cells[2].outputs = []
    elif kind == "cell raised":
        run = _executed(lab, "max_abs_err 0.000977\n", error=True)
        want = "ValueError: boom"
    elif kind == "other code":
        run.cells[3].source += "  # edited"
        want = "not the committed lab's"
    else:
        lab = _lab("max_abs_err 0.000977", run=False)
        run = _executed(lab, "max_abs_err 0.000977\n")
        want = "unrun reference cell has outputs"
    problems = nbcheck.compare_checked(lab, run)
    assert len(problems) == 1 and want in problems[0], problems
    if kind == "changed number":
        assert "0.000999" in problems[0] and "0.000977" in problems[0], problems[0]


def test_the_smoke_run_stands_in_only_at_the_defaults():
    defaults = {"device": "auto", "backend": "auto", "steps": 3, "shape": [2, 3], "progress": True}
    assert nbcheck.same_as_defaults({"device": "cpu", "backend": "gloo", "shape": [2, 3]}, defaults, cuda=False) == []
    assert nbcheck.same_as_defaults({"device": "cpu"}, defaults, cuda=True) == ["device='cpu' (default 'auto')"]
    assert nbcheck.same_as_defaults({"steps": 4}, defaults, cuda=False) == ["steps=4 (default 3)"]
    assert nbcheck.same_as_defaults({"progress": False}, defaults, cuda=False) == ["progress=False (default True)"]
    assert nbcheck.same_as_defaults({"shape": [3, 2]}, defaults, cuda=False) == ["shape=[3, 2] (default [2, 3])"]
    assert nbcheck.same_as_defaults({"bogus": 1}, defaults, cuda=False) == ["bogus=1 (not a parameter of the lab)"]


def test_a_session_value_is_made_once_across_xdist_workers(tmp_path, monkeypatch):
    """Under ``pytest -n N`` every worker has its own session; the smoke run and the step matrix are
    made by the first worker that asks and read back by the others, and a make that raises leaves
    nothing a later worker would take for a result."""
    import threading

    from conftest import once_per_run

    class Factory:
        def __init__(self, worker):
            self.base = tmp_path / f"popen-{worker}"
            self.base.mkdir(exist_ok=True)

        def getbasetemp(self):
            return self.base

    made, got = [], {}

    def make(folder):
        made.append(folder)
        (folder / "x").write_text("1")
        return {"folder": folder}

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    workers = [threading.Thread(target=lambda w=w: got.setdefault(w, once_per_run(Factory(w), "thing", make)))
               for w in ("gw0", "gw1", "gw2")]  # fmt: skip
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert made == [tmp_path / "thing"] and {w: v["folder"] for w, v in got.items()} == dict.fromkeys(got, made[0])

    def broken(folder):
        raise RuntimeError("the suite failed")

    with pytest.raises(RuntimeError, match="the suite failed"):
        once_per_run(Factory("gw0"), "other", broken)
    assert not (tmp_path / "other.pickle").exists()
    assert once_per_run(Factory("gw1"), "other", make) == {"folder": tmp_path / "other"}


def test_each_lab_runs_once_per_session():
    """``make test``'s time: a lab whose smoke set differs from its defaults is run twice per
    session (the smoke suite, then here at its defaults).  Keep every smoke set equal to its lab's
    defaults on a CPU machine (a cheaper lab is cheaper defaults, not a different smoke set)."""
    twice = {lab.stem: why for lab in LABS if (why := _smoke_differs(lab)) and why != "not in the smoke suite"}
    assert not twice, f"these labs would run twice in make test: {twice}"
