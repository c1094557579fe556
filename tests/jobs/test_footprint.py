"""What a report keeps and where its bytes go: traces only when asked, executed notebooks without
the plots' JavaScript (the pages keep it), tqdm bars in their final state, a real smoke report
under its budget, and no Jupyter transport warning per lab."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest
import yaml

from lab_utils.run import footprint, report
from lab_utils.run.nbtools import IPCKernelManager, make_notebook
from lab_utils.run.runner import run_suite

TCP_WARNING = "Kernel is running over TCP without encryption"


def _files(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` and its size, walked independently of footprint.bytes_by_kind."""
    out = {}
    for dirpath, _dirs, names in os.walk(folder):
        for n in names:
            p = Path(dirpath) / n
            if not p.is_symlink():
                out[p.relative_to(folder).as_posix()] = p.stat().st_size
    return out


def test_a_run_keeps_no_profiler_trace_unless_asked(tiny_reports):
    default, kept = tiny_reports["default"], tiny_reports["kept"]
    assert not [f for f in _files(default) if footprint.is_trace(Path(f))]
    listed = (default / "artifacts" / footprint.NOT_KEPT).read_text().splitlines()[1:]
    size = (kept / "artifacts" / "tiny" / "traces" / "step.trace.json").stat().st_size
    assert listed == [f"artifacts/tiny/traces/step.trace.json\t{size}"]
    index = (default / "index.html").read_text()
    assert 'id="traces-not-kept"' in index and "1 profiler trace(s)" in index
    assert "--keep-traces" in index and 'href="artifacts/tiny/traces/step.trace.json"' not in index
    # kept: the file, its link, no "not kept" note
    kindex = (kept / "index.html").read_text()
    assert 'href="artifacts/tiny/traces/step.trace.json"' in kindex and "traces-not-kept" not in kindex
    assert not (kept / "artifacts" / footprint.NOT_KEPT).exists()


def test_drop_traces_after_an_export_updates_the_index(tiny_reports, tmp_path):
    import shutil

    rep = tmp_path / "r"
    shutil.copytree(tiny_reports["kept"], rep)
    gone = report.drop_traces(rep)
    assert [g[0] for g in gone] == ["artifacts/tiny/traces/step.trace.json"]
    index = (rep / "index.html").read_text()
    assert 'id="traces-not-kept"' in index and 'href="artifacts/tiny/traces/step.trace.json"' not in index
    assert index.count('<table id="footprint">') == 1 and index.rstrip().endswith("</html>")


def test_executed_notebooks_keep_their_text_and_the_pages_their_plots(tiny_reports):
    rep = tiny_reports["default"]
    nb = nbformat.read(rep / "notebooks" / "tiny.ipynb", as_version=4)
    mimes = {m for c in nb.cells for o in c.get("outputs", []) for m in (o.get("data") or {})}
    assert not mimes & set(footprint.PLOT_MIMES), mimes
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "tiny lab done 4" in text  # what nbval compares stays
    page = (rep / "html" / "tiny.html").read_text()
    assert "Bokeh" in page and "docs_json" in page  # the page still carries BokehJS and the plot
    assert (rep / "html" / "tiny.html").stat().st_size > 10 * (rep / "notebooks" / "tiny.ipynb").stat().st_size
    # the labs draw on canvas, so a page leaves BokehJS's WebGL bundle out and keeps the others
    assert "BEGIN bokeh.min.js" in page and "BEGIN bokeh-widgets.min.js" in page and "BEGIN panel.min.js" in page
    assert "BEGIN bokeh-gl.min.js" not in page and '"output_backend":"webgl"' not in page


def test_a_tqdm_bar_shows_its_final_state_in_the_page(tiny_reports):
    page = (tiny_reports["default"] / "html" / "tiny.html").read_text()
    assert page.count('class="perflab-progress"') == 1
    bar = page[page.index('class="perflab-progress"') :][:600]
    assert "tiny\u2007steps:\u2007100%" in bar and "4/4" in bar and 'value="4"' in bar and 'max="4"' in bar
    assert "0%|" not in page  # the frozen text form of the bar when it was first shown


def test_headless_kernels_say_nothing_about_tcp(tmp_path, capfd):
    """The runner's kernels talk over IPC: ipykernel's "running over TCP without encryption" line,
    once per lab on the terminal, is not printed at all."""
    assert IPCKernelManager().transport == "ipc"
    nb = make_notebook([("params", "reps = 1"), ("code", "print('hello', reps)")])
    (tmp_path / "one.ipynb").write_text(nbformat.writes(nb))
    suite = tmp_path / "one.yaml"
    suite.write_text(yaml.safe_dump({"description": "one", "notebooks": [{"notebook": str(tmp_path / "one.ipynb")}]}))
    res = run_suite(suite, out_dir=tmp_path / "r", progress=False)
    assert res.ok
    out, err = capfd.readouterr()
    assert TCP_WARNING not in err + out
    assert "hello 1" in json.dumps(nbformat.read(res.path / "notebooks" / "one.ipynb", as_version=4))


@pytest.mark.slow
def test_a_real_smoke_report_is_under_its_budget(smoke_report):
    """The smoke report was 173 MB (3 MB of JavaScript twice in each executed notebook, 59 MB of
    profiler traces): under 50 MB now, every byte in the table, no trace kept, no frozen bar."""
    files = _files(smoke_report)
    total = sum(files.values())
    kinds = footprint.bytes_by_kind(smoke_report)
    print(footprint.table_text(kinds))
    assert sum(k.bytes for k in kinds) == total
    assert total < footprint.SMOKE_BUDGET_BYTES, footprint.table_text(kinds)
    assert not [f for f in files if footprint.is_trace(Path(f))]
    for f in (smoke_report / "notebooks").glob("*.ipynb"):
        nb = json.loads(f.read_text())
        assert not [m for c in nb["cells"] for o in c.get("outputs", []) for m in o.get("data", {})
                    if m in footprint.PLOT_MIMES], f.name  # fmt: skip
    for f in (smoke_report / "html").glob("*.html"):
        assert "|          | 0/" not in f.read_text(), f"{f.name}: a progress bar frozen at its first state"
