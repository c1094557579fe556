"""Shared test set-up.  Importing lab_kernels first sets TRITON_INTERPRET on CPU-only machines.

Random inputs: the ``gen`` fixture seeds a fresh generator per test (``PERFLAB_SEED=<n>``
replays one seed) and a failing test's report carries a "perflab seed" section with the
command to reproduce it.
"""

import json
import os
import pickle
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import filelock
import pytest
import torch

import lab_kernels

SEED_ENV = "PERFLAB_SEED"


def draw_seed() -> int:
    """``PERFLAB_SEED`` when set (replay), else a fresh random seed."""
    env = os.environ.get(SEED_ENV)
    return int(env) if env else random.SystemRandom().randrange(2**31)


@pytest.fixture
def gen(request):
    """A fresh, differently seeded generator per test; the seed is reported on failure."""
    seed = draw_seed()
    request.node.perflab_seed = seed
    return torch.Generator().manual_seed(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed = getattr(item, "perflab_seed", None)
    if seed is not None and report.failed:
        report.sections.append(
            ("perflab seed", f"random inputs drawn with seed {seed}; replay: {SEED_ENV}={seed} pytest '{item.nodeid}'")
        )
    return report


@pytest.fixture(autouse=True)
def _signal_handlers_restored(request):
    """A test leaves the process's signal handlers as it found them: the Ctrl-C tests later in
    the session rely on SIGINT's."""
    import signal

    watched = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2, signal.SIGALRM)
    before = {s: signal.getsignal(s) for s in watched}
    yield
    after = {s: signal.getsignal(s) for s in watched}
    leaked = {signal.Signals(s).name: (before[s], after[s]) for s in watched if after[s] != before[s]}
    for s in watched:
        if after[s] != before[s] and before[s] is not None:
            signal.signal(s, before[s])
    assert not leaked, f"{request.node.nodeid} changed signal handlers (before, after): {leaked}"


@pytest.fixture
def temporary_variant():
    """Register eager-kind variants of an op for one test (e.g. a deliberately wrong one);
    they are unregistered after it."""
    added = []

    def add(op, name, fn):
        lab_kernels.register(op, name, fn, kind="eager")
        added.append((op, name))

    yield add
    for op, name in added:
        lab_kernels.unregister(op, name)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: tiny shapes gain nothing from more, and on a shared
    2-core box a second thread waits on a descheduled core (multi-ms stalls)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@dataclass
class SmokeRun:
    """The smoke suite's report for this session; ``stale`` says why it may not be this tree's
    run (``None``: it is, so its executed notebooks can stand in for a run of the labs here)."""

    path: Path
    stale: str | None


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> SmokeRun:
    """The real smoke suite, run once per session and shared by every test that needs a report
    (the browser tests, the labs' checked outputs), unless ``$PERFLAB_REPORT`` names a finished
    report folder to reuse."""
    from lab_utils.core.records import git_commit

    given = os.environ.get("PERFLAB_REPORT")
    if given:
        p = Path(given).resolve()
        assert (p / "index.html").exists() and (p / "status.json").exists(), (
            f"$PERFLAB_REPORT={given} is not a finished report folder (index.html, status.json)"
        )
        made, here = json.loads((p / "context.json").read_text()).get("commit", "unknown"), git_commit()
        clean = made == here and "dirty" not in here and made != "unknown"
        return SmokeRun(p, None if clean else f"$PERFLAB_REPORT was made at {made}, this tree is {here}")
    return SmokeRun(once_per_run(tmp_path_factory, "smoke-report", _run_smoke), None)


def once_per_run(tmp_path_factory, name: str, make):
    """``make(folder)``'s value, made once per pytest run: under pytest-xdist every worker has its
    own session, so the first worker to ask makes it in the run's shared temporary folder while the
    others wait on a lock, then read it back (pickled). A ``make`` that raises leaves nothing
    behind: the next worker to ask tries again and reports its own error."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    with filelock.FileLock(shared / f"{name}.lock"):
        done = shared / f"{name}.pickle"
        if not done.exists():
            folder = shared / name
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            tmp = done.with_suffix(".partial")
            tmp.write_bytes(pickle.dumps(make(folder)))
            tmp.rename(done)
        return pickle.loads(done.read_bytes())


def _run_smoke(root: Path) -> Path:
    from lab_utils.run.runner import run_suite

    # two labs at a time (the runner's local jobs, as `perflab run smoke --parallel 2`): serially a
    # lab's kernel start-up and single-threaded stretches leave a core idle; measured on the idle
    # 2-core machine, 559 s serial -> 416 s. Each lab times on its share of the cores (its context
    # says so), and the checked outputs the tests compare do not depend on timings.
    # PERFLAB_SMOKE_PARALLEL=1: the labs one after the other, in this process.
    n = os.environ.get("PERFLAB_SMOKE_PARALLEL", "2")
    assert n.isdigit() and int(n) >= 1, f"$PERFLAB_SMOKE_PARALLEL={n!r}: expected an integer >= 1"
    jobs = {"executor": "local", "parallel": int(n)} if int(n) > 1 else None
    return run_suite("smoke", out_dir=root, progress=False, jobs=jobs).path


@pytest.fixture(scope="session")
def smoke_report(smoke_run) -> Path:
    return smoke_run.path


#: a lab of the tiny report: records under several keys (one repeated, one not finite), a
#: profiler-like trace, a tqdm bar that finishes and a HoloViews plot
TINY_LAB = """\
import math, os, pathlib
import holoviews as hv
from tqdm.auto import tqdm
from lab_utils.core.plots import init
from lab_utils.core.records import Recorder
init()
d = pathlib.Path(os.environ['PERFLAB_ARTIFACTS_DIR']) / 'traces'
d.mkdir(parents=True, exist_ok=True)
(d / 'step.trace.json').write_text('{"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 0, "dur": 5}]}')
rec = Recorder('tiny', params={'reps': reps})
for _ in tqdm(range(reps), desc='tiny steps', disable=False):
    pass
rec.add('sweep', 'eager', 'time', 1.5, 'ms', shape=(64, 128), dtype='float32', statistic='median')
rec.add('sweep', 'eager', 'time', 1.9, 'ms', shape=(64, 128), dtype='float32', statistic='p80')
rec.add('sweep', 'triton', 'time', math.nan, 'ms', shape=(64, 128), dtype='float32', statistic='failed')
for step in range(3):
    rec.add('telemetry', 'base', 'grad_norm', 0.5 + step, '', step=step)
rec.save()
print('tiny lab done', reps)
hv.Curve([(0, 0), (1, reps)])
"""


@pytest.fixture(scope="session")
def tiny_suite(tmp_path_factory) -> Path:
    """A suite file of one lab, :data:`TINY_LAB`."""
    import nbformat
    import yaml

    from lab_utils.run.nbtools import make_notebook

    root = tmp_path_factory.mktemp("tiny-suite")
    nb = make_notebook(
        [("md", "# tiny"), ("params", 'device = "cpu"\nreps = 4'), ("code", TINY_LAB)],
        config="lab_utils.studies.ceilings:CeilingsLabConfig",
    )
    (root / "tiny.ipynb").write_text(nbformat.writes(nb))
    suite = root / "tiny.yaml"
    suite.write_text(yaml.safe_dump({"description": "tiny", "notebooks": [{"notebook": str(root / "tiny.ipynb")}]}))
    return suite


@pytest.fixture(scope="session")
def tiny_reports(tiny_suite):
    """Two real reports of the tiny suite run by the runner: ``default`` (traces not kept) and
    ``kept`` (``keep_traces=True``)."""
    from lab_utils.run.runner import run_suite

    suite, root = tiny_suite, tiny_suite.parent
    out = {}
    for name, keep in (("default", False), ("kept", True)):
        res = run_suite(suite, out_dir=root / name, progress=False, keep_traces=keep)
        assert res.ok, [s.error for s in res.statuses]
        out[name] = res.path
    return out
