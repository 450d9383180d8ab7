"""Every format of the op on CUDA: the result equals the CPU reference within the dtype's bound,
or the call is refused with a clear error. Never a wrong answer (GPU only; the CPU side is
tests/test_gemm_cpu.py). The per-kernel suites are in tests/test_gemm_cuda_formats.py."""

import re

import pytest
import torch

import marlin
from conftest import random_layer, reference, rel_err, requires_cuda

pytestmark = requires_cuda

BOUND = {torch.float16: 1e-3, torch.bfloat16: 8e-3}
FORMATS = [(4, True), (4, False), (8, True)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bits,sym", FORMATS, ids=["u4", "u4_zp", "u8"])
@pytest.mark.parametrize(
    "group_size,m,k,n",
    [(g, m, k, n) for g in (32, 64, 128, -1) for m, k, n in [(1, 256, 192), (16, 576, 192), (77, 512, 512)] if g != 128 or k % 128 == 0],
)
def test_cuda_matches_cpu_or_refuses(dtype, bits, sym, group_size, m, k, n):
    layer = random_layer(k, n, group_size, seed=m + k + n, bits=bits, sym=sym, dtype=dtype)
    q, s, b_q, b_s = layer[:4]
    z, b_z = (layer[4], layer[5]) if not sym else (None, None)
    a = torch.randn(m, k).to(dtype)
    ref = reference(a, q, s, z)
    args = (b_q.cuda(), b_s.cuda())
    try:
        c = marlin.gemm(a.cuda(), *args, b_zeros=None if b_z is None else b_z.cuda(), bits=bits)
    except RuntimeError as e:
        assert re.search("CUDA kernel|no tile configuration fits", str(e)), str(e)
        return
    assert c.dtype == dtype and c.shape == (m, n)
    assert rel_err(c.cpu(), ref) < BOUND[dtype], (dtype, bits, sym, group_size, m, k, n)
