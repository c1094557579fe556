"""The rectified-flow step: objective, loss decrease, full Trainer, checkpoints, compile, bad input."""

from __future__ import annotations

import pytest
import torch

from lab_utils.core.checks import assert_close
from lab_utils.core.config import ConfigError
from lab_utils.model.mmdit import build_model
from lab_utils.model.train import (
    Checkpointer,
    TrainConfig,
    Trainer,
    compile_blocks,
    fit_fixed_batch,
    rf_loss,
    sample_timesteps,
    synthetic_batch,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def artifacts(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFLAB_ARTIFACTS_DIR", str(tmp_path))
    return tmp_path


def test_rf_loss_is_the_velocity_mse():
    model = build_model("tiny", seed=1)
    batch = synthetic_batch("tiny", 3, height=48, width=80, txt_len=7, generator=torch.Generator().manual_seed(0))
    assert batch.img.shape == (3, 3 * 5, model.cfg.in_channels)
    parts = rf_loss(model, batch, torch.Generator().manual_seed(1), return_parts=True)
    assert ((parts.t > 0) & (parts.t < 1)).all()
    assert_close(parts.target, parts.noise - batch.img, dtype=torch.float32, name="target")
    expect = ((parts.pred - parts.target) ** 2).mean()
    assert_close(parts.loss, expect, dtype=torch.float32, name="loss")
    # same generator seed -> same noise and timesteps -> same loss
    again = rf_loss(model, batch, torch.Generator().manual_seed(1))
    assert_close(again, parts.loss, dtype=torch.float32, name="loss repeat")


def test_logit_normal_timesteps():
    t = sample_timesteps(20000, torch.Generator().manual_seed(0), logit_mean=0.0, logit_std=1.0)
    assert 0.48 < float(t.median()) < 0.52  # sigmoid(N(0,1)) has median 1/2
    logit = torch.log(t / (1 - t))
    assert abs(float(logit.std()) - 1.0) < 0.03


def test_loss_decreases_on_a_fixed_batch():
    model = build_model("tiny", seed=2).train()
    batch = synthetic_batch("tiny", 2, height=64, width=48, txt_len=9, generator=torch.Generator().manual_seed(3))
    losses = fit_fixed_batch(model, batch, 30, lr=1e-3)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.3 * losses[0], losses


@pytest.mark.parametrize("encoders,autocast", [("live", "none"), ("precomputed", "bf16")])
def test_trainer_steps(artifacts, encoders, autocast):
    tr = Trainer(
        TrainConfig(
            device="cpu",
            encoders=encoders,
            autocast=autocast,
            num_samples=8,
            batch_size=2,
            buckets=[[64, 64], [48, 80]],
            max_caption_len=12,
        )
    )
    res = tr.run(3)
    tr.close()
    assert [r.step for r in res] == [0, 1, 2]
    assert all(torch.isfinite(torch.tensor([r.loss, r.grad_norm])).all() for r in res)
    assert {r.grid for r in res} <= {(4, 4), (3, 5)}
    assert all(8 <= r.txt_len <= 12 for r in res)


@pytest.mark.parametrize("fmt", ["torch", "dcp", "dcp_async"])
def test_checkpoint_roundtrip(tmp_path, fmt):
    model = build_model("tiny", seed=4).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fit_fixed_batch_opt = synthetic_batch("tiny", 2, generator=torch.Generator().manual_seed(5))
    rf_loss(model, fit_fixed_batch_opt).backward()
    opt.step()
    ck = Checkpointer(tmp_path, fmt)
    ck.save(model, opt, 1)
    p2 = ck.save(model, opt, 2)
    ck.wait()
    assert p2.exists() and not any(p.name.startswith("step_000001") for p in tmp_path.iterdir())  # pruned
    fresh = build_model("tiny", seed=99).train()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    rf_loss(fresh, fit_fixed_batch_opt).backward()
    fresh_opt.step()
    ck.load_into(fresh, fresh_opt)
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), n
    sa, sb = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    for k in sa:
        assert torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"])


def test_trainer_checkpoints_every_n(artifacts):
    tr = Trainer(
        TrainConfig(device="cpu", encoders="precomputed", num_samples=4, ckpt_every=2, ckpt_format="dcp_async")
    )
    res = tr.run(4)
    tr.checkpointer.wait()
    assert [r.checkpoint is not None for r in res] == [False, True, False, True]
    assert [p.name for p in tr.checkpointer.dir.iterdir()] == ["step_000004"]
    tr.close()
    assert not tr.checkpointer.dir.exists()


def test_compiled_blocks_match_eager():
    eager = build_model("tiny", seed=6).eval()
    comp = compile_blocks(build_model("tiny", seed=6).eval(), backend="eager", dynamic=False)
    batch = synthetic_batch("tiny", 2, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        a = rf_loss(eager, batch, torch.Generator().manual_seed(8))
        b = rf_loss(comp, batch, torch.Generator().manual_seed(8))
    assert_close(b, a, dtype=torch.float32, name="compiled loss")


def test_warm_compile_runs_each_shape_and_leaves_no_grads(artifacts):
    tr = Trainer(TrainConfig(device="cpu", encoders="precomputed", num_samples=4, buckets=[[64, 64], [48, 80]]))
    assert tr.warm_compile() == 2
    assert all(p.grad is None for p in tr.model.parameters())
    tr.close()


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(batch_size=0), "batch_size"),
        (dict(preset="flux-pro-max"), "preset"),
        (dict(buckets=[[64, 64], [100, 64]]), "buckets"),  # 100 is not a multiple of 8*2
        (dict(buckets="64x64"), "buckets"),
        (dict(activation_checkpoint="often"), "activation_checkpoint"),
        (dict(ckpt_format="zip"), "ckpt_format"),
        (dict(autocast="fp8"), "autocast"),
        (dict(kernels="warp-speed"), "kernels"),
    ],
)
def test_bad_train_config_names_the_parameter(kw, param):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**kw)
    assert e.value.param == param and param in str(e.value)


def test_bad_synthetic_batch_names_the_parameter():
    with pytest.raises(ConfigError) as e:
        synthetic_batch("tiny", 0)
    assert e.value.param == "batch_size"
    with pytest.raises(ConfigError) as e:
        synthetic_batch("tiny", 2, height=72, width=64)
    assert e.value.param == "resolution"
