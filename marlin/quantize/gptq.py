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
  * The clip search's objective (``clip_objective``): "hessian" scores a group's rounding error D
    with the group's block of the undamped Hessian, D H_gg D^T, as if the other weights stayed
    fixed; "compensated" scores it with what is left after GPTQ's update of the columns not yet
    quantized, D (H^-1_gg)^-1 D^T: the inverse of the group's block of the inverse Hessian of
    the remaining problem, which is U_gg^T U_gg with U's block on the group (U upper triangular,
    so the later rows add nothing), i.e. the Schur complement of H on the group. Errors the
    remaining columns can absorb then cost little, and the search spends its choice on those
    they cannot. "columnwise" goes one step further and counts the feedback inside the group
    too: column i's error weighs 1 / U[i, i]^2, the part of it that no later column, in the
    group or after it, can absorb (GPTQ's own cost of column i, ((w_i - q_i) / U[i, i])^2).
    Per column (one group of all K columns) "compensated" has no later columns and is the
    damped H itself, so there "columnwise" is the one that sees GPTQ's correction: on 6 blocks
    of SmolLM2-135M it lowered the mean layer error by 4% (0.0554 to 0.0531), nearly as much as
    running the whole column loop once per grid factor and keeping each row's best (tried and
    dropped: 0.0527, at twice the quantization time); at group 64 the two are within 0.1%.
    "auto" (QuantizeConfig's default) picks "columnwise" per column and "compensated" with
    groups.
  * Refit (``refit``, marlin.quantize.refit): once the loop has fixed the integer codes, each
    group's scale and zero point are refit to them by least squares on the layer objective
    (W - W_q) H (W - W_q)^T against the weight GPTQ was given (the undamped H); each further
    round re-runs the loop with those parameters fixed and refits again, and every output row
    keeps its best round. It lowers the calibration objective a little (0.5-1.3% of the layer
    error on random layers), but did not lower SmolLM2-135M's perplexity (benchmarks/NOTES.md,
    2026-11-26 evening), so it is off by default.

  * 2:4 sparsity (SparseGPT, Frantar & Alistarh 2023), pruning and quantization from the same
    Hessian: when the loop reaches the first column of a group of 4 input features, it prunes the
    2 of the 4 (per output row) whose removal costs least by the OBS saliency w_j^2 / U[j, j]^2
    (U[j, j]^2 is [H^-1]_jj of the sub-problem left at column j, the form the Cholesky factor
    gives). A pruned weight is "quantized" to exactly 0 (code 0, or u = z with zero points) and
    its error is fed back like any rounding error, so the kept weights (quantized, with feedback)
    absorb both. A group's scale (and zero point) is chosen from its weights after a provisional
    mask by the same saliency (the pruned weights must not stretch the range). 4-bit symmetric or
    with zero points (the 2:4 format's two); the refit keeps pruned weights at exactly 0 whatever
    zero point it picks. 2:4 needs the input order (the sparse format has no permutation):
    act-order is refused with it.

Formats (marlin.quantize.clip.WeightFormat, the Marlin formats of marlin/packing.py): symmetric
4-bit (q in [-8, 7], w = q * scale), symmetric 8-bit (q in [-128, 127]) or 4-bit with zero points
(u in [0, 15], w = (u - z) * scale); scales and zero points fp16.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from . import clip as clip_search
from .clip import SYM4, WeightFormat
from .hessian import relative_output_error
from .refit import layer_objective, refit_params

__all__ = [
    "GPTQResult",
    "gptq_quantize",
    "rtn_quantize",
    "compensated_hessian",
    "QMIN",
    "QMAX",
    "SPARSITIES",
    "CLIP_OBJECTIVES",
    "resolve_clip_objective",
]

QMIN, QMAX = SYM4.qmin, SYM4.qmax  # the default format's range (symmetric 4-bit)
SPARSITIES = ("2:4",)
CLIP_OBJECTIVES = ("hessian", "compensated", "columnwise")
AUTO_OBJECTIVE = "auto"


def resolve_clip_objective(objective: str, group_size: int) -> str:
    """"auto" -> "columnwise" per column (group_size -1), "compensated" with groups; others as given."""
    if objective == AUTO_OBJECTIVE:
        return "columnwise" if group_size == -1 else "compensated"
    if objective not in CLIP_OBJECTIVES:
        raise ValueError(f"clip_objective = {objective!r}, expected {AUTO_OBJECTIVE!r} or one of {CLIP_OBJECTIVES}")
    return objective


@dataclass
class GPTQResult:
    """A quantized weight in the Marlin format's terms.

    ``q`` int8 [K, N] and ``scales`` fp16 [groups, N] (``zeros`` fp16 [groups, N] for zero points,
    else None) are in natural order for the rows as stored: when ``perm`` is given, row i of q is
    input feature perm[i] (act-order with groups), else row i is input feature i. ``bits`` and
    ``zeros`` say the format (q is the signed value when symmetric, u in [0, 15] with zeros).
    ``sparsity`` "2:4": q (q - z with zero points) has at most 2 non-zeros in every 4 rows of a
    column (the pruned codes are 0, or z), ``keep`` (bool
    [K, N], not saved) the positions kept by the pruning and ``pruned_fraction`` ||W_pruned|| /
    ||W|| of the original weight. ``dequantized()`` gives nn.Linear's weight [N, K] in the
    original input order. ``error`` is the relative output error on the calibration data (see
    hessian.py) and ``rtn_error`` the same for round-to-nearest of the original weight (for 2:4:
    magnitude pruning, then round-to-nearest), for the report.
    """

    q: torch.Tensor
    scales: torch.Tensor
    perm: Optional[torch.Tensor]
    group_size: int
    error: float = float("nan")
    rtn_error: float = float("nan")
    zeros: Optional[torch.Tensor] = None
    bits: int = 4
    sparsity: Optional[str] = None
    keep: Optional[torch.Tensor] = None
    pruned_fraction: Optional[float] = None

    def dequantized(self) -> torch.Tensor:
        """W_q [N, K] float32, exact ((q - z) * scale is exact in fp32), original input order."""
        k = self.q.shape[0]
        rows = k // self.scales.shape[0]
        q = self.q.float()
        if self.zeros is not None:
            q = q - self.zeros.float().repeat_interleave(rows, dim=0)
        b = q * self.scales.float().repeat_interleave(rows, dim=0)  # [K, N]
        if self.perm is not None:
            out = torch.empty_like(b)
            out[self.perm] = b
            b = out
        return b.t().contiguous()

    def columns(self, n0: int, n1: int) -> "GPTQResult":
        """The result for output features n0..n1 (a layer of a jointly quantized stack)."""
        return GPTQResult(
            q=self.q[:, n0:n1].contiguous(),
            scales=self.scales[:, n0:n1].contiguous(),
            perm=self.perm,
            group_size=self.group_size,
            zeros=None if self.zeros is None else self.zeros[:, n0:n1].contiguous(),
            bits=self.bits,
            sparsity=self.sparsity,
            keep=None if self.keep is None else self.keep[:, n0:n1].contiguous(),
        )


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


def compensated_hessian(u: torch.Tensor, cols: slice) -> torch.Tensor:
    """The Hessian of columns ``cols`` once the columns after them have absorbed their error:
    (U_gg^T U_gg)^-1 for U the upper Cholesky factor of H^-1 (module doc), which is the Schur
    complement H_gg - H_gr H_rr^-1 H_rg of the later columns r in H."""
    return torch.cholesky_inverse(u[cols, cols], upper=True)


def _prune_2_of_4(saliency: torch.Tensor) -> torch.Tensor:
    """Bool [R, c] (c a multiple of 4), True where pruned: the 2 least salient of every 4 columns
    (ties: the higher column is pruned, as marlin.sparse.mask_2_4 keeps the lower)."""
    r, c = saliency.shape
    groups = saliency.reshape(r, c // 4, 4)
    order = torch.sort(groups, dim=2, descending=True, stable=True).indices
    pruned = torch.zeros_like(groups, dtype=torch.bool)
    pruned.scatter_(2, order[..., 2:], True)
    return pruned.reshape(r, c)


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


def _check_sparsity(sparsity: Optional[str], k: int, fmt: WeightFormat, act_order: bool, block_size: int) -> None:
    if sparsity is None:
        return
    if sparsity not in SPARSITIES:
        raise ValueError(f"sparsity = {sparsity!r}, expected None (dense) or one of {SPARSITIES}")
    if k % 4 or block_size % 4:
        raise ValueError(f"sparsity 2:4 needs K = {k} and block_size = {block_size} to be multiples of 4")
    if fmt.bits != 4:
        raise ValueError(
            f"sparsity 2:4 with bits = {fmt.bits}: the 2:4 format holds 4-bit weights only (symmetric or with zero points)"
        )
    if act_order:
        raise ValueError("sparsity 2:4 with act_order: the 2:4 format keeps the input order (no permutation)")


def rtn_quantize(
    weight: torch.Tensor, group_size: int, *, bits: int = 4, sym: bool = True, sparsity: Optional[str] = None
) -> GPTQResult:
    """Round to nearest with max-abs (or min/max) ranges (what MarlinLinear.from_linear does), as a
    GPTQResult. ``sparsity`` "2:4": prune by magnitude first (what MarlinLinear24.from_linear does)."""
    fmt = WeightFormat(bits, sym)
    _check(weight, None, group_size, block_size=max(group_size, 4))
    n, k = weight.shape
    _check_sparsity(sparsity, k, fmt, False, 4)
    w = weight.detach().float()
    keep = None
    if sparsity is not None:
        from .. import sparse

        keep = sparse.mask_2_4(w.t())  # [K, N]: groups of 4 along K
        w = w * keep.t()
    gs = k if group_size == -1 else group_size
    wg = w.reshape(n * (k // gs), gs)
    scale, zero = fmt.params(wg)
    q = fmt.quantize(wg, scale, zero)[0].reshape(n, k)
    res = GPTQResult(
        q=q.t().to(torch.int8).contiguous(),
        scales=scale.reshape(n, k // gs).t().to(torch.float16).contiguous(),
        perm=None,
        group_size=group_size,
        zeros=None if zero is None else zero.reshape(n, k // gs).t().to(torch.float16).contiguous(),
        bits=bits,
        sparsity=sparsity,
        keep=keep,
    )
    if keep is not None:
        res.pruned_fraction = pruned_fraction(weight, keep)
    return res


def pruned_fraction(weight: torch.Tensor, keep: torch.Tensor) -> float:
    """||W at the pruned positions|| / ||W|| for nn.Linear's weight [N, K] and keep [K, N]."""
    w = weight.detach().float()
    norm = w.norm()
    return float((w * (~keep.to(w.device)).t()).norm() / norm) if norm > 0 else 0.0


def gptq_quantize(
    weight: torch.Tensor,
    h: torch.Tensor,
    group_size: int = 128,
    *,
    act_order: bool = False,
    clip: bool = False,
    clip_grid: tuple = clip_search.DEFAULT_GRID,
    clip_objective: str = "hessian",
    damp: float = 0.01,
    block_size: int = 128,
    bits: int = 4,
    sym: bool = True,
    sparsity: Optional[str] = None,
    refit: int = 0,
    clip_shift: bool = False,
) -> GPTQResult:
    """Quantize nn.Linear's ``weight`` [N, K] with the Hessian ``h`` [K, K] of its inputs.

    ``group_size``: -1 (one scale per output column of B) or a divisor of K; ``act_order``:
    quantize inputs in order of decreasing diag(H); ``clip``: choose each group's range by the
    Hessian-weighted clip search (marlin.quantize.clip) over ``clip_grid`` instead of the full
    range, scored by ``clip_objective`` ("hessian", "compensated", "columnwise" or "auto", see the module doc); ``damp``: fraction of mean(diag H) added to the diagonal; ``bits`` 4 or 8 and ``sym``
    (False: 4-bit zero points) the format; ``sparsity`` "2:4": prune jointly (SparseGPT, see the
    module doc); ``refit`` rounds of refitting the scales and zero points to the codes
    (marlin.quantize.refit; 0: none, 1: once after the column loop, each further round re-runs the
    loop with the refit parameters fixed and refits again); ``clip_shift`` (zero points): the clip search
    shrinks the two ends of the range by separate factors of the grid. Computes in float32 on h's device.
    """
    _check(weight, h, group_size, block_size)
    fmt = WeightFormat(bits, sym)
    _check_sparsity(sparsity, weight.shape[1], fmt, act_order, block_size)
    if not 0 <= damp < 1:
        raise ValueError(f"damp = {damp!r}, expected a fraction in [0, 1)")
    if not isinstance(refit, int) or refit < 0:
        raise ValueError(f"refit = {refit!r}, expected a number of rounds >= 0")
    clip_objective = resolve_clip_objective(clip_objective, group_size)
    with torch.no_grad(), _one_thread_on_cpu(h.device):
        return _gptq(weight, h, group_size, act_order, clip, tuple(clip_grid), clip_objective, damp, block_size, fmt, sparsity, refit, clip_shift)


def _fixed_params(scales: list, zeros: list, group_size: int):
    """A params function for _column_loop that hands out given per-group (scale, zero)."""
    def params(cols: slice, w_cols: torch.Tensor):
        g = 0 if group_size == -1 else cols.start // group_size
        return scales[g], zeros[g]

    return params


def _best_rows(a: tuple, b: tuple, w: torch.Tensor, h: torch.Tensor, group_size: int) -> tuple:
    """Per output row, the _column_loop state (codes, scales, zeros, pruned) of a or b with the
    lower layer objective against w under h (a on ties)."""
    def dequant(state):
        q, scales, zeros, _ = state
        gs = q.shape[1] // len(scales)
        s = torch.stack(scales, dim=1).repeat_interleave(gs, dim=1)
        z = 0.0 if zeros[0] is None else torch.stack(zeros, dim=1).repeat_interleave(gs, dim=1)
        return (q - z) * s

    take_b = layer_objective(w, dequant(b), h) < layer_objective(w, dequant(a), h)
    pick = lambda x, y: torch.where(take_b.view(-1, *([1] * (x.dim() - 1))), y, x)  # noqa: E731
    return (
        pick(a[0], b[0]),
        [pick(x, y) for x, y in zip(a[1], b[1])],
        [None if x is None else pick(x, y) for x, y in zip(a[2], b[2])],
        None if a[3] is None else pick(a[3], b[3]),
    )


def _column_loop(w, u, u_diag2, group_size, block_size, fmt, prune, params):
    """GPTQ's column loop over w [N, K] (updated in place): (codes [N, K] float, scales, zeros
    (one [N] per group), pruned [N, K] bool or None). ``params(cols, w_cols)`` gives a group's
    (scale, zero) from its weights as corrected so far."""
    n, k = w.shape
    dev = w.device
    q_all = torch.zeros(n, k, dtype=torch.float32, device=dev)
    pruned_all = torch.zeros(n, k, dtype=torch.bool, device=dev) if prune else None
    if group_size == -1:
        scale, zero = params(slice(0, k), w)  # [N], from the whole (updated=original) rows
        scales, zeros = [scale], [zero]
    else:
        scales, zeros = [], []

    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        w_blk = w[:, b0:b1].clone()
        err_blk = torch.zeros_like(w_blk)
        u_blk = u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if group_size != -1 and col % group_size == 0:
                scale, zero = params(slice(col, col + group_size), w_blk[:, i : i + group_size])
                scales.append(scale)
                zeros.append(zero)
            if prune and col % 4 == 0:
                pruned_all[:, col : col + 4] = _prune_2_of_4(w_blk[:, i : i + 4].square() / u_diag2[col : col + 4])
            q, dq = fmt.quantize(w_blk[:, i : i + 1], scale, zero)
            if prune:
                cut = pruned_all[:, col : col + 1]
                # the code of w = 0: q = 0 when symmetric, u = z with zero points (the range holds 0)
                zero_code = torch.zeros_like(q) if zero is None else zero.unsqueeze(1).expand_as(q)
                q = torch.where(cut, zero_code, q)
                dq = torch.where(cut, torch.zeros_like(dq), dq)
            q_all[:, col] = q[:, 0]
            err = (w_blk[:, i] - dq[:, 0]) / u_blk[i, i]
            w_blk[:, i:] -= err.unsqueeze(1) * u_blk[i, i:].unsqueeze(0)
            err_blk[:, i] = err
        w[:, b1:] -= err_blk @ u[b0:b1, b1:]
    return q_all, scales, zeros, pruned_all


def _gptq(
    weight, h, group_size, act_order, clip, clip_grid, clip_objective, damp, block_size, fmt, sparsity, refit, clip_shift
) -> GPTQResult:
    dev = h.device
    w_orig = weight.detach().to(dev, torch.float32)
    w = w_orig.clone()
    h_input = h.detach().to(torch.float32)
    h = h_input.clone()
    n, k = w.shape
    prune = sparsity is not None

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
    u_diag2 = torch.diag(u).square()  # OBS saliency denominators (2:4)

    def params(cols: slice, w_cols: torch.Tensor):
        if prune:  # provisional mask: the pruned weights must not set the range
            w_cols = w_cols * ~_prune_2_of_4(w_cols.square() / u_diag2[cols])
        if not clip:
            return fmt.params(w_cols)
        if clip_objective == "compensated":
            weights = compensated_hessian(u, cols)
        elif clip_objective == "columnwise":
            weights = 1.0 / u_diag2[cols]
        else:
            weights = h_plain[cols, cols]
        return clip_search.search_params(w_cols, weights, clip_grid, fmt, separate_ends=clip_shift)

    w_target = w.clone()  # the refit fits against the weights before GPTQ's corrections
    state = _column_loop(w, u, u_diag2, group_size, block_size, fmt, prune, params)
    best = None
    for rnd in range(refit):
        if rnd:  # re-round against the refit parameters, then refit to the new codes
            state = _column_loop(w_target.clone(), u, u_diag2, group_size, block_size, fmt, prune,
                                 _fixed_params(state[1], state[2], group_size))
        q_r, scales_r, zeros_r, pruned_r = state
        # 2:4 with zero points: a pruned code is u = z, so a new z would move it off 0; the refit
        # keeps those weights at 0 and the codes follow the zero point it picks
        keep_r = None if pruned_r is None or fmt.sym else ~pruned_r
        scales_r, zeros_r = refit_params(w_target, q_r, scales_r, zeros_r, h_plain, group_size, fmt, keep=keep_r)
        if keep_r is not None:
            gs = k if group_size == -1 else group_size
            q_r = torch.where(pruned_r, torch.stack(zeros_r, dim=1).repeat_interleave(gs, dim=1), q_r)
        state = (q_r, scales_r, zeros_r, pruned_r)
        # GPTQ's loop with fixed parameters is greedy, so a re-round can lose on some rows: each
        # row keeps its best round, and more rounds never raise a row's objective
        best = state if best is None else _best_rows(best, state, w_target, h_plain, group_size)
    q_all, scales, zeros, pruned_all = state if best is None else best

    scales_t = torch.stack(scales, dim=0).to(torch.float16)  # [groups, N]
    zeros_t = None if zeros[0] is None else torch.stack(zeros, dim=0).to(torch.float16)
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
        zeros=None if zeros_t is None else zeros_t.contiguous().cpu(),
        bits=fmt.bits,
        sparsity=sparsity,
        keep=None if pruned_all is None else (~pruned_all).t().contiguous().cpu(),
    )
    if prune:
        result.pruned_fraction = pruned_fraction(w_orig, result.keep)
    result.error = relative_output_error(w_orig, result.dequantized().to(dev), h_input)
    return result
