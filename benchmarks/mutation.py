"""Do the tests catch realistic bugs?  Rerun: `.venv/bin/python benchmarks/mutation.py --jobs 3`
(11 min on the 2-core machine with little else running; not part of `make test`).

Method: a hand-written table of mutants (``benchmarks/mutants.py``: file, an exact source
snippet, its replacement, the kind of bug) over the packages of issue 20.  Each mutant is a
bug a person could plausibly write (a constant changed, a mask off by one, a threshold moved,
a direction flipped, a dtype changed, a term dropped), not a generated one: a generator's
thousands of trivial mutants would take hours here.

* The shared working tree is never touched: the tree is copied once per run (``git archive``
  of a commit, default ``HEAD``; ``--source tree`` copies the working tree's tracked and
  untracked, not ignored, files) into a temporary folder, and every test runs there with
  ``PYTHONPATH`` at the copy (checked: ``lab_utils`` and ``lab_kernels`` must import from it,
  not from the editable install's mapping to the main tree).
* Every mutant's snippet must occur exactly once in its file: a stale mutant (0 or several
  matches) is an error, reported, never skipped silently.
* Each source file maps to the few tests that exercise it (``TESTS`` in the table).  Each
  package's tests run first unmutated, all in one run (a failing baseline aborts that package); then each
  mutant is applied to the copy, its tests run (``-x -q``, no plugin autoload, fixed
  ``PERFLAB_SEED``, no bytecode written, so an equal-length edit is never hidden by a stale ``.pyc``) with a timeout of
  ``max(--min-timeout, --timeout-factor x baseline)``, and the file is restored.
* A failing test run kills the mutant; a timeout counts as killed and is reported apart; a
  run that collects no test or fails to start pytest is an error.

Written to ``benchmarks/results/mutation.json`` and printed: per package the mutants, killed,
survived, timeouts, errors and the kill rate ((killed + timeout) / judged), then the survivors.
Exit status: 1 when a package is under ``--goal`` (90%), a named bug class survives, a mutant
is stale or errs, or a baseline fails; else 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import io
import json
import os
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

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "benchmarks" / "mutants.py"
OUT = ROOT / "benchmarks" / "results" / "mutation.json"
#: no plugin autoload and no addopts: the notebook and browser plugins cost seconds of CPU per run
#: (a third of a small test set's time), and no mapped test uses them
PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=")
STATUSES = ("killed", "timeout", "survived", "error", "stale", "skipped")


@dataclass(frozen=True)
class Mutant:
    """One planted bug: in ``file``, the one occurrence of ``find`` becomes ``replace``."""

    id: str
    package: str
    file: str  # relative to the tree's root
    find: str
    replace: str
    why: str  # the bug, in words
    named: str = ""  # the bug class of issue 20 it stands for, if one


@dataclass
class Result:
    id: str
    package: str
    file: str
    status: str  # one of STATUSES
    seconds: float = 0.0
    why: str = ""
    named: str = ""
    detail: str = ""  # the failing test's line, the error, or why it was skipped


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    baselines: dict[str, dict] = field(default_factory=dict)  # package -> {ok, seconds, detail}
    seconds: float = 0.0

    def summary(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for r in self.results:
            row = out.setdefault(r.package, {"mutants": 0, **dict.fromkeys(STATUSES, 0)})
            row["mutants"] += 1
            row[r.status] += 1
        for row in out.values():
            judged = row["killed"] + row["timeout"] + row["survived"]
            row["kill_rate"] = round((row["killed"] + row["timeout"]) / judged, 4) if judged else None
        return out

    def survivors(self) -> list[Result]:
        return [r for r in self.results if r.status == "survived"]

    def problems(self, goal: float) -> list[str]:
        """Why the run misses its goal (empty when it does not)."""
        out = [f"baseline of {p} failed: {b['detail']}" for p, b in self.baselines.items() if not b["ok"]]
        for p, row in self.summary().items():
            if row["kill_rate"] is not None and row["kill_rate"] < goal:
                out.append(f"{p}: kill rate {row['kill_rate']:.0%} < {goal:.0%}")
        out += [f"named class survives: {r.named} ({r.id})" for r in self.survivors() if r.named]
        out += [f"{r.status} mutant {r.id}: {r.detail}" for r in self.results if r.status in ("stale", "error")]
        return out


# ------------------------------------------------------------------------------ the table
def load_table(path: str | Path = TABLE) -> tuple[list[Mutant], dict[str, list[str]]]:
    """``MUTANTS`` (tuples or dicts of :class:`Mutant`'s fields) and ``TESTS`` (file -> the
    pytest node ids that exercise it) of a table module."""
    spec = importlib.util.spec_from_file_location("mutation_table", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # a table may define dataclasses
    spec.loader.exec_module(mod)
    mutants = [m if isinstance(m, Mutant) else Mutant(**m) for m in mod.MUTANTS]
    ids = [m.id for m in mutants]
    dups = sorted({i for i in ids if ids.count(i) > 1})
    if dups:
        raise ValueError(f"mutant ids repeat: {', '.join(dups)}")
    unmapped = sorted({m.file for m in mutants} - set(mod.TESTS))
    if unmapped:
        raise ValueError(f"files with mutants but no tests mapped: {', '.join(unmapped)}")
    return mutants, {k: list(v) for k, v in mod.TESTS.items()}


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
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", source], check=True, capture_output=True, text=True
        ).stdout.strip()
        tar = subprocess.run(
            ["git", "-C", str(root), "archive", "--format=tar", commit], check=True, capture_output=True
        )
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as tf:
            tf.extractall(dest, filter="data")
        return commit
    if is_git:
        files = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split("\0")
        for f in filter(None, files):
            src = root / f
            if src.is_file():
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / f)
    else:
        shutil.copytree(root, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".venv", "__pycache__", ".git"))
    return "working tree"


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


def validate(mutants: list[Mutant], copy: Path) -> dict[str, str]:
    """Mutant id -> why it is stale (its snippet is not in its file exactly once)."""
    stale = {}
    for m in mutants:
        path = copy / m.file
        if not path.is_file():
            stale[m.id] = f"{m.file} does not exist"
            continue
        n = path.read_text(encoding="utf-8").count(m.find)
        if n != 1:
            stale[m.id] = f"snippet found {n} times in {m.file} (expected once): {m.find[:60]!r}"
        elif m.find == m.replace:
            stale[m.id] = "the replacement equals the snippet"
    return stale


# ------------------------------------------------------------------------------ running tests
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


def tests_for(m: Mutant, tests: dict[str, list[str]]) -> list[str]:
    return tests[m.file]


def mutate_and_test(
    m: Mutant, copy: Path, tests: dict[str, list[str]], timeout: float, python: str, seed: int
) -> Result:
    path = copy / m.file
    original = path.read_text(encoding="utf-8")
    try:
        path.write_text(original.replace(m.find, m.replace, 1), encoding="utf-8")
        status, secs, detail = run_tests(copy, tests_for(m, tests), timeout, python, seed)
    finally:
        path.write_text(original, encoding="utf-8")
    kind = {"failed": "killed", "passed": "survived"}.get(status, status)
    return Result(m.id, m.package, m.file, kind, round(secs, 1), m.why, m.named, "" if kind == "survived" else detail)


def run(
    mutants: list[Mutant],
    tests: dict[str, list[str]],
    *,
    root: Path = ROOT,
    source: str = "HEAD",
    jobs: int = 1,
    python: str = sys.executable,
    import_check: tuple[str, ...] = ("lab_utils", "lab_kernels"),
    min_timeout: float = 60.0,
    timeout_factor: float = 4.0,
    seed: int = 0,
    progress: bool = True,
) -> tuple[Run, str]:
    """Every mutant of ``mutants`` against its mapped tests, in copies of ``root``; (the run, what was copied)."""
    t0 = time.perf_counter()
    result = Run()
    with tempfile.TemporaryDirectory(prefix="perflab-mutation-") as tmp:
        copies = [Path(tmp, f"copy{j}") for j in range(max(1, jobs))]
        copied = ""
        for c in copies:
            copied = copy_tree(root, c, source)
            if import_check:
                check_imports(c, list(import_check), python, seed)
        stale = validate(mutants, copies[0])
        by_pkg: dict[str, list[Mutant]] = defaultdict(list)
        for m in mutants:
            if m.id in stale:
                result.results.append(Result(m.id, m.package, m.file, "stale", 0.0, m.why, m.named, stale[m.id]))
            else:
                by_pkg[m.package].append(m)
        free = list(copies)

        def baseline(pkg: str) -> tuple[str, float, str]:
            # one run of every test the package's mutants map to (one start-up, not one per file)
            union = list(dict.fromkeys(t for m in by_pkg[pkg] for t in tests_for(m, tests)))
            copy = free.pop()
            try:
                status, secs, det = run_tests(copy, union, 1800.0, python, seed)
            finally:
                free.append(copy)
            if progress:
                print(f"baseline {pkg}: {status} in {secs:.0f} s", file=sys.stderr)
            return status, secs, det

        todo: list[tuple[Mutant, float]] = []
        with ThreadPoolExecutor(max_workers=len(copies)) as pool:
            for pkg, (status, secs, det) in zip(by_pkg, pool.map(baseline, list(by_pkg))):
                ok = status == "passed"
                result.baselines[pkg] = {
                    "ok": ok,
                    "seconds": round(secs, 1),
                    "detail": "" if ok else f"{status}: {det}",
                }
                for m in by_pkg[pkg]:
                    if ok:  # a mutant's tests are a part of the baseline's: its time bounds theirs
                        todo.append((m, max(min_timeout, timeout_factor * secs)))
                    else:
                        result.results.append(
                            Result(m.id, pkg, m.file, "skipped", 0.0, m.why, m.named, "baseline failed")
                        )
        bar = tqdm(total=len(todo), desc="mutants", unit="mutant", disable=not progress)

        def one(item: tuple[Mutant, float]) -> Result:
            m, timeout = item
            copy = free.pop()
            try:
                r = mutate_and_test(m, copy, tests, timeout, python, seed)
            finally:
                free.append(copy)
            bar.set_postfix_str(f"{m.id}: {r.status}")
            bar.update()
            return r

        with ThreadPoolExecutor(max_workers=len(copies)) as pool:
            result.results += list(pool.map(one, todo))
        bar.close()
    order = {m.id: i for i, m in enumerate(mutants)}
    result.results.sort(key=lambda r: order[r.id])
    result.seconds = round(time.perf_counter() - t0, 1)
    return result, copied


# ------------------------------------------------------------------------------ output
def table_text(run_: Run) -> str:
    rows = run_.summary()
    head = f"{'package':<14}{'mutants':>8}{'killed':>8}{'survived':>9}{'timeout':>8}{'error':>6}{'stale':>6}  kill rate"
    lines = [head]
    for pkg, r in rows.items():
        rate = "-" if r["kill_rate"] is None else f"{r['kill_rate']:.0%}"
        lines.append(
            f"{pkg:<14}{r['mutants']:>8}{r['killed']:>8}{r['survived']:>9}{r['timeout']:>8}{r['error']:>6}"
            f"{r['stale']:>6}  {rate}"
        )
    return "\n".join(lines)


def markdown_table(packages: dict[str, dict]) -> str:
    """The per-package table (``Run.summary()``, or a written JSON's ``packages``) in Markdown."""
    lines = ["| package | mutants | killed | survived | timeout | kill rate |", "|---|---:|---:|---:|---:|---:|"]
    for pkg, r in packages.items():
        rate = "-" if r["kill_rate"] is None else f"{r['kill_rate']:.0%}"
        lines.append(f"| {pkg} | {r['mutants']} | {r['killed']} | {r['survived']} | {r['timeout']} | {rate} |")
    return "\n".join(lines)


def to_json(run_: Run, copied: str, command: str, goal: float) -> dict:
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "source": copied,
        "seconds": run_.seconds,
        "goal": goal,
        "packages": run_.summary(),
        "baselines": run_.baselines,
        "problems": run_.problems(goal),
        "survivors": [asdict(r) for r in run_.survivors()],
        "mutants": [asdict(r) for r in run_.results],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", action="append", help="only this package (repeatable)")
    ap.add_argument("--mutant", action="append", help="and the mutant with this id (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in its own copy (default 1)")
    ap.add_argument("--source", default="HEAD", help="a commit to copy (default HEAD), or 'tree': the working tree")
    ap.add_argument("--table", default=str(TABLE), help="the mutant table (default benchmarks/mutants.py)")
    ap.add_argument("--out", default=str(OUT), help="the JSON written (default benchmarks/results/mutation.json)")
    ap.add_argument("--min-timeout", type=float, default=60.0, help="seconds a mutant's tests may take at least")
    ap.add_argument("--timeout-factor", type=float, default=4.0, help="timeout as a multiple of the baseline's time")
    ap.add_argument("--goal", type=float, default=0.9, help="the kill rate each package must reach")
    ap.add_argument("--markdown", metavar="JSON", help="print the table of a written result in Markdown, run nothing")
    a = ap.parse_args(argv)
    if a.markdown:
        doc = json.loads(Path(a.markdown).read_text(encoding="utf-8"))
        print(f"{markdown_table(doc['packages'])}\n\n`{doc['command']}`, {doc['date']}, {doc['seconds'] / 60:.0f} min")
        return 0
    mutants, tests = load_table(a.table)
    unknown = set(a.package or ()) - {m.package for m in mutants} | set(a.mutant or ()) - {m.id for m in mutants}
    if unknown:
        ap.error(f"unknown package(s) or mutant(s): {', '.join(sorted(unknown))}")
    if a.package or a.mutant:  # the union of what was asked
        mutants = [m for m in mutants if m.package in (a.package or ()) or m.id in (a.mutant or ())]
    if a.list:
        for m in mutants:
            mark = f" [{m.named}]" if m.named else ""
            print(f"{m.package:<12} {m.id:<34} {m.file}: {m.why}{mark}\n{'':<13}tests: {' '.join(tests[m.file])}")
        return 0
    run_, copied = run(
        mutants,
        tests,
        source=a.source,
        jobs=a.jobs,
        min_timeout=a.min_timeout,
        timeout_factor=a.timeout_factor,
    )
    command = "python benchmarks/mutation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = to_json(run_, copied, command.strip(), a.goal)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"\n{table_text(run_)}\n")
    for r in run_.survivors():
        print(f"survived: {r.id} ({r.file}): {r.why}" + (f" [{r.named}]" if r.named else ""))
    for p in doc["problems"]:
        print(f"PROBLEM: {p}")
    print(f"\n{len(run_.results)} mutants of {copied} in {run_.seconds:.0f} s; written to {a.out}")
    return 1 if doc["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
