"""perflab compute kernels: one op per module, each with a plain-torch reference.

Design note: Triton reads ``TRITON_INTERPRET`` when a kernel is *defined*, so the
switch must be set before any kernel module is imported.  On a machine without a
CUDA device we set it here (unless the user already chose), which makes every
``@triton.jit`` kernel in this package run through Triton's interpreter: correct,
slow, never to be timed.  This package never imports ``lab_utils``.
"""

from __future__ import annotations

import os as _os


def _cuda_present() -> bool:
    # Cheap check that does not initialise CUDA in a forked-worker-hostile way.
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a broken install
        return False


if "TRITON_INTERPRET" not in _os.environ and not _cuda_present():
    _os.environ["TRITON_INTERPRET"] = "1"

TRITON_INTERPRETED: bool = _os.environ.get("TRITON_INTERPRET", "0") == "1"

from .registry import Variant, get_variant, list_ops, register, variants  # noqa: E402

__all__ = ["TRITON_INTERPRETED", "Variant", "get_variant", "list_ops", "register", "variants"]
