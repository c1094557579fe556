"""Guards on the committed labs: nbval has something deterministic to check in every lab,
nothing heavy or machine-dependent is committed, and the checked outputs really are
checked (a changed output fails nbval under the project's own pytest options)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lab_utils.run.nbtools import CHECK_MARK

ROOT = Path(__file__).resolve().parents[2]
LABS = sorted((ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))
TEXT_MIMES = {"text/plain"}
MAX_LAB_BYTES = 200_000
# a number followed by a time or rate unit: timing output must never be a checked output
TIMING_TEXT = re.compile(r"\d(\.\d+)?\s*(ms|µs|us|ns|sec|seconds|GB/s|TB/s|GFLOP/s|TFLOP/s|it/s)\b")


def _is_checked(cell) -> bool:
    return cell.cell_type == "code" and any(line.strip() == CHECK_MARK for line in cell.source.splitlines())


def _text_of(out) -> str:
    if out.output_type == "stream":
        return out.text
    return "".join(out.get("data", {}).get("text/plain", ""))


@pytest.fixture(params=LABS or [None], ids=[p.stem for p in LABS] or ["no-labs"])
def lab(request):
    if request.param is None:
        pytest.skip("no labs/NN_*.ipynb yet")
    return request.param, nbformat.read(request.param, as_version=4)


def test_lab_has_checked_cells_with_committed_outputs(lab):
    path, nb = lab
    checked = [c for c in nb.cells if _is_checked(c)]
    assert checked, f"{path.name}: no cell has a line '{CHECK_MARK}' (nbval would check nothing)"
    with_output = [c for c in checked if any(_text_of(o).strip() for o in c.get("outputs", []))]
    assert with_output, (
        f"{path.name}: its {CHECK_MARK} cells have no committed output; run "
        f"`perflab nb refresh {path.relative_to(ROOT)}`"
    )


def test_checked_outputs_are_plain_deterministic_text(lab):
    path, nb = lab
    for i, cell in enumerate(nb.cells):
        if not _is_checked(cell):
            continue
        for out in cell.get("outputs", []):
            assert out.output_type in ("stream", "execute_result", "display_data"), (
                f"{path.name} cell {i}: a checked cell keeps a {out.output_type!r} output"
            )
            if out.output_type == "stream":
                assert out.name == "stdout", f"{path.name} cell {i}: checked stderr output (warnings are not stable)"
            else:
                extra = set(out.get("data", {})) - TEXT_MIMES
                assert not extra, f"{path.name} cell {i}: checked cell keeps non-text output {sorted(extra)}"
            text = _text_of(out)
            m = TIMING_TEXT.search(text)
            assert m is None, (
                f"{path.name} cell {i}: checked output looks like a timing ({m.group(0)!r}): {text[:200]!r}"
            )
            for bad in ("/tmp/", "/home/", "/root/", str(ROOT)):
                assert bad not in text, f"{path.name} cell {i}: checked output holds a path ({bad!r})"


def test_no_heavy_outputs_outside_checked_cells(lab):
    path, nb = lab
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and not _is_checked(cell):
            assert not cell.get("outputs"), (
                f"{path.name} cell {i}: unchecked cell has committed outputs "
                f"(plot payloads must not be committed; `perflab nb refresh`)"
            )
            assert cell.get("execution_count") is None, f"{path.name} cell {i}: stale execution_count"
    assert path.stat().st_size < MAX_LAB_BYTES, f"{path.name} is {path.stat().st_size} bytes: outputs committed?"
    assert "papermill" not in nb.metadata, f"{path.name}: papermill metadata committed"
    # the kernel's widget models (a tqdm bar's state per update) are no output anyone reads
    assert "widgets" not in nb.metadata, f"{path.name}: widget state committed (`perflab nb refresh`)"


def test_lab_has_parameters_cell_and_config(lab):
    path, nb = lab
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and "parameters" in code[0].metadata.get("tags", []), (
        f"{path.name}: the first code cell must be tagged 'parameters'"
    )
    assert nb.metadata.get("perflab", {}).get("config"), f"{path.name}: metadata perflab.config names no config class"


def _tiny_lab(path: Path, committed: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cell = nbformat.v4.new_code_cell(f"{CHECK_MARK}\nprint('max_abs_err', round(2 ** -10, 6))")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=committed)]
    cell.execution_count = 1
    plain = nbformat.v4.new_code_cell("print('unchecked', __import__('time').time())")
    nb.cells = [cell, plain]
    nbformat.write(nb, path)


@pytest.mark.slow
def test_nbval_fails_when_a_checked_output_changes(tmp_path):
    """The mechanism itself, with the project's pytest options (--nbval-lax): a checked
    cell whose output matches passes, one whose committed output differs fails, and an
    unchecked cell printing a time is not compared."""
    good, bad = tmp_path / "good.ipynb", tmp_path / "bad.ipynb"
    _tiny_lab(good, "max_abs_err 0.000977\n")
    _tiny_lab(bad, "max_abs_err 0.000999\n")

    def nbval(path):  # from the repository root, so pyproject's options (--nbval-lax) apply
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-v",
                "-p",
                "no:randomly",
                str(path),
                "--rootdir",
                str(ROOT),
                "-c",
                str(ROOT / "pyproject.toml"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    ok = nbval(good)
    assert ok.returncode == 0 and "2 passed" in ok.stdout, ok.stdout + ok.stderr
    changed = nbval(bad)
    out = changed.stdout + changed.stderr
    assert changed.returncode == 1 and "1 failed, 1 passed" in out, out
    assert "Cell outputs differ" in out and "0.000999" in out, out


def test_guard_finds_the_labs():
    """Every committed lab is guarded (the glob above matches labs/NN_*.ipynb)."""
    committed = subprocess.run(["git", "ls-files", "labs/*.ipynb"], cwd=ROOT, capture_output=True, text=True).stdout
    names = {Path(p).name for p in committed.split()}
    assert names <= {p.name for p in LABS}, f"labs not matched by the guard's glob: {names - {p.name for p in LABS}}"


def test_every_parameter_is_seen_by_papermill(lab):
    """papermill (the runner's parameter injection) must parse every line of the parameters
    cell; a comment holding ':' or '=' makes it drop the parameter silently, and the suite
    then refuses the lab's parameter set."""
    import ast

    import papermill

    path, nb = lab
    cell = next(c for c in nb.cells if c.cell_type == "code")
    assigned = [
        t.id
        for node in ast.parse(cell.source).body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    ]
    seen = set(papermill.inspect_notebook(str(path)))
    missing = [n for n in assigned if n not in seen]
    assert not missing, (
        f"{path.name}: papermill cannot parse the parameter line(s) of {missing} "
        f"(keep ':' and '=' out of their comments)"
    )


MAX_CELL_LINES = 15


def test_cells_are_calls_into_a_study_module(lab):
    """Beyond the parameters, a cell is a few calls and a plot: no functions or classes
    defined, no loops, no records written by hand (``rec.add``), no long cells. Logic a test
    would want to call belongs in ``lab_utils.studies``."""
    path, nb = lab
    code = [c for c in nb.cells if c.cell_type == "code"][1:]
    problems = []
    for i, cell in enumerate(code, start=2):
        src = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                problems.append(f"code cell {i} defines {node.name!r}")
            elif isinstance(node, (ast.For, ast.While, ast.AsyncFor)):
                problems.append(f"code cell {i} has a loop (line {node.lineno})")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add":
                if isinstance(node.func.value, ast.Name) and node.func.value.id == "rec":
                    problems.append(f"code cell {i} writes records by hand (rec.add, line {node.lineno})")
        n = len([line for line in cell.source.splitlines() if line.strip() and not line.strip().startswith("#")])
        if n > MAX_CELL_LINES:
            problems.append(f"code cell {i} has {n} lines (at most {MAX_CELL_LINES})")
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_every_cell_has_an_id(lab):
    """nbformat 4.5 cells carry an id; a cell without one makes every reader warn
    (MissingIDFieldWarning) into the notebook's and the report's stderr."""
    path, _ = lab
    raw = json.loads(path.read_text())
    assert (raw["nbformat"], raw["nbformat_minor"]) >= (4, 5), path.name
    missing = [i for i, c in enumerate(raw["cells"]) if not c.get("id")]
    assert not missing, f"{path.name}: cells {missing} have no id (normalise: nbformat.read + nbformat.write)"


def test_lab_opens_with_its_takeaway(lab):
    """The cell after the set-up shows the lab's takeaway (studies.headline.board) and the last
    cell fills it from the lab's records, so the executed lab and its report open with the answer."""
    path, nb = lab
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert f'board("{path.stem}")' in code[2].source, f"{path.name}: no takeaway board after the set-up cell"
    assert "takeaway.update(" in code[-1].source, f"{path.name}: the last cell does not fill the takeaway"


def test_markdown_is_rendered_not_printed(lab):
    """A study function that returns markdown (a closing note, a table) is displayed as Markdown:
    printed, its headings and tables reach the notebook and the report as raw '###' and '|---|'."""
    path, nb = lab
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and re.search(r"print\(\s*study\.\w*(note|markdown)\w*\(", cell.source):
            raise AssertionError(f"{path.name} cell {i}: prints markdown; display it with IPython.display.Markdown")


def _prose(markdown: str) -> str:
    """Markdown without its code (fenced blocks and inline spans), where a backslash-n is code."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", markdown, flags=re.S))


def test_markdown_has_no_literal_newline_escapes(lab):
    """Lab 06's headings read '## The runs ...\\nLosses over the steps' (a
    newline escape written into the cell as two characters), in the notebook and its report."""
    path, nb = lab
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and "\\n" in _prose(cell.source):
            line = next(ln for ln in cell.source.splitlines() if "\\n" in ln)
            raise AssertionError(f"{path.name} cell {i}: a literal \\n in its markdown: {line[:120]!r}")
