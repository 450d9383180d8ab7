"""GPTQ for one linear layer: second-order rounding with error feedback, in the Marlin format.

The math (Frantar et al., "GPTQ", 2022), written for nn.Linear's weight W [N, K] (rows are output
features, columns input features) and the calibration inputs X [tokens, K]:

  * H = 2/T * X^T X, the Hessian of the layer-output error ||X W^T - X Q^T||^2 w.r.t. each row.
  * Dampening: H += damp * mean(diag H) * I, so that H is safely positive definite even where
    few tokens or dead inputs make it singular.
  * Columns are quantized one at a time. The rounding error of column i is spread over the
    columns not yet quantized, weighted by the inverse Hessian: with U the upper Cholesky factor
    of H^-1, err = (w_i - q_i) / U[i, i] and W[:, j] -= err * U[i, j] for j > i. This is the
    optimal update of the remaining weights for the quadratic error, and U gives it without ever
    re-inverting H.
  * Lazy blocks: inside a block of ``block_size`` columns the update is applied column by
    column; the columns after the block get the block's accumulated errors in one matmul.
  * Act-order: columns with the largest diag(H) (the most important inputs) go first, while the
    most columns are still free to absorb their errors. With groups, the groups follow the
    permuted order, so that each group's rows are contiguous: the Marlin layer then stores B's
    rows in that order and gathers the input with ``perm`` (MarlinLinear's act-order support).
  * Group scales are chosen when the column loop reaches a group's first column, from the
    weights as updated so far (per column: once, before the loop), optionally by the clip search
    of marlin.quantize.clip instead of the plain max-abs.

Format: symmetric 4-bit, q in [-8, 7], w = q * scale, scale fp16 (the Marlin format of
marlin/packing.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from . import clip as clip_search
from .hessian import relative_output_error

__all__ = ["GPTQResult", "gptq_quantize", "rtn_quantize", "QMIN", "QMAX"]

QMIN, QMAX = -8, 7


@dataclass
class GPTQResult:
    """A quantized weight in the Marlin format's terms.

    ``q`` int8 [K, N] and ``scales`` fp16 [groups, N] are in natural order for the rows as stored:
    when ``perm`` is given, row i of q is input feature perm[i] (act-order with groups), else row i
    is input feature i. ``dequantized()`` gives nn.Linear's weight [N, K] in the original input
    order. ``error`` is the relative output error on the calibration data (see hessian.py) and
    ``rtn_error`` the same for round-to-nearest of the original weight, for the report.
    """

    q: torch.Tensor
    scales: torch.Tensor
    perm: Optional[torch.Tensor]
    group_size: int
    error: float = float("nan")
    rtn_error: float = float("nan")

    def dequantized(self) -> torch.Tensor:
        """W_q [N, K] float32, exact (scale * q is exact in fp32), original input order."""
        k = self.q.shape[0]
        rows = k // self.scales.shape[0]
        b = self.q.float() * self.scales.float().repeat_interleave(rows, dim=0)  # [K, N]
        if self.perm is not None:
            out = torch.empty_like(b)
            out[self.perm] = b
            b = out
        return b.t().contiguous()


def _quantize_columns(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q = clamp(round(w / scale)) and its dequantized value, for w [N, c] and scale [N]."""
    q = torch.clamp(torch.round(w / scale.unsqueeze(1)), QMIN, QMAX)
    return q, q * scale.unsqueeze(1)


@contextlib.contextmanager
def _one_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """Run the column loop on one CPU thread.

    Its thousands of small ops ([N, 1] columns, [N, 128] updates) gain nothing from a thread pool,
    and on a busy machine each parallel op waits for a second thread to be scheduled: measured on
    2 shared cores, rounding one 3072-element column took 28 ms with 2 threads and 0.15 ms with 1,
    and a 1536 x 1536 Cholesky inverse 4.9 s against 0.7 s.
    """
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _inverse_cholesky_upper(h: torch.Tensor) -> torch.Tensor:
    """U upper triangular with U^T U = H^-1 (H damped, positive definite)."""
    try:
        chol = torch.linalg.cholesky(h)
        return torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)
    except torch.linalg.LinAlgError as e:
        raise ValueError(
            f"GPTQ: the damped Hessian is not positive definite ({e}); raise damp or use more calibration data"
        ) from None


def _group_scale(w: torch.Tensor, h: torch.Tensor, clip: bool, grid) -> torch.Tensor:
    """The scale [N] (fp16 values, float32) of the columns w [N, c] of one group."""
    if clip:
        return clip_search.search_scale(w, h, grid)
    return clip_search.maxabs_scale(w)


def _check(weight: torch.Tensor, h: Optional[torch.Tensor], group_size: int, block_size: int) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor [N, K], got shape {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    if h is not None and tuple(h.shape) != (k, k):
        raise ValueError(f"H shape {tuple(h.shape)}, expected [{k}, {k}] (K = weight.shape[1])")
    if group_size != -1:
        if not isinstance(group_size, int) or group_size <= 0 or k % group_size:
            raise ValueError(f"group_size = {group_size!r}, expected -1 (per column) or a positive divisor of K = {k}")
        if block_size % group_size:
            raise ValueError(f"block_size = {block_size} must be a multiple of group_size = {group_size}")


def rtn_quantize(weight: torch.Tensor, group_size: int) -> GPTQResult:
    """Round to nearest with max-abs scales (what MarlinLinear.from_linear does), as a GPTQResult."""
    _check(weight, None, group_size, block_size=max(group_size, 1))
    n, k = weight.shape
    gs = k if group_size == -1 else group_size
    w = weight.detach().float().reshape(n, k // gs, gs)
    scale = clip_search.maxabs_scale(w.reshape(-1, gs)).reshape(n, k // gs)
    q = torch.clamp(torch.round(w / scale.float().unsqueeze(2)), QMIN, QMAX)
    return GPTQResult(
        q=q.reshape(n, k).t().to(torch.int8).contiguous(),
        scales=scale.t().contiguous(),
        perm=None,
        group_size=group_size,
    )


def gptq_quantize(
    weight: torch.Tensor,
    h: torch.Tensor,
    group_size: int = 128,
    *,
    act_order: bool = False,
    clip: bool = False,
    clip_grid: tuple = clip_search.DEFAULT_GRID,
    damp: float = 0.01,
    block_size: int = 128,
) -> GPTQResult:
    """Quantize nn.Linear's ``weight`` [N, K] with the Hessian ``h`` [K, K] of its inputs.

    ``group_size``: -1 (one scale per output column of B) or a divisor of K; ``act_order``:
    quantize inputs in order of decreasing diag(H); ``clip``: choose each group's scale by the
    Hessian-weighted clip search (marlin.quantize.clip) over ``clip_grid`` instead of max-abs;
    ``damp``: fraction of mean(diag H) added to the diagonal. Computes in float32 on h's device.
    """
    _check(weight, h, group_size, block_size)
    if not 0 <= damp < 1:
        raise ValueError(f"damp = {damp!r}, expected a fraction in [0, 1)")
    with torch.no_grad(), _one_thread_on_cpu(h.device):
        return _gptq(weight, h, group_size, act_order, clip, tuple(clip_grid), damp, block_size)


def _gptq(weight, h, group_size, act_order, clip, clip_grid, damp, block_size) -> GPTQResult:
    dev = h.device
    w_orig = weight.detach().to(dev, torch.float32)
    w = w_orig.clone()
    h_input = h.detach().to(torch.float32)
    h = h_input.clone()
    n, k = w.shape

    dead = torch.diag(h) == 0  # inputs that were always zero: any weight is right, use 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else None
    if perm is not None:
        w = w[:, perm]
        h = h[perm][:, perm]
    h_plain = h.clone()  # the clip search weighs errors with the undamped Hessian
    h.diagonal().add_(damp * torch.mean(torch.diag(h)))
    u = _inverse_cholesky_upper(h)

    q_all = torch.zeros(n, k, dtype=torch.float32, device=dev)
    if group_size == -1:
        scale = _group_scale(w, h_plain, clip, clip_grid)  # [N], from the whole (updated=original) rows
        scales = [scale]
    else:
        scales = []

    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        w_blk = w[:, b0:b1].clone()
        err_blk = torch.zeros_like(w_blk)
        u_blk = u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if group_size != -1 and col % group_size == 0:
                g = slice(col, col + group_size)
                scale = _group_scale(w_blk[:, i : i + group_size], h_plain[g, g], clip, clip_grid)
                scales.append(scale)
            q, dq = _quantize_columns(w_blk[:, i : i + 1], scale)
            q_all[:, col] = q[:, 0]
            err = (w_blk[:, i] - dq[:, 0]) / u_blk[i, i]
            w_blk[:, i:] -= err.unsqueeze(1) * u_blk[i, i:].unsqueeze(0)
            err_blk[:, i] = err
        w[:, b1:] -= err_blk @ u[b0:b1, b1:]

    scales_t = torch.stack(scales, dim=0).to(torch.float16)  # [groups, N]
    q_t = q_all.t()  # [K, N], rows in quantization order
    if perm is not None and group_size == -1:
        # One scale per column: the row order does not matter for the scales, so put the rows
        # back and spare the layer its input gather.
        q_t = q_t[torch.argsort(perm)]
        perm = None
    result = GPTQResult(
        q=q_t.to(torch.int8).contiguous().cpu(),
        scales=scales_t.contiguous().cpu(),
        perm=None if perm is None else perm.cpu(),
        group_size=group_size,
    )
    result.error = relative_output_error(w_orig, result.dequantized().to(dev), h_input)
    return result
