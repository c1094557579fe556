"""lab_utils.step.profile: the phases read from a trace written here (per step, each named range's
summed time in ms and the step phase holding it, a range at a step's end and one across two
phases), the FLOPs of one step from the factory or counted by hand over the tiny step's eight
Linear layers, and one real profiled step's phase table and records checked against the report
they come from (relations, never a timing)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lab_utils.core.records import Recorder
from lab_utils.core.timing import judge_samples
from lab_utils.step.contract import STEP_PHASES
from lab_utils.step.profile import profile_step, record_profile, step_flops, trace_phases

from .tiny import B, D, tiny_step


def ann(name, ts, dur, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}


def test_phases_per_step_and_their_holder(tmp_path):
    ev = [ann("ProfilerStep#2", 1000, 1000), ann("ProfilerStep#1", 0, 1000),  # out of order: sorted by ts
          ann("data_loading", 0, 100), ann("forward", 100, 400), ann("backward", 500, 400),
          ann("embed", 150, 100), ann("embed", 300, 50),  # in one forward: summed
          ann("embed", 450, 50),  # ends where forward ends: still held by it
          ann("loss", 480, 40),  # across forward and backward: held by no phase
          ann("forward", 1000, 600), ann("embed", 1000, 200),  # starts with the step and with forward
          ann("embed", 1999, 1),  # at the step's last us
          ann("embed", 2000, 5),  # starts where step 2 ends: in no step
          ann("forward", 1700, 100, cat="cpu_op"),  # not a range
          {"ph": "i", "cat": "user_annotation", "name": "forward", "ts": 1}]  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    df = trace_phases(path, STEP_PHASES + ("embed", "loss"))
    got = {(r.step, r.phase, r.within): round(r.ms, 9) for r in df.itertuples()}
    assert got == {(0, "data_loading", ""): 0.1, (0, "forward", ""): 0.4, (0, "backward", ""): 0.4,
                   (0, "embed", "forward"): 0.2, (0, "loss", "(none)"): 0.04,
                   (1, "forward", ""): 0.6, (1, "embed", "forward"): 0.2, (1, "embed", "(none)"): 0.001}  # fmt: skip
    assert trace_phases(path, ("backward",)).ms.tolist() == [0.4]
    path.write_text(json.dumps(ev))  # a bare list of events, as some exporters write
    assert len(trace_phases(path, STEP_PHASES)) == 4


def test_the_flops_of_one_step():
    step = tiny_step()
    step.flops = lambda batch: 7.0 * batch.shape[0]
    assert step_flops(step, k=3) == (14.0, "the factory's flops(batch)")
    step.flops = None
    # eight Linear(8, 8) on 2 rows: forward 2*B*D*D each; backward the weight's gradient for all
    # eight and the input's for seven (the batch needs no gradient)
    mm = 2 * B * D * D
    assert step_flops(step) == (8 * mm + 8 * mm + 7 * mm, "FlopCounterMode over one forward + backward")
    assert all(p.grad is None for p in step.model.parameters())  # the count leaves no gradient behind


LONG = "pkg." + "m" * 80 + ":tiny_step"


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    step = tiny_step()
    step.name = LONG
    return profile_step(step, steps=3, warmup=1, out_dir=tmp_path_factory.mktemp("prof"))


def test_a_profiled_steps_phase_table_and_records(profiled):
    prof = profiled
    assert prof.phase_set == set(STEP_PHASES) and prof.flops == 23 * 2 * B * D * D
    assert sorted(set(prof.phases.step)) == [0, 1, 2] and set(prof.phases.within) == {""}
    steps = prof.report.analysis.steps
    assert len(steps) == 3 and steps.coverage.tolist() == pytest.approx((steps.phase_sum_ms / steps.step_ms).tolist())
    t = prof.phase_table().set_index("phase")
    median_step = float(steps.step_ms.median())
    for p in STEP_PHASES:
        per = prof.phases[prof.phases.phase == p].ms
        assert t.loc[p, "ms"] == pytest.approx(float(per.median()))
        assert t.loc[p, "pct_of_step"] == pytest.approx(100 * float(per.median()) / median_step)
    rec = Recorder("step", device="cpu")
    record_profile(rec, prof)
    rows = {(r["variant"], r["metric"]): r for r in rec.rows}
    key = prof.ident.key
    assert rows[(key, "flops")]["value"] == prof.flops and rows[(key, "flops")]["unit"] == "FLOP"
    assert rows[(key, "step_time")]["samples"] == pytest.approx(list(prof.report.amortised_step_ms))
    assert rows[(f"{key} · forward", "phase_time")]["value"] == pytest.approx(t.loc["forward", "ms"])
    assert rows[(f"{key} · forward", "phase_time")]["samples"] == pytest.approx(
        prof.phases[prof.phases.phase == "forward"].ms.tolist()
    )
    fwd = prof.phases[prof.phases.phase == "forward"].ms.tolist()
    v = judge_samples(fwd)  # three samples: a phase's time carries their verdict
    assert rows[(f"{key} · forward", "phase_time")]["stable"] == v.stable
    assert rows[(f"{key} · forward", "phase_time")]["stability"] == v.reason and v.reason
    assert rows[(key, "peak_allocated")]["value"] == pytest.approx(prof.peak_bytes / 2**20)
    assert rows[(key, "peak_allocated")]["unit"] == "MiB"
    assert all(v.startswith(key) for v, _ in rows)
    # the trace's file: the factory's name made safe (non-alphanumerics as _), its last 60 characters
    safe = ("pkg_" + "m" * 80 + "_tiny_step")[-60:]
    assert prof.report.trace_path.name.startswith(f"step-{safe}-") and prof.report.trace_path.is_file()
    assert prof.report.trace_path.name[len("step-") :].index("-") == 60


def test_the_peak_is_recorded_in_mib(profiled):
    cuda = dataclasses.replace(profiled, report=dataclasses.replace(profiled.report, cuda_peak_bytes=3 * 2**20))
    assert cuda.peak_bytes == 3 * 2**20  # the CUDA allocator's figure first
    assert profiled.peak_bytes == profiled.report.analysis.peak_allocated_bytes  # else the trace's
    rec = Recorder("step", device="cpu")
    record_profile(rec, cuda)
    peak = next(r for r in rec.rows if r["metric"] == "peak_allocated")
    assert (peak["value"], peak["unit"]) == (3.0, "MiB")
