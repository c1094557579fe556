"""lab_utils.traces.categories: HolisticTraceAnalysis's three kernel types and perflab's categories,
one hand-labelled name per rule and per precedence (the first rule that matches wins), on kernel
names as Kineto records them and operator names as the CPU rule reads them."""

from __future__ import annotations

import pytest

from lab_utils.traces.categories import (
    CATEGORIES,
    OPERATOR_RULES,
    RULES,
    category,
    hta_type,
    operator_category,
    operator_hta_type,
)


@pytest.mark.parametrize(
    "name, want",
    [
        ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, ...)", "COMMUNICATION"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, ...)", "COMMUNICATION"),
        ("ncclSomething", "COMPUTATION"),  # nccl without Kernel: not HTA's communication
        ("Memcpy DtoD (Device -> Device)", "MEMORY"),
        ("Memset (Device)", "MEMORY"),
        ("dmaCopy", "MEMORY"),
        ("void at::native::copy_Memcpy_kernel", "OTHER"),  # holds Memcpy, not at the start
        ("cudaStreamSync_wrapper", "OTHER"),  # holds Sync
        ("xMemset", "COMPUTATION"),  # Memset counts only at the start
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "COMPUTATION"),
    ],
)
def test_hta_type_follows_hta_rule(name, want):
    assert hta_type(name) == want


@pytest.mark.parametrize(
    "name, kind, op, want",
    [
        ("whatever", "gpu_memcpy", "", "memcpy"),
        ("whatever", "Memcpy", "", "memcpy"),
        ("whatever", "gpu_memset", "", "memset"),
        ("whatever", "Memset", "", "memset"),
        ("aten::mm", "cpu_op", "", "matmul"),  # an operator standing as a kernel: the operator table
        ("aten::add", "cpu_op", "", "elementwise/activation"),
        ("void at::native::direct_copy_kernel_cuda(...)", "kernel", "", "copy/cast"),
        # the template arguments say nothing: elementwise, though they name a copy
        (
            "void at::native::elementwise_kernel<128, 4, at::native::copy_kernel_impl>",
            "kernel",
            "",
            "elementwise/activation",
        ),  # fmt: skip
        (
            "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>(...)",
            "kernel",
            "",
            "elementwise/activation",
        ),  # fmt: skip
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", "", "communication"),
        ("memcpy32_post", "kernel", "", "memcpy"),
        ("memset_kernel", "kernel", "", "memset"),
        ("split_embedding_codegen_forward_kernel", "kernel", "", "embedding"),
        ("flash_fwd_kernel", "kernel", "", "attention"),
        ("sm80_xmma_gemm_f16f16_f16f32", "kernel", "", "matmul"),
        ("cutlass::Kernel<cutlass_80_tensorop_s1688gemm>", "kernel", "", "matmul"),
        ("Cijk_Ailk_Bljk_HHS_BH_MT128x128", "kernel", "", "matmul"),
        ("fbgemm_kernel", "kernel", "", "other"),  # fbgemm is not a GEMM name
        ("vectorized_layer_norm_kernel", "kernel", "", "normalization"),
        ("multi_tensor_apply_kernel", "kernel", "", "optimizer"),
        ("cunn_SoftMaxForward", "kernel", "", "reduction"),
        ("triton_red_fused_sum_0", "kernel", "", "reduction"),
        ("void at::native::index_elementwise_kernel", "kernel", "", "copy/cast"),
        ("triton_poi_fused_gelu_1", "kernel", "", "elementwise/activation"),
        ("triton__0d1d2d3", "kernel", "", "fused (triton)"),  # no rule, a Triton kernel
        ("kernel_xyz", "kernel", "aten::mm", "matmul"),  # the name says nothing: the launching op's
        ("kernel_xyz", "kernel", "c10d::allreduce_", "communication"),
        ("kernel_xyz", "kernel", "", "other"),
        ("<unnamed>", "kernel", "", "other"),
    ],
)
def test_category_rules_and_precedence(name, kind, op, want):
    assert category(name, kind, op) == want
    assert want in CATEGORIES


def test_the_first_matching_rule_wins():
    """A name two rules match takes the earlier one: communication before matmul, attention before
    matmul (``flash`` GEMMs), matmul before elementwise, normalisation before reduction."""
    order = [c for c, _ in RULES]
    assert order.index("communication") < order.index("matmul") < order.index("elementwise/activation")
    assert category("nccl_gemm_kernel") == "communication"
    assert category("flash_attention_gemm") == "attention"
    assert category("gemm_add_kernel") == "matmul"
    assert category("layer_norm_reduce_kernel") == "normalization"
    assert category("reduce_copy_kernel") == "reduction"


@pytest.mark.parametrize(
    "name, cat, hta",
    [
        ("c10d::allreduce_", "communication", "COMMUNICATION"),
        ("gloo:all_reduce", "communication", "COMMUNICATION"),
        ("record_param_comms", "communication", "COMMUNICATION"),
        ("aten::_foreach_add_", "optimizer", "COMPUTATION"),
        ("aten::_softmax", "attention", "COMPUTATION"),
        ("aten::native_layer_norm", "normalization", "COMPUTATION"),
        ("aten::addmm", "matmul", "COMPUTATION"),
        ("aten::linear", "matmul", "COMPUTATION"),
        ("aten::sum", "reduction", "COMPUTATION"),
        ("aten::mse_loss", "reduction", "COMPUTATION"),
        ("aten::copy_", "copy/cast", "MEMORY"),
        ("aten::to", "copy/cast", "MEMORY"),
        ("aten::cat", "copy/cast", "MEMORY"),
        ("aten::view", "copy/cast", "OTHER"),
        ("aten::empty", "copy/cast", "OTHER"),
        ("aten::detach", "copy/cast", "OTHER"),
        ("aten::t", "copy/cast", "OTHER"),
        ("aten::gelu", "elementwise/activation", "COMPUTATION"),
        ("aten::mul", "elementwise/activation", "COMPUTATION"),
        ("aten::unknown_thing", "other", "COMPUTATION"),
    ],
)
def test_operator_category_and_hta_type(name, cat, hta):
    assert operator_category(name) == cat
    assert operator_hta_type(name) == hta
    assert category(name, "cpu_op") == cat


def test_operator_rules_are_tried_in_order():
    order = [c for c, _ in OPERATOR_RULES]
    assert order[0] == "communication" and order.index("attention") < order.index("matmul")
    assert operator_category("aten::scaled_dot_product_attention") == "attention"  # not matmul
    assert operator_category("c10d::allgather_matmul") == "communication"
