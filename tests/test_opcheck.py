"""torch.library.opcheck on every op, and torch.compile tracing of the op (CPU)."""

import pytest
import torch

import marlin  # noqa: F401
from conftest import random_layer, requires_cuda


def sample_args(device):
    out = []
    for m, k, n, g in [(1, 128, 128, 128), (7, 256, 384, -1), (33, 384, 256, 128), (0, 128, 256, 128)]:
        _, _, b_q, b_s = random_layer(k, n, g, seed=m)
        out.append((torch.randn(m, k, device=device).half(), b_q.to(device), b_s.to(device)))
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_opcheck_gemm(device):
    for a, b_q, b_s in sample_args(device):
        torch.library.opcheck(torch.ops.marlin.gemm.default, (a, b_q, b_s, None, None, None, None))


def test_compile_fullgraph_cpu():
    _, _, b_q, b_s = random_layer(256, 256, 128, seed=3)

    def f(x):
        return torch.relu(torch.ops.marlin.gemm(x * 2, b_q, b_s)) + 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.randn(5, 256).half()
    assert torch.equal(compiled(x), f(x))
