"""Report pieces: self-contained HTML of executed notebooks, gathered records, index page.

Self-contained means it renders in a browser with no network: nbconvert's ``lab``
template already inlines its CSS; holoviews/bokeh outputs carry BokehJS inline
(``plots.init``); what remains external (require.js and MathJax from a CDN, the
widget manager) is dropped, since the labs' outputs need neither.
"""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

import nbformat
import pandas as pd
from nbconvert import HTMLExporter

from lab_utils.core.ceilings import Ceilings, get_ceilings
from lab_utils.core.records import (
    CONTEXT_COLUMNS,
    ROW_COLUMNS,
    load_records,
    run_context,
    stability_summary,
    thread_cut_note,
    write_records_json,
)
from lab_utils.run import footprint

EXTERNAL_SCRIPT = re.compile(r"<script[^>]*\bsrc=[\"'](?:https?:)?//[^\"']*[\"'][^>]*>\s*</script>", re.I)
EXTERNAL_LINK = re.compile(r"<link[^>]*\bhref=[\"'](?:https?:)?//[^\"']*[\"'][^>]*/?>", re.I)


PANEL_CDN = re.compile(r"https://cdn\.holoviz\.org/panel/[^/\"']+/dist/([A-Za-z0-9_./-]+\.css)")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _panel_css_data_uri(m: re.Match) -> str:
    """Panel's widgets reference their stylesheets on a CDN; inline the installed copy."""
    import panel  # noqa: PLC0415  (heavy; only pages whose widgets reference panel's CDN need it)

    f = Path(panel.__file__).parent / "dist" / m.group(1)
    if not f.is_file():
        return m.group(0)
    return "data:text/css;base64," + base64.b64encode(f.read_bytes()).decode()


#: BokehJS's WebGL bundle (190 kB in every page): only a plot drawn with ``output_backend="webgl"`` needs it
WEBGL_BUNDLE = re.compile(r"/\* BEGIN bokeh-gl(?:\.min)?\.js \*/.*?/\* END bokeh-gl(?:\.min)?\.js \*/", re.S)
WEBGL_BACKEND = re.compile(r"""["']?output_backend["']?\s*:\s*["']webgl["']""")


def drop_unused_webgl(text: str) -> str:
    """The loader's WebGL bundle removed from a page none of whose plots draws with WebGL."""
    if WEBGL_BACKEND.search(text):
        return text
    return WEBGL_BUNDLE.sub("/* bokeh-gl.min.js: no plot of this page draws with WebGL */", text)


def make_self_contained(text: str) -> str:
    text = EXTERNAL_SCRIPT.sub("", text)
    text = EXTERNAL_LINK.sub("", text)
    text = drop_unused_webgl(text)
    return PANEL_CDN.sub(_panel_css_data_uri, text)


def _widget_models(nb) -> dict:
    """``model_id -> {"model_name", "state"}`` of the widgets' final state, as the kernel left it
    (nbclient stores it in the notebook's metadata)."""
    widgets = (nb.metadata.get("widgets") or {}).get("application/vnd.jupyter.widget-state+json") or {}
    return dict(widgets.get("state") or {})


def progress_html(model_id: str, models: dict) -> str | None:
    """A tqdm bar (an HBox of an HTML, a progress bar and an HTML) as the kernel left it: its
    description, how far it got and its last figures, as plain HTML; None for any other widget."""
    box = models.get(model_id) or {}
    if box.get("model_name") != "HBoxModel":
        return None
    kids = [models.get(str(c).removeprefix("IPY_MODEL_")) or {} for c in (box.get("state") or {}).get("children", [])]
    bars = [k for k in kids if k.get("model_name") in ("FloatProgressModel", "IntProgressModel")]
    texts = [k for k in kids if k.get("model_name") == "HTMLModel"]
    if len(bars) != 1 or len(texts) != 2:
        return None
    s = bars[0].get("state") or {}
    lo, hi, v = float(s.get("min", 0) or 0), float(s.get("max", 100) or 0), float(s.get("value", 0) or 0)
    left, right = ((t.get("state") or {}).get("value", "") for t in texts)
    style = {"success": "#2e7d32", "danger": "#c62828"}.get(s.get("bar_style") or "", "#1976d2")
    frac = (v - lo) / (hi - lo) if hi > lo else 0.0
    # the texts are tqdm's own HTML (entities escaped by tqdm): shown as the widget showed them
    return (
        '<div class="perflab-progress" style="display:flex;gap:.5em;align-items:center;font-family:monospace">'
        f'<span>{left}</span><progress value="{v:g}" max="{hi:g}" style="accent-color:{style}" '
        f'data-fraction="{frac:.4f}"></progress><span>{right}</span></div>'
    )


def _drop_widget_views(nb) -> None:
    """ipywidget outputs need a widget manager from a CDN: a tqdm bar becomes plain HTML of its
    final state (not the 0% its text form was when first shown), any other widget its text form."""
    models = _widget_models(nb)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if "outputs" not in cell:
            continue
        for out in cell.outputs:
            data = out.get("data")
            if data and WIDGET_VIEW in data:
                view = data.pop(WIDGET_VIEW)
                bar = progress_html(str((view or {}).get("model_id", "")), models)
                if bar is not None:
                    data.clear()
                    data["text/html"] = bar
        cell.outputs = [o for o in cell.outputs if "data" not in o or o["data"]]


def relocate_text(text: str, tmp: Path, final: Path) -> str:
    """Paths under the run's temporary folder, as they will be once it is renamed."""
    return text.replace(str(tmp), str(final))


def relocate_file(path: Path, tmp: Path, final: Path) -> None:
    """Rewrite a text file (an executed notebook) so that the paths it printed into the
    temporary folder name the final report folder, where the files will be."""
    text = path.read_text(encoding="utf-8")
    moved = relocate_text(text, tmp, final)
    if moved != text:
        path.write_text(moved, encoding="utf-8")


def lab_threads_note(records_json: Path) -> str:
    """A lab's thread-cut line (``records.thread_cut_note``) from the records file its kernel wrote,
    whose context holds that kernel's thread policy and usable cores; "" when none were cut."""
    if not records_json.exists():
        return ""
    ctx = json.loads(records_json.read_text()).get("context", {})
    return thread_cut_note(load_records(records_json), ctx)


def banner_cell(note: str):
    """A first cell for a lab's page: ``note`` as the index shows it (same id and class)."""
    cell = nbformat.v4.new_markdown_cell(
        f'<p class="unstable" id="threads-cut" style="color:#bc4c00;font-weight:600">{html.escape(note)}</p>'
    )
    cell.id = "perflab-threads-cut"
    return cell


def export_html(ipynb: Path, out: Path, *, title: str | None = None, banner: str = "") -> Path:
    """``banner``: a line shown above the lab's first cell (a run whose threads were cut says so)."""
    nb = nbformat.read(ipynb, as_version=4)
    if title:
        nb.metadata["title"] = title
    if banner:
        nb.cells.insert(0, banner_cell(banner))
    _drop_widget_views(nb)
    exp = HTMLExporter(template_name="lab", embed_images=True)
    exp.mathjax_url = ""
    exp.require_js_url = ""
    body, _ = exp.from_notebook_node(nb)
    body = make_self_contained(body)
    # An empty src would still fire an error event; drop such tags too.
    body = re.sub(r"<script[^>]*\bsrc=[\"']{2}[^>]*>\s*</script>", "", body)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(body, encoding="utf-8")
    return out


def gather_records(run_dir: Path, statuses, run_id: str, *, relocate: tuple[Path, Path] | None = None) -> pd.DataFrame:
    """Merge every successful notebook's records (context columns on each row).
    ``relocate=(tmp, final)``: paths in the rows' ``extra`` (e.g. a profiler trace written
    under the temporary folder) are rewritten to where they are once the report is final."""
    frames = []
    for st in statuses:
        f = run_dir / "records" / st.notebook / "records.json"
        if st.status != "ok" or not f.exists():
            continue
        df = load_records(f)
        if relocate is not None:
            df["extra"] = [relocate_text(e, *relocate) if isinstance(e, str) else e for e in df["extra"]]
        summary = stability_summary(df)
        st.timings, st.unstable = summary.timings, summary.unstable
        df["notebook"] = st.notebook
        df["run_id"] = run_id
        st.rows = len(df)
        frames.append(df)
    cols = ROW_COLUMNS + CONTEXT_COLUMNS + ["notebook", "run_id"]
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)
    df = df.reindex(columns=cols)
    df["value"] = pd.to_numeric(df["value"], errors="coerce").astype(float)
    df.to_parquet(run_dir / "records.parquet", index=False)
    write_records_json(df, run_dir / "records.json")  # exact floats (to_json keeps 10 decimals)
    (run_dir / "status.json").write_text(
        json.dumps([{k: v for k, v in vars(s).items() if k != "params"} for s in statuses], indent=1)
    )
    return df


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.ok{color:#0a7d28;font-weight:600}.failed{color:#b00020;font-weight:600}.cause{color:#b00020;font-family:monospace}
code,pre{font-family:ui-monospace,Menlo,monospace;font-size:90%}pre{white-space:pre-wrap;margin:0}
.muted{color:#666}.unstable{color:#bc4c00;font-weight:600}
"""


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return html.escape(str(v))


def write_index(run_dir: Path, suite, statuses, run_id: str, overrides: dict) -> Path:
    ctx = run_context({"suite": suite.name, "overrides": overrides})
    ceil: Ceilings | None = None
    try:
        ceil = get_ceilings(quick=ctx["device_kind"] == "cpu")  # cached: the labs measured it already
        ctx["ceilings"] = ceil.as_dict()
    except Exception as e:  # noqa: BLE001 - the index is still useful without ceilings
        ctx["ceilings_error"] = str(e)
    ctx.update(
        suite=suite.name,
        suite_description=suite.description,
        run_id=run_id,
        overrides=overrides,
        notebooks=[
            {"notebook": s.notebook, "status": s.status, "params": s.params, "ran_on": getattr(s, "ran_on", "")}
            for s in statuses
        ],
    )
    (run_dir / "context.json").write_text(json.dumps(ctx, indent=1, default=str))

    n_ok = sum(s.status == "ok" for s in statuses)
    rows = []
    for s in statuses:
        link = f'<a href="{html.escape(s.html)}">{html.escape(s.notebook)}</a>' if s.html else html.escape(s.notebook)
        nb = f'<a href="{html.escape(s.ipynb)}">ipynb</a>' if s.ipynb else ""
        log = getattr(s, "log", None)  # a lab run as a job: its log, kept in the report
        nb += (" · " if nb else "") + f'<a class="job-log" href="{html.escape(log)}">job log</a>' if log else ""
        err = f"<pre>{html.escape(s.error)}</pre>" if s.error else ""
        params = ", ".join(f"{k}={v!r}" for k, v in s.params.items())
        ran_on = getattr(s, "ran_on", "")  # a lab run as a job: which device / job ran it
        ran = f'<br><span class="muted ran-on">{html.escape(ran_on)}</span>' if ran_on else ""
        rows.append(
            f'<tr><td>{link} <span class="muted">{nb}</span></td><td class="{s.status}">{s.status}</td>'
            f"<td>{s.seconds:.1f} s{ran}</td><td>{s.rows}</td>{_unstable_cell(s)}"
            f"<td><code>{html.escape(params)}</code>{err}</td></tr>"
        )
    ceil_rows = ""
    if ceil is not None:
        for r in ceil.summary_rows():
            ceil_rows += (
                f"<tr><td>{html.escape(r['quantity'])}</td><td>{_fmt(r['measured'])}</td>"
                f"<td>{_fmt(r['datasheet'])}</td><td>{html.escape(r['unit'])}</td>"
                f"<td>{html.escape(r.get('note', ''))}</td></tr>"
            )
    dev = ctx["device_info"]
    info = [
        ("run", run_id),
        ("suite", f"{suite.name}: {suite.description}"),
        (
            "device",
            f"{dev['name']} ({dev['kind']}, {dev['units']} {dev['units_name']}, {dev['memory_bytes'] / 2**30:.0f} GiB)",
        ),
        ("torch / triton / CUDA", f"{ctx['torch_version']} / {ctx['triton_version']} / {ctx['cuda_version']}"),
        ("python", ctx["python_version"]),
        ("commit", ctx["commit"]),
        ("finished", ctx["timestamp"]),
        ("overrides", ", ".join(f"{k}={v!r}" for k, v in overrides.items()) or "none"),
        (
            "records",
            '<a href="records.parquet">records.parquet</a> · <a href="records.json">records.json</a> · '
            '<a href="context.json">context.json</a>',
        ),
    ]
    info_html = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{v if k == 'records' else html.escape(str(v))}</td></tr>" for k, v in info
    )
    ran_head = " / ran on" if any(getattr(s, "ran_on", "") for s in statuses) else ""
    verdict = "all notebooks ran" if n_ok == len(statuses) else f"{len(statuses) - n_ok} of {len(statuses)} FAILED"
    page = f"""<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>perflab {html.escape(run_id)}</title>
<style>{_CSS}</style></head><body>
<h1>perflab report · {html.escape(suite.name)}</h1>
<p class="{"ok" if n_ok == len(statuses) else "failed"}">{verdict}</p>
{_threads_banner(run_dir, ctx)}
{_headline_section(run_dir, statuses)}
<h2>Context</h2><table>{info_html}</table>
<h2>Notebooks</h2>
<table><tr><th>notebook</th><th>status</th><th>time{ran_head}</th><th>records</th><th>unstable timings</th>
<th>parameters / error</th></tr>
{"".join(rows)}</table>
{_unstable_section(run_dir)}
<div id="files">{_artifacts_section(run_dir)}</div>
<h2>Ceilings</h2>
<p class="muted">Measured on this machine (copy: bytes read + written over time; matmul: 2n³ FLOPs over time),
beside the vendor datasheet's dense peaks, which are references, not measurements.</p>
<table><tr><th>quantity</th><th>measured</th><th>datasheet</th><th>unit</th><th>note</th></tr>{ceil_rows}</table>
</body></html>"""
    out = run_dir / "index.html"
    out.write_text(page, encoding="utf-8")
    return out


def _threads_banner(run_dir: Path, ctx: dict) -> str:
    """At the top of the index: the run's timings had fewer CPU threads than the machine's
    cores because it was busy (``records.thread_cut_note``)."""
    f = run_dir / "records.parquet"
    note = thread_cut_note(load_records(f), ctx) if f.exists() else ""
    return f'<p class="unstable" id="threads-cut">{html.escape(note)}</p>' if note else ""


def one_line_cause(error: str | None, limit: int = 240) -> str:
    """The first non-empty line of a notebook's error (``ValueError: ...``), shortened to ``limit`` characters."""
    line = next((ln.strip() for ln in (error or "").splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "\u2026"


def _failed_cell(s) -> str:
    cause = one_line_cause(s.error)
    why = f' <span class="cause">{html.escape(cause)}</span>' if cause else ""
    return f'<span class="failed">{s.status}</span>{why}'


def _headline_section(run_dir: Path, statuses) -> str:
    """One row per lab with its headline figures, built from the gathered records by the same
    function that fills the lab's takeaway cell (``studies.headline``)."""
    # heavy (models, plots): imported for their registered headlines, which only the index needs
    from lab_utils.studies import (  # noqa: F401, PLC0415
        attention,
        ceilings,
        distributed,
        fused_kernels,
        low_precision,
        memory,
        plan,
        stability,
        training_step,
    )
    from lab_utils.studies.headline import figures_html, headlines  # noqa: PLC0415 - beside the registrations

    f = run_dir / "records.parquet"
    df = load_records(f) if f.exists() else pd.DataFrame(columns=ROW_COLUMNS)
    ok = [s.notebook for s in statuses if s.status == "ok"]
    lines = headlines(df, ok)
    rows = "".join(
        f'<tr><td>{html.escape(s.notebook)}</td><td class="headline">'
        + (figures_html(lines[s.notebook]) if s.notebook in lines else _failed_cell(s))
        + "</td></tr>"
        for s in statuses
    )
    return f'<h2>Headlines</h2><table id="headlines"><tr><th>lab</th><th>what matters</th></tr>{rows}</table>'


def _unstable_cell(s) -> str:
    timings, unstable = getattr(s, "timings", 0), getattr(s, "unstable", 0)
    if not timings:
        return '<td class="muted">—</td>'
    cls = ' class="unstable"' if unstable else ""
    return f"<td{cls}>{unstable} of {timings}</td>"


def _unstable_section(run_dir: Path, limit: int = 50) -> str:
    """Every unstable timing of the run with its reason: these rows are not measurements
    to act on (``perflab compare`` calls them "noisy")."""
    f = run_dir / "records.parquet"
    if not f.exists():
        return ""
    df = load_records(f)
    summary = stability_summary(df, examples=limit)
    if not summary.unstable:
        note = f"all {summary.timings} timings stable" if summary.timings else "no timings in this run"
        return f'<h2>Unstable timings</h2><p class="muted">{note}.</p>'
    items = "".join(f"<li>{html.escape(e)}</li>" for e in summary.examples)
    more = f"<li>… {summary.unstable - limit} more (records: stable = false)</li>" if summary.unstable > limit else ""
    return (
        f'<h2>Unstable timings</h2><p class="unstable">{html.escape(str(summary))}: the machine disturbed them; '
        f"their medians are not measurements to act on, and comparisons call them noisy.</p><ul>{items}{more}</ul>"
    )


FILES_SECTION = re.compile(r'<div id="files">.*?</div>\n<h2>Ceilings</h2>', re.S)


def drop_traces(run_dir: Path) -> list[tuple[str, int]]:
    """Remove a finished report's profiler traces (``footprint.prune_traces``) and bring its index's
    file list and byte table up to date (``perflab run --export tensorboard`` exports the traces first)."""
    gone = footprint.prune_traces(run_dir)
    index = run_dir / "index.html"
    if gone and index.exists():
        section = f'<div id="files">{_artifacts_section(run_dir)}</div>\n<h2>Ceilings</h2>'
        index.write_text(FILES_SECTION.sub(lambda _m: section, index.read_text(encoding="utf-8"), count=1), "utf-8")
    return gone


def _artifacts_section(run_dir: Path) -> str:
    """Links to the files the labs left (profiler traces, memory timelines), inside the
    report folder, relative, so they work wherever the report is moved; the traces not kept; and
    where the report's bytes go (``footprint.bytes_by_kind``)."""
    root = run_dir / "artifacts"
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != footprint.NOT_KEPT) if root.exists() else []
    items = "".join(
        f'<li><a href="{html.escape(p.relative_to(run_dir).as_posix())}">{html.escape(p.relative_to(root).as_posix())}'
        f'</a> <span class="muted">{p.stat().st_size / 2**20:.2f} MiB</span></li>'
        for p in files
    )
    out = f"<h2>Artifacts</h2><ul>{items}</ul>" if files else ""
    not_kept = root / footprint.NOT_KEPT
    if not_kept.exists():
        gone = not_kept.read_text(encoding="utf-8").splitlines()[1:]
        mb = sum(int(line.rsplit("\t", 1)[1]) for line in gone) / 1e6
        out += (
            f'<p class="muted" id="traces-not-kept">{len(gone)} profiler trace(s), {mb:.1f} MB, read by the labs and '
            f'not kept (<a href="artifacts/{footprint.NOT_KEPT}">which</a>; '
            "<code>perflab run --keep-traces</code> keeps them)</p>"
        )
    rows = "".join(
        f"<tr><td>{html.escape(k.kind)}</td><td>{k.files}</td><td>{k.bytes / 1e6:.1f}</td></tr>"
        for k in footprint.bytes_by_kind(run_dir)
    )
    return (
        f'{out}<h2>Where this report\'s bytes go</h2><table id="footprint"><tr><th>kind</th><th>files</th>'
        f"<th>MB</th></tr>{rows}</table>"
    )
