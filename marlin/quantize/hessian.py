"""The Hessian of a linear layer's output error, accumulated from calibration inputs.

For inputs X [T, K] (T tokens) the layer-output error of a weight change D [N, K] is
||X D^T||^2 = T/2 * trace(D H D^T) with H = 2/T * X^T X. GPTQ needs only H, and the relative output
error on the calibration data follows from H alone (relative_output_error), without running the
layer again.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

__all__ = ["HessianAccumulator", "relative_output_error"]


class HessianAccumulator:
    """Running H = 2/T * sum of x x^T over every token seen so far (T counts tokens, not samples,
    so that samples of different lengths weigh by their length: each token counts once).

    With ``cross``, also C = 2/T * sum of x x_ref^T, where x_ref is the same token's input in a
    reference model (the full-precision one): what fitting the layer to the reference's outputs
    needs (marlin.quantize.runner, ``fp_target``)."""

    def __init__(
        self,
        k: int,
        device: Optional[Union[str, torch.device]] = None,
        dtype: torch.dtype = torch.float32,
        cross: bool = False,
    ):
        if k <= 0:
            raise ValueError(f"k = {k}, expected a positive number of input features")
        self.k = k
        self.h = torch.zeros(k, k, dtype=dtype, device=device)
        self.cross = torch.zeros(k, k, dtype=dtype, device=device) if cross else None
        self.tokens = 0

    def _rows(self, x: torch.Tensor, what: str) -> torch.Tensor:
        if x.shape[-1] != self.k:
            raise ValueError(f"{what} shape {tuple(x.shape)}, expected [..., {self.k}]")
        return x.detach().reshape(-1, self.k).to(device=self.h.device, dtype=self.h.dtype)

    @torch.no_grad()
    def add(self, x: torch.Tensor, x_ref: Optional[torch.Tensor] = None) -> None:
        """Add the inputs x [..., K] of one forward call (and, with ``cross``, the reference
        model's inputs x_ref of the same tokens, same shape)."""
        x = self._rows(x, "input")
        if (self.cross is None) != (x_ref is None):
            raise ValueError("x_ref is given exactly when the accumulator was made with cross=True")
        m = x.shape[0]
        if m == 0:
            return
        total = self.tokens + m
        scale = math.sqrt(2.0 / total)
        self.h.mul_(self.tokens / total)
        self.h.addmm_((x * scale).t(), x * scale)
        if self.cross is not None:
            x_ref = self._rows(x_ref, "reference input")
            if x_ref.shape != x.shape:
                raise ValueError(f"reference input rows {tuple(x_ref.shape)}, expected {tuple(x.shape)}")
            self.cross.mul_(self.tokens / total)
            self.cross.addmm_((x * scale).t(), x_ref * scale)
        self.tokens = total


def relative_output_error(w: torch.Tensor, w_q: torch.Tensor, h: torch.Tensor) -> float:
    """||X (W - W_q)^T|| / ||X W^T|| on the inputs that made ``h``, for weights [N, K]."""
    w = w.to(h.device, h.dtype)
    d = w - w_q.to(h.device, h.dtype)
    num = ((d @ h) * d).sum().clamp_min(0)
    den = ((w @ h) * w).sum()
    if den <= 0:
        return 0.0 if num == 0 else float("inf")
    return math.sqrt(float(num / den))
