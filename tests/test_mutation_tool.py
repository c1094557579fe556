"""benchmarks/mutation.py on a tiny fake package: a mutant the tests catch is killed, one they
miss survives, a snippet that is not in its file is stale (an error, not a skip), a mutant
that hangs is a timeout, a failing baseline skips its package; the tree it runs in is a copy."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("mutation", ROOT / "benchmarks" / "mutation.py")
mutation = importlib.util.module_from_spec(spec)
sys.modules["mutation"] = mutation  # dataclasses look their module up there
spec.loader.exec_module(mutation)

CALC = """\
def add(a, b):
    return a + b


def spin():
    return 1
"""
TEST_CALC = """\
from fakepkg.calc import add, spin


def test_add():
    assert add(2, 3) == 5


def test_spin():
    assert spin() == 1
"""
TABLE = """\
TESTS = {"fakepkg/calc.py": ["tests/test_calc.py"], "fakepkg/broken.py": ["tests/test_broken.py"]}
MUTANTS = [
    dict(id="sub", package="calc", file="fakepkg/calc.py", find="a + b", replace="a - b", why="sign", named="N1"),
    dict(id="swap", package="calc", file="fakepkg/calc.py", find="a + b", replace="b + a", why="equivalent"),
    dict(id="gone", package="calc", file="fakepkg/calc.py", find="a * b", replace="a / b", why="stale"),
    dict(id="hang", package="calc", file="fakepkg/calc.py", find="return 1", replace="while True:\\n        pass",
         why="loops"),
    dict(id="other", package="broken", file="fakepkg/broken.py", find="x = 1", replace="x = 2", why="any"),
]
"""


@pytest.fixture
def fake(tmp_path):
    root = tmp_path / "tree"
    (root / "fakepkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "fakepkg" / "__init__.py").write_text("")
    (root / "fakepkg" / "calc.py").write_text(CALC)
    (root / "fakepkg" / "broken.py").write_text("x = 1\n")
    (root / "tests" / "test_calc.py").write_text(TEST_CALC)
    (root / "tests" / "test_broken.py").write_text(
        "from fakepkg.broken import x\n\n\ndef test_x():\n    assert x == 3\n"
    )
    (tmp_path / "table.py").write_text(TABLE)
    return root, tmp_path / "table.py"


def test_mutants_are_classified_and_the_tree_is_untouched(fake):
    root, table = fake
    mutants, tests = mutation.load_table(table)
    run, copied = mutation.run(
        mutants,
        tests,
        root=root,
        source="tree",
        python=sys.executable,
        import_check=("fakepkg",),
        min_timeout=8.0,  # the hanging mutant costs this; a busy machine must still run the others within it
        timeout_factor=2.0,
        progress=False,
    )
    assert copied == "working tree"
    status = {r.id: r.status for r in run.results}
    assert status == {"sub": "killed", "swap": "survived", "gone": "stale", "hang": "timeout", "other": "skipped"}
    assert (root / "fakepkg" / "calc.py").read_text() == CALC  # mutants went to the copy only
    summary = run.summary()
    assert summary["calc"]["kill_rate"] == pytest.approx(
        2 / 3, abs=1e-3
    )  # killed + timeout over judged (stale excluded)
    assert summary["broken"]["kill_rate"] is None
    assert run.baselines["calc"]["ok"] and not run.baselines["broken"]["ok"]
    problems = run.problems(goal=0.9)
    assert any("baseline of broken failed" in p for p in problems)
    assert any(p.startswith("calc: kill rate 67%") for p in problems)
    assert any("stale mutant gone" in p for p in problems)
    # a surviving mutant of a named class is a problem of its own; a killed one is not
    assert [r.id for r in run.survivors()] == ["swap"]
    assert not any("named class" in p for p in problems)


def test_stale_snippets_and_bad_tables_are_errors(tmp_path):
    (tmp_path / "m.py").write_text("a = 1\na = 1\n")
    ms = [
        mutation.Mutant("twice", "p", "m.py", "a = 1", "a = 2", ""),
        mutation.Mutant("none", "p", "m.py", "b = 1", "b = 2", ""),
        mutation.Mutant("nofile", "p", "x.py", "a", "b", ""),
        mutation.Mutant("same", "p", "m.py", "a = 1\na", "a = 1\na", ""),
    ]
    stale = mutation.validate(ms, tmp_path)
    assert set(stale) == {"twice", "none", "nofile", "same"}
    assert "2 times" in stale["twice"] and "0 times" in stale["none"]
    (tmp_path / "t.py").write_text(
        "TESTS = {}\nMUTANTS = [dict(id='a', package='p', file='f.py', find='x', replace='y', why='')]\n"
    )
    with pytest.raises(ValueError, match="no tests mapped"):
        mutation.load_table(tmp_path / "t.py")


def test_the_copy_must_be_what_is_imported(fake, tmp_path):
    root, _ = fake
    copy = tmp_path / "copy"
    mutation.copy_tree(root, copy, "tree")
    mutation.check_imports(copy, ["fakepkg"], sys.executable)
    with pytest.raises(RuntimeError, match="not from the copy"):
        mutation.check_imports(copy, ["json"], sys.executable)  # the standard library's, not the copy's


def test_the_project_table_is_well_formed():
    mutants, tests = mutation.load_table()
    assert {m.package for m in mutants} >= {
        "lab_kernels",
        "flops",
        "memory",
        "compare",
        "timing",
        "distributed",
        "telemetry",
        "plan",
    }
    for m in mutants:
        assert (ROOT / m.file).is_file(), m.id
        assert m.why, m.id
    for f, ts in tests.items():
        assert ts, f
        for t in ts:
            assert (ROOT / t.split("::")[0]).is_file(), t
    named = {m.named for m in mutants if m.named}
    assert len(named) == 7, sorted(named)  # the seven bug classes of issue 20
