"""Labs 07 and 08 on a model no one here wrote (transformers' Llama, tiny, CPU): a spike
provoked at one step is found and handled by each policy; the generic levers run at the
model's own shapes and the MMDiT-only ones are excluded with a reason."""

from __future__ import annotations

import math

import pytest

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
