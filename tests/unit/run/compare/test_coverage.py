"""lab_utils.run.compare.coverage on sides written here: the labs each side covers (status and rows,
ran only), which failed and which newly failed, narrowing to some labs (rows, status and the
per-notebook context) and the error naming a lab neither ran, the device a ``device`` parameter
resolved to, what keeps a row from being compared (software for timings and memory, threads for
timings only and only when both sides say, parameters and compile mode for every kind) and the
flags and reasons printed for each, word for word."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from lab_utils.run.compare import coverage as C
from lab_utils.run.compare.options import Options
from lab_utils.run.compare.rules import CompareError
from lab_utils.run.compare.sides import Side


def side(label="base", rows=(), status=(), **context) -> Side:
    cols = ["lab", "notebook", "experiment", "metric", "value", "device_kind"]
    return Side(label, label, pd.DataFrame(list(rows), columns=cols), dict(context), list(status))


def row(lab, notebook=None, kind="cpu"):
    return {"lab": lab, "notebook": notebook, "experiment": "e", "metric": "time", "value": 1.0, "device_kind": kind}


def test_the_labs_a_side_covers_and_which_failed():
    s = side(
        rows=[row("01_a"), row("02_b", "02_b_nb")],
        status=[{"notebook": "03_c", "status": "ok"}, {"notebook": "04_d", "status": "failed"}, {"status": "ok"}],
    )
    assert C.labs_of(s) == {"01_a", "02_b", "02_b_nb", "03_c", "04_d"}
    assert C.labs_of(s, ran_only=True) == {"01_a", "02_b", "02_b_nb", "03_c"}  # a failed one's status left out
    assert C.failed_labs(s) == {"04_d"}
    cand = side(
        "cand",
        status=[
            {"notebook": "01_a", "status": "failed"},
            {"notebook": "03_c", "status": "error"},
            {"notebook": "02_b_nb", "status": "failed"},
            {"notebook": "09_z", "status": "failed"},
        ],
    )
    assert C.newly_failed(s, cand) == ["01_a", "02_b_nb", "03_c"]  # 09_z never ran in the base


def test_narrowing_to_some_labs():
    s = side(
        rows=[row("01_a"), row("x", "02_b"), row("03_c")],
        status=[{"notebook": "01_a", "status": "ok"}, {"notebook": "03_c", "status": "ok"}],
        notebooks=[{"notebook": "01_a", "params": {}}, {"notebook": "03_c", "params": {}}, "junk"],
        suite="smoke",
    )
    s.mixed = {"torch_version": ["2.12", "2.13"]}
    n = C.narrow(s, ("01_a", "02_b"))
    assert n.rows["lab"].tolist() == ["01_a", "x"] and list(n.rows.index) == [0, 1]  # by lab or by notebook
    assert n.status == [{"notebook": "01_a", "status": "ok"}]
    assert n.context["notebooks"] == [{"notebook": "01_a", "params": {}}] and n.context["suite"] == "smoke"
    assert n.mixed == s.mixed and len(s.rows) == 3  # the side itself untouched
    b, c = C.narrow_both(s, side("cand", rows=[row("05_e")]), ("05_e",))
    assert b.rows.empty and c.rows["lab"].tolist() == ["05_e"]
    assert C.narrow_both(s, s, ()) == (s, s)
    with pytest.raises(
        CompareError,
        match=r"parameter 'only' = '07_q' is not a lab of either run; their labs: "
        r"01_a, 02_b, 03_c, 05_e, x",
    ):
        C.narrow_both(s, side("cand", rows=[row("05_e")]), ("01_a", "07_q"))


def test_the_device_a_parameter_resolved_to():
    rows = [
        row("01_a", kind="cuda"),
        row("01_a", kind="cuda"),
        row("02_b", kind="cpu"),
        row("02_b", kind="cuda"),
        row("03_c", kind=None),
    ]
    s = side(
        rows=rows,
        device_kind="cpu",
        notebooks=[
            {"notebook": "01_a", "params": {"device": "auto", "n": 1}},
            {"notebook": "02_b", "params": {"device": "auto"}},
            {"notebook": "03_c", "params": None},
            {"params": {"device": "x"}},
        ],
    )
    kinds = C.resolved_device_kinds(s)
    assert kinds["01_a"] == "cuda" and "02_b" not in kinds and "03_c" not in kinds  # two kinds, or none: unknown
    p = C.notebook_params(s)
    assert p == {"01_a": {"device": "cuda", "n": 1}, "02_b": {"device": "cpu"}, "03_c": {}}  # else the run's kind
    assert C.notebook_params(side(notebooks="x")) is None and C.notebook_params(side(notebooks=[])) is None
    assert C.resolved_device_kinds(side()) == {}


def test_overrides_text():
    assert C.overrides_text(side(suite="smoke", overrides={"n": 2, "dtype": "bf16"})) == (
        "suite smoke, overrides n=2, dtype='bf16'"
    )
    assert C.overrides_text(side()) == "suite ?, overrides none"


def test_overrides_text_of_a_run_without_overrides_says_none():
    """The runner records a run without ``--param`` as ``overrides: {}``: none, not an empty list."""
    assert C.overrides_text(side(suite="smoke", overrides={})) == "suite smoke, overrides none"
    assert C.overrides_text(side(suite="smoke", overrides="n=2")) == "suite smoke, overrides none"  # not a dict
    assert C.overrides_text(side(overrides={"n": 2})) == "suite ?, overrides n=2"


def test_what_keeps_a_row_from_being_compared():
    d = C.ContextDiff(Options(), software=["torch 2.12 -> 2.13"])
    assert d.blockers("01_a", "performance", None, None) == [("software", "software differs: torch 2.12 -> 2.13")]
    assert [c for c, _ in d.blockers("01_a", "memory", None, None)] == ["software"]
    assert d.blockers("01_a", "accuracy", None, None) == []  # software does not change an error figure
    t = C.ContextDiff(Options())
    two, four = json.dumps({"threads": 2}), {"threads": 4}
    assert t.blockers("01_a", "performance", two, four) == [
        ("threads", "timed with 2 CPU thread(s) in the base, 4 in the candidate")
    ]
    assert t.blockers("01_a", "memory", two, four) == [] and t.blockers("01_a", "performance", two, {}) == []
    assert t.blockers("01_a", "performance", two, two) == []
    p = C.ContextDiff(
        Options(allow_context_diff=("compile",)), params={"01_a": [("compile", False, True), ("n", 1, 2)]}
    )
    assert (
        p.lab_params_text("01_a")
        == "compile False in the base, True in the candidate, n 1 in the base, 2 in the candidate"
    )
    assert p.param_categories("01_a") == {"compile", "params"} and p.param_categories("02_b") == set()
    got = p.blockers("01_a", "accuracy", None, None)
    assert [c for c, _ in got] == ["compile", "params"] and got[0][1].startswith("compile mode differ: compile False")
    assert p.not_allowed(got) == [got[1]]  # compile asked for, parameters not
    assert p.explain_one_sided("01_a") == "01_a ran with " + p.lab_params_text("01_a")
    r = C.ContextDiff(Options(), run_level="overrides {'n': 2} in the base, none in the candidate")
    assert r.param_categories("any") == {"params"} and r.explain_one_sided("any") == r.run_level


def test_the_flags_and_reasons_word_for_word():
    d = C.ContextDiff(
        Options(allow_context_diff=("params",)),
        software=["torch 2.12 -> 2.13"],
        suite="suite a in the base, b in the candidate",
        params={"02_b": [("n", 1, 2)], "01_a": [("compile", False, True)]},
    )
    assert d.flags_before() == [
        "SUITES DIFFER: suite a in the base, b in the candidate",
        "PARAMETERS DIFFER in 01_a: compile False in the base, True in the candidate: not compared "
        "(--allow-context-diff compile)",
        "PARAMETERS DIFFER in 02_b: n 1 in the base, 2 in the candidate (compared as asked)",
    ]
    assert d.flags_after() == []
    d.count_blocked([("threads", "timed with 2 ..."), ("software", "x")], "01_a e/v")
    d.count_blocked([("threads", "timed with 8 ...")], "01_a e/w")
    assert d.blocked == {"threads": 2, "software": 1} and d.threads_example == "01_a e/v: timed with 2 ..."
    assert d.flags_after() == [
        "TIMING THREADS DIFFER in 2 row(s) (e.g. 01_a e/v: timed with 2 ...): not compared "
        "(--allow-context-diff threads)"
    ]
    assert d.incomparable_reasons() == [
        "parameters differ (01_a: compile False in the base, True in the candidate); --allow-context-diff compile to "
        "compare them, or --only LAB to leave them out",
        "software differs (torch 2.12 -> 2.13): 1 row(s) not compared; --allow-context-diff software to compare them",
        "timing threads differ: 2 row(s) not compared; --allow-context-diff threads to compare them",
    ]
    r = C.ContextDiff(Options(), run_level="overrides a")
    assert r.flags_before() == ["RUNS DIFFER: overrides a: not compared (--allow-context-diff params)"]
    assert r.incomparable_reasons() == ["overrides a; --allow-context-diff params to compare them"]
    ok = C.ContextDiff(Options(allow_context_diff=("params",)), run_level="overrides a")
    assert ok.flags_before() == ["RUNS DIFFER: overrides a (compared as asked)"] and ok.incomparable_reasons() == []


def test_the_context_difference_of_two_runs():
    nbs = [{"notebook": "01_a", "params": {"n": 1, "m": 3}}, {"notebook": "02_b", "params": {"n": 1}}]
    base = side(
        torch_version="2.12",
        triton_version="3.5",
        python_version="3.11",
        cuda_version="12.4",
        suite="smoke",
        notebooks=nbs,
        params_source="runner",
    )
    cand = side(
        "cand",
        torch_version="2.13",
        triton_version="",
        python_version="3.11",
        cuda_version="12.8",
        suite="full",
        params_source="runner",
        notebooks=[{"notebook": "01_a", "params": {"n": 2}}, {"notebook": "02_b", "params": {"n": 1}}],
    )
    d = C.context_diff(base, cand, Options(), device_differs=False)
    assert d.software == ["torch 2.12 -> 2.13", "cuda 12.4 -> 12.8"]  # a Triton version on one side only: not
    assert C.context_diff(base, cand, Options(), device_differs=True).software == ["torch 2.12 -> 2.13"]
    assert d.suite == "suite smoke in the base, full in the candidate" and d.run_level == ""
    assert d.params == {"01_a": [("m", 3, None), ("n", 1, 2)]}  # same source: a key on one side differs too
    other = side("cand", notebooks=cand.context["notebooks"], params_source="records")
    assert C.context_diff(base, other, Options(), device_differs=False).params == {"01_a": [("n", 1, 2)]}
    a, b = side(suite="smoke", overrides={"n": 2}), side("cand", suite="smoke")
    assert C.context_diff(a, b, Options(), device_differs=False).run_level == (
        "overrides {'n': 2} in the base, none in the candidate"
    )
    assert C.context_diff(a, a, Options(), device_differs=False).run_level == ""


def test_the_context_flags_of_two_runs():
    base = side(
        device="NVIDIA H100",
        device_kind="cuda",
        device_info={"units": 132, "memory_bytes": 80},
        torch_version="2.12",
        commit="abc",
        status=[],
    )
    same = side(
        "cand",
        device="NVIDIA H100",
        device_kind="cuda",
        device_info={"units": 114, "memory_bytes": 80},
        torch_version="2.12",
        commit="abc",
    )
    flags, mismatch = C.context_flags(base, same)
    assert flags == ["device setup differs: units 132 -> 114"] and mismatch is False
    other = side(
        "cand",
        device="AMD EPYC",
        device_kind="cpu",
        device_info={"units": 2},
        torch_version="2.13",
        commit="def",
        status=[{"notebook": "01_a", "status": "failed"}],
    )
    other.mixed = {"torch_version": ["2.12", "2.13"]}
    flags, mismatch = C.context_flags(base, other)
    assert mismatch is True and flags == [
        "DEVICE DIFFERS: base ran on NVIDIA H100 (cuda), candidate on AMD EPYC (cpu)",
        "software differs: torch 2.12 -> 2.13",
        "commit differs: abc -> def",
        "cand: its rows come from different torch values (2.12, 2.13): a run that spanned commits, or records "
        "gathered from several runs?",
        "cand: notebook(s) failed, their rows are missing: 01_a",
    ]
    kind_only = side("cand", device_kind="cpu")
    assert C.context_flags(side(device_kind="cuda"), kind_only)[1] is True
    assert C.context_flags(side(device="x"), side("cand"))[1] is False  # one side unknown: no mismatch
