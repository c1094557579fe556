"""Distributed training of the MMDiT on torch.distributed (gloo on CPU, NCCL on GPUs).

``spec`` (what a run does, validated), ``launch`` (ranks on this machine, watchdog),
``worker`` (one rank; also what torchrun starts), ``parallel`` (DDP / FSDP2 / HSDP / TP
on a DeviceMesh), ``context_parallel`` (ring and Ulysses attention), ``comm`` (collectives
and overlap from traces, alpha-beta model), ``projection`` (flux-dev at 8..1024 GPUs),
``checkpoint`` (DCP save/resume in the single-process layout, so any strategy resumes any other's),
``verify`` (agreement with the single-process run and, for bf16, with its one-process emulation).
"""

from lab_utils.distributed.launch import DistResult, DistRunError, launch, launch_cases
from lab_utils.distributed.spec import COMPONENTS, STRATEGIES, DistConfig, Mesh, components

__all__ = [
    "COMPONENTS",
    "STRATEGIES",
    "DistConfig",
    "DistResult",
    "DistRunError",
    "Mesh",
    "components",
    "launch",
    "launch_cases",
]
