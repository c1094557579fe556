import math
import time

import pytest
import torch

from lab_utils.timing import BenchError, Timing, bench, try_bench


def test_bench_statistics_and_samples():
    x = torch.randn(256, 256)
    t = bench(lambda: x @ x, name="mm", device="cpu", reps=7, warmup_ms=1)
    assert isinstance(t, Timing) and t.n == 7 and t.method == "torch.utils.benchmark"
    assert t.p20_ms <= t.median_ms <= t.p80_ms
    assert all(s > 0 for s in t.samples_ms)
    assert "median" in str(t)


def test_first_call_is_excluded():
    calls = {"n": 0}

    def fn():
        calls["n"] += 1
        if calls["n"] == 1:
            time.sleep(0.3)  # "compilation"
        return torch.ones(3)

    t = bench(fn, device="cpu", reps=5, warmup_ms=1)
    assert t.first_call_ms >= 300
    assert t.p80_ms < 100


def test_raising_callable_is_a_clear_error():
    def boom():
        raise RuntimeError("kernel launch failed")

    with pytest.raises(BenchError, match="kernel launch failed") as e:
        bench(boom, name="boom", device="cpu")
    assert e.value.failure.kind == "raised"
    f = try_bench(boom, name="boom", device="cpu")
    assert not f.ok and f.kind == "raised"


def test_nonfinite_output_is_refused():
    with pytest.raises(BenchError, match="NaN/Inf") as e:
        bench(lambda: torch.tensor([1.0, math.nan]), name="nan", device="cpu")
    assert e.value.failure.kind == "nonfinite"
    with pytest.raises(BenchError, match=r"output\[1\]"):
        bench(lambda: (torch.ones(2), torch.tensor([math.inf])), device="cpu")
    # opt-out for ops whose output is legitimately non-finite
    assert bench(lambda: torch.tensor([math.inf]), device="cpu", reps=3, warmup_ms=1, check_finite=False).n == 3


def test_budget_is_enforced():
    f = try_bench(lambda: time.sleep(0.2), name="slow", device="cpu", budget_s=0.05, check_finite=False)
    assert not f.ok and f.kind == "budget" and "budget" in f.reason


def test_reps_validated():
    with pytest.raises(ValueError, match="'reps'"):
        bench(lambda: None, device="cpu", reps=1)
