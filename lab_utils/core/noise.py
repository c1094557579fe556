"""Library log lines that carry no information for a reader, kept out of notebooks and reports.

Each pattern is one known line from a library, silenced where it is emitted; every other
line (a real warning) stays visible:

* kineto (the profiler's C++ backend) prints ``profiler_start`` / ``profiler_stop`` markers at its
  USDT level to file descriptor 2 around every profiled region.  Its error level sits below
  USDT, so no ``KINETO_LOG_LEVEL`` hides the markers and keeps its errors:
  :func:`quiet_stderr_fd` filters the descriptor's lines around a profiled region instead.
* torchao logs "Failed to load ....so" for each bundled extension it cannot load.  On a
  machine without CUDA none of them (CUDA kernels, a build for another Python) could serve,
  and torchao falls back to Python: dropped there, kept on a CUDA machine, where a missing
  kernel matters.
* torch deprecates ``register_constant`` on Enum subclasses, which torchao calls on import:
  nothing a user of the lab can act on.
* diffusers warns on import that torchao 0.18 lacks the tensor classes (NF4, uintx) it would
  allow when loading a torchao-quantized checkpoint; the labs load none (lab 02 builds diffusers'
  FLUX blocks from random weights).
* DCP warns on every save and load without a process group that it assumes one process.
  That is the intent wherever the lab does it (the trainer's checkpoints; a distributed run
  always has its group), and ``dcp.async_save`` warns from its worker thread, after any
  scoped filter is gone: a warnings filter for this one message.

:func:`install_log_filters` puts the filters in place (``lab_utils`` calls it on
import); :func:`split_noise` separates the known lines from a captured stream (the runner moves
them out of a report's pages into a log file beside them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator

KINETO_MARKER = re.compile(r"^USDT:.*ActivityProfilerHandler\.cpp:\d+\] profiler_(?:start|stop)\s*$")
TORCHAO_SO = re.compile(r"Failed to load .*torchao.*\.so")
ENUM_CONSTANT = re.compile(r"is an Enum subclass and is now natively supported by torch\.compile")
DIFFUSERS_TORCHAO = re.compile(r"Unable to import `torchao` Tensor objects")
DCP_SINGLE_PROCESS = re.compile(r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent")

#: Known noise lines in a captured stream (a notebook's stderr): always these, whatever the machine.
STREAM_NOISE = (KINETO_MARKER, ENUM_CONSTANT, DCP_SINGLE_PROCESS)


class _DropMatching(logging.Filter):
    def __init__(self, *patterns: re.Pattern, without_cuda: bool = False):
        super().__init__()
        self.patterns = patterns
        self.without_cuda = without_cuda  # drop only on a machine without CUDA

    def filter(self, record: logging.LogRecord) -> bool:
        if self.without_cuda and _cuda_available():
            return True
        msg = record.getMessage()
        return not any(p.search(msg) for p in self.patterns)


def _cuda_available() -> bool:
    """Whether CUDA is visible, asked of torch only where torch is already imported (a library
    that logs about its CUDA extensions imported it); this module itself never imports torch."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


_INSTALLED: dict[str, _DropMatching] = {}


def install_log_filters() -> None:
    """Drop torchao's extension-load failures (machines without CUDA) and torch's Enum-constant
    deprecation from their loggers, and DCP's single-process warning; idempotent."""
    if _INSTALLED:
        return
    warnings.filterwarnings("ignore", message=DCP_SINGLE_PROCESS.pattern, category=UserWarning)
    wanted = {
        "torch.utils._pytree": _DropMatching(ENUM_CONSTANT),
        "diffusers.quantizers.torchao.torchao_quantizer": _DropMatching(DIFFUSERS_TORCHAO),
        "torchao": _DropMatching(TORCHAO_SO, without_cuda=True),
    }
    for name, f in wanted.items():
        logging.getLogger(name).addFilter(f)
        _INSTALLED[name] = f


def split_noise(text: str, patterns=STREAM_NOISE) -> tuple[str, list[str]]:
    """(``text`` without the known noise lines, the lines removed)."""
    kept, dropped = [], []
    for line in text.splitlines(keepends=True):
        (dropped if any(p.search(line) for p in patterns) else kept).append(line)
    return "".join(kept), [d.rstrip("\n") for d in dropped]


@contextlib.contextmanager
def quiet_stderr_fd(patterns=(KINETO_MARKER,)) -> Iterator[list[str]]:
    """Capture file descriptor 2 (where C++ libraries write) for the block, then write back every
    line that matches none of ``patterns``; yields the list that receives the dropped lines.
    Python's own ``sys.stderr`` is flushed first, so its lines keep their order around the block."""
    dropped: list[str] = []
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield dropped
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept, dropped[:] = split_noise(tmp.read().decode(errors="replace"), patterns)
            if kept:
                os.write(2, kept.encode())
