"""lab_utils.step.memory on a step whose every byte is known by construction (tests/unit/step/tiny.py:
four blocks of Linear -> ReLU -> Linear, one activation 64 bytes): the state's bytes (parameters,
gradients of the trainable ones, Adam's two moments and step counters), the saved activations
under no checkpointing, full and every other block, by block and by how they are kept, the peak
above what was live, a gradient mismatch at and beyond its tolerance, and what fits by bisection
over a step whose bytes are a known line."""

from __future__ import annotations

import pytest
import torch

from lab_utils.core.config import ConfigError
from lab_utils.step import memory as M

from .tiny import ACT, D, tiny_step

PARAM_BYTES = 4 * 2 * (D * D + D) * 4  # four blocks, two Linear(8, 8) each, float32


def test_state_bytes_by_hand():
    step = tiny_step()
    assert M.state_bytes(step) == {"parameters": PARAM_BYTES, "gradients": PARAM_BYTES, "optimizer": 0}
    step.model(step.make_batch(1)).sum().backward()
    step.optimizer.step()
    # Adam: exp_avg and exp_avg_sq per parameter, and a float32 step counter per parameter tensor (16)
    assert M.state_bytes(step)["optimizer"] == 2 * PARAM_BYTES + 16 * 4
    step.model.blocks[0].a.weight.requires_grad_(False)
    assert M.state_bytes(step)["gradients"] == PARAM_BYTES - D * D * 4  # frozen: no gradient
    step.model.blocks[1].a.weight = step.model.blocks[0].a.weight  # tied: one storage, counted once
    assert M.state_bytes(step)["parameters"] == PARAM_BYTES - D * D * 4


def test_saved_activations_under_no_full_and_every_other_checkpointing():
    step = tiny_step()
    # no checkpointing: per block its input (saved by the first Linear) and the ReLU's output (by the
    # ReLU and the second Linear, one storage); the last block's output is not saved (sum)
    none = M.measure_saved(step, "none")
    assert none.total == 8 * ACT and len(none.rows) == 8
    assert none.by("region") == {"input": ACT, "blocks.0": 2 * ACT, "blocks.1": 2 * ACT, "blocks.2": 2 * ACT,
                                 "blocks.3": ACT}  # fmt: skip
    assert none.by("how") == {"saved": 8 * ACT}
    assert set(none.frame()["shape"]) == {(2, D)} and set(none.frame()["dtype"]) == {"float32"}
    # full: only each block's input is kept (the batch and three block outputs; non-reentrant
    # checkpoint saves them through autograd's hooks, so they count once, as saved)
    full = M.measure_saved(step, "full")
    assert full.total == 4 * ACT and len(full.rows) == 4
    assert full.by("region") == {"input": ACT, "blocks.0": ACT, "blocks.1": ACT, "blocks.2": ACT}
    # every other (blocks 0 and 2): 0 and 2 keep their input, 1 and 3 save input and ReLU output
    half = M.measure_saved(step, "every_other")
    assert half.total == 6 * ACT
    assert half.by("region") == {"input": ACT, "blocks.0": ACT, "blocks.1": 2 * ACT, "blocks.2": ACT,
                                 "blocks.3": ACT}  # fmt: skip
    assert half.by("region", "op")[("blocks.1", "relu")] == ACT


def test_saved_bytes_are_of_the_step_asked_for():
    step = tiny_step()
    step.make_batch = lambda k: torch.ones(k + 1, D)  # step k's batch has k + 1 rows (a bucketed loader)
    row = D * 4
    assert M.measure_saved(step).total == 8 * 2 * row  # step 1 by default: two rows
    assert M.measure_saved(step, "none", k=3).total == 8 * 4 * row


def test_a_gradient_mismatch_at_and_beyond_the_tolerance():
    ref = {"w": torch.ones(3), "b": torch.zeros(2)}
    at = {"w": torch.ones(3) * (1 + M.GRAD_RTOL) + M.GRAD_ATOL * 0.5, "b": torch.zeros(2)}
    assert M.grad_mismatch(ref, at) == []
    assert M.grad_mismatch(ref, {"w": torch.ones(3) + 1e-3, "b": torch.zeros(2)}) == ["w"]
    assert M.grad_mismatch(ref, {"w": torch.ones(3), "c": torch.zeros(2)}) == ["b", "c"]  # missing on either side


def test_the_peak_is_above_what_was_live_before():
    keep = torch.zeros(10_000)  # live before: not counted

    def fn():
        a = torch.empty(1000)  # 4,000 bytes
        b = torch.empty(500)  # 6,000 bytes live at once
        del a, b
        torch.empty(250)  # 1,000 bytes after both are freed

    assert M.step_peak(fn, torch.device("cpu")) == 6000 and keep.numel() == 10_000


def line(per_batch: int, fixed: int = 0):
    def step_bytes(build, b, policy):
        return fixed + per_batch * b

    return step_bytes


@pytest.mark.parametrize(
    "device_bytes, max_batch, batch",
    [(350, 64, 3), (300, 64, 3), (299, 64, 2), (100, 64, 1), (99, 64, 0), (6400, 64, 64), (10**9, 5, 5),
     (500, 1, 1)],
)  # fmt: skip
def test_what_fits_is_the_largest_batch_at_or_under_the_device(monkeypatch, device_bytes, max_batch, batch):
    monkeypatch.setattr(M, "step_bytes", line(100))
    got = M.fits_bisect(None, device_bytes, max_batch=max_batch, policy="full")
    assert got["batch"] == batch and got["policy"] == "full" and got["device_bytes"] == device_bytes
    assert all(v == 100 * b for b, v in got["tried"].items()) and 1 in got["tried"]
    if 1 < batch < max_batch:
        assert batch in got["tried"] and batch + 1 in got["tried"]  # the boundary measured on both sides


def test_what_fits_refuses_a_batch_below_one():
    with pytest.raises(ConfigError, match="max_batch"):
        M.fits_bisect(None, 100, max_batch=0)


def test_step_bytes_is_the_state_after_a_step_and_the_peak(monkeypatch):
    monkeypatch.setattr(M, "step_peak", lambda fn, dev: (fn(), 1000)[1])
    got = M.step_bytes(lambda b: tiny_step(batch=b), 3, "full")
    assert got == PARAM_BYTES + PARAM_BYTES + (2 * PARAM_BYTES + 16 * 4) + 1000


def test_policies_compared_on_one_step():
    df = M.compare_policies(tiny_step(), ["none", "every_other", "full"], reps=3, progress=False).set_index("policy")
    assert df["blocks"].to_dict() == {"none": 0, "every_other": 2, "full": 4}
    assert df["saved_bytes"].to_dict() == {"none": 8 * ACT, "every_other": 6 * ACT, "full": 4 * ACT}
    assert df["grads_equal"].all() and (df["peak_bytes"] > 0).all()
