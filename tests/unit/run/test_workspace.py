"""`make lab` works on git-ignored working copies of the labs: copies are made on first use, an
edited copy is kept, a lab changed since its copy is reported, reset gives fresh copies, and the
JupyterLab command line carries --allow-root exactly when running as root. No JupyterLab starts."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from lab_utils.run import workspace
from lab_utils.run.cli import main as cli_main

ROOT = workspace.ROOT


@pytest.fixture
def labs(tmp_path):
    d = tmp_path / "labs"
    d.mkdir()
    for name in ("00_a.ipynb", "01_b.ipynb"):
        (d / name).write_text(f'{{"cells": [], "name": "{name}"}}\n')
    return d


def test_first_use_creates_the_folder_and_copies(labs, tmp_path):
    work = tmp_path / "work" / "labs"
    done = workspace.prepare(labs, work)
    assert done.copied == ["00_a.ipynb", "01_b.ipynb"] and not done.kept and not done.stale
    for name in done.copied:
        assert (work / name).read_bytes() == (labs / name).read_bytes()
    assert any("copied to" in line for line in done.lines())


def test_an_edited_copy_is_kept(labs, tmp_path):
    work = tmp_path / "w"
    workspace.prepare(labs, work)
    (work / "00_a.ipynb").write_text("my exploration")
    done = workspace.prepare(labs, work)
    assert done.kept == ["00_a.ipynb", "01_b.ipynb"] and not done.copied and not done.stale
    assert (work / "00_a.ipynb").read_text() == "my exploration"


def test_a_new_lab_is_copied_beside_kept_copies(labs, tmp_path):
    work = tmp_path / "w"
    workspace.prepare(labs, work)
    (labs / "02_c.ipynb").write_text("{}")
    done = workspace.prepare(labs, work)
    assert done.copied == ["02_c.ipynb"] and done.kept == ["00_a.ipynb", "01_b.ipynb"]


def test_a_lab_changed_since_its_copy_is_reported_not_replaced(labs, tmp_path):
    work = tmp_path / "w"
    workspace.prepare(labs, work)
    (work / "01_b.ipynb").write_text("my exploration")  # edited after the copy: newer than the lab
    (labs / "01_b.ipynb").write_text('{"cells": ["changed upstream"]}\n')
    done = workspace.prepare(labs, work)
    assert done.stale == ["01_b.ipynb"]
    assert (work / "01_b.ipynb").read_text() == "my exploration"
    note = [line for line in done.lines() if "01_b" in line and "changed" in line]
    assert note and "make lab-reset LAB=01_b" in note[0]


def test_a_copy_without_manifest_is_stale_when_its_lab_is_newer(labs, tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    (work / "00_a.ipynb").write_text("old copy")
    (work / "01_b.ipynb").write_text("old copy")
    past = time.time() - 3600
    os.utime(work / "00_a.ipynb", (past, past))  # 00_a's lab is newer than its copy, 01_b's is not
    os.utime(labs / "01_b.ipynb", (past - 60, past - 60))
    done = workspace.prepare(labs, work)
    assert done.stale == ["00_a.ipynb"] and (work / "00_a.ipynb").read_text() == "old copy"


def test_reset_gives_fresh_copies(labs, tmp_path):
    work = tmp_path / "w"
    workspace.prepare(labs, work)
    for name in ("00_a.ipynb", "01_b.ipynb"):
        (work / name).write_text("explored")
    (labs / "00_a.ipynb").write_text("new lab")
    done = workspace.prepare(labs, work, reset=["00_a"])
    assert done.copied == ["00_a.ipynb"] and (work / "00_a.ipynb").read_text() == "new lab"
    assert (work / "01_b.ipynb").read_text() == "explored"
    assert not workspace.prepare(labs, work).stale  # the fresh copy is current
    done = workspace.prepare(labs, work, reset=True)
    assert done.copied == ["00_a.ipynb", "01_b.ipynb"] and (work / "01_b.ipynb").read_text() != "explored"
    with pytest.raises(ValueError, match="no such lab"):
        workspace.prepare(labs, work, reset=["99_missing"])


def test_the_working_folder_is_ignored_by_git():
    for path in (
        workspace.WORK_DIR / "05_memory.ipynb",
        workspace.WORK_DIR / workspace.MANIFEST,
        workspace.WORK_DIR / ".perflab" / "records" / "05_memory-x.json",  # rec.save() from a copy
    ):
        rel = path.relative_to(ROOT)
        r = subprocess.run(["git", "check-ignore", "-q", "--no-index", str(rel)], cwd=ROOT)
        assert r.returncode == 0, f"{rel} is not ignored by git"


@pytest.mark.parametrize("uid", [0, 1000])
def test_argv_allows_root_only_as_root(uid, tmp_path):
    argv = workspace.lab_argv(tmp_path, ["--no-browser"], uid=uid)
    assert argv[1:4] == ["-m", "jupyter", "lab"] and f"--notebook-dir={tmp_path}" in argv
    assert argv[-1] == "--no-browser"
    assert ("--allow-root" in argv) == (uid == 0)


def test_perflab_lab_reset_stops_without_starting_jupyter(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(workspace, "LABS_DIR", ROOT / "labs")
    monkeypatch.setattr(workspace.os, "execv", lambda *a: pytest.fail(f"JupyterLab started: {a}"))
    work = tmp_path / "w"
    assert cli_main(["lab", "--dir", str(work), "--prepare-only"]) == 0
    committed = sorted(p.name for p in (ROOT / "labs").glob("*.ipynb"))
    assert sorted(p.name for p in work.glob("*.ipynb")) == committed
    assert cli_main(["lab", "--dir", str(work), "--reset", "05_memory"]) == 0
    assert "05_memory.ipynb" in capsys.readouterr().out
    assert cli_main(["lab", "--dir", str(work), "--reset", "nope"]) == 2


def test_make_lab_opens_the_working_copies():
    """The Makefile's lab target goes through `perflab lab`, never JupyterLab on labs/ itself."""
    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^lab: .*\n((?:\t.*\n)+)", make, re.M)
    assert recipe and "perflab lab" in recipe.group(1) and "notebook-dir=labs" not in recipe.group(1)
    assert re.search(r"^lab-reset: .*\n\t.*perflab lab --reset", make, re.M)
