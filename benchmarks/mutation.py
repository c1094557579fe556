"""Do the tests catch realistic bugs?  Plants one bug at a time in a copy of the tree and runs
the tests mapped to the mutated module; not part of `make test`.

    .venv/bin/python benchmarks/mutation.py --jobs 2                  # the hand-written table
    .venv/bin/python benchmarks/mutation.py --room memory --list      # one room's mutants, run nothing
    .venv/bin/python benchmarks/mutation.py --generate plan --count 10 --seed 7   # fresh mutants

Two sources of mutants:

* the table, ``benchmarks/mutants/<room>.yaml`` (``benchmarks/mutation_table.py`` has the schema):
  bugs a person wrote down, each an exact snippet of its file and its replacement;
* ``--generate ROOM_OR_MODULE --count N --seed S``: N mutants per module drawn from the module's
  syntax tree by ``benchmarks/mutation_gen.py`` (constants, boundaries, units, arithmetic,
  dropped terms, swaps, conditions, min/max, returns), applied at exact byte positions.  The
  seed is printed and recorded; the same seed on the same source gives the same mutants.

Method:

* The shared working tree is never touched: the tree is copied once per job (``git archive``
  of a commit, default ``HEAD``; ``--source tree`` copies the working tree's tracked and
  untracked, not ignored, files) into a temporary folder, and every test runs there with
  ``PYTHONPATH`` at the copy (checked: the packages must import from it, not from the editable
  install's mapping to the main tree).
* A module's tests are found by convention plus the node ids its room file lists
  (``mutation_table.tests_for``); every mapped id is checked against ``pytest --collect-only``.
* Stale, reported and counted, never a crash: a mutant whose file is gone or whose snippet is
  not in it exactly once, a mapped test id that no longer exists.
* Each room's tests run first unmutated, all in one run (a failing baseline skips the room);
  then each mutant is applied to a copy, its tests run (``-x -q``, no plugin autoload, fixed
  ``PERFLAB_SEED``, no bytecode written, so an equal-length edit is never hidden by a stale
  ``.pyc``) with a timeout of ``max(--min-timeout, --timeout-factor x baseline)``, and the file
  is restored.  A failing run kills the mutant; a timeout counts as killed and is reported apart;
  a module no test maps to leaves its mutants ``untested`` (judged, not killed); a mutant
  provably equivalent to the original is ``equivalent`` (not run, not judged).
* First shot: a mutant is fresh when no earlier run in the results' history judged it (the
  same file and lines before and after the edit); a run's first-shot kill rate is over its fresh
  mutants, the suite's strength before anyone wrote a test against those bugs.

Each run is appended to the ``history`` of ``benchmarks/results/mutation.json`` (commit, date,
load average before and after, seed, counts and kill rates per room, first-shot kill rates,
survivors, stale entries) and its every mutant's result kept as ``last``.  Exit status 1 when a
room is under ``--goal`` (90%), a named bug class survives, something is stale, untested or errs,
or a baseline fails; else 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

# runnable from a bare checkout: the repository root goes on the path for the tool's own modules
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import mutation_gen as gen  # noqa: E402
from benchmarks.mutation_table import (  # noqa: E402
    PACKAGES,
    TABLE_DIR,
    Mutant,
    Table,
    apply,
    load_table,
    locate,
    mutant_key,
    source_modules,
    stale_test_ids,
    tests_for,
)

OUT = ROOT / "benchmarks" / "results" / "mutation.json"
#: no plugin autoload and no addopts: the notebook and browser plugins cost seconds of CPU per run
#: (a third of a small test set's time), and no mapped test uses them
PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=")
STATUSES = ("killed", "timeout", "survived", "untested", "error", "stale", "skipped", "equivalent")
JUDGED = ("killed", "timeout", "survived", "untested")


@dataclass
class Result:
    id: str
    room: str
    file: str
    status: str  # one of STATUSES
    seconds: float = 0.0
    why: str = ""
    named: str = ""
    detail: str = ""  # the failing test's line, the error, or why it was not run
    line: int = 0
    find: str = ""
    replace: str = ""
    operator: str = ""  # a generated mutant's family/operator
    key: str = ""  # mutation_table.mutant_key: who the mutant is across runs
    fresh: bool = False  # judged here for the first time (set when recorded)


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    baselines: dict[str, dict] = field(default_factory=dict)  # room -> {ok, seconds, detail}
    stale_tests: dict[str, str] = field(default_factory=dict)  # node id -> why
    seconds: float = 0.0

    def summary(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for r in self.results:
            row = out.setdefault(r.room, {"mutants": 0, **dict.fromkeys(STATUSES, 0), "fresh": 0, "fresh_killed": 0})
            row["mutants"] += 1
            row[r.status] += 1
            if r.fresh:
                row["fresh"] += 1
                row["fresh_killed"] += r.status in ("killed", "timeout")
        for row in out.values():
            judged = sum(row[s] for s in JUDGED)
            row["kill_rate"] = round((row["killed"] + row["timeout"]) / judged, 4) if judged else None
            row["first_shot_kill_rate"] = round(row["fresh_killed"] / row["fresh"], 4) if row["fresh"] else None
        return dict(sorted(out.items()))

    def survivors(self) -> list[Result]:
        return [r for r in self.results if r.status in ("survived", "untested")]

    def problems(self, goal: float) -> list[str]:
        """Why the run misses its goal (empty when it does not)."""
        out = [f"baseline of {p} failed: {b['detail']}" for p, b in self.baselines.items() if not b["ok"]]
        for p, row in self.summary().items():
            if row["kill_rate"] is not None and row["kill_rate"] < goal:
                out.append(f"{p}: kill rate {row['kill_rate']:.0%} < {goal:.0%}")
        out += [f"named class survives: {r.named} ({r.id})" for r in self.survivors() if r.named]
        out += [f"{r.status} mutant {r.id}: {r.detail}" for r in self.results if r.status in ("stale", "error")]
        out += [f"untested module {f}" for f in sorted({r.file for r in self.results if r.status == "untested"})]
        out += [f"stale test {t}: {why}" for t, why in self.stale_tests.items()]
        return out


# ------------------------------------------------------------------------------ the copy
def copy_tree(root: Path, dest: Path, source: str) -> str:
    """Copy the tree at ``root`` into ``dest``: a commit (``git archive``), or ``"tree"``
    (tracked and untracked-not-ignored files of the working tree; every file when ``root``
    is not a git repository).  Returns what was copied (a commit hash or "working tree")."""
    dest.mkdir(parents=True, exist_ok=True)
    is_git = (root / ".git").exists()
    if source != "tree":
        if not is_git:
            raise ValueError(f"{root} is not a git repository: use --source tree")
        commit = _git(root, "rev-parse", source)
        tar = subprocess.run(
            ["git", "-C", str(root), "archive", "--format=tar", commit], check=True, capture_output=True
        )
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as tf:
            tf.extractall(dest, filter="data")
        return commit
    if is_git:
        files = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
        for f in filter(None, files):
            src = root / f
            if src.is_file():
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / f)
    else:
        shutil.copytree(root, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".venv", "__pycache__", ".git"))
    return "working tree"


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


def env_for(copy: Path, seed: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # an equal-length mutant must not be hidden by a stale .pyc
    env["PERFLAB_SEED"] = str(seed)  # the same random inputs for the baseline and every mutant
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


def check_imports(copy: Path, modules: list[str], python: str, seed: int = 0) -> None:
    """Every module in ``modules`` must import from ``copy`` (not from an editable install)."""
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    print(importlib.import_module(m).__file__)"
    out = subprocess.run(
        [python, "-c", code, *modules], cwd=copy, env=env_for(copy, seed), capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"importing {modules} in the copy failed:\n{out.stderr[-2000:]}")
    real = str(copy.resolve())
    for mod, path in zip(modules, out.stdout.split()):
        if not str(Path(path).resolve()).startswith(real):
            raise RuntimeError(f"{mod} imports from {path}, not from the copy {copy}")


# ------------------------------------------------------------------------------ running tests
def collect(copy: Path, files: list[str], python: str, seed: int) -> tuple[set[str], set[str]]:
    """(every node id pytest collects from ``files``, the files that fail to collect)."""
    files = [f for f in files if (copy / f).is_file()]
    if not files:
        return set(), set()
    cmd = [python, "-m", "pytest", "--collect-only", "-q", *PYTEST_ARGS[2:], *files]  # one -q: node ids
    out = subprocess.run(cmd, cwd=copy, env=env_for(copy, seed), capture_output=True, text=True)
    lines = out.stdout.splitlines()
    ids = {ln.strip() for ln in lines if "::" in ln and not ln.startswith(("ERROR", " "))}
    broken = {m.group(1) for ln in lines if (m := re.match(r"ERROR (?:collecting )?(\S+\.py)", ln))}
    return ids, broken


def run_tests(copy: Path, tests: list[str], timeout: float, python: str, seed: int) -> tuple[str, float, str]:
    """("passed" | "failed" | "timeout" | "error", seconds, detail) of one pytest run in ``copy``."""
    cmd = [python, "-m", "pytest", *PYTEST_ARGS, *tests]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=copy, env=env_for(copy, seed), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # pytest and whatever it started (worker processes)
        proc.communicate()
        return "timeout", time.perf_counter() - t0, f"over {timeout:.0f} s"
    secs = time.perf_counter() - t0
    text = log.decode(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    detail = next((ln for ln in lines if ln.startswith(("FAILED", "ERROR"))), lines[-1] if lines else "")
    # pytest: 0 passed, 1 a test failed, 2 collection/import errors (the mutant broke an import:
    # a kill), 3 internal error, 4 usage error, 5 no test collected (a wrong mapping); a signal
    # (negative: a crash, e.g. an out-of-bounds access in the interpreter) is a kill too
    rc = proc.returncode
    status = "failed" if rc in (1, 2) or rc < 0 else {0: "passed"}.get(rc, "error")
    return status, secs, detail[:300] if status != "error" else f"pytest exit {proc.returncode}: {text[-600:]}"


def mutate_and_test(
    m: Mutant, span: tuple[int, int], copy: Path, tests: list[str], timeout: float, python: str, seed: int
) -> tuple[str, float, str]:
    path = copy / m.file
    original = path.read_bytes()
    try:
        path.write_bytes(apply(original, span, m.replace))
        status, secs, detail = run_tests(copy, tests, timeout, python, seed)
    finally:
        path.write_bytes(original)
    kind = {"failed": "killed", "passed": "survived"}.get(status, status)
    return kind, secs, "" if kind == "survived" else detail


def generate(specs: list[str], tree: Path, count: int, seed: int, packages: tuple[str, ...]) -> list[Mutant]:
    """``count`` generated mutants of every module that ``specs`` names, read from ``tree``."""
    files = list(dict.fromkeys(f for s in specs for f in gen.targets(s, tree, packages)))
    return [m for f in files for m in gen.sample(f, (tree / f).read_bytes(), count, seed)]


def run(
    mutants: list[Mutant],
    extras: dict[str, list[str]],
    *,
    generate_specs: list[str] = (),
    count: int = 10,
    seed: int = 0,
    root: Path = ROOT,
    source: str = "HEAD",
    jobs: int = 1,
    python: str = sys.executable,
    packages: tuple[str, ...] = PACKAGES,
    min_timeout: float = 60.0,
    timeout_factor: float = 4.0,
    progress: bool = True,
) -> tuple[Run, str, list[Mutant]]:
    """Every mutant (the table's ``mutants`` and those generated from ``generate_specs``) against
    its mapped tests, in copies of ``root``; (the run, what was copied, the mutants run)."""
    t0 = time.perf_counter()
    result = Run()
    with tempfile.TemporaryDirectory(prefix="perflab-mutation-") as tmp:
        copies = [Path(tmp, f"copy{j}") for j in range(max(1, jobs))]
        copied = ""
        for c in copies:
            copied = copy_tree(root, c, source)
            check_imports(c, list(packages), python, seed)
        tree = copies[0]
        mutants = list(mutants) + generate(list(generate_specs), tree, count, seed, packages)
        modules = source_modules(tree, packages)
        mapped = {f: tests_for(f, tree, extras, modules) for f in dict.fromkeys(m.file for m in mutants)}
        wanted = sorted({t for ts in mapped.values() for t in ts})
        collected, broken = collect(tree, sorted({t.split("::")[0] for t in wanted}), python, seed)
        result.stale_tests = stale_test_ids(wanted, collected, tree, broken)
        tests = {f: [t for t in ts if t not in result.stale_tests] for f, ts in mapped.items()}
        by_room: dict[str, list[tuple[Mutant, tuple[int, int]]]] = defaultdict(list)
        for m in mutants:
            r = Result(m.id, m.room, m.file, "", 0.0, m.why, m.named, "", m.line, m.find, m.replace, m.operator)
            path = tree / m.file
            span = locate(m, path.read_bytes()) if path.is_file() else f"{m.file} does not exist"
            if isinstance(span, str):
                r.status, r.detail = "stale", span
            else:
                r.key, r.line = mutant_key(m.file, path.read_bytes(), span, m.replace), _line(path.read_bytes(), span)
                if m.equivalent:
                    r.status, r.detail = "equivalent", m.equivalent
                elif not tests[m.file]:
                    gone = [t for t in mapped[m.file] if t in result.stale_tests]
                    r.status = "stale" if gone else "untested"
                    r.detail = f"every mapped test is gone: {', '.join(gone)}" if gone else "no tests mapped"
                else:
                    by_room[m.room].append((m, span))
            if r.status:
                result.results.append(r)
        free = list(copies)

        def baseline(room: str) -> tuple[str, float, str]:
            # one run of every test the room's mutants map to (one start-up, not one per file)
            union = list(dict.fromkeys(t for m, _ in by_room[room] for t in tests[m.file]))
            copy = free.pop()
            try:
                status, secs, det = run_tests(copy, union, 1800.0, python, seed)
            finally:
                free.append(copy)
            if progress:
                print(f"baseline {room}: {status} in {secs:.0f} s", file=sys.stderr)
            return status, secs, det

        todo = []
        with ThreadPoolExecutor(max_workers=len(copies)) as pool:
            for room, (status, secs, det) in zip(by_room, pool.map(baseline, list(by_room))):
                ok = status == "passed"
                result.baselines[room] = {
                    "ok": ok,
                    "seconds": round(secs, 1),
                    "detail": "" if ok else f"{status}: {det}",
                }
                for m, span in by_room[room]:
                    if ok:  # a mutant's tests are a part of the baseline's: its time bounds theirs
                        todo.append((m, span, max(min_timeout, timeout_factor * secs)))
                    else:
                        result.results.append(_result(m, "skipped", 0.0, "baseline failed", tree, span))
        bar = tqdm(total=len(todo), desc="mutants", unit="mutant", disable=not progress)

        def one(item) -> Result:
            m, span, timeout = item
            copy = free.pop()
            try:
                status, secs, detail = mutate_and_test(m, span, copy, tests[m.file], timeout, python, seed)
            finally:
                free.append(copy)
            bar.set_postfix_str(f"{m.id}: {status}")
            bar.update()
            return _result(m, status, secs, detail, tree, span)

        with ThreadPoolExecutor(max_workers=len(copies)) as pool:
            result.results += list(pool.map(one, todo))
        bar.close()
    order = {m.id: i for i, m in enumerate(mutants)}
    result.results.sort(key=lambda r: order[r.id])
    result.seconds = round(time.perf_counter() - t0, 1)
    return result, copied, mutants


def _result(m: Mutant, status: str, secs: float, detail: str, tree: Path, span: tuple[int, int]) -> Result:
    src = (tree / m.file).read_bytes()
    key, line = mutant_key(m.file, src, span, m.replace), _line(src, span)
    return Result(
        m.id, m.room, m.file, status, round(secs, 1), m.why, m.named, detail, line, m.find, m.replace, m.operator, key
    )


def _line(source: bytes, span: tuple[int, int]) -> int:
    return source.count(b"\n", 0, span[0]) + 1


# ------------------------------------------------------------------------------ the record
def load_results(path: Path) -> dict:
    if not path.is_file():
        return {"history": []}
    doc = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or not isinstance(doc.get("history"), list):
        raise ValueError(f"{path}: not a results file of benchmarks/mutation.py (no 'history' list)")
    return doc


def record(run_: Run, doc: dict, meta: dict, goal: float) -> dict:
    """Mark the fresh mutants, append the run to ``doc``'s history and keep it as ``last``."""
    seen = {k for h in doc["history"] for k in h.get("keys", [])}
    for r in run_.results:
        r.fresh = bool(r.key) and r.key not in seen and r.status in JUDGED
    rooms = run_.summary()
    total = {k: sum(row[k] for row in rooms.values()) for k in ("mutants", *STATUSES, "fresh", "fresh_killed")}
    judged = sum(total[s] for s in JUDGED)
    total["kill_rate"] = round((total["killed"] + total["timeout"]) / judged, 4) if judged else None
    total["first_shot_kill_rate"] = round(total["fresh_killed"] / total["fresh"], 4) if total["fresh"] else None
    entry = {
        **meta,
        "seconds": run_.seconds,
        "goal": goal,
        "rooms": rooms,
        "total": total,
        "problems": run_.problems(goal),
        "survivors": [_brief(r) for r in run_.survivors()],
        "stale": [{"id": r.id, "detail": r.detail} for r in run_.results if r.status == "stale"],
        "stale_tests": run_.stale_tests,
        "keys": sorted({r.key for r in run_.results if r.key and r.status in JUDGED}),
    }
    doc["history"].append(entry)
    doc["last"] = {
        **{k: v for k, v in entry.items() if k != "keys"},
        "baselines": run_.baselines,
        "mutants": [asdict(r) for r in run_.results],
    }
    return entry


def _brief(r: Result) -> dict:
    out = {"id": r.id, "file": r.file, "line": r.line, "find": r.find, "replace": r.replace, "why": r.why}
    return {**out, "status": r.status} if r.status != "survived" else out


def table_text(rooms: dict[str, dict]) -> str:
    head = (
        f"{'room':<14}{'mutants':>8}{'killed':>8}{'survived':>9}{'timeout':>8}{'untested':>9}{'stale':>6}{'equiv':>6}"
    )
    lines = [head + "  kill rate  first shot"]
    for room, r in rooms.items():
        rate = "-" if r["kill_rate"] is None else f"{r['kill_rate']:.0%}"
        first = "-" if r["first_shot_kill_rate"] is None else f"{r['fresh_killed']}/{r['fresh']}"
        lines.append(
            f"{room:<14}{r['mutants']:>8}{r['killed']:>8}{r['survived']:>9}{r['timeout']:>8}{r['untested']:>9}"
            f"{r['stale']:>6}{r['equivalent']:>6}  {rate:>9}  {first:>10}"
        )
    return "\n".join(lines)


def markdown_table(rooms: dict[str, dict]) -> str:
    """A run's per-room table (a history entry's ``rooms``) in Markdown."""
    lines = [
        "| room | mutants | killed | survived | timeout | kill rate | first shot |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for room, r in rooms.items():
        rate = "-" if r["kill_rate"] is None else f"{r['kill_rate']:.0%}"
        first = "-" if not r.get("fresh") else f"{r['fresh_killed']}/{r['fresh']}"
        lines.append(
            f"| {room} | {r['mutants']} | {r['killed']} | {r['survived']} | {r['timeout']} | {rate} | {first} |"
        )
    return "\n".join(lines)


def _meta(root: Path, copied: str, argv: list[str], seed: int | None, count: int | None, jobs: int) -> dict:
    commit, dirty = copied, False
    if copied == "working tree" and (root / ".git").exists():
        commit = _git(root, "rev-parse", "HEAD")
        dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no"))
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "source": "working tree" if copied == "working tree" else "commit",
        "dirty": dirty,
        "command": "python benchmarks/mutation.py " + " ".join(argv),
        "seed": seed,
        "count": count,
        "jobs": jobs,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--room", action="append", help="the table's mutants of this room (repeatable)")
    ap.add_argument("--mutant", action="append", help="and the table's mutant with this id (repeatable)")
    ap.add_argument("--generate", action="append", metavar="ROOM_OR_MODULE", help="generate mutants (repeatable)")
    ap.add_argument("--count", type=int, default=10, help="generated mutants per module (default 10)")
    ap.add_argument("--seed", type=int, help="the generator's seed (default: drawn, printed and recorded)")
    ap.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in its own copy (default 1)")
    ap.add_argument("--source", default="HEAD", help="a commit to copy (default HEAD), or 'tree': the working tree")
    ap.add_argument("--table", default=str(TABLE_DIR), help="the table: a folder of <room>.yaml or one file")
    ap.add_argument("--out", default=str(OUT), help="the results file (default benchmarks/results/mutation.json)")
    ap.add_argument("--min-timeout", type=float, default=60.0, help="seconds a mutant's tests may take at least")
    ap.add_argument("--timeout-factor", type=float, default=4.0, help="timeout as a multiple of the baseline's time")
    ap.add_argument("--goal", type=float, default=0.9, help="the kill rate each room must reach")
    ap.add_argument("--markdown", action="store_true", help="print the last recorded run's table in Markdown")
    a = ap.parse_args(argv)
    if a.count < 1:
        ap.error(f"--count must be at least 1, got {a.count}")
    if a.markdown:
        last = load_results(Path(a.out)).get("last")
        if not last:
            ap.error(f"{a.out}: no run recorded")
        print(f"{markdown_table(last['rooms'])}\n\n`{last['command']}`, {last['commit'][:7]}, {last['date']}")
        return 0
    table: Table = load_table(a.table)
    known_rooms = {m.room for m in table.mutants}
    unknown = set(a.room or ()) - known_rooms | set(a.mutant or ()) - {m.id for m in table.mutants}
    if unknown:
        ap.error(
            f"unknown room(s) or mutant(s): {', '.join(sorted(unknown))} (rooms: {', '.join(sorted(known_rooms))})"
        )
    mutants = table.mutants
    if a.room or a.mutant or a.generate:  # the union of what was asked
        mutants = [m for m in mutants if m.room in (a.room or ()) or m.id in (a.mutant or ())]
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**31)
    try:
        for spec in a.generate or ():
            gen.targets(spec, ROOT, PACKAGES)
    except ValueError as e:
        ap.error(str(e))
    if a.generate:
        print(f"generating {a.count} mutants per module with --seed {seed}", file=sys.stderr)
    if a.list:  # read from the working tree, not a copy
        mutants = mutants + generate(a.generate or [], ROOT, a.count, seed, PACKAGES)
        modules = source_modules(ROOT, PACKAGES)
        for m in mutants:
            mark = f" [{m.named}]" if m.named else f" (equivalent: {m.equivalent})" if m.equivalent else ""
            where = f"{m.file}:{m.line}" if m.generated else m.file
            print(f"{m.room:<12} {m.id:<40} {where}: {m.why}{mark}")
            if m.generated:
                print(f"{'':<13}{m.find[:70]!r} -> {m.replace[:70]!r}")
            print(f"{'':<13}tests: {' '.join(tests_for(m.file, ROOT, table.tests, modules)) or '(none)'}")
        return 0
    load_before = [round(x, 2) for x in os.getloadavg()]
    run_, copied, _ = run(
        mutants,
        table.tests,
        generate_specs=a.generate or [],
        count=a.count,
        seed=seed,
        root=ROOT,
        packages=PACKAGES,
        source=a.source,
        jobs=a.jobs,
        min_timeout=a.min_timeout,
        timeout_factor=a.timeout_factor,
    )
    meta = _meta(ROOT, copied, argv, seed if a.generate else None, a.count if a.generate else None, a.jobs)
    meta["kind"] = ("both" if mutants else "generated") if a.generate else "table"
    meta.update(load_before=load_before, load_after=[round(x, 2) for x in os.getloadavg()])
    out = Path(a.out)
    doc = load_results(out)
    entry = record(run_, doc, meta, a.goal)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"\n{table_text(entry['rooms'])}\n")
    for r in run_.survivors():
        print(f"{r.status}: {r.id} ({r.file}:{r.line}): {r.why}" + (f" [{r.named}]" if r.named else ""))
    for p in entry["problems"]:
        print(f"PROBLEM: {p}")
    t = entry["total"]
    first = f"{t['fresh_killed']}/{t['fresh']} first shot" if t["fresh"] else "no fresh mutant"
    print(f"\n{len(run_.results)} mutants of {copied} ({first}; seed {meta['seed']}); written to {a.out}")
    return 1 if entry["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
