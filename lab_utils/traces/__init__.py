"""Real GPU profiler traces (Kineto / ``torch.profiler`` JSON): read, attribute, break down.

Layer 2: imports ``lab_utils.core`` only.  The front object is :class:`TraceAnalysis`
(:mod:`lab_utils.traces.analysis` has its API with examples); the modules each hold one idea:
``reader``, ``attribute``, ``phases``, ``categories``, ``breakdown``, ``launches``, ``roofline``,
``collectives``.
"""

from lab_utils.traces.analysis import TraceAnalysis
from lab_utils.traces.phases import PhaseTable
from lab_utils.traces.reader import RankTrace, read_job, read_rank, trace_files

__all__ = ["PhaseTable", "RankTrace", "TraceAnalysis", "read_job", "read_rank", "trace_files"]
