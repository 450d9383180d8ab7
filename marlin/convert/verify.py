"""Numerical check of one converted layer against its source format's formula.

On random inputs x (in the layer's dtype: fp16, or bf16 for bf16 scales), compare what the Marlin
op computes from the converted tensors, gemm(x[:, perm], b_q, b_scales, b_zeros) (gemm_2_4 for a
2:4-sparse layer), with x @ W in
float32, where W = scales[g] * (q - zero) is dequantized from the source tensors as stored (GPTQ or
AWQ), so a wrong zero, scale, nibble order, group or permutation shows up as an O(1) error.

Why VERIFY_TOLERANCE = 1e-3 (normwise relative error ||out - ref||_F / ||ref||_F):
  * both sides see the same x and the same weights: scale * (q - zero) is exact in fp32
    (11-bit fp16 mantissa times an integer of at most 8 bits), in the source's dequantization
    and in Marlin's;
  * the op sums in fp32 (CPU reference and CUDA kernel, including the reduction between
    thread blocks) and rounds once to fp16: at most 2^-11 ~ 4.9e-4 relative per element, so at
    most 4.9e-4 normwise (about 2.8e-4 on average for random data);
  * fp32 summation in a different order adds ~ sqrt(K) * 2^-24 ~ 1e-5 for K = 16384.
So a correct layer stays below ~5e-4, and 1e-3 leaves a factor two while any layout mistake
(errors of order 1) fails by orders of magnitude. bf16 rounds the output to 8 significant bits
instead of 11, so its bound is 8 times larger (BF16_VERIFY_TOLERANCE).
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch

from .. import ops
from .gptq import MarlinTensors

__all__ = ["VERIFY_TOLERANCE", "BF16_VERIFY_TOLERANCE", "VERIFY_ROWS", "verify_tolerance", "verify_layer", "normwise_relative_error"]

VERIFY_TOLERANCE = 1e-3
BF16_VERIFY_TOLERANCE = 8e-3  # bf16 rounds the output to 8 significant bits instead of 11: 8x the bound


def verify_tolerance(dtype: torch.dtype) -> float:
    """The bound for a layer computing in ``dtype`` (its scales' dtype)."""
    return BF16_VERIFY_TOLERANCE if dtype == torch.bfloat16 else VERIFY_TOLERANCE
VERIFY_ROWS = 16  # sample inputs per layer: enough to see every column, cheap on the CPU op


def normwise_relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in float64 (inf if out has inf/nan, e.g. an fp16 overflow)."""
    out, ref = out.double(), ref.double()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    denom = float(ref.norm())
    return float((out - ref).norm()) / denom if denom > 0 else float((out - ref).norm())


def verify_layer(
    prefix: str,
    w: torch.Tensor,
    marlin: MarlinTensors,
    *,
    device: torch.device,
    workspace: Optional[torch.Tensor] = None,
) -> float:
    """Normwise relative error of the converted layer ``prefix`` on VERIFY_ROWS random inputs.

    ``w`` is the checkpoint's weight B [K, N] in float32, dequantized by the source format's own
    formula (marlin.convert.gptq.dequantize_gptq, marlin.convert.awq.dequantize_awq). The inputs
    are seeded from the layer name, so a run is reproducible.
    """
    k = w.shape[0]
    gen = torch.Generator().manual_seed(zlib.crc32(prefix.encode()))
    x = torch.randn(VERIFY_ROWS, k, generator=gen).to(marlin.b_scales.dtype)
    ref = x.float() @ w
    x_in = x if marlin.perm is None else x.index_select(1, marlin.perm.to(torch.int64))
    zeros = None if marlin.b_zeros is None else marlin.b_zeros.to(device)
    if marlin.b_meta is not None:  # a 2:4-sparse layer
        out = ops.gemm_2_4(
            x_in.to(device), marlin.b_q.to(device), marlin.b_meta.to(device), marlin.b_scales.to(device), workspace, zeros
        ).float().cpu()
        return normwise_relative_error(out, ref)
    out = ops.gemm(
        x_in.to(device), marlin.b_q.to(device), marlin.b_scales.to(device), workspace, b_zeros=zeros, bits=marlin.bits
    ).float().cpu()
    return normwise_relative_error(out, ref)
