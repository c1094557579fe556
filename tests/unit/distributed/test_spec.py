"""Pins of the distributed verdict (``lab_utils.distributed.verify.compare``) on hand-made losses
and gradients, no processes spawned.

* A run whose parameters are bfloat16 is judged with the bf16 tolerances (loss 2e-3, gradient
  vector 5e-2), a float32 run with float32's (1e-5, per parameter 1e-4).
* Against the one-process emulation of the same bf16 step, one parameter off by 1e-3 (one
  bfloat16 rounding of a reduced sum, the error that comparison exists to see) fails the run even
  though the float32 reference comparison passes; off by 1e-7 (float32 rounding) it passes.
"""

from __future__ import annotations

import torch

from lab_utils.distributed.spec import DistConfig
from lab_utils.distributed.verify import compare, tolerance_key
from lab_utils.distributed.worker import EmulatedStep


def _grads(gen):
    return {"a": torch.randn(64, generator=gen) + 2.0, "b": torch.randn(32, generator=gen) + 2.0}


def test_tolerance_follows_the_parameter_dtype_and_mixed_precision():
    assert tolerance_key(DistConfig(strategy="fsdp", world_size=2)) == "float32"
    assert tolerance_key(DistConfig(strategy="fsdp", world_size=2, dtype="bfloat16")) == "bf16_compute"
    assert tolerance_key(DistConfig(strategy="fsdp", world_size=2, mixed_precision=True)) == "bf16_compute"


def test_a_bf16_run_within_bf16_tolerances_passes_and_fails_as_float32(gen):
    ref = _grads(gen)
    got = {k: v * (1 + 1e-3) for k, v in ref.items()}  # 1e-3: inside bf16's 5e-2, far outside float32's
    ref_losses, losses = [1.0, 0.9], [1.001, 0.9]  # loss 1e-3 apart: bf16 tolerance 2e-3
    bf16 = compare(DistConfig(strategy="fsdp", world_size=2, dtype="bfloat16"), losses, got, ref_losses, ref)
    assert bf16.tolerance == "bf16_compute" and bf16.ok
    fp32 = compare(DistConfig(strategy="fsdp", world_size=2), losses, got, ref_losses, ref)
    assert fp32.tolerance == "float32" and not fp32.ok


def test_the_emulated_step_sees_one_bf16_rounding(gen):
    cfg = DistConfig(strategy="fsdp", world_size=2, mixed_precision=True)
    ref = _grads(gen)
    emulated = EmulatedStep(loss=1.0, grads={k: v.clone() for k, v in ref.items()})
    rounded = {"a": ref["a"] * (1 + 1e-3), "b": ref["b"].clone()}  # a bf16-reduced parameter
    close = {"a": ref["a"] * (1 + 1e-7), "b": ref["b"].clone()}
    bad = compare(cfg, [1.0, 0.9], rounded, [1.0, 0.9], ref, emulated=emulated)
    assert bad.grad_rel_all < 5e-2  # the float32 reference alone cannot see it
    assert bad.emulated_param == "a" and abs(bad.emulated_worst - 1e-3) < 1e-5
    assert not bad.ok
    good = compare(cfg, [1.0, 0.9], close, [1.0, 0.9], ref, emulated=emulated)
    assert good.ok and good.emulated_worst < 1e-6
