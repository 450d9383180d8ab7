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


# -- every format: dtype x weight type x group size -----------------------------------------------
FORMATS = {  # name: (bits, sym)
    "u4": (4, True),
    "u4_zp": (4, False),
    "u8": (8, True),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Normwise bound for fp32 accumulation of exact products, rounded once to the output dtype:
# about 2^-12 (fp16) / 2^-9 (bf16) relative.
BOUND = {torch.float16: 5e-4, torch.bfloat16: 4e-3}


def make(k, n, group_size, fmt, dtype, seed):
    bits, sym = FORMATS[fmt]
    layer = random_layer(k, n, group_size, seed=seed, bits=bits, sym=sym, dtype=dtype)
    if sym:
        q, s, b_q, b_s = layer
        z = b_z = None
    else:
        q, s, b_q, b_s, z, b_z = layer
    return bits, q, s, z, b_q, b_s, b_z


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("k,n", [(128, 64), (256, 192), (384, 320)])
def test_every_format_matches_fp64_reference(dtype, fmt, group_size, k, n):
    bits, q, s, z, b_q, b_s, b_z = make(k, n, group_size, fmt, dtype, seed=k + n + group_size)
    assert b_q.shape == (k // 16, bits // 2 * n) and b_s.dtype == dtype
    a = torch.randn(9, k).to(dtype)
    c = marlin.gemm(a, b_q, b_s, b_zeros=b_z, bits=bits)
    assert c.shape == (9, n) and c.dtype == dtype
    ref = reference(a, q, s, z)
    assert rel_err(c, ref) < BOUND[dtype]
    # the bound catches a 1% scale error and a column permutation
    assert rel_err(c, ref * 1.01) > 2 * BOUND[dtype]
    assert rel_err(c[:, torch.randperm(n)], ref) > 0.5


@pytest.mark.parametrize("k,n", [(64, 64), (192, 576), (576, 192)])
def test_multiples_of_64(k, n):
    """K and N multiples of 64 but not of 128 (SmolLM2-135M widths 576 and 192)."""
    for group_size in (32, 64, -1):
        q, s, b_q, b_s = random_layer(k, n, group_size, seed=1)
        a = torch.randn(3, k).half()
        assert rel_err(marlin.gemm(a, b_q, b_s), reference(a, q, s)) < 5e-4


def test_group_size_outside_the_table_is_refused():
    _, _, b_q, _ = random_layer(192, 64, 64, seed=0)
    with pytest.raises(RuntimeError, match=r"b_scales\.size\(0\) = 2, expected 1 \(per-column scales\) or K / group_size"):
        # 192 rows in groups of 96: not a group size of the op
        marlin.gemm(torch.randn(1, 192).half(), b_q, torch.ones(2, 64).half())


def test_wrong_zero_point_is_caught():
    """One zero point off by one must push the error far past the bound."""
    bits, q, s, z, b_q, b_s, b_z = make(256, 128, 64, "u4_zp", torch.float16, seed=5)
    a = torch.randn(16, 256).half()
    c = marlin.gemm(a, b_q, b_s, b_zeros=b_z, bits=4)
    assert rel_err(c, reference(a, q, s, z)) < 5e-4
    z_wrong = z.clone()
    z_wrong[2] += torch.where(z_wrong[2] < 15, 1.0, -1.0).to(z.dtype)  # every column of group 2
    assert rel_err(c, reference(a, q, s, z_wrong)) > 1e-2
    # symmetric formats are not zero points of 8: the zero-point path must really be used
    c_sym = marlin.gemm(a, b_q, b_s, bits=4)
    assert rel_err(c_sym, reference(a, q, s, z)) > 1e-2


@pytest.mark.parametrize("group_size", [32, 64])
def test_wrong_group_size_is_caught(group_size):
    """Reading the scales of group size g with another group size must fail the bound."""
    q, s, b_q, b_s = random_layer(256, 128, group_size, seed=6)
    a = torch.randn(8, 256).half()
    c = marlin.gemm(a, b_q, b_s)
    assert rel_err(c, reference(a, q, s)) < 5e-4
    other = 2 * group_size  # the same scales spread over twice as many rows (half the groups)
    s_other = s[: 256 // other].repeat_interleave(other // group_size, dim=0)
    assert rel_err(c, reference(a, q, s_other)) > 1e-2


@pytest.mark.parametrize("bits,swap", [(4, (0, 1)), (4, (1, 4)), (8, (1, 2)), (8, (0, 3))])
def test_wrong_value_order_in_a_word_is_caught(bits, swap):
    """Swapping two values inside every packed word (another interleave) must fail the bound."""
    q, s, b_q, b_s = random_layer(256, 128, 128, seed=7, bits=bits)
    a = torch.randn(8, 256).half()
    ref = reference(a, q, s)
    assert rel_err(marlin.gemm(a, b_q, b_s, bits=bits), ref) < 5e-4
    i, j = swap
    words = b_q.to(torch.int64) & 0xFFFFFFFF
    mask = (1 << bits) - 1
    vi, vj = (words >> (bits * i)) & mask, (words >> (bits * j)) & mask
    swapped = words & ~((mask << (bits * i)) | (mask << (bits * j))) | (vi << (bits * j)) | (vj << (bits * i))
    swapped = torch.where(swapped >= 2**31, swapped - 2**32, swapped).to(torch.int32)
    assert rel_err(marlin.gemm(a, swapped, b_s, bits=bits), ref) > 1e-2


def test_bf16_accumulates_without_overflow():
    """Products and sums beyond the fp16 range stay exact-ish in bf16 (fp32 accumulation)."""
    q, s, b_q, b_s = random_layer(512, 128, 128, seed=9, dtype=torch.bfloat16)
    b_s_big = (b_s.float() * 2.0**60).bfloat16()
    s_big = (s.float() * 2.0**60).bfloat16()
    a = (torch.randn(5, 512) * 2.0**40).bfloat16()
    c = marlin.gemm(a, b_q, b_s_big)
    assert torch.isfinite(c).all()
    assert rel_err(c, reference(a, q, s_big)) < 4e-3


def test_zero_points_per_column_and_bf16():
    bits, q, s, z, b_q, b_s, b_z = make(192, 128, -1, "u4_zp", torch.bfloat16, seed=10)
    assert b_z.shape == (1, 128) and torch.equal(b_z, z)  # per column: natural order
    a = torch.randn(6, 192).bfloat16()
    assert rel_err(marlin.gemm(a, b_q, b_s, b_zeros=b_z), reference(a, q, s, z)) < 4e-3
