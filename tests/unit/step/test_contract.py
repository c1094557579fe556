"""lab_utils.step.contract: the repeated blocks found in a module tree written here (outermost lists
of two or more children of one class, in module order; a given block class instead), the region
a module belongs to, each block's index within its own list, the capabilities a step declares,
one step's four phases in order, its gradient norm before clipping and the clipped SGD update
against a float64 count, periodic work after every n-th step in its own range, batches compared
leaf by leaf, their skeletons and batch sizes, and the identity a record carries (its parameter
count by hand, a configuration hash that ignores library versions and tells two configurations
apart)."""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import hashlib
import json
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from lab_utils.step.contract import (
    CAPABILITIES,
    STEP_PHASES,
    Periodic,
    StepFactory,
    batch_leaves,
    batch_size_of,
    block_groups,
    blocks,
    config_hash,
    identity,
    region_of,
    run_step,
    same_batch,
    skeleton,
)

from .tiny import B, Block, D, Net, tiny_step


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


class TwoKinds(nn.Module):
    """Two block lists, like an MMDiT's double- and single-stream blocks."""

    def __init__(self):
        super().__init__()
        self.double = nn.ModuleList([Block(), Block(), Block()])
        self.single = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])


def test_each_block_is_counted_within_its_own_list():
    groups = block_groups(blocks(TwoKinds()))
    assert [(n, kind, i) for n, kind, i, _ in groups] == [
        ("double.0", "double", 0), ("double.1", "double", 1), ("double.2", "double", 2),
        ("single.0", "single", 0), ("single.1", "single", 1),
    ]  # fmt: skip
    # interleaved kinds each keep their own count; a name without a list is of kind "blocks"
    a, b = nn.Linear(2, 2), nn.ReLU()
    named = [("x.0", a), ("y.0", b), ("x.1", a), ("top", b), ("y.1", a), ("other", a)]
    assert [(kind, i) for _, kind, i, _ in block_groups(named)] == [
        ("x", 0), ("y", 0), ("x", 1), ("blocks", 0), ("y", 1), ("blocks", 1)]  # fmt: skip
    assert block_groups([]) == []


def test_a_step_has_the_capabilities_it_declares_and_refuses_unknown_names():
    step = tiny_step()
    assert not any(step.has(c) for c in CAPABILITIES)  # the contract alone declares nothing
    step.capabilities = {"tokens": lambda batch: 16, "trainer": object()}
    assert step.has("tokens") and step.has("trainer") and not step.has("policies")
    with pytest.raises(KeyError, match="unknown capability 'token'"):
        step.has("token")


def sgd_step(grad_clip: float = 0.0) -> StepFactory:
    torch.manual_seed(0)
    model = Net(2)
    return StepFactory(model, torch.optim.SGD(model.parameters(), lr=1.0), lambda k: torch.full((B, D), float(k + 1)),
                       lambda m, x: (m(x) ** 2).sum(), grad_clip=grad_clip)  # fmt: skip


def grads_by_hand(step: StepFactory, k: int) -> list[torch.Tensor]:
    """The step's gradients at its current weights, in float64 on a copy of the model."""
    m = copy.deepcopy(step.model).double()
    (m(step.make_batch(k).double()) ** 2).sum().backward()
    return [p.grad for p in m.parameters()]


@pytest.mark.parametrize("clip", [0.0, 1e-3, 1e9])
def test_the_gradient_norm_is_the_total_before_clipping_and_sgd_moves_by_the_clipped_gradient(clip):
    step = sgd_step(clip)
    before = [p.detach().double().clone() for p in step.model.parameters()]
    g = grads_by_hand(step, 2)
    total = math.sqrt(sum(float((x**2).sum()) for x in g))
    out = run_step(step, 2)
    if clip == 0:
        assert math.isnan(out.grad_norm)  # no clipping: no norm taken
        scale = 1.0
    else:
        assert out.grad_norm == pytest.approx(total, rel=1e-5)
        scale = min(1.0, clip / (total + 1e-6))  # clip_grad_norm_'s rule; 1e9: no change
    for p0, p1, gp in zip(before, step.model.parameters(), g):
        torch.testing.assert_close(p1.detach().double(), p0 - scale * gp, rtol=1e-4, atol=1e-7)  # lr 1
    assert torch.equal(out.batch, torch.full((B, D), 3.0))  # the batch of step 2


@pytest.mark.parametrize("every, due", [(1, [0, 1, 2, 3, 4, 5, 6]), (3, [2, 5]), (7, [6]), (8, [])])
def test_periodic_work_runs_after_every_nth_step_in_its_own_phase(every, due):
    step = tiny_step()
    seen = []
    step.periodic = (Periodic("checkpoint", every, seen.append),)
    for k in range(7):
        run_step(step, k)
    assert seen == due  # after step k when (k + 1) % every == 0


def test_a_periodic_phase_is_a_range_after_the_optimizer_unless_the_factory_opens_it():
    step = tiny_step()
    step.periodic = (Periodic("checkpoint", 2, lambda k: None),)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step(step, 0)  # (0 + 1) % 2: not due
        run_step(step, 1)  # due
    names = [e.name for e in prof.events() if e.name in (*STEP_PHASES, "checkpoint")]
    assert names == [*STEP_PHASES, *STEP_PHASES, "checkpoint"]

    def own_range(k):
        with torch.profiler.record_function("checkpoint"):
            pass

    step.periodic, step.phases = (Periodic("checkpoint", 1, own_range),), ("checkpoint",)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step(step, 0)
    assert [e.name for e in prof.events()].count("checkpoint") == 1  # opened once, by the factory


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    label: str


@pytest.mark.parametrize(
    "a, b, same",
    [
        (torch.ones(2, 3), torch.ones(2, 3), True),
        (torch.ones(2, 3), torch.ones(3, 2), False),  # shape
        (torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64), False),  # dtype
        (torch.ones(2, 3), torch.ones(2, 3).index_put_((torch.tensor(1), torch.tensor(2)), torch.tensor(2.0)), False),
        ({"a": torch.zeros(1), "b": 1}, {"b": 1, "a": torch.zeros(1)}, True),  # key order is no difference
        ({"a": torch.zeros(1), "b": 1}, {"a": torch.zeros(1), "b": 2}, False),
        ([torch.zeros(1)], [torch.zeros(1), torch.zeros(1)], False),  # a leaf more
        ([], [], True),
        (torch.zeros(1), 0.0, False),  # a tensor against a number
        (0.0, torch.zeros(1), False),
        (Pair(torch.ones(2), "a"), Pair(torch.ones(2), "a"), True),
        (Pair(torch.ones(2), "a"), Pair(torch.ones(2), "b"), False),
        ((None, "x"), (None, "x"), True),
    ],
)
def test_same_batch_compares_every_leaf(a, b, same):
    assert same_batch(a, b) is same and same_batch(b, a) is same


def test_the_leaves_skeleton_and_batch_size_of_a_nested_batch():
    Named = collections.namedtuple("Named", "ids mask")
    batch = {"z": Pair(torch.zeros(3, 2), "img"), "a": [torch.ones(3, 4, dtype=torch.bfloat16), 7], "n": None}
    leaves = batch_leaves(batch)
    assert [type(x).__name__ for x in leaves] == ["Tensor", "int", "NoneType", "Tensor", "str"]  # keys sorted: a n z
    sk = skeleton(batch)
    assert sk["z"].x.device.type == "meta" and sk["z"].x.shape == (3, 2) and sk["z"].label == "img"
    assert sk["a"][0].dtype == torch.bfloat16 and sk["a"][0].is_meta and sk["a"][1] == 7 and sk["n"] is None
    assert isinstance(sk["a"], list) and batch["z"].x.device.type == "cpu"  # the batch itself untouched
    nt = Named(torch.ones(5, 2), torch.ones(5))
    assert skeleton(nt) is nt  # a named tuple is kept as it is
    assert batch_size_of(batch) == 3  # the first tensor in leaf order: the list under "a"
    assert batch_size_of([torch.tensor(2.0), torch.zeros(6, 1)]) == 6  # a scalar tensor has no batch size
    assert batch_size_of({"n": 1, "s": "x"}) is None and batch_size_of(torch.tensor(1.0)) is None


def test_a_step_without_parameters_is_on_the_cpu_and_an_unloaded_one_cannot_rebuild():
    m = nn.ReLU()
    step = StepFactory(m, torch.optim.SGD([torch.zeros(1, requires_grad=True)]), lambda k: None, lambda m, b: None)
    assert step.device == torch.device("cpu")
    with pytest.raises(ValueError, match="step unnamed has no source to rebuild from"):
        step.rebuild(batch_size=2)


def test_a_factory_that_names_no_clip_never_clips():
    torch.manual_seed(0)
    model = Net(2)
    step = StepFactory(model, torch.optim.SGD(model.parameters(), lr=1.0), lambda k: torch.full((B, D), 3.0),
                       lambda m, x: (m(x) ** 2).sum())  # fmt: skip
    assert (step.grad_clip, step.phases, step.periodic, dict(step.capabilities)) == (0.0, (), (), {})
    before = [p.detach().double().clone() for p in model.parameters()]
    g = grads_by_hand(step, 2)
    assert math.sqrt(sum(float((x**2).sum()) for x in g)) > 1.0  # a clip at 1 would change this update
    assert math.isnan(run_step(step, 2).grad_norm)
    for p0, p1, gp in zip(before, model.parameters(), g):
        torch.testing.assert_close(p1.detach().double(), p0 - gp, rtol=1e-4, atol=1e-7)  # the whole gradient


class Mode(enum.IntEnum):
    TRAIN = 1
    EVAL = 2


class Tag(str):
    """A string that carries an attribute (it has a ``__dict__``): still one plain leaf."""


@pytest.mark.parametrize(
    "leaf", [Mode.TRAIN, Tag("img"), True, 3, 2.5, "s", None, np.float64(1.5), np.int64(4)], ids=repr
)
def test_a_plain_value_is_one_leaf_even_when_it_has_attributes(leaf):
    if isinstance(leaf, Tag):
        leaf.source = "loader"
    x = torch.ones(2)
    assert batch_leaves(leaf) == [leaf]
    got = batch_leaves({"x": x, "mode": leaf})  # keys sorted: mode, x
    assert len(got) == 2 and got[0] is leaf and got[1] is x
    assert same_batch({"m": Mode.TRAIN, "x": x}, {"m": Mode.TRAIN, "x": x.clone()})
    assert not same_batch({"m": Mode.TRAIN, "x": x}, {"m": Mode.EVAL, "x": x})
