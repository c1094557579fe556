"""The headless runner on a throwaway suite with a deliberately failing notebook."""

import json
import re

import pytest
import yaml

from lab_utils.config import ConfigError
from lab_utils.run import cli
from lab_utils.run.nbtools import make_notebook
from lab_utils.run.runner import SuiteError, load_suite, parse_overrides, plan, run_suite

CONFIG = "lab_utils.studies.ceilings:CeilingsLabConfig"  # any LabConfig with 'device' and 'reps' fields


def _write_nb(path, body, params='device = "cpu"\nreps = 5'):
    import nbformat

    nb = make_notebook([("md", "# test"), ("params", params), ("code", body)], config=CONFIG)
    path.write_text(nbformat.writes(nb))


@pytest.fixture
def suite_dir(tmp_path, monkeypatch):
    pdir = tmp_path / "parameterized"
    (pdir / "sets" / "good").mkdir(parents=True)
    nbs = tmp_path / "labs"
    nbs.mkdir()
    _write_nb(
        nbs / "good.ipynb",
        "from lab_utils.records import Recorder\n"
        "import holoviews as hv\nfrom lab_utils.plots import init\ninit()\n"
        "rec = Recorder('good', params={'reps': reps})\n"
        "rec.add('e', 'v', 'value', float(reps), 'count')\nrec.save()\n"
        "hv.Curve([(0, 0), (1, reps)])",
    )
    _write_nb(nbs / "bad.ipynb", "raise ValueError('deliberate failure ' + str(reps))")
    (pdir / "sets" / "good" / "small.yaml").write_text("reps: 7\n")
    (pdir / "mini.yaml").write_text(
        yaml.safe_dump(
            {
                "description": "test suite",
                "notebooks": [
                    {"notebook": str(nbs / "bad.ipynb")},
                    {"notebook": str(nbs / "good.ipynb"), "set": "small"},
                ],
            }
        )
    )
    monkeypatch.setenv("PERFLAB_PARAMETERIZED", str(pdir))
    return tmp_path


def test_failing_notebook_does_not_stop_the_suite(suite_dir):
    out = suite_dir / "reports"
    res = run_suite("mini", out_dir=out, progress=False)
    assert not res.ok
    st = {s.notebook: s for s in res.statuses}
    assert st["bad"].status == "failed" and "deliberate failure 5" in st["bad"].error
    assert st["good"].status == "ok" and st["good"].rows == 1
    # complete report, nothing left half-written
    assert res.path.exists() and not list(out.glob(".tmp-*"))
    assert (out / "latest").resolve() == res.path.resolve()
    for f in (
        "index.html",
        "context.json",
        "status.json",
        "records.parquet",
        "records.json",
        "notebooks/good.ipynb",
        "notebooks/bad.ipynb",
        "html/good.html",
        "html/bad.html",
    ):
        assert (res.path / f).exists(), f
    index = (res.path / "index.html").read_text()
    assert "1 of 2 FAILED" in index and "deliberate failure" in index and 'href="html/good.html"' in index
    recs = json.loads((res.path / "records.json").read_text())
    assert len(recs) == 1 and recs[0]["value"] == 7.0 and recs[0]["notebook"] == "good"
    assert recs[0]["run_id"] == res.run_id and recs[0]["device_kind"] in ("cpu", "cuda")
    ctx = json.loads((res.path / "context.json").read_text())
    assert ctx["suite"] == "mini" and ctx["notebooks"][1]["params"]["reps"] == 7
    page = (res.path / "html" / "good.html").read_text()
    assert not re.search(r"<script[^>]+src=[\"']https?://", page), "report pages must not load remote scripts"
    assert "cdn.holoviz.org" not in page and "unpkg.com" not in page


def test_cli_exit_codes_and_overrides(suite_dir, capsys):
    rc = cli.main(
        ["run", "mini", "--out", str(suite_dir / "r"), "--no-progress", "--param", "reps=4", "--only", "good"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "report:" in out and "ok     good" in out
    assert cli.main(["run", "mini", "--out", str(suite_dir / "r2"), "--no-progress"]) == 1
    assert cli.main(["run", "--list"]) == 0
    assert "mini: test suite" in capsys.readouterr().out


def test_validation_happens_before_anything_runs(suite_dir, capsys):
    out = suite_dir / "never"
    with pytest.raises(SuiteError, match="'nope' does not exist; known suites: mini"):
        run_suite("nope", out_dir=out)
    with pytest.raises(SuiteError, match="--param bogus"):
        run_suite("mini", overrides={"bogus": 1}, out_dir=out)
    with pytest.raises(ConfigError, match="'reps' = 1"):
        run_suite("mini", overrides={"reps": 1}, out_dir=out)
    with pytest.raises(SuiteError, match="--only"):
        run_suite("mini", only=["missing"], out_dir=out)
    assert not out.exists()
    assert cli.main(["run", "mini", "--param", "reps=1", "--out", str(out)]) == 2
    assert "'reps' = 1 is not allowed" in capsys.readouterr().err


def test_suite_file_errors(suite_dir):
    pdir = suite_dir / "parameterized"
    (pdir / "broken.yaml").write_text("notebooks: []\n")
    with pytest.raises(SuiteError, match="non-empty list"):
        load_suite("broken")
    (pdir / "noset.yaml").write_text(
        yaml.safe_dump({"notebooks": [{"notebook": str(suite_dir / "labs" / "good.ipynb"), "set": "huge"}]})
    )
    with pytest.raises(SuiteError, match="parameter set 'huge'.*known sets: small"):
        load_suite("noset")
    (pdir / "badparam.yaml").write_text(
        yaml.safe_dump({"notebooks": [{"notebook": str(suite_dir / "labs" / "good.ipynb"), "params": {"nonsense": 3}}]})
    )
    with pytest.raises(SuiteError, match="'nonsense'.*its parameters: device, reps"):
        plan(load_suite("badparam"))
    (pdir / "missing.yaml").write_text(yaml.safe_dump({"notebooks": ["labs/none.ipynb"]}))
    with pytest.raises(SuiteError, match="does not exist"):
        load_suite("missing")


def test_parse_overrides():
    assert parse_overrides(["a=1", "b=[1, 2]", "c=bfloat16", "d=true"]) == {
        "a": 1,
        "b": [1, 2],
        "c": "bfloat16",
        "d": True,
    }
    with pytest.raises(SuiteError, match="key=value"):
        parse_overrides(["novalue"])


def test_real_suites_are_valid():
    """Every committed suite loads and validates (parameter names and values) without running."""
    from pathlib import Path

    from lab_utils.run.runner import list_suites

    names = list_suites()
    assert "smoke" in names and "gpu" in names
    for name in names:
        s = load_suite(name)
        if name == "gpu":
            continue  # GPU parameter sets may name device='cuda', refused on a CPU machine by design
        plan(s)
    smoke = {e.stem for e in load_suite("smoke").entries}
    labs = {p.stem for p in (Path(__file__).resolve().parents[1] / "labs").glob("[0-9][0-9]_*.ipynb")}
    assert labs <= smoke, f"labs missing from the smoke suite: {sorted(labs - smoke)}"
