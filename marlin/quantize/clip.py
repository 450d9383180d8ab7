"""Clip search: each group's scale from a grid of shrunken ranges, kept by Hessian-weighted error.

A max-abs scale (range = the group's largest |w|) spends the 16 levels on the outliers; shrinking
the range clips those few weights but rounds all the others more finely. Which is better depends
on how much each input matters, so every candidate is scored by the error it causes on the
layer's output, ``D H_g D^T`` per output row, where D is the rounding error of the group's
weights and H_g the group's block of the input Hessian (marlin.quantize.hessian). The grid
includes 1.0 (no clipping) and ties keep the larger range, so the search is never worse than
max-abs on this objective.

The grid, DEFAULT_GRID = 1.00, 0.95, ..., 0.55 (ten factors): below about half the range, clipping
cuts into the bulk of a roughly Gaussian group rather than its tail, and a step of 5% is close to
the scale's own resolution for 4 bits (moving the range by one level out of ~8 is 12%), so a finer
grid finds nearly the same scales at twice the cost (the search is a grid x group-size product per
group, inside GPTQ's column loop). The same grid is used for every group size.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["DEFAULT_GRID", "maxabs_scale", "candidate_scale", "weighted_error", "search_scale"]

DEFAULT_GRID = tuple(round(1.0 - 0.05 * i, 2) for i in range(10))
_QMIN, _QMAX = -8, 7


def candidate_scale(w: torch.Tensor, factor: float) -> torch.Tensor:
    """fp16-representable scales [R] (as float32) for rows w [R, c]: 2 * factor * max|w| / 15.

    Rounded to fp16 first because the checkpoint stores fp16: the weights are rounded against the
    scale that the kernel will use. A zero row gets scale 1 (all its q are 0).
    """
    amax = w.abs().amax(dim=1).float()
    scale = (amax * (factor * 2.0 / 15.0)).to(torch.float16).float()
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def maxabs_scale(w: torch.Tensor) -> torch.Tensor:
    """The round-to-nearest scale [R] of rows w [R, c] (no clipping), as in marlin.packing.quantize."""
    return candidate_scale(w, 1.0)


def weighted_error(w: torch.Tensor, scale: torch.Tensor, h: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-row error [R] of rounding w [R, c] with ``scale`` [R]: D H D^T, or ||D||^2 without h."""
    q = torch.clamp(torch.round(w / scale.unsqueeze(1)), _QMIN, _QMAX)
    d = w - q * scale.unsqueeze(1)
    if h is None:
        return (d * d).sum(dim=1)
    return ((d @ h) * d).sum(dim=1)


def search_scale(w: torch.Tensor, h: Optional[torch.Tensor], grid: Sequence[float] = DEFAULT_GRID) -> torch.Tensor:
    """The scale [R] (fp16 values in float32) with the least weighted_error over ``grid``, per row."""
    if not grid or any(not 0 < f <= 1 for f in grid):
        raise ValueError(f"clip grid = {tuple(grid)!r}, expected factors in (0, 1]")
    w = w.float()
    best_scale = best_err = None
    for factor in sorted(set(grid), reverse=True):  # 1.0 first: ties keep the larger range
        scale = candidate_scale(w, factor)
        err = weighted_error(w, scale, h)
        if best_scale is None:
            best_scale, best_err = scale, err
        else:
            better = err < best_err
            best_scale = torch.where(better, scale, best_scale)
            best_err = torch.where(better, err, best_err)
    return best_scale
