"""Telemetry's figures against a direct computation on a toy model whose blocks are plain
linear layers: activation RMS and max per block, gradient norms unscaled by the loss scale,
update ratio and lost-update fraction of a hand-made step, loss per timestep bucket; the
NaN locator on a NaN that enters with the input; the numerics diff's relative difference."""

import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from lab_utils.stability.numdiff import numerics_diff, rel_diff
from lab_utils.stability.telemetry import NaNLocator, Telemetry


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.double_blocks = nn.ModuleList([nn.Linear(6, 6)])
        self.single_blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.head = nn.Linear(6, 1)  # outside the blocks: in the total gradient norm only

    def forward(self, x):
        for blk in (*self.double_blocks, *self.single_blocks):
            x = blk(x)
        return self.head(x)


BLOCKS = ("double_blocks.0", "single_blocks.0", "single_blocks.1")


def value(df, stat, block="", stream=None):
    sel = (df.stat == stat) & (df.block == block)
    if stream is not None:
        sel &= df.stream == stream
    (v,) = df[sel].value.to_numpy()
    return float(v)


def test_activation_and_gradient_figures_equal_a_direct_computation():
    model = Toy()
    outs = {}
    for name in BLOCKS:
        model.get_submodule(name).register_forward_hook(lambda m, a, o, name=name: outs.__setitem__(name, o.detach()))
    tel = Telemetry(model)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    scale = 4.0  # a loss scaler's factor: the grads are 4x the true ones
    tel.begin_step(0)
    (model(x).square().mean() * scale).backward()
    tel.after_backward(grad_scale=scale)
    tel.end_step()
    df = tel.frame()
    for name in BLOCKS:
        o = outs[name].double()
        assert value(df, "act_rms", name) == pytest.approx(float(o.square().mean().sqrt()), rel=1e-6)
        assert value(df, "act_max", name) == pytest.approx(float(o.abs().max()), rel=1e-6)
        g = torch.cat([p.grad.double().flatten() for p in model.get_submodule(name).parameters()])
        assert value(df, "grad_norm", name) == pytest.approx(float(g.norm()) / scale, rel=1e-6)
    every = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    assert value(df, "grad_norm", "total") == pytest.approx(float(every.norm()) / scale, rel=1e-6)
    tel.close()


def test_update_ratio_and_lost_updates_of_a_hand_made_step():
    """single_blocks.0 moves by 0.1 everywhere except 6 weight elements; 4 of those 6 had a
    non-zero gradient (lost updates), 2 had none (nothing to lose)."""
    model = Toy()
    tel = Telemetry(model)
    blk = model.single_blocks[0]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    blk.weight.grad[0, :2] = 0.0
    tel.begin_step(0)
    tel.before_step()
    old = [p.detach().clone() for p in blk.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p += 0.1
        blk.weight[0, :6] = old[0][0, :6]  # these six did not move
    tel.after_step()
    tel.end_step()
    df = tel.frame()
    moved = torch.cat([(p.detach() - o).flatten() for p, o in zip(blk.parameters(), old)]).double()
    before = torch.cat([o.flatten() for o in old]).double()
    assert value(df, "update_ratio", "single_blocks.0") == pytest.approx(float(moved.norm() / before.norm()), rel=1e-5)
    n = sum(p.numel() for p in blk.parameters())  # 42: weight 36 + bias 6
    assert value(df, "lost_update_frac", "single_blocks.0") == pytest.approx(4 / n)
    assert value(df, "lost_update_frac", "single_blocks.1") == 0.0
    tel.close()


def test_loss_per_timestep_bucket():
    tel = Telemetry(Toy(), timestep_buckets=4)
    tel.begin_step(0)
    tel.log_loss(torch.tensor([0.1, 0.3, 0.6, 0.9, 0.95]), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    tel.end_step()
    df = tel.frame()
    assert value(df, "loss") == 3.0
    buckets = df[df.stat == "loss_bucket"].set_index("stream").value.to_dict()
    assert buckets == {"t0.00-0.25": 1.0, "t0.25-0.50": 2.0, "t0.50-0.75": 3.0, "t0.75-1.00": 4.5}


def test_a_nan_entering_with_the_input_is_located_at_the_first_block_input():
    model = Toy()
    x = torch.randn(3, 6)
    x[1, 2] = math.nan
    with NaNLocator(model) as loc:
        model(x)
    assert loc.forward.module == "double_blocks.0" and loc.forward.tensor == "input[0]"
    assert loc.forward.nan == 1


def test_relative_difference_by_hand():
    a = [1.0, 0.0, math.nan, math.inf, 1.0, -2.0]
    b = [2.0, 0.0, math.nan, -math.inf, math.nan, -2.0]
    np.testing.assert_array_equal(rel_diff(a, b), [0.5, 0.0, 0.0, 1.0, 1.0, 0.0])
    assert rel_diff([0.0], [5e-5], floor=1e-2)[0] == pytest.approx(5e-3)  # against the floor, not the values


def test_a_few_lost_updates_against_none_are_no_divergence():
    """0 lost updates in one run and 5e-5 in the other: within the default floor of that
    statistic (1e-2), so no divergence at tol 0.05; the same gap in another statistic is one."""

    def frame(v):
        rows = [
            dict(step=s, block="single_blocks.0", stream="", stat=st, value=v if s == 1 else 0.5)
            for s in (0, 1)
            for st in ("lost_update_frac", "update_ratio")
        ]
        return pd.DataFrame(rows)

    d = numerics_diff(frame(0.0), frame(5e-5), tol=0.05)
    first = d.first.set_index("stat").first_step
    assert first["lost_update_frac"] == -1 and first["update_ratio"] == 1


def test_the_loss_is_the_mean_of_the_per_sample_losses():
    """Per-sample losses 1, 2 and 9: the logged loss is their mean, 4 (the median would be 2)."""
    tel = Telemetry(Toy(), timestep_buckets=1)
    tel.begin_step(0)
    tel.log_loss(torch.tensor([0.2, 0.5, 0.8]), torch.tensor([1.0, 2.0, 9.0]))
    tel.end_step()
    df = tel.frame()
    assert value(df, "loss") == 4.0 and value(df, "loss_bucket") == 4.0


def _act_rows(step_values: dict[int, tuple[float, float]]) -> pd.DataFrame:
    """act_rms of double_blocks.0, img and txt streams, per step."""
    return pd.DataFrame(
        [
            dict(step=s, block="double_blocks.0", stream=stream, stat="act_rms", value=v)
            for s, vals in step_values.items()
            for stream, v in zip(("img", "txt"), vals)
        ]
    )


def test_a_divergence_in_one_stream_is_the_blocks_divergence():
    """Streams are reduced by max: at step 1 the img stream differs by 8% (1.0 against 0.92), the
    txt stream not at all; the block diverges there at tol 0.05 (a mean over streams, 4%, would not)."""
    a = _act_rows({0: (1.0, 2.0), 1: (1.0, 2.0)})
    b = _act_rows({0: (1.0, 2.0), 1: (0.92, 2.0)})
    d = numerics_diff(a, b, tol=0.05)
    cell = d.cells[(d.cells.step == 1) & (d.cells.block == "double_blocks.0")]
    assert cell.rel_diff.item() == pytest.approx(0.08)
    assert d.first.set_index("stat").first_step["act_rms"] == 1


def test_a_difference_of_exactly_tol_is_not_a_divergence():
    """|1 - 0.75| / 1 = 0.25 exactly (binary fractions): at tol 0.25 no divergence; 0.7499 is one."""
    a = _act_rows({0: (1.0, 1.0), 1: (1.0, 1.0)})
    at = numerics_diff(a, _act_rows({0: (1.0, 1.0), 1: (0.75, 1.0)}), tol=0.25)
    assert at.first.first_step.tolist() == [-1] and at.origin == {}
    beyond = numerics_diff(a, _act_rows({0: (1.0, 1.0), 1: (0.7499, 1.0)}), tol=0.25)
    assert beyond.first.first_step.tolist() == [1] and beyond.origin == {"act_rms": ("double_blocks.0", 1)}
