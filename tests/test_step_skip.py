"""Labs 01, 07 and 08 on a step that is not perflab's MMDiT (issue 24): every MMDiT-only section
returns one line saying why, writes no record and measures nothing; what reads such a section's
result (tables, plots, checks, record helpers, explorers) hands the line on, however a cell
uses it (printed, joined, composed, indexed, asked for an attribute).  On the default step the
sections run.  Called on configs directly (the notebooks: tests/test_step_lab_matrix.py)."""

from __future__ import annotations

import copy
import pickle

import pytest

from lab_utils.core.device import device_info
from lab_utils.core.records import Recorder
from lab_utils.step.skip import Skipped, default_step_only_in, hand_on_skipped, skipped
from lab_utils.studies import plan as plan_study
from lab_utils.studies import stability, training_step
from lab_utils.studies.explore.plan import PlanExplorer
from lab_utils.studies.explore.stability import StabilityExplorer
from lab_utils.studies.explore.training_step import TrainingStepExplorer

LLAMA = "lab_utils.step.examples:llama_step"


def reason(why: str) -> str:
    return skipped(LLAMA, why).reason


def test_a_skipped_result_stays_its_line_however_a_cell_uses_it():
    s = skipped(LLAMA, "the formula is MMDiT-only")
    assert skipped("lab_utils.step.mmdit:mmdit_step", "x") is None
    line = s.reason
    assert line.startswith("skipped: the formula is MMDiT-only; this run measures " + LLAMA)
    assert str(s) == repr(s) == s.to_string(index=False) == "\n".join(s) == line
    for used in (s["x"], s + s, 1 + s, s * s, (s + s).cols(1), s.base.stability, s.round(3), s.items()):
        assert used is s
    assert len(s) == 0 and list(s) == [line]
    with pytest.raises(AttributeError):
        s._repr_html_  # noqa: B018 - IPython, pickle and copy see a plain object
    assert pickle.loads(pickle.dumps(s)).reason == copy.copy(s).reason == line


def test_the_namespace_helpers_wrap_the_functions_they_name():
    ns = {"section": lambda cfg: ("ran", cfg.step), "table": lambda res, n=1: ("table", res, n)}
    default_step_only_in(ns, "why", "section")
    hand_on_skipped(ns, "table")

    class Cfg:
        def __init__(self, step):
            self.step = step

    assert ns["section"](Cfg("lab_utils.step.mmdit:mmdit_step")) == ("ran", "lab_utils.step.mmdit:mmdit_step")
    res = ns["section"](Cfg(LLAMA))
    assert isinstance(res, Skipped) and res.reason == reason("why")
    assert ns["table"](res) is res and ns["table"](5, n=res) is res and ns["table"](5) == ("table", 5, 1)


def test_lab_01_skips_the_mmdits_sections_and_keeps_a_recorder_for_your_step():
    cfg = training_step.TrainingStepLabConfig(device="cpu", step=LLAMA)
    for f in (training_step.preset_lines, training_step.flop_lines, training_step.bad_input_lines):
        assert "\n".join(f(cfg)) == reason(training_step.MMDIT_FACTS), f.__name__
    assert "\n".join(training_step.faithfulness_lines(cfg, seed=0)) == reason(training_step.MMDIT_FACTS)
    info = device_info("cpu")
    run = training_step.profile_step(cfg, info)
    assert isinstance(run.rec, Recorder) and run.rec.frame().empty and run.rec.params["step"] == LLAMA
    for part in (run.report, run.seams, run.mfu):
        assert str(part) == reason(training_step.MMDIT_PROFILE)
    assert training_step.artifact_lines(run) == [reason(training_step.MMDIT_PROFILE)]
    r = run.report
    for shown in (training_step.steps_frame(r), training_step.phase_summary_bars(r) + training_step.phase_bars(r),
                  training_step.mfu_table(run.mfu), r.analysis.categories.round(3)):  # fmt: skip
        assert shown is r
    assert str(TrainingStepExplorer.for_lab(cfg, info, run.rec, measured=run).show()) == str(r)


def test_lab_01s_facts_run_on_the_default_step_and_without_a_config():
    cfg = training_step.TrainingStepLabConfig(device="cpu")
    assert training_step.preset_lines(cfg) == training_step.preset_lines()
    assert any(line.startswith("tiny") for line in training_step.preset_lines(cfg))


def test_lab_07_skips_every_experiment_and_what_reads_them():
    cfg = stability.StabilityLabConfig(device="cpu", step=LLAMA)
    rec = Recorder(lab=stability.LAB, params=cfg.to_dict(), device="cpu")
    qk = stability.run_qk_norm(cfg)
    assert str(qk) == reason(stability.MMDIT_QK)
    for f in ("run_precision", "run_adam", "run_recipes", "run_loss_scaling", "run_spikes", "nan_locator_lines"):
        assert str(getattr(stability, f)(cfg)) == reason(stability.MMDIT_LOOP), f
    res = stability.run_spikes(cfg)
    assert stability.record_runs(rec, "spikes", res) is res and stability.record_table(rec, "x", res) is res
    assert "\n".join(stability.spike_verdict_lines(res, cfg.provoke_step)) == str(res)
    assert stability.diff_heatmaps(stability.recipe_diffs(res, 0.02), "logit_max") is res
    assert "\n".join(stability.closing_lines(qk, res, res, res, res)) == str(qk)
    assert rec.frame().empty
    assert str(StabilityExplorer.for_lab(cfg, rec).show()) == reason(stability.MMDIT_LOOP)


def test_lab_08_skips_the_planner_and_keeps_its_synthetic_check():
    cfg = plan_study.PlanLabConfig(device="cpu", step=LLAMA)
    rec = plan_study.recorder(cfg)
    why = reason(plan_study.MMDIT_PLAN)
    assert plan_study.lever_table(cfg).to_string(index=False) == why
    res = plan_study.run(cfg, rec)
    assert str(res) == why and str(res.base.stability) == why and plan_study.periodic_line(res) is res
    assert str(plan_study.check(cfg, res, rec)) == why
    for f in ("base_table", "effects_table", "plans_table", "waterfall_plot", "verify_phases", "seams_verdict",
              "prediction_plot", "recommendations"):  # fmt: skip
        assert getattr(plan_study, f)(res) is res, f
    assert str(PlanExplorer.for_lab(cfg, res, rec).show()) == why
    assert len(plan_study.composition_check()) == 4  # synthetic, no model: it runs on any step
    assert rec.frame().empty
