"""What you explore is kept.

Every explored result reaches the lab's records file as it is measured (the save cell of a
Run All runs before any exploration); every save of a session rewrites one file per lab
instead of piling up a new one; a rerun of the lab in the same kernel does not overwrite
the explored results of the run before it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import ClassVar

import holoviews as hv
import pytest

from lab_utils.core import records
from lab_utils.core.records import Recorder, load_records
from lab_utils.studies.explore import Control, Explorer, Progress, Result


@dataclass
class Square(Explorer):
    lab: ClassVar[str] = "99_kept"
    title: ClassVar[str] = "Square"
    controls: ClassVar[tuple[Control, ...]] = (Control("n", (1, 2, 3), 1),)

    def measure(self, cfg, progress: Progress) -> Result:
        self.rec.add("explore", f"n{cfg['n']}", "square", cfg["n"] ** 2, "")
        return Result(0, cfg, dict(n=cfg["n"]))

    def figures(self, results):
        return [hv.Scatter([(r.row["n"], r.row["n"] ** 2) for r in results])]


@pytest.fixture
def interactive(tmp_path, monkeypatch):
    """A kernel session outside ``perflab run``: records go under ``./.perflab/records``."""
    monkeypatch.delenv("PERFLAB_RECORDS_DIR", raising=False)
    monkeypatch.delenv("PERFLAB_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(records, "_WRITERS", {}, raising=False)
    clock = iter(range(10_000))  # every call to strftime a new second: a timestamped name would change
    real = time.strftime
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: real(fmt, time.gmtime(1_700_000_000 + next(clock))))
    return tmp_path / ".perflab" / "records"


def _explored(path) -> list[str]:
    df = load_records(path)
    return sorted(df.loc[df["experiment"] == "explore", "variant"])


def test_explored_results_reach_the_records_file_as_they_are_measured(interactive):
    rec = Recorder("99_kept")
    rec.add("lab", "v", "m", 1.0)
    first = rec.save()  # the lab's save cell, run by Run All before anyone explores
    ex = Square(rec)
    ex.show(live=False)  # the explorer cell: its default point
    assert _explored(first) == ["n1"], "the explorer's default point is not in the records file"
    assert ex.run(n=2).ok and ex.run(n=3).ok  # the user explores after Run All: no save cell runs
    assert _explored(first) == ["n1", "n2", "n3"], "later choices never reached the records file"
    assert "saved to" in ex.status
    assert rec.save() == first  # the save cell after the explorer rewrites the same file
    assert sorted(p.name for p in interactive.iterdir()) == [first.name], "a save piled up another file"
    assert json.loads(first.read_text())["rows"][0]["experiment"] == "lab"


def test_a_rerun_rewrites_the_sessions_file_unless_it_holds_explored_results(interactive):
    a = Recorder("99_kept")
    a.add("lab", "v", "m", 1.0)
    pa = a.save()
    b = Recorder("99_kept")  # Run All again in the same kernel: a new recorder, nothing explored before
    b.add("lab", "v", "m", 2.0)
    assert b.save() == pa and len(list(interactive.iterdir())) == 1, "a rerun piled up a new file without need"
    Square(b).run(n=2)  # b explores: its file now holds explored results
    c = Recorder("99_kept")  # a third Run All must not overwrite them
    c.add("lab", "v", "m", 3.0)
    pc = c.save()
    assert pc != pa and pc.name.endswith("-2.json"), pc
    assert _explored(pa) == ["n2"] and _explored(pc) == []
    assert c.save() == pc and len(list(interactive.iterdir())) == 2
    other = Recorder("98_other")
    assert other.save().name.startswith("98_other-"), "each lab has a file of its own"


def test_a_headless_run_writes_the_runners_file_and_explorers_leave_it_to_the_save_cell(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFLAB_RECORDS_DIR", str(tmp_path))
    monkeypatch.setenv("PERFLAB_RUN_ID", "r1")
    rec = Recorder("99_kept")
    assert rec.save() == tmp_path / "records.json" and getattr(rec, "path", None) is None
    ex = Square(rec)
    ex.show(live=False)
    assert "saved" not in ex.status and _explored(tmp_path / "records.json") == []
    rec.save()
    assert _explored(tmp_path / "records.json") == ["n1"]
