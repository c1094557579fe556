"""The mutation benchmark's data: its hand-written mutants, the tests mapped to each module, and
what has gone stale.

* The table is one YAML file per room, ``benchmarks/mutants/<room>.yaml`` (YAML: the project
  already reads its parameter sets with PyYAML, and ``tomllib`` is not in Python 3.10)::

      room: memory
      tests:                       # node ids beyond the convention's, per module
        lab_utils/memory/saved.py:
        - tests/unit/studies/test_memory.py::test_formula_extrapolates_on_meta
      mutants:                     # sorted by the mutated module
      - id: saved.single_block_ln_out    # <module>.<what>, unique over every room
        file: lab_utils/memory/saved.py
        find: own = 6 * rows * d * s  # LN out     (occurs exactly once in the file)
        replace: own = 5 * rows * d * s  # LN out
        why: single block's saved tensors one short
        named: ...                 # optional: the bug class it stands for (each must be killed)

* A module's room is the folder under its package (``lab_utils/<room>/...``); a module directly
  in a package (``lab_kernels/<module>.py``) is in the package's room (``lab_kernels``).
* A module's tests are found by convention, then the room file's explicit node ids are added:
  ``tests/unit/<room>/[<sub>/]test_<module>.py`` where that tree exists (``lab_kernels``' also
  under ``tests/unit/kernels/``); otherwise the flat ``tests/test_<room>_<module>.py`` and
  ``tests/test_<module>.py``, the second only when no other room has a module of that name
  (``<module>`` of ``run/compare/rules.py`` is ``compare_rules``).
* Stale, never silently skipped: a mutant whose file is gone or whose snippet is not in it
  exactly once (a generated one: whose text is not at its recorded position), a mapped test id
  that no longer exists.  The tool reports them (status ``stale``, counted, listed).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TABLE_DIR = ROOT / "benchmarks" / "mutants"
PACKAGES = ("lab_utils", "lab_kernels")  # where the project's modules live
REQUIRED = ("id", "file", "find", "replace", "why")
OPTIONAL = ("named",)
ID_RE = re.compile(r"^[a-z0-9_]+\.[a-z0-9_]+$")


class TableError(ValueError):
    """A table file that does not follow the schema (the message names the file)."""


@dataclass(frozen=True)
class Mutant:
    """One planted bug: in ``file``, ``find`` becomes ``replace``.  A hand-written mutant's
    ``find`` occurs exactly once in the file; a generated one sits at byte offsets
    ``start:end`` of the file's UTF-8 text (``start`` is -1 for a hand-written one)."""

    id: str
    file: str  # relative to the tree's root
    find: str
    replace: str
    why: str  # the bug, in words
    named: str = ""  # the bug class it stands for, if one
    start: int = -1
    end: int = -1
    line: int = 0  # a generated mutant's first line (1-based)
    operator: str = ""  # a generated mutant's operator
    equivalent: str = ""  # why it provably behaves like the original (then it is not run)

    @property
    def room(self) -> str:
        return room_of(self.file)

    @property
    def generated(self) -> bool:
        return self.start >= 0


@dataclass
class Table:
    mutants: list[Mutant] = field(default_factory=list)
    tests: dict[str, list[str]] = field(default_factory=dict)  # module -> explicit extra node ids

    @property
    def rooms(self) -> list[str]:
        return sorted({m.room for m in self.mutants})


def room_of(file: str | Path) -> str:
    parts = Path(file).parts
    if len(parts) < 2 or not parts[-1].endswith(".py"):
        raise ValueError(f"{file}: not a module inside a package (expected pkg/<room>/<module>.py)")
    return parts[1] if len(parts) >= 3 else parts[0]


def module_name(file: str | Path) -> str:
    """``rules`` of ``lab_utils/run/compare/rules.py`` as the flat tests spell it: ``compare_rules``."""
    parts = Path(file).with_suffix("").parts
    below = parts[2:] if len(parts) >= 3 else parts[1:]
    return "_".join(below)


# ------------------------------------------------------------------------------ reading and writing
def load_table(path: str | Path = TABLE_DIR) -> Table:
    """Every room file of a folder (or one file): its mutants and explicit tests, checked."""
    path = Path(path)
    files = sorted(path.glob("*.yaml")) if path.is_dir() else [path]
    if not files:
        raise TableError(f"{path}: no room files (<room>.yaml)")
    table = Table()
    where: dict[str, Path] = {}
    for f in files:
        mutants, tests = load_room(f)
        for m in mutants:
            if m.id in where:
                raise TableError(f"{f}: mutant id {m.id!r} repeats (also in {where[m.id].name})")
            where[m.id] = f
        table.mutants += mutants
        table.tests.update(tests)
    return table


def load_room(path: Path) -> tuple[list[Mutant], dict[str, list[str]]]:
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise TableError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict) or set(doc) - {"room", "tests", "mutants"} or "room" not in doc:
        raise TableError(f"{path}: expected a mapping with 'room', 'tests' and 'mutants'")
    room = doc["room"]
    if room != path.stem:
        raise TableError(f"{path}: room {room!r} differs from the file's name {path.stem!r}")
    tests = doc.get("tests") or {}
    if not isinstance(tests, dict):
        raise TableError(f"{path}: 'tests' must map a module to a list of pytest node ids")
    for mod, ids in tests.items():
        _check_file(path, room, mod, "tests")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) and i for i in ids):
            raise TableError(f"{path}: tests of {mod} must be a non-empty list of node ids")
    mutants = []
    for i, row in enumerate(doc.get("mutants") or []):
        if not isinstance(row, dict):
            raise TableError(f"{path}: mutant {i} is not a mapping")
        label = f"mutant {row.get('id', i)!r}"
        missing = [k for k in REQUIRED if k not in row]
        extra = sorted(set(row) - set(REQUIRED) - set(OPTIONAL))
        if missing or extra:
            raise TableError(f"{path}: {label}: missing {missing}, unknown {extra} (allowed: {REQUIRED + OPTIONAL})")
        bad = [k for k in row if not isinstance(row[k], str) or (k not in ("named", "replace") and not row[k])]
        if bad:
            raise TableError(f"{path}: {label}: {', '.join(bad)} must be text (only replace and named may be empty)")
        if not ID_RE.match(row["id"]) or row["id"].split(".")[0] != Path(row["file"]).stem:
            raise TableError(
                f"{path}: {label}: an id is <module>.<what> (lower case), here <module> = {Path(row['file']).stem!r}"
            )
        _check_file(path, room, row["file"], label)
        if row["find"] == row["replace"]:
            raise TableError(f"{path}: {label}: the replacement equals the snippet")
        mutants.append(Mutant(**row))
    order = [m.file for m in mutants]
    if order != sorted(order):
        raise TableError(f"{path}: mutants must be sorted by the mutated module")
    return mutants, {k: list(v) for k, v in tests.items()}


def _check_file(path: Path, room: str, file: str, what: str) -> None:
    try:
        r = room_of(file)
    except ValueError as e:
        raise TableError(f"{path}: {what}: {e}") from None
    if r != room:
        raise TableError(f"{path}: {what}: {file} is in room {r!r}, not {room!r}")


class _Dumper(yaml.SafeDumper):
    pass


def _text(dumper: yaml.SafeDumper, s: str) -> yaml.ScalarNode:
    # snippets of several lines as literal blocks (PyYAML falls back to quotes where a block can't hold them)
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _text)

HEADER = """\
# Hand-written mutants of the {room} room for benchmarks/mutation.py (schema: benchmarks/mutation_table.py).
# tests: pytest node ids run for a module beyond the convention's (tests/unit/<room>/test_<module>.py,
# else tests/test_<module>.py); mutants: sorted by module, each find occurring exactly once in its file.
"""


def dump_room(room: str, mutants: list[Mutant], tests: dict[str, list[str]]) -> str:
    rows = []
    for m in mutants:
        row = {k: getattr(m, k) for k in REQUIRED}
        if m.named:
            row["named"] = m.named
        rows.append(row)
    doc = {"room": room, "tests": dict(sorted(tests.items())), "mutants": rows}
    body = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=4096)
    return HEADER.format(room=room) + body


# ------------------------------------------------------------------------------ tests by convention
def source_modules(tree: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    out = []
    for pkg in packages:
        if (tree / pkg).is_dir():
            out += sorted(p.relative_to(tree).as_posix() for p in (tree / pkg).rglob("*.py"))
    return out


def convention_tests(file: str, tree: Path, modules: list[str]) -> list[str]:
    """The test files a module's tests are expected in, that exist in ``tree``."""
    p = Path(file)
    if p.stem == "__init__":
        return []
    room, name = room_of(file), module_name(file)
    below = p.parts[2:-1] if len(p.parts) >= 3 else ()
    dirs = [room] + ([room.removeprefix("lab_")] if room.startswith("lab_") else [])
    unit = [Path("tests", "unit", d, *below, f"test_{p.stem}.py").as_posix() for d in dirs]
    found = [t for t in unit if (tree / t).is_file()]
    if found:
        return found
    clash = sum(module_name(m) == name for m in modules if Path(m).stem != "__init__") > 1
    flat = [f"tests/test_{room}_{name}.py"] + ([] if clash else [f"tests/test_{name}.py"])
    return [t for t in flat if (tree / t).is_file()]


def tests_for(file: str, tree: Path, extras: dict[str, list[str]], modules: list[str]) -> list[str]:
    return list(dict.fromkeys(convention_tests(file, tree, modules) + extras.get(file, [])))


def stale_test_ids(ids: list[str], collected: set[str], tree: Path, broken: set[str]) -> dict[str, str]:
    """Node id -> why it is stale: its file is gone, or the file collects but not that test.
    (A file that fails to collect is not stale: the baseline fails and says why.)"""
    out = {}
    for t in ids:
        path = t.split("::")[0]
        if not (tree / path).is_file():
            out[t] = f"{path} does not exist"
        elif (
            "::" in t and path not in broken and not any(c == t or c.startswith((t + "[", t + "::")) for c in collected)
        ):
            out[t] = f"no test {t.split('::', 1)[1]!r} in {path}"
    return out


# ------------------------------------------------------------------------------ staleness and identity
def locate(m: Mutant, source: bytes) -> tuple[int, int] | str:
    """(start, end) byte offsets of the mutant's snippet in ``source``, or why it is stale."""
    find = m.find.encode()
    if m.generated:
        if source[m.start : m.end] != find:
            return f"{m.file} no longer holds {m.find[:60]!r} at line {m.line}"
        return m.start, m.end
    n = source.count(find)
    if n != 1:
        return f"snippet found {n} times in {m.file} (expected once): {m.find[:60]!r}"
    i = source.index(find)
    return i, i + len(find)


def apply(source: bytes, span: tuple[int, int], replace: str) -> bytes:
    return source[: span[0]] + replace.encode() + source[span[1] :]


def mutant_key(file: str, source: bytes, span: tuple[int, int], replace: str) -> str:
    """Who a mutant is, wherever its lines moved: its file, its lines before and after the edit.
    A later run with the same key judges the same bug again (not a first shot)."""
    a = source.rfind(b"\n", 0, span[0]) + 1
    b = source.find(b"\n", span[1])
    b = len(source) if b < 0 else b
    before = source[a:b]
    after = source[a : span[0]] + replace.encode() + source[span[1] : b]
    h = hashlib.sha1(b"\0".join([file.encode(), before.strip(), after.strip()]))
    return h.hexdigest()[:12]
