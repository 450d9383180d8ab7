"""Tune a quantized block's scales against the full-precision block's outputs.

GPTQ (marlin.quantize.gptq) fits each Linear on its own, to that layer's output error. Once a
block's layers are all quantized, this step keeps every integer code and zero point and moves only
the scales (one per output row and group) to bring the block's output on the quantized model's
inputs, block(X_q), closer to the full-precision block's output block_fp(X_fp), the same target
as the full-precision target of marlin.quantize.runner, but through everything between the
layers (attention, the gated MLP, the residual stream) and for all layers at once.

With the codes fixed, a weight is linear in its scale, so the gradient is exact (no
straight-through rounding). Each scale is s0 * exp(t) with t starting at 0 and trained by Adam
on the mean squared output error over mini-batches of calibration samples; the result is
rounded to fp16, as stored. A row keeps its sign and its zero point, so this cannot turn into a
different format: only the step between levels changes.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
import torch
from torch import nn
from torch.func import functional_call

from .gptq import GPTQResult

__all__ = ["ScaleTuning", "tune_block_scales"]


@dataclass(frozen=True)
class ScaleTuning:
    """``steps`` Adam steps, each on ``batch`` samples (taken in a shuffled order, cycling), with
    learning rate ``lr`` on the log of each scale. The cost is steps x batch forward and backward
    passes of one block, whatever the number of calibration samples."""

    steps: int = 0
    batch: int = 8
    lr: float = 1e-2
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"scale tuning steps = {self.steps!r}, expected an integer >= 0")
        if not isinstance(self.batch, int) or self.batch <= 0:
            raise ValueError(f"scale tuning batch = {self.batch!r}, expected a positive number of samples")
        if not self.lr > 0:
            raise ValueError(f"scale tuning lr = {self.lr!r}, expected a positive learning rate")


def _unit_weight(res: GPTQResult) -> tuple[torch.Tensor, torch.Tensor]:
    """((q - z) [N, K] in the input order of nn.Linear, group index [K] of every input)."""
    k, groups = res.q.shape[0], res.scales.shape[0]
    unit = GPTQResult(
        q=res.q, scales=torch.ones_like(res.scales), perm=res.perm, group_size=res.group_size,
        zeros=res.zeros, bits=res.bits, sparsity=res.sparsity,
    ).dequantized()
    stored_group = torch.arange(k) // (k // groups)  # group of each stored row
    group = torch.empty_like(stored_group)
    if res.perm is None:
        group = stored_group
    else:
        group[res.perm] = stored_group  # stored row i is input perm[i]
    return unit, group


@contextlib.contextmanager
def _frozen(module: nn.Module):
    """No gradients for the block's own parameters while the scales train."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _block_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def tune_block_scales(
    block: nn.Module,
    results: dict,
    local_names: dict,
    hidden: list,
    calls: list,
    targets: list,
    tuning: ScaleTuning,
) -> tuple[dict, float, float]:
    """New fp16 scales for ``results`` ({full name: GPTQResult}), whose layers are
    ``block.get_submodule(local_names[name])``, trained so that block(hidden[i]) (with the
    block's call arguments ``calls[i]``) approaches ``targets[i]``.

    Returns ({name: scales}, mean squared error before, after) on the samples the steps used;
    the block's weights are left as they were. The new scales are returned only when they lower
    that error (after rounding to fp16), else the old ones.
    """
    if len(hidden) != len(targets) or len(hidden) != len(calls):
        raise ValueError(f"{len(hidden)} inputs, {len(calls)} calls and {len(targets)} targets: expected one of each per sample")
    names = list(results)
    device = next(block.parameters()).device
    units, groups, logs, base = {}, {}, {}, {}
    for name in names:
        res = results[name]
        unit, group = _unit_weight(res)
        units[name] = unit.to(device)
        groups[name] = group.to(device)
        base[name] = res.scales.float().t().contiguous().to(device)  # [N, groups]
        logs[name] = torch.zeros_like(base[name], requires_grad=True)

    def weights(with_grad: bool) -> dict:
        out = {}
        for name in names:
            scale = base[name] * torch.exp(logs[name] if with_grad else logs[name].detach())
            out[f"{local_names[name]}.weight"] = units[name] * scale[:, groups[name]]
        return out

    def error(params: dict, indices) -> torch.Tensor:
        total = 0.0
        for i in indices:
            args, kwargs = calls[i]
            out = _block_output(functional_call(block, params, (hidden[i], *args[1:]), kwargs))
            total = total + (out - targets[i]).square().mean()
        return total / len(indices)

    order = list(range(len(hidden)))
    random.Random(tuning.seed).shuffle(order)
    batches = [[order[(step * tuning.batch + j) % len(order)] for j in range(tuning.batch)] for step in range(tuning.steps)]
    if not batches or not names:
        return {name: results[name].scales for name in names}, float("nan"), float("nan")
    # judged on the samples it trained on: evaluating all of them would cost more than the steps
    seen = sorted({i for b in batches for i in b})
    with torch.no_grad():
        before = float(error(weights(False), seen))
    opt = torch.optim.Adam([logs[n] for n in names], lr=tuning.lr)
    with _frozen(block), torch.enable_grad():
        for indices in batches:
            opt.zero_grad(set_to_none=True)
            error(weights(True), indices).backward()
            opt.step()
    with torch.no_grad():
        final = {name: (base[name] * torch.exp(logs[name])).t().to(torch.float16).cpu().contiguous() for name in names}
        trial = {}
        for name in names:
            scale = final[name].float().t().to(device)
            trial[f"{local_names[name]}.weight"] = units[name] * scale[:, groups[name]]
        after = float(error(trial, seen))
    if not after < before:  # the fp16 rounding or a bad step made it worse: keep GPTQ's scales
        return {name: results[name].scales for name in names}, before, before
    return final, before, after
