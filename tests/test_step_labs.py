"""Labs 07 and 08 on a model no one here wrote (transformers' Llama, tiny, CPU): a spike
provoked at one step is found and handled by each policy; the generic levers run at the
model's own shapes and the MMDiT-only ones are excluded with a reason."""

from __future__ import annotations

import math

import pytest
import torch

from lab_utils.step.levers import MMDIT_ONLY, measure_levers
from lab_utils.step.load import build_step
from lab_utils.step.stability import run, spike_check_lines

LLAMA = "lab_utils.step.examples:llama_step"


ACTIONS = [("skip", "spike: skipped"), ("clip", "spike: clipped"), ("rewind", "rewound")]


@pytest.mark.parametrize("policy, action", ACTIONS)
def test_a_provoked_spike_is_found_and_handled(policy, action):
    print("seed 0 (the factory's)")
    df, tel, events = run(build_step(LLAMA), 10, spike_policy=policy, provoke_step=7)
    assert list(df.step) == list(range(10)) and not events
    row = df.set_index("step").loc[7]
    assert str(row.action).startswith(action), df[["step", "loss", "action"]]
    assert spike_check_lines({policy: df}, 7) == [f"{policy}: step 7 {row.action}"]
    assert set(tel.block.unique()) >= {"model.layers.0", "model.layers.1", "total"}
    assert {"act_rms", "grad_norm", "update_ratio", "lost_update_frac"} <= set(tel.stat)
    if policy == "skip":  # the skipped update leaves every later loss finite and the run unharmed
        assert all(math.isfinite(v) for v in df.loss)


def test_the_generic_levers_run_and_the_mmdit_only_ones_say_why():
    df, excluded = measure_levers(LLAMA, levers=("activation_checkpoint", "sdpa_backend", "batch_size"), progress=False)
    ac = "activation_checkpoint"
    assert list(df.lever) == ["baseline", ac, ac, "sdpa_backend", "batch_size"]
    assert df.set_index("lever").loc["batch_size", "batch"] == 4
    assert (df.time_ms > 0).all() and (df.speedup > 0).all()
    why = {e.lever: e.reason for e in excluded}
    assert set(MMDIT_ONLY) <= set(why) and all(why[k] for k in MMDIT_ONLY)


def test_a_levers_speedup_is_baseline_time_per_sample_over_its_own(gen):
    """Speedup per sample, baseline over lever: a lever twice as slow per sample reads 0.5, one
    that halves the per-sample time at twice the batch reads 4 (hand-derived, random base time)."""
    from types import SimpleNamespace

    from lab_utils.step.levers import _row

    base_ms = 1.0 + float(torch.rand((), generator=gen))
    base = SimpleNamespace(median_ms=base_ms)
    slowed = _row("x", "", 2, SimpleNamespace(median_ms=2 * base_ms), base, 2)
    assert slowed["per_sample_ms"] == pytest.approx(base_ms)  # 2 * base over a batch of 2
    assert slowed["speedup"] == pytest.approx(0.5)  # (base / 2) / base
    bigger = _row("batch_size", 4, 4, SimpleNamespace(median_ms=base_ms / 2), base, 2)
    assert bigger["speedup"] == pytest.approx(4.0)  # (base / 2) / (base / 8)
    assert _row("baseline", "", 2, base, base, 2)["speedup"] == pytest.approx(1.0)
