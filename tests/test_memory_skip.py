"""Lab 05 on a step that is not perflab's MMDiT (issue 24): its MMDiT-only sections (formula,
accounting, the MMDiT's policies, timeline, what fits, FSDP) are skipped, each with one line
saying why, instead of run; on the default step they run.  The study functions are called on a
config directly (no notebook run)."""

from __future__ import annotations

import pandas as pd
import pytest

from lab_utils.core.config import ConfigError
from lab_utils.core.records import Recorder
from lab_utils.step.skip import Skipped
from lab_utils.studies import memory as study

FLUX = "lab_utils.step.examples:flux_step"
REASON = (
    "skipped: the formula and FSDP projection are MMDiT-only; "
    f"this run measures {FLUX} through the step contract (section 'Your step')"
)
WITH_CFG = ("formula_check", "peak_table")
WITH_CFG_REC = (
    "block_ops",
    "accounting",
    "per_token_table",
    "block_state_table",
    "compare",
    "timeline",
    "fits",
    "fsdp_projection",
    "fsdp_check",
    "confirm_fits",
)


def _rec(cfg) -> Recorder:
    return Recorder(lab=study.LAB, params=cfg.to_dict(), device="cpu")


def test_a_non_default_step_skips_every_mmdit_only_section_with_the_reason():
    cfg = study.MemoryLabConfig(device="cpu", step=FLUX)
    rec = _rec(cfg)
    out = {f: getattr(study, f)(cfg) for f in WITH_CFG}
    out |= {f: getattr(study, f)(cfg, rec) for f in WITH_CFG_REC}
    for name, res in out.items():
        assert isinstance(res, Skipped), f"{name} ran on {FLUX}: {type(res).__name__}"
        # the notebook's cells print, display and index them: one line, the reason
        assert res.to_string(index=False) == REASON == repr(res), name
        assert res[["world_size", "rank"]].to_string(index=False) == REASON, name
        assert len(res) == 0 and "\n" not in REASON
    for plot in (study.class_bars, study.pareto_plot, study.timeline_plot, study.fits_table):
        assert plot(out["compare"]) is out["compare"]
    assert rec.frame().empty, "a skipped section wrote records"


def test_the_default_step_runs_the_mmdit_sections():
    cfg = study.MemoryLabConfig(device="cpu", batch_size=1, resolution=64)
    assert study.formula_check(cfg).policy.tolist()  # hooks == formula, per policy (raises otherwise)
    rec = _rec(cfg)
    acct = study.accounting(cfg, rec)
    assert isinstance(acct, pd.DataFrame) and len(acct) and not rec.frame().empty


@pytest.mark.parametrize(
    "param,value", [("step_policies", ("none", "checkpoint_everything")), ("step_fit_max_batch", 0)]
)
def test_the_step_section_sizes_are_checked(param, value):
    with pytest.raises(ConfigError, match=param):
        study.MemoryLabConfig(device="cpu", step=FLUX, **{param: value})
