"""Kernel categories: HolisticTraceAnalysis's three types beside perflab's finer categories.

HTA's types (``hta_type``), the rule of HolisticTraceAnalysis 0.5 (``hta.utils.utils``) so that
shares agree with it figure for figure:

* ``COMMUNICATION``: the name matches ``^nccl.*Kernel`` (NCCL and RCCL kernels);
* ``MEMORY``: the name starts with ``Memcpy``, ``Memset`` or ``dma``;
* ``COMPUTATION``: every other name, except those that ``(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)``
  matches from the start (a name holding ``Memcpy``, or containing ``Sync``), which are ``OTHER``.

perflab's categories (``category``), first match wins, tested on real kernel names
(tests/unit/traces/test_collectives.py): the activity's own kind first (``gpu_memcpy`` -> ``memcpy``,
``gpu_memset`` -> ``memset``), then the kernel name, then the launching operator's name:

=========================  ===========================================================================
``communication``          ``nccl``/``rccl`` kernels, ``c10d``/collective operators
``memcpy`` / ``memset``    copies and fills between or within memories (by activity kind or name)
``embedding``              FBGEMM ``split_embedding_*`` / TBE, ``embedding_bag``, ``embedding`` lookups
``attention``              flash / fmha / efficient attention / ``scaled_dot_product`` (not ``softmax``)
``matmul``                 GEMM and convolution: cuBLAS/cutlass/xmma (``sm80_xmma``, ``ampere_sgemm``,
                           ``volta_sgemm``), ROCm Tensile ``Cijk_*`` and hipBLASLt, ``gemv``,
                           cuDNN ``fprop``/``dgrad``/``wgrad``/``implicit_gemm``, Triton templates ``triton_tem_``
``normalization``          layer / rms / group / batch norm (cuDNN ``bn_fw``/``bn_bw``)
``optimizer``              fused/foreach optimizer kernels (``multi_tensor_apply``, ``fused_adam``)
``reduction``              reductions and softmax (``reduce_kernel``, ``softmax``, ``log_softmax``),
                           Triton ``triton_red_`` / ``triton_per_``
``copy/cast``              layout and index kernels (``copy``, ``cat``, ``transpose``, ``nchwToNhwc``, ``gather``),
                           and elementwise kernels whose functor is a copy (``direct_copy_kernel``)
``elementwise/activation`` elementwise and activation kernels, Triton pointwise ``triton_poi_``
``fused (triton)``         other Triton kernels (``triton_``/``triton__0d1d...``: Inductor's fused kernels)
``other``                  none of the above
=========================  ===========================================================================

Operators (``kind == "cpu_op"``: a CPU trace read by the CPU rule, :mod:`lab_utils.traces.cpu`)
take :data:`OPERATOR_RULES`, the operator-name table lab 01's profiler has always used
(:func:`lab_utils.profiling.traces.categorize` reads it from here: one table for both): first match
wins, in this order: communication (``c10d``, ``gloo:``, ``record_param_comms``, collectives by
name), optimizer (``_foreach_``, fused Adam), attention (``sdpa``, ``softmax``), normalization,
matmul (``mm``, ``addmm``, ``bmm``, ``linear``, ``conv``), reduction, copy/cast (copies, views,
layout, allocation), elementwise/activation.  Their HolisticTraceAnalysis type
(:func:`operator_hta_type`): ``COMMUNICATION`` for the communication operators, ``MEMORY`` for the
copies (``copy_``, ``to``, ``_to_copy``, ``cat``, ``clone``, ``contiguous``), ``OTHER`` for
operators that move no data (views, ``empty``, ``detach``, ``as_strided``), ``COMPUTATION`` for
every other operator.
"""

from __future__ import annotations

import re
from functools import lru_cache

HTA_TYPES = ("COMPUTATION", "COMMUNICATION", "MEMORY", "OTHER")
CATEGORIES = (
    "matmul",
    "attention",
    "normalization",
    "elementwise/activation",
    "reduction",
    "copy/cast",
    "embedding",
    "communication",
    "optimizer",
    "memcpy",
    "memset",
    "fused (triton)",
    "other",
)

_HTA_COMM = re.compile(r"^nccl.*Kernel")
_HTA_MEMORY = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_HTA_NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")

RULES: tuple[tuple[str, re.Pattern], ...] = (
    ("communication", re.compile(r"nccl|rccl|c10d|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|alltoall")),
    ("memcpy", re.compile(r"^memcpy|^dma")),
    ("memset", re.compile(r"^memset")),
    ("embedding", re.compile(r"split_embedding|embedding_bag|embedding_(forward|backward)|\btbe\b|^embedding$")),
    ("attention", re.compile(r"flash|fmha|attention|attn|scaled_dot_product|sdpa")),
    (
        "matmul",
        re.compile(
            r"(?<!fb)gemm|gemv|cutlass|cublas|xmma|wgmma|^cijk_|hipblaslt|tensile|\bmm\b|addmm|bmm|matmul|linear"
            r"|fprop|dgrad|wgrad|implicit_gemm|conv|triton_tem_|^sm\d+_"
        ),
    ),
    ("normalization", re.compile(r"layer_?norm|rms_?norm|group_?norm|batch_?norm|instance_?norm|bn_fw|bn_bw|\bbn_")),
    ("optimizer", re.compile(r"multi_tensor_apply|fused_adam|_foreach_|adamw?_|optimizer")),
    ("reduction", re.compile(r"reduce|softmax|triton_red_|triton_per_|\bsum\b|\bmean\b|argmax|cumsum|topk")),
    (
        "copy/cast",
        re.compile(
            r"copy|\bcat\b|catarray|transpose|permute|nchwtonhwc|nhwctonchw|index|gather|scatter|\bfill|\bpad\b"
            r"|contiguous|clone|_to_copy"
        ),
    ),
    (
        "elementwise/activation",
        re.compile(
            r"elementwise|vectorized|unrolled|triton_poi_|gelu|silu|relu|sigmoid|tanh|dropout|\badd|\bmul|\bdiv"
            r"|exp|rsqrt|sqrt|where|clamp|pow"
        ),
    ),
)


#: operator names (``aten::mm``, ``c10d::allreduce_``, ``gloo:all_reduce``) -> category; the names are
#: lower-cased and ``aten::`` / ``::`` turned into blanks before the search (see the module note)
OPERATOR_RULES: tuple[tuple[str, re.Pattern], ...] = (
    (
        "communication",
        re.compile(
            r"nccl|gloo:|all_?reduce|all_?gather|reduce_?scatter|c10d|alltoall|broadcast_coalesced"
            r"|record_param_comms|\bsend\b|\brecv\b"
        ),
    ),
    ("optimizer", re.compile(r"_foreach_|fused_adam|multi_tensor_apply|adamw?_|optimizer")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|softmax|scaled_dot_product|cudnn_.*attn")),
    ("normalization", re.compile(r"layer_?norm|rms_?norm|group_?norm|batch_?norm|instance_?norm")),
    ("matmul", re.compile(r"gemm|\bmm\b|addmm|bmm|matmul|linear|conv|xmma|cutlass|cublas|wgmma|sm\d+_|baddbmm")),
    (
        "reduction",
        re.compile(
            r"reduce|\bsum\b|mean|\bmax\b|\bmin\b|argmax|argmin|vector_norm|\bnorm\b|\bvar\b|\bstd\b"
            r"|cumsum|topk|\ball\b|\bany\b|mse_loss"
        ),
    ),
    (
        "copy/cast",
        re.compile(
            r"copy|memcpy|memset|_to_copy|\bto\b|contiguous|clone|\bcat\b|stack|index|gather"
            r"|scatter|pad|fill|zero_|repeat|expand|transpose|permute|reshape|view|slice|select"
            r"|unfold|flip|roll|split|chunk|narrow|empty|as_strided|detach|unbind|resize|squeeze|\bt\b|alias"
            r"|full|zeros|ones|arange|scalar_tensor|lift_fresh|type_as|meshgrid|embedding"
        ),
    ),
    (
        "elementwise/activation",
        re.compile(
            r"elementwise|vectorized|unrolled|gelu|silu|relu|sigmoid|tanh|\badd|\bsub"
            r"|\bmul|\bdiv|exp|log|pow|rsqrt|sqrt|\bsin\b|\bcos\b|where|neg|abs|clamp"
            r"|rand|normal|uniform|bernoulli|dropout|lerp|addcmul|addcdiv|sign|erf"
            r"|maximum|minimum|\beq\b|\bne\b|\bgt\b|\blt\b|\bge\b|\ble\b|logical|rsub|reciprocal|bitwise"
            r"|__and__|__or__"
        ),
    ),
)
_OP_MEMORY = re.compile(r"^aten::(copy_|_copy_from|_copy_from_and_resize|to|_to_copy|cat|clone|contiguous|stack)$")
_OP_NO_DATA = re.compile(
    r"^aten::(empty|empty_strided|empty_like|view|_unsafe_view|_reshape_alias|reshape|as_strided|detach|detach_"
    r"|alias|lift_fresh|t|transpose|permute|expand|unsqueeze|squeeze|select|slice|split|chunk|narrow|unbind"
    r"|resize_|set_|result_type|item|_local_scalar_dense|is_nonzero)$"
)


def _operator_text(name: str) -> str:
    return name.lower().replace("aten::", " ").replace("::", " ")


@lru_cache(maxsize=65536)
def operator_category(name: str) -> str:
    """The category of an operator's name through :data:`OPERATOR_RULES` ("other" when none matches)."""
    text = _operator_text(name)
    for cat, rx in OPERATOR_RULES:
        if rx.search(text):
            return cat
    return "other"


@lru_cache(maxsize=65536)
def operator_hta_type(name: str) -> str:
    """The HolisticTraceAnalysis type an operator stands as under the CPU rule (see the module note)."""
    if operator_category(name) == "communication":
        return "COMMUNICATION"
    if _OP_MEMORY.match(name):
        return "MEMORY"
    if _OP_NO_DATA.match(name):
        return "OTHER"
    return "COMPUTATION"


_COPY_FUNCTOR = re.compile(r"direct_copy_kernel|copy_kernel_cuda|copy_device_to_device")


@lru_cache(maxsize=65536)
def hta_type(name: str) -> str:
    """HolisticTraceAnalysis's kernel type of ``name`` (see the module note)."""
    if _HTA_COMM.match(name):
        return "COMMUNICATION"
    if _HTA_MEMORY.match(name):
        return "MEMORY"
    if not _HTA_NOT_COMPUTE.match(name):
        return "COMPUTATION"
    return "OTHER"


def _kernel_text(name: str) -> str:
    """The part of a kernel name that says what it does: the function name, not its template
    arguments (``elementwise_kernel<..., at::native::copy_...>`` is elementwise, not a copy)."""
    lt = name.find("<")
    head = name[:lt] if lt > 0 else name
    return head.lower().replace("::", " ")


@lru_cache(maxsize=65536)
def category(name: str, kind: str = "kernel", op: str = "") -> str:
    """perflab's category of a GPU activity (see the module note).

    ``kind``: the event's ``cat`` (``kernel``, ``gpu_memcpy``, ``gpu_memset``); ``op``: the
    operator that launched it, consulted when the kernel's own name says nothing.
    """
    if kind == "cpu_op":  # an operator standing as a kernel (the CPU rule): the operator table
        return operator_category(name)
    if kind in ("gpu_memcpy", "Memcpy"):
        return "memcpy"
    if kind in ("gpu_memset", "Memset"):
        return "memset"
    if _COPY_FUNCTOR.search(name):
        return "copy/cast"
    for text in (_kernel_text(name), name.lower(), op.lower().replace("aten::", "").replace("::", " ")):
        if not text:
            continue
        for cat, rx in RULES:
            if rx.search(text):
                return cat
    if name.startswith("triton"):
        return "fused (triton)"
    return "other"
