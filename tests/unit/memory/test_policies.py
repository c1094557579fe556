"""lab_utils.memory.policies: a gradient mismatch at and beyond its tolerance, the peak above what
was live before (a synthetic function whose allocations are known), offload marked as not acting on
a CPU, and the policies compared on tests/unit/step/tiny.py's step, whose blocks and saved bytes are
known by construction."""

from __future__ import annotations

import torch

from lab_utils.memory import policies as P
from unit.step.tiny import ACT, tiny_step


def test_a_gradient_mismatch_at_and_beyond_the_tolerance():
    atol, rtol = P.GRAD_TOL["float32"]
    ref = {"w": torch.ones(3), "b": torch.zeros(2)}
    at = {"w": torch.ones(3) * (1 + rtol) + atol * 0.5, "b": torch.zeros(2)}
    assert P.grad_mismatch(ref, at) == []
    assert P.grad_mismatch(ref, {"w": torch.ones(3) + 1e-3, "b": torch.zeros(2)}) == ["w"]
    assert P.grad_mismatch(ref, {"w": torch.ones(3), "c": torch.zeros(2)}) == ["b", "c"]  # on one side only
    loose = {"w": torch.ones(3) + 1e-2, "b": torch.zeros(2)}  # inside bfloat16's tolerance, not float32's
    assert P.grad_mismatch(ref, loose, "bfloat16") == [] and P.grad_mismatch(ref, loose, "float32") == ["w"]


def test_the_peak_is_above_what_was_live_before_and_what_is_left_is_counted():
    keep = torch.zeros(10_000)  # live before: not counted
    held = []

    def fn():
        a = torch.empty(1000)  # 4,000 bytes
        b = torch.empty(500)  # 6,000 bytes live at once
        del a, b
        torch.empty(250)  # 1,000 bytes after both are freed
        held.append(torch.empty(100))  # 400 bytes still held when it returns

    assert P.excursion(fn, torch.device("cpu")) == (6000, 400) and keep.numel() == 10_000
    assert P.peak_above(lambda: torch.empty(25), torch.device("cpu")) == 100


def test_offload_does_not_act_on_a_cpu_and_says_so():
    assert not P.acts_on("offload", "cpu") and P.acts_on("offload", "cuda") and P.acts_on("full", "cpu")
    assert "moves nothing" in P.saved_means("offload", torch.device("cpu"))
    assert "host memory" in P.saved_means("offload", torch.device("cuda"))
    assert P.saved_means("full", torch.device("cpu")).startswith("kept for the backward")


def test_policies_compared_on_one_step():
    rows = {r.policy: r for r in P.compare_policies(tiny_step(), ["none", "every_other", "full"], reps=3,
                                                    progress=False)}  # fmt: skip
    assert {p: r.blocks for p, r in rows.items()} == {"none": 0, "every_other": 2, "full": 4}
    assert {p: r.saved_bytes for p, r in rows.items()} == {"none": 8 * ACT, "every_other": 6 * ACT, "full": 4 * ACT}
    assert all(r.grads_equal and r.acts_here and r.peak_bytes > 0 for r in rows.values())
    # recompute: non-reentrant checkpointing stops once the tensors the backward needs are back, so
    # each checkpointed block runs its first Linear again (for the ReLU's output), not its second
    mm = 2 * 2 * 8 * 8  # one Linear(8, 8) on 2 rows
    assert rows["none"].flops == 23 * mm  # 8 forward, 8 weight-gradient and 7 input-gradient matmuls
    assert rows["full"].flops - rows["none"].flops == 4 * mm
    assert rows["every_other"].flops - rows["none"].flops == 2 * mm


def test_a_policy_whose_gradients_differ_is_refused(monkeypatch):
    real = P.grads_of

    def wrong(step, policy="none", k=1):
        g = real(step, policy, k)
        if policy == "full":
            g["blocks.0.a.weight"] = g["blocks.0.a.weight"] * 1.01
        return g

    monkeypatch.setattr(P, "grads_of", wrong)
    try:
        P.compare_policies(tiny_step(), ["none", "full"], reps=3, progress=False)
    except AssertionError as e:
        assert "policy 'full'" in str(e) and "blocks.0.a.weight" in str(e)
    else:
        raise AssertionError("a policy with wrong gradients was not refused")
