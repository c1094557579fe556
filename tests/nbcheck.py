"""nbval's check of a lab's committed outputs, applied to a notebook that was already executed.

``make test`` used to run every lab twice on a CPU machine: once for the browser tests' smoke
report and once more under nbval, at parameters that resolve to the same values (the smoke
sets are the labs' defaults with ``device: cpu``, ``backend: gloo`` for "auto").  This module
lets a test take the smoke run's executed notebook instead, when it is the same run nbval
would make, and compare it the way nbval does (``nbval.plugin``'s own functions: streams
coalesced, ``metadata``/``execution_count``/images not compared, every other output field and
mime type compared as text, in order).
"""

from __future__ import annotations

import copy
import json
from collections import defaultdict

import nbformat
from nbval.plugin import (
    IPyNbCell,
    IPyNbFile,
    coalesce_streams,
    find_comment_markers,
    find_metadata_tags,
    nocolors,
)

# nbval's IPyNbFile.skip_compare without --nbdime (the project's options), read off a collector
# built the way nbval builds it, so a change of nbval's list shows up here.
SKIP_COMPARE = (
    "metadata",
    "traceback",
    "prompt_number",
    "output_type",
    "name",
    "execution_count",
    "application/vnd.jupyter.widget-view+json",
    "image/png",
    "image/jpeg",
)


class _Comparer:
    """Just enough of an ``IPyNbCell`` for nbval's ``compare_outputs`` (no sanitize patterns:
    the project passes no ``--nbval-sanitize-with``)."""

    colors = nocolors

    class parent:  # noqa: N801 - the attribute nbval reads
        skip_compare = SKIP_COMPARE

    compare_outputs = IPyNbCell.compare_outputs
    format_output_compare = IPyNbCell.format_output_compare
    config = None

    class ihook:  # noqa: N801 - no pytest diff here: nbval falls back to printing both outputs
        @staticmethod
        def pytest_assertrepr_compare(**_):
            return [None]

    def sanitize(self, s):
        return s


def is_checked(cell) -> bool:
    """nbval's reading of a cell's options: comment markers over metadata tags."""
    opts = defaultdict(bool, find_metadata_tags(cell.metadata))
    opts.update(dict(find_comment_markers(cell.source)))
    return bool(opts["check"]) and not opts["skip"]


def code_cells(nb) -> list:
    """The lab's code cells; papermill's injected-parameters cell is not one of them."""
    return [c for c in nb.cells if c.cell_type == "code" and "injected-parameters" not in c.metadata.get("tags", [])]


def compare_checked(committed, executed) -> list[str]:
    """What nbval --nbval-lax would report for ``executed`` against the ``committed`` lab: one
    message per cell (empty when it would pass).  The executed notebook must hold the same code,
    cell for cell; a cell that raised is a failure whether or not it is checked."""
    ref, run = code_cells(committed), code_cells(executed)
    if [c.source for c in ref] != [c.source for c in run]:
        return ["the executed notebook's code cells are not the committed lab's (another version of the lab?)"]
    problems = []
    for i, (r, e) in enumerate(zip(ref, run)):
        errors = [o for o in e.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            problems.append(f"Cell {i}: cell execution caused an exception: {errors[0].ename}: {errors[0].evalue}")
            continue
        if r.execution_count is None:  # nbval does not compare a cell whose reference was not run
            if r.get("outputs"):
                problems.append(f"Cell {i}: unrun reference cell has outputs")
            continue
        if not is_checked(r):
            continue
        c = _Comparer()
        test = coalesce_streams(copy.deepcopy(list(e.get("outputs", []))))
        if not c.compare_outputs(test, coalesce_streams(copy.deepcopy(list(r.outputs)))):
            diff = "\n".join(str(x) for x in c.comparison_traceback)
            problems.append(f"Cell {i}: Cell outputs differ\n{r.source}\n{diff}")
    return problems


def nbval_skip_compare() -> tuple:
    """nbval's own list, for the test that pins :data:`SKIP_COMPARE` to it."""
    src = IPyNbFile.__init__.__code__.co_consts
    return tuple(x for c in src if isinstance(c, tuple) for x in c)


def lab_defaults(nb) -> dict:
    """The values of the lab's parameters cell (plain assignments of literals)."""
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    ns: dict = {}
    exec(cell.source, ns)  # our own committed lab
    return {k: v for k, v in ns.items() if not k.startswith("__")}


def _norm(v):
    return json.loads(json.dumps(v))


def same_as_defaults(params: dict, defaults: dict, *, cuda: bool) -> list[str]:
    """The injected parameters that make a run differ from one at the lab's defaults on this
    machine ("auto" resolves to "cpu" for a device, "gloo" for a backend without CUDA)."""
    auto_is = {"device": "cuda" if cuda else "cpu", "backend": "nccl" if cuda else "gloo"}
    diffs = []
    for k, v in params.items():
        if k not in defaults:
            diffs.append(f"{k}={v!r} (not a parameter of the lab)")
            continue
        d = defaults[k]
        if d == "auto" and k in auto_is and v == auto_is[k]:
            continue
        if _norm(v) != _norm(d):
            diffs.append(f"{k}={v!r} (default {d!r})")
    return diffs


def read(path):
    return nbformat.read(str(path), as_version=4)
