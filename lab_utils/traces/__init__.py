"""Real GPU profiler traces (Kineto / ``torch.profiler`` JSON): read, attribute, break down.

Layer 2: imports ``lab_utils.core`` only.  See :mod:`lab_utils.traces.reader` for reading.
"""

from lab_utils.traces.reader import RankTrace, read_job, read_rank, trace_files

__all__ = ["RankTrace", "read_job", "read_rank", "trace_files"]
