"""Refit of the scales and zero points once GPTQ has fixed the integer codes.

GPTQ picks a group's scale s (and zero point z) when its column loop reaches the group, from the
weights as corrected so far, and then rounds every weight of the group against it, feeding each
rounding error forward. The codes it ends with are not the ones that s was chosen for: the
feedback moved the weights. With the codes q fixed, the layer-output error of one output row is
a quadratic in the group's dequantized values s * (q - z):

    f = (w - w_hat) H (w - w_hat)^T,   w_hat = s_g * (q_g - z_g) on each group g's columns,

with w the row's target weight and H the input Hessian, so each group's best s has a closed
form given z, and z (an integer in [0, 15] in the Marlin format, which stores it as such) takes
16 values: all of them are tried. Per column there is one group and the refit is the exact
minimum of f over (s, z) for the given codes; with groups, the groups of a row are coupled by
H's off-diagonal blocks and each one is refit with the others held (one Gauss-Seidel sweep).

For one group, with e = w - w_hat the current error and d_g = s_g (q_g - z_g) its current values,
replacing d_g by s v (v = q_g - z) changes f by a term that depends on (s, v) only through

    phi(s, v) = s^2 v H_gg v^T - 2 s v r^T,   r = (e H)_g + d_g H_gg,

(r is the group's part of w H with the other groups' reconstruction taken out), minimised at
s = v r^T / v H_gg v^T. v = q_g - z is linear in z, so both products are quadratics in z from
five sums per row. The scale is rounded to fp16 (the checkpoint stores fp16) before phi is
evaluated, and the current (s, z) competes with equal standing and wins ties, so the refit never
increases f, the objective it minimises (a test checks this against a float64 reference).

Symmetric formats have no zero point: only s is refit (z = 0).

2:4-sparse weights with zero points (``keep``): a pruned weight is exactly 0 whatever z is (its
code follows z: u = z), so v = (q - z) m with m the 0/1 mask of kept weights, still linear in z;
the same five sums are taken over the kept weights (C becomes per row).
"""

from __future__ import annotations

from typing import Optional

import torch

from .clip import WeightFormat

__all__ = ["refit_params", "layer_objective"]


def layer_objective(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Per-row (w - w_hat) H (w - w_hat)^T [N] for rows [N, K] and H [K, K]."""
    e = w - w_hat
    return ((e @ h) * e).sum(dim=1)


def _dequant(
    q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], keep: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """s * (q - z) of one group's codes q [N, c] with per-row scale and zero [N]; 0 where the
    float 0/1 mask ``keep`` [N, c] (if given) is 0."""
    z = 0.0 if zero is None else zero.unsqueeze(1)
    d = (q - z) * scale.unsqueeze(1)
    return d if keep is None else d * keep


def refit_params(
    w: torch.Tensor,
    q: torch.Tensor,
    scales: list,
    zeros: list,
    h: torch.Tensor,
    group_size: int,
    fmt: WeightFormat,
    keep: Optional[torch.Tensor] = None,
) -> tuple[list, list]:
    """Refit each group's (scale, zero) to the codes ``q`` [N, K] (float, as stored: signed when
    symmetric, u in [0, maxq] with zero points) against the target rows ``w`` [N, K] under ``h``
    [K, K] (all in the same column order). ``scales`` and ``zeros``: one [N] tensor per group
    (fp16 values in float32; zeros None when symmetric). ``keep`` (bool [N, K], 2:4 with zero
    points): the weights not pruned; the others stay exactly 0 for any zero point, and the caller
    sets their codes to the new zero points. Returns new lists of the same form."""
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    scales, zeros = list(scales), list(zeros)
    m = None if keep is None else keep.to(w.dtype)
    if m is not None:
        q = q * m  # v = (q - z) m = q m - z m: only the kept codes count
    groups = [slice(g * gs, (g + 1) * gs) for g in range(len(scales))]
    w_hat = torch.cat(
        [_dequant(q[:, c], scales[g], zeros[g], None if m is None else m[:, c]) for g, c in enumerate(groups)], dim=1
    )
    eh = (w - w_hat) @ h  # [N, K], kept current as groups change
    cand = torch.zeros(1, dtype=w.dtype, device=w.device) if fmt.sym else torch.arange(
        fmt.maxq + 1, dtype=w.dtype, device=w.device
    )
    for g, cols in enumerate(groups):
        h_gg = h[cols, cols]
        qg = q[:, cols]
        d_old = w_hat[:, cols]
        r = eh[:, cols] + d_old @ h_gg
        qh = qg @ h_gg
        # v = q - z: v r = a - z b, v H v = A - 2 z B + z^2 C (rows [N], candidates z [Z])
        a = (qg * r).sum(dim=1)
        big_a = (qh * qg).sum(dim=1)
        if m is None:
            b, big_b, big_c = r.sum(dim=1), qh.sum(dim=1), h_gg.sum()
        else:  # v = q m - z m (q already masked): the sums of z's terms over the kept weights
            mg = m[:, cols]
            b, big_b, big_c = (mg * r).sum(dim=1), (qh * mg).sum(dim=1), ((mg @ h_gg) * mg).sum(dim=1).unsqueeze(1)
        z = cand.unsqueeze(0)  # [1, Z]
        num = a.unsqueeze(1) - z * b.unsqueeze(1)
        den = big_a.unsqueeze(1) - 2 * z * big_b.unsqueeze(1) + z * z * big_c
        ok = (den > 0) & (num > 0)  # a positive scale that the data determine
        s = torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.ones_like(den))
        s = s.to(torch.float16).float()
        ok &= torch.isfinite(s) & (s > 0)
        phi = torch.where(ok, s * s * den - 2 * s * num, torch.full_like(den, float("inf")))
        # the current parameters, scored the same way; they win ties
        z0 = torch.zeros_like(a) if zeros[g] is None else zeros[g]
        s0 = scales[g]
        c0 = big_c if m is None else big_c[:, 0]
        phi0 = s0 * s0 * (big_a - 2 * z0 * big_b + z0 * z0 * c0) - 2 * s0 * (a - z0 * b)
        best_phi, best = phi.min(dim=1)
        better = best_phi < phi0
        rows = torch.arange(n, device=w.device)
        s_new = torch.where(better, s[rows, best], s0)
        z_new = None if zeros[g] is None else torch.where(better, cand[best], z0)
        d_new = _dequant(qg, s_new, z_new, None if m is None else m[:, cols])
        eh -= (d_new - d_old) @ h[cols, :]
        w_hat[:, cols] = d_new
        scales[g], zeros[g] = s_new, z_new
    return scales, zeros
