"""torch.library.opcheck on every op, and torch.compile tracing of the op (CPU)."""

import pytest
import torch

import marlin  # noqa: F401
from conftest import random_layer, requires_cuda


def sample_args(device):
    out = []
    for m, k, n, g in [(1, 128, 128, 128), (7, 256, 384, -1), (33, 384, 256, 128), (0, 128, 256, 128)]:
        _, _, b_q, b_s = random_layer(k, n, g, seed=m)
        out.append((torch.randn(m, k, device=device).half(), b_q.to(device), b_s.to(device), None, None, None, None, 4))
    return out


def sample_args_formats():
    """One call per new format (CPU: the CUDA kernel takes them as they land)."""
    out = []
    for m, k, n, g, bits, sym, dtype in [
        (3, 128, 64, 32, 4, True, torch.bfloat16),
        (5, 192, 192, 64, 4, False, torch.float16),
        (2, 256, 128, 128, 4, False, torch.bfloat16),
        (4, 128, 128, -1, 8, True, torch.float16),
        (1, 256, 64, 128, 8, True, torch.bfloat16),
    ]:
        layer = random_layer(k, n, g, seed=m, bits=bits, sym=sym, dtype=dtype)
        b_z = None if sym else layer[5]
        out.append((torch.randn(m, k).to(dtype), layer[2], layer[3], b_z, None, None, None, bits))
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_opcheck_gemm(device):
    for args in sample_args(device):
        torch.library.opcheck(torch.ops.marlin.gemm.default, args)


def test_opcheck_gemm_formats_cpu():
    for args in sample_args_formats():
        torch.library.opcheck(torch.ops.marlin.gemm.default, args)


def test_compile_fullgraph_cpu_bf16_zero_points():
    _, _, b_q, b_s, _, b_z = random_layer(256, 192, 64, seed=4, sym=False, dtype=torch.bfloat16)

    def f(x):
        return torch.ops.marlin.gemm(x, b_q, b_s, b_z) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(compiled(x), f(x))


def test_compile_fullgraph_cpu():
    _, _, b_q, b_s = random_layer(256, 256, 128, seed=3)

    def f(x):
        return torch.relu(torch.ops.marlin.gemm(x * 2, b_q, b_s)) + 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.randn(5, 256).half()
    assert torch.equal(compiled(x), f(x))
