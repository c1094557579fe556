"""The matrix: labs 01, 05, 07 and 08 run end to end (papermill, through the runner) with ``step``
set to each of diffusers' FLUX and SD3 transformers, transformers' Llama
(``parameterized/step_matrix.yaml``) and a PixArt-style model written for the tests
(``tests/pixart_step.py``: cross-attention, adaLN-single, no RoPE; a suite of its own, the tests'
folder importable): 16 runs, each lab at its ``smoke_step`` set, three at a time in the runner's
process pool.  Each run is checked for: the notebook completed; every row carries the step's
identity; the takeaway is built from the step's own figures (lab 01 step time and MFU, lab 05 peak
memory and what fits, lab 07 where a NaN was located and the provoked spike, lab 08 the best plan
with its predicted and measured gain); the sections the step has no capability for left the page,
each capability named once in the footnote; lab 07's report names the module the locator found.

The smoke suite's ``05_memory_flux`` is this matrix's lab 05 on FLUX with the same parameters
(checked below): when the session runs the smoke suite anyway (``make test``) that run is checked
instead of running the notebook a second time; run alone, this file runs all 16."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
import yaml
from conftest import once_per_run

from lab_utils.run.executors import MapOptions, map_jobs
from lab_utils.run.runner import JOB_HOOKS, ROOT, NotebookStatus, load_suite, plan
from lab_utils.step import STEP_PATH_ENV

SUITE = ROOT / "parameterized" / "step_matrix.yaml"
TESTS = Path(__file__).resolve().parents[1]
EXAMPLES = "lab_utils.step.examples"
#: short name -> (factory, the model class's name)
STEPS = {
    "flux": (f"{EXAMPLES}:flux_step", "FluxTransformer2DModel"),
    "sd3": (f"{EXAMPLES}:sd3_step", "SD3Transformer2DModel"),
    "llama": (f"{EXAMPLES}:llama_step", "LlamaForCausalLM"),
    "pixart": ("pixart_step:pixart_step", "PixArt"),
}
IN_SUITE = ("flux", "sd3", "llama")  # the PixArt-style model lives beside the tests: a suite of its own
#: lab -> (the experiments it records on any step, its takeaway's figures, the capabilities its page leaves out)
LABS = {
    "01_training_step": (
        {"step", "phases", "categories", "top_ops", "mfu", "memory", "artifacts"},
        ("step time", "MFU", "peak memory", "largest phase"),
        {"presets", "diffusers_equivalence", "flop_formula", "bad_input", "explorer"},
    ),
    "05_memory": (
        {"step_memory", "step_saved", "saved_by_op", "policies", "timeline", "step_fits"},
        ("peak memory, no checkpointing", "lowest peak", "what fits"),
        {"memory_formula", "fsdp_check", "explorer"},
    ),
    "07_stability": (
        {"nan_locator", "spikes", "spike_summary"},
        ("NaN located in", "provoked spike", "steps replayed by spike policies"),
        {"stability_runs", "explorer"},
    ),
    "08_plan": (
        {"base", "effects", "plans", "verify"},
        ("measured step", "best plan", "measured gain", "prediction error"),
        {"explorer"},
    ),
}
REUSED = "05_memory_flux"  # the smoke suite's entry of the same name
RUNS = [f"{lab}_{s}" for lab in LABS for s in STEPS]
#: Runs at once: most of a run is its kernel starting and importing (torch, diffusers, holoviews),
#: so one more than this machine's 2 cores keeps both busy; each kernel computes on one thread.
PARALLEL = 3
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass
class Run:
    stem: str
    status: str
    error: str | None
    seconds: float
    notebook: Path
    records: Path


def _runs_of(report: Path, stems) -> dict[str, Run]:
    status = {s["notebook"]: s for s in json.loads((report / "status.json").read_text())}
    return {
        stem: Run(
            stem,
            status[stem]["status"],
            status[stem]["error"],
            status[stem]["seconds"],
            report / "notebooks" / f"{stem}.ipynb",
            report / "records" / stem / "records.json",
        )
        for stem in stems
    }


def _session_runs_the_smoke_suite(request) -> bool:
    """Whether another test of this session needs the smoke suite's report (``make test``: yes),
    on this process (under xdist another worker would run it a second time)."""
    if hasattr(request.config, "workerinput"):
        return False
    return any({"smoke_run", "smoke_report"} & set(getattr(i, "fixturenames", ())) for i in request.session.items)


def run_planned(item: tuple) -> NotebookStatus:
    """One planned notebook through the runner's own execution (papermill, records, HTML), in a
    pool worker forked from this process (no job process importing the runner again)."""
    p, out = item
    return JOB_HOOKS.run_one(p, out, out, 600)


def pixart_suite(folder: Path) -> Path:
    """The four labs on the tests' PixArt-style model, as a suite file."""
    entries = [
        dict(notebook=str(ROOT / "labs" / f"{lab}.ipynb"), name=f"{lab}_pixart", set="smoke_step",
             params={"step": STEPS["pixart"][0]})
        for lab in LABS
    ]  # fmt: skip
    path = folder / "pixart_matrix.yaml"
    path.write_text(
        yaml.safe_dump({"description": "labs 01, 05, 07, 08 on a PixArt-style model", "notebooks": entries})
    )
    return path


def run_matrix(stems: list[str], out: Path) -> dict[str, Run]:
    """The runs ``stems``, validated by the runner's ``plan``, ``PARALLEL`` at a time on
    :func:`lab_utils.run.executors.map_jobs`' process pool, as a headless run sees them."""
    ours = [x for x in stems if not x.endswith("_pixart")]
    planned = plan(load_suite(SUITE), only=ours) if ours else []
    pix = [x for x in stems if x.endswith("_pixart")]
    planned += plan(load_suite(pixart_suite(out)), only=pix) if pix else []
    for d in ("notebooks", "html", "logs"):
        (out / d).mkdir(parents=True, exist_ok=True)
    env = {**THREADS, "TQDM_DISABLE": "1", "PERFLAB_RUN_ID": out.name, STEP_PATH_ENV: str(TESTS)}
    saved = {k: os.environ.get(k) for k in (*env, "PERFLAB_RECORDS_DIR", "PERFLAB_ARTIFACTS_DIR")}
    os.environ.update(env)  # the workers and their kernels inherit it
    try:
        opts = MapOptions(executor="pool", workers=PARALLEL, mem_gb=None)  # no bound: the kernels inherit it
        outs = map_jobs(run_planned, [(p, out) for p in planned], opts, out / "jobs", progress=False)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    runs = {}
    for p, o in zip(planned, outs):
        st = o.value if o.ok else NotebookStatus(p.entry.stem, "", status="failed", error=o.error)
        nb, rec = out / "notebooks" / f"{st.notebook}.ipynb", out / "records" / st.notebook / "records.json"
        runs[st.notebook] = Run(st.notebook, st.status, st.error, st.seconds, nb, rec)
    return runs


@pytest.fixture(scope="session")
def step_matrix(request, tmp_path_factory) -> dict[str, Run]:
    runs: dict[str, Run] = {}
    only = list(RUNS)
    if _session_runs_the_smoke_suite(request):
        smoke = request.getfixturevalue("smoke_run")
        if smoke.stale is None:
            runs |= _runs_of(smoke.path, [REUSED])
            only.remove(REUSED)
    t0 = time.perf_counter()
    runs |= once_per_run(tmp_path_factory, "step-matrix", lambda folder: run_matrix(only, folder))
    wall = time.perf_counter() - t0
    print(f"\nstep matrix: {len(only)} runs in {wall:.0f} s wall ({PARALLEL} at a time)")
    for r in runs.values():
        reused = "  (the smoke run's)" if r.stem not in only else ""
        print(f"  {r.stem:26s} {r.status:6s} {r.seconds:6.1f} s{reused}")
    return runs


def test_the_matrix_is_every_lab_on_every_model(tmp_path):
    suite = load_suite(SUITE)
    got = {e.stem: (e.notebook.stem, e.set, e.params["step"]) for e in suite.entries}
    assert got == {f"{lab}_{s}": (lab, "smoke_step", STEPS[s][0]) for lab in LABS for s in IN_SUITE}
    plan(suite)  # every run's parameters validate
    assert len(plan(load_suite(pixart_suite(tmp_path)))) == 4


def test_the_smoke_suites_lab_05_on_flux_is_the_matrixs():
    """What lets the matrix check the smoke run's 05_memory_flux instead of running it again."""
    smoke = {p.entry.stem: p.resolved for p in plan(load_suite("smoke"), only=[REUSED])}
    ours = {p.entry.stem: p.resolved for p in plan(load_suite(SUITE), only=[REUSED])}
    assert smoke == ours
    sets = ROOT / "parameterized" / "sets" / "05_memory"
    flux, step = (yaml.safe_load((sets / f"{n}.yaml").read_text()) for n in ("smoke_flux", "smoke_step"))
    assert flux == {**step, "step": STEPS["flux"][0]}


def _text(o) -> str:
    if o.output_type == "stream":
        return o.get("text", "")
    data = o.get("data", {})
    return "".join(data.get("text/plain", "")) + "".join(data.get("text/markdown", ""))


@pytest.mark.slow  # the matrix: ~6 minutes on 2 cores, paid by the first of these tests
@pytest.mark.parametrize("stem", RUNS)
def test_a_lab_runs_end_to_end_with_its_whole_page_on_a_model_perflab_did_not_write(step_matrix, stem):
    lab, short = stem.rsplit("_", 1)
    factory, model_class = STEPS[short]
    recorded, figures, absent = LABS[lab]
    run = step_matrix[stem]
    assert run.status == "ok", f"{stem}: {run.error}"

    # the notebook completed: every code cell ran, none raised
    nb = nbformat.read(run.notebook, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), f"{stem}: a cell did not run"
    assert not [o for c in code for o in c.get("outputs", []) if o.output_type == "error"], stem
    out = "\n".join(_text(o) for c in nb.cells for o in c.get("outputs", []))

    # the records carry the step's identity, the run's parameters too
    data = json.loads(run.records.read_text())
    ident = data["context"]["params"]["step_identity"]
    assert ident["factory"] == factory and ident["model_class"].endswith("." + model_class), ident
    assert ident["parameters"] > 0 and re.fullmatch(r"[0-9a-f]{12}", ident["config_hash"]), ident
    key = f"{factory}/{ident['model_class']}"
    assert f"step: {key} · {ident['parameters']:,} parameters · config {ident['config_hash']}" in out, stem
    rows = data["rows"]
    assert recorded <= {r["experiment"] for r in rows}, f"{stem}: missing {recorded - {r['experiment'] for r in rows}}"
    for r in rows:
        extra = json.loads(r["extra"] or "{}")
        assert r["variant"].startswith(key), r
        assert (extra["model_class"], extra["parameters"], extra["config"]) == (
            ident["model_class"],
            ident["parameters"],
            ident["config_hash"],
        ), r

    # the takeaway is the step's own figures, shown in the notebook
    (take,) = [line for line in out.splitlines() if line.startswith("Takeaway: ")]
    for f in figures:
        assert re.search(re.escape(f) + r"[^;:]*: ", take), f"{stem}: no {f!r} in {take}"
    assert "n/a" not in take, take

    # what the step cannot do left the page, each capability named once in the footnote
    assert not [c for c in nb.cells if c.source.startswith("%%needs")], stem
    foot = _text(code[-1].outputs[-1])
    named = set(re.findall(r"`(\w+)`: ", foot))
    assert named == absent, f"{stem}: footnote names {named}, expected {absent}"
    assert all(foot.count(f"`{c}`") == 1 for c in absent), foot

    if lab == "07_stability":  # the module the locator found is in the report: the injected one, or inside it
        found = re.findall(r"injected .+? in (\S+): step \d+, located in (\S+) \(", out)
        assert len(found) == 3, out
        assert all(got == want or got.startswith(want + ".") for want, got in found), found
        assert all(got in take for _, got in found), take
    if lab == "08_plan":
        assert "verified plans: 2; each ran exactly its predicted seams: True" in out, stem
