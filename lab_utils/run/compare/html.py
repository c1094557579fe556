"""``compare.html``: one self-contained page (BokehJS inline, no request outside the file):
the result, flags, both runs' context, a gain plot with intervals and a sortable,
filterable table of rows."""

from __future__ import annotations

import html
import math
import re

import numpy as np
from bokeh.embed import components
from bokeh.models import BoxAnnotation, ColumnDataSource, HoverTool, Span
from bokeh.plotting import figure
from bokeh.resources import Resources

from lab_utils.run.compare.coverage import notebook_params, overrides_text
from lab_utils.run.compare.rules import (
    APPEARED,
    DISAPPEARED,
    ENTERED_TOP_N,
    LEFT_TOP_N,
    NOISY,
    NOT_COMPARABLE,
    SIDE_CONTEXT_KEYS,
    direction_table,
)
from lab_utils.run.compare.text import fmt_num, row_label

VERDICT_COLOURS = {
    "faster": "#1a7f37",
    "more accurate": "#1a7f37",
    "less memory": "#1a7f37",
    "fixed": "#1a7f37",
    "slower": "#cf222e",
    "less accurate": "#cf222e",
    "more memory": "#cf222e",
    "failed": "#cf222e",
    APPEARED: "#cf222e",
    DISAPPEARED: "#cf222e",
    ENTERED_TOP_N: "#9a6700",
    LEFT_TOP_N: "#9a6700",
    "same": "#6e7781",
    "changed": "#9a6700",
    "device differs": "#9a6700",
    NOT_COMPARABLE: "#9a6700",
    NOISY: "#bc4c00",
}

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em;color:#222;max-width:1400px}
table{border-collapse:collapse;margin:1em 0;font-size:90%}
td,th{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}th{background:#f3f3f3}
th.sortable{cursor:pointer;user-select:none}th.sortable:after{content:" \\2195";
color:#999}td.num{text-align:right;font-variant-numeric:tabular-nums}.flag{color:#9a6700}.bad{color:#cf222e;
font-weight:600}.good{color:#1a7f37;font-weight:600}.muted{color:#666}code{font-family:ui-monospace,Menlo,monospace}
#filter{padding:4px;width:30em}tr.noisy{background:#fff4e5}
"""

_JS = """
(function(){
  function cellValue(td){ var v = td.getAttribute('data-v'); if (v === null) v = td.textContent.trim();
    var n = parseFloat(v); return (v !== '' && !isNaN(n) && isFinite(v)) ? n : v.toLowerCase(); }
  document.querySelectorAll('table.sortable').forEach(function(table){
    table.querySelectorAll('th').forEach(function(th, col){
      th.classList.add('sortable');
      th.addEventListener('click', function(){
        var tbody = table.tBodies[0], rows = Array.prototype.slice.call(tbody.rows);
        var asc = th.getAttribute('data-dir') !== 'asc';
        table.querySelectorAll('th').forEach(function(h){ h.removeAttribute('data-dir'); });
        th.setAttribute('data-dir', asc ? 'asc' : 'desc');
        rows.sort(function(a, b){ var x = cellValue(a.cells[col]), y = cellValue(b.cells[col]);
          if (typeof x === typeof y) return (x < y ? -1 : x > y ? 1 : 0) * (asc ? 1 : -1);
          return (typeof x === 'number' ? -1 : 1) * (asc ? 1 : -1); });
        rows.forEach(function(r){ tbody.appendChild(r); });
      });
    });
  });
  var f = document.getElementById('filter');
  if (f) f.addEventListener('input', function(){ var q = f.value.toLowerCase();
    document.querySelectorAll('#rows tbody tr').forEach(function(tr){
      tr.style.display = tr.textContent.toLowerCase().indexOf(q) >= 0 ? '' : 'none'; }); });
})();
"""


def _ratio_plot(cmp, max_rows: int = 300):
    """Bokeh plot of the oriented gain (> 1: candidate better) with its interval, one row per key."""
    df = cmp.rows
    if not len(df):
        return None
    df = df[np.isfinite(df["gain"].astype(float)) & (df["gain"].astype(float) > 0)].copy()
    if not len(df):
        return None
    df["_dev"] = np.abs(np.log(df["gain"].astype(float)))
    if len(df) > max_rows:
        df = df.sort_values("_dev", ascending=False).head(max_rows)
    df = df.sort_values(["lab", "experiment", "variant", "shape", "dtype", "metric"], ascending=False)
    labels = [row_label(r) for _, r in df.iterrows()]
    # labels must be unique factors
    seen: dict[str, int] = {}
    uniq = []
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
        uniq.append(lab if seen[lab] == 1 else f"{lab} ({seen[lab]})")
    lo = df["lo"].astype(float).where(np.isfinite(df["lo"].astype(float)), df["gain"].astype(float))
    hi = df["hi"].astype(float).where(np.isfinite(df["hi"].astype(float)), df["gain"].astype(float))
    src = ColumnDataSource(
        dict(
            label=uniq,
            gain=df["gain"].astype(float).tolist(),
            lo=lo.tolist(),
            hi=hi.tolist(),
            verdict=df["verdict"].tolist(),
            base=df["base"].astype(float).tolist(),
            cand=df["candidate"].astype(float).tolist(),
            unit=df["unit"].tolist(),
            noise=df["noise"].tolist(),
            colour=[VERDICT_COLOURS.get(v, "#6e7781") for v in df["verdict"]],
        )
    )
    vals = np.concatenate([lo.to_numpy(), hi.to_numpy(), df["gain"].astype(float).to_numpy()])
    t = cmp.options.threshold
    xmin = min(float(vals.min()), 1 / (1 + t)) / 1.15
    xmax = max(float(vals.max()), 1 + t) * 1.15
    p = figure(
        y_range=uniq,
        x_axis_type="log",
        x_range=(xmin, xmax),
        # the data area's own width: long row labels widen the figure instead of squeezing it
        frame_height=max(130, 24 * len(uniq)),
        frame_width=RATIO_FRAME_WIDTH,
        title="candidate vs base: gain (> 1 = candidate better), with interval",
        x_axis_label="gain = base/candidate for lower-is-better, candidate/base for higher-is-better (dB: 10^(Δ/10))",
        tools="pan,wheel_zoom,box_zoom,reset,save",
        toolbar_location="above",
    )
    p.add_layout(BoxAnnotation(left=1 / (1 + t), right=1 + t, fill_alpha=0.12, fill_color="#6e7781"))
    p.add_layout(Span(location=1, dimension="height", line_color="black", line_dash="dashed"))
    p.segment(x0="lo", x1="hi", y0="label", y1="label", source=src, line_color="colour", line_width=3)
    r = p.scatter(x="gain", y="label", source=src, size=9, fill_color="colour", line_color="black")
    p.add_tools(
        HoverTool(
            renderers=[r],
            tooltips=[
                ("row", "@label"),
                ("verdict", "@verdict"),
                ("base", "@base{0.0000g} @unit"),
                ("candidate", "@cand{0.0000g} @unit"),
                ("gain", "@gain{0.000} [@lo{0.000}, @hi{0.000}]"),
                ("noise", "@noise"),
            ],
        )
    )
    p.yaxis.major_label_text_font_size = "9pt"
    # a tick shows at most LABEL_CHARS characters (the middle elided); the hover shows the whole row
    p.yaxis.major_label_overrides = {u: _short(u) for u in uniq if _short(u) != u}
    return p


RATIO_FRAME_WIDTH = 720
LABEL_CHARS = 70


def _short(label: str, n: int = LABEL_CHARS) -> str:
    """A row label cut to ``n`` characters, its middle elided (lab and metric stay readable)."""
    if len(label) <= n:
        return label
    head = (n - 1) * 2 // 3
    return label[:head] + "…" + label[-(n - 1 - head) :]


def _params_rows(cmp) -> str:
    """Each side's suite and overrides, and every lab's parameters that differ between the sides."""
    esc = html.escape
    b, c = overrides_text(cmp.base), overrides_text(cmp.cand)
    cls = ' class="flag"' if b != c else ""
    out = f"<tr{cls}><th>suite, overrides</th><td>{esc(b)}</td><td>{esc(c)}</td></tr>"
    pb, pc = notebook_params(cmp.base) or {}, notebook_params(cmp.cand) or {}
    for lab in sorted(set(pb) | set(pc)):
        a, z = pb.get(lab, {}), pc.get(lab, {})
        keys = sorted(k for k in set(a) | set(z) if str(a.get(k)) != str(z.get(k)))
        if keys:
            fa = ", ".join(f"{k}={a.get(k)!r}" for k in keys)
            fz = ", ".join(f"{k}={z.get(k)!r}" for k in keys)
            out += f'<tr class="flag"><th>{esc(lab)} parameters</th><td>{esc(fa)}</td><td>{esc(fz)}</td></tr>'
    return out


def _inline_bokeh(Resources) -> str:
    """BokehJS inline.  Once panel has been imported in the process it registers its own
    extension scripts by relative URL (e.g. es-module-shims); this page uses none of them,
    so any <script src=...> is dropped to keep the page self-contained."""
    return re.sub(r"<script[^>]*\bsrc=[^>]*>\s*</script>", "", Resources(mode="inline", components=["bokeh"]).render())


def render_html(cmp) -> str:
    """One self-contained page: BokehJS inline, no request to anything outside the file."""
    esc = html.escape
    o = cmp.options
    plot = _ratio_plot(cmp)
    script, div = components(plot) if plot is not None else ("", "<p class='muted'>no comparable rows to plot</p>")
    ctx_rows = ""
    for k in SIDE_CONTEXT_KEYS:
        b, c = cmp.base.context.get(k, ""), cmp.cand.context.get(k, "")
        cls = ' class="flag"' if str(b) != str(c) and k not in ("timestamp", "run_id") else ""
        ctx_rows += f"<tr{cls}><th>{esc(k)}</th><td>{esc(str(b))}</td><td>{esc(str(c))}</td></tr>"
    ctx_rows += f"<tr><th>source</th><td>{esc(cmp.base.source)}</td><td>{esc(cmp.cand.source)}</td></tr>"
    ctx_rows += _params_rows(cmp)
    flags = "".join(f'<li class="flag">{esc(f)}</li>' for f in cmp.flags) or "<li class='muted'>none</li>"
    counts = ", ".join(f"{v} {esc(k)}" for k, v in cmp.counts().items()) or "no rows"
    body = []
    noisy_cls = ' class="noisy"'
    for _, r in cmp.rows.iterrows():
        colour = VERDICT_COLOURS.get(r["verdict"], "#6e7781")
        lo_hi = ""
        if math.isfinite(r["lo"]) and math.isfinite(r["hi"]):
            lo_hi = f"[{r['lo']:.3g}, {r['hi']:.3g}]"

        def num(v, cls="num"):
            fv = float(v) if v is not None else math.nan
            dv = "" if math.isnan(fv) else (repr(fv) if math.isfinite(fv) else ("1e308" if fv > 0 else "-1e308"))
            return f'<td class="{cls}" data-v="{dv}">{fmt_num(fv)}</td>'

        body.append(
            f'<tr data-verdict="{esc(r["verdict"])}"{noisy_cls if r["verdict"] == NOISY else ""}>'
            + "".join(
                f"<td>{esc(str(r[c]))}</td>"
                for c in ("lab", "experiment", "variant", "shape", "dtype", "ident", "metric", "statistic")
            )
            + num(r["base"])
            + num(r["candidate"])
            + f"<td>{esc(r['unit'])}</td>"
            + num(r["ratio"])
            + num(r["gain"])
            + f"<td>{lo_hi}</td><td>{esc(r['noise'])}</td>"
            + f'<td style="color:{colour};font-weight:600">{esc(r["verdict"])}'
            + (" ⚑" if r["regression"] or bool(r.get("missing", False)) else "")
            + f"</td><td>{esc(r['note'])}</td></tr>"
        )
    dir_rows = "".join(
        f"<tr><td><code>{esc(d['rule'])}</code></td><td>{d['better']}</td><td>{d['kind']}</td>"
        f"<td>{d['compared by']}</td></tr>"
        for d in direction_table()
    )
    result_cls = "bad" if cmp.exit_code else "good"
    noise = (
        f"{int(o.confidence * 100)}% bootstrap interval of the ratio of medians ({o.bootstrap} resamples, fixed seed)"
        if o.method == "bootstrap"
        else f"Mann-Whitney U test, p &lt; {1 - o.confidence:.3g}"
    )
    title = f"perflab compare: {cmp.cand.run_id} vs {cmp.base.run_id}"
    return f"""<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>{_CSS}</style>
{_inline_bokeh(Resources)}
</head><body>
<h1>{esc(title)}</h1>
<p class="{result_cls}">{esc(cmp.result_line())}</p>
<p>Verdicts: {counts}.</p>
<p class="muted">A verdict other than <i>same</i> needs the difference beyond the threshold (±{o.threshold:.0%}
performance and memory, ±{o.accuracy_threshold:.0%} error figures, ±{o.db_threshold:g} dB) and, where samples were
kept, significance by the {noise}. GB/s, TFLOP/s and % of ceiling borrow their time row's interval.
<i>gain</i> &gt; 1 means the candidate is better; <i>ratio</i> is candidate / base.</p>
<h2>Flags</h2><ul>{flags}</ul>
<h2>Runs</h2><table><tr><th></th><th>base</th><th>candidate</th></tr>{ctx_rows}</table>
<h2>Gains with intervals</h2>
{div}
<h2>Rows</h2>
<p><input id="filter" placeholder="filter rows (any text)"> <span class="muted">click a column header to sort</span></p>
<table id="rows" class="sortable"><thead><tr><th>lab</th><th>experiment</th><th>variant</th><th>shape</th><th>dtype</th>
<th>extra</th><th>metric</th><th>statistic</th><th>base</th><th>candidate</th><th>unit</th><th>ratio</th><th>gain</th>
<th>interval (gain)</th><th>noise</th><th>verdict</th><th>note</th></tr></thead>
<tbody>{"".join(body)}</tbody></table>
<details><summary><b>Which way is better</b> (first matching rule)</summary>
<table><tr><th>rule</th><th>better</th><th>kind</th><th>compared by</th></tr>{dir_rows}</table></details>
{script}
<script>{_JS}</script>
</body></html>"""
