"""Lab 07's config: bad input names the parameter; the parameter sets build valid configs;
the recipe drift summary reads a numerics diff."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from lab_utils.core.config import ConfigError
from lab_utils.stability.numdiff import numerics_diff
from lab_utils.stability.training import RunResult, RunSpec
from lab_utils.studies.stability import (
    StabilityLabConfig,
    policy_check_lines,
    rewind_matches_skip,
    run_spikes,
    spike_verdict_lines,
)
from lab_utils.studies.stability_runs import drift_table, precision_verdict_lines, qk_verdict_lines

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "param,value",
    [
        ("head_groups", 3),
        ("preset", "huge"),
        ("recipes", ["fp9"]),
        ("recipes", ["bf16"]),
        ("spike_policies", ["pray"]),
        ("provoke", "none"),
        ("provoke_step", 0),
        ("provoke_step", 40),
        ("adam_grid", [[1e-8, 0.999]]),
        ("adam_grid", [[1e-8, 1.5, 1.0]]),
        ("nan_checks", [["double_blocks.7", "forward"]]),
        ("nan_checks", [["double_blocks.0", "sideways"]]),
        ("resolution", 50),
        ("qk_lr", 0),
        ("drift_tol", -0.1),
        ("telemetry_every", 0),
        ("spike_grad_clip", -1.0),
    ],
)
def test_bad_parameter_is_refused_by_name(param, value):
    with pytest.raises(ConfigError) as e:
        StabilityLabConfig(**{param: value})
    assert e.value.param == param, str(e.value)


@pytest.mark.parametrize("name", ["smoke", "gpu"])
def test_parameter_sets_are_valid(name):
    params = yaml.safe_load((ROOT / "parameterized" / "sets" / "07_stability" / f"{name}.yaml").read_text())
    if params.get("device") == "cuda":
        params["device"] = "auto"  # the GPU set's shapes are validated here; the device is not
    cfg = StabilityLabConfig.from_params(params, strict=True)
    assert cfg.preset == params["preset"]


def test_drift_table_names_the_block_where_drift_starts():
    rows_a, rows_b = [], []
    for step in range(4):
        for i, blk in enumerate(["double_blocks.0", "double_blocks.1", "single_blocks.0"]):
            for stat in ("act_max", "logit_max", "grad_norm"):
                v = 1.0 + step + i
                rows_a.append(dict(step=step, block=blk, stream="", stat=stat, value=v))
                late = stat == "logit_max" and blk != "double_blocks.0" and step >= 2
                rows_b.append(dict(step=step, block=blk, stream="", stat=stat, value=v * (1.2 if late else 1.0)))
    d = numerics_diff(pd.DataFrame(rows_a), pd.DataFrame(rows_b), tol=0.05)
    t = drift_table({"fp8_tensor": d}).set_index("stat")
    assert t.loc["logit_max", "drift_starts_in"] == "double_blocks.1" and t.loc["logit_max", "at_step"] == 2
    assert t.loc["act_max", "drift_starts_in"] == "none" and t.loc["act_max", "at_step"] == -1


def test_nan_checks_accept_a_weight_gradient_injection():
    cfg = StabilityLabConfig(nan_checks=(("double_blocks.0", "weight"),))
    assert cfg.nan_checks[0][1] == "weight"


def _policy(policy: str, losses: list[float], actions: list[str] | None = None, **columns) -> RunResult:
    n = len(losses)
    steps = pd.DataFrame(
        dict(step=range(n), loss=losses, grad_norm=[1.0] * n, action=actions or ["step"] * n, spike=[False] * n)
    )
    for k, v in columns.items():
        steps[k] = v
    return RunResult(RunSpec(spike_policy=policy, provoke="batch"), steps, pd.DataFrame())


def test_policy_checks_raise_when_clip_leaves_the_trajectory_unchanged_or_breaks_its_rule():
    none = _policy("none", [3.0, 2.0, 9.0, 2.5])
    same = _policy("clip", [3.0, 2.0, 9.0, 2.5], ["step", "step", "spike: clip no-op", "step"])
    with pytest.raises(AssertionError, match="clip policy left the trajectory"):
        policy_check_lines({"n": none, "c": same})
    # a x9 spike over a window median of 1.5 with grad_clip 1 (RunSpec's): 1 x 1.5 / 9 = 1/6
    acts = ["step", "step", "spike: clipped", "step"]
    kw = dict(grad_norm=[1.4, 1.5, 9.0, 1.6], clip_median=[math.nan, math.nan, 1.5, math.nan])
    moved = _policy("clip", [3.0, 2.0, 9.0, 2.4], acts, clipped_norm=[1.0, 1.0, 1 / 6, 1.0], **kw)
    assert policy_check_lines({"n": none, "c": moved}) == [
        "clip changes the trajectory of none: True (1 step(s) clipped)",
        "clip at step 2: reference grad_clip = 1 (at or below the window median norm: every step is clipped to it); "
        "post-clip norm = reference x median / norm: True",
    ]
    # clipped to the median alone (1.5, what a clip to a norm would do) is not the rule
    off = _policy("clip", [3.0, 2.0, 9.0, 2.4], acts, clipped_norm=[1.0, 1.0, 1.5, 1.0], **kw)
    with pytest.raises(AssertionError, match=r"measured 1.5, the rule gives 0.166667"):
        policy_check_lines({"n": none, "c": off})


def test_rewind_matches_skip_until_their_actions_part():
    nan = float("nan")
    skip = _policy("skip", [3.0, 2.0, 9.0, 8.0, 7.0, 2.2], ["step", "step", *["spike: skipped"] * 3, "step"])
    acts = ["step", "step", "rewound: batch skipped", "rewound: batch skipped", "step", "step"]
    rewind = _policy("rewind", [3.0, 2.0, nan, nan, 7.0, 2.9], acts)  # its rewinds ran out at step 4
    assert rewind_matches_skip(skip, rewind) == (True, 4)
    off = _policy("rewind", [3.0, 2.1, nan, nan, 7.0, 2.9], acts)
    assert rewind_matches_skip(skip, off) == (False, 4)
    with pytest.raises(AssertionError, match="rewind does not replay the skip policy's losses before step 4"):
        policy_check_lines({"s": skip, "r": off})
    assert policy_check_lines({"s": skip, "r": rewind}) == [
        "rewind replays exactly the skip policy's losses until their actions part: True"
    ]


def _logits(name: str, values: list[float]) -> RunResult:
    tel = pd.DataFrame(dict(step=range(len(values)), stat="logit_max", value=values))
    return RunResult(RunSpec(name=name), pd.DataFrame(dict(step=[0], loss=[1.0])), tel)


def test_qk_verdicts_raise_when_the_normed_run_grows():
    ok = {"qk_norm on": _logits("on", [1.0, 2.0, 3.0]), "qk_norm off": _logits("off", [1.0, 4.0, 9.0])}
    assert qk_verdict_lines(ok)[1] == "qk_norm off: logit max grows more than 5x over the run: True"
    both_grow = {"qk_norm on": _logits("on", [1.0, 4.0, 9.0]), "qk_norm off": _logits("off", [1.0, 4.0, 9.0])}
    with pytest.raises(AssertionError, match="QK-norm: the lab's claim does not hold: qk_norm on"):
        qk_verdict_lines(both_grow)


def test_precision_verdicts_raise_when_master_weights_lose_updates():
    t = pd.DataFrame(
        dict(lost_update_frac=[0.0, 0.9, 0.0, 0.1], loss_gap_vs_fp32=[0.0, 0.5, 0.01, 0.02]),
        index=pd.Index(["fp32", "bf16", "bf16_master", "bf16_sr"], name="run"),
    )
    assert all(ln.endswith(": True") for ln in precision_verdict_lines(t))
    with pytest.raises(AssertionError, match="precision: .*fp32 master weights lose almost none"):
        precision_verdict_lines(t.assign(lost_update_frac=[0.0, 0.9, 0.01, 0.1]))


def test_spike_verdicts_raise_on_a_spike_in_the_clean_run_or_a_missed_one():
    clean = _policy("none", [3.0, 2.0, 2.0, 2.0])
    hit = _policy("skip", [3.0, 2.0, 9.0, 2.0])
    hit.steps.loc[2, "spike"] = True
    assert spike_verdict_lines({"clean": clean, "skip": hit}, 2)[1].endswith(": True")
    with pytest.raises(AssertionError, match="spikes: .*skip: first spike at the provoked step"):
        spike_verdict_lines({"clean": clean, "skip": hit}, 3)  # the spike came a step early
    noisy = _policy("none", [3.0, 2.0, 2.0, 2.0])
    noisy.steps.loc[1, "spike"] = True
    with pytest.raises(AssertionError, match="clean run: spikes detected: 1"):
        spike_verdict_lines({"clean": noisy, "skip": hit}, 2)


@pytest.mark.usefixtures("one_thread")  # the lab's cpu_threads = 1
def test_clip_policy_at_the_labs_defaults_scales_the_spike_below_what_the_global_clip_leaves():
    """Lab 07's spike runs clip every step to grad_clip = 1.0 and the tiny model's typical norm is
    above it: the spike leaves the global clip at 1.0 like every step, and the clip policy takes it
    to 1.0 x median / norm (the window median and the spike's norm read from the rows), so its
    trajectory parts from none's after the spike."""
    cfg = StabilityLabConfig(spike_policies=("none", "clip"), progress=False, device="cpu")
    runs = {r.spec.spike_policy: r.steps for r in run_spikes(cfg).values() if r.spec.provoke != "none"}
    none, clip, k, c = runs["none"], runs["clip"], cfg.provoke_step, cfg.spike_grad_clip
    assert c == 1.0 and clip.action[k] == "spike: clipped" and clip.clip_ref[k] == "grad_clip"
    window = clip.grad_norm.to_numpy()[:k][-cfg.spike_window :]
    med = float(np.median(window))
    assert med > c and (window > c).all()  # every step before the spike was clipped to grad_clip
    assert none.clipped_norm[k] == pytest.approx(c, rel=1e-5)  # none: the spike at grad_clip, as every step
    assert clip.clipped_norm[k] == pytest.approx(c * med / clip.grad_norm[k], rel=1e-5)
    np.testing.assert_array_equal(clip.loss[: k + 1], none.loss[: k + 1])
    assert (clip.loss[k + 1 :] != none.loss[k + 1 :]).all()
