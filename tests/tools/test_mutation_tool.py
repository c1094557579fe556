"""benchmarks/mutation.py on a tiny fake tree: a mutant the tests catch is killed, one they miss
survives, a snippet that is not in its file is stale, a test id that is gone is stale, a module
no test maps to is untested, a mutant that hangs is a timeout, a failing baseline skips its room;
the tree it runs in is a copy.  The generator's edits are counted by hand on small modules,
applied at exact positions and restored, reproducible from their seed; equivalents are marked.
Of the project's own table only the schema is checked (never whether a snippet still matches)."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the tool's modules import as benchmarks.<name>, like gpu_check's

from benchmarks import mutation  # noqa: E402
from benchmarks import mutation_gen as gen  # noqa: E402
from benchmarks import mutation_table as mt  # noqa: E402

CALC = '''\
import os


def add(a, b):
    return a + b


def spin():
    return 1


def clip(x, lo, hi):
    """Doc: 0 < 1."""
    if x < lo:
        return lo
    return min(x, hi)


def scaled(ms):
    return ms * 1e3 - 2
'''
TEST_CALC = """\
import os
from pathlib import Path

from fakepkg.toy.calc import add, clip, scaled, spin


def test_dump():  # first: what the tests saw, whatever fails after
    if os.environ.get("MUTATION_DUMP"):
        text = Path(__file__).parents[3].joinpath("fakepkg", "toy", "calc.py").read_text()
        Path(os.environ["MUTATION_DUMP"], str(abs(hash(text)))).write_text(text)


def test_add():
    assert add(2, 3) == 5


def test_spin():
    assert spin() == 1


def test_clip():
    assert clip(5, 0, 3) == 3 and clip(-1, 0, 3) == 0


def test_scaled():
    assert scaled(2) == 1998
"""
TOY = """\
room: toy
tests:
  fakepkg/toy/calc.py:
  - tests/test_calc_extra.py::test_gone
  - tests/test_calc_extra.py::test_other
  - tests/test_moved.py
mutants:
- id: calc.sub
  file: fakepkg/toy/calc.py
  find: a + b
  replace: a - b
  why: sign
  named: N1
- id: calc.swap
  file: fakepkg/toy/calc.py
  find: a + b
  replace: b + a
  why: equivalent
- id: calc.gone
  file: fakepkg/toy/calc.py
  find: a * b
  replace: a / b
  why: stale
- id: calc.hang
  file: fakepkg/toy/calc.py
  find: return 1
  replace: |-
    while True:
            pass
  why: loops
- id: idle.triple
  file: fakepkg/toy/idle.py
  find: x * 2
  replace: x * 3
  why: no test sees it
"""
BROKEN = """\
room: broken
mutants:
- id: thing.two
  file: fakepkg/broken/thing.py
  find: x = 1
  replace: x = 2
  why: any
"""
PACKAGES = ("fakepkg",)


@pytest.fixture
def fake(tmp_path):
    root = tmp_path / "tree"
    files = {
        "fakepkg/__init__.py": "",
        "fakepkg/toy/__init__.py": "",
        "fakepkg/toy/calc.py": CALC,
        "fakepkg/toy/idle.py": "def unused(x):\n    return x * 2\n",
        "fakepkg/broken/__init__.py": "",
        "fakepkg/broken/thing.py": "x = 1\n",
        "tests/unit/toy/test_calc.py": TEST_CALC,  # found by convention
        "tests/test_calc_extra.py": "def test_other():\n    pass\n",
        "tests/test_thing.py": "from fakepkg.broken.thing import x\n\n\ndef test_x():\n    assert x == 3\n",  # flat
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    table = tmp_path / "table"
    table.mkdir()
    (table / "toy.yaml").write_text(TOY)
    (table / "broken.yaml").write_text(BROKEN)
    return root, table


def _run(root, table, **kw):
    t = mt.load_table(table)
    kw = {"min_timeout": 8.0, "timeout_factor": 2.0, **kw}  # the hanging mutant costs min_timeout
    return mutation.run(t.mutants, t.tests, root=root, source="tree", packages=PACKAGES, progress=False, **kw)


def test_table_mutants_are_classified_recorded_and_the_tree_is_untouched(fake, tmp_path):
    root, table = fake
    run, copied, _ = _run(root, table)
    assert copied == "working tree"
    status = {r.id: r.status for r in run.results}
    assert status == {
        "calc.sub": "killed",
        "calc.swap": "survived",
        "calc.gone": "stale",
        "calc.hang": "timeout",
        "idle.triple": "untested",
        "thing.two": "skipped",
    }
    assert (root / "fakepkg/toy/calc.py").read_text() == CALC  # mutants went to the copy only
    assert run.stale_tests == {
        "tests/test_calc_extra.py::test_gone": "no test 'test_gone' in tests/test_calc_extra.py",
        "tests/test_moved.py": "tests/test_moved.py does not exist",
    }
    by_id = {r.id: r for r in run.results}
    assert by_id["calc.sub"].detail.startswith("FAILED tests/unit/toy/test_calc.py::test_add")
    assert by_id["calc.sub"].line == 5 and by_id["calc.hang"].line == 9
    summary = run.summary()
    assert summary["toy"]["kill_rate"] == 0.5  # (killed + timeout) / (killed + timeout + survived + untested)
    assert summary["toy"]["stale"] == 1 and summary["broken"]["kill_rate"] is None
    assert run.baselines["toy"]["ok"] and not run.baselines["broken"]["ok"]
    problems = run.problems(goal=0.9)
    for expected in (
        "baseline of broken failed",
        "toy: kill rate 50% < 90%",
        "stale mutant calc.gone",
        "untested module fakepkg/toy/idle.py",
        "stale test tests/test_moved.py",
    ):
        assert any(p.startswith(expected) for p in problems), (expected, problems)
    assert not any("named class" in p for p in problems)  # calc.sub (N1) was killed
    # the record: a first run judges every mutant for the first time; the same run again, none
    doc = {"history": []}
    meta = {"date": "d", "commit": "c", "seed": None, "load_before": [1.0, 1.0, 1.0], "load_after": [2.0, 2.0, 2.0]}
    first = mutation.record(run, doc, meta, 0.9)
    assert first["rooms"]["toy"]["fresh"] == 4 and first["rooms"]["toy"]["fresh_killed"] == 2
    assert first["rooms"]["toy"]["first_shot_kill_rate"] == 0.5 and first["total"]["fresh"] == 4
    assert {s["id"] for s in first["survivors"]} == {"calc.swap", "idle.triple"}
    assert [s["id"] for s in first["stale"]] == ["calc.gone"] and len(first["stale_tests"]) == 2
    again = mutation.record(run, doc, meta, 0.9)
    assert again["total"]["fresh"] == 0 and again["rooms"]["toy"]["first_shot_kill_rate"] is None
    assert len(doc["history"]) == 2 and {r["id"] for r in doc["last"]["mutants"]} == set(status)
    assert doc["history"][0]["load_before"] == [1.0, 1.0, 1.0] and "keys" not in doc["last"]


def test_generated_mutants_run_at_exact_positions_and_are_recorded_with_their_seed(fake, tmp_path, monkeypatch, capsys):
    root, table = fake
    dump = tmp_path / "dump"
    dump.mkdir()
    monkeypatch.setenv("MUTATION_DUMP", str(dump))
    monkeypatch.setattr(mutation, "ROOT", root)
    monkeypatch.setattr(mutation, "PACKAGES", PACKAGES)
    out = tmp_path / "results.json"
    argv = ["--generate", "fakepkg/toy/calc.py", "--count", "5", "--seed", "11", "--table", str(table)]
    argv += ["--out", str(out), "--source", "tree", "--min-timeout", "8"]
    code = mutation.main(argv)
    printed = capsys.readouterr()
    assert "--seed 11" in printed.err
    doc = json.loads(out.read_text())
    entry = doc["history"][-1]
    assert entry["seed"] == 11 and entry["count"] == 5 and entry["kind"] == "generated"
    assert len(entry["load_before"]) == 3 and len(entry["load_after"]) == 3 and entry["date"]
    assert set(entry["rooms"]) == {"toy"} and entry["rooms"]["toy"]["mutants"] == 5
    # the same seed on the same source gives the same mutants: those the run judged
    src = (root / "fakepkg/toy/calc.py").read_bytes()
    again = gen.sample("fakepkg/toy/calc.py", src, 5, 11)
    assert [r["id"] for r in doc["last"]["mutants"]] == [m.id for m in again]
    # every test run saw the original or exactly one mutant at its own byte range (each restored after)
    seen = {p.read_text() for p in dump.iterdir()}
    expected = {CALC} | {mt.apply(src, (m.start, m.end), m.replace).decode() for m in again if not m.equivalent}
    assert seen == expected
    for m in again:
        assert src[m.start : m.end].decode() == m.find
    statuses = {r["status"] for r in doc["last"]["mutants"]}
    assert statuses <= {"killed", "survived", "timeout", "equivalent"}
    assert code == (1 if entry["problems"] else 0)
    # --list shows the same mutants without running anything
    assert mutation.main(argv + ["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(m.id in listed for m in again) and "tests/unit/toy/test_calc.py" in listed
    assert mutation.main(["--out", str(out), "--markdown"]) == 0
    assert "| toy | 5 |" in capsys.readouterr().out


def test_edits_counted_by_hand():
    src = (
        b'"""Doc: 1 < 2."""\n'
        b"import math\n"
        b"\n"
        b"LIMIT: int = 3\n"
        b"\n"
        b"\n"
        b"def clip(x: float, lo: float = 0.0) -> float:\n"
        b'    """Doc 4 > 5."""\n'
        b"    if x < lo:\n"
        b"        return lo\n"
        b'    log.info("clipped %d", 5)\n'
        b"    return max(x, lo) * 2 + 1e3\n"
    )
    got = {(e.line, src[e.start : e.end].decode(), e.replace) for e in gen.edits(src)}
    ret = "max(x, lo) * 2 + 1e3"
    assert got == {
        (4, "3", "4"),
        (4, "3", "6"),
        (7, "0.0", "1.0"),
        (9, "<", "<="),
        (9, "x < lo", "not (x < lo)"),
        (9, "x < lo", "True"),
        (10, "return lo", "return None"),
        (12, f"return {ret}", "return None"),
        (12, "max", "min"),
        (12, "*", "/"),
        (12, "+", "-"),
        (12, ret, "max(x, lo) * 2"),
        (12, ret, "1e3"),
        (12, "max(x, lo) * 2", "max(x, lo)"),
        (12, "max(x, lo) * 2", "2"),
        (12, "2", "3"),
        (12, "2", "4"),
        (12, "1e3", "1e-3"),
        (12, "1e3", "1e6"),
        (12, "1e3", "1024"),
    }
    fams = {e.family for e in gen.edits(src)}
    assert fams == {"constant", "unit", "boundary", "arithmetic", "dropped_term", "condition", "min_max", "return"}
    # byte offsets, not characters: a multi-byte character before the constant
    s2 = 'UNIT = "µs"; N = 5\n'.encode()
    assert {(s2[e.start : e.end], e.replace) for e in gen.edits(s2)} == {(b"5", "6"), (b"5", "10")}


def test_what_the_generator_leaves_alone():
    src = b'''\
from __future__ import annotations
import os

__all__ = ["f", "g"]


@decorator(3)
def f(x: list[int] = None, *, n: dict[str, int] = None) -> tuple[int, int]:
    """Docstring with 1 < 2 and 3 + 4."""
    print("value", 1 + 2)
    warnings.warn(f"{x + 1} bad", stacklevel=2)
    logger.debug("n=%d", 3 * 4)
    if TYPE_CHECKING:
        y = 1
    assert x, f"{len(x) > 2}"
    raise ValueError(f"x must be < {2 ** 10}" + "!")


def g():
    z = 7  # pragma: no mutate
    plot(width=600, height=400)
    label = "a" + "b"
    return
'''
    assert gen.edits(src) == []


NINE = b"""\
def f(a, b, xs):
    if a < b and xs:
        return max(a, b) * 1e3 + 2
    for x in xs:
        if x:
            break
    return g(a, b) - True
"""


def test_seeds_are_reproducible_and_drawn_from_each_family_in_turn():
    assert {e.family for e in gen.edits(NINE)} == set(gen.FAMILIES)
    a = gen.sample("x/y/a.py", NINE, 9, 3)
    assert a == gen.sample("x/y/a.py", NINE, 9, 3)
    assert len({m.operator.split("/")[0] for m in a}) == 9  # one of each family before a second of any
    draws = {tuple(m.id for m in gen.sample("x/y/a.py", NINE, 9, s)) for s in range(10)}
    assert len(draws) > 1  # the seed decides which
    # and which families get the draws when there are fewer draws than families
    assert len({frozenset(m.operator.split("/")[0] for m in gen.sample("x/y/a.py", NINE, 4, s)) for s in range(10)}) > 1
    assert gen.sample("x/y/b.py", NINE, 9, 3) != a  # and each module draws on its own
    assert len({m.id for m in a}) == 9
    # asked for more than a module has: every valid edit once
    assert len(gen.sample("x/y/a.py", NINE, 1000, 0)) == len(gen.edits(NINE))


def test_equivalents_are_marked():
    assert gen.equivalence(b"x = (1)\n", b"x = 1\n") == "the same syntax tree"
    assert gen.equivalence(b"x = 2 ** 10\n", b"x = 1024\n") == "the same bytecode"
    assert gen.equivalence(b"x = a + b\n", b"x = b + a\n") == ""
    ms = {m.replace: m.equivalent for m in gen.sample("x/y/z.py", b"Z = 0.5 * 0\n", 50, 0)}
    assert ms["1.0"] == ms["0.25"] == "the same bytecode"  # both fold to 0.0
    assert ms["1"] == "" and ms["/"] == ""
    run = mutation.Run(
        results=[
            mutation.Result("a", "r", "f.py", "killed"),
            mutation.Result("b", "r", "f.py", "equivalent"),
            mutation.Result("c", "r", "f.py", "survived"),
        ]
    )
    assert run.summary()["r"]["kill_rate"] == 0.5  # an equivalent is not judged


def test_stale_generated_mutant_and_snippets():
    src = b"a = 1\na = 1\nb = 2\n"
    g = mt.Mutant("m:3:4:x", "p/q/m.py", "2", "3", "", start=16, end=17, line=3)
    assert mt.locate(g, src) == (16, 17)
    assert "no longer holds" in mt.locate(g, b"b = 2\n")
    assert "2 times" in mt.locate(mt.Mutant("m.a", "p/q/m.py", "a = 1", "a = 2", ""), src)
    assert "0 times" in mt.locate(mt.Mutant("m.c", "p/q/m.py", "c = 1", "c = 2", ""), src)
    # a mutant's key survives its lines moving, not its lines changing
    k = mt.mutant_key("p/q/m.py", src, (16, 17), "3")
    assert k == mt.mutant_key("p/q/m.py", b"\n\n" + src, (18, 19), "3")
    assert k != mt.mutant_key("p/q/m.py", src.replace(b"b = 2", b"b = 2 + c"), (16, 17), "3")


def test_tests_are_found_by_convention(tmp_path):
    mods = [
        "lab_utils/run/compare/rules.py",
        "lab_utils/memory/policies.py",
        "lab_utils/step/policies.py",
        "lab_utils/plan/from_trace.py",
        "lab_kernels/rope.py",
    ]
    flat = [
        "tests/test_compare_rules.py",
        "tests/test_policies.py",
        "tests/test_step_policies.py",
        "tests/test_rope.py",
    ]
    for f in mods + flat:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    found = {f: mt.convention_tests(f, tmp_path, mods) for f in mods}
    assert found == {  # a flat tests/ folder: tests/test_<room>_<name>.py, or tests/test_<name>.py when unique
        "lab_utils/run/compare/rules.py": ["tests/test_compare_rules.py"],
        "lab_utils/memory/policies.py": [],  # two rooms have a policies module: the bare name is neither's
        "lab_utils/step/policies.py": ["tests/test_step_policies.py"],
        "lab_utils/plan/from_trace.py": [],
        "lab_kernels/rope.py": ["tests/test_rope.py"],
    }
    # once the tree mirrors the source, that is where a module's tests are (the flat file is ignored)
    for t in ("tests/unit/run/compare/test_rules.py", "tests/unit/kernels/test_rope.py"):
        (tmp_path / t).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / t).write_text("")
    assert mt.convention_tests("lab_utils/run/compare/rules.py", tmp_path, mods) == [
        "tests/unit/run/compare/test_rules.py"
    ]
    assert mt.convention_tests("lab_kernels/rope.py", tmp_path, mods) == ["tests/unit/kernels/test_rope.py"]
    extras = {"lab_kernels/rope.py": ["tests/test_x.py::test_y", "tests/unit/kernels/test_rope.py"]}
    assert mt.tests_for("lab_kernels/rope.py", tmp_path, extras, mods) == [
        "tests/unit/kernels/test_rope.py",
        "tests/test_x.py::test_y",
    ]
    assert mt.room_of("lab_kernels/rope.py") == "lab_kernels" and mt.room_of("lab_utils/run/compare/x.py") == "run"


@pytest.mark.parametrize(
    "body, message",
    [
        ("room: other\nmutants: []\n", "differs from the file's name"),
        ("room: toy\nmutants:\n- {id: calc.a, file: fakepkg/toy/calc.py, find: x, replace: y}\n", "missing"),
        (
            "room: toy\nmutants:\n- {id: calc.a, file: fakepkg/toy/calc.py, find: x, replace: y, why: w, z: 1}\n",
            "unknown",
        ),
        ("room: toy\nmutants:\n- {id: other.a, file: fakepkg/toy/calc.py, find: x, replace: y, why: w}\n", "<module>"),
        ("room: toy\nmutants:\n- {id: calc.a, file: fakepkg/nope/calc.py, find: x, replace: y, why: w}\n", "room"),
        ("room: toy\nmutants:\n- {id: calc.a, file: fakepkg/toy/calc.py, find: x, replace: x, why: w}\n", "equals"),
        (
            "room: toy\nmutants:\n- {id: calc.a, file: fakepkg/toy/calc.py, find: x, replace: y, why: w}\n"
            "- {id: aaa.b, file: fakepkg/toy/aaa.py, find: x, replace: y, why: w}\n",
            "sorted",
        ),
        ("room: toy\ntests:\n  fakepkg/toy/calc.py: []\n", "non-empty list"),
    ],
)
def test_bad_tables_name_the_file(tmp_path, body, message):
    (tmp_path / "toy.yaml").write_text(body)
    with pytest.raises(mt.TableError, match=re.escape(message)) as e:
        mt.load_table(tmp_path)
    assert "toy.yaml" in str(e.value)


def test_a_table_round_trips_exactly(tmp_path):
    tricky = ["a\n    b", "  leading", "trailing  ", "x: 'y' # z", "tab\there", "µs", "- dash", "line\n\nblank"]
    ms = [mt.Mutant(f"calc.m{i}", "fakepkg/toy/calc.py", s, s + "!", f"why {i}") for i, s in enumerate(tricky)]
    (tmp_path / "toy.yaml").write_text(mt.dump_room("toy", ms, {"fakepkg/toy/calc.py": ["tests/t.py::a"]}))
    table = mt.load_table(tmp_path)
    assert table.mutants == ms and table.tests == {"fakepkg/toy/calc.py": ["tests/t.py::a"]}
    (tmp_path / "dup.yaml").write_text(mt.dump_room("dup", [], {}) + "")
    (tmp_path / "zz.yaml").write_text(
        "room: zz\nmutants:\n- {id: calc.m0, file: fakepkg/zz/calc.py, find: a, replace: b, why: c}\n"
    )
    with pytest.raises(mt.TableError, match="repeats"):
        mt.load_table(tmp_path)


def test_the_project_table_is_well_formed():
    table = mt.load_table()  # the schema: fields, ids, rooms, order (never whether a snippet still matches)
    assert len(table.mutants) >= 263
    assert {m.room for m in table.mutants} >= {"lab_kernels", "core", "memory", "run", "distributed", "plan"}
    named = {m.named for m in table.mutants if m.named}
    assert len(named) == 8, sorted(named)  # eight named bug classes, each of which must be killed
    for f, ids in table.tests.items():
        assert all(i.startswith("tests/") for i in ids), f
    words = re.compile(r"\b(round|issue)s?\s*#?\d", re.I)
    for path in [*mt.TABLE_DIR.glob("*.yaml"), *(ROOT / "benchmarks").glob("mutation*.py")]:
        assert not words.search(path.read_text(encoding="utf-8")), path
    doc = mutation.load_results(mutation.OUT)
    for h in doc["history"]:
        assert {"date", "commit", "rooms", "total", "keys"} <= set(h), h.get("date")
