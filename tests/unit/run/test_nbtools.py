"""Building and cleaning lab notebooks (``nbtools``): cells from code, the outputs nbval keeps, library
noise and left-out sections removed, and execution handed to nbclient (faked here: no kernel starts)."""

from __future__ import annotations

import nbformat
import pytest
from jupyter_core.paths import jupyter_runtime_dir

from lab_utils.run import nbtools

NOISE = "USDT: ActivityProfilerHandler.cpp:42] profiler_start\n"


def test_cells_are_built_in_order_with_their_kinds_and_tags():
    nb = nbtools.make_notebook(
        [("md", "\n# T\n"), ("params", "reps = 1", ["x"]), ("code", "a()\n"), ("code", "b()", ("slow", "y"))],
        config="m:C",
        title="t",
    )
    assert [(c.cell_type, c.source) for c in nb.cells] == [
        ("markdown", "# T"), ("code", "reps = 1"), ("code", "a()"), ("code", "b()")
    ]  # fmt: skip
    assert [c.metadata.get("tags") for c in nb.cells] == [None, ["parameters", "x"], None, ["slow", "y"]]
    assert nb.metadata["perflab"] == {"config": "m:C"} and nb.metadata["title"] == "t"
    assert "perflab" not in nbtools.make_notebook([("md", "x")]).metadata
    with pytest.raises(ValueError, match="cell kind 'raw' is not"):
        nbtools.make_notebook([("raw", "x")])


def _executed():
    nb = nbtools.make_notebook([("md", "# t"), ("code", "# NBVAL_CHECK_OUTPUT\nshow()"), ("code", "other()")])
    checked, other = nb.cells[1], nb.cells[2]
    checked.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="ok 3\n"),
        nbformat.v4.new_output("stream", name="stderr", text="warning\n"),
        nbformat.v4.new_output(
            "execute_result", data={"text/plain": "42", "text/html": "<b>42</b>"}, execution_count=1
        ),
        nbformat.v4.new_output("display_data", data={"image/png": "AAAA"}),
    ]
    other.outputs = [nbformat.v4.new_output("stream", name="stdout", text="not checked\n")]
    other.execution_count = 2
    other.metadata["execution"] = {"x": 1}
    nb.metadata["papermill"] = {}
    nb.metadata["widgets"] = {}
    return nb


def test_only_the_checked_cells_text_outputs_are_kept():
    nb = nbtools.strip_outputs(_executed())
    checked, other = nb.cells[1], nb.cells[2]
    assert [o.output_type for o in checked.outputs] == ["stream", "execute_result"]
    assert checked.outputs[0]["text"] == "ok 3\n" and checked.outputs[1]["data"] == {"text/plain": "42"}
    assert other.outputs == [] and other.execution_count is None and "execution" not in other.metadata
    assert "papermill" not in nb.metadata and "widgets" not in nb.metadata
    bad = _executed()
    bad.cells[1].outputs.append(nbformat.v4.new_output("error", ename="ValueError", evalue="no", traceback=[]))
    with pytest.raises(RuntimeError, match="checked cell raised: ValueError: no"):
        nbtools.strip_outputs(bad)


def test_library_noise_leaves_stderr_and_an_empty_stderr_goes():
    nb = nbtools.make_notebook([("md", "# t"), ("code", "a()"), ("code", "b()")])
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stderr", text=NOISE)]
    nb.cells[2].outputs = [
        nbformat.v4.new_output("stream", name="stderr", text="real warning\n" + NOISE),
        nbformat.v4.new_output("stream", name="stdout", text=NOISE),  # stdout is the lab's own: kept
    ]
    removed = nbtools.strip_noise(nb)
    assert removed == [f"[cell 1] {NOISE.strip()}", f"[cell 2] {NOISE.strip()}"]
    assert nb.cells[1].outputs == []
    assert [o["text"] for o in nb.cells[2].outputs] == ["real warning\n", NOISE]


def test_sections_a_step_lacks_are_dropped_and_named():
    nb = nbtools.make_notebook(
        [("md", "# t"), ("md", "## memory"), ("code", "m()"), ("md", "## speed"), ("code", "s()")]
    )
    nb.cells[1].metadata["tags"] = ["needs:memory_formula"]
    nb.cells[3].metadata["tags"] = ["needs:speed"]
    mark = {"perflab": {"absent": ["memory_formula"]}}
    nb.cells[2].outputs = [nbformat.v4.new_output("display_data", data={"text/plain": ""}, metadata=mark)]
    assert nbtools.drop_absent(nb) == ["memory_formula"]
    assert [c.source for c in nb.cells] == ["# t", "## speed", "s()"]
    assert nbtools.drop_absent(nb) == [] and len(nb.cells) == 3


class _FakeClient:
    calls: list = []

    def __init__(self, nb, **kw):
        self.nb, self.kw = nb, kw

    def execute(self):
        _FakeClient.calls.append((self.nb, self.kw))
        for c in self.nb.cells:
            if c.cell_type == "code":
                c.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran\n")]


@pytest.fixture
def fake_client(monkeypatch):
    _FakeClient.calls = []
    monkeypatch.setattr(nbtools, "NotebookClient", _FakeClient)
    return _FakeClient.calls


def test_execution_runs_in_the_notebooks_folder_over_ipc_with_twenty_minutes(fake_client, tmp_path):
    nb = nbtools.make_notebook([("code", "x()")])
    assert nbtools.execute(nb, tmp_path) is nb
    (got, kw), = fake_client  # fmt: skip
    assert got is nb and kw["timeout"] == 1200 and kw["kernel_name"] == "python3"
    assert kw["resources"] == {"metadata": {"path": str(tmp_path)}}
    assert kw["kernel_manager_class"] is nbtools.IPCKernelManager


def test_a_refreshed_lab_keeps_only_its_checked_outputs(fake_client, tmp_path):
    path = tmp_path / "lab.ipynb"
    nb = nbtools.make_notebook([("code", "# NBVAL_CHECK_OUTPUT\nx()"), ("code", "y()")])
    assert nbtools.write(nb, path, run=False) == path and fake_client == []
    assert nbtools.refresh(path) == path
    assert fake_client[0][1]["resources"] == {"metadata": {"path": str(tmp_path)}}
    back = nbformat.read(path, as_version=4)
    assert [len(c.outputs) for c in back.cells] == [1, 0] and back.cells[0].outputs[0]["text"] == "ran\n"


def test_each_kernel_has_sockets_of_its_own_in_the_runtime_folder():
    a, b = nbtools.IPCKernelManager(), nbtools.IPCKernelManager()
    assert a.transport == "ipc" and a.ip != b.ip
    assert a.ip.startswith(jupyter_runtime_dir()) and a.ip.endswith("-ipc")
