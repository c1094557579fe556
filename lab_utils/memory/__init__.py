"""Where a training step's memory goes: exact accounting of the MMDiT's state and saved
activations, an analytic model that the measurement confirms, timelines, what fits.

Design note
-----------
* **State** (parameters, gradients, AdamW's two moments, fp32 master weights when the
  parameters are in a 16-bit dtype) is counted from the model's parameters, per block
  and per class; it is exact by construction and works on ``meta``.
* **Saved activations** are measured with ``torch.autograd.graph.saved_tensors_hooks``
  over one forward of the rectified-flow loss: every tensor autograd saves is seen,
  parameters are skipped (they are state, not activations), and each *storage* is
  counted once (views share storage, and what a view keeps alive is its whole base).
  A checkpointed block keeps its inputs and, under a selective policy, the outputs torch
  caches; ``lab_utils.model.checkpointing.capture`` reports both.  Each storage is
  attributed to the region (block, embedder, final layer, loss) and the aten op that
  *made* it, observed by a ``TorchDispatchMode``.  Everything works on ``meta`` tensors.
* The **analytic model** (:func:`saved_bytes_formula`) writes the same bytes as a formula
  of width, heads, MLP ratio, sequence lengths and dtype, per region; tests assert it
  equals the measurement exactly for ``tiny`` and ``small`` under every policy that
  ``torch.utils.checkpoint`` or ``save_on_cpu`` implements (``compile_budget`` is the
  partitioner's choice and is measured only).
* **FSDP** shards parameters, gradients and optimizer state over N ranks on dim 0 as
  ``torch.chunk`` splits it (``ceil(rows / N)``-row chunks; the last ranks may hold fewer
  rows, or none).  ``fully_shard`` allocates every rank's parameter and gradient shard
  padded to ``ceil(rows / N)`` rows; AdamW's moments (and fp32 master weights) are made
  like the unpadded local shard.  Activations are not sharded.  :func:`fsdp_rank_state`
  projects the allocated bytes and is checked per rank and per parameter against real
  ``fully_shard`` runs on gloo (``python -m lab_utils.memory fsdp``).
* **What fits** is predicted from state + saved activations + a transient model, and on
  CUDA confirmed by bisecting a real step that holds the state the prediction counts
  (:class:`MasterAdamW`: fp32 master weights and moments beside bf16 weights).

Modules: ``saved`` (hooks, formula) <- ``master`` (AdamW with fp32 masters) <- ``budget``
(state, peak, FSDP projection, what fits) <- ``fsdp`` (gloo runs); ``policies`` (AC policies
on one step); ``timeline``.
"""

from __future__ import annotations

from lab_utils.memory.budget import (
    CLASSES,
    FitEdge,
    bisect_fit,
    block_of,
    default_device_bytes,
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
from lab_utils.memory.fsdp import (
    FSDP_FIGURES,
    fsdp_mismatches,
    run_fsdp,
)
from lab_utils.memory.master import MasterAdamW
from lab_utils.memory.policies import (
    GRAD_TOL,
    PolicyResult,
    compare_policies,
    grad_mismatch,
    step_flops,
    step_grads,
    step_peak,
)
from lab_utils.memory.saved import (
    EMBED_REGIONS,
    FORMULA_POLICIES,
    H200_BYTES,
    MEMORY_DTYPES,
    CreatorMode,
    RegionTracker,
    SavedReport,
    SavedTensor,
    StepShape,
    batch_for,
    block_names,
    bytes_per_token_per_block,
    check_block,
    double_block_bytes,
    measure_saved,
    saved_bytes_formula,
    saved_tensor_probe,
    selective_cache_bytes,
    single_block_bytes,
    step_shape,
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
    "categorize_trace",
    "CLASSES",
    "CUDA_CATEGORIES",
    "CreatorMode",
    "EMBED_REGIONS",
    "FORMULA_POLICIES",
    "FSDP_FIGURES",
    "FitEdge",
    "GRAD_TOL",
    "H200_BYTES",
    "MEMORY_DTYPES",
    "MasterAdamW",
    "PolicyResult",
    "RegionTracker",
    "SavedReport",
    "SavedTensor",
    "StepShape",
    "TIMELINE_CATEGORIES",
    "alloc_conf",
    "batch_for",
    "bisect_fit",
    "block_names",
    "block_of",
    "bytes_per_token_per_block",
    "check_block",
    "compare_policies",
    "cpu_timeline",
    "cuda_timeline",
    "default_device_bytes",
    "double_block_bytes",
    "downsample",
    "fit_state",
    "fsdp_mismatches",
    "fsdp_rank_params",
    "fsdp_rank_state",
    "fsdp_shard_rows",
    "gpus_needed",
    "grad_mismatch",
    "largest_live",
    "measure_saved",
    "meta_model",
    "predicted_peak",
    "profiled_timeline",
    "run_fsdp",
    "saved_bytes_formula",
    "saved_tensor_probe",
    "selective_cache_bytes",
    "single_block_bytes",
    "state_bytes",
    "state_totals",
    "step_flops",
    "step_grads",
    "step_peak",
    "step_shape",
    "storage_bytes",
    "storage_key",
    "transient_bytes",
    "what_fits",
]
