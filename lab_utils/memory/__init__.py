"""Where a training step's memory goes: exact accounting of the MMDiT's state and saved
activations, an analytic model that the measurement confirms, timelines, what fits.

Design note
-----------
Every measurement takes a step (``lab_utils.step.contract.StepFactory``): perflab's MMDiT or any
other model's.

* **State** of a step (parameters, gradients, the optimizer's own state) is read from its tensors
  (:func:`step_state`); the MMDiT's per block and per class, with fp32 master weights for 16-bit
  parameters, is counted from its parameters on ``meta`` (:func:`state_bytes`).
* **Saved activations** are measured with ``torch.autograd.graph.saved_tensors_hooks``
  over one forward of the step (:func:`measure_saved`): every tensor autograd saves is seen,
  parameters are skipped (they are state, not activations), and each *storage* is
  counted once (views share storage, and what a view keeps alive is its whole base).
  A checkpointed block keeps its inputs and, under a selective policy, the outputs torch
  caches; ``lab_utils.model.checkpointing.capture`` reports both.  Each storage is
  attributed to the module and the aten op that *made* it (a ``TorchDispatchMode``) and to its
  region (block, top-level module, loss, input).  Everything works on ``meta`` tensors.
* The MMDiT's **analytic model** (:func:`saved_bytes_formula`) writes the same bytes as a formula
  of width, heads, MLP ratio, sequence lengths and dtype, per region; tests assert it
  equals the measurement exactly for ``tiny`` and ``small`` under every policy that
  ``torch.utils.checkpoint`` or ``save_on_cpu`` implements (``compile_budget`` is the
  partitioner's choice and is measured only).
* **Policies** on one step (:func:`compare_policies`): saved bytes, peak, FLOPs, time, and
  gradients against no checkpointing.
* **FSDP** shards parameters, gradients and optimizer state over N ranks on dim 0 as
  ``torch.chunk`` splits it (``ceil(rows / N)``-row chunks; the last ranks may hold fewer
  rows, or none).  ``fully_shard`` allocates every rank's parameter and gradient shard
  padded to ``ceil(rows / N)`` rows; AdamW's moments (and fp32 master weights) are made
  like the unpadded local shard.  Activations are not sharded.  :func:`fsdp_rank_state`
  projects the allocated bytes and is checked per rank and per parameter against real
  ``fully_shard`` runs on gloo (``python -m lab_utils.memory fsdp``).
* **What fits** a device, for any step: its peak predicted from its parts (state, the forward +
  backward above it, the optimizer step), checked against a whole step, bisected over real
  steps of other batch sizes (:func:`fits_bisect`; on CUDA an out-of-memory step does not fit).
  For the MMDiT at shapes no CPU holds it is projected from state + saved activations + a
  transient model (:func:`what_fits`), and on CUDA confirmed by bisecting a real step that holds
  the state the prediction counts (:class:`MasterAdamW`: fp32 master weights and moments beside
  bf16 weights).

Modules: ``formula`` (the MMDiT's analytic model) <- ``saved`` (hooks, on a step) <- ``policies``
(AC policies on one step) <- ``fits`` (what fits, any step); ``master`` (AdamW with fp32 masters)
<- ``budget`` (the MMDiT's state, peak, FSDP projection, what fits) <- ``fsdp`` (gloo runs);
``timeline``.
"""

from __future__ import annotations

from lab_utils.memory.budget import (
    CLASSES,
    H200_BYTES,
    NAMED_GPUS,
    FitEdge,
    bisect_fit,
    block_of,
    default_device_bytes,
    device_memory,
    fit_state,
    fsdp_rank_params,
    fsdp_rank_state,
    fsdp_shard_rows,
    gpus_needed,
    meta_model,
    predicted_peak,
    state_bytes,
    state_totals,
    transient_bytes,
    what_fits,
)
from lab_utils.memory.fits import (
    Fit,
    StepMemory,
    check_prediction,
    fits_bisect,
    oom_edge,
    step_memory,
    step_state,
    whole_step_peak,
)
from lab_utils.memory.formula import (
    EMBED_REGIONS,
    FORMULA_POLICIES,
    MEMORY_DTYPES,
    StepShape,
    batch_for,
    block_names,
    bytes_per_token_per_block,
    check_block,
    double_block_bytes,
    pixels_of,
    saved_bytes_formula,
    selective_cache_bytes,
    single_block_bytes,
    step_shape,
)
from lab_utils.memory.fsdp import (
    FSDP_FIGURES,
    fsdp_mismatches,
    run_fsdp,
)
from lab_utils.memory.master import MasterAdamW
from lab_utils.memory.policies import (
    GRAD_TOL,
    PolicyResult,
    acts_on,
    compare_policies,
    excursion,
    grad_mismatch,
    grads_of,
    peak_above,
    saved_means,
    treated_blocks,
)
from lab_utils.memory.saved import (
    CreatorMode,
    ModuleTracker,
    SavedReport,
    SavedTensor,
    measure_saved,
    mmdit_saved,
    policies_of,
    policy_applied,
    saved_tensor_probe,
    storage_bytes,
    storage_key,
)
from lab_utils.memory.timeline import (
    CUDA_CATEGORIES,
    TIMELINE_CATEGORIES,
    alloc_conf,
    categorize_trace,
    cpu_timeline,
    cuda_timeline,
    downsample,
    largest_live,
    profiled_timeline,
)

__all__ = [
    "MasterAdamW",
    "acts_on",
    "alloc_conf",
    "batch_for",
    "bisect_fit",
    "block_names",
    "block_of",
    "bytes_per_token_per_block",
    "categorize_trace",
    "check_block",
    "check_prediction",
    "CLASSES",
    "compare_policies",
    "cpu_timeline",
    "CreatorMode",
    "CUDA_CATEGORIES",
    "cuda_timeline",
    "default_device_bytes",
    "device_memory",
    "double_block_bytes",
    "downsample",
    "excursion",
    "EMBED_REGIONS",
    "Fit",
    "fit_state",
    "FitEdge",
    "fits_bisect",
    "FORMULA_POLICIES",
    "FSDP_FIGURES",
    "fsdp_mismatches",
    "fsdp_rank_params",
    "fsdp_rank_state",
    "fsdp_shard_rows",
    "gpus_needed",
    "grad_mismatch",
    "GRAD_TOL",
    "grads_of",
    "H200_BYTES",
    "largest_live",
    "measure_saved",
    "MEMORY_DTYPES",
    "meta_model",
    "mmdit_saved",
    "ModuleTracker",
    "NAMED_GPUS",
    "oom_edge",
    "peak_above",
    "pixels_of",
    "policies_of",
    "policy_applied",
    "PolicyResult",
    "predicted_peak",
    "profiled_timeline",
    "run_fsdp",
    "saved_bytes_formula",
    "saved_means",
    "saved_tensor_probe",
    "SavedReport",
    "SavedTensor",
    "selective_cache_bytes",
    "single_block_bytes",
    "state_bytes",
    "state_totals",
    "step_memory",
    "step_shape",
    "step_state",
    "StepMemory",
    "StepShape",
    "storage_bytes",
    "storage_key",
    "TIMELINE_CATEGORIES",
    "transient_bytes",
    "treated_blocks",
    "what_fits",
    "whole_step_peak",
]
