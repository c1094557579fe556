"""lab_utils.step.contract: the repeated blocks found in a module tree written here (outermost lists
of two or more children of one class, in module order; a given block class instead), the region
a module belongs to, one step's four phases in order, and the identity a record carries (its
parameter count by hand, a configuration hash that ignores library versions and tells two
configurations apart)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from lab_utils.step.contract import STEP_PHASES, StepFactory, blocks, config_hash, identity, region_of, run_step

from .tiny import Block, D, Net, tiny_step


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.parts = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])  # a block's own list: not blocks


class Tree(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(2, 2)
        self.layers = nn.ModuleList([Inner(), Inner(), Inner()])
        self.mixed = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])  # two classes: not blocks
        self.one = nn.ModuleList([Inner()])  # one child: not blocks
        self.head = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))


def test_blocks_are_the_outermost_repeated_children_in_module_order():
    names = [n for n, _ in blocks(Tree())]
    # "one" is no block list (one child), so its Inner's own list of two is found below it
    assert names == ["layers.0", "layers.1", "layers.2", "one.0.parts.0", "one.0.parts.1", "head.0", "head.1"]
    assert [n for n, _ in blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))] == ["0", "1"]  # the root list
    assert [n for n, _ in blocks(Tree(), block_class=Inner)] == ["layers.0", "layers.1", "layers.2", "one.0"]
    step = tiny_step()
    assert [n for n, _ in blocks(step)] == [f"blocks.{i}" for i in range(4)]
    step.block_class = nn.Linear
    assert len(blocks(step)) == 8 and blocks(step)[0][0] == "blocks.0.a"


def test_blocks_of_a_given_class_keep_the_outermost_only():
    tree = nn.Module()
    tree.a = Block()
    tree.a.inner = Block()  # a Block inside a Block: not a block of its own
    tree.b = Block()
    assert [n for n, _ in blocks(tree, block_class=Block)] == ["a", "b"]
    assert [n for n, _ in blocks(tree, block_class=(Block, nn.ReLU))] == ["a", "b"]


@pytest.mark.parametrize(
    "name, region",
    [("blocks.1", "blocks.1"), ("blocks.1.a", "blocks.1"), ("blocks.10.a", "blocks"), ("embed.proj", "embed"),
     ("head", "head"), ("", "model")],
)  # fmt: skip
def test_the_region_of_a_module(name, region):
    assert region_of(name, ["blocks.0", "blocks.1"]) == region  # blocks.10 is not inside blocks.1


def test_one_step_runs_its_four_phases_in_order_and_trains():
    step = tiny_step()
    before = [p.detach().clone() for p in step.model.parameters()]
    want = copy.deepcopy(step.model)(step.make_batch(1)).sum().item()  # the loss of the weights before
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss = run_step(step, 1).loss
    names = [e.name for e in prof.events() if e.name in STEP_PHASES]
    assert names == list(STEP_PHASES) == ["data_loading", "forward", "backward", "optimizer"]
    assert not loss.requires_grad and loss.item() == pytest.approx(want, rel=1e-6)
    assert all(p.grad is None for p in step.model.parameters())  # zero_grad(set_to_none) after the step
    assert any(not torch.equal(a, p) for a, p in zip(before, step.model.parameters()))  # the optimizer stepped


def test_the_identity_a_record_carries():
    step = tiny_step()
    ident = identity(step)
    assert ident.parameters == 4 * 2 * (D * D + D) == 576
    assert ident.factory == "unnamed" and ident.model_class == f"{Net.__module__}.Net"
    assert ident.key == f"unnamed/{Net.__module__}.Net" and str(ident).endswith(
        f"· 576 parameters · config {ident.config_hash}"
    )
    assert ident.as_dict()["parameters"] == 576
    # no config anywhere: the module tree's repr, hashed
    assert ident.config_hash == hashlib.sha256(json.dumps(str(step.model)).encode()).hexdigest()[:12]
    step.name = "pkg.mod:fn"
    assert identity(step).key.startswith("pkg.mod:fn/")


def cfg_step(config) -> StepFactory:
    m = nn.Linear(2, 2)
    return StepFactory(m, torch.optim.SGD(m.parameters(), lr=0.1), lambda k: None, lambda m, b: None, config=config)


def test_the_configuration_hash():
    a = config_hash(cfg_step({"width": 8, "depth": 2}))
    assert a == hashlib.sha256(json.dumps({"depth": 2, "width": 8}).encode()).hexdigest()[:12]  # sorted keys
    assert config_hash(cfg_step({"depth": 2, "width": 8})) == a
    versions = {"width": 8, "depth": 2, "_diffusers_version": "0.30", "transformers_version": "4.4",
                "_name_or_path": "/tmp/x"}  # fmt: skip
    assert config_hash(cfg_step(versions)) == a  # library versions and paths do not change the model
    assert config_hash(cfg_step({"width": 16, "depth": 2})) != a

    class HF:
        def to_dict(self):
            return {"width": 8, "depth": 2}

    assert config_hash(cfg_step(HF())) == a

    @dataclasses.dataclass
    class Cfg:
        depth: int = 2
        width: int = 8

    assert config_hash(cfg_step(Cfg())) == a  # a dataclass instance: its fields
    assert config_hash(cfg_step(Cfg)) == hashlib.sha256(json.dumps(str(Cfg)).encode()).hexdigest()[:12]  # a class
    m = nn.Linear(2, 2)
    m.config = {"width": 8, "depth": 2}  # the model's own config when the factory gives none
    assert config_hash(StepFactory(m, torch.optim.SGD(m.parameters(), lr=0.1), lambda k: None, lambda m, b: None)) == a
