"""The format spec: quantization, pack/unpack round trips and the layout facts the kernel relies on."""

import pytest
import torch

from marlin import packing


ROUND_TRIP_CASES = [
    (k, n, g)
    for k, n in [(16, 64), (128, 128), (256, 192), (384, 640)]
    for g in (-1, 16, 64, 128)
    if g == -1 or k % g == 0
]


@pytest.mark.parametrize("k,n,group_size", ROUND_TRIP_CASES)
def test_pack_unpack_round_trip_bit_exact(k, n, group_size):
    q = torch.randint(-8, 8, (k, n), dtype=torch.int8)
    scales = (torch.rand(packing.num_groups(k, group_size), n) + 0.01).half()
    b_q, b_scales = packing.pack(q, scales)
    assert b_q.dtype == torch.int32 and b_q.shape == (k // 16, 2 * n)
    assert b_scales.shape == scales.shape
    q2, s2 = packing.unpack(b_q, b_scales)
    assert torch.equal(q2, q)
    assert torch.equal(s2, scales)
    # and back again: packing is a bijection on the packed words too
    b_q2, b_s2 = packing.pack(q2, s2)
    assert torch.equal(b_q2, b_q) and torch.equal(b_s2, b_scales)


def test_tile_order_is_the_mma_fragment_layout():
    # One 16x64 tile whose weight at (k, n) encodes its own row k (0..15 -> q = k - 8).
    k_idx = torch.arange(16).unsqueeze(1).expand(16, 64)
    n_idx = torch.arange(64).unsqueeze(0).expand(16, 64)
    b_q_rows, _ = packing.pack((k_idx - 8).to(torch.int8), torch.ones(1, 64, dtype=torch.float16))
    b_q_cols, _ = packing.pack((n_idx % 16 - 8).to(torch.int8), torch.ones(1, 64, dtype=torch.float16))
    words_r = b_q_rows.view(-1).tolist()
    words_c = b_q_cols.view(-1).tolist()

    def nib(word, p):
        return ((word & 0xFFFFFFFF) >> (4 * p)) & 0xF

    for lane in range(32):
        g, c = divmod(lane, 4)
        for j in range(4):
            w_r, w_c = words_r[4 * lane + j], words_c[4 * lane + j]
            # decode in the kernel's order: (w & 0x000f000f) -> (e0, e1), (w & 0x00f000f0) -> (e2, e3),
            # then the same on w >> 8 -> (e4, e5), (e6, e7)
            elems = [0, 4, 1, 5, 2, 6, 3, 7]  # nibble holding e0..e7
            rows = [nib(w_r, p) for p in elems]
            cols = [nib(w_c, p) for p in elems]
            assert rows == [2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9] * 2, (lane, j, rows)
            # columns are 16 j + g (first half) and 16 j + 8 + g (second half); we stored n % 16
            assert cols == [g] * 4 + [8 + g] * 4, (lane, j, cols)


def test_interleave_is_64207531():
    # The paper's "64207531": the elements held by the low 16-bit half (nibbles 3..0), then by the
    # high half (nibbles 7..4), each read from its top nibble down.
    order = [packing.INTERLEAVE[p] for p in (3, 2, 1, 0, 7, 6, 5, 4)]
    assert "".join(map(str, order)) == "64207531"


def test_scale_permutation_gives_each_lane_its_columns():
    g = 2
    scales = torch.arange(g * 128, dtype=torch.float32).reshape(g, 128).half()
    perm = packing.permute_scales(scales)
    for chunk in range(2):
        for lane in range(32):
            vec = perm[1, chunk * 64 + 8 * (lane // 4): chunk * 64 + 8 * (lane // 4) + 8]
            want = [scales[1, chunk * 64 + lane // 4 + 8 * m] for m in range(8)]
            assert vec.tolist() == torch.stack(want).tolist()
    assert torch.equal(packing.unpermute_scales(perm), scales)
    one = torch.rand(1, 128).half()
    assert torch.equal(packing.permute_scales(one), one), "per-column scales keep natural order"


@pytest.mark.parametrize("group_size", [128, -1])
def test_quantize_is_round_to_nearest_symmetric(group_size):
    w = torch.randn(256, 128)
    q, s = packing.quantize(w, group_size)
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
    rows = 256 if group_size == -1 else group_size
    assert s.shape == (256 // rows, 128) and s.dtype == torch.float16
    deq = packing.dequantize(q, s)
    # round to nearest: every weight within half a step of its dequantized value (unless clamped at +7)
    step = s.float().repeat_interleave(rows, 0)
    err = (w - deq).abs()
    clamped = q == 7
    assert bool((err[~clamped] <= step[~clamped] * 0.5 + 1e-6).all())
    # scale is 2 * amax / 15 of the group, rounded to fp16: within one fp16 rounding (2^-11 relative;
    # the order of the float32 product and division may move the rounding by one ulp)
    amax = w.abs().reshape(-1, rows, 128).amax(1)
    assert torch.allclose(s.float(), amax * 2 / 15, rtol=2**-10, atol=0)


def test_quantize_zero_group_has_unit_scale():
    w = torch.zeros(128, 64)
    q, s = packing.quantize(w, 128)
    assert bool((s == 1).all()) and bool((q == 0).all())


@pytest.mark.parametrize(
    "shape,group_size,match",
    [((100, 64), 128, "K = 100"), ((128, 60), 128, "N = 60"), ((256, 64), 96, "group_size = 96")],
)
def test_pack_rejects_bad_shapes(shape, group_size, match):
    with pytest.raises(ValueError, match=match):
        packing.quantize_and_pack(torch.randn(*shape), group_size)


def test_pack_rejects_out_of_range_q():
    q = torch.full((16, 64), 9, dtype=torch.int8)
    with pytest.raises(ValueError, match="q values"):
        packing.pack(q, torch.ones(1, 64, dtype=torch.float16))


# -- the other formats: zero points, 8 bits, bf16 ------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (8, True)])
@pytest.mark.parametrize("k,n,group_size", [(64, 64, 32), (256, 192, 64), (384, 320, 128), (128, 128, -1)])
def test_round_trip_every_format(dtype, bits, sym, k, n, group_size):
    gen = torch.Generator().manual_seed(k + n + bits)
    groups = packing.num_groups(k, group_size)
    scales = (torch.rand(groups, n, generator=gen) + 0.01).to(dtype)
    if sym:
        half = 1 << (bits - 1)
        q = torch.randint(-half, half, (k, n), generator=gen).to(torch.int8)
        parts = (q, scales)
    else:
        q = torch.randint(0, 16, (k, n), generator=gen).to(torch.int8)
        parts = (q, scales, torch.randint(0, 16, (groups, n), generator=gen).to(dtype))
    packed = packing.pack(*parts, bits=bits)
    assert len(packed) == len(parts)
    assert packed[0].dtype == torch.int32 and packed[0].shape == (k // 16, packing.words_per_column(bits) * n)
    assert all(p.dtype == dtype for p in packed[1:])
    unpacked = packing.unpack(*packed, bits=bits)
    assert all(torch.equal(x, y) for x, y in zip(unpacked, parts))
    assert all(torch.equal(x, y) for x, y in zip(packing.pack(*unpacked, bits=bits), packed))
    if not sym:  # zero points take exactly the scales' layout
        assert torch.equal(packed[2], packing.permute_scales(parts[2]))


def test_8bit_tile_order_is_the_mma_fragment_layout():
    # One 16x64 tile whose weight at (k, n) encodes its row k, another its column n % 16 (q = v - 128).
    k_idx = torch.arange(16).unsqueeze(1).expand(16, 64)
    n_idx = torch.arange(64).unsqueeze(0).expand(16, 64)
    one = torch.ones(1, 64, dtype=torch.float16)
    words_r = packing.pack((k_idx - 128).to(torch.int8), one, bits=8)[0].view(-1).tolist()
    words_c = packing.pack((n_idx % 16 - 128).to(torch.int8), one, bits=8)[0].view(-1).tolist()
    assert len(words_r) == 256

    def byte(word, p):
        return ((word & 0xFFFFFFFF) >> (8 * p)) & 0xFF

    for lane in range(32):
        g, c = divmod(lane, 4)
        for j in range(4):
            for h in range(2):
                w_r, w_c = words_r[8 * lane + 2 * j + h], words_c[8 * lane + 2 * j + h]
                # decode in the kernel's order: prmt 0x5250 -> bytes (0, 2) = (e0, e1), 0x5351 -> (1, 3) = (e2, e3)
                rows = [byte(w_r, p) for p in (0, 2, 1, 3)]
                cols = [byte(w_c, p) for p in (0, 2, 1, 3)]
                assert rows == [2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9], (lane, j, h, rows)
                assert cols == [8 * h + g] * 4, (lane, j, h, cols)


def test_8bit_word_example():
    """The worked example of docs/FORMAT.md: lane 0, block 0 of an 8-bit tile holding u = 16 k + n."""
    k_idx = torch.arange(16).unsqueeze(1).expand(16, 64)
    n_idx = torch.arange(64).unsqueeze(0).expand(16, 64)
    u = (16 * k_idx + n_idx % 16)  # 0..255
    b_q, _ = packing.pack((u - 128).to(torch.int8), torch.ones(1, 64, dtype=torch.float16), bits=8)
    w0, w1 = (int(x) & 0xFFFFFFFF for x in b_q.view(-1)[:2])
    # lane 0 (g = 0, c = 0): rows 0, 1, 8, 9 of column 0 -> u = 0, 16, 128, 144 in bytes (e0, e2, e1, e3)
    assert w0 == 0x90108000
    # the same rows of column 8 -> u = 8, 24, 136, 152
    assert w1 == 0x98188808


@pytest.mark.parametrize("group_size", [32, -1])
def test_quantize_zero_points_round_to_nearest(group_size):
    w = torch.randn(256, 128) + 0.7  # skewed: zero points differ from 8
    q, s, z = packing.quantize(w, group_size, sym=False)
    assert q.dtype == torch.int8 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert s.dtype == torch.float16 and z.dtype == torch.float16 and z.shape == s.shape
    assert bool((z == z.round()).all()) and int(z.min()) >= 0 and int(z.max()) <= 15
    assert bool((z != 8).any())
    rows = 256 if group_size == -1 else group_size
    wg = w.reshape(-1, rows, 128)
    lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
    assert torch.equal(s, ((hi - lo) / 15).half())
    assert torch.equal(z, torch.round(-lo / s.float()).clamp(0, 15).half())
    deq = packing.dequantize(q, s, z)
    step = s.float().repeat_interleave(rows, 0)
    clamped = (q == 0) | (q == 15)
    assert bool(((w - deq).abs()[~clamped] <= step[~clamped] * 0.5 + 1e-6).all())
    # zero points beat symmetric quantization on skewed weights
    qs, ss = packing.quantize(w, group_size)
    assert (w - deq).norm() < (w - packing.dequantize(qs, ss)).norm()


def test_quantize_8bit_and_bf16():
    w = torch.randn(256, 64).bfloat16()
    q, s = packing.quantize(w, 128, bits=8)
    assert s.dtype == torch.bfloat16  # the weight's dtype when it is fp16 or bf16
    assert int(q.min()) >= -128 and int(q.max()) <= 127 and int(q.min()) < -100
    amax = w.float().abs().reshape(2, 128, 64).amax(1)
    assert torch.equal(s, (amax * 2 / 255).bfloat16())
    rel = (packing.dequantize(q, s) - w.float()).norm() / w.float().norm()
    q4, s4 = packing.quantize(w, 128)
    rel4 = (packing.dequantize(q4, s4) - w.float()).norm() / w.float().norm()
    assert rel < 0.02 < rel4 / 5
    assert packing.quantize(w, 128, dtype=torch.float16)[1].dtype == torch.float16


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: packing.quantize(torch.randn(128, 64), 128, bits=8, sym=False), "zero points are supported for 4-bit"),
        (lambda: packing.quantize(torch.randn(128, 64), 128, bits=3), r"bits = 3, expected one of \(4, 8\)"),
        (lambda: packing.quantize(torch.randn(128, 64), 128, dtype=torch.float32), "dtype = torch.float32"),
        (
            lambda: packing.pack(torch.zeros(128, 64, dtype=torch.int8), torch.ones(1, 64).half(), torch.ones(1, 64).half(), bits=8),
            "zero points are supported for 4-bit",
        ),
        (
            lambda: packing.pack(torch.zeros(128, 64, dtype=torch.int8), torch.ones(1, 64).half(), torch.full((1, 64), 16.0).half()),
            r"zeros must hold integer values in \[0, 15\]",
        ),
        (
            lambda: packing.pack(torch.zeros(128, 64, dtype=torch.int8), torch.ones(1, 64).half(), torch.ones(1, 64).bfloat16()),
            "expected the scales' shape and dtype",
        ),
        (
            lambda: packing.pack(torch.full((128, 64), -1, dtype=torch.int8), torch.ones(1, 64).half(), torch.ones(1, 64).half()),
            r"q values must lie in \[0, 15\]",
        ),
        (lambda: packing.pack(torch.zeros(128, 64, dtype=torch.int8), torch.ones(1, 64)), "scales.dtype = torch.float32"),
        (lambda: packing.unpack(torch.zeros(8, 128, dtype=torch.int32), torch.ones(1, 64).half(), bits=8), r"\[K/16, 4N\]"),
    ],
)
def test_format_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
