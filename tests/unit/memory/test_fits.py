"""What fits, right: a step's predicted peak (its state plus the larger of the forward + backward and
the optimizer step above it, each byte counted once) equals its whole step's peak, and the largest
batch that fits a device equals a bisection written here over whole steps measured independently
(the allocator's events around a step this test runs itself); a step that runs out of memory does
not fit; past the largest batch tried the answer is read off a line through the measured peaks."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._pytree import tree_leaves

from lab_utils import memory as mem
from lab_utils.core.config import ConfigError
from lab_utils.core.noise import quiet_stderr_fd
from lab_utils.step.contract import StepFactory
from lab_utils.step.load import load_step

MODELS = {"pixart": "pixart_step:pixart_step", "flux": "lab_utils.step.examples:flux_step"}


def independent_peak(step: StepFactory) -> int:
    """The peak of a whole training step, written apart from lab_utils.memory: after a warm step
    (the optimizer's state exists), the bytes of the parameters and of the optimizer's tensors plus
    the highest running sum of the allocator's events over batch 1's make-forward-backward-update."""
    step.loss(step.model, step.make_batch(0)).backward()
    step.optimizer.step()
    step.optimizer.zero_grad(set_to_none=True)
    held = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in step.model.parameters()}
    for st in step.optimizer.state.values():
        held.update(
            {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tree_leaves(st) if torch.is_tensor(t)}
        )
    with (
        quiet_stderr_fd(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        batch = step.make_batch(1)
        loss = step.loss(step.model, batch)
        loss.backward()
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)
    live = top = 0
    for _, n in sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    ):
        live += n
        top = max(top, live)
    return sum(held.values()) + top


@pytest.fixture(scope="module")
def steps():
    """The PixArt-style step at batch 1 (loaded, checked) and its independent peaks at batch 1..4."""
    step = load_step(MODELS["pixart"], batch_size=1)
    peaks = {b: independent_peak(step.rebuild(batch_size=b)) for b in range(1, 5)}
    print("pixart", peaks)
    return "pixart", step, peaks


def their_bisection(peaks: dict[int, int], cap: int) -> int:
    fit = [b for b, p in peaks.items() if p <= cap]
    return max(fit) if fit else 0


@pytest.mark.parametrize("name", list(MODELS))
def test_the_predicted_peak_is_the_whole_steps(name):
    step = load_step(MODELS[name], batch_size=1)
    for b in (1, 3):
        s = step.rebuild(batch_size=b)
        s.loss(s.model, s.make_batch(0)).backward()
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        m = mem.step_memory(s)
        whole = mem.whole_step_peak(s)
        assert m.peak == whole, (name, b, m, whole)
        assert "+0 B" in mem.check_prediction(m, whole)
        # the gradients are counted once: adding them to the backward's peak overshoots the step
        assert m.state + m.gradients + m.forward_backward > whole
        assert m.after_backward >= m.gradients + m.batch  # the optimizer step holds them


@pytest.mark.parametrize("where, b", [("between", 1), ("between", 3), ("at", 2)])
def test_what_fits_equals_an_independent_whole_step_bisection(steps, where, b):
    name, step, peaks = steps
    assert all(peaks[i] < peaks[i + 1] for i in range(1, 4))
    cap = (peaks[b] + peaks[b + 1]) // 2 if where == "between" else peaks[b]  # "at": fits exactly
    fit = mem.fits_bisect(step, cap, max_batch=4)
    assert fit.batch == their_bisection(peaks, cap) == b, (name, where, b, fit.tried)
    assert fit.whole == peaks[b], (fit.whole, peaks[b])


def test_not_even_one_sample_fits_below_the_first_peak(steps):
    _, step, peaks = steps
    assert mem.fits_bisect(step, peaks[1] - 1, max_batch=4, check=False).batch == 0


def test_past_the_largest_batch_tried_the_line_through_the_peaks_answers(steps):
    name, step, peaks = steps
    device = 10 * peaks[4]
    fit = mem.fits_bisect(step, device, max_batch=4, check=False)
    assert fit.capped and fit.batch == 4
    pts = {b: m.peak for b, m in fit.tried.items() if m is not None}
    assert set(pts) == {1, 2, 4} and pts[4] == peaks[4]  # batch 1, the cap, and its half for the line
    xs, ys = list(pts), list(pts.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    want = math.floor((device - (my - slope * mx)) / slope)
    assert fit.extrapolated == want and want > 4


def oom_step(batch_size: int = 1) -> StepFactory:
    """A step that runs out of memory above 3 samples (as a GPU would)."""
    lin = torch.nn.Linear(8, 8)

    def loss(m, x):
        if x.shape[0] > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return m(x).square().mean()

    return StepFactory(
        lin, torch.optim.SGD(lin.parameters(), lr=0.1),
        lambda k: torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(k)), loss,
    )  # fmt: skip


def test_a_step_out_of_memory_does_not_fit_and_the_bisection_goes_on():
    step = load_step("unit.memory.test_fits:oom_step", batch_size=1)
    fit = mem.fits_bisect(step, 10**12, max_batch=8)
    assert fit.batch == 3 and fit.tried[8] is None and fit.tried[4] is None
    assert fit.whole is not None and fit.tried[3].peak == fit.whole


def test_the_out_of_memory_edge_is_bisected_over_real_steps_and_counts_each_oom():
    """The one out-of-memory bisection: on a step that runs out above 3 samples, real steps of its
    factory (two each) find 3, counting each batch above it that the bisection tries."""
    step = load_step("unit.memory.test_fits:oom_step", batch_size=1)
    assert mem.oom_edge(step, 8) == (3, 1)  # tries 4 (OOM), 2, 3
    assert mem.oom_edge(step, 3) == (3, 0) and mem.oom_edge(step, 0) == (0, 0)
    tried = []

    def trial(b):
        tried.append(b)
        if b > 6:
            raise torch.OutOfMemoryError("test")

    assert mem.fits.oom_bisect(trial, 10) == (6, 2) and tried == [5, 8, 6, 7]


def test_the_device_is_named_by_gigabytes_or_gpu():
    assert mem.device_memory("H100")[0] == 80 * 10**9 and mem.device_memory("h200")[0] == 141 * 10**9
    # a part by its exact name (the datasheet's memory), a family by its first part, the others named
    assert mem.device_memory("H100 NVL") == (94 * 10**9, "H100 NVL, 94 GB (its datasheet)")
    assert mem.device_memory("A100 PCIe 40GB")[0] == 40 * 10**9 and mem.device_memory("B200")[0] == 180 * 10**9
    assert "assumed for 'H100', also H100 NVL 94 GB" in mem.device_memory("H100")[1]
    assert mem.device_memory(0.012)[0] == 12_000_000 and "given" in mem.device_memory(0.012)[1]
    if not torch.cuda.is_available():
        assert mem.device_memory(0.0) == (141 * 10**9, "an H200, 141 GB (no GPU here: name one with device_memory_gb)")
    for bad in ("H300", "RTX 4090", -1.0):
        with pytest.raises(ConfigError) as e:
            mem.device_memory(bad)
        assert e.value.param == "device_memory_gb"


def test_the_state_of_a_step_by_hand():
    """Parameters, gradients of the trainable ones and the optimizer's state, each storage once
    (tests/unit/step/tiny.py: four blocks of two Linear(8, 8), float32)."""
    from lab_utils.memory.fits import step_state
    from unit.step.tiny import D, tiny_step

    params = 4 * 2 * (D * D + D) * 4
    step = tiny_step()
    assert step_state(step) == {"parameters": params, "gradients": params, "optimizer": 0}
    step.model(step.make_batch(1)).sum().backward()
    step.optimizer.step()
    # Adam: exp_avg and exp_avg_sq per parameter and a float32 step counter per parameter tensor (16)
    assert step_state(step)["optimizer"] == 2 * params + 16 * 4
    step.model.blocks[0].a.weight.requires_grad_(False)
    assert step_state(step)["gradients"] == params - D * D * 4  # frozen: no gradient
    step.model.blocks[1].a.weight = step.model.blocks[0].a.weight  # tied: one storage, counted once
    assert step_state(step)["parameters"] == params - D * D * 4
