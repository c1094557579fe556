"""The stability library: NaN locator, spike detector, stochastic rounding, lost updates,
the optimizer's storage modes, loss scaling, telemetry and the numerics diff."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from lab_utils.config import ConfigError
from lab_utils.model.mmdit import build_model
from lab_utils.model.train import rf_loss, synthetic_batch
from lab_utils.records import Recorder
from lab_utils.stability import (
    DynamicLossScaler,
    RunSpec,
    SpikeDetector,
    StabilityAdamW,
    half_ulp,
    lost_update_mask,
    stochastic_round_bf16,
    train_run,
)
from lab_utils.telemetry import (
    Telemetry,
    disable_qk_norm,
    inject_nonfinite,
    locate_nonfinite,
    numdiff_main,
    numerics_diff,
)

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


def test_spike_detector_fires_on_a_provoked_spike_and_not_on_a_clean_run():
    kw = dict(steps=12, batch_size=2, provoke_step=9, seed=0)
    clean = train_run(RunSpec(**kw))
    assert not clean.steps.spike.any(), clean.steps[["step", "loss", "z_loss", "z_grad"]]
    poisoned = train_run(RunSpec(provoke="batch", spike_policy="skip", **kw))
    assert poisoned.steps.step[poisoned.steps.spike.astype(bool)].tolist() == [9]
    assert poisoned.steps.action.iloc[9] == "spike: skipped"
    rewound = train_run(RunSpec(provoke="batch", spike_policy="rewind", ckpt_every=4, **kw))
    assert rewound.steps.action.iloc[9] == "rewound: batch skipped" and rewound.replayed_steps == 1
    # skipping the poisoned batch's update or rewinding past it gives the same weights
    assert rewound.steps.loss.iloc[-1] == pytest.approx(poisoned.steps.loss.iloc[-1], rel=1e-5)


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
    assert n16 == -(-p.numel() // 16) and abs(float(lost16) / n16 - frac) < 0.05  # an estimate of the same fraction


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
    assert numdiff_main(paths + ["--tol", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "act_max: first beyond 0.1 at step 2 in single_blocks.0" in out
