"""The printed summary of a comparison (``summary.txt`` and the terminal)."""

from __future__ import annotations

import math

import pandas as pd

from lab_utils.run.compare.coverage import overrides_text
from lab_utils.run.compare.rules import ENTERED_TOP_N, LEFT_TOP_N, NOISY, NOT_COMPARABLE, SKIPPED, WORSE_VERDICTS
from lab_utils.run.compare.sides import Side

RANKED_REPORTED = (LEFT_TOP_N, ENTERED_TOP_N)


def row_label(r) -> str:
    parts = [r["lab"], r["experiment"], r["variant"]]
    tail = " ".join(x for x in (r["shape"], r["dtype"], f"[{r['ident']}]" if r.get("ident") else "") if x)
    stat = r["statistic"] if r["statistic"] not in ("value", "") else ""
    lab = "/".join(str(p) for p in parts if p)
    metric = r["metric"] + (f"[{stat}]" if stat else "") + (f" #{r['occurrence']}" if r["occurrence"] > 1 else "")
    return f"{lab} {tail} {metric}".replace("  ", " ").strip()


def fmt_num(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return f"{float(v):.4g}"


def ratio_text(r) -> str:
    if r["unit"] == "dB" and math.isfinite(r["base"]) and math.isfinite(r["candidate"]):
        return f"{r['candidate'] - r['base']:+.2f} dB"
    if not math.isfinite(r["ratio"]) and not (isinstance(r["ratio"], float) and math.isinf(r["ratio"])):
        return ""
    s = f"x{fmt_num(r['ratio'])}"
    if math.isfinite(r["lo"]) and math.isfinite(r["hi"]):
        # interval shown in the same orientation as the ratio (candidate / base)
        lo, hi = (1 / r["hi"], 1 / r["lo"]) if r["better"] == "lower" else (r["lo"], r["hi"])
        s += f" [{lo:.3g}, {hi:.3g}]"
    return s


def side_line(s: Side) -> str:
    c = s.context
    bits = [
        f"{c.get('device') or '?'} ({c.get('device_kind') or '?'})",
        f"torch {c.get('torch_version') or '?'}",
        f"triton {c.get('triton_version') or '?'}",
    ]
    if c.get("cuda_version"):
        bits.append(f"CUDA {c['cuda_version']}")
    bits.append(f"commit {c.get('commit') or '?'}")
    bits.append(overrides_text(s))
    return f"{s.source} [{s.run_id}]: " + ", ".join(bits)


def summary_text(cmp, limit: int = 40) -> str:
    """The printed summary of a ``Comparison`` (``comparison.Comparison``, which calls this)."""
    o = cmp.options
    noise = (
        f"{int(o.confidence * 100)}% bootstrap interval of the ratio of medians ({o.bootstrap} resamples)"
        if o.method == "bootstrap"
        else f"Mann-Whitney U test at p < {1 - o.confidence:.3g}"
    )
    lines = [
        "perflab compare",
        f"  base:      {side_line(cmp.base)}",
        f"  candidate: {side_line(cmp.cand)}",
        f"  rule:      a verdict needs the difference beyond the threshold (±{o.threshold:.0%} performance "
        f"and memory, ±{o.accuracy_threshold:.0%} error figures, ±{o.db_threshold:g} dB) and, where samples "
        f"were kept, significant by the {noise}",
    ]
    if cmp.flags:
        lines.append("flags:")
        lines += [f"  ! {f}" for f in cmp.flags]
    counts = cmp.counts()
    lines.append("verdicts: " + (", ".join(f"{v} {k}" for k, v in counts.items()) or "no rows"))

    def section(title: str, df: pd.DataFrame):
        if not len(df):
            return
        lines.append(f"{title} ({len(df)}):")
        for _, r in df.head(limit).iterrows():
            unit = f" {r['unit']}" if r["unit"] else ""
            lines.append(
                f"  {row_label(r)}: {fmt_num(r['base'])} -> {fmt_num(r['candidate'])}{unit}  {ratio_text(r)}  "
                f"{r['verdict'].upper()}" + (f" ({r['note']})" if r["note"] else "")
            )
        if len(df) > limit:
            lines.append(f"  ... {len(df) - limit} more (see compare.html / compare.json)")

    rows = cmp.rows
    section("REGRESSIONS beyond threshold", cmp.regressions)
    if len(rows):
        section("worse but not gated", rows[rows["verdict"].isin(WORSE_VERDICTS) & ~rows["regression"]])
        section("improvements", cmp.improvements)
        section("possible changes, not confident (not gated)", rows[rows["note"].str.startswith("possibly")])
        section("noisy: unstable timings, not judged", rows[rows["verdict"] == NOISY])
        changed = rows["verdict"] == "changed"
        section("changed (no better direction)", rows[changed & (rows["kind"] != "reported")])
        section("reported, never gated: moved beyond the threshold", rows[changed & (rows["kind"] == "reported")])
        section("ranked lists: items that entered or left (reported)", rows[rows["verdict"].isin(RANKED_REPORTED)])
        section("not compared: device differs", rows[rows["verdict"] == "device differs"])
        section("not compared: the runs differ in what they measure", rows[rows["verdict"] == NOT_COMPARABLE])
        section("only in base", rows[rows["verdict"] == "only in base"])
        section("only in candidate", rows[rows["verdict"] == "only in candidate"])
        section("no value", rows[rows["verdict"].isin(("no value", "failed both"))])
        section("skipped in base and candidate (not compared)", rows[rows["verdict"] == SKIPPED])
    lines.append("result: " + cmp.result_line())
    return "\n".join(lines) + "\n"
