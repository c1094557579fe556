"""Numerical checks shared by tests and labs: one assertion helper that explains itself.

* ``TOLERANCES[dtype] = (atol, rtol)`` ties tolerances to dtype in one place.
* ``assert_close`` reports how many elements mismatch, the first bad indices with
  their values, and NaN/Inf disagreements.
* ``poison_`` fills an output with NaN (or a sentinel for integer tensors) before a
  kernel writes it, so an unwritten element fails the comparison.
* ``rel_error``/``sqnr_db`` for end-to-end low precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (atol, rtol) for a fused op computed in `dtype` versus a float64 reference.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def tolerance(dtype: torch.dtype, scale: float = 1.0) -> tuple[float, float]:
    atol, rtol = TOLERANCES.get(dtype, (0.0, 0.0))
    return atol * scale, rtol * scale


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (float) or the dtype's max (integer/fp8-as-bits) so unwritten elements show."""
    if t.is_floating_point():
        try:
            return t.fill_(float("nan"))
        except RuntimeError:  # float8 formats: write the NaN bit pattern directly
            t.view(torch.uint8).fill_(0x7F)
            return t
    return t.fill_(torch.iinfo(t.dtype).max if t.dtype != torch.bool else True)


@dataclass(frozen=True)
class CloseReport:
    ok: bool
    n_bad: int
    numel: int
    max_abs: float
    max_rel: float
    message: str
    #: the largest share of its bound (atol + rtol * |expected|) an element's error used: the finite
    #: elements pass while it is <= 1
    worst_share: float = 0.0
    #: the bound ``max_abs`` is held to: the finite elements pass exactly while max_abs <= it (max_abs
    #: over ``worst_share``; with no error at all, the tightest element's bound), what a record of the
    #: figure carries as its ``tolerance``
    max_abs_bound: float = float("inf")


def compare(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float | torch.Tensor,
    rtol: float,
    name: str = "output",
    equal_nan: bool = False,
    show: int = 5,
) -> CloseReport:
    """Elementwise |actual - expected| <= atol + rtol * |expected|; ``atol`` may be a tensor (broadcast
    to the shape): a per-element error bound derived from the operands (then usually ``rtol`` = 0)."""
    if actual.shape != expected.shape:
        msg = f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        return CloseReport(False, -1, expected.numel(), float("inf"), float("inf"), msg)
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    a_nan, e_nan = torch.isnan(a), torch.isnan(e)
    a_inf, e_inf = torch.isinf(a), torch.isinf(e)
    diff = (a - e).abs()
    finite = torch.isfinite(a) & torch.isfinite(e)
    # Finite elements compare by tolerance; non-finite ones agree only when both sides
    # hold the same special value (NaN == NaN only with equal_nan).
    same_special = (a_inf & e_inf & (a == e)) | (a_nan & e_nan & equal_nan)
    per_element = isinstance(atol, torch.Tensor)
    allowed = (atol.detach().to("cpu", torch.float64) if per_element else atol) + rtol * e.abs()
    bad = torch.where(finite, ~(diff <= allowed), ~same_special)
    n_bad = int(bad.sum())
    max_abs = float(diff[finite].max()) if bool(finite.any()) else 0.0
    rel = diff / e.abs().clamp_min(1e-30)
    max_rel = float(rel[finite].max()) if bool(finite.any()) else 0.0
    limit = torch.as_tensor(allowed, dtype=torch.float64).expand_as(e)[finite]
    d = diff[finite]
    share = torch.where(limit > 0, d / limit.clamp_min(1e-300), torch.where(d > 0, torch.inf, 0.0))
    worst = float(share.max()) if share.numel() else 0.0
    fig_bound = max_abs / worst if worst > 0 else (float(limit.min()) if limit.numel() else float("inf"))
    fig = dict(worst_share=worst, max_abs_bound=fig_bound)
    if n_bad == 0:
        return CloseReport(True, 0, e.numel(), max_abs, max_rel, f"{name}: ok (max abs {max_abs:.3g})", **fig)
    idx = bad.nonzero()[:show]
    how = f"per-element bound, rtol={rtol:g}" if per_element else f"atol={atol:g}, rtol={rtol:g}"
    lines = [
        f"{name}: {n_bad} of {e.numel()} elements mismatch ({how}); "
        f"max abs err {max_abs:.4g}, max rel err {max_rel:.4g}"
    ]
    nan_dis = int((a_nan ^ e_nan).sum())
    inf_dis = int((a_inf ^ e_inf).sum())
    if nan_dis or inf_dis:
        lines.append(
            f"  NaN disagreements: {nan_dis} (actual NaN {int(a_nan.sum())}, expected NaN "
            f"{int(e_nan.sum())}); Inf disagreements: {inf_dis}"
        )
    for ix in idx.tolist():
        t = tuple(ix)
        bound = f", allowed {allowed.expand_as(e)[t].item():.3g}" if per_element else ""
        lines.append(f"  at {t}: actual {a[t].item():.6g}, expected {e[t].item():.6g}{bound}")
    return CloseReport(False, n_bad, e.numel(), max_abs, max_rel, "\n".join(lines), **fig)


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    dtype: torch.dtype | None = None,
    name: str = "output",
    equal_nan: bool = False,
) -> CloseReport:
    """Assert elementwise closeness; tolerances default to ``TOLERANCES[dtype or actual.dtype]``."""
    if atol is None or rtol is None:
        d_atol, d_rtol = tolerance(dtype or actual.dtype)
        atol = d_atol if atol is None else atol
        rtol = d_rtol if rtol is None else rtol
    rep = compare(actual, expected, atol=atol, rtol=rtol, name=name, equal_nan=equal_nan)
    if not rep.ok:
        raise AssertionError(rep.message)
    return rep


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "output") -> None:
    """Bit-exact equality (casts, quantization): compares the raw bits, so NaN == NaN
    with the same payload and +0 != -0."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{name}: shape/dtype {tuple(actual.shape)}/{actual.dtype} != {tuple(expected.shape)}/{expected.dtype}"
        )
    nbits = actual.element_size() * 8
    view = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[nbits]
    a = actual.detach().cpu().contiguous().view(view)
    e = expected.detach().cpu().contiguous().view(view)
    bad = a != e
    if bool(bad.any()):
        idx = bad.nonzero()[:5].tolist()
        det = "; ".join(
            f"at {tuple(i)}: {actual[tuple(i)].item()!r} (bits {a[tuple(i)].item():#x}) vs "
            f"{expected[tuple(i)].item()!r} (bits {e[tuple(i)].item():#x})"
            for i in idx
        )
        raise AssertionError(f"{name}: {int(bad.sum())} of {a.numel()} elements differ bitwise; {det}")


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_F / ||expected||_F in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20·log10(||x|| / ||x - q(x)||)."""
    a, e = actual.detach().double(), expected.detach().double()
    noise = (a - e).norm()
    if float(noise) == 0.0:
        return float("inf")
    return float(20 * torch.log10(e.norm() / noise))
