"""lab_utils.traces.phases: the phase of a range name by hand, for the examples the module note lists
and the lab trainer's own names; the name's normalisation, the first matching rule winning, the
``ProfilerStep`` ranges having none, a user's rules before (or instead of) the defaults, a bad rule
refused, the rules in the order they are tried, and the MMDiT block label."""

from __future__ import annotations

import pytest

from lab_utils.core.config import ConfigError
from lab_utils.traces import PhaseTable
from lab_utils.traces.phases import DEFAULT_RULES, LAB_PHASES, block_of, normalise

# the module note's table, example by example, and names of real traces (written out by hand)
DOCUMENTED = {
    "nccl:all_reduce": "communication",
    "gloo:broadcast": "communication",
    "c10d::allreduce_": "communication",
    "all2all_pooled": "communication",
    "alltoall": "communication",
    "Optimizer.step#SGD.step": "optimizer",
    "Optimizer.zero_grad#SGD.zero_grad": "optimizer",
    "## optimizer ##": "optimizer",
    "optimizer": "optimizer",
    "## backward ##": "backward",
    "backward": "backward",
    "## forward ##": "forward",
    "forward": "forward",
    "DistributedDataParallel.forward": "forward",
    "text_encoding": "encoders",
    "image_encoding": "encoders",
    "text_encoder": "encoders",
    "vae.encode": "encoders",
    "data_loading": "data",
    "## data_load ##": "data",
    "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__": "data",
    "checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "dcp.save": "checkpoint",
}


@pytest.mark.parametrize(("name", "phase"), sorted(DOCUMENTED.items()))
def test_each_documented_range_name_has_its_phase(name, phase):
    assert PhaseTable().phase(name) == phase


def test_the_lab_trainers_range_names_have_their_phase():
    t = PhaseTable()
    by_hand = {"data_loading": "data", "text_encoding": "encoders", "image_encoding": "encoders", "forward": "forward",
               "backward": "backward", "optimizer": "optimizer", "checkpoint": "checkpoint"}  # fmt: skip
    assert LAB_PHASES == by_hand
    for name, phase in by_hand.items():
        assert t.phase(name) == phase and t.phase(f"## {name.upper()} ##") == phase


def test_lab_phase_names_stay_in_step_with_the_trainer():
    from lab_utils.model.train import PHASES

    assert tuple(LAB_PHASES) == tuple(PHASES), "copy lab_utils.model.train.PHASES into traces.phases.LAB_PHASES"


def test_a_name_is_normalised_before_the_rules_read_it():
    assert normalise("## Forward ##") == "forward"
    assert normalise("  #  Data_Load#  ") == "data_load"
    assert normalise("enumerate(DataLoader)#_Iter.__next__") == "enumerate(dataloader)#_iter.__next__"  # inner # kept
    assert normalise("") == ""
    assert PhaseTable().phase("   ## BACKWARD ##   ") == "backward"


def test_profiler_steps_and_unknown_names_have_no_phase():
    t = PhaseTable()
    for name in ("ProfilerStep#3", "## ProfilerStep#12 ##", "profilerstep#0", "## encoder fp8 None ##", "", "aten::mm"):
        assert t.phase(name) is None, name
    # a step range that names a phase is still a step range; a user rule matching it changes nothing
    assert t.phase("ProfilerStep#1 forward") is None
    assert PhaseTable(rules=(("profiler", "data"),)).phase("ProfilerStep#1") is None


def test_the_first_matching_rule_wins():
    t = PhaseTable()
    # autograd's backward nodes name their forward op: the backward rule comes before the forward one
    assert t.phase("autograd::engine::evaluate_function: AddmmBackward0") == "backward"
    # a collective inside an optimizer's name is communication: that rule is tried first
    assert t.phase("nccl:all_reduce optimizer") == "communication"
    assert t.phase("optimizer.backward") == "optimizer"


def test_a_users_rules_go_before_the_defaults_or_instead_of_them():
    mine = PhaseTable(rules=(("my_fwd", "forward"), ("^forward$", "backward")))
    assert mine.phase("my_fwd_pass") == "forward"
    assert mine.phase("forward") == "backward"  # before the default rule for the same name
    assert mine.phase("## backward ##") == "backward" and mine.phase("nccl:all_reduce") == "communication"
    only = PhaseTable(rules=(("x", "forward"),), replace=True)
    assert only.phase("## backward ##") is None and only.phase("nccl:all_reduce") is None
    assert only.phase("x_step") == "forward"
    assert PhaseTable(rules=(), replace=True).phase("forward") is None


def test_a_rule_naming_no_phase_or_a_bad_pattern_is_refused():
    with pytest.raises(ConfigError, match="rules"):
        PhaseTable(rules=(("x", "warmup"),))
    with pytest.raises(ConfigError, match="regular expression"):
        PhaseTable(rules=(("(", "forward"),))
    for phase in ("data", "encoders", "forward", "backward", "optimizer", "checkpoint", "communication"):
        assert PhaseTable(rules=(("x", phase),)).phase("x") == phase


def test_the_rules_are_listed_in_the_order_they_are_tried():
    assert PhaseTable(rules=(("x", "forward"), ("y", "data")), replace=True).table() == [
        ("x", "forward"),
        ("y", "data"),
    ]
    t = PhaseTable(rules=(("my_fwd", "forward"),)).table()
    assert t[0] == ("my_fwd", "forward") and t[1:] == [tuple(r) for r in DEFAULT_RULES]
    assert len(PhaseTable().table()) == 8  # seven phases and the lab's exact names
    assert PhaseTable(rules=(), replace=True).table() == []


def test_the_block_label_of_a_range_or_module_name():
    assert block_of("model.double_blocks.12.attn") == "double_blocks.12"
    assert block_of("single_blocks.0") == "single_blocks.0"
    assert block_of("## single_blocks.37.mlp ##") == "single_blocks.37"
    assert block_of("double_blocks") is None and block_of("blocks.3") is None and block_of("") is None


def test_a_tables_repr_shows_its_rules_not_their_compiled_patterns():
    mine = PhaseTable(rules=(("my_fwd", "forward"),))
    assert repr(mine) == "PhaseTable(rules=(('my_fwd', 'forward'),), replace=False)"
    assert mine == PhaseTable(rules=(("my_fwd", "forward"),)) and mine != PhaseTable()
