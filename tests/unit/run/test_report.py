"""Report pieces (``report``): pages made self-contained, tqdm bars in their final state, paths moved to
the final folder, the gathered records, and the index's sections (unstable timings, the traces not
kept and their megabytes), on small inputs built here (no notebook runs)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import panel

from lab_utils.core.records import ROW_COLUMNS, StabilitySummary
from lab_utils.run import footprint, report


def test_the_webgl_bundle_goes_only_from_a_page_that_draws_nothing_with_it():
    gl = "/* BEGIN bokeh-gl.min.js */" + " webgl code" * 100 + " /* END bokeh-gl.min.js */"
    core = "/* BEGIN bokeh.min.js */ core /* END bokeh.min.js */"
    canvas = f'<script>{core}{gl}</script><script>docs_json = {{"output_backend":"canvas"}}</script>'
    dropped = report.drop_unused_webgl(canvas)
    assert "webgl code" not in dropped and "core" in dropped
    assert len(canvas) - len(dropped) > 900
    webgl = canvas.replace('"canvas"', '"webgl"')
    assert report.drop_unused_webgl(webgl) == webgl  # a plot that draws with WebGL keeps its bundle
    assert report.drop_unused_webgl(core) == core


def test_progress_html_reads_the_widget_state_and_leaves_other_widgets():
    def m(name, **state):
        return {"model_name": name, "state": state}

    models = {
        "box": m("HBoxModel", children=["IPY_MODEL_l", "IPY_MODEL_p", "IPY_MODEL_r"]),
        "l": m("HTMLModel", value="sweep: 50%"),
        "p": m("FloatProgressModel", value=8.0, max=16.0, min=0.0, bar_style=""),
        "r": m("HTMLModel", value=" 8/16 [00:01&lt;00:01]"),
        "dd": m("DropdownModel", value="a"),
        "vbox": m("HBoxModel", children=["IPY_MODEL_dd"]),
    }
    html = report.progress_html("box", models)
    assert 'value="8" max="16"' in html and 'data-fraction="0.5000"' in html and "sweep: 50%" in html
    assert report.progress_html("vbox", models) is None and report.progress_html("nope", models) is None


def test_a_bar_without_a_value_is_at_zero():
    models = {
        "box": {"model_name": "HBoxModel", "state": {"children": ["IPY_MODEL_l", "IPY_MODEL_p", "IPY_MODEL_r"]}},
        "l": {"model_name": "HTMLModel", "state": {"value": "a"}},
        "p": {"model_name": "IntProgressModel", "state": {"max": 10}},
        "r": {"model_name": "HTMLModel", "state": {"value": "b"}},
    }
    bar = report.progress_html("box", models)
    assert 'value="0" max="10"' in bar and 'data-fraction="0.0000"' in bar


def test_panels_stylesheets_are_inlined_from_the_installed_copy():
    rel = "bundled/bootstrap4/css/bootstrap-grid.min.css"
    want = base64.b64encode((Path(panel.__file__).parent / "dist" / rel).read_bytes()).decode()
    text = f'{{"stylesheets": ["https://cdn.holoviz.org/panel/1.4.4/dist/{rel}"]}}'
    assert report.make_self_contained(text) == f'{{"stylesheets": ["data:text/css;base64,{want}"]}}'
    missing = '"https://cdn.holoviz.org/panel/1.4.4/dist/css/no_such_sheet.css"'
    assert report.make_self_contained(missing) == missing


def test_an_executed_notebooks_paths_are_moved_to_the_final_folder(tmp_path):
    tmp, final = tmp_path / ".run-tmp", tmp_path / "run"
    f = tmp_path / "a.ipynb"
    f.write_text(f'{{"text": "trace written to {tmp}/artifacts/a.json"}}', encoding="utf-8")
    report.relocate_file(f, tmp, final)
    assert f.read_text(encoding="utf-8") == f'{{"text": "trace written to {final}/artifacts/a.json"}}'
    report.relocate_file(f, tmp, final)  # nothing left to move: as it was
    assert str(tmp) not in f.read_text(encoding="utf-8")


def _row(**kw):
    row = dict.fromkeys(ROW_COLUMNS)
    base = dict(lab="a", experiment="e", variant="v", shape="s", dtype="float32", metric="step_time", value=0.1 + 0.2)
    base.update(unit="s", statistic="median", samples=5, extra="{}", stable=True)
    return {**row, **base, **kw}


def test_the_gathered_records_hold_every_successful_notebooks_rows(tmp_path):
    (tmp_path / "records" / "a").mkdir(parents=True)
    rows = [_row(), _row(variant="w", value=2.5)]
    (tmp_path / "records" / "a" / "records.json").write_text(json.dumps({"rows": rows, "context": {"device": "cpu"}}))
    ok = SimpleNamespace(notebook="a", status="ok", params={"reps": 1})
    failed = SimpleNamespace(notebook="b", status="failed", params={})
    df = report.gather_records(tmp_path, [ok, failed], "r1")
    assert len(df) == 2 and list(df["notebook"]) == ["a", "a"] and list(df["run_id"]) == ["r1", "r1"]
    assert ok.rows == 2 and ok.timings == 2 and ok.unstable == 0 and not hasattr(failed, "rows")
    back = json.loads((tmp_path / "records.json").read_text())
    assert [r["value"] for r in back] == [0.1 + 0.2, 2.5]  # exact floats
    assert len(pd.read_parquet(tmp_path / "records.parquet")) == 2
    status = json.loads((tmp_path / "status.json").read_text())
    assert [s["notebook"] for s in status] == ["a", "b"] and "params" not in status[0]


def test_a_run_without_records_has_no_threads_banner(tmp_path):
    assert report._threads_banner(tmp_path, {}) == ""


def test_the_unstable_list_says_how_many_more_only_past_its_limit(tmp_path, monkeypatch):
    (tmp_path / "records.parquet").write_bytes(b"")
    monkeypatch.setattr(report, "load_records", lambda f: pd.DataFrame())
    for unstable, more in ((2, None), (3, "… 1 more")):
        summary = StabilitySummary(10, unstable, tuple(f"t{i}" for i in range(min(unstable, 2))))
        monkeypatch.setattr(report, "stability_summary", lambda df, examples, s=summary: s)
        page = report._unstable_section(tmp_path, limit=2)
        assert page.count("<li>") == 2 + (more is not None), page
        assert (more is None) == ("more (records" not in page), page
        if more:
            assert more in page


def _traces(run_dir: Path, sizes: dict[str, int]) -> None:
    for rel, n in sizes.items():
        p = run_dir / "artifacts" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * n)


def test_the_index_lists_the_artifacts_and_the_megabytes_of_the_traces_not_kept(tmp_path):
    _traces(tmp_path, {"a/s.trace.json": 1_500_000, "b/trace-rank0.json": 1_000_000, "a/memory/t.json": 3})
    (tmp_path / "index.html").write_text('<div id="files">OLD</div>\n<h2>Ceilings</h2>', encoding="utf-8")
    gone = report.drop_traces(tmp_path)
    assert gone == [("artifacts/a/s.trace.json", 1_500_000), ("artifacts/b/trace-rank0.json", 1_000_000)]
    index = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert "OLD" not in index and index.endswith("</table></div>\n<h2>Ceilings</h2>")
    assert "2 profiler trace(s), 2.5 MB, read by the labs and not kept" in index  # 2 500 000 bytes
    section = report._artifacts_section(tmp_path)
    links = section[: section.index("</ul>")]
    assert links.count("<li>") == 1 and 'href="artifacts/a/memory/t.json">a/memory/t.json</a>' in links
    assert "index.html" not in links and footprint.NOT_KEPT not in links
    assert report.drop_traces(tmp_path) == []


def test_a_bar_whose_total_is_zero_is_at_zero():
    models = {
        "box": {"model_name": "HBoxModel", "state": {"children": ["IPY_MODEL_l", "IPY_MODEL_p", "IPY_MODEL_r"]}},
        "l": {"model_name": "HTMLModel", "state": {"value": "a"}},
        "p": {"model_name": "FloatProgressModel", "state": {"min": 0, "max": 0, "value": 0}},
        "r": {"model_name": "HTMLModel", "state": {"value": "b"}},
    }
    assert 'max="0" style="accent-color:#1976d2" data-fraction="0.0000"' in report.progress_html("box", models)


def test_an_errors_cause_is_its_first_line_cut_past_the_limit():
    assert report.one_line_cause("\n  ValueError: bad  \nTraceback...") == "ValueError: bad"
    assert report.one_line_cause(None) == "" and report.one_line_cause("\n \n") == ""
    assert report.one_line_cause("x" * 10, limit=10) == "x" * 10  # the limit itself: whole
    assert report.one_line_cause("x" * 11, limit=10) == "x" * 9 + "\u2026"  # one more: cut to the limit


def _status(notebook, status, error=""):
    return SimpleNamespace(notebook=notebook, status=status, html="", ipynb="", error=error, params={"reps": 1},
                           seconds=1.0, rows=0)  # fmt: skip


def test_the_headlines_row_shows_an_ok_labs_figures_and_a_failed_labs_cause(tmp_path, monkeypatch):
    from lab_utils.studies import headline  # noqa: PLC0415 - the index's own import

    asked = []

    def fake(df, labs):
        asked.append((len(df), list(labs)))
        return {lab: [headline.Figure("speed-up", "2.0x")] for lab in labs}

    monkeypatch.setattr(headline, "headlines", fake)
    page = report._headline_section(tmp_path, [_status("a", "ok"), _status("b", "failed", "ValueError: no\nmore")])
    assert asked == [(0, ["a"])]
    assert '<td>a</td><td class="headline">speed-up: <b>2.0x</b>' in page
    assert (
        '<td>b</td><td class="headline"><span class="failed">failed</span> <span class="cause">ValueError: no</span>'
        in page
    )


def test_the_index_says_how_many_failed_and_which_overrides_it_ran_with(tmp_path, monkeypatch):
    ctx = dict(device_kind="cpu", device_info=dict(name="cpu0", kind="cpu", units=4, units_name="cores",
               memory_bytes=8 * 2**30), torch_version="t", triton_version="tr", cuda_version="c",
               python_version="p", commit="abc", timestamp="now")  # fmt: skip
    monkeypatch.setattr(report, "run_context", lambda extra: dict(ctx))
    monkeypatch.setattr(report, "get_ceilings", lambda quick: (_ for _ in ()).throw(RuntimeError("none here")))
    monkeypatch.setattr(report, "_headline_section", lambda run_dir, statuses: "")
    suite = SimpleNamespace(name="smoke", description="d")
    statuses = [_status("a", "ok"), _status("b", "failed")]
    page = report.write_index(tmp_path, suite, statuses, "r1", {}).read_text(encoding="utf-8")
    assert '<p class="failed">1 of 2 FAILED</p>' in page
    assert "<tr><th>overrides</th><td>none</td></tr>" in page
    assert "cpu0 (cpu, 4 cores, 8 GiB)" in page
    page = report.write_index(tmp_path, suite, statuses[:1], "r1", {"reps": 2}).read_text(encoding="utf-8")
    assert '<p class="ok">all notebooks ran</p>' in page and "<tr><th>overrides</th><td>reps=2</td></tr>" in page
    assert json.loads((tmp_path / "context.json").read_text())["ceilings_error"] == "none here"
