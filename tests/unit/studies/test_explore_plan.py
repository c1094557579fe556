"""Lab 08's explorer: pick levers, see the predicted plan at once, run it and
see the measured step with its stability verdict beside the prediction.  On the synthetic
machine of test_study_plan.py: every phase time is known, so each prediction is checked
against a hand sum of the phases."""

from __future__ import annotations

import dataclasses
import math

import holoviews as hv
import pytest

from lab_utils.core.records import Recorder
from lab_utils.plan.planner import build_plan
from lab_utils.studies.explore.plan import PlanExplorer
from unit.plan.test_planner import CFG, fake_measure

hv.extension("bokeh")


@pytest.fixture(scope="module")
def res():
    return build_plan(CFG.train, ["encoders", "activation_checkpoint"], measure=fake_measure)


def _explorer(res, measure=fake_measure):
    return PlanExplorer.for_lab(CFG, res, Recorder("08_plan"), measure_fn=measure)


def test_levers_are_the_labs_measured_settings_and_the_prediction_is_instant(res):
    ex = _explorer(res, measure=lambda c: pytest.fail("a prediction must not measure"))
    assert [c.name for c in ex.controls] == ["encoders", "activation_checkpoint", "run"]
    assert ex.controls[0].options == ("off", "precomputed") and ex.controls[1].options[0] == "off"
    assert "full" in ex.controls[1].options
    ex.show(live=False)  # the default: the measured step, predicted as itself
    first = ex.results[0].row
    assert first["plan"] == "measured step" and first["predicted_ms"] == pytest.approx(100.0, rel=1e-12)
    assert math.isnan(first["measured_ms"]) and first["stability"].startswith("predicted from the measured step")
    # precomputed encoders: text and image encoding at 0 -> 100 - 10 - 20 = 70 ms (phases of fake_measure)
    r = ex.run(encoders="precomputed").result.row
    assert r["predicted_ms"] == pytest.approx(70.0, rel=1e-12) and r["plan"] == "encoders=precomputed"
    # full checkpointing on top: forward x1.3, backward x1.6 -> 30*1.3 + 40*1.6 = 103 ms
    r = ex.run(activation_checkpoint="full").result.row
    assert r["predicted_ms"] == pytest.approx(103.0, rel=1e-12)
    assert r["predicted_peak_mib"] == pytest.approx(50.0, rel=1e-12)  # 80 - 30 of the checkpointing's effect
    hv.renderer("bokeh").get_plot(ex.figure())


def test_running_a_plan_measures_it_with_its_verdict_and_error(res):
    ex = _explorer(res)
    out = ex.run(encoders="precomputed", run=True)
    row = out.result.row
    assert row["measured_ms"] == pytest.approx(70.0, rel=1e-12) and row["error_pct"] == pytest.approx(0.0, abs=1e-9)
    assert row["stable"] is True and row["stability"].startswith("stable")
    df = ex.rec.frame()
    step = df[(df.experiment == "explore") & (df.metric == "step_time")].iloc[0]
    assert step.stable is True and len(step.samples) == 5 and step.variant == "encoders=precomputed"
    assert set(df.metric) >= {"predicted_step", "step_time", "prediction_error"}


def test_a_noisy_run_is_marked_unstable_and_a_wrong_seam_is_refused(res):
    def noisy(cfg):
        p = fake_measure(cfg)
        return dataclasses.replace(p, step_samples=(100.0, 100.0, 100.0, 400.0, 100.0, 30.0, 250.0, 100.0))

    ex = _explorer(res, measure=noisy)
    row = ex.run(encoders="precomputed", run=True).result.row
    assert row["stable"] is False and row["stability"].startswith("UNSTABLE"), row["stability"]
    wrong = _explorer(res, measure=lambda c: dataclasses.replace(fake_measure(c), seams={"encoders": "live"}))
    out = wrong.run(encoders="precomputed", run=True)
    assert not out.ok and "seams" in out.reason and not wrong.results and not len(wrong.rec.frame())
