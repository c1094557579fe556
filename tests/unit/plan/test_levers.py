"""lab_utils.plan.planner and lab_utils.plan.levers: the composition is exact on synthetic profiles, a
lever that cannot run here is excluded with its reason, bad input is refused or excluded
with a reason while the plan goes on, and verification runs exactly the predicted seams."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lab_utils.core.config import ConfigError
from lab_utils.model.train import TrainConfig
from lab_utils.plan.levers import LEVERS, candidates, check_levers
from lab_utils.plan.planner import (
    ALL_PHASES,
    Effect,
    Plan,
    StepProfile,
    build_plan,
    compose,
    enumerate_plans,
    interacting,
    judge,
    measure_step,
    merge_profiles,
    verify,
    waterfall,
)
from lab_utils.plan.summary import plan_and_verify

CPU = torch.device("cpu")
BASE = TrainConfig(preset="tiny", device="cpu", batch_size=2, buckets=[[64, 64]], num_samples=8, ckpt_every=2)


def profile(seams=None, **phases) -> StepProfile:
    ph = dict.fromkeys(ALL_PHASES, 0.0) | phases
    return StepProfile(ph, dict.fromkeys(ph, 0.0), 100.0, 2e12, 512.0, seams=seams or {})


# the synthetic machine: every setting scales its phases by a known factor
FACTORS = {
    ("attention_path", "math"): dict(forward=0.8, backward=0.9),
    ("encoders", "precomputed"): dict(text_encoding=0.0, image_encoding=0.0, data_loading=0.5),
    ("num_workers", 2): dict(data_loading=0.25),
    ("ckpt_format", "dcp_async"): dict(checkpoint=0.1),
    ("ckpt_format", "dcp"): dict(checkpoint=1.5),
}
BASE_PHASES = dict(
    data_loading=4.0,
    text_encoding=10.0,
    image_encoding=20.0,
    forward=30.0,
    backward=50.0,
    optimizer=6.0,
    checkpoint=8.0,
)


def synthetic_measure(calls):
    def measure(cfg: TrainConfig) -> StepProfile:
        calls.append(cfg)
        ph = dict(BASE_PHASES)
        for (lever, value), f in FACTORS.items():
            if getattr(cfg, lever) == value:
                for p, r in f.items():
                    ph[p] *= r
        return profile(seams=cfg.to_dict(), **ph)

    return measure


def test_compose_is_exact_on_known_phases_and_speedups():
    base = profile(forward=40.0, backward=60.0, text_encoding=30.0, optimizer=20.0)
    half = Effect("compile", True, dict(forward=0.5, backward=0.5), -10.0, {})
    quarter_off = Effect("attention_path", "math", dict(forward=0.75, backward=0.75), 2.0, {})
    cached = Effect("encoders", "precomputed", dict(text_encoding=0.0), -5.0, {})
    assert compose(base, []).total_ms == 150.0
    p = compose(base, [half, quarter_off, cached])
    assert p.phases["forward"] == 15.0 and p.phases["backward"] == 22.5 and p.phases["text_encoding"] == 0.0
    assert p.total_ms == 57.5
    assert p.amdahl_ms == 20.0  # only the optimizer is untouched
    assert p.peak_mib == 87.0
    assert math.isclose(p.tokens_per_s, 512.0 / 57.5e-3)
    assert math.isclose(p.tflops, 2e12 / 57.5e-3 / 1e12)
    assert p.low_ms == p.high_ms == 57.5  # no spread, no interval
    assert math.isnan(p.mfu_pct)
    assert math.isclose(compose(base, [half], peak_tflops=100.0).mfu_pct, 100 * 2e12 / 0.1 / 1e12 / 100.0)


def test_interval_adds_relative_spreads_in_quadrature():
    base = dataclasses.replace(profile(forward=100.0), spread=dict.fromkeys(ALL_PHASES, 0.0) | dict(forward=0.3))
    e = Effect("compile", True, dict(forward=0.5), 0.0, dict(forward=0.4))
    p = compose(base, [e])
    assert math.isclose(p.high_ms - p.total_ms, 0.5 * 50.0 * 0.5)  # sqrt(0.3² + 0.4²) = 0.5


def test_plan_and_verify_on_a_synthetic_machine_predicts_exactly():
    calls = []
    res = build_plan(
        BASE, ["attention_path", "encoders", "num_workers", "ckpt_format"], measure=synthetic_measure(calls)
    )
    best = res.plans[0]
    assert best.choices == {
        "attention_path": "math",
        "encoders": "precomputed",
        "num_workers": 2,
        "ckpt_format": "dcp_async",
    }
    expected = 4 * 0.5 * 0.25 + 0 + 0 + 30 * 0.8 + 50 * 0.9 + 6 + 8 * 0.1
    assert math.isclose(best.prediction.total_ms, expected)
    ver = verify(res, top=2, measure=synthetic_measure(calls))
    assert len(ver) == 2
    for v in ver:
        assert v.seams_match and math.isclose(v.error_pct, 0.0, abs_tol=1e-9) and v.broken == ""
    # the verification runs were given exactly the predicted configurations
    # each plan's run follows a fresh measurement of the step (drift apart from composition)
    assert calls[-4:] == [BASE, ver[0].plan.config, BASE, ver[1].plan.config]
    assert all(v.drift_pct == 0.0 and math.isclose(v.rebased_error_pct, 0.0, abs_tol=1e-9) for v in ver)
    bars = waterfall(res.base, best)
    assert bars[0]["end"] == res.base.total_ms and math.isclose(bars[-1]["end"], expected)
    assert math.isclose(sum(b["delta"] for b in bars[1:-1]), expected - res.base.total_ms)


def test_verification_refuses_a_run_with_other_seams():
    calls = []
    res = build_plan(BASE, ["encoders"], measure=synthetic_measure(calls))

    def wrong(cfg):  # a run that silently dropped the plan's seam
        return synthetic_measure(calls)(dataclasses.replace(cfg, encoders="live"))

    with pytest.raises(AssertionError, match="not the predicted"):
        verify(res, top=1, measure=wrong)


def test_unavailable_levers_are_excluded_with_a_reason_and_the_plan_goes_on():
    ok, out = candidates("pin_memory", BASE, CPU)
    assert ok == [] and out and "no GPU" in out[0].reason
    ok, out = candidates("kernels", BASE, CPU)
    assert "compile" in ok and any(x.value == "triton" and "interpreter" in x.reason for x in out)
    ok, out = candidates("recipe", BASE, CPU)
    assert ok == [] and {x.value for x in out} >= {"fp8_tensor", "mxfp8"}
    ok, out = candidates("distributed", BASE, CPU)
    assert ok == [] and "one process" in out[0].reason
    ok, out = candidates("attention_path", BASE, CPU)
    assert "sdpa" not in ok and any(x.value == "cudnn" for x in out)
    res = build_plan(BASE, ["pin_memory", "recipe", "encoders"], measure=synthetic_measure([]))
    assert {x.lever for x in res.excluded} >= {"pin_memory", "recipe"}
    assert [p.choices for p in res.plans] == [{"encoders": "precomputed"}, {}]


def test_bad_input():
    with pytest.raises(ConfigError) as e:
        check_levers("levers", ["compile", "warp_speed"])
    assert e.value.param == "levers" and "warp_speed" in str(e.value)
    with pytest.raises(ConfigError):
        check_levers("levers", ["compile", "compile"])
    with pytest.raises(ConfigError):
        build_plan(BASE, ["nonsense"], measure=synthetic_measure([]))
    # an impossible combination is excluded with the TrainConfig's reason; the rest are ranked
    base = profile(**BASE_PHASES)
    good = Effect("encoders", "precomputed", dict(text_encoding=0.0), 0.0, {})
    bad = Effect("attention_path", "no_such_path", dict(forward=0.1), 0.0, {})
    plans, excluded = enumerate_plans(BASE, base, [good, bad])
    assert [p.choices for p in plans] == [{"encoders": "precomputed"}, {}]
    assert len(excluded) == 2 and all("attention_path" in x.reason for x in excluded)


def test_judge_names_levers_that_interact_where_the_error_is():
    base = profile(forward=100.0, backward=100.0)
    a = Effect("compile", True, dict(forward=0.5, backward=0.5), 0.0, {})
    b = Effect("kernels", "compile", dict(forward=0.5, backward=0.5), 0.0, {})
    plans, _ = enumerate_plans(BASE, base, [a, b])
    both = next(p for p in plans if len(p.choices) == 2)
    assert both.prediction.total_ms == 50.0
    assert interacting(both) == [("compile=True", "kernels=compile", "forward")]
    # compile fused what the kernels already fused: the second lever bought nothing
    measured = profile(seams=both.config.to_dict(), forward=50.0, backward=50.0)
    v = judge(both, measured)
    assert v.seams_match and math.isclose(v.error_pct, 100.0)
    assert "compile=True with kernels=compile" in v.broken


def test_merge_profiles():
    a, b = profile(forward=10.0), profile(forward=20.0)
    assert merge_profiles(a, b).phases["forward"] == 15.0
    assert merge_profiles(a, b, statistic="min").phases["forward"] == 10.0


def test_every_lever_declares_known_phases():
    for lv in LEVERS.values():
        assert set(lv.phases) <= set(ALL_PHASES) | {"communication"}, lv.name


def test_measure_step_on_the_tiny_cpu_step():
    """The real path once: lab 01's profiler on the tiny step, its seams recorded."""
    prof = measure_step(dataclasses.replace(BASE, encoders="precomputed"), steps=2, warmup=1)
    assert prof.seams == dataclasses.replace(BASE, encoders="precomputed").to_dict()
    assert set(prof.phases) == set(ALL_PHASES)
    assert prof.phases["forward"] > 0 and prof.phases["backward"] > 0 and prof.phases["checkpoint"] > 0
    assert prof.total_ms > 0 and len(prof.step_samples) == 2 and prof.threads >= 1
    assert prof.tokens == 2 * 4 * 4 and prof.flops > 0


def test_plan_and_verify_summary_for_the_gpu_check():
    out = plan_and_verify(BASE, ["encoders", "pin_memory"], measure=synthetic_measure([]))
    assert out["device"] == "cpu" and any("pin_memory" in x for x in out["excluded"])
    assert out["verified"][0]["plan"] == "encoders=precomputed" and out["verified"][0]["seams_match"]
    assert out["verified"][0]["error_pct"] == 0.0


def test_verification_on_a_machine_that_slowed_reports_drift_and_the_rebased_error():
    """The plan is built on the synthetic machine; at verification the machine runs the base
    step 25% slower and the plan's step 50% slower than before (a deliberately slowed machine):
    drift +25% (fresh base over the planned base), error +50% against the prediction, and
    against the prediction rebased on the fresh base (1.25x) 1.5 / 1.25 - 1 = +20%."""
    calls = []
    res = build_plan(BASE, ["attention_path", "num_workers"], measure=synthetic_measure(calls))
    fast = synthetic_measure(calls)

    def slowed(cfg):
        p = fast(cfg)
        f = 1.25 if cfg == BASE else 1.5
        return dataclasses.replace(p, phases={k: v * f for k, v in p.phases.items()})

    (v,) = verify(res, top=1, measure=slowed)
    assert v.drift_pct == pytest.approx(25.0)
    assert v.error_pct == pytest.approx(50.0)
    assert v.rebased_ms == pytest.approx(1.25 * v.plan.prediction.total_ms)
    assert v.rebased_error_pct == pytest.approx(20.0)


def test_a_plan_much_faster_than_predicted_is_flagged_too():
    """The error is judged both ways: a step measured at half the prediction (-50%) is as broken
    as one at twice it."""
    base = profile(forward=100.0, backward=100.0)
    a = Effect("compile", True, dict(forward=0.5, backward=0.5), 0.0, {})
    plans, _ = enumerate_plans(BASE, base, [a])
    one = next(p for p in plans if p.choices)
    measured = profile(seams=one.config.to_dict(), forward=25.0, backward=25.0)
    v = judge(one, measured)
    assert math.isclose(v.error_pct, -50.0)
    assert "phase 'forward' is off most" in v.broken


def test_merged_profiles_keep_the_wider_spread():
    """Two measurements merged are no more certain than the noisier one: per phase the larger
    relative spread (10 % and 30 % -> 30 %, either order)."""
    a = dataclasses.replace(profile(forward=10.0), spread=dict.fromkeys(ALL_PHASES, 0.0) | {"forward": 0.1})
    b = dataclasses.replace(profile(forward=20.0), spread=dict.fromkeys(ALL_PHASES, 0.0) | {"forward": 0.3})
    assert merge_profiles(a, b).spread["forward"] == 0.3
    assert merge_profiles(b, a).spread["forward"] == 0.3


def test_waterfall_adds_the_largest_gain_first():
    """forward 30 ms halved (-15 ms) and backward 50 ms halved (-25 ms): the bars go 80 -> 55
    (backward) -> 40 (forward), whatever order the plan lists its effects in."""
    base = profile(forward=30.0, backward=50.0)
    fwd = Effect("f", 1, {"forward": 0.5}, 0.0, {})
    bwd = Effect("b", 1, {"backward": 0.5}, 0.0, {})
    plan = Plan({"f": 1, "b": 1}, BASE, compose(base, [fwd, bwd]), (fwd, bwd))
    bars = [(r["bar"], r["start"], r["end"]) for r in waterfall(base, plan)]
    assert bars == [("measured step", 0.0, 80.0), ("b=1", 80.0, 55.0), ("f=1", 55.0, 40.0), ("plan", 0.0, 40.0)]
