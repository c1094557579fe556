"""lab_utils.memory.saved on a step whose every byte is known by construction (tests/unit/step/tiny.py:
four blocks of Linear -> ReLU -> Linear on a batch of two rows, one activation 64 bytes): the
activations kept for the backward under no checkpointing, full and every other block, by block, by
op and by how they are kept, a selective policy's cached outputs counted once, the region among the
blocks asked for and without creators, a backward under the probe equal to one without it, at the
batch of the step asked for, the MMDiT's bytes against its analytic formula, and the policies a
step takes."""

from __future__ import annotations

import pytest
import torch

from lab_utils.core.config import ConfigError
from lab_utils.memory import saved as S
from lab_utils.memory.formula import StepShape, saved_bytes_formula
from lab_utils.model import resolve_config
from unit.step.tiny import ACT, D, tiny_step


def test_no_checkpointing_keeps_each_blocks_input_and_relu_output():
    # per block its input (saved by the first Linear) and the ReLU's output (by the ReLU and the
    # second Linear: one storage, counted once); the last block's output is not saved (sum)
    none = S.measure_saved(tiny_step(), "none")
    assert none.total == 8 * ACT and len(none.tensors) == 8
    assert none.by("region") == {"input": ACT, "blocks.0": 2 * ACT, "blocks.1": 2 * ACT, "blocks.2": 2 * ACT,
                                 "blocks.3": ACT}  # fmt: skip
    assert none.by("how") == {"saved": 8 * ACT}
    assert set(none.frame()["shape"]) == {(2, D)} and set(none.frame()["dtype"]) == {"float32"}
    assert S.measure_saved(tiny_step(), None).total == none.total  # None is no policy


def test_full_checkpointing_keeps_only_each_blocks_input():
    # non-reentrant checkpoint saves the block inputs through autograd's hooks: counted once, as saved
    full = S.measure_saved(tiny_step(), "full")
    assert full.total == 4 * ACT and len(full.tensors) == 4
    assert full.by("region") == {"input": ACT, "blocks.0": ACT, "blocks.1": ACT, "blocks.2": ACT}


def test_every_other_block_checkpointed_keeps_both_kinds():
    # blocks 0 and 2 keep their input; 1 and 3 save input and ReLU output
    half = S.measure_saved(tiny_step(), "every_other")
    assert half.total == 6 * ACT
    assert half.by("region") == {"input": ACT, "blocks.0": ACT, "blocks.1": 2 * ACT, "blocks.2": ACT,
                                 "blocks.3": ACT}  # fmt: skip
    assert half.by("region", "op")[("blocks.1", "relu")] == ACT
    assert half.by_op() == half.by("region", "op") and half.by_region() == half.by("region")


def test_saved_bytes_are_of_the_step_asked_for():
    step = tiny_step()
    step.make_batch = lambda k: torch.ones(k + 1, D)  # step k's batch has k + 1 rows (a bucketed loader)
    row = D * 4
    assert S.measure_saved(step).total == 8 * 2 * row  # step 1 by default: two rows
    assert S.measure_saved(step, "none", k=3).total == 8 * 4 * row
    assert S.measure_saved(tiny_step(batch=5), "full").total == 4 * 5 * row


def test_a_storage_is_counted_once_however_many_views_are_saved():
    t = torch.zeros(4, 8)
    assert S.storage_bytes(t[1:3]) == S.storage_bytes(t) == 4 * 8 * 4
    assert S.storage_key(t[1:3]) == S.storage_key(t.view(32)) != S.storage_key(t.clone())


def test_a_step_takes_the_generic_policies_and_refuses_others():
    step = tiny_step()
    assert set(S.policies_of(step)) >= {"none", "full", "every_other"}
    with pytest.raises(ConfigError, match="activation_checkpoint"):
        S.policy_applied(step, "no_such_policy")


def test_a_selective_policy_caches_each_matmul_output_once():
    # each block keeps its input (the checkpoint's, saved) and caches its two Linear outputs; the
    # second Linear's output of blocks 0-2 is the next block's input, already kept: counted once
    sel = S.measure_saved(tiny_step(), "selective")
    assert sel.by("how") == {"saved": 4 * ACT, "selective_cache": 5 * ACT} and sel.total == 9 * ACT
    assert sel.by("region") == {"input": ACT, "blocks.0": 2 * ACT, "blocks.1": 2 * ACT, "blocks.2": 2 * ACT,
                                "blocks.3": 2 * ACT}  # fmt: skip
    assert sel.by("region", "op") == {("input", "input"): ACT, **{(f"blocks.{i}", "addmm"): 2 * ACT for i in range(4)}}


def test_the_bytes_by_any_columns():
    none = S.measure_saved(tiny_step(), "none")
    assert none.by("how", "dtype") == {("saved", "float32"): 8 * ACT}  # several columns: tuples
    assert none.by("bytes") == {ACT: 8 * ACT} and none.by("shape") == {(2, D): 8 * ACT}
    assert S.SavedReport().by("region") == {} and S.SavedReport().total == 0
    assert list(S.SavedReport().frame().columns) == ["region", "module", "op", "how", "bytes", "shape", "dtype"]


def test_the_region_among_the_blocks_asked_for_and_without_creators():
    step = tiny_step()
    batch = step.make_batch(1)
    with S.saved_tensor_probe(step.model) as rep:  # default: the model's repeated blocks
        step.loss(step.model, batch)
    assert rep.by("region") == S.measure_saved(tiny_step(), "none").by("region")
    with S.saved_tensor_probe(step.model, []) as rep:  # no blocks: the top-level child
        step.loss(step.model, batch)
    assert rep.by("region") == {"input": ACT, "blocks": 7 * ACT}
    with S.saved_tensor_probe(step.model, creators=False) as rep:  # the module running when it was saved
        step.loss(step.model, batch)
    # each block's input is saved by its first Linear, the ReLU's output by the block (a functional relu)
    assert rep.by("module") == {m: ACT for i in range(4) for m in (f"blocks.{i}.a", f"blocks.{i}")}
    assert rep.by("region", "op") == {(f"blocks.{i}", "saved"): 2 * ACT for i in range(4)}


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
def test_the_probe_leaves_the_backward_as_it_was(policy):
    ref, probed = tiny_step(), tiny_step()
    ref.loss(ref.model, ref.make_batch(1)).backward()
    with S.policy_applied(probed, policy):
        with S.saved_tensor_probe(probed.model) as rep:
            loss = probed.loss(probed.model, probed.make_batch(1))
        loss.backward()
    assert rep.total > 0
    for a, b in zip(ref.model.parameters(), probed.model.parameters()):
        torch.testing.assert_close(b.grad, a.grad)


def test_a_refused_policy_names_the_ones_allowed():
    with pytest.raises(ConfigError, match=r"activation_checkpoint.*one of 'none', 'full'"):
        S.policy_applied(tiny_step(), "fulll")
    assert S.policy_applied(tiny_step(), "none") is not None


@pytest.mark.parametrize("policy, device", [("none", "cpu"), ("full", "meta")])
def test_the_mmdits_saved_bytes_are_its_analytic_formula_region_by_region(policy, device):
    # a 4 x 5 grid of image tokens (not square), seven text tokens, batch 3; on meta (no memory)
    # attention takes the math path, whose saved tensors are the formula's on CUDA under full
    sh = StepShape(3, 20, 7)
    got = S.mmdit_saved("tiny", sh, "float32", policy, device=device)
    kind = "cuda" if device == "meta" else "cpu"
    assert got.by_region() == saved_bytes_formula(resolve_config("tiny"), sh, "float32", policy, device_type=kind)
    assert got.total == sum(got.by_region().values()) > 0
