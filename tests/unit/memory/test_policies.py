"""lab_utils.memory.policies: a gradient mismatch at and beyond its tolerance (per dtype, relative to
the gradient without checkpointing), the parameter dtype of a step, the peak above what was live
before (a synthetic function whose allocations are known, on the CPU's profiler and on a fake CUDA
allocator), the timing method and progress of a comparison, every figure of the step's batch 1,
offload marked as not acting on a CPU, and the policies compared on tests/unit/step/tiny.py's step,
whose blocks and saved bytes are known by construction; a policy's gradients against torch.autograd's
on batch 1 (nothing left behind), and the blocks treated counted by a step's own seam or from outside."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from lab_utils.memory import policies as P
from lab_utils.step.contract import StepFactory
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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "complex64"])
def test_a_half_precision_gradient_may_differ_by_two_hundredths_plus_two_percent(dtype):
    # |got - ref| <= 0.02 + 0.02 * |ref| (an unknown dtype: half precision's tolerance)
    ref = {"w": torch.tensor([1.0, 0.0, -50.0])}
    assert P.grad_mismatch(ref, {"w": torch.tensor([1.039, 0.0199, -50.0 - 1.019])}, dtype) == []
    for off in ([1.041, 0.0, -50.0], [1.0, 0.021, -50.0], [1.0, 0.0, -51.03]):
        assert P.grad_mismatch(ref, {"w": torch.tensor(off)}, dtype) == ["w"], off


def test_the_tolerance_is_relative_to_the_gradient_without_checkpointing():
    # 98 -> 100 is 2.04% of the reference (beyond), 100 -> 98 is 2% (within): the reference is no checkpointing
    assert P.grad_mismatch({"w": torch.tensor([98.0])}, {"w": torch.tensor([100.0])}, "bfloat16") == ["w"]
    assert P.grad_mismatch({"w": torch.tensor([100.0])}, {"w": torch.tensor([98.0])}, "bfloat16") == []
    atol, rtol = P.GRAD_TOL["float32"]
    assert (atol, rtol) == (1e-6, 1e-5)
    assert P.grad_mismatch({"w": torch.tensor([0.0])}, {"w": torch.tensor([0.9e-6])}) == []
    assert P.grad_mismatch({"w": torch.tensor([0.0])}, {"w": torch.tensor([1.2e-6])}) == ["w"]  # atol alone at 0


def test_the_parameter_dtype_of_a_step():
    step = tiny_step()
    assert P.param_dtype(step) == "float32"
    step.model.to(torch.bfloat16)
    assert P.param_dtype(step) == "bfloat16"
    step.model = torch.nn.ReLU()  # no parameters: float32
    assert P.param_dtype(step) == "float32"


def test_the_peak_on_a_gpu_is_the_allocators_above_what_was_live(monkeypatch):
    # a fake CUDA allocator: 1,000 bytes live before; fn allocates 700, frees 300 (peak 1,700)
    mem = {"now": 1000, "peak": 1000}

    def alloc(n):
        mem["now"] += n
        mem["peak"] = max(mem["peak"], mem["now"])

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: mem["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mem["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: mem.update(peak=mem["now"]))
    mem["peak"] = 5000  # an earlier peak: reset before fn runs
    assert P.excursion(lambda: (alloc(700), alloc(-300)), torch.device("cuda")) == (700, 400)
    assert P.peak_above(lambda: alloc(-400), torch.device("cuda")) == 0  # frees only: nothing above


def test_the_policies_timings_method_and_progress(monkeypatch):
    calls, bars = [], []
    monkeypatch.setattr(P, "try_bench", lambda fn, **kw: calls.append(kw) or "timing")
    real_tqdm = P.tqdm
    monkeypatch.setattr(P, "tqdm", lambda it, **kw: bars.append(kw) or real_tqdm(it, disable=True))
    rows = P.compare_policies(tiny_step(), ["none", "full"], reps=5)
    assert [r.timing for r in rows] == ["timing", "timing"] and bars[0]["disable"] is False  # progress by default
    assert [c["name"] for c in calls] == ["step-none", "step-full"]
    assert all(c["reps"] == 5 and c["retries"] == 0 and c["check_finite"] is False for c in calls)  # CPU: no retries
    monkeypatch.setattr(P, "peak_above", lambda fn, dev: 1)
    monkeypatch.setattr(StepFactory, "device", property(lambda self: torch.device("cuda")))
    calls.clear()
    P.compare_policies(tiny_step(), ["full"], progress=False)
    assert calls[0]["retries"] == 2 and calls[0]["device"] == torch.device("cuda") and bars[-1]["disable"] is True


def test_a_policys_gradients_are_held_to_those_without_checkpointing(monkeypatch):
    # float32: |got - ref| <= 1e-6 + 1e-5 * |ref|. 99,999 -> 100,000 is beyond (the bound is 0.99999),
    # 100,000 -> 99,999 within (1.000001): which side is the reference decides
    def fake(values):
        return lambda step, policy="none", k=1: {"w": torch.tensor([values[policy]])}

    monkeypatch.setattr(P, "grads_of", fake({"none": 99_999.0, "full": 100_000.0}))
    with pytest.raises(AssertionError, match=r"policy 'full': gradients differ from no checkpointing in \['w'\]"):
        P.compare_policies(tiny_step(), ["full"], reps=1, progress=False)
    monkeypatch.setattr(P, "grads_of", fake({"none": 100_000.0, "full": 99_999.0}))
    monkeypatch.setattr(P, "try_bench", lambda fn, **kw: "timing")
    assert [r.policy for r in P.compare_policies(tiny_step(), ["full"], reps=1, progress=False)] == ["full"]


def test_every_figure_of_a_policy_is_of_the_steps_batch_one():
    step = tiny_step()
    step.make_batch = lambda k: torch.ones(k + 1, 8)  # step k's batch has k + 1 rows: batch 1 has two
    (row,) = P.compare_policies(step, ["full"], reps=3, progress=False)
    mm = 2 * 2 * 8 * 8  # one Linear(8, 8) on two rows
    assert row.flops == 27 * mm  # 23 matmuls of the step and each block's first Linear again
    assert row.saved_bytes == 4 * 2 * 8 * 4  # each block's input of two rows (float32)


class CountingSeam:
    """A step's own checkpointing seam (as perflab's MMDiT declares one): under ``applied(p)`` the
    model holds one runner per block ``p`` treats (three double blocks and five single ones),
    and none outside it."""

    names = ("none", "full", "double", "single", "every_other")
    treated = {"full": (3, 5), "double": (3, 0), "single": (0, 5), "every_other": (2, 3)}

    def __init__(self, model):
        self.model, self.applied_with = model, []

    @contextlib.contextmanager
    def applied(self, policy):
        self.applied_with.append(policy)
        d, s = self.treated[policy]
        self.model.block_runners = {
            **{("double", i): None for i in range(d)},
            **{("single", i): None for i in range(s)},
        }
        try:
            yield
        finally:
            self.model.block_runners = {}


@pytest.mark.parametrize("policy, n", [("full", 8), ("double", 3), ("single", 5), ("every_other", 5), ("none", 0)])
def test_a_step_with_its_own_seam_counts_the_blocks_its_seam_treats(policy, n):
    step = tiny_step()
    seam = CountingSeam(step.model)
    step.capabilities = {"policies": seam}
    assert P.treated_blocks(step, policy) == n
    assert seam.applied_with == ([policy] if policy != "none" else [])  # the seam, never the blocks from outside
    assert step.model.block_runners == {} if policy != "none" else not hasattr(step.model, "block_runners")


@pytest.mark.parametrize("policy, n", [("none", 0), ("full", 4), ("every_other", 2), ("selective", 4), ("offload", 4)])
def test_a_step_without_a_seam_counts_the_blocks_the_policy_treats_from_outside(policy, n):
    """Four blocks: every policy that does something treats each of them, every_other blocks 0 and 2."""
    assert P.treated_blocks(tiny_step(), policy) == n


@pytest.mark.parametrize("policy", ["none", "full"])
def test_a_policys_gradients_are_step_ones_and_leave_nothing_behind(policy):
    """Gradients of the step's batch 1 by default (of batch k when asked), computed here apart by
    torch.autograd.grad on a copy of the model; gradients left from before do not leak in, and
    none is left after (weights and optimizer untouched)."""
    step = tiny_step()
    ref_model = copy.deepcopy(step.model)
    for p in step.model.parameters():
        p.grad = torch.full_like(p, 7.0)  # left over from an earlier step

    def by_hand(k):
        params = dict(ref_model.named_parameters())
        g = torch.autograd.grad(step.loss(ref_model, step.make_batch(k)), list(params.values()))
        return dict(zip(params, g, strict=True))

    weights = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    got = P.grads_of(step, policy)
    want = by_hand(1)
    assert set(got) == set(want) and all(torch.allclose(got[n], want[n], atol=1e-6, rtol=1e-5) for n in want)
    assert not all(torch.allclose(want[n], by_hand(0)[n]) for n in want)  # batch 0 would differ
    assert all(p.grad is None for p in step.model.parameters())
    assert all(torch.equal(p, weights[n]) for n, p in step.model.named_parameters())
    got3 = P.grads_of(step, policy, k=3)
    assert all(torch.allclose(got3[n], by_hand(3)[n], atol=1e-6, rtol=1e-5) for n in want)


def test_offload_compared_on_a_cpu_is_measured_and_marked_as_not_acting(monkeypatch):
    monkeypatch.setattr(P, "try_bench", lambda fn, **kw: "timing")
    rows = {r.policy: r for r in P.compare_policies(tiny_step(), ["offload", "full"], progress=False)}
    assert not rows["offload"].acts_here and rows["full"].acts_here
    assert rows["offload"].blocks == 4 and rows["offload"].grads_equal
    assert rows["offload"].flops == 23 * 2 * 2 * 8 * 8  # nothing recomputed: the step's own 23 matmuls
