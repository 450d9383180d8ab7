"""The Hessian of a linear layer's output error, accumulated from calibration inputs.

For inputs X [T, K] (T tokens) the layer-output error of a weight change D [N, K] is
||X D^T||^2 = T/2 * trace(D H D^T) with H = 2/T * X^T X. GPTQ needs only H, and the relative output
error on the calibration data follows from H alone (relative_output_error), without running the
layer again.

Cost: the products X^T X (and the cross terms X^T X_ref) are most of a quantization run's
arithmetic after the forward passes. InputBatch gathers the inputs of many forward calls and
adds them in one product per distinct input (layers that read the same tensor, such as q/k/v,
share it), and gram() computes X^T X from three of its four blocks where K is large enough for
that to pay (benchmarks/NOTES.md, 2026-11-27).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

__all__ = ["HessianAccumulator", "InputBatch", "gram", "relative_output_error"]

# From this K on, gram() skips the lower off-diagonal block (measured on the 2-core CPU machine,
# 8192 rows: K = 576 -18%, K = 1536 -20% with one or two threads; at 300 rows there was no gain
# for K = 1536, so InputBatch's batching is what makes it pay).
SYMMETRIC_MIN_K = 512


def gram(x: torch.Tensor) -> torch.Tensor:
    """x^T x for x [T, K], exactly symmetric. For K >= SYMMETRIC_MIN_K it is built from the two
    diagonal blocks and one off-diagonal block of the halves of K, mirrored: 3/4 of the products."""
    k = x.shape[1]
    if k < SYMMETRIC_MIN_K:
        out = x.t() @ x
        return (out + out.t()) * 0.5  # a symmetric matrix whichever order BLAS summed in
    half = k // 2
    a, b = x[:, :half], x[:, half:]
    out = torch.empty(k, k, dtype=x.dtype, device=x.device)
    out[:half, :half] = a.t() @ a
    out[half:, half:] = b.t() @ b
    off = a.t() @ b
    out[:half, half:] = off
    out[half:, :half] = off.t()
    # the diagonal blocks are products of a matrix with itself, symmetric up to BLAS's order of
    # summation; make them exactly so, as the unblocked branch does
    for blk in (slice(0, half), slice(half, k)):
        d = out[blk, blk]
        d.copy_((d + d.t()) * 0.5)
    return out


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

    def _rows(self, x: torch.Tensor, what: str = "input") -> torch.Tensor:
        """x [..., K] as float rows [M, K] on the accumulator's device and dtype."""
        if x.shape[-1] != self.k:
            raise ValueError(f"{what} shape {tuple(x.shape)}, expected [..., {self.k}]")
        return x.detach().reshape(-1, self.k).to(device=self.h.device, dtype=self.h.dtype)

    def _check_ref(self, x_ref: Optional[torch.Tensor]) -> None:
        if (self.cross is None) != (x_ref is None):
            raise ValueError("x_ref is given exactly when the accumulator was made with cross=True")

    @torch.no_grad()
    def add(self, x: torch.Tensor, x_ref: Optional[torch.Tensor] = None) -> None:
        """Add the inputs x [..., K] of one forward call (and, with ``cross``, the reference
        model's inputs x_ref of the same tokens, same shape)."""
        self._check_ref(x_ref)
        x = self._rows(x)
        xtr = None
        if self.cross is not None:
            x_ref = self._rows(x_ref, "reference input")
            if x_ref.shape != x.shape:
                raise ValueError(f"reference input rows {tuple(x_ref.shape)}, expected {tuple(x.shape)}")
            xtr = x.t() @ x_ref
        if x.shape[0]:
            self.add_products(gram(x), xtr, x.shape[0])

    @torch.no_grad()
    def add_products(self, xtx: torch.Tensor, xtr: Optional[torch.Tensor], m: int) -> None:
        """Add m tokens given by their sums x^T x [K, K] (and x^T x_ref with ``cross``)."""
        self._check_ref(xtr)
        if m <= 0:
            raise ValueError(f"m = {m}, expected a positive number of tokens")
        total = self.tokens + m
        self.h.mul_(self.tokens / total).add_(xtx, alpha=2.0 / total)
        if self.cross is not None:
            self.cross.mul_(self.tokens / total).add_(xtr, alpha=2.0 / total)
        self.tokens = total


def _version(t: Optional[torch.Tensor]):
    """The in-place version counter (None for None, and for inference tensors, which have none)."""
    if t is None:
        return None
    try:
        return t._version
    except RuntimeError:
        return None


def _view_key(t: Optional[torch.Tensor]) -> tuple:
    """What makes two live tensors hold the same values: the same view of the same memory."""
    if t is None:
        return ()
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


class InputBatch:
    """Inputs handed over by forward hooks, added to their layers' accumulators in batches.

    ``record(name, x, x_ref)`` only keeps the tensors; ``end_call()`` (between samples) adds them
    once at least ``max_rows`` rows are pending for a layer, ``flush()`` adds the rest. Layers
    whose pending inputs are the same views of the same memory (q/k/v, gate/up: one tensor read
    by several layers), with the same reference inputs likewise, get one product between them.
    The pending tensors are held here, so their memory cannot be reused while they wait; they
    must not be changed in place before the flush (checked by their version counters). Adding one
    product for many calls gives the same H as adding the calls one by one, up to float rounding.
    """

    def __init__(self, accumulators: dict, max_rows: int = 8192):
        if max_rows <= 0:
            raise ValueError(f"max_rows = {max_rows}, expected a positive number of rows")
        self.accumulators = accumulators
        self.max_rows = max_rows
        self.pending: dict = {name: [] for name in accumulators}
        self.pending_rows = dict.fromkeys(accumulators, 0)

    def record(self, name: str, x: torch.Tensor, x_ref: Optional[torch.Tensor] = None) -> None:
        acc = self.accumulators[name]
        acc._check_ref(x_ref)
        if x.shape[-1] != acc.k or (x_ref is not None and x_ref.shape != x.shape):
            raise ValueError(
                f"{name}: input {tuple(x.shape)}, reference {None if x_ref is None else tuple(x_ref.shape)}, "
                f"expected [..., {acc.k}] and the same shape"
            )
        self.pending[name].append((x, x_ref, _version(x), _version(x_ref)))
        self.pending_rows[name] += x.numel() // acc.k

    def end_call(self) -> None:
        if max(self.pending_rows.values(), default=0) >= self.max_rows:
            self.flush()

    @torch.no_grad()
    def flush(self) -> None:
        by_inputs: dict = {}
        for name, items in self.pending.items():
            for x, r, vx, vr in items:
                if _version(x) != vx or _version(r) != vr:
                    raise RuntimeError(f"{name}: an input was changed in place between record() and flush()")
            if items:
                key = tuple((_view_key(x), _view_key(r)) for x, r, _, _ in items)
                by_inputs.setdefault(key, []).append(name)
        for names in by_inputs.values():
            first = self.accumulators[names[0]]
            items = self.pending[names[0]]
            x = torch.cat([first._rows(t) for t, *_ in items])
            if x.shape[0] == 0:
                continue
            xtr = None
            if first.cross is not None:
                xtr = x.t() @ torch.cat([first._rows(r, "reference input") for _, r, _, _ in items])
            xtx = gram(x)
            for name in names:
                self.accumulators[name].add_products(xtx, xtr, x.shape[0])
        self.pending = {name: [] for name in self.accumulators}
        self.pending_rows = dict.fromkeys(self.accumulators, 0)


def relative_output_error(w: torch.Tensor, w_q: torch.Tensor, h: torch.Tensor) -> float:
    """||X (W - W_q)^T|| / ||X W^T|| on the inputs that made ``h``, for weights [N, K]."""
    w = w.to(h.device, h.dtype)
    d = w - w_q.to(h.device, h.dtype)
    num = ((d @ h) * d).sum().clamp_min(0)
    den = ((w @ h) * w).sum()
    if den <= 0:
        return 0.0 if num == 0 else float("inf")
    return math.sqrt(float(num / den))
