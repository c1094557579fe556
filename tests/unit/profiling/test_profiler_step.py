"""lab_utils.profiling.profiler on a step given by its factory (tests/unit/step/tiny.py: eight
Linear(8, 8) on two rows): the FLOPs of one step from the factory or counted by hand, and one real
profiled step's phases and records checked against the analysis they come from (relations and
exact counts, never a timing), its memory counted by default (at least every gradient at once), and
a profile into a folder it makes."""

from __future__ import annotations

import pytest

from lab_utils.core.records import Recorder
from lab_utils.profiling.profiler import profile_step, step_flops, step_phase_names
from lab_utils.step.contract import STEP_PHASES
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
