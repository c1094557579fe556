"""The step contract (lab_utils.step): a factory that does not import, returns the wrong
thing or fails its first step is refused with a ConfigError naming ``step``, the value and the
reason; blocks are detected from repeated children; the identity keeps two models apart."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lab_utils.core.config import ConfigError
from lab_utils.step.contract import StepFactory, blocks, identity, region_of
from lab_utils.step.load import DEFAULT_STEP, check_step_spec, load_step


class Tiny(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(3))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        x = self.inp(x)
        for blk in self.layers:
            x = x + blk(x)
        return self.out(x)


def good(width: int = 8, batch_size: int = 2, seed: int = 0) -> StepFactory:
    torch.manual_seed(seed)
    m = Tiny(width)
    return StepFactory(
        m,
        torch.optim.SGD(m.parameters(), lr=0.1),
        lambda k: torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(k)),
        lambda model, x: model(x).square().mean(),
    )


def wider() -> StepFactory:
    return good(width=16)


def returns_dict():
    return {"model": Tiny()}


def raises_when_called():
    raise RuntimeError("no weights here")


def nan_loss() -> StepFactory:
    s = good()
    s.loss = lambda model, x: model(x).sum() * float("nan")
    return s


def forward_fails() -> StepFactory:
    s = good()
    s.make_batch = lambda k: torch.randn(2, 5)  # the model takes 4 features
    return s


def no_grad_loss() -> StepFactory:
    s = good()
    s.loss = lambda model, x: torch.tensor(1.0)
    return s


NOT_A_FUNCTION = 3

HERE = __name__


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("no_such_package_xyz.models:step", "importing 'no_such_package_xyz.models' failed"),
        (f"{HERE}:missing", f"module {HERE!r} has no attribute 'missing'"),
        (f"{HERE}:NOT_A_FUNCTION", "is a int, not a function"),
        ("not a spec", "a string such as"),
        (f"{HERE}:returns_dict", "it returned a dict, not a lab_utils.step.contract.StepFactory"),
        (f"{HERE}:raises_when_called", "calling it failed: RuntimeError: no weights here"),
        (f"{HERE}:nan_loss", "its first loss is nan"),
        (f"{HERE}:forward_fails", "its first step failed in the forward: RuntimeError"),
        (f"{HERE}:no_grad_loss", "its loss does not require grad"),
    ],
)
def test_a_bad_factory_is_refused_naming_step_the_value_and_the_reason(spec, reason):
    with pytest.raises(ConfigError) as e:
        load_step(spec)
    assert e.value.param == "step" and e.value.value == spec
    assert reason in str(e.value), str(e.value)


def test_the_config_check_refuses_what_does_not_import_before_building_anything():
    with pytest.raises(ConfigError) as e:
        check_step_spec("no_such_package_xyz:f")
    assert e.value.param == "step"
    assert check_step_spec(DEFAULT_STEP) == DEFAULT_STEP


def test_a_good_factory_loads_has_taken_its_first_step_and_is_named():
    s = load_step(f"{HERE}:good")
    assert s.name == f"{HERE}:good"
    assert all(p.grad is None for p in s.model.parameters())  # zero_grad after step 0
    assert [n for n, _ in blocks(s)] == ["layers.0", "layers.1", "layers.2"]  # the Sequentials inside are not blocks
    assert blocks(s.model, nn.Linear)[0][0] == "inp"
    assert region_of("layers.1.0", ["layers.0", "layers.1"]) == "layers.1"
    assert region_of("out", ["layers.0"]) == "out" and region_of("", []) == "model"


def test_the_identity_keeps_two_models_apart_and_two_builds_of_one_together():
    a, b, c = load_step(f"{HERE}:good"), load_step(f"{HERE}:good"), load_step(f"{HERE}:wider")
    ia, ib, ic = identity(a), identity(b), identity(c)
    assert ia == ib
    assert ia.key != ic.key and ia.config_hash != ic.config_hash and ia.parameters != ic.parameters
    # hand count of Tiny(8): 4*8+8 + 3*(8*8+8) + 8+1
    assert ia.parameters == 40 + 216 + 9
