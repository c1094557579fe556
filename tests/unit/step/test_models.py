"""The measurements of labs 05 and 07 on models no one here wrote (diffusers FLUX and SD3,
transformers Llama, at tiny sizes on CPU) and on one written for the tests that is unlike the
MMDiT (``pixart_step``: cross-attention to text, adaLN-single, no RoPE): saved-activation bytes
equal a second, separately written hook count and the allocator's count of what the forward leaves
alive; gradients under every generic checkpointing policy equal no checkpointing (float32, atol
1e-6) and each policy's saved bytes equal the allocator's count; the NaN locator names the module a
NaN is injected into, forward and backward."""

from __future__ import annotations

import pytest
import torch

from lab_utils import memory as mem
from lab_utils.core.noise import quiet_stderr_fd
from lab_utils.model.checkpointing import GENERIC_POLICIES
from lab_utils.stability.training import locate
from lab_utils.step.contract import blocks
from lab_utils.step.load import load_step

MODELS = {
    "flux": "lab_utils.step.examples:flux_step",
    "sd3": "lab_utils.step.examples:sd3_step",
    "llama": "lab_utils.step.examples:llama_step",
    "pixart": "pixart_step:pixart_step",
}
#: Where the test injects a NaN: a block, and a linear layer inside the last block.
INJECT = {
    "flux": ["transformer_blocks.0", "single_transformer_blocks.1.proj_out"],
    "sd3": ["transformer_blocks.0", "transformer_blocks.1.ff.net.2"],  # the last block's first output is None
    "llama": ["model.layers.0", "model.layers.1.mlp.down_proj"],
    "pixart": ["blocks.0", "blocks.2.cross.kv"],
}
BLOCKS = {
    "flux": [f"transformer_blocks.{i}" for i in range(2)] + [f"single_transformer_blocks.{i}" for i in range(2)],
    "sd3": ["transformer_blocks.0", "transformer_blocks.1"],
    "llama": ["model.layers.0", "model.layers.1"],
    "pixart": ["blocks.0", "blocks.1", "blocks.2"],
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_step(request):
    print(f"seed 0 (factories are seeded), model {request.param}")
    return request.param, load_step(MODELS[request.param])


@pytest.fixture(scope="module")
def reference(model_step):
    """No checkpointing: the gradients and the saved bytes every policy is held to."""
    _, step = model_step
    return mem.grads_of(step, "none"), mem.measure_saved(step, "none").total


def hook_count(step, k: int = 1) -> tuple[int, int]:
    """Written apart from lab_utils.memory: the saved storages of one forward, keyed by their
    data pointer, parameters and buffers left out; (bytes, count)."""
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


#: torch.utils.checkpoint keeps the CPU generator's state per recomputed block (host memory, not a
#: saved activation: the probe leaves it out, the allocator on a CPU sees it)
RNG_STATE = torch.get_rng_state().untyped_storage().nbytes()


def left_alive(step, policy: str, k: int = 1) -> int:
    """The allocator's count, written apart: the bytes a forward under ``policy`` allocates and
    does not free (what the graph keeps for the backward; the loss left out), from the profiler's
    allocation events; the batch is made before (it is the probe's region "input")."""
    batch = step.make_batch(k)
    held = []
    with (
        quiet_stderr_fd(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof,
        mem.policy_applied(step, policy),
    ):
        held.append(step.loss(step.model, batch))
    events = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    loss_bytes = held[0].untyped_storage().nbytes()
    return sum(events) - loss_bytes


def test_blocks_are_detected_from_repeated_children(model_step):
    name, step = model_step
    assert [n for n, _ in blocks(step)] == BLOCKS[name]


def test_saved_bytes_equal_a_separate_hook_count_and_the_allocators(model_step):
    name, step = model_step
    probe = mem.measure_saved(step, "none")
    total, n = hook_count(step)
    assert probe.total == total and len(probe.tensors) == n, (name, probe.total, total)
    assert probe.total > 0
    alive = left_alive(step, "none")
    assert alive == probe.total - probe.by_region().get("input", 0), (name, alive, probe.total)
    by_region = probe.by_region()
    for b in BLOCKS[name]:  # every block keeps something, and the module tree names it
        assert by_region.get(b, 0) > 0, (b, by_region)
    assert sum(by_region.values()) == probe.total
    assert all(op for op in probe.frame().op)


@pytest.mark.parametrize("policy", [p for p in GENERIC_POLICIES if p != "none"])
def test_every_generic_policy_keeps_the_gradients_and_saves_what_the_allocator_counts(model_step, reference, policy):
    name, step = model_step
    ref, none = reference
    got = mem.grads_of(step, policy)
    assert set(got) == set(ref) and len(ref) == sum(1 for p in step.model.parameters() if p.requires_grad)
    for k in ref:
        diff = float((got[k] - ref[k]).abs().max())
        assert torch.allclose(got[k], ref[k], atol=1e-6, rtol=0), f"{name} {policy} {k}: max |diff| {diff}"
    probe = mem.measure_saved(step, policy)
    saved = probe.total
    assert saved < none, f"{name}: policy {policy} saves {saved} bytes, no checkpointing {none}"
    if policy != "offload":  # on a CPU save_on_cpu keeps its tensors where they are: nothing moves
        alive = left_alive(step, policy)
        rng = mem.treated_blocks(step, policy) * RNG_STATE
        assert alive == saved - probe.by_region().get("input", 0) + rng, (name, policy, alive, saved)


def test_offload_on_a_cpu_is_measured_and_marked_as_not_acting(model_step):
    name, step = model_step
    none, off = mem.compare_policies(step, ["none", "offload"], reps=3, progress=False)
    assert none.acts_here and not off.acts_here
    assert off.peak_bytes >= 0.95 * none.peak_bytes, (name, off.peak_bytes, none.peak_bytes)  # nothing freed


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


def test_state_bytes_come_from_the_step(model_step):
    name, step = model_step
    sb = mem.step_state(step)
    n = sum(p.numel() for p in step.model.parameters())
    assert sb["parameters"] == 4 * n and sb["gradients"] == 4 * n
    # AdamW after one step: exp_avg and exp_avg_sq per parameter (float32) + a step counter each
    counters = sum(1 for p in step.model.parameters() if p.requires_grad)
    assert sb["optimizer"] == 8 * n + 4 * counters, (name, sb, n)
