"""Loading a factory named ``package.module:function`` and refusing a bad one before any
measurement: a name that does not import, a result that is not a :class:`StepFactory`, a
first step that fails (raises, a loss that is not a finite scalar with a gradient, no
parameter receiving a gradient).  Each refusal is a :class:`ConfigError` naming ``step``,
the value and the reason."""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lab_utils.core.config import ConfigError
from lab_utils.step.contract import StepFactory, run_step

#: The default: perflab's own MMDiT (lab_utils.step.mmdit).
DEFAULT_STEP = "lab_utils.step.mmdit:mmdit_step"
#: Keywords a factory may accept; it is called with those its signature names.
FACTORY_KEYWORDS = ("device", "dtype", "batch_size", "seed")
SPEC_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


def _refuse(value: Any, reason: str) -> ConfigError:
    return ConfigError("step", value, f"a step factory 'package.module:function' ({reason})")


def resolve_factory(spec: Any) -> Callable[..., StepFactory]:
    """The function ``spec`` names (imported), or a ConfigError saying why not."""
    if not isinstance(spec, str) or not SPEC_RE.match(spec):
        raise _refuse(spec, "a string such as 'my_pkg.models:flux_step'")
    mod_name, fn_name = spec.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module's reason
        raise _refuse(spec, f"importing {mod_name!r} failed: {type(e).__name__}: {e}") from e
    fn = getattr(mod, fn_name, None)
    if fn is None:
        raise _refuse(spec, f"module {mod_name!r} has no attribute {fn_name!r}")
    if not callable(fn):
        raise _refuse(spec, f"{spec} is a {type(fn).__name__}, not a function")
    return fn


def check_step_spec(spec: Any) -> str:
    """A lab config's check of ``step``: the name imports and is callable (the first step is
    run by :func:`load_step`, before the lab measures anything)."""
    resolve_factory(spec)
    return spec


def _kwargs(fn: Callable, given: dict) -> dict:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return given
    return {k: v for k, v in given.items() if k in params}


def _check_result(spec: str, out: Any) -> StepFactory:
    if not isinstance(out, StepFactory):
        raise _refuse(spec, f"it returned a {type(out).__name__}, not a lab_utils.step.contract.StepFactory")
    if not isinstance(out.model, nn.Module):
        raise _refuse(spec, f"its model is a {type(out.model).__name__}, not a torch.nn.Module")
    if not isinstance(out.optimizer, torch.optim.Optimizer):
        raise _refuse(spec, f"its optimizer is a {type(out.optimizer).__name__}, not a torch.optim.Optimizer")
    for f in ("make_batch", "loss"):
        if not callable(getattr(out, f)):
            raise _refuse(spec, f"its {f} is not callable")
    if out.flops is not None and not callable(out.flops):
        raise _refuse(spec, "its flops is not a function of the batch")
    if isinstance(out.phases, str) or not all(isinstance(p, str) for p in out.phases):
        raise _refuse(spec, f"its phases {out.phases!r} are not a tuple of names")
    return out


def first_step(spec: str, step: StepFactory) -> float:
    """Run step 0 and check it: the loss is a finite scalar with a gradient and some
    parameter gets a gradient.  Returns the loss."""
    try:
        batch = step.make_batch(0)
        loss = step.loss(step.model, batch)
    except Exception as e:  # noqa: BLE001 - the factory's own failure is the reason given
        raise _refuse(spec, f"its first step failed in the forward: {type(e).__name__}: {e}") from e
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise _refuse(spec, f"its loss returned {type(loss).__name__}, not a scalar tensor")
    if not loss.requires_grad:
        raise _refuse(spec, "its loss does not require grad (no parameter reaches it)")
    value = float(loss.detach())
    if not math.isfinite(value):
        raise _refuse(spec, f"its first loss is {value}")
    try:
        loss.backward()
    except Exception as e:  # noqa: BLE001
        raise _refuse(spec, f"its first step failed in the backward: {type(e).__name__}: {e}") from e
    if not any(p.grad is not None for p in step.model.parameters()):
        raise _refuse(spec, "no parameter of its model got a gradient")
    step.optimizer.zero_grad(set_to_none=True)
    try:
        run_step(step, 0)  # the optimizer too, once
    except Exception as e:  # noqa: BLE001
        raise _refuse(spec, f"its first optimizer step failed: {type(e).__name__}: {e}") from e
    return value


def build_step(spec: str, **kwargs) -> StepFactory:
    """Import and call the factory (with the keywords it accepts) and check the result's
    type; no step is run."""
    fn = resolve_factory(spec)
    given = {k: v for k, v in kwargs.items() if v is not None}
    bad = sorted(set(given) - set(FACTORY_KEYWORDS))
    if bad:
        raise ConfigError("step keywords", bad, "any of " + ", ".join(FACTORY_KEYWORDS))
    try:
        out = fn(**_kwargs(fn, given))
    except Exception as e:  # noqa: BLE001
        raise _refuse(spec, f"calling it failed: {type(e).__name__}: {e}") from e
    out = _check_result(spec, out)
    out.name = spec
    return out


def load_step(spec: str = DEFAULT_STEP, *, check: bool = True, **kwargs) -> StepFactory:
    """The step ``spec`` names, built with ``kwargs`` (device, dtype, batch_size, seed: those
    the factory accepts) and, with ``check``, its first step run and checked (the returned
    step has then taken step 0: weights updated once, optimizer state made)."""
    step = build_step(spec, **kwargs)
    if check:
        first_step(spec, step)
    return step
