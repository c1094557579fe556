"""Loading the step a lab's ``step`` parameter names, once per run, and refusing a bad one before
anything is measured.

``step`` is ``"package.module:function"``.  A lab config checks only its form
(:func:`check_step_spec`); the lab's first cell resolves it once (:func:`resolve_factory`: the
module imported with the working directory and the folders of ``PERFLAB_STEP_PATH`` importable,
which ``perflab run`` and ``make lab`` set to the folder they were started in and the labs'
folder), builds it (:class:`StepSource`, which every later build of the run reuses: a what-fits
bisection, a lever, a fresh run from the same weights) and checks the step it returns
(:func:`check_step`).  The step that was checked is the step the lab measures.

Refused, each with a :class:`ConfigError` naming ``step``, the value and what was seen: a name
that does not import or is not a function; a result that is not a :class:`StepFactory`;
``make_batch(k)`` that differs for equal ``k`` or repeats for different ``k``; a loss that is not
a zero-dimensional tensor (at the lab's batch size and at 2), that reaches no parameter or is
not finite; gradients that are not finite or reach no parameter; a failing optimizer step.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lab_utils.core.config import ConfigError
from lab_utils.step import STEP_PATH_ENV
from lab_utils.step.contract import StepFactory, same_batch

#: The default: perflab's own MMDiT, one registered step (lab_utils.step.mmdit).
DEFAULT_STEP = "lab_utils.step.mmdit:mmdit_step"
#: Keywords a factory may accept; it is called with those its signature names.  ``lab`` is the
#: lab's config (a factory may read its parameters: perflab's MMDiT takes its preset and shapes).
FACTORY_KEYWORDS = ("device", "dtype", "batch_size", "seed", "lab")
SPEC_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


def refuse(value: Any, reason: str) -> ConfigError:
    return ConfigError("step", value, f"a step factory 'package.module:function' ({reason})")


def check_step_spec(spec: Any) -> str:
    """A lab config's check of ``step``: its form only (the lab's first cell imports, builds and
    checks it once, :func:`load_step`)."""
    if not isinstance(spec, str) or not SPEC_RE.match(spec):
        raise refuse(spec, "a string such as 'my_models.flux:flux_step'")
    return spec


def search_path() -> list[str]:
    """Where a factory's package may live: ``PERFLAB_STEP_PATH``'s folders, then the working directory."""
    extra = [p for p in os.environ.get(STEP_PATH_ENV, "").split(os.pathsep) if p]
    return list(dict.fromkeys(str(Path(p).resolve()) for p in [*extra, os.getcwd()]))


def resolve_factory(spec: Any) -> Callable[..., StepFactory]:
    """The function ``spec`` names (imported, with :func:`search_path` importable), or a
    ConfigError saying why not."""
    check_step_spec(spec)
    mod_name, fn_name = spec.split(":")
    where = search_path()
    for p in reversed(where):
        if p not in sys.path:
            sys.path.insert(0, p)
    importlib.invalidate_caches()
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module's reason
        looked = f" (looked on sys.path and in {', '.join(where)})" if isinstance(e, ImportError) else ""
        raise refuse(spec, f"importing {mod_name!r} failed: {type(e).__name__}: {e}{looked}") from e
    fn = getattr(mod, fn_name, None)
    if fn is None:
        raise refuse(spec, f"module {mod_name!r} has no attribute {fn_name!r}")
    if not callable(fn):
        raise refuse(spec, f"{spec} is a {type(fn).__name__}, not a function")
    return fn


def _accepted(fn: Callable, given: dict) -> dict:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return given
    return {k: v for k, v in given.items() if k in params}


def _check_result(spec: str, out: Any) -> StepFactory:
    if not isinstance(out, StepFactory):
        raise refuse(spec, f"it returned a {type(out).__name__}, not a lab_utils.step.contract.StepFactory")
    if not isinstance(out.model, nn.Module):
        raise refuse(spec, f"its model is a {type(out.model).__name__}, not a torch.nn.Module")
    if not isinstance(out.optimizer, torch.optim.Optimizer):
        raise refuse(spec, f"its optimizer is a {type(out.optimizer).__name__}, not a torch.optim.Optimizer")
    for f in ("make_batch", "loss"):
        if not callable(getattr(out, f)):
            raise refuse(spec, f"its {f} is not callable")
    if out.flops is not None and not callable(out.flops):
        raise refuse(spec, "its flops is not a function of the batch")
    if isinstance(out.phases, str) or not all(isinstance(p, str) for p in out.phases):
        raise refuse(spec, f"its phases {out.phases!r} are not a tuple of names")
    return out


@dataclass
class StepSource:
    """A factory resolved once and the keywords of the lab's build: :meth:`build` calls it again
    with some changed (a batch size, a lever), never importing it again."""

    spec: str
    fn: Callable[..., StepFactory]
    keywords: dict = field(default_factory=dict)

    def accepts(self, keyword: str) -> bool:
        return keyword in _accepted(self.fn, {keyword: None})

    def build(self, **changed) -> StepFactory:
        given = {k: v for k, v in {**self.keywords, **changed}.items() if v is not None}
        try:
            out = self.fn(**_accepted(self.fn, given))
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the factory's own failure is the reason given
            raise refuse(self.spec, f"calling it failed: {type(e).__name__}: {e}") from e
        out = _check_result(self.spec, out)
        out.name, out.source = self.spec, StepSource(self.spec, self.fn, given)
        return out


def build_step(spec: str, **keywords) -> StepFactory:
    """Resolve ``spec`` and call the factory with the keywords it accepts (``device``,
    ``dtype``, ``batch_size``, ``seed``, ``lab``); the result's type is checked, no step is run."""
    bad = sorted(set(keywords) - set(FACTORY_KEYWORDS))
    if bad:
        raise ConfigError("step keywords", bad, "any of " + ", ".join(FACTORY_KEYWORDS))
    return StepSource(spec, resolve_factory(spec), {}).build(**keywords)


# --------------------------------------------------------------------------------------
# The checks, before anything is measured
# --------------------------------------------------------------------------------------


def _shape_of(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)}"
    return f"a {type(x).__name__}"


def _scalar_loss(spec: str, step: StepFactory, batch: Any, batch_size: int | None) -> torch.Tensor:
    at = f" at batch size {batch_size}" if batch_size else ""
    try:
        loss = step.loss(step.model, batch)
    except Exception as e:  # noqa: BLE001 - the factory's own failure is the reason given
        raise refuse(spec, f"its first step failed in the forward{at}: {type(e).__name__}: {e}") from e
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise refuse(
            spec,
            f"its loss{at} is {_shape_of(loss)}, not a zero-dimensional tensor "
            "(reduce it to one number, e.g. .mean(), before returning it)",
        )
    return loss


def check_batches(spec: str, step: StepFactory) -> Any:
    """``make_batch`` equal for equal ``k``, different for different ``k``; returns batch 0."""
    try:
        b0, b1, again = step.make_batch(0), step.make_batch(1), step.make_batch(0)
    except Exception as e:  # noqa: BLE001
        raise refuse(spec, f"its make_batch failed: {type(e).__name__}: {e}") from e
    if not same_batch(b0, again):
        raise refuse(spec, "make_batch(0) gave two different batches (seed its random draws with k)")
    if same_batch(b0, b1):
        raise refuse(spec, "make_batch(0) and make_batch(1) gave the same batch (each step k needs its own)")
    return again


def first_step(spec: str, step: StepFactory, batch_size: int | None = None) -> float:
    """Step 0 on the step to be measured, checked: batches (:func:`check_batches`), a
    zero-dimensional finite loss that reaches the parameters, finite gradients, one optimizer
    step.  Returns the loss; the step has then taken step 0 (weights updated once)."""
    batch = check_batches(spec, step)
    loss = _scalar_loss(spec, step, batch, batch_size)
    if not loss.requires_grad:
        raise refuse(spec, "its loss does not require grad (no parameter reaches it)")
    value = float(loss.detach())
    if not math.isfinite(value):
        raise refuse(spec, f"its first loss is {value}")
    try:
        loss.backward()
    except Exception as e:  # noqa: BLE001
        raise refuse(spec, f"its first step failed in the backward: {type(e).__name__}: {e}") from e
    named = [(n, p) for n, p in step.model.named_parameters() if p.grad is not None]
    if not named:
        raise refuse(spec, "no parameter of its model got a gradient")
    bad = [n for n, p in named if not torch.isfinite(p.grad).all()]
    if bad:
        raise refuse(spec, f"its first gradients are not finite in {len(bad)} of {len(named)} parameters ({bad[0]!r})")
    try:
        if step.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(step.model.parameters(), step.grad_clip)
        step.optimizer.step()
        step.optimizer.zero_grad(set_to_none=True)
    except Exception as e:  # noqa: BLE001
        raise refuse(spec, f"its first optimizer step failed: {type(e).__name__}: {e}") from e
    return value


def check_at_two(source: StepSource) -> None:
    """The loss at batch size 2 is zero-dimensional too (a per-sample loss squeezed at batch 1
    is one number there); built apart and freed before the lab's own build."""
    if not source.accepts("batch_size") or source.keywords.get("batch_size") == 2:
        return
    step = source.build(batch_size=2)
    try:
        batch = step.make_batch(0)
        with torch.no_grad():
            _scalar_loss(source.spec, step, batch, 2)
    finally:
        del step
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def load_step(spec: str = DEFAULT_STEP, *, check: bool = True, **keywords) -> StepFactory:
    """The step ``spec`` names, resolved once and built with ``keywords`` (device, dtype,
    batch_size, seed, lab: those the factory accepts); with ``check``, refused as the module note
    says or returned after its checked step 0 (weights updated once, optimizer state made)."""
    bad = sorted(set(keywords) - set(FACTORY_KEYWORDS))
    if bad:
        raise ConfigError("step keywords", bad, "any of " + ", ".join(FACTORY_KEYWORDS))
    source = StepSource(spec, resolve_factory(spec), {k: v for k, v in keywords.items() if v is not None})
    if check:
        check_at_two(source)
    step = source.build()
    if check:
        first_step(spec, step, keywords.get("batch_size"))
    return step
