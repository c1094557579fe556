"""Arithmetic intensity, the roofline's x axis: FLOPs per byte, written out by hand."""

import math

from lab_utils.core.flops import arithmetic_intensity, fused_bytes, fused_flops


def test_intensity_is_flops_over_bytes():
    assert arithmetic_intensity(10.0, 4.0) == 2.5
    assert arithmetic_intensity(0.0, 8.0) == 0.0
    assert arithmetic_intensity(3.0, 0.0) == math.inf


def test_a_fused_op_sits_far_left_of_any_ridge_point():
    """gelu_tanh forward in float32: 9 FLOPs per element over 8 bytes per element (x read, y
    written) = 1.125 FLOP/B, far below an H200's ~200 (bf16 matmul TFLOP/s over HBM TB/s)."""
    kw = dict(batch=2, tokens=16, hidden=64)
    ai = arithmetic_intensity(fused_flops("gelu_tanh", "fwd", **kw), fused_bytes("gelu_tanh", "fwd", elem_size=4, **kw))
    assert ai == 9 / 8
