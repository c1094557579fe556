"""The step contract (lab_utils.step): a factory that does not import, returns the wrong thing,
or whose step would be measured wrong is refused before anything is measured, with a
ConfigError naming ``step``, the value and what was seen; the step is resolved once per run;
blocks are detected from repeated children; the identity keeps two models apart."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from torch import nn

from lab_utils.core.config import ConfigError
from lab_utils.step import load as step_load
from lab_utils.step.contract import StepFactory, blocks, identity, region_of, run_step, same_batch
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
    s.make_batch = lambda k: torch.ones(2, 5) * k  # the model takes 4 features
    return s


def no_grad_loss() -> StepFactory:
    s = good()
    s.loss = lambda model, x: torch.tensor(1.0)
    return s


def per_sample_loss(batch_size: int = 2) -> StepFactory:
    """The loss of each sample, shape [batch_size]: at batch 1 a one-element [1] tensor."""
    s = good(batch_size=batch_size)
    s.loss = lambda model, x: model(x).square().mean(dim=1)
    return s


def squeezed_loss(batch_size: int = 2) -> StepFactory:
    """Per sample, squeezed: zero-dimensional at batch 1 only."""
    s = good(batch_size=batch_size)
    s.loss = lambda model, x: model(x).square().mean(dim=1).squeeze()
    return s


def unseeded_batches() -> StepFactory:
    s = good()
    s.make_batch = lambda k: torch.randn(2, 4)  # a new draw every call
    return s


def one_batch_for_all() -> StepFactory:
    s = good()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(5))
    s.make_batch = lambda k: x
    return s


def nan_gradients() -> StepFactory:
    s = good()
    s.model.out.weight.register_hook(lambda g: g * float("nan"))  # a finite loss, a NaN gradient
    return s


def optimizer_fails() -> StepFactory:
    s = good()

    def broken(*a, **k):
        raise RuntimeError("no optimizer state on this device")

    s.optimizer.step = broken
    return s


NOT_A_FUNCTION = 3

HERE = __name__


@pytest.mark.parametrize(
    "spec, keywords, reason",
    [
        ("no_such_package_xyz.models:step", {}, "importing 'no_such_package_xyz.models' failed"),
        (f"{HERE}:missing", {}, f"module {HERE!r} has no attribute 'missing'"),
        (f"{HERE}:NOT_A_FUNCTION", {}, "is a int, not a function"),
        ("not a spec", {}, "a string such as"),
        (f"{HERE}:returns_dict", {}, "it returned a dict, not a lab_utils.step.contract.StepFactory"),
        (f"{HERE}:raises_when_called", {}, "calling it failed: RuntimeError: no weights here"),
        (f"{HERE}:nan_loss", {}, "its first loss is nan"),
        (f"{HERE}:forward_fails", {}, "its first step failed in the forward: RuntimeError"),
        (f"{HERE}:no_grad_loss", {}, "its loss does not require grad"),
        # a per-sample loss of shape [1] at batch 1 is one number, not a zero-dimensional tensor
        (f"{HERE}:per_sample_loss", {"batch_size": 1}, "its loss at batch size 2 is a tensor of shape [2]"),
        (f"{HERE}:per_sample_loss", {"batch_size": 2}, "its loss at batch size 2 is a tensor of shape [2]"),
        (f"{HERE}:per_sample_loss", {"batch_size": 3}, "its loss at batch size 2 is a tensor of shape [2]"),
        # squeezed: zero-dimensional at the lab's batch size 1, refused at 2
        (f"{HERE}:squeezed_loss", {"batch_size": 1}, "its loss at batch size 2 is a tensor of shape [2]"),
        (f"{HERE}:unseeded_batches", {}, "make_batch(0) gave two different batches"),
        (f"{HERE}:one_batch_for_all", {}, "make_batch(0) and make_batch(1) gave the same batch"),
        (f"{HERE}:nan_gradients", {}, "its first gradients are not finite in 1 of 10 parameters ('out.weight')"),
        (f"{HERE}:optimizer_fails", {}, "its first optimizer step failed: RuntimeError: no optimizer state"),
    ],
)
def test_a_bad_factory_is_refused_naming_step_the_value_and_what_was_seen(spec, keywords, reason):
    with pytest.raises(ConfigError) as e:
        load_step(spec, **keywords)
    assert e.value.param == "step" and e.value.value == spec
    assert reason in str(e.value), str(e.value)


def test_a_one_element_loss_is_refused_at_the_labs_batch_size_when_two_is_not_asked():
    """A factory that takes no batch size is checked at its own: a [1] loss there is refused."""

    def fixed():
        s = good(batch_size=1)
        s.loss = lambda model, x: model(x).square().mean(dim=1)  # [1]
        return s

    src = step_load.StepSource("x:fixed", fixed)
    with pytest.raises(ConfigError, match=r"its loss is a tensor of shape \[1\], not a zero-dimensional"):
        step_load.check_at_two(src)  # no batch_size keyword: nothing built at 2
        step_load.first_step("x:fixed", src.build())


def test_the_config_check_is_the_form_only_the_first_cell_imports():
    with pytest.raises(ConfigError) as e:
        check_step_spec("not a spec")
    assert e.value.param == "step"
    assert check_step_spec("no_such_package_xyz:f") == "no_such_package_xyz:f"  # imported by load_step
    assert check_step_spec(DEFAULT_STEP) == DEFAULT_STEP


def test_a_good_factory_loads_has_taken_its_first_step_and_is_named():
    ref = good()
    s = load_step(f"{HERE}:good")
    assert s.name == f"{HERE}:good" and s.source.spec == s.name
    assert all(p.grad is None for p in s.model.parameters())  # zero_grad after step 0
    moved = [not torch.equal(a, b) for a, b in zip(s.model.parameters(), ref.model.parameters())]
    assert all(moved), "the checked step is the one returned: its weights took step 0"
    assert [n for n, _ in blocks(s)] == ["layers.0", "layers.1", "layers.2"]  # the Sequentials inside are not blocks
    assert blocks(s.model, nn.Linear)[0][0] == "inp"
    assert region_of("layers.1.0", ["layers.0", "layers.1"]) == "layers.1"
    assert region_of("out", ["layers.0"]) == "out" and region_of("", []) == "model"


def test_the_step_is_resolved_once_and_rebuilt_from_that_function(monkeypatch):
    calls = []
    real = importlib.import_module
    monkeypatch.setattr(step_load.importlib, "import_module", lambda name: calls.append(name) or real(name))
    s = load_step(f"{HERE}:good", batch_size=2)
    bigger = s.rebuild(batch_size=5)
    assert bigger.make_batch(0).shape == (5, 4) and bigger.source.keywords["batch_size"] == 5
    assert s.rebuild().make_batch(3).shape == (2, 4)
    assert calls == [HERE], calls  # imported once: at load; the builds reuse the function


def test_run_step_opens_the_phases_the_factory_does_not_and_clips():
    s = load_step(f"{HERE}:good")
    s.grad_clip = 1e-3
    out = run_step(s, 1)
    assert out.loss.dim() == 0 and not out.loss.requires_grad and out.grad_norm > 1e-3
    assert same_batch(out.batch, s.make_batch(1)) and not same_batch(out.batch, s.make_batch(2))


def test_the_identity_keeps_two_models_apart_and_two_builds_of_one_together():
    a, b, c = load_step(f"{HERE}:good"), load_step(f"{HERE}:good"), load_step(f"{HERE}:wider")
    ia, ib, ic = identity(a), identity(b), identity(c)
    assert ia == ib
    assert ia.key != ic.key and ia.config_hash != ic.config_hash and ia.parameters != ic.parameters
    # hand count of Tiny(8): 4*8+8 + 3*(8*8+8) + 8+1
    assert ia.parameters == 40 + 216 + 9


class Dot(nn.Module):
    """loss = w . a: the gradient is the batch itself, so the clipped step is known by hand."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))

    def forward(self, a):
        return (self.w * a).sum()


def clipped(grad_clip: float = 0.0) -> StepFactory:
    m = Dot()
    s = StepFactory(
        m, torch.optim.SGD(m.parameters(), lr=1.0), lambda k: torch.tensor([3.0, 4.0]) * (k + 1), lambda mm, a: mm(a)
    )
    s.grad_clip = grad_clip
    return s


@pytest.mark.parametrize(
    "clip, want",
    [
        (0.0, [-3.0, -4.0]),  # no clipping: w1 = -lr * a, a = [3, 4] (norm 5)
        (0.5, [-0.3, -0.4]),  # clipped to norm 0.5: -a * 0.5 / 5
        (1.0, [-0.6, -0.8]),
        (10.0, [-3.0, -4.0]),  # over the norm: left as it is
    ],
)
def test_the_checked_first_step_clips_the_gradient_norm_to_grad_clip(clip, want):
    s = clipped(clip)
    step_load.first_step("t:clipped", s)
    torch.testing.assert_close(s.model.w.detach(), torch.tensor(want))


def test_build_step_takes_the_factory_keywords_and_refuses_others():
    s = step_load.build_step(f"{HERE}:good", batch_size=3, seed=1, device="cpu")
    assert s.make_batch(0).shape == (3, 4)
    assert step_load.build_step(f"{HERE}:good").make_batch(0).shape == (2, 4)
    with pytest.raises(ConfigError, match="colour"):
        step_load.build_step(f"{HERE}:good", colour="red")


def test_a_folder_on_the_step_path_comes_before_everything_on_sys_path(tmp_path, monkeypatch):
    name = f"shadowed_step_{tmp_path.name}".replace("-", "_")
    first, mine = tmp_path / "first", tmp_path / "mine"
    for d, width in ((first, 3), (mine, 5)):
        d.mkdir()
        (d / f"{name}.py").write_text(f"def width():\n    return {width}\n")
    monkeypatch.syspath_prepend(str(first))  # already at sys.path[0], holding a module of the same name
    monkeypatch.setenv(step_load.STEP_PATH_ENV, str(mine))
    monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        assert step_load.resolve_factory(f"{name}:width")() == 5
    finally:
        sys.modules.pop(name, None)
