"""lab_utils.traces.cpu: which operators of a CPU trace stand as its kernels (leaves, whole kernel-like
operators, the backend's ranges), at the edges of the nesting rule (an operator starting the instant
another ends), on traces written here whose selection is known by construction."""

from __future__ import annotations

import numpy as np
import pytest

from lab_utils.traces import read_rank
from lab_utils.traces.cpu import RULE, activities, applies, is_whole, launch_columns

from .kineto import ann, kernel, op, step, write


def picked(tmp_path, events) -> list[str]:
    return activities(read_rank(write(tmp_path / "c.json", events))).sort_values("ts")["name"].astype(str).tolist()


def test_leaves_and_whole_operators(tmp_path):
    """An autograd wrapper is never whole (its addmm is); addmm is whole (its copy_ inside is not counted);
    a parent of two leaves gives way to them; operators back to back are both leaves."""
    ev = [step(1, 0, 1000),
          op("autograd::engine::evaluate_function: AddmmBackward0", 0, 100),
          op("aten::addmm", 10, 50), op("aten::copy_", 20, 5), op("aten::expand", 30, 5),
          op("aten::my_parent", 100, 100), op("aten::relu", 100, 50), op("aten::sigmoid", 150, 50),
          op("aten::add", 200, 10), op("aten::mul", 210, 10)]  # fmt: skip
    assert picked(tmp_path, ev) == ["aten::addmm", "aten::relu", "aten::sigmoid", "aten::add", "aten::mul"]


def test_an_operator_starting_as_a_whole_one_ends_is_outside_it(tmp_path):
    ev = [step(1, 0, 100), op("aten::linear", 0, 10), op("aten::add", 10, 5), op("aten::mm", 20, 10),
          op("aten::t", 29, 1), op("aten::view", 30, 2)]  # fmt: skip
    assert picked(tmp_path, ev) == ["aten::linear", "aten::add", "aten::mm", "aten::view"]


def test_backend_ranges_are_the_transfer_and_threads_are_streams(tmp_path):
    ev = [step(1, 0, 500), op("c10d::allreduce_", 10, 20), op("record_param_comms", 12, 5),
          ann("gloo:all_reduce", 15, 200, tid=3), ann("## forward ##", 300, 10),
          {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": "worker", "ts": 400,
           "dur": 5}]  # fmt: skip
    k = activities(read_rank(write(tmp_path / "g.json", ev))).set_index("name")
    assert list(k.index) == ["c10d::allreduce_", "gloo:all_reduce", "aten::add"]  # c10d is whole: no record inside
    assert k.loc["gloo:all_reduce", "stream"] == 3 and k.loc["c10d::allreduce_", "stream"] == 1
    assert k.loc["aten::add", "stream"] == -1  # a thread id that is no number
    assert (k["device"] == -1).all() and (k["correlation"] == -1).all()
    host = read_rank(write(tmp_path / "g.json", ev)).host
    assert host.loc[k["host_index"], "name"].astype(str).tolist() == list(k.index)


@pytest.mark.parametrize(
    "name, whole",
    [("aten::linear", True), ("aten::addmm", True), ("c10d::allreduce_", True), ("aten::layer_norm", True),
     ("aten::scaled_dot_product_attention", True), ("AddmmBackward0", False),
     ("autograd::engine::evaluate_function: MmBackward0", False), ("aten::add", False), ("aten::copy_", False)],
)  # fmt: skip
def test_which_operators_stand_whole(name, whole):
    assert is_whole(name) is whole


def test_the_rule_applies_only_to_a_trace_without_gpu_activity(tmp_path):
    cpu = read_rank(write(tmp_path / "c.json", [step(1, 0, 10), op("aten::mm", 1, 2)]))
    gpu = read_rank(write(tmp_path / "g.json", [step(1, 0, 10), op("aten::mm", 1, 2), kernel("k", 1, 3, 1)]))
    assert applies(cpu) and not applies(gpu) and RULE == "cpu"


def test_each_activity_is_launched_by_itself(tmp_path):
    k = launch_columns(activities(read_rank(write(tmp_path / "c.json", [step(1, 0, 50), op("aten::mm", 5, 20)]))))
    row = k.iloc[0]
    assert (row["launch_ts"], row["launch_dur"], row["launch_tid"], row["op"]) == (5.0, 0.0, "1", "aten::mm")
    assert row["launch_name"] == "aten::mm" and row["op_index"] == 1 and "host_index" not in k
    assert np.issubdtype(k["op_index"].dtype, np.integer)


def test_a_trace_without_operators_has_no_activity(tmp_path):
    """Only a step and a user range, no ``cpu_op`` and no backend range: nothing stands as a kernel
    (the step itself, the first host row, must not)."""
    trace = read_rank(write(tmp_path / "e.json", [step(1, 0, 100), ann("## forward ##", 10, 20)]))
    k = activities(trace)
    assert len(k) == 0 and list(k.columns) == list(trace.host.columns) + ["host_index"]


def test_activities_are_the_host_rows_renumbered_from_zero(tmp_path):
    """One row per activity, numbered 0..n-1, with the host table's columns and the host row it is:
    no column of the host's own numbering beside them."""
    ev = [step(1, 0, 100), op("aten::mm", 5, 20), op("aten::add", 40, 5), ann("gloo:all_reduce", 50, 10, tid=3)]
    trace = read_rank(write(tmp_path / "c.json", ev))
    k = activities(trace)
    assert list(k.columns) == list(trace.host.columns) + ["host_index"]
    assert k.index.tolist() == [0, 1, 2]
    assert trace.host.loc[k["host_index"], "name"].astype(str).tolist() == k["name"].astype(str).tolist()
