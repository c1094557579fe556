"""What a report keeps (``footprint``): executed notebooks without the plots' payloads, profiler traces
removed and listed, and where a report's bytes go, on small folders built here."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat

from lab_utils.run import footprint


def _write(root: Path, sizes: dict[str, int]) -> None:
    for rel, n in sizes.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * n)


def test_the_byte_table_counts_every_file_once_by_kind(tmp_path):
    sizes = {
        "html/a.html": 10,
        "notebooks/a.ipynb": 20,
        "artifacts/a/traces/s.trace.json": 30,
        "artifacts/a/w/trace-rank1.json": 5,
        "artifacts/a/memory/timeline.json": 40,
        "records.json": 50,
        "records.parquet": 7,
        "records/a/records.json": 60,
        "index.html": 70,
        "logs/a.noise.txt": 3,
    }
    for rel, n in sizes.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x" * n)
    rows = {k.kind: (k.files, k.bytes) for k in footprint.bytes_by_kind(tmp_path)}
    assert rows == {
        "HTML pages (html/)": (1, 10),
        "executed notebooks (notebooks/)": (1, 20),
        "profiler traces (artifacts/)": (2, 35),
        "other artifacts (artifacts/)": (1, 40),
        "records (records.*, records/)": (3, 117),
        "index, context, status, logs": (2, 73),
    }
    assert sum(b for _, b in rows.values()) == sum(sizes.values())
    assert "| all | 10 | 0.0 | 100% |" in footprint.table_text(footprint.bytes_by_kind(tmp_path))


def test_a_trace_outside_artifacts_is_counted_with_the_rest(tmp_path):
    """Only profiler traces under artifacts/ are the traces row; one elsewhere is one more file."""
    _write(tmp_path, {"stray.trace.json": 9, "artifacts/x.txt": 4})
    rows = {k.kind: (k.files, k.bytes) for k in footprint.bytes_by_kind(tmp_path)}
    assert rows["profiler traces (artifacts/)"] == (0, 0)
    assert rows["other artifacts (artifacts/)"] == (1, 4)
    assert rows["index, context, status, logs"] == (1, 9)


def test_the_smoke_budget_is_50_megabytes():
    assert footprint.SMOKE_BUDGET_BYTES == 50_000_000


def test_trace_names_are_told_from_other_files():
    for name in ("s.trace.json", "s.trace.json.gz", "w.pt.trace.json", "w.pt.trace.json.gz", "trace-rank3.json"):
        assert footprint.is_trace(Path("artifacts/a") / name), name
    for name in ("timeline.json", "trace.json", "records.json", "s.trace.json.txt", "rank3.json"):
        assert not footprint.is_trace(Path("artifacts/a") / name), name


def _plot_notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {"state": {"m": {"x": 1}}}
    cell = nbformat.v4.new_code_cell("plot()")
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="measured 3 rows\n"),
        nbformat.v4.new_output("display_data", data={"text/plain": "a table"}),
        nbformat.v4.new_output(
            "display_data",
            data={"application/javascript": "x" * 5000, "text/plain": ":Curve [x]"},
            metadata={"big": "y" * 100},
        ),
        nbformat.v4.new_output(
            "display_data", data={"application/vnd.holoviews_exec.v0+json": {}, "text/html": "<div>" + "z" * 5000}
        ),
    ]
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), cell]
    nbformat.write(nb, path)


def test_plot_payloads_leave_an_executed_notebook_and_its_text_stays(tmp_path):
    path = tmp_path / "a.ipynb"
    _plot_notebook(path)
    before = os.path.getsize(path)
    saved = footprint.strip_plot_payloads(path)
    after = os.path.getsize(path)
    assert saved == before - after and saved > 10_000
    nb = nbformat.read(path, as_version=4)
    outs = nb.cells[1].outputs
    assert outs[0]["text"] == "measured 3 rows\n" and outs[1]["data"] == {"text/plain": "a table"}
    assert outs[2]["data"] == {"text/plain": ":Curve [x]"} and outs[2]["metadata"] == {}
    assert outs[3]["data"] == {"text/plain": "(a plot: see this lab's page in html/)"}
    assert "widgets" not in nb.metadata


def test_traces_are_removed_and_listed_and_other_artifacts_kept(tmp_path):
    assert footprint.prune_traces(tmp_path) == []  # no artifacts/ at all
    _write(tmp_path, {"artifacts/b/w/trace-rank0.json": 5, "artifacts/a/s.pt.trace.json": 30})
    _write(tmp_path, {"artifacts/a/memory/timeline.json": 40, "notebooks/x.trace.json": 3})
    gone = footprint.prune_traces(tmp_path)
    assert gone == [("artifacts/a/s.pt.trace.json", 30), ("artifacts/b/w/trace-rank0.json", 5)]
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["artifacts/TRACES_NOT_KEPT.txt", "artifacts/a/memory/timeline.json", "notebooks/x.trace.json"]
    lines = (tmp_path / "artifacts" / footprint.NOT_KEPT).read_text().splitlines()
    assert "--keep-traces" in lines[0]
    assert lines[1:] == ["artifacts/a/s.pt.trace.json\t30", "artifacts/b/w/trace-rank0.json\t5"]
    assert footprint.prune_traces(tmp_path) == []  # nothing left to remove


def test_a_report_without_traces_gets_no_list(tmp_path):
    _write(tmp_path, {"artifacts/a/memory/timeline.json": 40})
    assert footprint.prune_traces(tmp_path) == []
    assert not (tmp_path / "artifacts" / footprint.NOT_KEPT).exists()
