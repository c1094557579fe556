"""What two runs cover and what their timings measure: the checks that keep a comparison from
passing by omission or by matching unlike rows.

* Coverage: the labs each side ran (its status and its rows).  A lab of the base that the
  candidate did not run, and rows of the base missing from a lab the candidate ran, fail the
  gate, unless the comparison is narrowed to some labs (``Options.labs``, ``--only LAB``):
  then both sides are compared on those labs only.
* What a timing measures: the device, the software (torch, triton, CUDA, Python, the Triton
  interpreter), the CPU threads it ran with (each timing row's ``extra.threads``), and the
  notebook's parameters (a ``compile`` parameter is its own category).  Rows whose runs differ
  in one of these are "not comparable" (never slower or faster) unless the comparison is asked
  for (``Options.allow_context_diff``, ``--allow-context-diff``).  Parameters are the runner's
  (``context.json`` ``notebooks[].params``) or, for a records file or an interrupted run, each
  notebook's config as its records carry it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace

from lab_utils.run.compare.options import Options
from lab_utils.run.compare.rules import CompareError
from lab_utils.run.compare.sides import Side, extra_dict
from lab_utils.run.migrate import migrate_params

#: software fields that follow the device (a CPU run has no CUDA and interprets Triton)
DEVICE_SOFTWARE = ("cuda_version", "triton_interpret")
SOFTWARE = ("torch_version", "triton_version", "python_version", *DEVICE_SOFTWARE)
#: which kinds of row each context difference makes not comparable
AFFECTS = {
    "software": ("performance", "memory"),
    "threads": ("performance",),
    "compile": ("performance", "memory", "accuracy", "other"),
    "params": ("performance", "memory", "accuracy", "other"),
}


def labs_of(side: Side, *, ran_only: bool = False) -> set[str]:
    """The labs a side covers: those in its status (any status) and those with rows.
    ``ran_only``: leave out notebooks whose status is not ok."""
    labs = {
        str(s.get("notebook")) for s in side.status if s.get("notebook") and (not ran_only or s.get("status") == "ok")
    }
    for col in ("lab", "notebook"):
        if col in side.rows.columns:
            labs |= {str(v) for v in side.rows[col].dropna().unique() if str(v)}
    return labs


def failed_labs(side: Side) -> set[str]:
    return {str(s.get("notebook")) for s in side.status if s.get("status") != "ok"}


def narrow(side: Side, labs: tuple[str, ...]) -> Side:
    """The side's rows, status and per-notebook context of these labs only."""
    rows = side.rows
    keep = rows["lab"].isin(labs)
    if "notebook" in rows.columns:
        keep |= rows["notebook"].astype(str).isin(labs)
    ctx = dict(side.context)
    if isinstance(ctx.get("notebooks"), list):
        ctx["notebooks"] = [n for n in ctx["notebooks"] if isinstance(n, dict) and n.get("notebook") in labs]
    out = replace(
        side,
        rows=rows[keep].reset_index(drop=True),
        status=[s for s in side.status if s.get("notebook") in labs],
        context=ctx,
    )
    out.mixed = getattr(side, "mixed", {})  # type: ignore[attr-defined]
    return out


def narrow_both(base: Side, cand: Side, labs: tuple[str, ...]) -> tuple[Side, Side]:
    if not labs:
        return base, cand
    known = labs_of(base) | labs_of(cand)
    unknown = [x for x in labs if x not in known]
    if unknown:
        raise CompareError(
            f"parameter 'only' = {unknown[0]!r} is not a lab of either run; their labs: {', '.join(sorted(known))}"
        )
    return narrow(base, labs), narrow(cand, labs)


#: the notebook parameter that picks the device: compared by what it resolved to
DEVICE_PARAM = "device"


def resolved_device_kinds(side: Side) -> dict[str, str]:
    """Each notebook's (and lab's) device kind as its rows recorded it (``cpu``, ``cuda``): what a
    ``device`` parameter of ``auto`` (a notebook's default) or ``cpu`` (a headless set) resolved to."""
    rows = side.rows
    if "device_kind" not in rows.columns or not len(rows):
        return {}
    out: dict[str, str] = {}
    for col in ("lab", "notebook"):
        if col in rows.columns:
            for name, kinds in rows.groupby(rows[col].astype(str))["device_kind"]:
                vals = sorted({str(k) for k in kinds.dropna() if str(k)})
                if len(vals) == 1:
                    out[name] = vals[0]
    return out


def notebook_params(side: Side) -> dict[str, dict] | None:
    """Each notebook's parameters as the run recorded them, or None where it did not; its
    ``device`` parameter as the device kind it resolved to (``auto`` on a CPU machine is ``cpu``)."""
    nbs = side.context.get("notebooks")
    if not isinstance(nbs, list):
        return None
    out = {str(n["notebook"]): n.get("params") or {} for n in nbs if isinstance(n, dict) and n.get("notebook")}
    # a run stored before a parameter was renamed is read under the current names
    out = {nb: migrate_params(nb, params)[0] for nb, params in out.items()}
    kinds = resolved_device_kinds(side)
    fallback = str(side.context.get("device_kind") or "")
    for nb, params in out.items():
        kind = kinds.get(nb) or fallback
        if DEVICE_PARAM in params and kind:
            out[nb] = {**params, DEVICE_PARAM: kind}
    return out or None


def _text(v) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def overrides_text(side: Side) -> str:
    """The suite and the command line's overrides a side ran with, in one line."""
    c = side.context
    ov = c.get("overrides")
    ov_s = ", ".join(f"{k}={v!r}" for k, v in ov.items()) if isinstance(ov, dict) and ov else "none"
    return f"suite {c.get('suite') or '?'}, overrides {ov_s}"


@dataclass
class ContextDiff:
    """How the two runs differ in what their timings measure, and what the options allow."""

    options: Options
    software: list[str] = field(default_factory=list)  # "torch 2.12 -> 2.13"
    params: dict[str, list[tuple[str, object, object]]] = field(default_factory=dict)  # lab -> (key, base, cand)
    run_level: str = ""  # a suite or overrides difference where per-notebook parameters are unknown
    suite: str = ""  # a suite difference (shown; the parameters it brings are compared per lab)
    threads_example: str = ""
    blocked: dict[str, int] = field(default_factory=dict)  # category -> rows not compared

    def lab_params_text(self, lab: str) -> str:
        diffs = self.params.get(lab) or []
        return ", ".join(f"{k} {b!r} in the base, {c!r} in the candidate" for k, b, c in diffs)

    def param_categories(self, lab: str) -> set[str]:
        cats = {"compile" if re.search("compile", k, re.I) else "params" for k, _, _ in self.params.get(lab) or []}
        if self.run_level:
            cats.add("params")
        return cats

    def blockers(self, lab: str, kind: str, extra_b, extra_c) -> list[tuple[str, str]]:
        """(category, why) for each difference that keeps this row from being compared."""
        out = []
        if self.software and kind in AFFECTS["software"]:
            out.append(("software", "software differs: " + "; ".join(self.software)))
        if kind in AFFECTS["threads"]:
            tb, tc = extra_dict(extra_b).get("threads"), extra_dict(extra_c).get("threads")
            if tb is not None and tc is not None and tb != tc:
                out.append(("threads", f"timed with {tb} CPU thread(s) in the base, {tc} in the candidate"))
        for cat in sorted(self.param_categories(lab)):
            if kind in AFFECTS[cat]:
                why = self.lab_params_text(lab) or self.run_level
                out.append((cat, f"{'compile mode' if cat == 'compile' else 'parameters'} differ: {why}"))
        return out

    def not_allowed(self, blockers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [(c, w) for c, w in blockers if not self.options.allows(c)]

    def explain_one_sided(self, lab: str) -> str:
        """Why a row may be on one side only: the parameter of its lab that differs."""
        text = self.lab_params_text(lab)
        if text:
            return f"{lab} ran with {text}"
        return self.run_level

    def count_blocked(self, blocked: list[tuple[str, str]], label: str) -> None:
        for cat, why in blocked:
            self.blocked[cat] = self.blocked.get(cat, 0) + 1
            if cat == "threads" and not self.threads_example:
                self.threads_example = f"{label}: {why}"

    def flags_before(self) -> list[str]:
        """Flags known before the rows are compared: suites and parameters."""
        out = [f"SUITES DIFFER: {self.suite}"] if self.suite else []
        for lab in sorted(self.params):
            cats = self.param_categories(lab)
            allowed = all(self.options.allows(c) for c in cats)
            out.append(
                f"PARAMETERS DIFFER in {lab}: {self.lab_params_text(lab)}"
                + (
                    " (compared as asked)"
                    if allowed
                    else f": not compared (--allow-context-diff {','.join(sorted(cats))})"
                )
            )
        if self.run_level:
            allowed = self.options.allows("params")
            out.append(
                f"RUNS DIFFER: {self.run_level}"
                + (" (compared as asked)" if allowed else ": not compared (--allow-context-diff params)")
            )
        return out

    def flags_after(self) -> list[str]:
        """Flags counted while comparing rows: timings whose threads differ."""
        n = self.blocked.get("threads", 0)
        if not n:
            return []
        return [
            f"TIMING THREADS DIFFER in {n} row(s) (e.g. {self.threads_example}): not compared "
            f"(--allow-context-diff threads)"
        ]

    def incomparable_reasons(self) -> list[str]:
        """What keeps part of the comparison from being made (exit 3), one line each."""
        out = []
        param_labs = [
            lab for lab in sorted(self.params) if not all(self.options.allows(c) for c in self.param_categories(lab))
        ]
        if param_labs:
            cats = sorted(set().union(*(self.param_categories(lab) for lab in param_labs)))
            texts = "; ".join(f"{lab}: {self.lab_params_text(lab)}" for lab in param_labs)
            out.append(
                f"parameters differ ({texts}); "
                f"--allow-context-diff {','.join(cats)} to compare them, or --only LAB to leave them out"
            )
        if self.run_level and not self.options.allows("params"):
            out.append(f"{self.run_level}; --allow-context-diff params to compare them")
        for cat in ("software", "threads"):
            if self.blocked.get(cat):
                what = (
                    "software differs (" + "; ".join(self.software) + ")"
                    if cat == "software"
                    else "timing threads differ"
                )
                out.append(
                    f"{what}: {self.blocked[cat]} row(s) not compared; --allow-context-diff {cat} to compare them"
                )
        return out


def context_diff(base: Side, cand: Side, options: Options, *, device_differs: bool) -> ContextDiff:
    diff = ContextDiff(options)
    for k in SOFTWARE:
        if device_differs and k in DEVICE_SOFTWARE:
            continue  # a different device brings its own stack: "device" covers it
        b, c = base.context.get(k), cand.context.get(k)
        both = b not in (None, "") and c not in (None, "")
        if (both or k == "cuda_version") and (b or c) and str(b) != str(c):
            diff.software.append(f"{k.replace('_version', '')} {b} -> {c}")
    pb, pc = notebook_params(base), notebook_params(cand)
    sb, sc = base.context.get("suite"), cand.context.get("suite")
    if pb is not None and pc is not None:
        if sb and sc and sb != sc:
            diff.suite = f"suite {sb} in the base, {sc} in the candidate"
        same_source = base.context.get("params_source") == cand.context.get("params_source")
        for lab in sorted(set(pb) & set(pc)):
            a, b = pb[lab], pc[lab]
            keys = (set(a) | set(b)) if same_source else (set(a) & set(b))
            diffs = [(k, a.get(k), b.get(k)) for k in sorted(keys) if _text(a.get(k)) != _text(b.get(k))]
            if diffs:
                diff.params[lab] = diffs
    else:
        ob, oc = base.context.get("overrides") or {}, cand.context.get("overrides") or {}
        what = []
        if sb and sc and sb != sc:
            what.append(f"suite {sb} in the base, {sc} in the candidate")
        if _text(ob) != _text(oc):
            what.append(f"overrides {ob or 'none'} in the base, {oc or 'none'} in the candidate")
        diff.run_level = "; ".join(what)
    return diff


SOFTWARE_FIELDS = ("torch_version", "triton_version", "cuda_version", "python_version", "triton_interpret")


def context_flags(base: Side, cand: Side) -> tuple[list[str], bool]:
    flags = []
    bd, cd = base.context.get("device", ""), cand.context.get("device", "")
    mismatch = bool(bd and cd and bd != cd) or (
        base.context.get("device_kind")
        and cand.context.get("device_kind")
        and base.context.get("device_kind") != cand.context.get("device_kind")
    )
    if mismatch:
        flags.append(
            f"DEVICE DIFFERS: base ran on {bd or '?'} ({base.context.get('device_kind')}), candidate on "
            f"{cd or '?'} ({cand.context.get('device_kind')})"
        )
    bi, ci = base.context.get("device_info") or {}, cand.context.get("device_info") or {}
    if not mismatch and bi and ci:
        for k in ("units", "memory_bytes", "capability", "threads"):
            if k in bi and k in ci and bi[k] != ci[k]:
                flags.append(f"device setup differs: {k} {bi[k]} -> {ci[k]}")
    for k in SOFTWARE_FIELDS:
        b, c = base.context.get(k), cand.context.get(k)
        if (b or c) and str(b) != str(c):
            flags.append(f"software differs: {k.replace('_version', '')} {b} -> {c}")
    b, c = base.context.get("commit"), cand.context.get("commit")
    if b and c and b != c:
        flags.append(f"commit differs: {b} -> {c}")
    for side in (base, cand):
        for k, vals in getattr(side, "mixed", {}).items():
            flags.append(
                f"{side.label}: its rows come from different {k.replace('_version', '')} values "
                f"({', '.join(vals)}): a run that spanned commits, or records gathered from several runs?"
            )
        bad = [s.get("notebook") for s in side.status if s.get("status") != "ok"]
        if bad:
            flags.append(f"{side.label}: notebook(s) failed, their rows are missing: {', '.join(map(str, bad))}")
    return flags, bool(mismatch)


def newly_failed(base: Side, cand: Side) -> list[str]:
    """Notebooks that failed in the candidate but ran (or left rows) in the base."""
    ok_in_base = {s.get("notebook") for s in base.status if s.get("status") == "ok"}
    if "notebook" in base.rows.columns:
        ok_in_base |= {str(n) for n in base.rows["notebook"].dropna().unique()}
    ok_in_base |= {str(n) for n in base.rows["lab"].unique()}
    return sorted(
        str(s.get("notebook")) for s in cand.status if s.get("status") != "ok" and s.get("notebook") in ok_in_base
    )
