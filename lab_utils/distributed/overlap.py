"""Exposed communication in the projection: an overlap model, its error band and the dominant assumption.

Design note
-----------
A projected step is ``compute + exposed``, where the exposed communication is

    exposed = max((1 - overlap) * comm, comm - compute, 0)

``overlap`` is the fraction of the collectives' time hidden under compute.  Where the
lab measured the strategy (the ``overlap_fraction`` of its profiled runs, mean over
ranks and runs; ``fsdp/bf16`` counts as ``fsdp``) that value is used, with the measured
minimum and maximum as its range; a strategy not measured takes the median of all the
measured runs (range: their minimum to maximum); with nothing measured, a stated 0.5
with the full 0..1 range.  Communication can never hide under more compute than the
step has, hence the second term.

The band: the communication time is uncertain by the alpha-beta model's measured
relative error ``e`` (median |error| of the model against the traces), taken as a
multiplicative factor ``1 / (1 - e)`` both ways (the model underpredicts by ``e`` means
the truth is ``comm / (1 - e)``); the overlap by its range; the compute by a stated
relative error (the MFU is an assumption).  The low/high of the exposed time combine the
comm and overlap ends; :func:`sensitivity` varies each assumption alone across its range
and reports the step-time swing, and :func:`dominant` names the one that moves it most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

STATED_DEFAULT = 0.5
MAX_REL_ERR = 0.95  # a measured error of 100% or more would make the band unbounded


@dataclass(frozen=True)
class OverlapRange:
    point: float
    low: float
    high: float
    source: str


@dataclass(frozen=True)
class OverlapModel:
    """Per strategy: the measured overlap fraction (and its range); a default for the rest."""

    measured: dict[str, OverlapRange] = field(default_factory=dict)
    default: OverlapRange = OverlapRange(STATED_DEFAULT, 0.0, 1.0, "stated default (nothing measured)")

    def for_strategy(self, strategy: str) -> OverlapRange:
        return self.measured.get(strategy, self.default)


def _clip01(x: float) -> float:
    return min(1.0, max(0.0, float(x)))


def overlap_model(fractions: list[tuple[str, float]]) -> OverlapModel:
    """From measured (strategy, overlap_fraction) pairs: one entry per base strategy (the name
    before ``/``); the default is the median of all of them (NaNs are dropped)."""
    by: dict[str, list[float]] = {}
    for s, f in fractions:
        if f is not None and not math.isnan(f):
            by.setdefault(s.split("/")[0], []).append(_clip01(f))
    measured = {s: OverlapRange(float(np.mean(v)), min(v), max(v), f"measured ({len(v)} ranks)") for s, v in by.items()}
    allv = [f for v in by.values() for f in v]
    if not allv:
        return OverlapModel(measured)
    default = OverlapRange(float(np.median(allv)), min(allv), max(allv), "median of the measured strategies")
    return OverlapModel(measured, default)


def exposed_comm(comm: float, compute: float, overlap: float) -> float:
    """The part of ``comm`` not hidden: ``(1 - overlap) * comm``, never less than ``comm - compute``."""
    return max((1.0 - _clip01(overlap)) * comm, comm - compute, 0.0)


def comm_range(comm: float, rel_err: float) -> tuple[float, float]:
    """``comm`` scaled down and up by the model's relative error (multiplicative, ``1 / (1 - e)``)."""
    e = min(abs(rel_err), MAX_REL_ERR)
    return comm * (1 - e), comm / (1 - e)


def exposed_band(comm: float, compute: float, ov: OverlapRange, rel_err: float) -> tuple[float, float]:
    """Low / high exposed communication: the small comm with the high overlap, the large with the low."""
    lo_c, hi_c = comm_range(comm, rel_err)
    return exposed_comm(lo_c, compute, max(ov.high, ov.point)), exposed_comm(hi_c, compute, min(ov.low, ov.point))


def step_time(compute: float, comm: float, overlap: float) -> float:
    return compute + exposed_comm(comm, compute, overlap)


def sensitivity(
    compute: float, comm: float, ov: OverlapRange, rel_err: float, compute_rel_err: float
) -> dict[str, float]:
    """Step-time swing (high minus low) when one assumption alone spans its range, the others at their point."""
    lo_c, hi_c = comm_range(comm, rel_err)
    lo_k, hi_k = compute * (1 - compute_rel_err), compute * (1 + compute_rel_err)
    return {
        "overlap": abs(step_time(compute, comm, ov.low) - step_time(compute, comm, ov.high)),
        "bandwidth": abs(step_time(compute, hi_c, ov.point) - step_time(compute, lo_c, ov.point)),
        "compute": abs(step_time(hi_k, comm, ov.point) - step_time(lo_k, comm, ov.point)),
    }


def dominant(swings: dict[str, float]) -> str:
    """The assumption with the largest swing (ties: the first in overlap, bandwidth, compute order)."""
    return max(swings, key=lambda k: swings[k])
