"""lab_utils.profiling.profiler on a step given by its factory (tests/unit/step/tiny.py: eight
Linear(8, 8) on two rows): the FLOPs of one step from the factory or counted by hand, and one real
profiled step's phases and records checked against the analysis they come from (relations and
exact counts, never a timing), its memory counted by default (at least every gradient at once), and
a profile into a folder it makes.  The schedule by the batches a step is asked for (the default one
warm-up and three profiled from batch 0, a later start, a trainer's next step and its count), bad
schedules refused before anything runs, only phases every N > 1 steps periodic, and on a CUDA device
(faked on a CPU: the allocator's calls are stand-ins) the allocator's peak and memory page recorded
as what they are."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import pytest
import torch

from lab_utils.core.config import ConfigError
from lab_utils.core.records import Recorder
from lab_utils.profiling import profiler as profiler_module
from lab_utils.profiling.profiler import profile_step, profile_training, step_flops, step_phase_names
from lab_utils.step.contract import STEP_PHASES, Periodic, StepFactory
from unit.step.tiny import B, D, tiny_step

MM = 2 * B * D * D  # one Linear(8, 8) forward on B rows


def test_the_flops_of_one_step_by_hand():
    step = tiny_step()
    # forward 2*B*D*D per Linear; backward the weight's gradient for all eight and the input's for
    # seven (the batch needs no gradient)
    assert step_flops(step, [None, None]) == ([23 * MM, 23 * MM], "FlopCounterMode over one forward + backward")
    assert all(p.grad is None for p in step.model.parameters())  # the count leaves no gradient behind
    assert step_flops(tiny_step(batch=5), [None])[0] == [23 * 2 * 5 * D * D]


def test_the_factorys_own_flops_are_taken_per_batch():
    step = tiny_step()
    step.flops = lambda batch: 7.0 * batch
    assert step_flops(step, [2, 3]) == ([14, 21], "the step's flops(batch)")
    step.flops.method = "counted on a meta copy"
    assert step_flops(step, [1])[1] == "counted on a meta copy"


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    return profile_step(tiny_step(), active=3, warmup=1, out_dir=tmp_path_factory.mktemp("prof"), name="tiny")


def test_a_profiled_step_has_its_phases_in_every_step_and_its_counted_flops(profiled):
    a = profiled
    assert step_phase_names(tiny_step()) == tuple(STEP_PHASES)
    assert profiled.step_flops == [23 * MM] * 3 and profiled.trace_path.is_file()
    assert profiled.trace_path.name.startswith("tiny-")
    assert profiled.flops_source == "FlopCounterMode over one forward + backward"
    assert len(a.steps) == 3
    assert a.steps.coverage.tolist() == pytest.approx((a.steps.phase_sum_ms / a.steps.step_ms).tolist())
    assert (a.steps.phase_sum_ms <= a.steps.step_ms * (1 + 1e-9)).all()  # phases lie inside their step


def test_a_profiled_steps_records_are_its_analysis(profiled):
    rec = Recorder("step", device="cpu")
    profiled.record(rec, variant="tiny")
    rows = {(r["experiment"], r["variant"], r["metric"], r["statistic"]): r for r in rec.rows}
    flops = [r for k, r in rows.items() if k[:3] == ("step", "tiny", "flops")]
    assert [r["value"] for r in flops] == [23 * MM] * 3 and {r["unit"] for r in flops} == {"FLOP"}
    step = rows[("step", "tiny", "step_time", "median")]
    assert step["value"] == pytest.approx(float(profiled.steps.amortised_ms.median()))
    assert step["samples"] == pytest.approx(profiled.steps.amortised_ms.tolist())
    peak = rows[("memory", "tiny", "peak_allocated", "max")]
    assert peak["unit"] == "MiB" and peak["value"] == pytest.approx(profiled.analysis.peak_allocated_bytes / 2**20)
    trace = rows[("artifacts", "tiny", "trace_file", "file")]
    assert trace["value"] == profiled.trace_path.stat().st_size and trace["unit"] == "bytes"


def test_a_profiled_step_counts_its_memory_by_default(profiled):
    # every parameter's gradient is live at once between the backward and zero_grad: at least
    # 576 float32 values (four blocks of two Linear(8, 8)) above what was live when profiling began
    assert profiled.analysis.peak_allocated_bytes >= 4 * 2 * (D * D + D) * 4 == 2304
    assert profiled.memory_html_path is None and profiled.cuda_peak_bytes is None  # a CPU: no allocator history


def test_a_profile_writes_into_a_folder_it_makes(tmp_path):
    rep = profile_step(tiny_step(), active=1, warmup=1, out_dir=tmp_path / "new" / "traces", name="one")
    assert rep.trace_path.parent == tmp_path / "new" / "traces" and rep.trace_path.is_file()
    assert len(rep.analysis.steps) == 1 and rep.step_flops == [23 * MM]


def growing_step(seen: list, saves: list, every: dict[str, int] | None = None) -> StepFactory:
    """The tiny step with batch k of k + 1 rows (``seen`` collects each k asked for), its FLOPs and
    tokens counted per batch from its rows, and one periodic phase per ``every`` item (name -> N)
    that appends (name, k) to ``saves`` when it runs."""
    step = tiny_step()

    def make_batch(k):
        seen.append(k)
        return torch.randn(k + 1, D, generator=torch.Generator().manual_seed(k))

    step.make_batch = make_batch
    step.flops = lambda batch: 23 * 2 * batch.shape[0] * D * D  # as counted by hand above, per row
    step.capabilities = {"tokens": lambda batch: 16 * batch.shape[0]}
    step.periodic = tuple(
        Periodic(name, n, lambda k, name=name: saves.append((name, k))) for name, n in (every or {}).items()
    )
    return step


@pytest.fixture(scope="module")
def by_default(tmp_path_factory):
    """A profile at the default schedule of a step with a save every 2 steps and a phase every step."""
    seen, saves = [], []
    rep = profile_step(growing_step(seen, saves, {"save": 2, "log": 1}), out_dir=tmp_path_factory.mktemp("p"))
    return rep, seen, saves


def test_by_default_one_warm_up_step_then_three_profiled_from_batch_0(by_default):
    rep, seen, saves = by_default
    assert seen == [0, 1, 2, 3]  # warm-up batch 0, then the profiled 1, 2, 3
    assert len(rep.analysis.steps) == 3
    # the profiled batches have 2, 3 and 4 rows: their FLOPs and tokens, in order
    assert rep.step_flops == [23 * 2 * r * D * D for r in (2, 3, 4)]
    assert rep.tokens == [32.0, 48.0, 64.0]
    assert saves == [("log", 0), ("save", 1), ("log", 1), ("log", 2), ("save", 3), ("log", 3)]


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_only_a_phase_run_every_n_over_1_steps_is_periodic(by_default):
    rep = by_default[0]
    assert rep.periods == {"save": 2}  # "log" runs every step: a phase like any other
    assert step_phase_names(growing_step([], [], {"save": 2, "log": 1})) == (*STEP_PHASES, "save", "log")
    figs = {f.phase: f for f in rep.phase_figures()}
    assert figs["save"].periodic and figs["save"].events == 2  # after profiled steps 1 and 3
    assert not figs["log"].periodic and len(figs["log"].samples) == 3
    rec = Recorder("step", device="cpu")
    rep.record(rec, variant="v")
    step = next(r for r in rec.rows if r["metric"] == "step_time")
    assert json.loads(step["extra"])["periods"] == {"save": 2}
    plain = profile_step(growing_step([], [], {"log": 1}), active=1, warmup=0, out_dir=by_default[0].trace_path.parent)
    assert plain.periods == {}
    rec = Recorder("step", device="cpu")
    plain.record(rec, variant="v")
    step = next(r for r in rec.rows if r["metric"] == "step_time")
    assert "rule" not in step["extra"] and "periods" not in step["extra"]


def test_a_later_start_profiles_the_batches_from_it(tmp_path):
    seen = []
    rep = profile_step(growing_step(seen, []), active=2, warmup=2, start=5, out_dir=tmp_path)
    assert seen == [5, 6, 7, 8] and len(rep.analysis.steps) == 2
    assert rep.tokens == [16.0 * 8, 16.0 * 9] and rep.step_flops == [23 * 2 * r * D * D for r in (8, 9)]


def test_profiling_a_trainer_starts_at_its_next_step_and_counts_the_steps(tmp_path):
    seen = []
    trainer = SimpleNamespace(step_index=7, as_step=lambda: growing_step(seen, []))
    rep = profile_training(trainer, active=2, warmup=1, out_dir=tmp_path)
    assert seen == [7, 8, 9] and trainer.step_index == 10 and len(rep.analysis.steps) == 2
    trainer.step_index, seen[:] = 0, []
    profile_training(trainer, out_dir=tmp_path)  # the default schedule: 1 + 3
    assert seen == [0, 1, 2, 3] and trainer.step_index == 4


@pytest.mark.parametrize(
    "active, warmup, param",
    [(0, 1, "steps"), (-1, 1, "steps"), (True, 1, "steps"), (2.0, 1, "steps"), (1, -1, "warmup_steps"),
     (1, False, "warmup_steps"), (1, 0.5, "warmup_steps"), (1, "1", "warmup_steps")],
)  # fmt: skip
def test_a_bad_schedule_names_its_parameter_before_anything_runs(active, warmup, param, tmp_path):
    seen = []
    with pytest.raises(ConfigError) as e:
        profile_step(growing_step(seen, []), active=active, warmup=warmup, out_dir=tmp_path / "never")
    assert e.value.param == param and seen == [] and not (tmp_path / "never").exists()
    trainer = SimpleNamespace(step_index=3, as_step=lambda: growing_step(seen, []))
    with pytest.raises(ConfigError):
        profile_training(trainer, active=active, warmup=warmup, out_dir=tmp_path / "never")
    assert trainer.step_index == 3 and seen == []


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_the_smallest_schedule_profiles_one_step_without_warm_up(tmp_path):
    seen = []
    rep = profile_step(growing_step(seen, []), active=1, warmup=0, out_dir=tmp_path)
    assert seen == [0] and len(rep.analysis.steps) == 1 and rep.tokens == [16.0]


@pytest.fixture
def fake_cuda(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a real CUDA device: test_profiler.py's CUDA profile runs the real calls")
    """What a CUDA device gives the profile, on a CPU: the step reports a CUDA device, the
    allocator's counters and history are stand-ins (calls logged), MemoryViz writes a stub page;
    the profiler drops its CUDA activity (none here) and traces the host as on a CUDA run."""
    calls = []
    monkeypatch.setattr(StepFactory, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append(("reset", a)))
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(("history", k)))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: {"segments": [], "device_traces": [[]]})
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2**20 + 2**19)  # 3.5 MiB
    monkeypatch.setattr(profiler_module, "trace_plot", lambda snap: "<html>" + "x" * 1000 + "</html>")
    return calls


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_on_cuda_the_allocators_peak_and_memory_page_are_the_profiles(fake_cuda, tmp_path):
    rep = profile_step(tiny_step(), active=2, warmup=1, out_dir=tmp_path, name="gpu")
    assert rep.cuda_peak_bytes == 3.5 * 2**20
    assert rep.memory_html_path.name.endswith(".memory.html") and rep.memory_html_path.stat().st_size == 1013
    assert rep.memory_snapshot_path.name.endswith(".memory_snapshot.pickle")
    assert pickle.loads(rep.memory_snapshot_path.read_bytes()) == {"segments": [], "device_traces": [[]]}
    assert rep.trace_path.name.startswith("gpu-") and rep.analysis.device_kind == "cuda"
    assert any("MemoryViz" in n for n in rep.notes)
    # the peak is reset before the profile, the history recorded during it and stopped after it
    assert [c[0] for c in fake_cuda] == ["reset", "history", "history"]
    assert fake_cuda[1][1]["max_entries"] > 0 and fake_cuda[2][1] == {"enabled": None}
    rec = Recorder("step", device="cuda")
    rep.record(rec, variant="v")
    rows = {(r["experiment"], r["metric"]): r for r in rec.rows}
    peak = rows[("memory", "cuda_max_allocated")]
    assert (peak["value"], peak["unit"], peak["statistic"]) == (3.5, "MiB", "max")
    page = rows[("artifacts", "memory_html")]
    assert page["value"] == 1013 and json.loads(page["extra"]) == {"path": str(rep.memory_html_path), "format": "html"}
    assert json.loads(rows[("artifacts", "trace_file")]["extra"])["format"] == "chrome-trace-json"


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_on_cuda_a_failed_snapshot_is_a_note_and_the_profile_stands(fake_cuda, monkeypatch, tmp_path):
    def broken(*a, **k):
        raise RuntimeError("no history")

    monkeypatch.setattr(torch.cuda.memory, "_snapshot", broken)
    rep = profile_step(tiny_step(), active=1, warmup=1, out_dir=tmp_path)
    assert rep.memory_html_path is None and rep.cuda_peak_bytes == 3.5 * 2**20
    assert "CUDA memory snapshot not written: RuntimeError: no history" in rep.notes
    assert fake_cuda[-1] == ("history", {"enabled": None})  # the history is stopped all the same
    rec = Recorder("step", device="cuda")
    rep.record(rec, variant="v")
    assert not any(r["metric"] == "memory_html" for r in rec.rows)
    assert any(r["metric"] == "cuda_max_allocated" and r["value"] == 3.5 for r in rec.rows)


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_without_memory_on_cuda_nothing_of_the_allocator_is_touched(fake_cuda, tmp_path):
    rep = profile_step(tiny_step(), active=1, warmup=1, out_dir=tmp_path, memory=False)
    assert fake_cuda == [] and rep.cuda_peak_bytes is None and rep.memory_html_path is None
