"""The CPU reference op against fp64 A @ dequant(B), and the properties later kernels rely on."""

import pytest
import torch

import marlin
from conftest import random_layer, reference, rel_err

SHAPES = [(128, 128), (256, 384), (384, 256), (1024, 640)]


@pytest.mark.parametrize("m", [0, 1, 7, 16, 33, 200])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("group_size", [128, -1])
def test_cpu_gemm_matches_fp64_reference(m, k, n, group_size):
    q, s, b_q, b_s = random_layer(k, n, group_size)
    a = torch.randn(m, k).half()
    c = torch.ops.marlin.gemm(a, b_q, b_s)
    assert c.shape == (m, n) and c.dtype == torch.float16
    if m == 0:
        return
    ref = reference(a, q, s)
    # fp32 accumulation of exact products, one fp16 rounding at the end: about 2^-12 relative.
    assert rel_err(c, ref) < 5e-4
    # the same bound must catch a wrong scale or a wrong column order
    assert rel_err(c * 1.01, ref) > 5e-3
    assert rel_err(c[:, torch.randperm(n)], ref) > 0.5


def test_cpu_gemm_is_deterministic_and_uses_every_group():
    q, s, b_q, b_s = random_layer(512, 256, 128)
    a = torch.randn(9, 512).half()
    c1 = torch.ops.marlin.gemm(a, b_q, b_s)
    c2 = torch.ops.marlin.gemm(a, b_q, b_s)
    assert torch.equal(c1, c2)
    # doubling the scales of the last group must change the result
    s2 = s.clone()
    s2[-1] *= 2
    from marlin import packing

    _, b_s2 = packing.pack(q, s2)
    c3 = torch.ops.marlin.gemm(a, b_q, b_s2)
    assert rel_err(c3, reference(a, q, s2)) < 5e-4
    assert rel_err(c3, c1) > 1e-2


def test_non_contiguous_activations_are_read_correctly():
    q, s, b_q, b_s = random_layer(256, 128, 128)
    big = torch.randn(5, 512).half()
    a = big[:, ::2]  # stride 2 along K
    c = torch.ops.marlin.gemm(a, b_q, b_s)
    assert rel_err(c, reference(a.contiguous(), q, s)) < 5e-4


def test_marlin_gemm_wrapper_and_workspace_ignored_on_cpu():
    q, s, b_q, b_s = random_layer(128, 128, -1)
    a = torch.randn(3, 128).half()
    ws = torch.zeros(4, dtype=torch.int32)
    assert torch.equal(marlin.gemm(a, b_q, b_s, ws), torch.ops.marlin.gemm(a, b_q, b_s))
    assert torch.equal(marlin.gemm(a, b_q, b_s, tile_k=128, tile_n=128), torch.ops.marlin.gemm(a, b_q, b_s))
