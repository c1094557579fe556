"""Labs 07 and 08 on a model no one here wrote (transformers' Llama, tiny, CPU) through the one
training loop and the one planner: a spike provoked at one step is found and handled by each
policy (its token batch has nothing to scale: its loss is scaled); the generic levers are measured
at the model's own shapes, combined into plans and the best plans verified; a lever that changes
the batch is credited per sample (pinned by hand)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lab_utils.plan.planner import StepProfile, build_plan, compose, effect_of, measure_step, per_batch, verify
from lab_utils.plan.setup import StepSetup, step_candidates
from lab_utils.stability.training import RunSpec, train_run
from lab_utils.step.load import load_step
from lab_utils.studies.stability import spike_verdict_lines

LLAMA = "lab_utils.step.examples:llama_step"
ACTIONS = [("skip", "spike: skipped"), ("clip", "spike: clipped"), ("rewind", "rewound")]


@pytest.fixture(scope="module")
def llama():
    return load_step(LLAMA, batch_size=2)


@pytest.mark.parametrize("policy, action", ACTIONS)
def test_a_provoked_spike_is_found_and_handled(llama, policy, action):
    print("seed 0 (the factory's)")
    spec = RunSpec(steps=14, provoke="batch", provoke_step=10, poison_scale=30.0, spike_policy=policy, grad_clip=0.0)
    res = train_run(spec, step=llama.rebuild())
    df = res.steps
    assert list(df.step) == list(range(14)) and not res.nonfinite
    row = df.set_index("step").loc[10]
    assert str(row.action).startswith(action), df[["step", "loss", "action"]]
    assert spike_verdict_lines(
        {"clean": train_run(dataclasses.replace(spec, provoke="none"), step=llama.rebuild()), policy: res}, 10
    )
    tel = res.telemetry
    assert set(tel.block.unique()) >= {"model.layers.0", "model.layers.1", "total"}
    assert {"act_rms", "grad_norm", "update_ratio", "lost_update_frac", "logit_max"} <= set(tel.stat)
    if policy == "skip":  # the skipped update leaves every later loss finite and the run unharmed
        assert all(math.isfinite(v) for v in df.loss)


def test_the_generic_levers_make_a_plan_on_the_step_and_the_best_is_verified(llama):
    setup = StepSetup.of(llama)
    assert setup.train is None and setup.batch_size == 2
    ok, out = step_candidates("attention_path", setup, torch.device("cpu"))
    assert not ok and "train_config" in out[0].reason  # a trainer's lever: not this step's
    res = build_plan(setup, ["activation_checkpoint", "sdpa_backend", "batch_size"], steps=3, warmup=1, own=llama)
    keys = {e.key for e in res.effects}
    assert keys == {
        "activation_checkpoint=full",
        "activation_checkpoint=selective",
        "sdpa_backend=math",
        "batch_size=4",
    }
    assert res.base.batch == 2 and len(res.plans) == 3 * 2 * 2
    ver = verify(res, top=1, steps=3, warmup=1, own=llama)
    assert len(ver) == 1 and ver[0].seams_match and math.isfinite(ver[0].error_pct)
    v = ver[0]
    assert v.measured.seams == {"step": LLAMA, **v.plan.choices}
    assert v.measured.batch == 2  # a batch-size plan is measured per sample of the base batch


def test_a_lever_that_changes_the_batch_is_credited_per_sample(gen):
    """Base: 2 samples, forward 10 ms, backward 20 ms.  At 4 samples the step takes 36 ms (18 + 18):
    per 2 samples 18 ms, so forward x0.9 and backward x0.45 (hand-derived)."""
    fwd = 5.0 + float(torch.rand((), generator=gen))
    base = StepProfile(dict(forward=fwd, backward=2 * fwd), dict(forward=0.0, backward=0.0), 10.0, 1e9, 32.0, batch=2)
    four = StepProfile(
        dict(forward=1.8 * fwd, backward=1.8 * fwd), dict(forward=0.0, backward=0.0), 14.0, 2e9, 64.0, batch=4
    )
    e = effect_of("batch_size", 4, base, four)
    assert e.ratios["forward"] == pytest.approx(0.9) and e.ratios["backward"] == pytest.approx(0.45)
    assert compose(base, [e]).total_ms == pytest.approx(0.9 * fwd + 0.9 * fwd)
    assert e.peak_delta_mib == pytest.approx(4.0)  # memory is per step, not per sample
    half = per_batch(four, 2)
    assert half.phases["forward"] == pytest.approx(0.9 * fwd) and half.tokens == pytest.approx(32.0)
    assert per_batch(four, None) is four and per_batch(base, 2) is base


def test_checkpointing_and_an_sdpa_backend_together_recompute_on_that_backend(llama):
    """A checkpointed block recomputes in the backward: it must use the forward's SDPA backend
    (the whole step runs under it), or torch refuses the recomputed tensors."""

    setup = StepSetup.of(llama).replace(activation_checkpoint="full", sdpa_backend="math")
    prof = measure_step(setup, steps=1, warmup=0)
    assert prof.seams == {"step": LLAMA, "activation_checkpoint": "full", "sdpa_backend": "math"}
    assert prof.total_ms > 0
