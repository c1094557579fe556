"""Pins of the planner's inputs against hand-made cases.

* Which precision recipes a GPU may try, as a boundary table over compute capabilities: FP8
  from sm_89 (Ada) on, MXFP8 only from sm_100 (Blackwell); the capability is faked, so this
  runs without a GPU.
* A step profile read from a trace: a phase's GPU microseconds become milliseconds beside the
  step's window, ``other`` is the rest of the step, and the spread is (p80 - p20) / median, each
  checked against numbers worked out by hand on a five-step trace.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from lab_utils.model.train import TrainConfig
from lab_utils.plan.from_trace import profile_from_trace
from lab_utils.plan.levers import candidates
from lab_utils.traces import TraceAnalysis

BASE = TrainConfig(preset="tiny", device="cpu", batch_size=2, buckets=[[64, 64]], num_samples=8)


@pytest.mark.parametrize(
    "cap,fp8,mx_excluded",
    [
        ((8, 6), False, True),  # Ampere: no FP8
        ((8, 9), True, True),  # Ada: FP8, no MX
        ((9, 0), True, True),  # Hopper: FP8, no MX
        ((10, 0), True, False),  # Blackwell: MX too
    ],
)
def test_recipe_candidates_follow_the_compute_capability(monkeypatch, cap, fp8, mx_excluded):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: cap)
    ok, out = candidates("recipe", BASE, torch.device("cuda"))
    assert ok == (["fp8_tensor", "fp8_row"] if fp8 else [])
    excluded = {e.value for e in out}
    assert ("mxfp8" in excluded) == mx_excluded
    assert ({"fp8_tensor", "fp8_row"} <= excluded) == (not fp8)


class _Trace(TraceAnalysis):
    """Five steps of one rank: step windows (µs) and the GPU time of each phase's kernels."""

    def __init__(self, steps_us, phase_rows):
        self.path = "hand-made"
        self._steps = pd.DataFrame({"step": range(len(steps_us)), "dur": steps_us})
        self._phases = pd.DataFrame(phase_rows, columns=["rank", "phase", "step", "gpu_us"])

    @property
    def ranks(self):
        return [0]

    def attributed(self, rank):
        class _A:
            has_steps = True

        return _A()

    def steps(self, rank):
        return self._steps

    def phases(self):
        return self._phases


def test_profile_from_trace_by_hand():
    steps_us = [10_000, 11_000, 12_000, 13_000, 30_000]  # 10, 11, 12, 13, 30 ms
    fwd_us = [2_000, 3_000, 4_000, 5_000, 6_000]  # 2..6 ms of forward kernels
    rows = [(0, "forward", s, us / 2) for s, us in enumerate(fwd_us)] * 2  # two halves per step
    rows += [(0, "backward", s, 4_000.0) for s in range(5)]
    prof = profile_from_trace(_Trace(steps_us, rows))
    assert prof.phases["forward"] == pytest.approx(4.0)  # median of 2..6 ms
    assert prof.phases["backward"] == pytest.approx(4.0)
    # other = step - forward - backward: 4, 4, 4, 4, 20 ms -> median 4
    assert prof.phase_samples["other"] == pytest.approx([4.0, 4.0, 4.0, 4.0, 20.0])
    assert prof.phases["other"] == pytest.approx(4.0)
    # spread (p80 - p20) / median of 2, 3, 4, 5, 6: p20 = 2.8, p80 = 5.2 (linear) -> 2.4 / 4
    assert prof.spread["forward"] == pytest.approx(0.6)
    assert prof.spread["backward"] == 0.0
    # other: p20 = 4, p80 = 4 + 0.2 * 16 = 7.2 -> 3.2 / 4
    assert prof.spread["other"] == pytest.approx(0.8)
    assert prof.step_samples == pytest.approx((10.0, 11.0, 12.0, 13.0, 30.0))
    assert sum(prof.phases[p] for p in ("forward", "backward", "other")) == pytest.approx(12.0)
    assert float(np.median(prof.step_samples)) == 12.0
