"""perflab's MMDiT is one registered step (lab_utils.step.mmdit): built from the lab's own parameters
(the trainer's step for labs 01 and 08, synthetic batches at the lab's shape for 05 and 07), with
every capability declared; the one probe of saved activations on its step equals the analytic
formula region by region under each of its policies (through its own seam), and the one profiler
on its trainer's step has the trainer's phases and its FLOPs."""

from __future__ import annotations

import pytest
import torch

from lab_utils import memory as mem
from lab_utils.model.accounting import forward_flops, training_step_flops
from lab_utils.model.train import PHASES, TrainConfig
from lab_utils.profiling.profiler import profile_step
from lab_utils.step.contract import CAPABILITIES, run_step, same_batch
from lab_utils.step.load import DEFAULT_STEP, load_step
from lab_utils.studies.memory import MemoryLabConfig
from lab_utils.studies.plan import PlanLabConfig
from lab_utils.studies.training_step import TrainingStepLabConfig


@pytest.fixture(scope="module")
def lab05_step():
    cfg = MemoryLabConfig(device="cpu", batch_size=2, resolution=64, txt_len=8)
    return cfg, load_step(DEFAULT_STEP, lab=cfg, batch_size=cfg.batch_size)


def test_the_default_is_the_mmdit_at_the_labs_shape_with_every_capability(lab05_step):
    cfg, step = lab05_step
    assert type(step.model).__name__ == "MMDiT" and step.model.cfg.preset == "tiny"
    assert set(CAPABILITIES) - set(step.capabilities) == {"train_config", "trainer"}  # no trainer at lab 05
    shape = step.capabilities["memory_formula"]
    assert (shape.batch, shape.height, shape.width, shape.txt_len) == (2, 64, 64, 8)
    batch = step.make_batch(1)
    mc = step.model.cfg
    assert batch.img.shape == (2, 16, mc.in_channels) and batch.txt.shape == (2, 8, mc.context_dim)


@pytest.mark.parametrize("policy", list(mem.FORMULA_POLICIES))
def test_the_one_probe_on_the_mmdits_step_equals_the_formula(lab05_step, policy):
    cfg, step = lab05_step
    sh = mem.StepShape(2, 16, 8)
    got = mem.measure_saved(step, policy).by_region()
    assert got == mem.saved_bytes_formula(step.model.cfg, sh, "float32", policy), policy
    assert step.model.activation_checkpoint.name == "none"  # the seam is restored after the forward


def test_each_policys_recomputed_flops_are_the_forward_flops_of_what_it_recomputes(lab05_step):
    """Lab 05's recomputed FLOPs (a policy's counted step less no checkpointing's) equal a hand count
    of the forward it repeats: every block's matmuls and attention (full), one kind's (double /
    single), the attention alone (save_matmul keeps the matmul outputs), nothing (selective).  The
    CPU's flash-attention kernel is counted (FlopCounterMode has no formula for it of its own)."""
    _, step = lab05_step
    mc = step.model.cfg
    f = forward_flops(mc, 2, 16, 8)  # batch 2, 64 px = 4 x 4 image tokens, 8 text tokens
    per_block = f["attention"] / (mc.depth_double + mc.depth_single)
    want = {
        "full": f["double_linear"] + f["single_linear"] + f["attention"],
        "double": f["double_linear"] + mc.depth_double * per_block,
        "single": f["single_linear"] + mc.depth_single * per_block,
        "save_matmul": f["attention"],
        "selective": 0.0,
    }
    res = {r.policy: r.flops for r in mem.compare_policies(step, ["none", *want], reps=3, progress=False)}
    assert {p: res[p] - res["none"] for p in want} == want
    assert res["none"] > 2 * f["total"]  # forward + backward


def test_lab_08s_default_step_is_the_trainer_of_its_config_and_batches_are_seeded():
    cfg = PlanLabConfig(device="cpu", num_samples=4, buckets=[[64, 64]], ckpt_every=0)
    step = load_step(DEFAULT_STEP, lab=cfg, batch_size=cfg.batch_size)
    try:
        assert step.capabilities["train_config"] == cfg.train
        assert step.has("trainer") and step.phases == ("data_loading", "text_encoding", "image_encoding")
        again = step.make_batch(3)  # a loader read out of order restarts at batch 3
        assert same_batch(again, step.make_batch(3)) and not same_batch(again, step.make_batch(2))
    finally:
        step.close()


def test_lab_01s_default_step_profiles_the_trainers_phases_and_flops(tmp_path):
    cfg = TrainingStepLabConfig(device="cpu", num_samples=4, encoders="precomputed", buckets=[[64, 64]], ckpt_every=2)
    step = load_step(DEFAULT_STEP, lab=cfg, batch_size=cfg.batch_size)
    try:
        rep = profile_step(step, active=2, warmup=1, out_dir=tmp_path)  # batches 0 (warm-up), 1 and 2
        shapes = [step.make_batch(k) for k in (1, 2)]  # seeded: the profiled batches again
    finally:
        step.close()
    assert list(rep.phase_frame().columns) == list(PHASES)  # checkpoint every 2 steps included
    assert rep.periods == {"checkpoint": 2}
    assert rep.step_flops == [training_step_flops(cfg.model, 2, b.grid, b.txt.shape[1]) for b in shapes]
    assert rep.flops_source == "FlopCounterMode fwd+bwd on meta"
    assert rep.analysis.nested_phases.empty  # the trainer's phases follow each other
    assert rep.tokens == [32.0, 32.0]


def test_the_mmdit_trainer_step_checkpoints_every_n_steps_in_its_own_phase():
    cfg = TrainConfig(device="cpu", num_samples=4, encoders="precomputed", buckets=[[64, 64]], ckpt_every=2)
    step = load_step(DEFAULT_STEP, lab=cfg)
    tr = step.capabilities["trainer"]
    try:
        saved = []
        for k in range(1, 5):
            tr.last_checkpoint = None
            run_step(step, k)
            saved.append(tr.last_checkpoint is not None)
        assert saved == [True, False, True, False]  # after steps 1 and 3: (k + 1) % 2 == 0
        assert torch.isfinite(torch.stack([p.detach().sum() for p in step.model.parameters()])).all()
    finally:
        step.close()
