"""The headless runner's promises, on notebooks whose execution is faked (no kernel): a failing
notebook is recorded and the suite goes on; a refusal in a lab's first cell is "refused"; the
report is written to a temporary folder and renamed only when complete, ``latest`` repointed
only then; a report that cannot be finished is marked incomplete and never renamed; Ctrl-C
keeps the finished notebooks apart and leaves ``latest`` alone; the environment is restored."""

import json
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
import yaml
from papermill.exceptions import PapermillExecutionError

from lab_utils.core.config import ConfigError
from lab_utils.core.records import Recorder
from lab_utils.run import runner
from lab_utils.run.nbtools import make_notebook
from lab_utils.run.suites import Refused, SuiteError, load_suite

CONFIG = "lab_utils.studies.ceilings:CeilingsLabConfig"  # a LabConfig with 'device' and 'reps' fields
NOISE = "USDT: ActivityProfilerHandler.cpp:42] profiler_start\n"


def _write_nb(path: Path, params: str, config: str | None = None) -> None:
    nb = make_notebook([("md", "# t"), ("params", params), ("code", "first()"), ("code", "second()")], config=config)
    path.write_text(nbformat.writes(nb))


class Fake:
    """papermill.execute_notebook replaced: each notebook does what ``behave[stem]`` says, its
    executed copy written as papermill would (parameters injected after the parameters cell)."""

    def __init__(self, behave, clock):
        self.behave, self.clock, self.calls, self.timeouts = behave, clock, [], []

    def __call__(self, src, dst, *, parameters, cwd, **kw):
        stem = Path(src).stem
        self.calls.append((stem, dict(parameters), cwd, dict(os.environ)))
        self.timeouts.append(kw["execution_timeout"])
        what = self.behave.get(stem, "ok")
        self.clock.t += 7.0  # every notebook runs 7 s of the runner's clock
        if what == "interrupt":
            raise KeyboardInterrupt
        if what == "crash":  # papermill itself failed: no executed notebook
            raise RuntimeError("  kernel died before it started  ")
        nb = nbformat.read(src, as_version=4)
        i = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
        src_inj = "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
        inj = nbformat.v4.new_code_cell(src_inj, metadata={"tags": ["injected-parameters"]})
        nb.cells.insert(i + 1, inj)
        code = [c for c in nb.cells if c.cell_type == "code" and not {"parameters", "injected-parameters"} & set(
            c.metadata.get("tags", []))]  # fmt: skip
        code[0].outputs = [nbformat.v4.new_output("stream", name="stderr", text=NOISE + "kept line\n")]
        err = None
        if what in ("fail", "refuse", "late_refuse"):
            ename = "RuntimeError" if what == "fail" else "ConfigError"
            evalue = "deliberate failure" if what == "fail" else "reps=-1 is not allowed"
            cell = code[1] if what == "late_refuse" else code[0]
            cell.outputs.append(nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[]))
            err = PapermillExecutionError(1, 1, "x", ename, evalue, [])
        else:
            Path(os.environ["PERFLAB_ARTIFACTS_DIR"], "trace.txt").write_text("x")
            rec = Recorder(stem, params=dict(parameters))
            rec.add("e", "v", "value", 3.0, "count")
            rec.add("e", "w", "value", 4.0, "count", trace=os.environ["PERFLAB_ARTIFACTS_DIR"] + "/trace.txt")
            printed = f"trace written to {os.environ['PERFLAB_ARTIFACTS_DIR']}/trace.txt\n"
            code[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text=printed)]
            rec.save()
        nbformat.write(nb, dst)
        if err is not None:
            raise err


@pytest.fixture
def lab(tmp_path, monkeypatch):
    pdir, nbs = tmp_path / "parameterized", tmp_path / "labs"
    (pdir / "sets" / "b").mkdir(parents=True)
    nbs.mkdir()
    clock = SimpleNamespace(t=100.0)
    monkeypatch.setattr(runner, "time", SimpleNamespace(perf_counter=lambda: clock.t, strftime=time.strftime))
    monkeypatch.setenv("PERFLAB_PARAMETERIZED", str(pdir))
    indexed = []

    def write_index(run_dir, suite, statuses, run_id, overrides):
        indexed.append([s.status for s in statuses])
        (run_dir / "index.html").write_text(f"<p>{run_id}</p>")
        return run_dir / "index.html"

    monkeypatch.setattr(runner.report, "write_index", write_index)
    monkeypatch.setattr(runner.report, "export_html", lambda nb, out, **kw: out.write_text("<html/>"))

    def make(suite: dict[str, str], behave: dict[str, str] | None = None, sets=None):
        entries = []
        for stem, params in suite.items():
            _write_nb(nbs / f"{stem}.ipynb", params)
            entries.append(
                {"notebook": str(nbs / f"{stem}.ipynb"), **({"set": sets[stem]} if sets and stem in sets else {})}
            )
        (pdir / "s.yaml").write_text(yaml.safe_dump({"description": "t", "notebooks": entries}))
        fake = Fake(behave or {}, clock)
        monkeypatch.setattr(runner.pm, "execute_notebook", fake)
        return fake

    return SimpleNamespace(make=make, out=tmp_path / "reports", pdir=pdir, nbs=nbs, indexed=indexed)


def _status(path: Path) -> dict:
    return {s["notebook"]: s for s in json.loads((path / "status.json").read_text())}


def test_a_failing_notebook_is_recorded_and_the_suite_goes_on(lab):
    fake = lab.make({"a": "reps = 5", "bad": "reps = 5", "crash": "x = 1", "c": "reps = 5"},
                    {"bad": "fail", "crash": "crash"})  # fmt: skip
    res = runner.run_suite("s", out_dir=lab.out, progress=False)
    assert [c[0] for c in fake.calls] == ["a", "bad", "crash", "c"]  # every notebook ran, in order
    assert not res.ok and [s.status for s in res.statuses] == ["ok", "failed", "failed", "ok"]
    st = {s.notebook: s for s in res.statuses}
    assert st["bad"].error == "RuntimeError: deliberate failure" and st["a"].error is None
    assert st["crash"].error == "RuntimeError:   kernel died before it started"
    assert st["crash"].ipynb is None and st["crash"].html is None  # nothing to show is not linked
    assert st["bad"].ipynb == "notebooks/bad.ipynb" and st["bad"].html == "html/bad.html"
    assert (res.path / "notebooks" / "bad.ipynb").exists() and (res.path / "html" / "bad.html").exists()
    # the records: every ok notebook's rows, none of a failed one's; status.json says the same
    assert st["a"].rows == 2 and st["c"].rows == 2 and st["bad"].rows == 0
    status = _status(res.path)
    assert list(status) == ["a", "bad", "crash", "c"] and status["bad"]["status"] == "failed"
    assert status["bad"]["error"] == "RuntimeError: deliberate failure" and "params" not in status["a"]
    assert all(s.seconds == pytest.approx(7.0) for s in res.statuses)
    assert lab.indexed == [["ok", "failed", "failed", "ok"]]
    # finished: renamed from its temporary folder, latest points at it
    assert res.path == lab.out / res.run_id and res.index == res.path / "index.html" and res.index.exists()
    assert not list(lab.out.glob(".tmp-*")) and (lab.out / "latest").resolve() == res.path.resolve()


def test_all_ok_is_ok():
    ok = runner.RunResult("r", Path("x"), [runner.NotebookStatus("a", "a.ipynb", status="ok")])
    assert ok.ok and not runner.RunResult("r", Path("x"), [*ok.statuses, runner.NotebookStatus("b", "b")]).ok
    s = runner.NotebookStatus("b", "b.ipynb")
    assert (s.status, s.error, s.seconds, s.rows, s.timings, s.unstable, s.html, s.ipynb, s.log) == (
        "pending", None, 0.0, 0, 0, 0, None, None, None,
    )  # fmt: skip


def test_the_executed_notebook_and_its_noise(lab):
    lab.make({"a": "reps = 5"})
    res = runner.run_suite("s", out_dir=lab.out, progress=False)
    nb = nbformat.read(res.path / "notebooks" / "a.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "kept line" in text and "profiler_start" not in text
    assert (res.path / "logs" / "a.noise.txt").read_text().splitlines() == [
        f"[cell 3] {NOISE.strip()}"
    ]  # md, parameters, injected, first code cell
    assert (res.path / "records" / "a" / "records.json").exists()


def test_paths_written_while_running_name_the_final_folder(lab):
    lab.make({"a": "reps = 5"})
    res = runner.run_suite("s", out_dir=lab.out, progress=False)
    final_trace = f"{res.path}/artifacts/a/trace.txt"
    page = (res.path / "notebooks" / "a.ipynb").read_text()
    assert f"trace written to {final_trace}" in page and ".tmp-" not in page
    rows = json.loads((res.path / "records.json").read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    extras = [json.dumps(r) for r in rows if "trace" in json.dumps(r)]
    assert len(extras) == 1 and final_trace in extras[0] and ".tmp-" not in extras[0]
    assert Path(final_trace).read_text() == "x"


def test_a_refusal_in_the_first_cell_is_refused_and_a_later_one_a_failure(lab):
    lab.make({"a": "reps = 5", "r": "reps = 5", "late": "reps = 5"}, {"r": "refuse", "late": "late_refuse"})
    with pytest.raises(Refused) as e:
        runner.run_suite("s", out_dir=lab.out, progress=False)
    msg = str(e.value)
    assert msg.startswith("r: ConfigError: reps=-1 is not allowed") and "late" not in msg.split("(")[0]
    final = next(p for p in lab.out.iterdir() if p.name != "latest" and not p.name.startswith("."))
    assert str(final / "index.html") in msg  # the others' report is kept and named
    status = _status(final)
    assert status["r"]["status"] == "refused" and status["late"]["status"] == "failed" and status["a"]["status"] == "ok"
    assert (lab.out / "latest").resolve() == final.resolve()


def test_when_every_notebook_refuses_nothing_is_kept(lab):
    lab.make({"r": "reps = 5", "q": "reps = 5"}, {"r": "refuse", "q": "refuse"})
    with pytest.raises(Refused) as e:
        runner.run_suite("s", out_dir=lab.out, progress=False)
    assert "r: ConfigError" in str(e.value) and "q: ConfigError" in str(e.value) and "nothing was run" in str(e.value)
    assert [p.name for p in lab.out.iterdir()] == []


def test_a_report_that_cannot_be_finished_is_marked_and_never_becomes_latest(lab, monkeypatch):
    lab.make({"a": "reps = 5"})
    first = runner.run_suite("s", out_dir=lab.out, progress=False)

    def broken(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(runner.report, "write_index", broken)
    with pytest.raises(OSError, match="disk full"):
        runner.run_suite("s", out_dir=lab.out, progress=False)
    (tmp,) = lab.out.glob(".tmp-*")
    assert "disk full" in (tmp / "REPORT_INCOMPLETE.txt").read_text()
    assert sorted(p.name for p in lab.out.iterdir() if not p.name.startswith(".")) == sorted([first.run_id, "latest"])
    assert (lab.out / "latest").resolve() == first.path.resolve()


@pytest.mark.parametrize("at", [0, 1, 2])
def test_ctrl_c_keeps_the_finished_notebooks_apart_and_latest_alone(lab, at):
    stems = ["a", "b", "c"]
    lab.make({s: "reps = 5" for s in stems})
    first = runner.run_suite("s", out_dir=lab.out, progress=False)
    lab.make({s: "reps = 5" for s in stems}, {stems[at]: "interrupt"})
    with pytest.raises(runner.RunInterrupted) as e:
        runner.run_suite("s", out_dir=lab.out, progress=False)
    msg = str(e.value)
    assert f"interrupted during {stems[at]}" in msg and f"({at} of 3 notebooks done)" in msg
    assert str(lab.out / "latest") in msg and "unchanged" in msg
    assert (lab.out / "latest").resolve() == first.path.resolve() and not list(lab.out.glob(".tmp-*"))
    kept = list(lab.out.glob("*-interrupted"))
    if at == 0:
        assert kept == [] and "no notebook had finished, nothing was kept" in msg
        return
    (k,) = kept
    assert (
        str(k) in msg
        and sorted(json.loads((k / "status.json").read_text())[i]["notebook"] for i in range(at)) == stems[:at]
    )
    assert (k / "INTERRUPTED.txt").read_text() == (
        f"run {k.name.removesuffix('-interrupted')} was interrupted during {stems[at]}; "
        f"these notebooks had finished: {', '.join(stems[:at])}\n"
    )
    for s in stems[:at]:
        assert (k / "notebooks" / f"{s}.ipynb").exists() and (k / "records" / s / "records.json").exists()
    for s in stems[at:]:  # the one running and the ones after it: nothing of theirs
        assert not (k / "notebooks" / f"{s}.ipynb").exists() and not (k / "records" / s).exists()
        assert not (k / "artifacts" / s).exists() and not (k / "html" / f"{s}.html").exists()


def test_ctrl_c_while_the_report_is_written_keeps_every_notebook(lab, monkeypatch):
    lab.make({"a": "reps = 5"})

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.report, "write_index", interrupted)
    with pytest.raises(runner.RunInterrupted, match=r"during the report.*\(1 of 1 notebooks done\)"):
        runner.run_suite("s", out_dir=lab.out, progress=False)
    (k,) = lab.out.glob("*-interrupted")
    assert (k / "notebooks" / "a.ipynb").exists() and (k / "records" / "a" / "records.json").exists()
    assert not (lab.out / "latest").exists()


def test_the_environment_the_kernels_see_and_its_restoring(lab, monkeypatch):
    monkeypatch.setenv("PERFLAB_RUN_ID", "outer")
    monkeypatch.delenv("PERFLAB_RECORDS_DIR", raising=False)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    fake = lab.make({"a": "reps = 5", "b": "reps = 5"}, {"b": "fail"})
    res = runner.run_suite("s", out_dir=lab.out, progress=False)
    for stem, _params, cwd, env in fake.calls:
        assert env["PERFLAB_RUN_ID"] == res.run_id and env["TQDM_DISABLE"] == "1"
        assert env["PERFLAB_RECORDS_DIR"] == str(lab.out / f".tmp-{res.run_id}" / "records" / stem)
        assert env["PERFLAB_ARTIFACTS_DIR"] == str(lab.out / f".tmp-{res.run_id}" / "artifacts" / stem)
        assert cwd == str(lab.nbs) and str(lab.nbs) in env[runner.STEP_PATH_ENV].split(os.pathsep)
    assert os.environ["PERFLAB_RUN_ID"] == "outer" and "PERFLAB_RECORDS_DIR" not in os.environ
    assert "TQDM_DISABLE" not in os.environ


def test_overrides_reach_only_the_notebooks_that_have_the_parameter(lab):
    fake = lab.make({"a": "reps = 5\ndevice = 'cpu'", "b": "device = 'cpu'", "c": "reps = 5"}, sets={"b": "small"})
    (lab.pdir / "sets" / "b" / "small.yaml").write_text("device: cuda\n")
    runner.run_suite("s", out_dir=lab.out, progress=False, overrides={"reps": 3}, only=["a", "b"])
    assert [(c[0], c[1]) for c in fake.calls] == [("a", {"reps": 3}), ("b", {"device": "cuda"})]


def test_plan_validates_every_notebook_before_anything_runs(lab):
    lab.make({"a": "reps = 5\ndevice = 'cpu'", "b": "device = 'cpu'"})
    s = load_suite("s")
    p = runner.plan(s, {"reps": 2})
    assert [(q.entry.stem, q.params, q.resolved) for q in p] == [
        ("a", {"reps": 2}, {"reps": 2, "device": "cpu"}), ("b", {}, {"device": "cpu"}),
    ]  # fmt: skip
    assert [q.entry.stem for q in runner.plan(s, None, ["b"])] == ["b"]
    with pytest.raises(SuiteError, match=r"--param reps: no notebook of suite s"):
        runner.plan(s, {"reps": 2}, ["b"])
    with pytest.raises(SuiteError, match=r"--param nope"):
        runner.plan(s, {"nope": 1})


def test_a_suite_parameter_the_notebook_lacks_or_its_config_refuses(lab):
    _write_nb(lab.nbs / "a.ipynb", "reps = 5\ndevice = 'cpu'", config=CONFIG)
    suite = {"description": "t", "notebooks": [{"notebook": str(lab.nbs / "a.ipynb"), "params": {"device": "gpu"}}]}
    (lab.pdir / "s.yaml").write_text(yaml.safe_dump(suite))
    with pytest.raises(ConfigError) as e:
        runner.plan(load_suite("s"))
    assert e.value.param == "device" and "(in a)" in str(e.value)
    suite["notebooks"][0]["params"] = {"colour": "red"}
    (lab.pdir / "s.yaml").write_text(yaml.safe_dump(suite))
    with pytest.raises(
        SuiteError, match=r"'colour' \(suite s, a\) is not a parameter of a.ipynb; its parameters: reps, device"
    ):
        runner.plan(load_suite("s"))
    suite["notebooks"][0]["params"] = {"reps": 3}
    (lab.pdir / "s.yaml").write_text(yaml.safe_dump(suite))
    (q,) = runner.plan(load_suite("s"))
    assert q.params == {"reps": 3} and q.resolved == {"reps": 3, "device": "cpu"}


def test_report_folders_are_created_exclusively(tmp_path, monkeypatch):
    rid, tmp = runner._make_run_dir(tmp_path / "r", "run1", "s")
    assert rid == "run1" and tmp == tmp_path / "r" / ".tmp-run1"
    assert sorted(p.name for p in tmp.iterdir()) == ["artifacts", "html", "notebooks", "records"]
    with pytest.raises(SuiteError, match="another run is writing"):
        runner._make_run_dir(tmp_path / "r", "run1", "s")
    (tmp_path / "r" / "run2").mkdir()
    with pytest.raises(SuiteError, match="already exists"):
        runner._make_run_dir(tmp_path / "r", "run2", "s")
    ids = iter(["run1", "run2", "run3"])  # generated ids: the ones taken are skipped
    monkeypatch.setattr(runner, "new_run_id", lambda name: next(ids))
    assert runner._make_run_dir(tmp_path / "r", None, "s")[0] == "run3"
    calls = []
    monkeypatch.setattr(runner, "new_run_id", lambda name: calls.append(1) or "run2")
    with pytest.raises(SuiteError, match="could not create a fresh report folder"):
        runner._make_run_dir(tmp_path / "r", None, "s")
    assert len(calls) == 5  # a few tries, never a loop for ever


def test_a_report_folder_is_made_with_the_folders_above_it(tmp_path):
    out = tmp_path / "not" / "yet" / "reports"  # none of these exists
    rid, tmp = runner._make_run_dir(out, "run1", "s")
    assert rid == "run1" and tmp.is_dir() and tmp.parent == out
    rid, tmp = runner._make_run_dir(out, "run2", "s")  # and again, now that it exists
    assert tmp == out / ".tmp-run2" and tmp.is_dir()


def test_run_ids_name_the_suite_and_differ():
    a, b = runner.new_run_id("smoke"), runner.new_run_id("smoke")
    assert a != b and re.fullmatch(rf"\d{{8}}-\d{{6}}-smoke-p{os.getpid()}-[0-9a-f]{{6}}", a), a


def test_step_path_keeps_what_it_held_then_cwd_then_each_notebooks_folder(tmp_path):
    p = [SimpleNamespace(entry=SimpleNamespace(notebook=tmp_path / d / "x.ipynb")) for d in ("l1", "l2", "l1")]
    got = runner.step_path(f"/a{os.pathsep}{os.pathsep}/b", p).split(os.pathsep)
    assert got == ["/a", "/b", os.getcwd(), str(tmp_path / "l1"), str(tmp_path / "l2")]
    assert runner.step_path(None, []) == os.getcwd()


def test_error_of_names_the_error_and_its_message():
    assert runner._error_of(ValueError(" bad  ")) == "ValueError:  bad"
    e = PapermillExecutionError(0, 1, "x", "RankCrashed", "rank 1 died", [])
    assert runner._error_of(e) == "RankCrashed: rank 1 died"


def test_a_notebook_whose_page_cannot_be_exported_is_failed_not_ok(lab, monkeypatch):
    lab.make({"a": "reps = 5", "bad": "reps = 5"}, {"bad": "fail"})

    def export(nb, out, **kw):
        raise OSError("no space left")

    monkeypatch.setattr(runner.report, "export_html", export)
    res = runner.run_suite("s", out_dir=lab.out, progress=False)
    a, bad = res.statuses
    assert a.status == "failed" and a.error == "HTML export failed: OSError: no space left" and a.html is None
    assert (
        bad.status == "failed"
        and bad.error == "RuntimeError: deliberate failure; HTML export failed: OSError: no space left"
    )
    assert a.ipynb == "notebooks/a.ipynb" and not res.ok


def test_each_notebook_runs_under_the_per_notebook_time_limit(lab):
    fake = lab.make({"a": "reps = 5", "b": "reps = 5"})
    runner.run_suite("s", out_dir=lab.out, progress=False)
    runner.run_suite("s", out_dir=lab.out, progress=False, timeout_s=90)
    assert fake.timeouts == [30 * 60] * 2 + [90] * 2  # 30 minutes unless told otherwise


def test_labs_as_jobs_write_the_same_report_with_their_thread_share(lab, monkeypatch):
    """``jobs``: the labs run as jobs (faked here: each job's function called in this process, as
    submitit's would be in its own), each with its share of the timing threads; failures are rows."""
    fake = lab.make({"a": "reps = 5", "bad": "reps = 5", "c": "reps = 5"}, {"bad": "fail"})
    monkeypatch.setattr(runner.parallel, "visible_gpus", lambda: 0)
    submitted = []

    def fake_run_tasks(tasks, cluster, folder, *, max_running, devices, progress, desc, on_done):
        submitted.append((max_running, tuple(devices)))
        saved = dict(os.environ)
        for t in tasks:
            on_done(runner.parallel.Outcome(t.key, "ok", value=t.fn(*t.args), job_id=f"j-{t.key}"))
            os.environ.clear()
            os.environ.update(saved)  # a job's environment is its own

    monkeypatch.setattr(runner.parallel, "run_tasks", fake_run_tasks)
    for k in (runner.THREADS_ENV, runner.parallel.SHARE_ENV):
        monkeypatch.delenv(k, raising=False)
    res = runner.run_suite("s", out_dir=lab.out, progress=False, timing_threads=4, jobs={"parallel": 2}, timeout_s=77)
    assert submitted == [(2, ())] and fake.timeouts == [77] * 3
    assert [s.notebook for s in res.statuses] == ["a", "bad", "c"]
    assert [s.status for s in res.statuses] == ["ok", "failed", "ok"] and not res.ok
    assert res.statuses[1].error == "RuntimeError: deliberate failure"
    assert [s.ran_on for s in res.statuses] == [
        f"cpu, 2 of 4 timing threads (local job j-{k})" for k in ("a", "bad", "c")
    ]
    share = "4 timing threads shared by up to 2 labs running at once: 2 each"
    for stem, _p, _cwd, env in fake.calls:  # what each lab's kernel saw
        assert env[runner.THREADS_ENV] == "2" and env[runner.parallel.SHARE_ENV] == share
        assert env["PERFLAB_RECORDS_DIR"] == str(lab.out / f".tmp-{res.run_id}" / "records" / stem)
    assert runner.THREADS_ENV not in os.environ and runner.parallel.SHARE_ENV not in os.environ
    status = _status(res.path)
    assert list(status) == ["a", "bad", "c"] and status["a"]["rows"] == 2 and status["bad"]["rows"] == 0
    assert (lab.out / "latest").resolve() == res.path.resolve() and not list(lab.out.glob(".tmp-*"))
