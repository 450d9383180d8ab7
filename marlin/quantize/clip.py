"""Clip search: each group's range from a grid of shrunken ranges, kept by Hessian-weighted error.

A max-abs scale (range = the group's largest |w|) spends the levels on the outliers; shrinking
the range clips those few weights but rounds all the others more finely. Which is better depends
on how much each input matters, so every candidate is scored by the error it causes on the
layer's output, ``D H_g D^T`` per output row, where D is the rounding error of the group's
weights and H_g the group's block of the input Hessian (marlin.quantize.hessian). The grid
includes 1.0 (no clipping) and ties keep the larger range, so the search is never worse than
the unclipped range on this objective.

The grid, DEFAULT_GRID = 1.00, 0.95, ..., 0.55 (ten factors): below about half the range, clipping
cuts into the bulk of a roughly Gaussian group rather than its tail, and a step of 5% is close to
the scale's own resolution for 4 bits (moving the range by one level out of ~8 is 12%), so a finer
grid finds nearly the same scales at twice the cost (the search is a grid x group-size product per
group, inside GPTQ's column loop). The same grid is used for every group size and format.

Formats (WeightFormat), as marlin.packing stores them:
  * symmetric, ``bits`` 4 or 8: q in [-2^(bits-1), 2^(bits-1) - 1], w = q * s, s = 2 max|w| / (2^bits - 1);
    a candidate shrinks max|w|.
  * asymmetric (zero points), 4 bits: u in [0, 15], w = (u - z) * s with the range [min(w, 0),
    max(w, 0)], s = range / 15 and the integer zero point z = round(-min / s); a candidate shrinks
    both ends of the range by the same factor (the range keeps 0 inside, so pruned or dead
    weights stay exactly 0); with ``separate_ends`` each end takes its own factor of the grid,
    which also shifts the range toward the end whose tail costs less to clip (len(grid)^2
    candidates, all of them kept by the same rule, so never worse than the shared factor).
Scales are rounded to fp16 before the weights are rounded against them (the checkpoint stores fp16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = [
    "DEFAULT_GRID",
    "WeightFormat",
    "SYM4",
    "maxabs_scale",
    "candidate_scale",
    "weighted_error",
    "search_scale",
    "search_params",
]

DEFAULT_GRID = tuple(round(1.0 - 0.05 * i, 2) for i in range(10))


@dataclass(frozen=True)
class WeightFormat:
    """One of the Marlin weight formats: ``bits`` 4 or 8, symmetric or (4 bits) with zero points."""

    bits: int = 4
    sym: bool = True

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"bits = {self.bits!r}, expected 4 or 8")
        if not self.sym and self.bits != 4:
            raise ValueError(f"asymmetric (zero-point) weights with bits = {self.bits}: zero points exist for 4 bits only")

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1)) if self.sym else 0

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.sym else self.maxq

    def params(
        self, w: torch.Tensor, factor: float = 1.0, factor_lo: Optional[float] = None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(scale [R], zero [R] or None) of rows w [R, c] with the range shrunk by ``factor``
        (with zero points, ``factor_lo`` shrinks the lower end instead, if given).

        Scales are fp16 values held in float32; a row whose scale is 0 (all zeros) gets scale 1.
        """
        w = w.float()
        if self.sym:
            scale = (w.abs().amax(dim=1) * (factor * 2.0 / self.maxq)).to(torch.float16).float()
            return torch.where(scale == 0, torch.ones_like(scale), scale), None
        lo = w.amin(dim=1).clamp(max=0) * (factor if factor_lo is None else factor_lo)
        hi = w.amax(dim=1).clamp(min=0) * factor
        scale = ((hi - lo) / self.maxq).to(torch.float16).float()
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = torch.clamp(torch.round(-lo / scale), 0, self.maxq)
        return scale, zero

    def quantize(
        self, w: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q as stored, dequantized) of w [R, c] with per-row scale [R] and zero [R] (or None)."""
        s = scale.unsqueeze(1)
        if zero is None:
            q = torch.clamp(torch.round(w / s), self.qmin, self.qmax)
            return q, q * s
        z = zero.unsqueeze(1)
        u = torch.clamp(torch.round(w / s) + z, 0, self.maxq)
        return u, (u - z) * s


SYM4 = WeightFormat(4, True)


def candidate_scale(w: torch.Tensor, factor: float) -> torch.Tensor:
    """Symmetric 4-bit scales [R] (fp16 values, float32) of rows w [R, c]: 2 * factor * max|w| / 15."""
    return SYM4.params(w, factor)[0]


def maxabs_scale(w: torch.Tensor) -> torch.Tensor:
    """The round-to-nearest scale [R] of rows w [R, c] (no clipping), as in marlin.packing.quantize."""
    return candidate_scale(w, 1.0)


def weighted_error(
    w: torch.Tensor,
    scale: torch.Tensor,
    h: Optional[torch.Tensor],
    zero: Optional[torch.Tensor] = None,
    fmt: WeightFormat = SYM4,
) -> torch.Tensor:
    """Per-row error [R] of rounding w [R, c] with ``scale`` [R] (and ``zero``): D H D^T, or ||D||^2 without h."""
    d = w - fmt.quantize(w, scale, zero)[1]
    if h is None:
        return (d * d).sum(dim=1)
    if h.dim() == 1:  # a diagonal weighting, given as its diagonal [c]
        return (d * d * h).sum(dim=1)
    return ((d @ h) * d).sum(dim=1)


def _check_grid(grid: Sequence[float]) -> None:
    if not grid or any(not 0 < f <= 1 for f in grid):
        raise ValueError(f"clip grid = {tuple(grid)!r}, expected factors in (0, 1]")


def search_params(
    w: torch.Tensor,
    h: Optional[torch.Tensor],
    grid: Sequence[float] = DEFAULT_GRID,
    fmt: WeightFormat = SYM4,
    separate_ends: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(scale [R], zero [R] or None) with the least weighted_error over ``grid``, per row.
    ``separate_ends`` (zero points only): each end of the range shrinks by its own factor of the
    grid (len(grid)^2 candidates), which also shifts the range."""
    _check_grid(grid)
    w = w.float()
    best = best_err = None
    factors = sorted(set(grid), reverse=True)  # 1.0 first: ties keep the larger range
    pairs = [(f, f) for f in factors]
    if separate_ends and not fmt.sym:
        pairs += [(f, g) for f in factors for g in factors if f != g]
    for factor, factor_lo in pairs:
        scale, zero = fmt.params(w, factor, factor_lo)
        err = weighted_error(w, scale, h, zero, fmt)
        if best is None:
            best, best_err = (scale, zero), err
            continue
        better = err < best_err
        best = (
            torch.where(better, scale, best[0]),
            None if zero is None else torch.where(better, zero, best[1]),
        )
        best_err = torch.where(better, err, best_err)
    return best


def search_scale(w: torch.Tensor, h: Optional[torch.Tensor], grid: Sequence[float] = DEFAULT_GRID) -> torch.Tensor:
    """The symmetric 4-bit scale [R] (fp16 values in float32) with the least weighted_error over ``grid``."""
    return search_params(w, h, grid, SYM4)[0]
