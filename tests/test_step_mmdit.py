"""On perflab's own MMDiT, the generic path (lab_utils.step) agrees with the MMDiT-specific
one: the same saved bytes, region by region and policy by policy where both have the policy,
and the same phase set as lab 01's trainer; the generic profile's figures hold together."""

from __future__ import annotations

import pytest
import torch

from lab_utils.core.records import Recorder
from lab_utils.memory.saved import StepShape
from lab_utils.memory.saved import measure_saved as mmdit_saved
from lab_utils.model.train import TrainConfig, Trainer
from lab_utils.profiling.profiler import profile_training, training_step_flops
from lab_utils.step.contract import STEP_PHASES, identity
from lab_utils.step.load import DEFAULT_STEP, load_step
from lab_utils.step.memory import measure_saved
from lab_utils.step.mmdit import mmdit_factory
from lab_utils.step.profile import profile_step, record_profile

SHAPE = dict(batch_size=2, height=64, width=64, txt_len=8)  # 4 x 4 tokens


@pytest.fixture(scope="module")
def mmdit():
    step = mmdit_factory("tiny", **SHAPE)
    step.name = "lab_utils.step.mmdit:mmdit_factory"
    return step


@pytest.mark.parametrize("policy", ["none", "full", "every_other", "selective", "save_matmul", "offload"])
def test_generic_saved_bytes_equal_the_mmdit_specific_probe(mmdit, policy):
    sh = StepShape(SHAPE["batch_size"], 16, SHAPE["txt_len"])
    ref = mmdit_saved("tiny", sh, "float32", policy)
    got = measure_saved(mmdit, policy)
    assert got.total == ref.total, (policy, got.total, ref.total)
    if policy == "none":  # with no policy the regions agree too (a policy's kept inputs are named apart)
        assert got.by("region") == ref.by_region()


def test_the_default_step_is_the_mmdit_and_has_lab_01s_phase_set(tmp_path):
    step = load_step(DEFAULT_STEP)
    assert type(step.model).__name__ == "MMDiT"
    prof = profile_step(step, steps=1, warmup=0, out_dir=tmp_path)
    tr = Trainer(TrainConfig(device="cpu", num_samples=4, encoders="precomputed", buckets=[[64, 64]]))
    try:
        rep = profile_training(tr, active=1, warmup=0, out_dir=tmp_path)
    finally:
        tr.close()
    assert prof.phase_set == set(rep.analysis.phases.phase), (prof.phase_set, set(rep.analysis.phases.phase))
    # the generic FLOPs (FlopCounterMode on the real step) equal the MMDiT's count on meta
    cfg = step.model.cfg
    assert prof.flops == training_step_flops(cfg, 2, (4, 4), 8)
    # the step phases cover the step, the factory's phases nest in data_loading
    t = prof.phase_table()
    assert set(t[t.within == ""].phase) == set(STEP_PHASES)
    assert set(t[t.within != ""].within) == {"data_loading"}
    cov = prof.report.analysis.steps.coverage
    assert ((cov > 0.5) & (cov <= 1.0 + 1e-9)).all(), cov
    rec = Recorder(lab="t")
    record_profile(rec, prof)
    df = rec.frame()
    assert df.variant.str.startswith(identity(step).key).all()
    assert not df.duplicated(["experiment", "variant", "metric", "statistic"]).any()


def test_the_flux_factory_brings_its_own_phase_inside_the_forward(tmp_path):
    step = load_step("lab_utils.step.examples:flux_step")
    prof = profile_step(step, steps=1, warmup=0, out_dir=tmp_path)
    t = prof.phase_table().set_index("phase")
    assert t.loc["noising", "within"] == "forward"
    assert prof.flops_source.startswith("FlopCounterMode") and prof.flops > 0
    assert prof.peak_bytes > 0
    assert torch.isfinite(torch.tensor(prof.report.analysis.steps.step_ms.to_numpy())).all()
