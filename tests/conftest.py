"""Shared helpers for the marlin tests: random layers, references and error measures."""

import copy
import os

import pytest
import torch

from marlin import packing
from strict_skips import (  # noqa: F401  (hooks: CI fails on a skip other than a missing GPU)
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# the 2:4 op's CUDA kernel is built only where CUDA is (and until it exists, not at all)
requires_cuda_2_4 = pytest.mark.skipif(
    not torch.cuda.is_available() or not torch._C._dispatch_has_kernel_for_dispatch_key("marlin::gemm_2_4", "CUDA"),
    reason="needs a CUDA GPU and a build with the gemm_2_4 CUDA kernel",
)


def wgmma_device() -> bool:
    """A compute capability 9.0 device, and a build that has the sm_90a kernels (setup.py builds
    them unless TORCH_CUDA_ARCH_LIST leaves out 9.0a): where the wgmma and prefill kernels run."""
    if not torch.cuda.is_available():
        return False
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    return torch.cuda.get_device_capability() == (9, 0) and (archs is None or "9.0a" in archs)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Normwise relative error ||x - ref|| / ||ref|| in float64; inf if x has NaN/inf."""
    x64, r64 = x.double(), ref.double()
    if not torch.isfinite(x64).all():
        return float("inf")
    return ((x64 - r64).norm() / r64.norm().clamp_min(1e-30)).item()


def random_linear(k: int, n: int, bias: bool, seed: int, dtype=torch.float16) -> torch.nn.Linear:
    """nn.Linear(k, n) with standard-normal weight (and bias) from ``seed``, in ``dtype``."""
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        lin.weight.copy_(torch.randn(n, k, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return lin.to(dtype)


def random_layer(k: int, n: int, group_size: int, device="cpu", seed=None, *, bits=4, sym=True, dtype=torch.float16):
    """Random B [K, N] quantized and packed: returns (q, scales, b_q, b_scales) for symmetric
    formats and (q, scales, b_q, b_scales, zeros, b_zeros) with sym=False."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(torch.seed() if seed is None else seed)
    w = torch.randn(k, n, generator=gen)
    parts = packing.quantize(w.to(device), group_size, bits=bits, sym=sym, dtype=dtype)
    packed = [t.to(device) for t in packing.pack(*parts, bits=bits)]
    if sym:
        return parts[0], parts[1], packed[0], packed[1]
    return parts[0], parts[1], packed[0], packed[1], parts[2], packed[2]


def poison_allocator(numel: int, dtype=torch.float16) -> int:
    """Make the allocator's next block of `numel` elements NaN-filled, so unwritten outputs show up.

    With the cache emptied, the freed NaN block is the best fit for the op's output allocation;
    returns its address, which the GPU tests compare with the output's to be sure of that."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    t = torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
    ptr = t.data_ptr()
    del t
    return ptr


def fp32_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a @ w in true fp32 (TF32 off for the call), the GPU reference for the kernel."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return a.float() @ w.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def reference(a: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros=None) -> torch.Tensor:
    """A @ dequant(B) with exact weights, in float64 on CPU or float32 (no TF32) on GPU."""
    w = packing.dequantize(q, scales, zeros)
    return fp32_matmul(a, w) if a.is_cuda else a.double() @ w.double()


def tiny_llama_config(tie_word_embeddings: bool = False):
    """A 2-layer Llama whose Linear shapes the kernel takes (multiples of 128), for model tests."""
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
    )


def assert_fusing_keeps_logits(model, seq_len: int = 6, seed: int = 3):
    """Fuses q/k/v and gate/up of every layer of `model` in place (strict) and checks that its
    logits equal, bit for bit, those of an unfused copy; returns (unfused copy, token ids)."""
    import marlin

    unfused = copy.deepcopy(model)
    report = marlin.fuse_projections(model, strict=True)
    assert len(report.fused) == 2 * model.config.num_hidden_layers and not report.skipped
    ids = torch.randint(0, 1000, (2, seq_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, unfused(ids).logits)
    return unfused, ids
