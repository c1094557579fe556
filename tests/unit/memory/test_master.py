"""Pins of the memory room's figures and verdicts against hand counts.

* ``MasterAdamW``: the bytes it holds for bf16 parameters (an fp32 master, 4 B, and two fp32
  moments, 8 B, per element) and its first step against AdamW written out in float64;
* ``fsdp_mismatches``: a rank whose padded storage differs from the projection is a mismatch;
* ``grad_mismatch``: a float32 checkpointing policy whose gradient is off by 0.1% fails, one off
  by float32 rounding passes;
* ``largest_live``: the largest storages first.
"""

from __future__ import annotations

import torch

from lab_utils.memory.fsdp import fsdp_mismatches
from lab_utils.memory.master import MasterAdamW
from lab_utils.memory.policies import grad_mismatch
from lab_utils.memory.saved import SavedReport, SavedTensor
from lab_utils.memory.timeline import largest_live


def test_master_adamw_holds_fp32_masters_and_moments_for_bf16_parameters():
    w = torch.nn.Parameter(torch.ones(10, 3, dtype=torch.bfloat16))
    b = torch.nn.Parameter(torch.ones(7, dtype=torch.bfloat16))
    opt = MasterAdamW([w, b])
    n = 30 + 7
    assert opt.state_bytes() == {"optimizer": 2 * 4 * n, "master_weights": 4 * n}
    assert all(m.dtype == torch.float32 for m in opt.master)
    # an fp32 parameter is its own master: no master bytes
    f = torch.nn.Parameter(torch.ones(5))
    assert MasterAdamW([f]).state_bytes() == {"optimizer": 2 * 4 * 5, "master_weights": 0}


def test_master_adamw_first_steps_by_hand(gen):
    """Step 1 of AdamW: m = (1 - b1) g, v = (1 - b2) g^2, bias-corrected to g and g^2, so
    w1 = w0 (1 - lr wd) - lr g / (|g| + eps); step 2 written out the same way."""
    lr, wd, b1, b2, eps = 0.1, 0.5, 0.9, 0.999, 1e-8
    w0 = torch.randn(64, generator=gen, dtype=torch.float64)
    g1 = torch.randn(64, generator=gen, dtype=torch.float64)
    g2 = torch.randn(64, generator=gen, dtype=torch.float64)
    p = torch.nn.Parameter(w0.float().clone())
    opt = MasterAdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    p.grad = g1.float()
    opt.step()
    w1 = w0 * (1 - lr * wd) - lr * g1 / (g1.abs() + eps)
    torch.testing.assert_close(p.detach().double(), w1, rtol=1e-5, atol=1e-6)
    p.grad = g2.float()
    opt.step()
    m = b1 * (1 - b1) * g1 + (1 - b1) * g2
    v = b2 * (1 - b2) * g1**2 + (1 - b2) * g2**2
    mhat, vhat = m / (1 - b1**2), v / (1 - b2**2)
    w2 = w1 * (1 - lr * wd) - lr * mhat / (vhat.sqrt() + eps)
    torch.testing.assert_close(p.detach().double(), w2, rtol=1e-5, atol=1e-6)


def _row(padded_real: int, padded_proj: int) -> dict:
    figures = {k: 100 for k in ("parameters", "parameters_held", "gradients", "optimizer")}
    return {
        **figures,
        **{f"projected_{k}": v for k, v in figures.items()},
        "params": {"w": dict(numel=6, padded_numel=padded_real, grad_numel=6, moment_numel=6)},
        "projected_params": {"w": dict(numel=6, padded_numel=padded_proj)},
    }


def test_fsdp_mismatch_sees_a_wrong_padded_storage():
    assert fsdp_mismatches(_row(8, 8)) == []
    bad = fsdp_mismatches(_row(8, 6))
    assert len(bad) == 1 and bad[0].startswith("w: real")


def test_float32_policy_gradients_must_agree_to_rounding(gen):
    ref = {"a": torch.randn(256, generator=gen) + 3.0, "b": torch.randn(16, generator=gen) + 3.0}
    rounding = {k: v * (1 + 2.0**-23) for k, v in ref.items()}  # one float32 ulp
    tenth_percent = {"a": ref["a"] * 1.001, "b": ref["b"].clone()}
    assert grad_mismatch(ref, rounding, torch.float32) == []
    assert grad_mismatch(ref, tenth_percent, torch.float32) == ["a"]


def test_largest_live_lists_the_largest_storages_first():
    sizes = [64, 4096, 8, 1024, 512]
    rep = SavedReport([SavedTensor("model", "model", "mm", "saved", n, (n,), "uint8") for n in sizes])
    assert [t.nbytes for t in largest_live(rep, top=3)] == [4096, 1024, 512]
