"""lab_utils.studies.plan: the lab's config, checked facts, tables, plots and words, on a
synthetic machine (the measuring itself is tested in test_plan.py)."""

from __future__ import annotations

import holoviews as hv
import pytest

from lab_utils.config import ConfigError
from lab_utils.plan import ALL_PHASES, StepProfile, build_plan, record_plan, verify
from lab_utils.records import Recorder
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
    r = build_plan(CFG.train_config(), ["encoders", "activation_checkpoint", "pin_memory"], measure=fake_measure)
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


def test_checked_facts():
    assert len(study.composition_check()) == 4
    t = study.lever_table(study.PlanLabConfig(device="cpu", levers=["pin_memory", "encoders"]))
    assert list(t.status) == ["excluded", "measured"] and "no GPU" in t.reason.iloc[0]


def test_tables_plots_words_and_records(res):
    assert study.plans_table(res).plan.iloc[0] == "encoders=precomputed"
    eff = study.effects_table(res).set_index("lever")
    assert eff.loc["encoders=precomputed", "gain_pct"] == 30.0
    assert eff.loc["activation_checkpoint=full", "buys"] == "+0 samples/batch"  # 30 MiB freed, 40 MiB/sample
    vt = study.verify_table(res)
    assert (vt[vt.phase == "TOTAL"].error_pct == 0.0).all()
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
