"""torch.ops.marlin.gemm_2_4 on the CPU (the exact reference) against fp64 A @ dequant(B), with
and without zero points; its errors, fake kernel, opcheck and torch.compile."""

import pytest
import torch

import marlin
from marlin import packing, sparse
from conftest import rel_err, requires_cuda_2_4


def sparse_layer(k, n, group_size, seed=None, dtype=torch.float16):
    gen = torch.Generator().manual_seed(torch.seed() if seed is None else seed)
    w = sparse.prune_2_4(torch.randn(k, n, generator=gen))
    b_q, b_meta, b_s = sparse.quantize_and_pack_2_4(w, group_size, dtype=dtype)
    return sparse.unpack_2_4(b_q, b_meta, b_s), b_q, b_meta, b_s


def call(a, b_q, b_meta, b_s, workspace=None, b_zeros=None):
    return torch.ops.marlin.gemm_2_4(a, b_q, b_meta, b_s, workspace, b_zeros)


def check_against_fp64(c, a, w, n):
    """c = the op's [M, N] output for a [M, K] and the exact dense weight w: checks its shape and
    dtype (a's) and its error against fp64 a @ w; returns (ref, tol), or None for M = 0."""
    assert c.shape == (a.shape[0], n) and c.dtype == a.dtype
    if a.shape[0] == 0:
        return None
    ref = a.double() @ w.double()
    tol = 5e-4 if a.dtype == torch.float16 else 4e-3  # the output's rounding: fp16 keeps 11 bits, bf16 8
    assert rel_err(c, ref) < tol
    return ref, tol


def zero_point_parts(k, n, group_size, seed, dtype=torch.float16):
    """(u, scales, zeros, keep) of a 2:4 layer with zero points 1 and 14, alternating from one
    group to the next and from one column to the next: every z is 6 or 7 away from the symmetric
    8 and 13 away from the next group's, so reading 8, or another group's z, moves every kept
    weight by 6..13 scales (weights u - z of -14..14 scales). Pruned positions hold u = z."""
    gen = torch.Generator().manual_seed(seed)
    groups = packing.num_groups(k, group_size)
    z = 1 + 13 * ((torch.arange(groups)[:, None] + torch.arange(n)[None, :]) % 2)
    s = (torch.rand(groups, n, generator=gen) * 0.01 + 0.001).to(dtype)
    keep = sparse.mask_2_4(torch.randn(k, n, generator=gen))
    z_rows = z.repeat_interleave(k // groups, dim=0)
    u = torch.where(keep, torch.randint(0, 16, (k, n), generator=gen), z_rows).to(torch.int8)
    return u, s, z.to(dtype), keep


def zero_point_layer(k, n, group_size, seed, dtype=torch.float16):
    """pack_2_4 of zero_point_parts: (exact dense B', b_q, b_meta, b_scales, b_zeros)."""
    u, s, z, _ = zero_point_parts(k, n, group_size, seed, dtype)
    b_q, b_meta, b_s, b_z = sparse.pack_2_4(u, s, z)
    return sparse.unpack_2_4(b_q, b_meta, b_s, b_z), b_q, b_meta, b_s, b_z


# N = 192 and 320 (N % 128 == 64, e.g. tensor-parallel shards): whole 64-column tiles, no 128
@pytest.mark.parametrize("m", [0, 1, 7, 16, 33])
@pytest.mark.parametrize("k,n", [(128, 128), (256, 384), (512, 256), (256, 192), (384, 320)])
@pytest.mark.parametrize("group_size", [128, 64, 32, -1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cpu_gemm_2_4_matches_fp64_reference(m, k, n, group_size, dtype):
    w, b_q, b_meta, b_s = sparse_layer(k, n, group_size, dtype=dtype)
    assert b_s.dtype == dtype
    a = torch.randn(m, k).to(dtype)
    c = call(a, b_q, b_meta, b_s)
    checked = check_against_fp64(c, a, w, n)
    if checked is None:
        return
    ref, tol = checked
    assert rel_err(c.double() * 1.02, ref) > 3 * tol
    assert rel_err(c[:, torch.randperm(n)], ref) > 0.5


@pytest.mark.parametrize("group_size", [128, 64, 32])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_each_group_of_rows_takes_its_own_scales(group_size, dtype):
    """Weights that grow by 1.5x from one 32-row block of the original K to the next, so that
    neighbouring groups' scales differ by 1.5x or more at every group size: the op meets the
    float64 reference, while reading the scale rows for the wrong rows of K (one group off, in
    groups of 128 or of twice the group size, or along the compressed K / 2) would be far off."""
    k, n = 512, 256
    gen = torch.Generator().manual_seed(group_size)
    growth = 1.5 ** (torch.arange(k) // 32).double()  # [K]: constant over 32 rows
    w = sparse.prune_2_4((torch.randn(k, n, generator=gen, dtype=torch.float64) * growth[:, None]).float())
    b_q, b_meta, b_s = sparse.quantize_and_pack_2_4(w, group_size, dtype=dtype)
    assert b_s.shape == (k // group_size, n)
    q, s = sparse.unpack_2_4_parts(b_q, b_meta, b_s)
    a = torch.randn(9, k).to(dtype)
    rows = torch.arange(k)

    def product(group_of_row):  # a @ B with row kr of B scaled by scale row group_of_row[kr]
        return a.double() @ (q.double() * s.double()[group_of_row])

    ref = product(rows // group_size)
    tol = 5e-4 if dtype == torch.float16 else 4e-3
    assert rel_err(call(a, b_q, b_meta, b_s), ref) < tol
    wrong = {
        "one group off": (rows // group_size + 1) % (k // group_size),
        "groups of 128": rows // 128,
        "groups of twice the size": rows // (2 * group_size),
        "groups along the compressed K": rows // 2 // group_size,
    }
    for name, group_of_row in wrong.items():
        if not torch.equal(group_of_row, rows // group_size):
            assert rel_err(product(group_of_row), ref) > 100 * tol, name


@pytest.mark.parametrize("m", [0, 1, 7, 33])
@pytest.mark.parametrize("k,n", [(256, 384), (512, 256), (256, 192), (384, 320)])
@pytest.mark.parametrize("group_size", [128, 64, 32, -1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cpu_gemm_2_4_with_zero_points_matches_fp64_reference(m, k, n, group_size, dtype):
    """b_zeros: each kept value is (u - z) * s with its group's z, the pruned ones stay 0. The
    zero points (zero_point_parts) are far from 8 and from the neighbouring group's, so the
    symmetric reading (the op without b_zeros) and a kept weight read with another group's z are
    over 100 times the bound away."""
    u, s, z, keep = zero_point_parts(k, n, group_size, seed=m + k + n, dtype=dtype)
    b_q, b_meta, b_s, b_z = sparse.pack_2_4(u, s, z)
    assert b_z.shape == b_s.shape and b_z.dtype == dtype
    w = sparse.unpack_2_4(b_q, b_meta, b_s, b_z)
    assert torch.equal(w, packing.dequantize(u, s, z)) and bool((w[~keep] == 0).all())
    a = torch.randn(m, k).to(dtype)
    c = call(a, b_q, b_meta, b_s, None, b_z)
    checked = check_against_fp64(c, a, w, n)
    if checked is None:
        return
    ref, tol = checked
    assert rel_err(marlin.gemm_2_4(a, b_q, b_meta, b_s, b_zeros=b_z), ref) < tol  # the wrapper's keyword
    # z = 8 (the op without b_zeros): far off
    assert rel_err(call(a, b_q, b_meta, b_s), ref) > 100 * tol
    groups = s.shape[0]
    rows = torch.arange(k) // (k // groups)
    if groups > 1:  # the kept weights read with the next group's zero point (pruned ones still 0)
        z_next = z.double().roll(-1, dims=0)[rows]
        wrong = torch.where(keep, (u.double() - z_next) * s.double()[rows], torch.zeros((), dtype=torch.float64))
        assert rel_err(a.double() @ wrong, ref) > 100 * tol


@pytest.mark.parametrize("zero_points", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("n", [64, 192, 320])
def test_each_64_column_tile_is_self_contained(n, zero_points):
    """The op on N % 128 == 64 reads each 64-column tile as its own layer: its columns equal,
    bit for bit, the op on that tile's slices of b_q (128 words per row), b_meta, b_scales and
    b_zeros (64 columns each; the scales' permutation stays inside a tile), N = 64 included. A
    tile read at another tile's offset (a 128-column stride) would differ."""
    k, g = 256, 64
    if zero_points:
        _, b_q, b_meta, b_s, b_z = zero_point_layer(k, n, g, seed=n)
    else:
        _, b_q, b_meta, b_s = sparse_layer(k, n, g, seed=n)
        b_z = None
    a = torch.randn(6, k).half()
    c = call(a, b_q, b_meta, b_s, None, b_z)
    assert c.shape == (6, n)
    for t in range(n // 64):
        cols = slice(64 * t, 64 * t + 64)
        tile = call(a, b_q[:, 128 * t: 128 * t + 128].contiguous(), b_meta[:, cols].contiguous(), b_s[:, cols].contiguous(),
                    None, None if b_z is None else b_z[:, cols].contiguous())
        assert torch.equal(c[:, cols], tile), t
        if t > 0:
            assert not torch.equal(c[:, cols], c[:, 64 * (t - 1): 64 * t]), t


def test_wrong_metadata_or_values_are_caught():
    w, b_q, b_meta, b_s = sparse_layer(256, 128, 128, seed=4)
    a = torch.randn(9, 256).half()
    ref = a.double() @ w.double()
    assert rel_err(call(a, b_q, b_meta, b_s), ref) < 5e-4
    # the metadata words of lanes c = 0, 1 and c = 2, 3 swapped (blocks 0, 1 <-> 2, 3): wrong positions
    swapped = b_meta.view(-1, 2, 16, 2, 2).flip(3).reshape(b_meta.shape).contiguous()
    assert rel_err(call(a, b_q, swapped, b_s), ref) > 0.3
    # the values read as the dense kernel would (no positions): wrong
    other = b_q.clone()
    other[0] = b_q[1]
    assert rel_err(call(a, other, b_meta, b_s), ref) > 0.05
    # the last group's scales doubled
    s2 = b_s.clone()
    s2[-1] *= 2
    assert rel_err(call(a, b_q, b_meta, s2), ref) > 1e-2


def test_repeats_are_identical_and_wrapper_matches():
    _, b_q, b_meta, b_s = sparse_layer(256, 256, 128, seed=5)
    a = torch.randn(5, 256).half()
    c = call(a, b_q, b_meta, b_s)
    assert torch.equal(c, call(a, b_q, b_meta, b_s))
    assert torch.equal(marlin.gemm_2_4(a, b_q, b_meta, b_s, torch.zeros(4, dtype=torch.int32)), c)
    # a strided A is read correctly
    big = torch.randn(5, 512).half()
    assert torch.equal(call(big[:, ::2], b_q, b_meta, b_s), call(big[:, ::2].contiguous(), b_q, b_meta, b_s))


def test_zero_points_must_be_integers_in_0_15_on_the_cpu():
    _, b_q, b_meta, b_s, b_z = zero_point_layer(256, 128, 64, seed=7)
    a = torch.randn(2, 256).half()
    for value, shown in ((16.0, "16.000000"), (2.5, "2.500000"), (-1.0, "-1.000000")):
        bad = b_z.clone()
        bad[1, 70] = value
        with pytest.raises(RuntimeError, match=rf"b_zeros holds {shown} at flat index 198, expected integer zero points in \[0, 15\]"):
            call(a, b_q, b_meta, b_s, None, bad)


def test_invalid_metadata_is_an_error_on_the_cpu():
    _, b_q, b_meta, b_s = sparse_layer(128, 128, -1, seed=6)
    bad = b_meta.clone()
    bad[2, 3] = 0x55555555  # every nibble names position 1 twice
    with pytest.raises(RuntimeError, match=r"b_meta names the same or a decreasing pair of positions"):
        call(torch.randn(2, 128).half(), b_q, bad, b_s)


@pytest.fixture(scope="module")
def layer():
    _, b_q, b_meta, b_s = sparse_layer(256, 256, 128, seed=0)
    return b_q, b_meta, b_s


def a16(m=4, k=256):
    return torch.randn(m, k).half()


CASES = [
    ("a float32", lambda q, m, s: (a16().float(), q, m, s, None), r"a\.dtype = Float, expected torch\.float16 or torch\.bfloat16"),
    ("a 3-D", lambda q, m, s: (a16().unsqueeze(0), q, m, s, None), r"a\.dim\(\) = 3, expected 2"),
    ("K mismatch", lambda q, m, s: (a16(k=128), q, m, s, None), r"a\.size\(1\) = 128, expected K = b_q\.size\(0\) \* 32 = 256"),
    ("b_q float", lambda q, m, s: (a16(), q.float(), m, s, None), r"b_q\.dtype = Float, expected torch\.int32"),
    ("b_q dense shape", lambda q, m, s: (a16(), torch.zeros(16, 512, dtype=torch.int32), m, s, None), r"a\.size\(1\) = 256, expected K = b_q\.size\(0\) \* 32 = 512"),
    ("meta int16", lambda q, m, s: (a16(), q, m.to(torch.int16), s, None), r"b_meta\.dtype = Short, expected torch\.int32"),
    ("meta 1-D", lambda q, m, s: (a16(), q, m.flatten(), s, None), r"b_meta\.dim\(\) = 1, expected 2"),
    ("meta wrong shape", lambda q, m, s: (a16(), q, m[:, :128].contiguous(), s, None), r"b_meta shape \[8, 128\], expected \[K/32, N\] = \[8, 256\]"),
    ("meta non-contiguous", lambda q, m, s: (a16(), q, m.t().contiguous().t(), s, None), r"b_meta must be contiguous"),
    ("K not multiple of 128", lambda q, m, s: (a16(k=64), q[:2].contiguous(), m[:2].contiguous(), s[:1].contiguous(), None), r"K = 64, expected a positive multiple of 128"),
    # N = 64 (one tile) and 192 are taken; 32 and 96 are not whole 64-column tiles
    ("N not multiple of 64", lambda q, m, s: (a16(), q[:, :64].contiguous(), m[:, :32].contiguous(), s[:, :32].contiguous(), None), r"N = b_q\.size\(1\) / 2 = 32, expected a positive multiple of 64"),
    ("N = 96", lambda q, m, s: (a16(), q[:, :192].contiguous(), m[:, :96].contiguous(), s[:, :96].contiguous(), None), r"N = b_q\.size\(1\) / 2 = 96, expected a positive multiple of 64"),
    ("scales fp32", lambda q, m, s: (a16(), q, m, s.float(), None), r"b_scales\.dtype = Float but a\.dtype = Half"),
    ("scales bf16, a fp16", lambda q, m, s: (a16(), q, m, s.bfloat16(), None), r"b_scales\.dtype = BFloat16 but a\.dtype = Half"),
    ("a bf16, scales fp16", lambda q, m, s: (a16().bfloat16(), q, m, s, None), r"b_scales\.dtype = Half but a\.dtype = BFloat16"),
    ("scales wrong groups", lambda q, m, s: (a16(), q, m, torch.ones(3, 256).half(), None), r"b_scales\.size\(0\) = 3, expected 1 \(per-column scales\) or K / group_size with group_size 128, 64 or 32 along the original K \(K = 256: 2, 4 or 8\)"),
    ("scales in groups of 16", lambda q, m, s: (a16(), q, m, torch.ones(16, 256).half(), None), r"b_scales\.size\(0\) = 16, expected 1 \(per-column scales\) or K / group_size with group_size 128, 64 or 32"),
    ("workspace dtype", lambda q, m, s: (a16(), q, m, s, torch.zeros(8)), r"workspace\.dtype = Float, expected torch\.int32"),
]


@pytest.mark.parametrize("name,make,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(layer, name, make, match):
    args = make(*layer)
    with pytest.raises(RuntimeError, match=match):
        call(*args)


def test_meta_tensors_give_the_same_errors(layer):
    b_q, b_meta, b_s = (t.to("meta") for t in layer)
    with pytest.raises(Exception, match=r"a\.size\(1\) = 128, expected K"):
        call(torch.empty(4, 128, dtype=torch.float16, device="meta"), b_q, b_meta, b_s)
    with pytest.raises(Exception, match=r"b_meta shape"):
        call(torch.empty(4, 256, dtype=torch.float16, device="meta"), b_q, b_meta[:, :128], b_s)
    # a group count the op does not take (K / 16): the CPU op's message, from the fake kernel
    with pytest.raises(Exception, match=r"b_scales\.size\(0\) = 16, expected 1 \(per-column scales\) or K / group_size "
                       r"with group_size 128, 64 or 32 along the original K \(K = 256: 2, 4 or 8\)"):
        call(torch.empty(4, 256, dtype=torch.float16, device="meta"), b_q, b_meta, torch.empty(16, 256, dtype=torch.float16, device="meta"))
    for groups in (1, 2, 4, 8):  # per column, groups of 128, 64 and 32
        b_sg = torch.empty(groups, 256, dtype=torch.float16, device="meta")
        out = call(torch.empty(4, 256, dtype=torch.float16, device="meta"), b_q, b_meta, b_sg)
        assert out.shape == (4, 256) and out.dtype == torch.float16
    # N in whole 64-column tiles: 192 gives its shape, 96 the CPU op's message
    a = torch.empty(4, 256, dtype=torch.float16, device="meta")
    out = call(a, b_q[:, :384].contiguous(), b_meta[:, :192].contiguous(), b_s[:, :192].contiguous())
    assert out.shape == (4, 192) and out.dtype == torch.float16
    with pytest.raises(Exception, match=r"N = 96, expected a positive multiple of 64"):
        call(a, b_q[:, :192].contiguous(), b_meta[:, :96].contiguous(), b_s[:, :96].contiguous())
    # empty weights: refused as the CPU op refuses them (K and N must be positive)
    with pytest.raises(Exception, match=r"N = 0, expected a positive multiple of 64"):
        call(a, b_q[:, :0], b_meta[:, :0], b_s[:, :0])
    with pytest.raises(Exception, match=r"K = 0, expected a positive multiple of 128"):
        call(torch.empty(4, 0, dtype=torch.float16, device="meta"), b_q[:0], b_meta[:0], b_s)
    with pytest.raises(Exception, match=r"N = b_q.size\(1\) / 2 = 0, expected a positive multiple of 64"):  # the CPU op
        call(torch.randn(4, 256).half(), *(t[:, :0].contiguous() for t in layer))


@pytest.fixture(scope="module")
def zp_layer():
    _, b_q, b_meta, b_s, b_z = zero_point_layer(256, 256, 64, seed=0)
    return b_q, b_meta, b_s, b_z


# (name, b_zeros from the layer's (b_s, b_z), the CPU op's message, the fake kernel's message)
ZERO_CASES = [
    ("fp32", lambda s, z: z.float(), r"b_zeros\.dtype = Float but a\.dtype = Half; they must match",
     r"b_zeros\.dtype = torch\.float32 but a\.dtype = torch\.float16; they must match"),
    ("bf16 with fp16 a", lambda s, z: z.bfloat16(), r"b_zeros\.dtype = BFloat16 but a\.dtype = Half",
     r"b_zeros\.dtype = torch\.bfloat16 but a\.dtype = torch\.float16"),
    ("per-column shape with groups", lambda s, z: z[:1].contiguous(),
     r"b_zeros shape \[1, 256\], expected the shape of b_scales \[4, 256\]",
     r"b_zeros shape \[1, 256\], expected the shape of b_scales \[4, 256\]"),
    ("transposed", lambda s, z: torch.ones(256, 4, dtype=torch.float16),
     r"b_zeros shape \[256, 4\], expected the shape of b_scales \[4, 256\]",
     r"b_zeros shape \[256, 4\], expected the shape of b_scales \[4, 256\]"),
    ("1-D", lambda s, z: z.flatten(), r"b_zeros shape \[1024\], expected the shape of b_scales \[4, 256\]",
     r"b_zeros shape \[1024\], expected the shape of b_scales \[4, 256\]"),
]


@pytest.mark.parametrize("name,make,cpu_match,fake_match", ZERO_CASES, ids=[c[0] for c in ZERO_CASES])
def test_bad_zero_points_raise_clear_errors(zp_layer, name, make, cpu_match, fake_match):
    """The CPU op (csrc/gemm_2_4_checks.h) and the fake kernel (marlin/ops.py) refuse the same
    b_zeros, each naming the argument, what it got and what it expected."""
    b_q, b_meta, b_s, b_z = zp_layer
    bad = make(b_s, b_z)
    with pytest.raises(RuntimeError, match="marlin.gemm_2_4: " + cpu_match):
        call(a16(), b_q, b_meta, b_s, None, bad)
    meta = [t.to("meta") for t in (a16(), b_q, b_meta, b_s, bad)]
    with pytest.raises(Exception, match="marlin.gemm_2_4: " + fake_match):
        call(*meta[:4], None, meta[4])


def test_zero_points_on_another_device_are_refused(zp_layer):
    """b_zeros on another device than a: the CPU op's check (reached directly, as a CUDA b_zeros
    would reach it) and the fake kernel's (which the dispatcher picks for a meta tensor)."""
    b_q, b_meta, b_s, b_z = zp_layer
    a = a16()
    cpu_only = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    with pytest.raises(RuntimeError, match=r"marlin\.gemm_2_4: b_zeros is on meta but a is on cpu; all tensors must be on one device"):
        torch.ops.marlin.gemm_2_4.default.redispatch(cpu_only, a, b_q, b_meta, b_s, None, b_z.to("meta"))
    with pytest.raises(Exception, match=r"marlin\.gemm_2_4: b_zeros is on cpu but a is on meta; all tensors must be on one device"):
        call(*(t.to("meta") for t in (a, b_q, b_meta, b_s)), None, b_z)
    # non-contiguous zero points (the CPU op reads them in place)
    with pytest.raises(RuntimeError, match=r"marlin\.gemm_2_4: b_zeros must be contiguous"):
        call(a, b_q, b_meta, b_s, None, b_z.t().contiguous().t())


def test_meta_tensors_with_zero_points_give_the_output_shape(zp_layer):
    b_q, b_meta, b_s, b_z = (t.to("meta") for t in zp_layer)
    out = call(torch.empty(5, 256, dtype=torch.float16, device="meta"), b_q, b_meta, b_s, None, b_z)
    assert out.shape == (5, 256) and out.dtype == torch.float16


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda_2_4)])
def test_opcheck_gemm_2_4(device):
    cases = [(1, 128, 128, 128, torch.float16), (7, 256, 384, -1, torch.float16), (33, 384, 256, 128, torch.bfloat16),
             (0, 128, 256, 128, torch.float16), (5, 256, 128, -1, torch.bfloat16), (3, 256, 128, 64, torch.float16),
             (9, 384, 128, 32, torch.bfloat16), (5, 256, 192, 128, torch.float16), (17, 384, 320, 64, torch.bfloat16),
             (2, 128, 64, 32, torch.float16)]
    for m, k, n, g, dtype in cases:
        _, b_q, b_meta, b_s = sparse_layer(k, n, g, seed=m, dtype=dtype)
        a = torch.randn(m, k, device=device).to(dtype)
        torch.library.opcheck(torch.ops.marlin.gemm_2_4.default, (a, b_q.to(device), b_meta.to(device), b_s.to(device), None))
    # with zero points (b_zeros last, after the workspace)
    zp_cases = [(1, 128, 128, 128, torch.float16), (7, 256, 384, -1, torch.bfloat16), (0, 256, 128, 64, torch.float16),
                (17, 384, 256, 32, torch.bfloat16), (4, 256, 256, 128, torch.bfloat16), (3, 256, 192, 32, torch.float16),
                (6, 128, 320, -1, torch.bfloat16)]
    for m, k, n, g, dtype in zp_cases:
        _, b_q, b_meta, b_s, b_z = zero_point_layer(k, n, g, seed=m, dtype=dtype)
        a = torch.randn(m, k, device=device).to(dtype)
        args = (a, b_q.to(device), b_meta.to(device), b_s.to(device), None, b_z.to(device))
        torch.library.opcheck(torch.ops.marlin.gemm_2_4.default, args)


def test_compile_fullgraph_cpu():
    _, b_q, b_meta, b_s = sparse_layer(256, 256, 128, seed=3)

    def f(x):
        return torch.relu(torch.ops.marlin.gemm_2_4(x * 2, b_q, b_meta, b_s)) + 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.randn(5, 256).half()
    assert torch.equal(compiled(x), f(x))
    # with zero points
    _, zq, zmeta, zs, zz = zero_point_layer(256, 256, 64, seed=3)

    def g(x):
        return torch.ops.marlin.gemm_2_4(x - 1, zq, zmeta, zs, None, zz) * 3

    assert torch.equal(torch.compile(g, fullgraph=True, backend="aot_eager")(x), g(x))
