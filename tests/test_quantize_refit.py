"""The refit of scales and zero points to GPTQ's codes (marlin.quantize.refit).

Checked against a float64 reference written the direct way (for each group and each integer
zero point, the 1-D least-squares scale of the whole row's error, rounded to fp16, scored by
the row's full objective), so a slip in the refit's algebra (the per-group target r, the
quadratic-in-z sums, the running e H) changes which parameters win and fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

from marlin import sparse
from marlin.quantize import gptq_quantize
from marlin.quantize.clip import WeightFormat
from marlin.quantize.refit import layer_objective, refit_params
from test_quantize_gptq import calib_inputs, hessian_of


def setup(n: int, k: int, group_size: int, fmt: WeightFormat, seed: int):
    """Target rows, codes and per-group params as GPTQ leaves them: codes of a perturbed weight
    (the error feedback moves the weights away from the range the params were chosen for)."""
    gen = torch.Generator().manual_seed(seed)
    h = hessian_of(calib_inputs(4 * k, k, seed))
    w = torch.randn(n, k, generator=gen) * 0.05
    moved = w + 0.01 * torch.randn(n, k, generator=gen)
    gs = k if group_size == -1 else group_size
    scales, zeros, codes = [], [], []
    for g in range(k // gs):
        cols = moved[:, g * gs : (g + 1) * gs]
        s, z = fmt.params(w[:, g * gs : (g + 1) * gs], 0.9)
        codes.append(fmt.quantize(cols, s, z)[0])
        scales.append(s)
        zeros.append(z)
    return w, torch.cat(codes, dim=1), scales, zeros, h


def dequant(q, scales, zeros, gs, keep=None):
    parts = []
    for g, (s, z) in enumerate(zip(scales, zeros)):
        qg = q[:, g * gs : (g + 1) * gs]
        parts.append((qg - (0 if z is None else z.unsqueeze(1))) * s.unsqueeze(1))
    out = torch.cat(parts, dim=1)
    return out if keep is None else out * keep  # 2:4: the pruned weights are 0 whatever z is


def reference_refit(w, q, scales, zeros, h, gs, fmt, keep=None):
    """One Gauss-Seidel sweep over the groups in float64, row by row, the direct way (``keep``:
    the 2:4 mask [N, K] of kept weights; the others stay 0)."""
    m = torch.ones_like(w, dtype=torch.float64) if keep is None else keep.double()
    w, q, h = w.double(), q.double(), h.double()
    scales = [s.double().clone() for s in scales]
    zeros = [None if z is None else z.double().clone() for z in zeros]
    cands = [0.0] if fmt.sym else [float(z) for z in range(fmt.maxq + 1)]
    for g in range(len(scales)):
        cols = slice(g * gs, (g + 1) * gs)
        for row in range(w.shape[0]):
            w_hat = dequant(q[row : row + 1], [s[row : row + 1] for s in scales],
                            [None if z is None else z[row : row + 1] for z in zeros], gs, m[row : row + 1])[0]
            t = w[row].clone()  # what the group should reconstruct, the other groups' part taken out
            t[: g * gs] -= w_hat[: g * gs]
            t[(g + 1) * gs :] -= w_hat[(g + 1) * gs :]

            def objective(s, z):
                v = torch.zeros_like(t)
                v[cols] = (q[row, cols] - z) * m[row, cols]
                e = t - s * v
                return float(e @ h @ e), v

            z0 = 0.0 if zeros[g] is None else float(zeros[g][row])
            best = (objective(float(scales[g][row]), z0)[0], float(scales[g][row]), z0)
            for z in cands:
                _, v = objective(1.0, z)
                den = float(v @ h @ v)
                num = float(v @ h @ t)
                if den <= 0 or num <= 0:
                    continue
                s = float(torch.tensor(num / den).to(torch.float16))
                f = objective(s, z)[0]
                if f < best[0] * (1 - 1e-9):
                    best = (f, s, z)
            scales[g][row] = best[1]
            if zeros[g] is not None:
                zeros[g][row] = best[2]
    return scales, zeros


FORMATS = [WeightFormat(4, False), WeightFormat(4, True), WeightFormat(8, True)]


@pytest.mark.parametrize("fmt", FORMATS, ids=["asym4", "sym4", "sym8"])
@pytest.mark.parametrize("group_size", [-1, 32])
def test_refit_never_increases_the_objective_and_matches_float64_reference(fmt, group_size):
    n, k = 24, 96
    w, q, scales, zeros, h = setup(n, k, group_size, fmt, seed=3)
    gs = k if group_size == -1 else group_size
    before = layer_objective(w, dequant(q, scales, zeros, gs), h)
    new_s, new_z = refit_params(w, q, scales, zeros, h, group_size, fmt)
    after = layer_objective(w, dequant(q, new_s, new_z, gs), h)
    assert (after <= before * (1 + 1e-5)).all()
    assert after.sum() < 0.9 * before.sum()  # the perturbed codes leave a lot for the refit to win
    for s in new_s:  # stored as fp16: the values must be fp16 values, positive
        assert torch.equal(s, s.half().float()) and (s > 0).all()
    for z in new_z:
        if z is not None:
            assert torch.equal(z, z.round()) and z.min() >= 0 and z.max() <= fmt.maxq
    ref_s, ref_z = reference_refit(w, q, scales, zeros, h, gs, fmt)
    ref_after = layer_objective(w.double(), dequant(q.double(), ref_s, ref_z, gs), h.double())
    torch.testing.assert_close(after.double(), ref_after, rtol=1e-4, atol=1e-9)
    if group_size == -1:  # one group: the exact optimum over (fp16 s, integer z) for these codes
        agree = sum(bool((a.double() == b).all()) for a, b in zip(new_s, ref_s))
        assert agree == len(new_s)


@pytest.mark.parametrize("group_size", [-1, 64])
@pytest.mark.parametrize("sym", [False, True])
def test_gptq_refit_lowers_the_layer_error(group_size, sym):
    x = calib_inputs(1024, 256, seed=5)
    h = hessian_of(x)
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(6)) * 0.05
    kw = dict(act_order=True, clip=True, clip_objective="auto", sym=sym)
    plain = gptq_quantize(w, h, group_size, **kw)
    once = gptq_quantize(w, h, group_size, refit=1, **kw)
    twice = gptq_quantize(w, h, group_size, refit=2, **kw)
    # one round keeps GPTQ's codes (same bits), only the parameters move, and only down in error
    assert torch.equal(once.q, plain.q)
    assert once.error < plain.error
    assert twice.error < plain.error
    if not sym:
        assert once.zeros.min() >= 0 and once.zeros.max() <= 15 and torch.equal(once.zeros, once.zeros.round())


@pytest.mark.parametrize("group_size", [-1, 32])
def test_refit_with_a_2_4_mask_matches_float64_reference(group_size):
    """Zero points with 2:4 (``keep``): the refit's sums over the kept weights only (a pruned
    weight is 0 whatever z is) against the direct float64 sweep with the same mask."""
    fmt = WeightFormat(4, False)
    n, k = 24, 96
    w, q, scales, zeros, h = setup(n, k, group_size, fmt, seed=4)
    gs = k if group_size == -1 else group_size
    keep = sparse.mask_2_4(torch.randn(k, n, generator=torch.Generator().manual_seed(9))).t()  # [N, K]
    z_full = torch.stack(zeros, dim=1).repeat_interleave(gs, dim=1)
    q = torch.where(keep, q, z_full)  # pruned codes at the zero point, as GPTQ leaves them
    w = w * keep  # the target without the pruned weights: what is left for the refit is the codes' error
    before = layer_objective(w, dequant(q, scales, zeros, gs, keep), h)
    new_s, new_z = refit_params(w, q, scales, zeros, h, group_size, fmt, keep=keep)
    after = layer_objective(w, dequant(q, new_s, new_z, gs, keep), h)
    assert (after <= before * (1 + 1e-5)).all() and after.sum() < 0.9 * before.sum()
    ref_s, ref_z = reference_refit(w, q, scales, zeros, h, gs, fmt, keep)
    ref_after = layer_objective(w.double(), dequant(q.double(), ref_s, ref_z, gs, keep.double()), h.double())
    torch.testing.assert_close(after.double(), ref_after, rtol=1e-4, atol=1e-9)
    # without the mask the refit would score the pruned codes as weights: other parameters
    plain_s, plain_z = refit_params(w, q, scales, zeros, h, group_size, fmt)
    assert any(not torch.equal(a, b) for a, b in zip(plain_z + plain_s, new_z + new_s))


@pytest.mark.parametrize("sym", [True, False])
def test_refit_keeps_2_4_pruned_weights_at_zero(sym):
    x = calib_inputs(1024, 128, seed=7)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(8)) + (0 if sym else 0.3)
    res = gptq_quantize(w, hessian_of(x), 128, sparsity="2:4", refit=2, sym=sym)
    deq = res.dequantized()
    zero_code = 0 if sym else res.zeros.float().repeat_interleave(128 // res.scales.shape[0], dim=0)  # [K, N]
    assert torch.equal(deq.t() == 0, ~res.keep | (res.q == zero_code))
    assert bool((res.q[~res.keep].float() == (zero_code if sym else zero_code[~res.keep])).all())
    assert ((res.q != zero_code).reshape(-1, 4, 64).sum(dim=1) <= 2).all()


def test_bad_refit():
    with pytest.raises(ValueError, match="refit"):
        gptq_quantize(torch.randn(8, 64), torch.eye(64), -1, refit=-1)
