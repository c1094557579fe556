"""The stability library: NaN locator, spike detector, stochastic rounding, lost updates,
the optimizer's storage modes, loss scaling, telemetry and the numerics diff."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from lab_utils.core.config import ConfigError
from lab_utils.core.records import Recorder, load_records
from lab_utils.model.mmdit import build_model
from lab_utils.model.train import rf_loss, synthetic_batch
from lab_utils.run.cli import main as perflab
from lab_utils.stability.numdiff import numerics_diff, rel_diff, telemetry_frame
from lab_utils.stability.optim import (
    DynamicLossScaler,
    StabilityAdamW,
    half_ulp,
    lost_update_mask,
    stochastic_round_bf16,
)
from lab_utils.stability.telemetry import (
    Telemetry,
    disable_qk_norm,
    inject_nonfinite,
    locate_nonfinite,
)
from lab_utils.stability.training import RunSpec, SpikeDetector, clip_target, train_run

SEED = 1234
pytestmark = pytest.mark.usefixtures("one_thread")


def _model_and_batch(seed: int = SEED):
    print(f"seed = {seed}")
    model = build_model("tiny", seed=seed).train()
    g = torch.Generator().manual_seed(seed)
    batch = synthetic_batch("tiny", 2, height=48, width=80, txt_len=7, generator=g)
    return model, batch


def _loss_fn(model, batch):
    return lambda: rf_loss(model, batch, torch.Generator().manual_seed(SEED))


# ------------------------------------------------------------------------------ NaN locator
@pytest.mark.parametrize(
    "module,phase",
    [
        ("double_blocks.1", "forward"),
        ("single_blocks.0", "forward"),
        ("double_blocks.1", "backward"),
        ("single_blocks.0", "backward"),
        ("double_blocks.0.img_mlp.fc2", "backward"),
    ],
)
def test_nan_locator_names_the_injected_block(module, phase):
    model, batch = _model_and_batch()
    handle = inject_nonfinite(model, module, phase)
    report = locate_nonfinite(model, _loss_fn(model, batch))
    handle.remove()
    assert report is not None, f"NaN injected into {module} ({phase}) was not found"
    assert report.phase == phase, str(report)
    assert report.block == module.split(".")[0] + "." + module.split(".")[1], str(report)
    assert module in report.module or report.module.startswith(module), str(report)
    assert report.nan >= 1


def test_nan_locator_is_quiet_on_a_finite_step_and_leaves_no_hooks():
    model, batch = _model_and_batch()
    assert locate_nonfinite(model, _loss_fn(model, batch)) is None
    assert all(not m._forward_hooks for m in model.modules())


def test_nan_locator_names_a_module_whose_weight_gradient_alone_is_inf():
    """An Inf in one weight gradient, every activation gradient finite (fp16's usual overflow):
    the locator hooks parameter gradients too and names the module that owns the weight."""
    model, batch = _model_and_batch()
    fc2 = model.double_blocks[1].img_mlp.fc2
    seen = []

    def overflow(g):
        g = g.clone()
        g[0, 0] = math.inf
        return g

    def watch(mod, args, out):  # every module output's gradient, to show they all stay finite
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(seen.append)

    handles = [fc2.weight.register_hook(overflow), *(m.register_forward_hook(watch) for m in model.modules())]
    report = locate_nonfinite(model, _loss_fn(model, batch))
    for h in handles:
        h.remove()
    assert len(seen) > 20 and all(bool(torch.isfinite(g).all()) for g in seen)
    assert report is not None, "an Inf in a weight gradient alone was not located"
    assert (report.phase, report.module, report.block) == ("backward", "double_blocks.1.img_mlp.fc2", "double_blocks.1")
    assert report.tensor == "grad of weight" and report.inf == 1 and report.nan == 0, str(report)
    assert all(not p._backward_hooks for p in model.parameters()), "the locator leaves no parameter hooks"


def test_training_locates_a_weight_gradient_overflow():
    res = train_run(RunSpec(steps=3, batch_size=2, nan_module="double_blocks.0", nan_phase="weight", nan_step=1))
    assert res.steps.action.tolist() == ["step", "non-finite: skipped", "step"]
    ((i, rep),) = res.nonfinite
    assert i == 1 and rep is not None and rep.block == "double_blocks.0" and rep.tensor.startswith("grad of ")


def test_training_skips_and_locates_a_nonfinite_step():
    res = train_run(RunSpec(steps=4, batch_size=2, nan_module="single_blocks.1", nan_phase="backward", nan_step=1))
    assert res.steps.action.tolist() == ["step", "non-finite: skipped", "step", "step"]
    (i, rep), *_ = res.nonfinite
    assert i == 1 and rep.block == "single_blocks.1" and rep.phase == "backward"
    assert math.isfinite(res.steps.loss.iloc[-1])


# ------------------------------------------------------------------------------ spikes
def test_spike_detector_on_a_series():
    det = SpikeDetector(window=8, threshold=6.0, min_history=4)
    g = torch.Generator().manual_seed(SEED)
    series = (2.0 + 0.05 * torch.randn(30, generator=g)).tolist()
    assert not any(det.observe(x, 1.0).spike for x in series)
    assert det.observe(20.0, 1.0).spike
    assert det.observe(2.0, 50.0).spike
    assert det.observe(float("nan"), 1.0).spike
    assert not det.observe(2.0, 1.0).spike


POISONED = dict(steps=12, batch_size=2, provoke_step=9, seed=0)


@functools.cache
def _poisoned_run(policy: str):
    # a poisoned batch at step 9: one spike, which every policy answers once (rewind: to step 8's checkpoint)
    return train_run(RunSpec(provoke="batch", spike_policy=policy, ckpt_every=4, name=policy, **POISONED))


def test_spike_detector_fires_on_a_provoked_spike_and_not_on_a_clean_run():
    clean = train_run(RunSpec(**POISONED))
    assert not clean.steps.spike.any(), clean.steps[["step", "loss", "z_loss", "z_grad"]]
    poisoned = _poisoned_run("skip")
    assert poisoned.steps.step[poisoned.steps.spike.astype(bool)].tolist() == [9]
    assert poisoned.steps.action.iloc[9] == "spike: skipped"
    rewound = _poisoned_run("rewind")
    assert rewound.steps.action.iloc[9] == "rewound: batch skipped" and rewound.replayed_steps == 1
    # skipping the poisoned batch's update or rewinding past it gives the same weights
    assert rewound.steps.loss.iloc[-1] == pytest.approx(poisoned.steps.loss.iloc[-1], rel=1e-5)


@pytest.mark.parametrize("policy", ["none", "skip", "clip", "rewind"])
def test_the_spike_steps_loss_is_in_the_telemetry_under_every_policy(policy):
    """The spike step ran its forward under every policy: its loss and per-timestep losses are in
    the telemetry once, the values of the step every policy computed alike (the policies part after)."""
    t, skip = _poisoned_run(policy).telemetry, _poisoned_run("skip")
    at = t[t.step == POISONED["provoke_step"]].set_index(["stat", "stream"]).value
    assert (at.index.get_level_values("stat") == "loss").sum() == 1, at
    assert (at.index.get_level_values("stat") == "loss_bucket").sum() >= 1, at
    assert at["loss", ""] == skip.steps.loss.iloc[POISONED["provoke_step"]]  # the poisoned batch's loss
    s = skip.telemetry
    ref = s[(s.step == POISONED["provoke_step"]) & s.stat.isin(["loss", "loss_bucket"])].set_index(["stat", "stream"])
    pd.testing.assert_series_equal(at[at.index.get_level_values("stat").isin(["loss", "loss_bucket"])], ref.value)


def test_rewind_and_skip_that_computed_the_same_numbers_do_not_diverge():
    """Rewinding past the poisoned batch computes exactly what skipping it does: the numerics
    diff of the two runs' telemetry finds no origin and no row that one run has and the other lacks."""
    skip, rewind = _poisoned_run("skip"), _poisoned_run("rewind")
    d = numerics_diff(skip.telemetry, rewind.telemetry, tol=1e-6)
    assert d.origin == {}, (d.origin, d.one_sided.head())
    assert d.one_sided.empty and d.steps_only == {"a": [], "b": []}
    assert d.shared == len(skip.telemetry) == len(rewind.telemetry)


@functools.cache
def _policy_run(policy: str, precision: str = "fp32"):
    # a one-step learning-rate jump at step 12 spikes steps 13, 14, 15 (the replays jump again):
    # the rewind policy goes back to the checkpoint of step 10 twice, then to step 15's
    spec = RunSpec(steps=17, batch_size=2, provoke="lr", provoke_step=12, ckpt_every=5, seed=0, precision=precision)
    return train_run(dataclasses.replace(spec, spike_policy=policy, name=policy))


@pytest.mark.parametrize("precision", ["fp32", "bf16_master"])
def test_rewinds_to_one_checkpoint_replay_the_skip_policy_exactly(precision):
    """A checkpoint is held by value: after two rewinds to it the run computes exactly what the
    skip policy computes (same weights, Adam moments, fp32 master copies) on every step both
    take; a replay that updated the checkpoint's moments in place parted at the second rewind."""
    skip, rewind = _policy_run("skip", precision), _policy_run("rewind", precision)
    assert rewind.replayed_steps == 3 + 4  # back to step 10 from 13 and from 14; from 15 to its own checkpoint
    a, b = skip.steps, rewind.steps
    assert b.action.tolist()[12:] == ["step", *["rewound: batch skipped"] * 3, "step"]
    assert a.action.tolist()[12:] == ["step", *["spike: skipped"] * 4]
    took = (b.action != "rewound: batch skipped").to_numpy()
    np.testing.assert_array_equal(b.loss.to_numpy()[took], a.loss.to_numpy()[took])  # bitwise, steps 0-12 and 16
    np.testing.assert_array_equal(b.grad_norm.to_numpy()[took], a.grad_norm.to_numpy()[took])


def test_rewind_keeps_one_telemetry_row_per_step_the_replayed_one():
    skip, rewind = _policy_run("skip", "fp32"), _policy_run("rewind", "fp32")
    keys = ["step", "block", "stream", "stat"]
    t = rewind.telemetry
    assert not t.duplicated(keys).any(), t[t.duplicated(keys, keep=False)].sort_values(keys).head()
    assert sorted(t.step.unique()) == list(range(17))
    # the replayed steps' rows are the replay's: equal to the skip run's, which took those steps once
    replayed = t[t.step.between(10, 12)].set_index(keys).value.sort_index()
    s = skip.telemetry
    once = s[s.step.between(10, 12)].set_index(keys).value.sort_index()
    pd.testing.assert_series_equal(replayed, once)


def test_rewind_restores_the_optimizer_by_value():
    torch.manual_seed(SEED)
    p = nn.Parameter(torch.randn(33, 7).bfloat16())
    opt = StabilityAdamW([p], lr=1e-3, mode="master", seed=SEED)
    p.grad = torch.randn_like(p)
    opt.step()
    snap = opt.snapshot()
    kept = {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    for _ in range(2):
        opt.restore(snap)
        assert opt.state[p]["master"].dtype == torch.float32 and opt.state[p]["m"].dtype == torch.float32
        p.grad = torch.randn_like(p)
        opt.step()  # updates the restored copies, never the snapshot
    for k, v in kept.items():
        assert torch.equal(snap["state"][p][k], v), k


def _by_hand(steps: pd.DataFrame, k: int, grad_clip: float, window: int = 16) -> tuple[float, float]:
    """(window median raw norm, the clip rule's post-clip norm) of spike step ``k``, from the rows:
    the last ``window`` accepted steps before it (none of them a spike)."""
    before = steps[steps.step < k]
    assert not before.spike.any()
    med = float(np.median(before.grad_norm.to_numpy()[-window:]))
    ref = min(grad_clip, med) if grad_clip > 0 else med
    return med, ref * med / float(steps.grad_norm[k])


@pytest.mark.parametrize("grad_clip", [0.0, 5.0])  # off; a guard rail above every typical norm (~1.4)
def test_clip_policy_in_the_median_case_scales_the_spike_by_its_excess(grad_clip):
    kw = dict(steps=14, batch_size=2, provoke="batch", provoke_step=10, seed=0, grad_clip=grad_clip)
    none = train_run(RunSpec(spike_policy="none", **kw)).steps
    clip = train_run(RunSpec(spike_policy="clip", **kw)).steps
    assert clip.action[10] == "spike: clipped" and clip.clip_ref[10] == "median"
    np.testing.assert_array_equal(clip.loss[:11], none.loss[:11])  # the same run until the clipped step
    assert (clip.loss[11:] != none.loss[11:]).all()
    med, want = _by_hand(clip, 10, grad_clip)
    assert med < clip.grad_norm[10] and (grad_clip == 0 or med < grad_clip)
    assert clip.clipped_norm[10] == pytest.approx(want, rel=1e-5)  # median x median / norm
    # none applies the spike as the global clip leaves it: all of it, or grad_clip
    assert none.clipped_norm[10] == pytest.approx(min(none.grad_norm[10], grad_clip or math.inf), rel=1e-5)


def test_clip_target_at_the_boundary_where_the_median_equals_the_clip():
    """At median == grad_clip the two cases give one number (grad_clip x median / norm) and the
    target moves continuously through it; a norm at or below the median is left as it is."""
    at = clip_target(8.0, 1.0, 1.0)
    assert (at.case, at.ref, at.target) == ("grad_clip", 1.0, 1.0 / 8)
    above, below = clip_target(8.0, 1.0 + 1e-9, 1.0), clip_target(8.0, 1.0 - 1e-9, 1.0)
    assert above.case == "grad_clip" and below.case == "median"
    assert above.target == pytest.approx(1 / 8, rel=1e-8) and below.target == pytest.approx(1 / 8, rel=1e-8)
    assert clip_target(8.0, 1.31, 1.0).target == pytest.approx(1.31 / 8)  # binding: grad_clip x median / norm
    assert clip_target(8.0, 0.5, 1.0).target == pytest.approx(0.5 * 0.5 / 8)  # below the clip: median^2 / norm
    for off in (0.0, math.inf):
        ct = clip_target(8.0, 2.0, off)
        assert (ct.case, ct.ref, ct.target) == ("median", 2.0, 0.5)
    assert clip_target(0.9, 1.0, 0.0).target == 1.0  # not above the median: the target does not bind (no-op)


# ------------------------------------------------------------------------------ rounding
def test_stochastic_rounding_is_unbiased():
    """E[SR(x)] = x: the mean of K draws per element, standardised by the Bernoulli variance
    of its rounding, is centred; round-to-nearest of the same values is biased."""
    print(f"seed = {SEED}")
    g = torch.Generator().manual_seed(SEED)
    w = torch.randn(523, 7, generator=g).bfloat16().float()
    ulp = 2 * half_ulp(w.bfloat16())
    x = w + ulp * torch.rand(w.shape, generator=g) * 0.45  # below half an ulp: nearest rounding drops it
    k = 400
    draws = torch.stack([stochastic_round_bf16(x, g).float() for _ in range(k)])
    p = (x - w) / ulp
    sd = (p * (1 - p)).sqrt() * ulp / math.sqrt(k)
    z = (draws.mean(0) - x) / sd
    assert abs(float(z.mean())) < 4 / math.sqrt(z.numel()), float(z.mean())
    assert float(z.abs().max()) < 6.5
    nearest = x.bfloat16().float()
    assert float(((nearest - x) / sd).mean()) < -5  # every nearest rounding drops the update


def test_stochastic_rounding_keeps_representable_and_nonfinite_values():
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(1823, generator=g).bfloat16().float()
    assert torch.equal(stochastic_round_bf16(x, g).float(), x)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    out = stochastic_round_bf16(special, g).float()
    assert out[0].isnan() and out[1] == math.inf and out[2] == -math.inf and out[3] == 0


def test_half_ulp_and_lost_updates_match_rounding():
    one = torch.tensor([1.0, 1.5, 0.75, -3.0])
    assert half_ulp(one.bfloat16()).tolist() == [2**-8, 2**-8, 2**-9, 2**-7]
    assert half_ulp(one, torch.float32).tolist() == [2**-24, 2**-24, 2**-25, 2**-23]
    assert half_ulp(torch.zeros(1, dtype=torch.bfloat16)).item() == 2.0**-134
    g = torch.Generator().manual_seed(SEED)
    w = torch.randn(781, 13, generator=g).bfloat16()
    u = torch.randn(w.shape, generator=g) * 10 ** (-1 - 3 * torch.rand(w.shape, generator=g))
    stays = (w.float() + u).bfloat16() == w
    hu = half_ulp(w)
    tie = ((u.abs() - hu).abs() < 1e-12) | ((u.abs() - hu / 2).abs() < 1e-12)
    assert torch.equal(lost_update_mask(w, u)[~tie], stays[~tie])


def test_optimizer_plain_fp32_matches_torch_adamw():
    torch.manual_seed(SEED)
    a = torch.nn.Parameter(torch.randn(37, 19))
    b = torch.nn.Parameter(a.detach().clone())
    opt_a = StabilityAdamW([a], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_b = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(5):
        grad = torch.randn(37, 19)
        a.grad, b.grad = grad.clone(), grad.clone()
        opt_a.step(), opt_b.step()
    # torch's AdamW decays the weight before the step (w * (1 - lr*wd)); ours adds -lr*wd*w: same to first order
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode,lost_max", [("plain", 1.0), ("master", 0.0), ("stochastic", 1.0)])
def test_optimizer_storage_modes(mode, lost_max):
    torch.manual_seed(SEED)
    p = torch.nn.Parameter(torch.randn(257, 31).bfloat16())
    opt = StabilityAdamW([p], lr=1e-5, mode=mode, seed=SEED, lost_stride=1)
    opt.track = True
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    opt.step()
    upd_sq, w_sq, lost, n = opt.last_stats[p]
    frac = float(lost) / n
    assert 0 < float(upd_sq) and float(w_sq) > 0
    if mode == "master":
        assert frac == 0.0 and opt.state[p]["master"].dtype == torch.float32
    else:
        assert frac > 0.9  # lr 1e-5 is far below bf16's step for O(1) weights
    if mode == "plain":  # round to nearest: exactly the lost elements keep their value
        assert int((p.detach() == before).sum()) == int(lost)
    assert frac <= lost_max
    strided = StabilityAdamW([p], lr=1e-5, mode=mode, seed=SEED, lost_stride=16)
    strided.track = True
    strided.step()
    _, _, lost16, n16 = strided.last_stats[p]
    # an estimate of the same count, scaled from every 16th element to the whole tensor
    assert n16 == p.numel() and abs(float(lost16) / n16 - frac) < 0.05


class _OneBlock(nn.Module):
    """A model with one block: a large fp32 weight whose updates all land, and a small bf16
    vector whose updates all round away (lr far below its ulp)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(SEED)
        blk = nn.Module()
        blk.weight = nn.Parameter(torch.randn(256, 64, generator=g))  # 16384 elements: sampled
        blk.scale = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))  # 64 elements: counted in full
        self.double_blocks = nn.ModuleList([blk])


def _lost_frac(stride: int) -> float:
    model = _OneBlock()
    tel = Telemetry(model)
    opt = StabilityAdamW(model.parameters(), lr=1e-6, lost_stride=stride)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    tel.begin_step(0)
    opt.track = True
    opt.step()
    tel.after_step(opt.last_stats)
    tel.end_step()
    tel.close()
    df = tel.frame()
    return float(df[df.stat == "lost_update_frac"].value.iloc[0])


def test_lost_update_fraction_weighs_each_tensor_by_its_size():
    """A block's fraction is lost elements / elements.  The large tensor is sampled every 16th
    element; its estimate must stand for all of its elements, or the small tensor counted in
    full weighs 16 times its share (64 / (1024 + 64) = 0.059 instead of 64 / 16448 = 0.0039)."""
    exact = _lost_frac(1)
    assert exact == pytest.approx(64 / (256 * 64 + 64), rel=1e-6)
    assert _lost_frac(16) == pytest.approx(exact, rel=1e-6)


def test_loss_scaler_backs_off_and_grows():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert not s.unscale_([p])
    s.update(0, False)
    assert s.scale == 512.0
    for i in range(2):
        p.grad = torch.ones(3) * 512
        assert s.unscale_([p]) and torch.equal(p.grad, torch.ones(3))
        s.update(i + 1, True)
    assert s.scale == 1024.0
    assert [h[2] for h in s.history] == [True, False, False]
    with pytest.raises(ConfigError, match="growth_interval"):
        DynamicLossScaler(growth_interval=0)


# ------------------------------------------------------------------------------ telemetry
def test_telemetry_rows_and_logit_max_against_a_direct_computation():
    model, batch = _model_and_batch()
    captured = []
    orig = model.ops.qk_norm_rope

    def spy(q, k, *a, **kw):
        out = orig(q, k, *a, **kw)
        captured.append((out[0].detach(), out[1].detach()))
        return out

    model.ops.qk_norm_rope = spy
    tel = Telemetry(model, every=2, head_groups=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        captured.clear()
        tel.begin_step(step)
        parts = rf_loss(model, batch, torch.Generator().manual_seed(step), return_parts=True)
        parts.loss.backward()
        tel.after_backward()
        tel.before_step()
        opt.step()
        tel.after_step()
        per = (parts.pred.detach() - parts.target).square().mean(dim=(1, 2))
        tel.log_loss(parts.t, per)
        tel.end_step()
        opt.zero_grad()
        if step == 2:
            q, k = captured[-1]  # the last single block
            logits = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
            expect = logits.amax(dim=(0, 2, 3)).view(2, -1).amax(1)
    tel.close()
    df = tel.frame()
    assert sorted(df.step.unique()) == [0, 2]
    assert set(df.stat) >= {"act_rms", "act_max", "logit_max", "grad_norm", "update_ratio", "loss", "loss_bucket"}
    blocks = {"double_blocks.0", "double_blocks.1", "single_blocks.0", "single_blocks.1"}
    assert set(df[df.stat == "grad_norm"].block) == blocks | {"total"}
    assert set(df[(df.stat == "act_rms") & (df.block == "double_blocks.0")].stream) == {"img", "txt"}
    got = df[(df.step == 2) & (df.stat == "logit_max") & (df.block == "single_blocks.1")].value.to_numpy()
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), expect, rtol=1e-5, atol=1e-6)
    assert model.ops.qk_norm_rope is spy  # the seam is restored
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_qk_norm_off_leaves_the_norm_weights_without_gradient():
    model, batch = _model_and_batch()
    disable_qk_norm(model)
    rf_loss(model, batch, torch.Generator().manual_seed(0)).backward()
    assert model.single_blocks[0].q_norm.grad is None
    assert model.single_blocks[0].linear1.weight.grad is not None


def test_bad_telemetry_parameters_name_the_parameter():
    model, _ = _model_and_batch()
    with pytest.raises(ConfigError, match="head_groups"):
        Telemetry(model, head_groups=3)
    with pytest.raises(ConfigError, match="telemetry_every"):
        Telemetry(model, every=0)
    with pytest.raises(ConfigError, match="nan_module"):
        inject_nonfinite(model, "double_blocks.9")
    with pytest.raises(ConfigError, match="precision"):
        RunSpec(precision="fp8")
    with pytest.raises(ConfigError, match="spike_policy"):
        RunSpec(spike_policy="pray")


# ------------------------------------------------------------------------------ numerics diff
def _frame(perturb: tuple[int, str] | None = None) -> pd.DataFrame:
    rows = []
    for step in range(6):
        for i, blk in enumerate(["double_blocks.0", "double_blocks.1", "single_blocks.0"]):
            v = 1.0 + 0.1 * step + i
            if perturb and step >= perturb[0] and blk == perturb[1]:
                v *= 1.5
            rows.append(dict(step=step, block=blk, stream="img", stat="act_max", value=v))
    return pd.DataFrame(rows)


def test_numerics_diff_finds_where_two_runs_part():
    same = numerics_diff(_frame(), _frame(), tol=0.05)
    assert same.origin == {} and (same.first.first_step == -1).all()
    d = numerics_diff(_frame(), _frame((3, "double_blocks.1")), tol=0.05)
    assert d.origin == {"act_max": ("double_blocks.1", 3)}
    assert d.first.set_index("block").loc["double_blocks.0", "first_step"] == -1
    assert len(d.cells) == 18 and d.cells.rel_diff.max() == pytest.approx(1 / 3)
    with pytest.raises(ConfigError, match="tol"):
        numerics_diff(_frame(), _frame(), tol=0)


def test_numdiff_command_reads_two_reports_records(tmp_path, capsys):
    paths = []
    for name, perturb in (("a", None), ("b", (2, "single_blocks.0"))):
        rec = Recorder("07_stability")
        for r in _frame(perturb).itertuples():
            rec.add("telemetry", name, r.stat, r.value, "", step=r.step, block=r.block, stream=r.stream)
        paths.append(str(rec.save(tmp_path / f"{name}.json")))
    assert perflab(["numdiff", *paths, "--tol", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "act_max: first beyond 0.1 at step 2 in single_blocks.0" in out


def test_rel_diff_decides_non_finite_values_by_class():
    inf, nan = math.inf, math.nan
    a = [inf, 1.0, inf, -inf, nan, nan, inf, 2.0, 0.0]
    b = [1.0, inf, -inf, -inf, nan, 3.0, nan, 2.0, 0.0]
    assert rel_diff(a, b).tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert rel_diff([0.0], [5e-5], 1e-2).tolist() == [pytest.approx(5e-3)]  # the floor, not the values


def _nonfinite_pair():
    """Run B goes to Inf in single_blocks.0's act_max at step 3 and its update ratios are
    missing there (the step was skipped), otherwise the runs agree."""
    a = _frame().assign(stat="act_max")
    b = a.copy()
    b.loc[(b.step == 3) & (b.block == "single_blocks.0"), "value"] = math.inf
    ratio = a.assign(stat="update_ratio", value=0.01)
    return pd.concat([a, ratio]), pd.concat([b, ratio[ratio.step != 3]])


def test_numerics_diff_counts_inf_against_finite_and_missing_rows_as_full_differences():
    a, b = _nonfinite_pair()
    d = numerics_diff(a, b, tol=0.05)
    assert d.origin["act_max"] == ("single_blocks.0", 3)
    assert d.origin["update_ratio"] == ("double_blocks.0", 3)  # rows B lacks at a step both recorded
    assert len(d.one_sided) == 3 and set(d.one_sided.run) == {"a"}
    assert d.first.set_index(["stat", "block"]).loc[("act_max", "single_blocks.0"), "max_rel_diff"] == 1.0
    # +Inf against -Inf differs; the same non-finite class (Inf and Inf, NaN and NaN) does not
    neg = b.assign(value=np.where(np.isinf(b.value), -math.inf, b.value))
    assert numerics_diff(b, neg).origin["act_max"] == ("single_blocks.0", 3)
    assert "act_max" not in numerics_diff(b, b).origin
    # steps only one run recorded (another length, another sampling) are left out, and listed
    short = a[a.step < 4]
    d = numerics_diff(a, short)
    assert d.origin == {} and d.steps_only == {"a": [4, 5], "b": []}


def test_numerics_diff_floor_keeps_tiny_statistics_from_diverging():
    rows = lambda v: pd.DataFrame(  # noqa: E731
        [dict(step=0, block="double_blocks.0", stream="", stat="lost_update_frac", value=v)]
    )
    assert numerics_diff(rows(0.0), rows(5e-5), tol=0.02).origin == {}
    assert numerics_diff(rows(0.0), rows(5e-5), tol=0.02, floors={"lost_update_frac": 0}).origin != {}
    assert numerics_diff(rows(0.10), rows(0.12), tol=0.02).origin == {"lost_update_frac": ("double_blocks.0", 0)}


def _records_file(tmp_path, name, frame, **extra) -> str:
    rec = Recorder("07_stability")
    for r in frame.itertuples():
        rec.add("telemetry", name, r.stat, r.value, "", step=r.step, block=r.block, stream=r.stream, **extra)
    return str(rec.save(tmp_path / f"{name}.json"))


def test_nonfinite_telemetry_round_trips_through_records_and_numdiff_sees_it(tmp_path, capsys):
    from lab_utils.stability.training import RunResult
    from lab_utils.studies.stability import record_runs

    a, b = _nonfinite_pair()
    b = pd.concat([b, b.head(1).assign(step=3, block="double_blocks.1", stream="txt", value=math.nan)])
    b = pd.concat([b, b.head(1).assign(step=3, block="double_blocks.1", stream="img", value=-math.inf)])
    paths = []
    for name, frame in (("a", a), ("b", b)):
        rec = Recorder("07_stability")
        run = RunResult(RunSpec(name=name), pd.DataFrame(columns=["step", "loss", "grad_norm", "action"]), frame)
        record_runs(rec, "recipes", {name: run}, telemetry=True)
        paths.append(str(rec.save(tmp_path / f"{name}.json")))
    back = telemetry_frame(load_records(paths[1]), "b").sort_values(["step", "block", "stream", "stat"])
    want = b.sort_values(["step", "block", "stream", "stat"])
    assert len(back) == len(want)
    np.testing.assert_array_equal(back.value.to_numpy(), want.value.to_numpy())  # NaN, +Inf, -Inf as such
    assert perflab(["numdiff", *paths]) == 0
    out = capsys.readouterr().out
    assert "act_max: first beyond 0.05 at step 3 in double_blocks.1" in out
    assert "update_ratio: first beyond 0.05 at step 3" in out


def test_numdiff_refuses_a_report_without_telemetry_in_one_line(tmp_path, capsys):
    rec = Recorder("05_memory")
    rec.add("saved", "none", "bytes", 1.0, "B")
    empty = str(rec.save(tmp_path / "mem.json"))
    good = _records_file(tmp_path, "a", _frame())
    assert perflab(["numdiff", good, empty]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has no telemetry records" in err and "mem.json" in err
    assert perflab(["numdiff", good, str(tmp_path / "missing.json")]) == 2
    assert "cannot read records" in capsys.readouterr().err
    assert perflab(["numdiff", good, good, "--variant-b", "zz"]) == 2
    assert "no telemetry variant 'zz'" in capsys.readouterr().err


def test_numdiff_warns_when_the_two_runs_are_unrelated(tmp_path, capsys):
    a = _records_file(tmp_path, "a", _frame(), source="recipes")
    b = _records_file(tmp_path, "b", _frame(), source="recipes")
    c = _records_file(tmp_path, "c", _frame(), source="qk_norm")
    assert perflab(["numdiff", a, b]) == 0
    assert "warning" not in capsys.readouterr().err
    assert perflab(["numdiff", a, c]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "experiment qk_norm" in err
    d = _records_file(tmp_path, "d", _frame()[lambda f: f.step >= 5].assign(step=lambda f: f.step + 10))
    assert perflab(["numdiff", a, d]) == 2  # no step in common: nothing to compare, said in one line
    assert "sharing steps" in capsys.readouterr().err


def test_numdiff_on_two_recorded_runs_names_the_step_one_went_nan(tmp_path, capsys):
    from lab_utils.studies.stability import record_runs

    paths = []
    for name, kw in (("a", {}), ("b", dict(nan_module="double_blocks.1", nan_phase="forward", nan_step=2))):
        rec = Recorder("07_stability")
        record_runs(rec, "nan", {name: train_run(RunSpec(name=name, steps=4, batch_size=2, **kw))}, telemetry=True)
        paths.append(str(rec.save(tmp_path / f"{name}.json")))
    assert perflab(["numdiff", *paths]) == 0
    out = capsys.readouterr().out
    assert "act_max: first beyond 0.05 at step 2 in double_blocks.1" in out, out
    assert "loss: first beyond 0.05 at step 2\n" in out, out
