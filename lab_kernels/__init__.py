"""perflab compute kernels: one op per module, each with a plain-torch reference.

Design note: Triton reads ``TRITON_INTERPRET`` when it is imported and when a kernel is
defined, so the switch is set here, before anything of the package imports Triton: on a
machine without a CUDA device (unless the user already chose) every ``@triton.jit``
kernel here runs through Triton's interpreter: correct, slow, never to be timed.
``TRITON_INTERPRETED`` (= ``_common.interpreted()``, the package's one predicate) says which.

Every op module is imported here, so its variants are registered as soon as the package
is: the registry never imports a module by name.  ``liger`` adds the peer library's variants
(Liger-Kernel, when installed) to the ops it covers.  Each op module has the same shape:
private ``@triton.jit`` kernels ``_<op>_fwd_kernel`` / ``_<op>_bwd_kernel``, host
launchers ``<op>_forward`` / ``<op>_backward``, one ``autograd.Function``
(``<Op>Function``), the public ``<op>(...)`` and ``reference_<op>`` (plain torch, valid in
float64) beside it.  This package never imports ``lab_utils``.
"""

from __future__ import annotations

import os as _os

import torch as _torch

if "TRITON_INTERPRET" not in _os.environ and not _torch.cuda.is_available():
    _os.environ["TRITON_INTERPRET"] = "1"

# Each op module registers its variants when imported.
from . import (  # noqa: E402  (Triton must see TRITON_INTERPRET, set above, on its first import)
    _common,
    attention,
    gated_residual,
    gelu_tanh,
    layer_norm_modulate,
    liger,
    lowp_matmul,
    qk_norm_rope,
    quant,
    rms_norm,
    rope,
    swiglu,
)
from .registry import (  # noqa: E402
    Variant,
    get_variant,
    list_ops,
    register,
    register_fused_op,
    unregister,
    variant_names,
    variants,
)

TRITON_INTERPRETED: bool = _common.interpreted()
# whether the interpreter works with this triton + numpy at all (probed on first use, cached)
interpreter_why_not = _common.interpreter_why_not
interpreter_note = _common.interpreter_note

OPS: tuple[str, ...] = (
    "rms_norm",
    "layer_norm_modulate",
    "gated_residual",
    "gelu_tanh",
    "swiglu",
    "rope",
    "qk_norm_rope",
    "attention",
    "quant",
    "lowp_matmul",
)

__all__ = [
    "OPS",
    "TRITON_INTERPRETED",
    "Variant",
    "attention",
    "gated_residual",
    "gelu_tanh",
    "get_variant",
    "interpreter_note",
    "interpreter_why_not",
    "layer_norm_modulate",
    "liger",
    "list_ops",
    "lowp_matmul",
    "qk_norm_rope",
    "quant",
    "register",
    "register_fused_op",
    "rms_norm",
    "rope",
    "swiglu",
    "unregister",
    "variant_names",
    "variants",
]
