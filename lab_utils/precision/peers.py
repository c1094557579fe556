"""The field's low-precision training recipes beside perflab's own: torchao's float8 training.

torchao's ``convert_to_float8_training`` (tensorwise and rowwise scaling) is registered as the
recipes ``torchao_float8_tensorwise`` / ``torchao_float8_rowwise`` (``lab_utils.precision.recipes``;
applied by ``lab_utils.precision.quantized.apply_recipe``, emulated by torchao on CPU).  This
module says whose a recipe is, whether it can train on a device (and why not), and which of lab
04's per-layer SQNR figures show its quantizers' error.
"""

from __future__ import annotations

import importlib.metadata

import pandas as pd
import torch

from lab_utils.precision.recipes import RECIPES

#: torchao's float8 training recipes (the peer a team would adopt) and the per-layer SQNR figures
#: of lab 04's ``sqnr_real`` (lab_utils.studies.low_precision) that show their quantizers' error
PEER_SQNR_VARIANTS = {
    "torchao_float8_tensorwise": "fp8_e4m3/tensor (x, w) and fp8_e5m2/tensor (grad): the same quantizers, bit for bit "
    "(emulation proof)",
    "torchao_float8_rowwise": "fp8_e4m3/row (x, w and grad); torchao also rounds each row's scale to a power of two",
}


def recipe_why_not(name: str, device) -> str | None:
    """None when recipe ``name`` can train here, else why not (torchao: importable, and on a GPU
    float8 matmuls, sm_89 or newer; on CPU torchao emulates them)."""
    if RECIPES[name].kind != "torchao_float8":
        return None
    try:
        import torchao.float8  # noqa: F401, PLC0415  (optional, heavy)
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return f"torchao is not importable: {type(e).__name__}: {e}"
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
        major, minor = torch.cuda.get_device_capability(dev)
        return f"torchao float8 training needs float8 matmuls (sm_89 or newer); this GPU is sm_{major}{minor}"
    return None


def recipe_sources(recipes, device) -> pd.DataFrame:
    """Each recipe: whose it is, how it runs on this device (or why it cannot), and the per-layer
    SQNR figures that show its quantizers' error."""
    rows = []
    for name in recipes:
        r = RECIPES[name]
        why = recipe_why_not(name, device)
        if r.kind == "torchao_float8":
            source = f"torchao {importlib.metadata.version('torchao')} convert_to_float8_training ({r.torchao_recipe})"
            how = "float8 matmuls" if torch.device(device).type == "cuda" else "emulated by torchao (emulate=True)"
        else:
            source, how = "perflab (lab_kernels.quant, exact emulation)", "emulated"
        rows.append(
            dict(recipe=name, source=source, here=how if why is None else f"not run: {why}", per_layer_sqnr=
                 PEER_SQNR_VARIANTS.get(name, ""))
        )  # fmt: skip
    return pd.DataFrame(rows).set_index("recipe")


__all__ = ["PEER_SQNR_VARIANTS", "recipe_sources", "recipe_why_not"]
