"""The generic measurements on models no one here wrote (diffusers FLUX and SD3, transformers
Llama, at tiny sizes on CPU): saved-activation bytes equal a second, separately written hook
count; gradients under every checkpointing policy equal no checkpointing (float32, atol
1e-6); the NaN locator names the module a NaN is injected into, forward and backward."""

from __future__ import annotations

import pytest
import torch

from lab_utils.step.contract import blocks
from lab_utils.step.load import load_step
from lab_utils.step.memory import grads_of, measure_saved, state_bytes
from lab_utils.step.policies import STEP_POLICIES
from lab_utils.step.stability import locate

MODELS = {
    "flux": "lab_utils.step.examples:flux_step",
    "sd3": "lab_utils.step.examples:sd3_step",
    "llama": "lab_utils.step.examples:llama_step",
}
#: Where the test injects a NaN: a block, and a linear layer inside the last block.
INJECT = {
    "flux": ["transformer_blocks.0", "single_transformer_blocks.1.proj_out"],
    "sd3": ["transformer_blocks.0", "transformer_blocks.1.ff.net.2"],  # the last block's first output is None
    "llama": ["model.layers.0", "model.layers.1.mlp.down_proj"],
}
BLOCKS = {
    "flux": [f"transformer_blocks.{i}" for i in range(2)] + [f"single_transformer_blocks.{i}" for i in range(2)],
    "sd3": ["transformer_blocks.0", "transformer_blocks.1"],
    "llama": ["model.layers.0", "model.layers.1"],
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_step(request):
    print(f"seed 0 (factories are seeded), model {request.param}")
    return request.param, load_step(MODELS[request.param])


@pytest.fixture(scope="module")
def reference(model_step):
    """No checkpointing: the gradients and the saved bytes every policy is held to."""
    _, step = model_step
    return grads_of(step, "none"), measure_saved(step, "none").total


def hook_count(step, k: int = 1) -> tuple[int, int]:
    """Written apart from lab_utils.step.memory: the saved storages of one forward, keyed by
    their data pointer, parameters and buffers left out; (bytes, count)."""
    own = {t.untyped_storage().data_ptr() for t in list(step.model.parameters()) + list(step.model.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            seen[s.data_ptr()] = s.nbytes()
        return t

    batch = step.make_batch(k)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step.loss(step.model, batch)
    del loss
    return sum(seen.values()), len(seen)


def test_blocks_are_detected_from_repeated_children(model_step):
    name, step = model_step
    assert [n for n, _ in blocks(step)] == BLOCKS[name]


def test_saved_bytes_equal_a_separate_hook_count(model_step):
    name, step = model_step
    probe = measure_saved(step, "none")
    total, n = hook_count(step)
    assert probe.total == total and len(probe.rows) == n, (name, probe.total, total)
    assert probe.total > 0
    by_region = probe.by("region")
    for b in BLOCKS[name]:  # every block keeps something, and the module tree names it
        assert by_region.get(b, 0) > 0, (b, by_region)
    assert sum(by_region.values()) == probe.total
    assert all(op for op in probe.frame().op)


@pytest.mark.parametrize("policy", [p for p in STEP_POLICIES if p != "none"])
def test_gradients_under_every_policy_equal_no_checkpointing(model_step, reference, policy):
    name, step = model_step
    ref, none = reference
    got = grads_of(step, policy)
    assert set(got) == set(ref) and len(ref) == sum(1 for p in step.model.parameters() if p.requires_grad)
    for k in ref:
        diff = float((got[k] - ref[k]).abs().max())
        assert torch.allclose(got[k], ref[k], atol=1e-6, rtol=0), f"{name} {policy} {k}: max |diff| {diff}"
    saved = measure_saved(step, policy).total
    assert saved < none, f"{name}: policy {policy} saves {saved} bytes, no checkpointing {none}"


@pytest.mark.parametrize("where", [0, 1])
def test_the_nan_locator_names_the_injected_module_forward_and_backward(model_step, where):
    name, step = model_step
    module = INJECT[name][where]
    fwd, _ = locate(step, 1, module=module, phase="forward")
    assert fwd is not None and fwd.module == module and fwd.phase == "forward", fwd
    assert fwd.nan >= 1
    f2, bwd = locate(step, 1, module=module, phase="backward")
    assert f2 is None, f2  # a backward injection leaves the forward finite
    assert bwd is not None and (bwd.module == module or bwd.module.startswith(module + ".")), bwd


def test_the_nan_locator_names_nothing_in_a_clean_step(model_step):
    assert locate(model_step[1], 1) == (None, None)


def test_state_bytes_come_from_the_optimizer(model_step):
    name, step = model_step
    sb = state_bytes(step)
    n = sum(p.numel() for p in step.model.parameters())
    assert sb["parameters"] == 4 * n and sb["gradients"] == 4 * n
    # AdamW after one step: exp_avg and exp_avg_sq per parameter (float32) + a step counter each
    counters = sum(1 for p in step.model.parameters() if p.requires_grad)
    assert sb["optimizer"] == 8 * n + 4 * counters, (name, sb, n)
