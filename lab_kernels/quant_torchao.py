"""torchao's own quantize + dequantize of the formats ``lab_kernels.quant`` emulates.

An independent reference for the tests and lab 04: torchao's float8 (tensorwise and
rowwise), MX and NVFP4 paths on the last axis of 2-D, block-divisible tensors.  torchao
is optional (absent on a bare GPU machine, seconds to import), so every import of it is
inside the function that needs it.  ``lab_kernels.quant`` registers it as the "torchao"
variant of the quant op.
"""

from __future__ import annotations

import logging

import torch

from .formats import check_format, param_error


class _EnumConstantNote(logging.Filter):
    """torchao registers its Enums (KernelPreference, ScaleCalculationMode, ...) as pytree
    constants, which torch >= 2.10 logs as deprecated, once per Enum and import: a wall of
    stderr in every lab and report that touches a recipe, about torchao's code, not ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_EnumConstantNote())


def torchao_check(device=None, dtype=None, fmt=None, **_):
    """Capability check for the registry: why torchao cannot serve as a reference here."""
    try:
        import torchao  # noqa: F401, PLC0415  (optional: absent on a bare GPU machine; slow to import)
    except Exception as e:  # pragma: no cover
        return f"torchao is not importable: {e}"
    if fmt is not None and fmt not in TORCHAO_FORMATS:
        return f"torchao has no reference for {fmt} here"
    return None


TORCHAO_FORMATS = ("fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4")


def torchao_fake_quantize(
    x: torch.Tensor, fmt: str, *, granularity: str | None = None, scale_rule: str = "floor", axis: int = -1, **_
):
    """torchao's own quantize + dequantize of the same format (last axis, 2-D, divisible shapes)."""
    F = check_format(fmt)
    x2 = x.movedim(axis, -1).contiguous()
    if F.family == "fp8":
        from torchao.float8.float8_utils import ScalingGranularity, tensor_to_scale, to_fp8_saturated  # noqa: PLC0415  (optional dependency)

        gran = granularity or "tensor"
        if gran == "tensor":
            s = tensor_to_scale(x2, F.elem_format.torch_dtype)
        elif gran == "row":
            s = tensor_to_scale(
                x2, F.elem_format.torch_dtype, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1
            )
        else:
            raise param_error("granularity", gran, "'tensor' or 'row' for the torchao float8 reference")
        d = to_fp8_saturated(x2.float() * s, F.elem_format.torch_dtype)
        out = d.float() / s
    elif F.family == "mx":
        from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: PLC0415  (optional dependency)
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx  # noqa: PLC0415  (optional dependency)

        ed = F.elem_format.torch_dtype if F.elem != "e2m1" else torch.float4_e2m1fn_x2
        mode = ScaleCalculationMode.FLOOR if scale_rule == "floor" else ScaleCalculationMode.RCEIL
        s, d = to_mx(x2.float(), ed, 32, mode)
        out = to_dtype(d, s, ed, 32, torch.float32)
    else:
        from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4  # noqa: PLC0415  (optional dependency)
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale  # noqa: PLC0415  (optional dependency)

        x2d = x2.float().reshape(-1, x2.shape[-1])
        pts = per_tensor_amax_to_scale(x2d.abs().amax())
        s, d = nvfp4_quantize(x2d, 16, pts)
        vals = f4_unpacked_to_f32(unpack_uint4(d)).reshape(x2d.shape[0], -1, 16)
        out = (vals * (pts * s.float()).reshape(x2d.shape[0], -1, 1)).reshape(x2.shape)
    return out.reshape(x2.shape).movedim(-1, axis).to(x.dtype)
