"""The CPU rule of lab_utils.traces (lab_utils/traces/cpu.py) on traces perflab records here on CPU:
a tiny MLP step under a torch.profiler schedule, and two gloo ranks all-reducing known tensors."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from lab_utils.profiling.record import record_gloo_ranks, record_tiny_step
from lab_utils.traces import TraceAnalysis
from lab_utils.traces.cpu import RULE_TEXT, is_whole
from unit.traces.test_collectives import kernel, lagging, launch, op, step, write

STEPS = 3
NUMEL = (4096, 65536)


@pytest.fixture(scope="module")
def step_trace(tmp_path_factory):
    return record_tiny_step(tmp_path_factory.mktemp("cpu_step"), steps=STEPS, warmup=1)


@pytest.fixture(scope="module")
def gloo_job(tmp_path_factory):
    return record_gloo_ranks(tmp_path_factory.mktemp("gloo"), ranks=2, steps=STEPS, numel=NUMEL)


def _raw(path):
    return json.loads(open(path).read())["traceEvents"]


def _independent_per_step(events) -> dict[int, float]:
    """The rule's activity time per ProfilerStep, from the raw JSON alone: per thread, an operator
    enclosing no other operator (a leaf) or a whole one (matmul/attention/norm/communication), not
    inside a whole one; each counted in the step that encloses its start."""
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    steps = {
        int(re.match(r"ProfilerStep#(\d+)", e["name"]).group(1)): (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in events
        if e.get("cat") == "user_annotation" and re.match(r"ProfilerStep#\d+$", e.get("name", ""))
    }
    out = dict.fromkeys(steps, 0.0)
    for tid in {e["tid"] for e in ops}:
        mine = [e for e in ops if e["tid"] == tid]
        ts = np.array([float(e["ts"]) for e in mine])
        dur = np.array([float(e["dur"]) for e in mine])
        end = ts + dur
        whole = np.array([is_whole(e["name"]) for e in mine])
        idx = np.arange(len(mine))
        for i in range(len(mine)):
            inside_me = (ts >= ts[i]) & (end <= end[i]) & (idx != i) & ~((ts == ts[i]) & (end == end[i]) & (idx < i))
            around_me = (ts <= ts[i]) & (end >= end[i]) & (idx != i) & ~inside_me
            if (around_me & whole).any():
                continue
            if whole[i] or not inside_me.any():
                for s, (a, b) in steps.items():
                    if a <= ts[i] < b:
                        out[s] += dur[i]  # (end - ts of ~1e12 us timestamps would lose the ns)
    return out


def test_steps_found_are_the_steps_recorded(step_trace):
    """A schedule of 1 warm-up + 3 active steps: the trace holds 3 ProfilerStep ranges, all found."""
    raw = [e for e in _raw(step_trace) if re.match(r"ProfilerStep#\d+$", e.get("name", ""))]
    assert len(raw) == STEPS, [e["name"] for e in raw]
    ta = TraceAnalysis(step_trace)
    assert ta.rule(0) == "cpu" and len(ta.steps(0)) == STEPS
    assert sorted(ta.steps(0)["step"]) == sorted(int(e["name"].split("#")[1]) for e in raw)


def test_activity_totals_equal_an_independent_sum_of_the_raw_events(step_trace):
    ta = TraceAnalysis(step_trace)
    k = ta.kernels(0, "steps")
    mine = k.groupby("step")["dur"].sum().to_dict()
    want = _independent_per_step(_raw(step_trace))
    assert set(mine) == set(want) and len(want) == STEPS
    for s in want:
        assert mine[s] == pytest.approx(want[s], rel=1e-9, abs=1e-6), (s, mine[s], want[s])
    assert k["dur"].sum() == pytest.approx(sum(want.values()), rel=1e-9)  # the steps add up to the rank's total
    assert (k["queue_delay"] == 0).all() and (k["launch_tid"] == k["tid"].astype(str)).all()
    cats = set(k["category"])
    assert "matmul" in cats and k.loc[k["category"] == "matmul", "hta_type"].eq("COMPUTATION").all()
    assert {"forward", "backward", "optimizer"} <= set(k["phase"].dropna())


def test_every_figure_is_given_and_says_it_is_a_cpu_trace(step_trace):
    ta = TraceAnalysis(step_trace)
    t = ta.temporal().iloc[0]
    assert t["rule"] == "cpu" and t["span"] > 0 and t["compute"] > 0
    parts = sum(t[f"{c}_pct"] for c in ("idle", "compute", "communication", "memory", "other"))
    assert parts == pytest.approx(100.0)
    assert sum(ta.shares().iloc[0][c] for c in ("COMPUTATION", "COMMUNICATION", "MEMORY", "OTHER")) == pytest.approx(
        100.0
    )
    assert len(ta.temporal(by="step")) == STEPS
    ls = ta.launch_stats().iloc[0]
    assert not ls["launch_bound"] and "does not apply" in ls["reason"]
    assert RULE_TEXT in ta.summary()
    roof = ta.roofline(0)
    assert len(roof) and (roof["flops"] > 0).all()  # shapes were recorded
    assert set(ta.phases()["phase"]) >= {"forward", "backward", "optimizer"}


def test_gloo_ranks_communication_share_and_sizes(gloo_job):
    ta = TraceAnalysis(gloo_job)
    assert ta.ranks == [0, 1] and {ta.rule(r) for r in ta.ranks} == {"cpu"}
    for r in ta.ranks:
        assert len(ta.steps(r)) == STEPS
    assert (ta.shares()["COMMUNICATION"] > 0).all()
    calls = ta.collectives()
    calls = calls[(calls["collective"] == "all_reduce") & (calls["window"] == "step")]
    for r in ta.ranks:
        mine = calls[calls["rank"] == r]
        assert len(mine) == STEPS * len(NUMEL), mine
        assert sorted(set(mine["bytes"])) == sorted(4 * n for n in NUMEL)  # float32: 4 bytes per element
    sk = ta.skew()
    assert len(sk) >= STEPS * len(NUMEL) and (sk["skew_us"] >= 0).all()
    assert "straggler" in ta.straggler().verdict


def test_the_rule_is_not_applied_to_a_trace_with_gpu_kernels(tmp_path):
    ta = TraceAnalysis(lagging(tmp_path))
    assert ta.rule(0) == "gpu"
    assert set(ta.kernels(0)["name"]) == {"sm80_xmma_gemm", "elementwise_kernel_add"}  # no operator stands as one
    # one kernel is enough: the host's operators stay operators
    ev = [step(1, 0, 100), op("aten::mm", 10, 50, 5), op("aten::add", 60, 20, 6)]
    ev += [launch(1, 15, ext=5), kernel("sm80_xmma_gemm", 1, 20, 30, ext=5)]
    ta = TraceAnalysis(write(tmp_path / "one.json", ev))
    assert ta.rule(0) == "gpu" and list(ta.kernels(0)["name"]) == ["sm80_xmma_gemm"]
    assert RULE_TEXT not in ta.summary()


def test_whole_operators_and_record_param_comms_sizes(tmp_path):
    """A CPU trace as written by a backend that records ``record_param_comms`` (NCCL-style args):
    the matmul and the collective stand whole (what they enclose is not counted again), the
    collective's size comes from the record inside it, a leaf outside both is an activity."""
    comms = {"Collective name": "allreduce", "In msg nelems": 1000, "dtype": "Float", "Group size": 2}
    ev = [step(1, 0, 1000), op("aten::linear", 10, 100, 1), op("aten::addmm", 20, 80, 2), op("aten::expand", 25, 5, 3)]
    ev += [op("c10d::allreduce_", 200, 300, 4), op("record_param_comms", 210, 280, 5, **comms)]
    ev += [op("aten::empty", 220, 2, 6), op("aten::relu", 600, 50, 7)]
    ta = TraceAnalysis(write(tmp_path / "cpu.json", ev))
    k = ta.kernels(0).set_index("name")
    assert ta.rule(0) == "cpu" and sorted(k.index) == ["aten::linear", "aten::relu", "c10d::allreduce_"]
    assert k.loc["aten::linear", "category"] == "matmul" and k.loc["c10d::allreduce_", "hta_type"] == "COMMUNICATION"
    assert k["dur"].sum() == 100 + 300 + 50
    calls = ta.collectives()
    assert list(calls["collective"]) == ["all_reduce"] and list(calls["bytes"]) == [4000.0]
    assert calls["busbw_gbps"].iloc[0] == pytest.approx(4000 / 300e3)  # 2(n-1)/n = 1 for two ranks
    assert ta.shares().iloc[0]["COMMUNICATION"] == pytest.approx(100 * 300 / 450)
