"""The one table of dtype names: a parameter's string <-> a ``torch.dtype``.

Labs take dtypes as plain strings (``"bfloat16"``) so that notebooks, YAML sets and
``perflab run --param`` share one spelling; records write the same names back.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lab_utils.core.config import ConfigError

#: parameter name -> torch dtype (the floating-point dtypes the labs compute in)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}

#: the dtypes a lab's ``dtype`` parameter usually offers (float64 is for references)
LAB_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def parse_dtype(param: str, value: str | torch.dtype, allowed: Iterable[str] | None = None) -> torch.dtype:
    """The ``torch.dtype`` of a parameter value (a name from :data:`DTYPES` or a dtype);
    a value outside ``allowed`` (default: every name in the table) is a ConfigError."""
    names = tuple(allowed) if allowed is not None else tuple(DTYPES)
    name = dtype_name(value) if isinstance(value, torch.dtype) else value
    if not isinstance(name, str) or name not in names or name not in DTYPES:
        raise ConfigError(param, value, "one of " + ", ".join(repr(n) for n in names))
    return DTYPES[name]


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (a string passes through unchanged)."""
    if isinstance(dtype, str):
        return dtype
    if not isinstance(dtype, torch.dtype):
        raise ConfigError("dtype", dtype, "a torch.dtype or a dtype name")
    return str(dtype).removeprefix("torch.")
