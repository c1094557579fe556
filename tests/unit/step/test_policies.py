"""lab_utils.step.policies: which blocks each policy treats (every_other: 0, 2, 4 ...), that a
block's forward is wrapped only inside :func:`applied` and restored after (an instance's own
``forward`` kept), what a checkpointed block keeps (its inputs, one entry per treated block),
what selective checkpointing saves (every matmul output, counted on a step of known bytes), a
forward without grad left alone, and the policy named when it is not one of the choices."""

from __future__ import annotations

import pytest
import torch

from lab_utils.core.config import ConfigError
from lab_utils.step.contract import blocks
from lab_utils.step.memory import measure_saved
from lab_utils.step.policies import STEP_POLICIES, applied, treated

from .tiny import ACT, tiny_step


@pytest.mark.parametrize(
    "policy, want",
    [("none", []), ("full", [0, 1, 2, 3, 4]), ("every_other", [0, 2, 4]), ("selective", [0, 1, 2, 3, 4]),
     ("save_matmul", [0, 1, 2, 3, 4]), ("save_attention", [0, 1, 2, 3, 4]), ("offload", [0, 1, 2, 3, 4])],
)  # fmt: skip
def test_which_blocks_a_policy_treats(policy, want):
    assert [i for i in range(5) if treated(policy, i)] == want


def test_every_policy_is_in_the_table_and_others_are_refused():
    assert set(STEP_POLICIES) == {"none", "full", "every_other", "selective", "save_matmul", "save_attention",
                                  "offload"}  # fmt: skip
    with pytest.raises(ConfigError, match="policy"):
        treated("half", 0)
    with pytest.raises(ConfigError, match="policy"), applied([], "half"):
        pass


def test_forwards_are_wrapped_inside_and_restored_after():
    step = tiny_step()
    bl = blocks(step)
    assert [n for n, _ in bl] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    own = bl[1][1].forward = lambda x: x  # an instance's own forward (a patched block)
    with applied(bl, "every_other") as kept:
        assert ["forward" in m.__dict__ for _, m in bl] == [True, True, True, False]
        assert bl[1][1].forward is own  # block 1 is not treated: its own forward untouched
        x = step.make_batch(1)
        step.model(x)
    assert ["forward" in m.__dict__ for _, m in bl] == [False, True, False, False] and bl[1][1].forward is own
    # the two treated blocks kept their inputs: the batch, then block 1's output (the identity: block 0's)
    assert [n for n, _ in kept.inputs] == ["blocks.0", "blocks.2"]
    assert kept.inputs[0][1][0] is x and all(len(ts) == 1 for _, ts in kept.inputs) and kept.caches == []


def test_selective_policies_note_their_caches_and_no_grad_is_left_alone():
    step = tiny_step(n=2)
    bl = blocks(step)
    with applied(bl, "selective") as kept:
        step.model(step.make_batch(1)).sum().backward()
    assert [n for n, _ in kept.caches] == ["blocks.0", "blocks.1"] and len(kept.inputs) == 2
    with torch.no_grad(), applied(bl, "full") as kept:
        step.model(step.make_batch(1))
    assert kept.inputs == [] and kept.caches == []  # nothing is kept for a backward that never comes
    with applied(bl, "none") as kept:
        step.model(step.make_batch(1))
    assert kept.inputs == [] and all("forward" not in m.__dict__ for _, m in bl)


@pytest.mark.parametrize("policy", STEP_POLICIES)
def test_every_policy_gives_the_gradients_of_no_checkpointing(policy):
    step = tiny_step(n=3)
    bl = blocks(step)

    def grads(pol):
        step.model.zero_grad(set_to_none=True)
        with applied(bl, pol):
            step.model(step.make_batch(2)).sum().backward()
        return [p.grad.clone() for p in step.model.parameters()]

    for a, b in zip(grads("none"), grads(policy)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("policy", ["selective", "save_matmul"])
def test_selective_checkpointing_keeps_every_matmul_output(policy):
    # each block's input (4) and both Linear outputs of every block (8), of which three block outputs
    # are the next block's input: x, a0, b0, a1, b1, a2, b2, a3, b3; the ReLU is recomputed
    p = measure_saved(tiny_step(), policy)
    assert p.total == 9 * ACT and p.by("op") == {"input": ACT, "addmm": 8 * ACT}
    assert p.by("how") == {"saved": 4 * ACT, "selective_cache": 5 * ACT}


def test_saving_attention_in_a_step_without_attention_keeps_what_full_keeps():
    assert measure_saved(tiny_step(), "save_attention").total == measure_saved(tiny_step(), "full").total == 4 * ACT
