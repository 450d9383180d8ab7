"""Shared helpers for the marlin tests: random layers, references and error measures."""

import pytest
import torch

from marlin import packing

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Normwise relative error ||x - ref|| / ||ref|| in float64; inf if x has NaN/inf."""
    x64, r64 = x.double(), ref.double()
    if not torch.isfinite(x64).all():
        return float("inf")
    return ((x64 - r64).norm() / r64.norm().clamp_min(1e-30)).item()


def random_layer(k: int, n: int, group_size: int, device="cpu", seed=None):
    """Random B [K, N] quantized and packed: returns (q, scales, b_q, b_scales)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(torch.seed() if seed is None else seed)
    w = torch.randn(k, n, generator=gen)
    q, scales = packing.quantize(w.to(device), group_size)
    b_q, b_scales = packing.pack(q, scales)
    return q, scales, b_q.to(device), b_scales.to(device)


def reference(a: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A @ dequant(B) with exact weights, in float64 on CPU or float32 (no TF32) on GPU."""
    w = packing.dequantize(q, scales)
    if a.is_cuda:
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return a.float() @ w.float()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    return a.double() @ w.double()
