"""lab_utils.studies.plan: the lab's config, checked facts, tables, plots and words, on a
synthetic machine (the measuring itself is tested in tests/unit/plan/test_levers.py)."""

from __future__ import annotations

import holoviews as hv
import pytest
import torch

from lab_utils.core.config import ConfigError
from lab_utils.core.records import Recorder
from lab_utils.plan.planner import ALL_PHASES, StepProfile, build_plan, verify
from lab_utils.plan.summary import record_plan
from lab_utils.step.contract import StepFactory
from lab_utils.studies import plan as study

hv.extension("bokeh")
CFG = study.PlanLabConfig(preset="tiny", device="cpu", buckets=[[64, 64]], num_samples=16, ckpt_every=2)
FACTORS = {"precomputed": dict(text_encoding=0.0, image_encoding=0.0), "full": dict(forward=1.3, backward=1.6)}


def fake_measure(cfg):
    ph = dict.fromkeys(ALL_PHASES, 0.0) | dict(text_encoding=10.0, image_encoding=20.0, forward=30.0, backward=40.0)
    for value, f in FACTORS.items():
        if value in (cfg.encoders, cfg.activation_checkpoint):
            for p, r in f.items():
                ph[p] *= r
    peak = 50.0 if cfg.activation_checkpoint == "full" else 80.0
    samples = (100.0, 101.0, 99.0, 100.5, 100.2)
    return StepProfile(ph, dict.fromkeys(ph, 0.1), peak, 1e9, 32.0, samples, "stable: test", cfg.to_dict())


@pytest.fixture(scope="module")
def res():
    r = build_plan(CFG.train, ["encoders", "activation_checkpoint", "pin_memory"], measure=fake_measure)
    verify(r, top=2, measure=fake_measure)
    return r


def test_config_refuses_bad_input():
    with pytest.raises(ConfigError) as e:
        study.PlanLabConfig(levers=["compile", "teleport"])
    assert e.value.param == "levers"
    with pytest.raises(ConfigError) as e:
        study.PlanLabConfig(verify_top=0)
    assert e.value.param == "verify_top"
    with pytest.raises(ConfigError) as e:
        study.PlanLabConfig(statistic="mean")
    assert e.value.param == "statistic"
    assert study.PlanLabConfig.from_params({"levers": ["encoders"]}).levers == ("encoders",)


def _step(train=None) -> StepFactory:
    """A step with (or without) a trainer's config: what the lever table reads of it."""
    m = torch.nn.Linear(2, 2)
    caps = {"train_config": train} if train is not None else {}
    return StepFactory(
        m, torch.optim.SGD(m.parameters(), lr=0.1), torch.ones, lambda m, b: m(b).sum(), capabilities=caps
    )


def test_checked_facts():
    assert len(study.composition_check()) == 4
    cfg = study.PlanLabConfig(device="cpu", levers=["pin_memory", "encoders"])
    t = study.lever_table(cfg, _step(cfg.train))
    assert list(t.status) == ["excluded", "measured"] and "no GPU" in t.reason.iloc[0]
    t = study.lever_table(cfg, _step())  # no trainer: its levers are not this step's
    assert list(t.status) == ["excluded", "excluded"] and all("train_config" in r for r in t.reason)


def test_auto_levers_are_the_steps_own():
    auto = study.PlanLabConfig(device="cpu")
    assert auto.levers == "auto"
    assert study.levers_of(auto, _step(auto.train)) == study.CPU_LEVERS
    assert study.levers_of(auto, _step()) == ("activation_checkpoint", "sdpa_backend", "batch_size")
    assert study.levers_of(study.PlanLabConfig(device="cpu", levers=["encoders"]), _step()) == ("encoders",)


def test_tables_plots_words_and_records(res):
    assert study.plans_table(res).plan.iloc[0] == "encoders=precomputed"
    eff = study.effects_table(res).set_index("lever")
    assert eff.loc["encoders=precomputed", "gain_pct"] == 30.0
    assert eff.loc["activation_checkpoint=full", "buys"] == "+0 samples/batch"  # 30 MiB freed, 40 MiB/sample
    vt = study.verify_table(res)
    assert (vt.error_pct == 0.0).all() and len(vt) == 2
    assert study.seams_verdict(res) == "verified plans: 2; each ran exactly its predicted seams: True"
    words = study.recommendations(res)
    assert words.startswith("1. encoders=precomputed") and "risk" in words and "+0.0%" in words
    assert "activation_checkpoint" not in words.splitlines()[0]
    for plot in (study.waterfall_plot(res), study.prediction_plot(res)):
        hv.render(plot)
    rec = Recorder(lab="08_plan")
    record_plan(rec, res)
    df = rec.frame()
    err = df[df.metric == "prediction_error"]
    assert len(err) == 2 and (err.unit == "%").all()
    assert set(df.experiment) >= {"base", "effects", "excluded", "plans", "verify"}


def test_verify_table_has_no_nan_columns_and_the_prediction_plot_a_legend(res):
    """The verification table holds no column of NaN (per-phase rows in
    their own table), and the prediction plot has a legend and phase names as its ticks."""
    vt = study.verify_table(res)
    assert not vt.isna().any().any(), vt
    ph = study.verify_phases(res)
    assert set(ph.phase) >= {"forward", "backward", "TOTAL"} and not ph.isna().any().any()
    for bars in study.prediction_plot(res):
        opts = bars.opts.get().kwargs
        assert opts["show_legend"] and opts["legend_position"] and opts["multi_level"] is False
        fig = hv.render(bars)
        assert fig.legend and fig.legend[0].items  # grouped by the colour column: predicted / measured
        assert set(fig.renderers[0].data_source.data["which"]) == {"predicted", "measured"}
        assert list(dict.fromkeys(f[0] for f in fig.x_range.factors)) == list(dict.fromkeys(ph.phase))
        ax = fig.xaxis[0]  # the phases are the ticks; the inner level (predicted / measured) is the legend
        assert ax.major_label_text_font_size == "1px" and ax.group_text_font_size == "10pt"


def test_a_checkpoint_every_n_steps_counts_as_its_cost_over_n_in_both_labs():
    """A checkpoint every N=4 steps costing C=40 ms is C/4 per step in lab 08's
    plan and table and in lab 01's figure, its full cost shown beside it, the rule stated."""
    from lab_utils.plan.planner import profile_from_report
    from lab_utils.studies import training_step as lab01
    from unit.profiling.test_profiler import synthetic_report

    ck = [0.0, 0.0, 0.0, 40.0, 0.0, 0.0, 0.0, 40.0]
    rep = synthetic_report({"forward": [10.0] * 8, "checkpoint": ck}, periods={"checkpoint": 4})
    prof = profile_from_report(rep, CFG.train)
    assert prof.phases["checkpoint"] == 10.0 and prof.periodic == {"checkpoint": (4, 40.0)}
    r = build_plan(CFG.train, [], measure=lambda c: prof)
    t = study.base_table(r).set_index("phase")
    assert (t.loc["checkpoint", "ms_per_step"], t.loc["checkpoint", "ms_per_event"]) == (10.0, 40.0)
    assert t.loc["checkpoint", "every_n_steps"] == 4 and "40 ms per checkpoint" in study.periodic_line(r)
    bars = lab01.phase_summary_bars(rep)
    assert dict(zip(bars.data.phase, bars.data.ms))["checkpoint"] == 10.0
    label = bars.opts.get().kwargs["xlabel"]
    assert "40 ms per checkpoint" in label and "10 ms per step" in label and "/ N" in label
    assert lab01.phase_table(rep).set_index("phase").loc["checkpoint", "ms_per_step"] == 10.0


def test_lab08_base_phases_carry_samples_and_the_timing_verdict():
    """Lab 08: the measured step's phase rows keep one sample per profiled
    step (per save for a checkpoint every N steps) and the timing judge's verdict; one outlier
    step makes its phase unstable."""
    from lab_utils.core.timing import judge_samples
    from lab_utils.plan.planner import profile_from_report
    from unit.profiling.test_profiler import synthetic_report

    fwd = [10.0, 10.1, 9.9, 10.0, 40.0, 10.05, 10.0, 9.95]
    ck = [0.0, 0.0, 0.0, 40.0, 0.0, 0.0, 0.0, 41.0]
    rep = synthetic_report({"forward": fwd, "backward": [20.0] * 8, "checkpoint": ck}, periods={"checkpoint": 4})
    prof = profile_from_report(rep, CFG.train)
    r = build_plan(CFG.train, [], measure=lambda c: prof)
    rec = Recorder(lab="08_plan")
    record_plan(rec, r)
    base = {x["variant"]: x for x in rec.rows if x["experiment"] == "base" and x["metric"] == "time"}
    assert base["forward"]["samples"] == fwd and base["forward"]["stable"] is False
    assert base["backward"]["samples"] == [20.0] * 8 and base["backward"]["stable"] is True
    assert base["checkpoint"]["samples"] == [40.0, 41.0]  # one per save
    for p in ("forward", "backward", "checkpoint"):
        assert base[p]["stability"] == judge_samples(base[p]["samples"]).reason
    # a phase the profile never saw: no samples, no verdict (never a made-up "stable")
    te = base["text_encoding"]
    assert (te["value"], te["samples"], te["stable"], te["stability"]) == (0.0, None, None, ""), te


def test_a_phases_spread_is_p20_to_p80_over_its_median():
    """A phase's spread in the plan's profile is (p80 - p20) / median of its per-step
    samples, by hand with numpy's linear rule: 10, 12, 14, 16, 30 ms give p20 11.6, p80 18.8,
    median 14, so 7.2 / 14 (quartiles would give 4 / 14); a constant phase has no spread and a
    phase that never ran has 0."""
    from lab_utils.plan.planner import profile_from_report
    from unit.profiling.test_profiler import synthetic_report

    rep = synthetic_report({"forward": [10.0, 12.0, 14.0, 16.0, 30.0], "backward": [20.0] * 5})
    prof = profile_from_report(rep, CFG.train)
    assert prof.phases["forward"] == 14.0
    assert prof.spread["forward"] == pytest.approx(7.2 / 14, rel=1e-12)
    assert prof.spread["backward"] == 0.0 and prof.spread["text_encoding"] == 0.0
