"""What a report's bytes are, and what a report keeps.

A smoke report was 173 MB: each executed notebook carried HoloViews' loader output (BokehJS and
Panel's JavaScript, 3 MB, twice: as JavaScript and as HoloViews' own MIME type), and the labs'
profiler traces stayed in ``artifacts/`` (a 26 MB trace for a 16 ms CPU step).  So, once a lab's
HTML page is exported (the page keeps the JavaScript inline: it must render alone, with no
network):

* :func:`strip_plot_payloads` leaves the executed notebook in ``notebooks/`` its code and text
  outputs (what nbval compares) and drops the plots' JavaScript and embedded documents, which
  the lab's page in ``html/`` shows;
* :func:`prune_traces` removes the profiler traces once the labs have read them, unless the run
  was asked to keep them (``perflab run --keep-traces``); what was removed is listed in
  ``artifacts/TRACES_NOT_KEPT.txt``.

:func:`bytes_by_kind` is the table of where a report's bytes go (the index shows it).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

import nbformat

#: MIME types of HoloViews / Bokeh / Panel outputs: the loader's JavaScript and each plot's
#: embedded document; a lab's HTML page carries them, its executed notebook need not
PLOT_MIMES = (
    "application/javascript",
    "application/vnd.holoviews_load.v0+json",
    "application/vnd.holoviews_exec.v0+json",
    "application/vnd.bokehjs_load.v0+json",
    "application/vnd.bokehjs_exec.v0+json",
)
#: file names of profiler traces (Kineto JSON: the torch profiler's, the distributed workers')
TRACE_PATTERNS = ("*.trace.json", "*.trace.json.gz", "*.pt.trace.json", "*.pt.trace.json.gz", "trace-rank*.json")
#: where a report lists the traces it did not keep
NOT_KEPT = "TRACES_NOT_KEPT.txt"
#: what ``perflab run`` keeps a smoke report under (tests/jobs/test_footprint.py holds a real one to it)
SMOKE_BUDGET_BYTES = 50 * 10**6


def is_trace(path: Path) -> bool:
    return any(fnmatch.fnmatch(path.name, p) for p in TRACE_PATTERNS)


def strip_plot_payloads(nb_path: Path) -> int:
    """Drop the plot payloads (:data:`PLOT_MIMES` and the HTML that goes with them) from an executed
    notebook's outputs, in place, keeping each output's text; returns the bytes saved."""
    before = nb_path.stat().st_size
    nb = nbformat.read(nb_path, as_version=4)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data")
            if not data or not any(m in data for m in PLOT_MIMES):
                continue
            text = data.get("text/plain", "")
            out["data"] = {"text/plain": text or "(a plot: see this lab's page in html/)"}
            out["metadata"] = {}
    nb.metadata.pop("widgets", None)  # widget state: the page renders the final state of each bar
    nbformat.write(nb, nb_path)
    return before - nb_path.stat().st_size


def prune_traces(run_dir: Path) -> list[tuple[str, int]]:
    """Remove the profiler traces under ``run_dir/artifacts`` and list them (relative path, bytes)
    in ``artifacts/TRACES_NOT_KEPT.txt``; returns that list."""
    root = run_dir / "artifacts"
    if not root.is_dir():
        return []
    gone = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and is_trace(p):
            gone.append((p.relative_to(run_dir).as_posix(), p.stat().st_size))
            p.unlink()
    if gone:
        lines = [f"{path}\t{size}" for path, size in gone]
        (root / NOT_KEPT).write_text(
            "profiler traces the labs read and this report does not keep (rerun with `perflab run --keep-traces` "
            "to keep them; path, bytes):\n" + "\n".join(lines) + "\n",
            encoding="utf-8",
        )
    return gone


@dataclass(frozen=True)
class Kind:
    """One kind of file in a report and how many bytes it takes."""

    kind: str
    files: int
    bytes: int


#: the kinds of a report's files, in the order the table lists them: (kind, what matches it)
KINDS = (
    ("HTML pages (html/)", lambda rel: rel.startswith("html/")),
    ("executed notebooks (notebooks/)", lambda rel: rel.startswith("notebooks/")),
    ("profiler traces (artifacts/)", lambda rel: rel.startswith("artifacts/") and is_trace(Path(rel))),
    ("other artifacts (artifacts/)", lambda rel: rel.startswith("artifacts/")),
    ("records (records.*, records/)", lambda rel: rel.startswith("records")),
    ("index, context, status, logs", lambda rel: True),
)


def bytes_by_kind(run_dir: Path) -> list[Kind]:
    """Where a report's bytes go: one row per kind of file (:data:`KINDS`), every file counted once."""
    counts = {k: [0, 0] for k, _ in KINDS}
    for p in Path(run_dir).rglob("*"):
        if not p.is_file() or p.is_symlink():
            continue
        rel = p.relative_to(run_dir).as_posix()
        kind = next(k for k, match in KINDS if match(rel))
        counts[kind][0] += 1
        counts[kind][1] += p.stat().st_size
    return [Kind(k, n, b) for k, (n, b) in counts.items()]


def table_text(rows: list[Kind]) -> str:
    """The byte table as Markdown (what the README quotes)."""
    total = sum(r.bytes for r in rows)
    out = ["| kind | files | MB | share |", "|---|---:|---:|---:|"]
    out += [f"| {r.kind} | {r.files} | {r.bytes / 1e6:.1f} | {r.bytes / total:.0%} |" for r in rows if total]
    out.append(f"| all | {sum(r.files for r in rows)} | {total / 1e6:.1f} | 100% |")
    return "\n".join(out)
