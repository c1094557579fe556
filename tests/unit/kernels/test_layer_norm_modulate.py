"""layer_norm_modulate: what is specific to it ((B, 1, D) modulation, bad inputs, row limit, the
output's error bound per element); the shared cases are in tests/unit/fused/test_ops.py."""

import pytest
import torch

from lab_kernels import get_variant
from lab_kernels import layer_norm_modulate as K
from lab_utils.core.checks import assert_close, compare, tolerance
from lab_utils.fused import ops as fused
from lab_utils.fused.inputs import make_inputs

OP = "layer_norm_modulate"


def test_modulation_as_b1d_and_non_contiguous_x(gen):
    x = torch.randn(2, 96, 13, generator=gen).transpose(1, 2)  # (2, 13, 96), not contiguous
    sh, sc = torch.randn(2, 1, 96, generator=gen), torch.randn(2, 1, 96, generator=gen)
    out = K.layer_norm_modulate(x, sh, sc)
    assert_close(out, K.reference_layer_norm_modulate(x.double(), sh.double(), sc.double()), dtype=torch.float32)


def test_bad_inputs_name_the_parameter():
    x, v = torch.randn(2, 5, 64), torch.randn(2, 64)
    with pytest.raises(ValueError, match="'shift'.*shape"):
        K.layer_norm_modulate(x, torch.randn(2, 63), v)
    with pytest.raises(ValueError, match="'scale'.*shape"):
        K.layer_norm_modulate(x, v, torch.randn(3, 64))
    with pytest.raises(ValueError, match="'x'.*\\(B, L, D\\)"):
        K.layer_norm_modulate(torch.randn(5, 64), v, v)
    with pytest.raises(TypeError, match="'x'.*int32"):
        K.layer_norm_modulate(x.int(), v, v)


def test_registry_capabilities():
    assert "limit" in get_variant(OP, "triton").why_not("cpu", torch.bfloat16, shape=(1, 4, 100_000))


# ------------------------------------------------------------------ the output's error bound
# y = x̂·(1 + scale) + shift cancels where the product and the shift nearly cancel: a rounding
# error of the product is then large against |y|, so the output is held to a bound per element
# from the operands (lab_utils.fused.ops.layer_norm_modulate_bound), not to atol + rtol·|y|.
BIG = fused.Problem(1, 1823, 781)
SMALL = fused.Problem(2, 37, 781)


def _eager_and_reference(problem, dtype, seed):
    args, _, seed = make_inputs(OP, problem, dtype, "cpu", seed=seed, requires_grad=False)
    ref_args = [a.detach().double() for a in args]
    out = get_variant(OP, "eager")(*args)
    return out, K.reference_layer_norm_modulate(*ref_args), fused.layer_norm_modulate_bound(*ref_args, dtype)


def test_a_cancelling_element_passes_its_bound_and_failed_a_relative_tolerance():
    """The draw where bfloat16's eager op gives 0 for -0.0181 (element (0, 1509, 230)): within its
    bound, which a tolerance relative to |y| (bfloat16's atol = rtol = 1.6e-2) is not."""
    out, ref, bound = _eager_and_reference(BIG, torch.bfloat16, 1233185751)  # the gen seed 197254285's draw
    at = (0, 1509, 230)
    assert out[at].item() == 0.0 and ref[at].item() == pytest.approx(-0.0180842, abs=1e-6)
    assert compare(out, ref, atol=bound, rtol=0.0).ok
    atol, rtol = tolerance(torch.bfloat16)
    rel = compare(out, ref, atol=atol, rtol=rtol)
    assert not rel.ok and rel.n_bad == 1 and f"at {at}" in rel.message
    fused.assert_variant_ok(OP, "eager", torch.bfloat16, BIG, seed=1233185751)


@pytest.mark.parametrize(("dtype", "problem"), [(torch.bfloat16, BIG), (torch.float16, SMALL)], ids=str)
def test_the_bound_fails_an_error_twice_the_eager_ops(gen, dtype, problem):
    """The bound is no looser tolerance: the eager op's own error (four roundings) fits in it,
    the same error doubled does not (eager reaches about 0.7-0.8 of the bound)."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    out, ref, bound = _eager_and_reference(problem, dtype, seed)
    err = out.double() - ref
    assert compare(out, ref, atol=bound, rtol=0.0).ok, seed
    doubled = compare(ref + 2 * err, ref, atol=bound, rtol=0.0, name="eager error x2")
    assert not doubled.ok and "per-element bound" in doubled.message and "allowed" in doubled.message, seed
    # and it is tighter than the relative tolerance away from cancellation: no atol floor near 0
    small = (ref.abs() < 1e-3) & (bound < tolerance(dtype)[0])
    assert small.any(), seed
