"""Build lab notebooks from code, and keep only the outputs nbval should check.

Labs are committed with outputs stripped, except the cells marked
``# NBVAL_CHECK_OUTPUT`` whose deterministic text output (correctness verdicts,
shapes, counts, fixed-seed error figures) nbval compares on every ``make test``.
``refresh(path)`` executes a notebook at its default parameters and rewrites it that
way; run it after changing a lab on purpose (``perflab nb refresh labs/NN_x.ipynb``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path

import nbformat
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.paths import jupyter_runtime_dir
from nbclient import NotebookClient
from traitlets import CaselessStrEnum, default

from lab_utils.core.noise import split_noise

CHECK_MARK = "# NBVAL_CHECK_OUTPUT"


class IPCKernelManager(AsyncKernelManager):
    """A kernel reached over IPC (Unix sockets in the user's Jupyter runtime folder, named for this
    kernel alone) instead of TCP on localhost: a headless kernel has no reason to listen on a port,
    and over TCP without CurveZMQ keys ipykernel warns once per kernel ("Kernel is running over TCP
    without encryption"), which the runner printed once per lab."""

    transport = CaselessStrEnum(["tcp", "ipc"], default_value="ipc", config=True)

    @default("ip")
    def _own_socket_path(self) -> str:
        # jupyter_client's default, "kernel-ipc" in the working folder, is shared by two runs started
        # there at once: each kernel must have sockets of its own
        folder = jupyter_runtime_dir()
        os.makedirs(folder, exist_ok=True)
        return os.path.join(folder, f"perflab-{os.getpid()}-{uuid.uuid4().hex[:12]}-ipc")


def make_notebook(
    cells: Sequence[tuple], *, config: str | None = None, title: str | None = None
) -> nbformat.NotebookNode:
    """``cells``: ("md", text) | ("code", source) | ("params", source) | ("code", source, [tags]).

    ``config`` is "module:Class", the LabConfig the runner builds from the parameters to
    validate them before the notebook runs."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    if config:
        nb.metadata["perflab"] = {"config": config}
    if title:
        nb.metadata["title"] = title
    for c in cells:
        kind, src = c[0], c[1].strip("\n")
        tags = list(c[2]) if len(c) > 2 else []
        if kind == "md":
            nb.cells.append(nbformat.v4.new_markdown_cell(src))
        elif kind == "params":
            nb.cells.append(nbformat.v4.new_code_cell(src, metadata={"tags": ["parameters", *tags]}))
        elif kind == "code":
            nb.cells.append(nbformat.v4.new_code_cell(src, metadata={"tags": tags} if tags else {}))
        else:
            raise ValueError(f"cell kind {kind!r} is not 'md', 'code' or 'params'")
    return nb


def strip_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Keep text outputs of NBVAL_CHECK_OUTPUT cells only; drop everything else."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if CHECK_MARK in cell.source:
            kept = []
            for out in cell.get("outputs", []):
                if out.output_type == "stream" and out.name == "stdout":
                    kept.append(out)
                elif out.output_type in ("execute_result", "display_data") and "text/plain" in out.get("data", {}):
                    out = nbformat.from_dict({**out, "data": {"text/plain": out["data"]["text/plain"]}})
                    out.setdefault("metadata", {})
                    kept.append(out)
                elif out.output_type == "error":
                    raise RuntimeError(f"checked cell raised: {out.get('ename')}: {out.get('evalue')}")
            cell.outputs = kept
        else:
            cell.outputs = []
            cell.execution_count = None
    nb.metadata.pop("papermill", None)
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
    return nb


def strip_noise(nb: nbformat.NotebookNode) -> list[str]:
    """Remove known library log lines (:data:`lab_utils.core.noise.STREAM_NOISE`) from the stderr
    outputs of an executed notebook, in place; returns them, "[cell N] line", for a log file.
    A stderr output left empty is dropped; every other line stays where it was."""
    removed = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.get("outputs"):
            continue
        kept_outputs = []
        for out in cell.outputs:
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                text, dropped = split_noise(out.get("text", ""))
                removed += [f"[cell {i}] {d}" for d in dropped]
                if not text:
                    continue
                out["text"] = text
            kept_outputs.append(out)
        cell.outputs = kept_outputs
    return removed


def execute(nb: nbformat.NotebookNode, cwd: str | Path, timeout: int = 1200) -> nbformat.NotebookNode:
    NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        kernel_manager_class=IPCKernelManager,
        resources={"metadata": {"path": str(cwd)}},
    ).execute()
    return nb


def write(nb: nbformat.NotebookNode, path: str | Path, *, run: bool = True) -> Path:
    """Write a lab; with ``run`` execute it first so its checked cells carry outputs."""
    path = Path(path)
    if run:
        execute(nb, path.parent)
    strip_outputs(nb)
    nbformat.validate(nb)
    path.write_text(nbformat.writes(nb) + "\n")
    return path


def refresh(path: str | Path) -> Path:
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    return write(nb, path, run=True)
