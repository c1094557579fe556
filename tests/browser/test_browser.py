"""Real-browser tests (headless Chromium from Debian's packages, no network).

(a) A report written by ``perflab run smoke``: its index and every notebook page render
    with every bokeh plot drawn (a canvas with more than one colour per plot), no console
    error, no request to any outside address; the HoloMap widgets of an exported page
    still switch frames.  The compare page is checked the same way, on two runs whose
    records (samples included) the test writes itself, so its verdicts do not depend on the
    machine's load.
(b) JupyterLab: a server of our own on a free loopback port opens a lab, runs all its
    cells, and changing the HoloMap's dtype picker redraws the plot.

The report comes from a session fixture (``smoke_report`` in conftest.py, shared with
tests/labs/test_lab_outputs.py) that runs the real smoke suite once
(``lab_utils.run.runner.run_suite("smoke", out_dir=tmp)``) unless ``$PERFLAB_REPORT`` names
a finished report folder to reuse.  Skipped, with the reason, when Chromium is missing.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.request
import warnings
from pathlib import Path

import browser_util as B
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = "smoke"
SKIP = B.skip_reason()
pytestmark = [pytest.mark.browser, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]
PLOT_MIMES = ("application/vnd.holoviews_exec.v0+json", "application/vnd.bokehjs_exec.v0+json")


def _suite_notebooks() -> list[str]:
    """The smoke suite's notebooks; a suite that does not load is a collection error, not a skip."""
    from lab_utils.run.runner import load_suite

    stems = [e.stem for e in load_suite(SUITE).entries]
    assert stems, f"the {SUITE} suite lists no notebook"
    return stems


@pytest.fixture(scope="module")
def chrome(tmp_path_factory):
    with B.browser(tmp_path_factory.mktemp("chromium-profile")) as ctx:
        yield ctx


def _status(report: Path) -> dict[str, dict]:
    return {s["notebook"]: s for s in json.loads((report / "status.json").read_text())}


NOT_FIGURES = ("Table", "ItemTable", "Div", "Tabular")  # rendered as DOM tables/text, not canvases


def _figures_in(text: str) -> int:
    """Bokeh figures a displayed holoviews object draws, from its text repr: a Table is
    no figure, an Overlay or HoloMap of one element is one, a Layout one per child."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return 0
    head = lines[0].strip()
    kind = head[1:].split()[0] if head.startswith(":") else ""
    if kind in ("HoloMap", "DynamicMap") and len(lines) > 1:
        return _figures_in("\n".join(ln[3:] for ln in lines[1:]))
    if kind in ("Layout", "NdLayout", "GridSpace", "GridMatrix"):
        children = [re.match(r"^ {3}\.\S+\s+:(\w+)", ln) for ln in lines[1:]]
        return sum(1 for m in children if m and m.group(1) not in NOT_FIGURES)
    return 0 if kind in NOT_FIGURES else 1


def _expected_plots(ipynb: Path) -> int:
    """Figures of the holoviews/bokeh objects an executed notebook displayed (the
    extension-loading output of ``plots.init()`` has no text/plain and is not a plot)."""
    nb = nbformat.read(ipynb, as_version=4)
    n = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if any(m in data for m in PLOT_MIMES) and "text/plain" in data:
                text = data["text/plain"]
                n += _figures_in(text if isinstance(text, str) else "".join(text))
    return n


def _open(ctx, url: str):
    page = ctx.new_page()
    watch = B.Watch.on(page)
    # generous: a compare page of a full smoke run is several MB, and CI's 2 cores may be busy
    page.goto(url, wait_until="load", timeout=120_000)
    return page, watch


def _assert_clean(watch: B.Watch, what: str):
    assert not watch.outside, f"{what}: requests to outside addresses: {watch.outside}"
    assert not watch.errors, f"{what}: console errors: {watch.errors}"


def test_index_renders(smoke_report, chrome):
    page, watch = _open(chrome, (smoke_report / "index.html").as_uri())
    try:
        page.wait_for_timeout(300)
        text = page.inner_text("body")
        for name, st in _status(smoke_report).items():
            assert name in text, f"index.html does not list {name}"
            if st.get("html"):
                assert page.locator(f'a[href="{st["html"]}"]').count() == 1, f"index.html has no link to {st['html']}"
        assert B.undrawn(B.plots(page)) == []
        _assert_clean(watch, "index.html")
        # the Headlines table leads the page, one row per lab with its figures
        heads = page.locator("table#headlines tr:has(td)")
        rows = {heads.nth(i).locator("td").first.inner_text(): heads.nth(i) for i in range(heads.count())}
        for name, st in _status(smoke_report).items():
            assert name in rows, f"index.html: no headline row for {name}"
            cell = rows[name].locator("td.headline").inner_text()
            if st["status"] == "ok":
                assert rows[name].locator("td.headline b").count() >= 1, f"{name}'s headline has no figure: {cell}"
                assert "not available" not in cell, f"{name}'s headline: {cell}"
        order = page.evaluate("() => [...document.querySelectorAll('h2')].map(e => e.innerText)")
        assert order and order[0] == "Headlines", f"the index does not lead with its headlines: {order}"
    finally:
        page.close()


@pytest.mark.parametrize("stem", _suite_notebooks())
def test_notebook_page_renders(smoke_report, chrome, stem):
    st = _status(smoke_report).get(stem)
    if st is None:
        pytest.skip(f"{stem} is not in the report {smoke_report.name} ($PERFLAB_REPORT from another suite?)")
    assert st["status"] == "ok", f"{stem} failed in the smoke run: {st.get('error')}"
    html = smoke_report / st["html"]
    expected = _expected_plots(smoke_report / st["ipynb"])
    page, watch = _open(chrome, html.as_uri())
    try:
        ps = B.wait_for_plots(page, expected, timeout_s=60)
        assert len(ps) >= expected, f"{stem}: {len(ps)} plots rendered, the notebook displayed {expected}"
        bad = B.undrawn(ps)
        assert not bad, f"{stem}: plots not drawn (no canvas, zero size or one flat colour): {bad}"
        _assert_clean(watch, f"{stem}.html")
        _assert_opens_with_its_takeaway(page, stem)
        _assert_markdown_rendered(page, stem)
        # HoloMap frames are embedded: switching a picker must redraw without a kernel
        selects = page.locator("select")
        if selects.count():
            sel = selects.first
            options = sel.evaluate("e => [...e.options].map(o => o.value)")
            other = [o for o in options if o != sel.input_value()]
            if other:
                before = page.evaluate(B.CANVAS_PRINT_JS)
                sel.select_option(other[0])
                after = _wait_changed(page, before, 15)
                assert after != before, f"{stem}: choosing {other[0]!r} in the HoloMap picker did not redraw a plot"
                _assert_clean(watch, f"{stem}.html after switching the picker")
    finally:
        page.close()


TAKEAWAY_FIRST_JS = """() => {
  const t = document.querySelector('.perflab-takeaway'), c = document.querySelector('canvas');
  return !c || !!(t.compareDocumentPosition(c) & Node.DOCUMENT_POSITION_FOLLOWING);
}"""


def _assert_opens_with_its_takeaway(page, stem: str):
    """The takeaway box, filled by the lab's last cell, comes before the lab's first plot."""
    box = page.locator(".perflab-takeaway")
    assert box.count() == 1, f"{stem}: {box.count()} takeaway boxes on the page"
    text = box.inner_text()
    assert "fills in here" not in text and box.locator("li").count() >= 1, f"{stem}: the takeaway is empty: {text}"
    assert page.evaluate(TAKEAWAY_FIRST_JS), f"{stem}: the takeaway comes after a plot"


def _assert_markdown_rendered(page, stem: str):
    """No heading shows a literal backslash-n, no output is raw markdown (lab 06 had both)."""
    heads = page.evaluate("() => [...document.querySelectorAll('h1,h2,h3,h4')].map(e => e.innerText)")
    bad = [h for h in heads if "\\n" in h]
    assert not bad, f"{stem}: headings with a literal \\n: {bad}"
    outs = page.evaluate("() => [...document.querySelectorAll('.jp-OutputArea-output pre')].map(e => e.innerText)")
    raw = [o[:120] for o in outs if re.search(r"^#{2,4} \w|^\|[-:| ]+\|$", o, re.M)]
    assert not raw, f"{stem}: outputs print raw markdown: {raw}"


def _wait_changed(page, before: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    now = before
    while time.monotonic() < deadline:
        page.wait_for_timeout(250)
        now = page.evaluate(B.CANVAS_PRINT_JS)
        if now != before:
            break
    return now


# Two runs of one lab written here, samples and all: 12 timings of 20 samples within +-1% of their
# median (judged stable), one planted 1.5x slower, one 0.7x faster, one unstable on both sides, and a
# fixed-seed error figure; what the compare page shows does not depend on how busy the machine is.
STEADY = [1.0 + 0.01 * math.sin(i) for i in range(20)]
VICTIM, FASTER, NOISY = "planted_slower", "planted_faster", "unstable"
BULK = 1000


def _compare_side(folder: Path, candidate: bool) -> Path:
    from lab_utils.core.records import Recorder

    rec = Recorder(lab="02_fused_kernels", params={"op": "rms_norm", "seed": 0}, device="cpu")
    for i in range(12):
        variant = {0: VICTIM, 1: FASTER, 2: NOISY}.get(i, f"variant_{i}")
        ms = 0.5 + 0.25 * i
        if candidate:
            ms *= {VICTIM: 1.5, FASTER: 0.7}.get(variant, 1.0)
        noisy = variant == NOISY
        samples = [ms * (3.0 if noisy and k % 3 == 0 else x) for k, x in enumerate(STEADY)]
        verdict = "dispersion p80/p20 = 3 > 1.2" if noisy else "spread 1.02, no stalls"
        rec.add("sweep", variant, "time", ms, "ms", shape=(4096, 781), dtype="bfloat16", statistic="median",
                samples=samples, stable=not noisy, stability=verdict)  # fmt: skip
    rec.add("correctness", "triton", "max_rel_err", 3.1e-3, "", shape=(4096, 781), dtype="bfloat16")
    for i in range(BULK):  # a page of a thousand rows more: deterministic, equal on both sides
        metric, unit = (("peak_memory", "bytes"), ("max_abs_err", ""), ("launches", "count"))[i % 3]
        rec.add("bulk", f"row_{i}", metric, 1000.0 + i, unit, shape=(i % 7 + 1, 64), dtype="float32")
    return rec.save(folder / "records.json")


def test_compare_page_renders(chrome, tmp_path):
    """The compare page of two runs whose records this test writes: the planted regression is found
    (exit 1, a "slower" row), the plot is drawn, the rows sort by verdict and filter by name."""
    from lab_utils.run import compare as C

    base, cand = _compare_side(tmp_path / "base", False), _compare_side(tmp_path / "candidate", True)
    out = tmp_path / "cmp"
    assert C.main([str(base), str(cand), "--out", str(out), "--quiet"]) == C.EXIT_REGRESSION
    page, watch = _open(chrome, (out / "compare.html").as_uri())
    try:
        ps = B.wait_for_plots(page, 1, timeout_s=30)
        assert len(ps) == 1 and not B.undrawn(ps), ps
        rows = page.locator("#rows tbody tr")
        n = rows.count()
        assert n == 13 + BULK, n  # 12 timings, the error figure, the bulk
        verdict_of = {v: rows.filter(has_text=v).get_attribute("data-verdict") for v in (VICTIM, FASTER, NOISY)}
        assert verdict_of == {VICTIM: "slower", FASTER: "faster", NOISY: "noisy"}, verdict_of
        # sortable: clicking "verdict" twice puts the rows in opposite orders
        header = page.locator("#rows th", has_text="verdict")
        header.click()
        first = rows.first.get_attribute("data-verdict")
        header.click()
        last = rows.first.get_attribute("data-verdict")
        verdicts = page.evaluate("() => [...document.querySelectorAll('#rows tbody tr')].map(r => r.dataset.verdict)")
        assert len(set(verdicts)) >= 3 and first != last, (first, last, sorted(set(verdicts)))
        # one query for every row (a round trip per row is minutes on a page of thousands of rows)
        page.fill("#filter", VICTIM)
        visible = page.evaluate(
            "() => [...document.querySelectorAll('#rows tbody tr')].filter(r => r.offsetParent !== null).length"
        )
        assert visible == 1, visible
        _assert_clean(watch, "compare.html")
    finally:
        page.close()


# ------------------------------------------------------------------ JupyterLab
LAB = "00_ceilings"
# the lab at its defaults, a little smaller: this test is about the UI, not the numbers
LAB_OVERRIDES = "\nreps = 5\nelementwise_sizes = [65536, 262144]\nmatmul_sizes = [64, 128]\n"
PROMPTS_JS = "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(e => e.textContent.trim())"


def _kernel_idle(srv) -> bool:
    with urllib.request.urlopen(f"{srv.url}/api/sessions?token={srv.token}", timeout=5) as r:
        sessions = json.load(r)
    return bool(sessions) and all(s["kernel"]["execution_state"] == "idle" for s in sessions)


def test_jupyterlab_run_lab_and_change_widget(chrome, tmp_path):
    src = ROOT / "labs" / f"{LAB}.ipynb"
    assert src.exists(), f"labs/{LAB}.ipynb is missing"
    # a copy of labs/ so that nothing (autosave, checkpoints) can touch the committed labs
    labs = tmp_path / "labs"
    labs.mkdir()
    nb = nbformat.read(src, as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source += LAB_OVERRIDES
    nbformat.write(nb, labs / src.name)
    with B.jupyter_lab(labs, tmp_path / "jupyter") as srv:
        page, watch = _open(chrome, f"{srv.url}/lab/tree/{src.name}?token={srv.token}&reset")
        try:
            page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=90_000)
            deadline = time.monotonic() + 90
            while True:  # the kernel starts; a kernel picker may ask first
                dialog = page.get_by_role("button", name="Select", exact=True)
                if dialog.count() and dialog.first.is_visible():
                    dialog.first.click()
                if _kernel_idle(srv):
                    break
                assert time.monotonic() < deadline, f"the kernel did not start:\n{srv.log.read_text()[-2000:]}"
                page.wait_for_timeout(500)
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
            deadline = time.monotonic() + 300
            while True:
                prompts = page.evaluate(PROMPTS_JS)
                if prompts and all(p[1:-2].isdigit() for p in prompts):
                    break
                assert time.monotonic() < deadline, f"cells did not all run: {prompts}"
                page.wait_for_timeout(1000)
            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
            tracebacks = page.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.error']")
            assert tracebacks.count() == 0, f"a cell raised: {tracebacks.first.inner_text()[:2000]}"
            _ = errors  # stderr (progress bars, warnings) is allowed
            ps = B.wait_for_plots(page, 1, timeout_s=60)
            assert ps and not B.undrawn(ps), f"plots not drawn in JupyterLab: {ps}"
            picker = page.locator(".jp-OutputArea-output select").first
            picker.wait_for(timeout=30_000)
            options = picker.evaluate("e => [...e.options].map(o => o.value)")
            other = [o for o in options if o != picker.input_value()]
            assert other, f"the HoloMap picker offers only {options}"
            before = page.evaluate(B.CANVAS_PRINT_JS)
            picker.select_option(other[0])
            after = _wait_changed(page, before, 30)
            assert after != before, f"choosing {other[0]!r} did not redraw the plot"
            # Nothing may leave the machine except (known, reported) panel stylesheets from its CDN
            scripts_out = [u for u in watch.outside if not u.split("?")[0].endswith(".css")]
            assert not scripts_out, f"JupyterLab requested outside addresses: {scripts_out}"
            if watch.outside:
                warnings.warn(
                    f"JupyterLab: panel asked its CDN for {len(watch.outside)} stylesheet(s) (blocked; the "
                    f"widgets work unstyled): {sorted(set(watch.outside))[:3]}",
                    stacklevel=1,
                )
            blocked = [e for e in watch.errors if "net::ERR_FAILED" in e]
            assert len(blocked) <= len(watch.outside), f"JupyterLab: failed loads beyond the blocked ones: {blocked}"
            other_errors = [e for e in watch.errors if "net::ERR_FAILED" not in e]
            assert not other_errors, f"JupyterLab console errors: {other_errors}"
        finally:
            page.close()
    assert srv.proc.poll() is not None, "the JupyterLab server is still running"


def test_the_checks_catch_failures(chrome, tmp_path):
    """The watchers are not vacuous: an outside request is seen (and blocked), a console
    error is seen, and a blank or missing canvas counts as an undrawn plot."""
    page_file = tmp_path / "bad.html"
    page_file.write_text("""<!DOCTYPE html><html><body>
<img src="http://192.0.2.1/pixel.png">
<div class="bk-Figure" id="blank"><canvas width="50" height="40"></canvas></div>
<div class="bk-Figure" id="drawn"><canvas id="c" width="50" height="40"></canvas></div>
<div class="bk-Figure" id="none"></div>
<script>
const g = document.getElementById('c').getContext('2d');
g.fillStyle = '#fff'; g.fillRect(0, 0, 50, 40); g.fillStyle = '#c00'; g.fillRect(10, 10, 20, 20);
console.error('boom');
</script></body></html>""")
    page, watch = _open(chrome, page_file.as_uri())
    try:
        page.wait_for_timeout(300)
        assert watch.outside == ["http://192.0.2.1/pixel.png"]
        assert any("boom" in e for e in watch.errors)
        ps = B.plots(page)
        assert [p["colours"] >= 2 for p in ps] == [False, True, False]
        assert [p["index"] for p in B.undrawn(ps)] == [0, 2]
    finally:
        page.close()
    assert B.is_outside("https://cdn.holoviz.org/x.css") and B.is_outside("http://10.0.0.1:8888/")
    assert not any(
        B.is_outside(u)
        for u in (
            "file:///tmp/x.html",
            "data:text/plain,hi",
            "http://127.0.0.1:8888/lab",
            "ws://localhost:1/api",
            "blob:null/abc",
            "about:blank",
        )
    )


THREADS_CUT_NB = (
    "import lab_utils.core.records as R\n"
    "# this kernel's context as on a busy 4-core machine: the policy gave some timings 1 thread\n"
    "R.timing_context = lambda: {'cpu_threads': {'threads': 1, 'policy': 'auto', 'cores': 4, 'busy': 3.0}}\n"
    "rec = R.Recorder('cut', params={'reps': reps})\n"
    "for v, n in (('a', 1), ('b', 1), ('c', 4)):\n"
    "    rec.add('e', v, 'time', 1.0, 'ms', statistic='median', threads=n)\n"
    "rec.save()"
)


def test_a_labs_page_says_at_the_top_that_its_threads_were_cut(chrome, tmp_path, monkeypatch):
    """The thread-cut line the index shows is also above each lab's first cell."""
    import yaml

    from lab_utils.run.nbtools import make_notebook
    from lab_utils.run.runner import run_suite

    pdir, labs = tmp_path / "parameterized", tmp_path / "labs"
    pdir.mkdir()
    labs.mkdir()
    cfg = "lab_utils.studies.ceilings:CeilingsLabConfig"
    for name, body in (("cut", THREADS_CUT_NB), ("calm", "print('no timings')")):
        cells = [("md", f"# Lab {name}"), ("params", 'device = "cpu"\nreps = 5'), ("code", body)]
        nb = make_notebook(cells, config=cfg)
        nbformat.write(nb, labs / f"{name}.ipynb")
    entries = [{"notebook": str(labs / "cut.ipynb")}, {"notebook": str(labs / "calm.ipynb")}]
    (pdir / "two.yaml").write_text(yaml.safe_dump({"description": "thread cut", "notebooks": entries}))
    monkeypatch.setenv("PERFLAB_PARAMETERIZED", str(pdir))
    monkeypatch.delenv("PERFLAB_TIMING_THREADS", raising=False)
    res = run_suite("two", out_dir=tmp_path / "reports", progress=False)
    assert res.ok, [(s.notebook, s.error) for s in res.statuses]
    page, watch = _open(chrome, (res.path / "html" / "cut.html").as_uri())
    try:
        banner = page.locator("#threads-cut")
        assert banner.count() == 1 and banner.is_visible(), "the lab's page does not say its threads were cut"
        text = banner.inner_text()
        assert text.startswith("THREADS CUT") and "2 of 3 CPU timings" in text and "4 usable cores" in text, text
        heading = page.get_by_role("heading", name="Lab cut").bounding_box()
        assert banner.bounding_box()["y"] < heading["y"], "the thread-cut line is not at the top of the page"
        _assert_clean(watch, "cut.html")
    finally:
        page.close()
    page, _ = _open(chrome, (res.path / "html" / "calm.html").as_uri())
    try:
        assert page.locator("#threads-cut").count() == 0, "a lab without cut timings shows the line"
    finally:
        page.close()
