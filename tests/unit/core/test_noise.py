"""Known library log lines stay out of notebooks and reports; real warnings stay visible.

The noise: kineto's ``profiler_start`` / ``profiler_stop`` markers on every profiled region
(C++, file descriptor 2), torchao's "Failed to load ....so" on import (machines without CUDA),
torch's Enum-constant deprecation that torchao triggers, DCP's single-process warning.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import nbformat
import pytest
import torch
import yaml

from lab_utils.core.noise import KINETO_MARKER, quiet_stderr_fd, split_noise
from lab_utils.model.train import TrainConfig, Trainer
from lab_utils.profiling.profiler import profile_training
from lab_utils.run.nbtools import make_notebook, strip_noise
from lab_utils.run.runner import run_suite

MARKER = "USDT:2026-12-03 15:59:15 23002:23002 SyncActivityProfilerHandler.cpp:52] profiler_start"


def test_split_noise_drops_known_lines_only():
    text = f"{MARKER}\nUserWarning: something real\n{MARKER.replace('start', 'stop')}\nlast line without newline"
    kept, dropped = split_noise(text)
    assert kept == "UserWarning: something real\nlast line without newline"
    assert dropped == [MARKER, MARKER.replace("start", "stop")]
    assert not KINETO_MARKER.search("USDT: profiler_start of something else")


def test_profiled_region_leaves_no_kineto_markers_but_keeps_other_stderr(capfd):
    with quiet_stderr_fd() as dropped:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            torch.ones(4).add_(1)
        os.write(2, b"a real line from C++\n")
    err = capfd.readouterr().err
    assert "ActivityProfilerHandler" not in err, err
    assert "a real line from C++" in err
    assert [d.split("] ")[-1] for d in dropped] == ["profiler_start", "profiler_stop"]


def test_profile_training_prints_no_kineto_markers(tmp_path, capfd):
    tr = Trainer(TrainConfig(device="cpu", num_samples=4, buckets=[[48, 48]], max_caption_len=8, ckpt_every=0))
    try:
        profile_training(tr, active=1, warmup=0, out_dir=tmp_path, memory=False)
    finally:
        tr.close()
    err = capfd.readouterr().err
    assert "ActivityProfilerHandler" not in err, err


def test_importing_torchao_and_dcp_without_a_group_leave_only_real_warnings():
    code = textwrap.dedent(
        """
        import logging, tempfile, warnings
        import lab_utils
        import torch, torchao
        import torch.distributed.checkpoint as dcp
        dcp.async_save({"a": torch.ones(2)}, checkpoint_id=tempfile.mkdtemp()).result()
        logging.getLogger("torchao").warning("a real torchao warning")
        warnings.warn("a real warning")
        """
    )
    r = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "is an Enum subclass" not in r.stderr and "torch.distributed is disabled" not in r.stderr, r.stderr
    if not torch.cuda.is_available():  # on a CUDA machine a CUDA extension that fails to load matters
        assert "Failed to load" not in r.stderr, r.stderr
    assert "a real torchao warning" in r.stderr and "UserWarning: a real warning" in r.stderr


def test_strip_noise_moves_known_lines_out_of_stderr_outputs():
    nb = make_notebook([("code", "x = 1"), ("code", "y = 2")])
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stderr", text=f"{MARKER}\n")]
    nb.cells[1].outputs = [
        nbformat.v4.new_output("stream", name="stderr", text=f"{MARKER}\nreal warning\n"),
        nbformat.v4.new_output("stream", name="stdout", text=f"{MARKER}\n"),  # stdout is the lab's own text
    ]
    assert strip_noise(nb) == [f"[cell 0] {MARKER}", f"[cell 1] {MARKER}"]
    assert nb.cells[0].outputs == []
    assert [o["text"] for o in nb.cells[1].outputs] == ["real warning\n", f"{MARKER}\n"]


@pytest.fixture
def noisy_suite(tmp_path, monkeypatch):
    pdir, labs = tmp_path / "parameterized", tmp_path / "labs"
    pdir.mkdir()
    labs.mkdir()
    head, tail = MARKER.split("Sync")  # the cell's source must not hold the line it prints
    body = (
        f"import sys\nprint({head!r} + 'Sync' + {tail!r}, file=sys.stderr)\n"
        "print('a real ' + 'warning', file=sys.stderr)"
    )
    nb = make_notebook(
        [("params", 'device = "cpu"\nreps = 5'), ("code", body)], config="lab_utils.studies.ceilings:CeilingsLabConfig"
    )
    (labs / "noisy.ipynb").write_text(nbformat.writes(nb))
    (pdir / "noisy.yaml").write_text(
        yaml.safe_dump({"description": "noise", "notebooks": [{"notebook": str(labs / "noisy.ipynb")}]})
    )
    monkeypatch.setenv("PERFLAB_PARAMETERIZED", str(pdir))
    return tmp_path


def test_report_page_has_no_known_noise_and_keeps_real_warnings(noisy_suite):
    res = run_suite("noisy", out_dir=noisy_suite / "reports", progress=False)
    assert res.ok, res.statuses
    page = (res.path / "html" / "noisy.html").read_text()
    assert "SyncActivityProfilerHandler" not in page
    assert "a real warning" in page
    assert (res.path / "logs" / "noisy.noise.txt").read_text() == f"[cell 1] {MARKER}\n"
