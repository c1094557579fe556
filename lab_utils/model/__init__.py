"""The MMDiT and its training step.

``config`` (shape, presets, seams) <- ``layers`` (fused-op seam, embeddings, blocks) <-
``mmdit`` (the model, ``build_model``) <- ``accounting`` / ``diffusers`` / ``train``;
``checkpointing`` holds the activation-checkpointing policies, ``encoders`` and ``data``
the text/image encoders and the synthetic captioned-image data.  The public names of
those modules are re-exported here.
"""

from lab_utils.model.accounting import analytic_param_count, forward_flops, num_params
from lab_utils.model.checkpointing import ACTIVATION_CHECKPOINTS, CHECKPOINT_POLICIES, ActivationCheckpoint
from lab_utils.model.config import (
    KERNEL_OPS,
    LARGE_PRESETS,
    PRESETS,
    MMDiTConfig,
    kernel_map,
    registered_variants,
    resolve_config,
)
from lab_utils.model.diffusers import (
    config_from_diffusers,
    convert_diffusers_state_dict,
    convert_double_block_state_dict,
    convert_single_block_state_dict,
    diffusers_block_errors,
)
from lab_utils.model.layers import (
    MLP,
    DoubleStreamBlock,
    FinalLayer,
    KernelSet,
    MLPEmbedder,
    Modulation,
    RoPE3D,
    Seams,
    SelfAttentionProj,
    SingleStreamBlock,
    image_ids,
    patchify,
    text_ids,
    timestep_embedding,
    unpatchify,
)
from lab_utils.model.mmdit import MMDiT, build_model

__all__ = [
    "ACTIVATION_CHECKPOINTS",
    "ActivationCheckpoint",
    "CHECKPOINT_POLICIES",
    "KERNEL_OPS",
    "LARGE_PRESETS",
    "MLP",
    "PRESETS",
    "DoubleStreamBlock",
    "FinalLayer",
    "KernelSet",
    "MLPEmbedder",
    "MMDiT",
    "MMDiTConfig",
    "Modulation",
    "RoPE3D",
    "Seams",
    "SelfAttentionProj",
    "SingleStreamBlock",
    "analytic_param_count",
    "build_model",
    "config_from_diffusers",
    "convert_diffusers_state_dict",
    "convert_double_block_state_dict",
    "convert_single_block_state_dict",
    "diffusers_block_errors",
    "forward_flops",
    "image_ids",
    "kernel_map",
    "num_params",
    "patchify",
    "registered_variants",
    "resolve_config",
    "text_ids",
    "timestep_embedding",
    "unpatchify",
]
