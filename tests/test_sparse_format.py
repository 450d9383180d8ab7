"""The 2:4-sparse format (marlin/sparse.py): pruning, the pattern check, pack/unpack round trips,
and the layout as the sparse tensor-core instruction reads it (emulated lane by lane)."""

import pytest
import torch

from marlin import packing, sparse


def sparse_weight(k, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return sparse.prune_2_4(torch.randn(k, n, generator=gen))


def test_prune_keeps_the_two_largest_of_every_four():
    w = torch.tensor([[1.0, -5.0, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, -1.0]]).t()  # [K=4, N=3]
    p = sparse.prune_2_4(w)
    assert p[:, 0].tolist() == [0.0, -5.0, 3.0, 0.0]
    assert p[:, 1].tolist() == [2.0, 2.0, 0.0, 0.0]  # ties: the lower rows
    assert p[:, 2].tolist() == [0.0, 0.0, 0.0, -1.0]
    w = torch.randn(64, 32)
    p = sparse.prune_2_4(w)
    assert int((p != 0).reshape(16, 4, 32).sum(1).max()) == 2
    # what is kept is at least as large as what is dropped, in every group
    kept = torch.where(p != 0, w.abs(), torch.tensor(float("inf"))).reshape(16, 4, 32).amin(1)
    dropped = torch.where(p == 0, w.abs(), torch.tensor(0.0)).reshape(16, 4, 32).amax(1)
    assert bool((kept >= dropped).all())
    assert sparse.violations_2_4(p).numel() == 0


def test_check_names_the_columns_that_break_the_pattern():
    w = sparse_weight(64, 64)
    w[8:12, 5] = 1.0  # 4 non-zeros in rows 8..11 of column 5
    w[60, 17] = w[61, 17] = w[62, 17] = 2.0
    assert sparse.violations_2_4(w).tolist() == [5, 17]
    with pytest.raises(ValueError, match=r"2 of 64 columns break it: column 5 \(rows 8\.\.11 hold 4 non-zeros\), column 17 \(rows 60\.\.63"):
        sparse.check_2_4(w)
    with pytest.raises(ValueError, match=r"column 5"):
        sparse.quantize_and_pack_2_4(w, 128)
    with pytest.raises(ValueError, match=r"K = 6 is not a multiple of 4"):
        sparse.check_2_4(torch.zeros(6, 4))


@pytest.mark.parametrize(
    "k,n,group_size",
    [(128, 64, 128), (256, 128, -1), (512, 192, 128), (96, 64, -1), (256, 192, 64), (384, 128, 32), (96, 64, 32),
     (384, 320, 32)],
)
def test_pack_unpack_round_trip_is_exact(k, n, group_size):
    w = sparse_weight(k, n, seed=k + n)
    b_q, b_meta, b_s = sparse.quantize_and_pack_2_4(w, group_size)
    assert b_q.shape == (k // 32, 2 * n) and b_q.dtype == torch.int32
    assert b_meta.shape == (k // 32, n) and b_meta.dtype == torch.int32
    assert b_s.shape == (packing.num_groups(k, group_size), n) and b_s.dtype == torch.float16
    q, s = packing.quantize(w, group_size)
    q2, s2 = sparse.unpack_2_4_parts(b_q, b_meta, b_s)
    assert torch.equal(q2, q) and torch.equal(s2, s)
    assert torch.equal(sparse.unpack_2_4(b_q, b_meta, b_s), packing.dequantize(q, s))
    # zeros of the pruned matrix stay zeros (q = 0 exactly where w = 0)
    assert bool((q2[w == 0] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("k,n,group_size", [(256, 128, 128), (256, 192, 64), (384, 128, 32), (96, 64, 32), (256, 128, -1)])
def test_pack_unpack_round_trip_with_zeros_is_exact(k, n, group_size, dtype):
    """Zero points (sym=False): b_zeros has b_scales' shape, dtype and layout; unpacking gives
    packing.quantize's (u, scales, zeros) back, with u = z at the pruned positions, which dequantize
    to exact zeros; pack_2_4 of those parts is the inverse of unpack_2_4_parts."""
    w = sparse_weight(k, n, seed=k + n + 1) + 0.3  # shifted: the zero points are not all 8
    w = torch.where(sparse.mask_2_4(w), w, torch.zeros(()))
    b_q, b_meta, b_s, b_z = sparse.quantize_and_pack_2_4(w, group_size, dtype=dtype, sym=False)
    u, s, z = packing.quantize(w, group_size, sym=False, dtype=dtype)
    assert b_q.shape == (k // 32, 2 * n) and b_meta.shape == (k // 32, n)
    assert b_z.shape == b_s.shape == (packing.num_groups(k, group_size), n) and b_z.dtype == b_s.dtype == dtype
    assert torch.equal(b_z, packing.permute_scales(z)) and torch.equal(b_s, packing.permute_scales(s))
    assert len(set(z.flatten().tolist())) > 3  # a range of zero points, not one value
    u2, s2, z2 = sparse.unpack_2_4_parts(b_q, b_meta, b_s, b_z)
    assert torch.equal(u2, u) and torch.equal(s2, s) and torch.equal(z2, z)
    dense = sparse.unpack_2_4(b_q, b_meta, b_s, b_z)
    assert torch.equal(dense, packing.dequantize(u, s, z))
    assert bool((dense[w == 0] == 0).all()) and sparse.violations_2_4(dense).numel() == 0
    # the symmetric reading of the same words is another weight: the zero points matter
    assert not torch.equal(sparse.unpack_2_4(b_q, b_meta, b_s), dense)
    # pack_2_4 from the parts (positions from u - z) and back
    parts = sparse.pack_2_4(u, s, z)
    assert len(parts) == 4 and torch.equal(parts[2], b_s) and torch.equal(parts[3], b_z)
    back = sparse.unpack_2_4_parts(*parts)
    assert all(torch.equal(x, y) for x, y in zip(back, (u, s, z)))


def test_zero_point_positions_come_from_the_pruned_weight():
    """A kept weight small enough to quantize to its zero point (u = z, so u - z = 0) keeps its
    position: b_meta names the pruned weight's non-zeros, not the lowest free rows, and the nibble
    stored there is u (= z), so it dequantizes to 0 like a pruned weight."""
    k, n = 64, 64
    w = torch.zeros(k, n)
    w[1, :] = 1.0  # group 0 of every column: rows 1 and 3 kept, row 3 tiny
    w[3, :] = 0.01
    w[4:, :] = sparse_weight(k - 4, n, seed=7)
    w[4:8, 0] = torch.tensor([0.0, -0.9, 0.0, 0.002])  # column 0's second group likewise
    b_q, b_meta, b_s, b_z = sparse.quantize_and_pack_2_4(w, -1, sym=False)
    u, s, z = packing.quantize(w, -1, sym=False)
    assert int(u[3, 0]) == int(z[0, 0]) and int(u[7, 0]) == int(z[0, 0])  # kept, but quantized to z
    idx = sparse.unpack_meta(b_meta)
    _, from_w = sparse.compress_2_4(w)
    assert torch.equal(idx, from_w)
    assert idx[:2, 0].tolist() == [1, 3] and idx[2:4, 0].tolist() == [1, 3]  # not (0, 1): the lowest free rows
    # the stored nibbles are u: packing.pack stores a signed v as v + 8
    values, _ = packing.unpack(b_q, torch.ones(1, n, dtype=torch.float16))
    kept_u = torch.gather(u.to(torch.int64).reshape(k // 4, 4, n), 1, idx.to(torch.int64).reshape(k // 4, 2, n))
    assert torch.equal(values.to(torch.int64) + 8, kept_u.reshape(k // 2, n))
    assert torch.equal(sparse.unpack_2_4(b_q, b_meta, b_s, b_z), packing.dequantize(u, s, z))
    # pack_2_4 sees only u - z: its positions differ there, its weight does not
    p_q, p_meta, p_s, p_z = sparse.pack_2_4(u, s, z)
    assert sparse.unpack_meta(p_meta)[:2, 0].tolist() == [0, 1]
    assert torch.equal(sparse.unpack_2_4(p_q, p_meta, p_s, p_z), sparse.unpack_2_4(b_q, b_meta, b_s, b_z))


def test_zero_point_arguments_are_checked():
    w = sparse_weight(128, 64, seed=9)
    u, s, z = packing.quantize(w, 32, sym=False)
    with pytest.raises(ValueError, match=r"pack_2_4: zeros \(1, 64\) torch.float16, expected the scales' shape and dtype \(4, 64\)"):
        sparse.pack_2_4(u, s, z[:1])
    with pytest.raises(ValueError, match=r"pack_2_4: zeros \(4, 64\) torch.bfloat16, expected the scales' shape and dtype"):
        sparse.pack_2_4(u, s, z.bfloat16())
    with pytest.raises(ValueError, match=r"integer zero points in \[0, 15\]"):
        sparse.pack_2_4(u, s, z + 0.5)
    with pytest.raises(ValueError, match=r"with zeros, q holds the stored values u, integers in \[0, 15\]; got \[-8, 7\]"):
        sparse.pack_2_4(packing.quantize(w, 32)[0], s, z)
    dense = u.clone()
    dense[0:3, 5] = (z[0, 5] + 1).to(torch.int8)  # three values off the zero point in rows 0..3
    with pytest.raises(ValueError, match=r"pack_2_4: q - zeros .* column 5 \(rows 0\.\.3 hold 3 non-zeros\)"):
        sparse.pack_2_4(dense, s, z)
    with pytest.raises(ValueError, match=r"quantize_and_pack_2_4: sym = 'no', expected True"):
        sparse.quantize_and_pack_2_4(w, 32, sym="no")
    b_q, b_meta, b_s, b_z = sparse.quantize_and_pack_2_4(w, 32, sym=False)
    with pytest.raises(ValueError, match=r"unpack_2_4: b_zeros \(2, 64\) torch.float16, expected b_scales' shape and dtype"):
        sparse.unpack_2_4(b_q, b_meta, b_s, b_z[:2])
    # the symmetric calls are unchanged: three parts, q = 0 at the pruned positions
    assert len(sparse.quantize_and_pack_2_4(w, 32)) == 3 and len(sparse.pack_2_4(*packing.quantize(w, 32))) == 3


def test_compress_fills_short_groups_with_the_lowest_free_positions():
    q = torch.zeros(8, 3, dtype=torch.int8)
    q[3, 0] = 5  # one non-zero at position 3 -> pair (0, 3)
    q[1, 1], q[2, 1] = -2, 7  # (1, 2)
    q[4 + 2, 2] = 1  # second group of column 2: (0, 2)
    values, idx = sparse.compress_2_4(q)
    assert idx[:2, 0].tolist() == [0, 3] and values[:2, 0].tolist() == [0, 5]
    assert idx[:2, 1].tolist() == [1, 2] and values[:2, 1].tolist() == [-2, 7]
    assert idx[:2, 2].tolist() == [0, 1] and idx[2:4, 2].tolist() == [0, 2]
    assert torch.equal(sparse.decompress_2_4(values, idx), q)


def test_meta_round_trip_and_invalid_nibbles_are_refused():
    gen = torch.Generator().manual_seed(1)
    pairs = torch.tensor([(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)])
    choice = torch.randint(0, 6, (64 // 4, 128), generator=gen)
    idx = pairs[choice].permute(0, 2, 1).reshape(32, 128).to(torch.int8)  # [K/2, N] for K = 64
    b_meta = sparse.pack_meta(idx)
    assert b_meta.shape == (2, 128)
    assert torch.equal(sparse.unpack_meta(b_meta), idx)
    bad = b_meta.clone()
    bad[1, 70] = bad[1, 70] & ~0xF | 0b0101  # positions (1, 1) in one nibble
    with pytest.raises(ValueError, match=r"index nibble 0b0101"):
        sparse.unpack_meta(bad)


def meta_word_and_bits(k, n):
    """Where the index nibble of (group of rows 4 (k // 4) .., column n) lives, from the prose of
    marlin/sparse.py's docstring (independent of the code that packs)."""
    s, go, nt, col = k // 32, (k % 32) // 4, n // 64, n % 64
    j, hi, g = col // 16, (col % 16) // 8, col % 8
    c = 2 * (j // 2) + go // 4
    r = j % 2
    t = 4 * g + c
    return s, 64 * nt + 2 * t + r, 16 * hi + 4 * (go % 4)


def test_meta_layout_matches_the_documented_formula():
    gen = torch.Generator().manual_seed(2)
    k, n = 64, 128
    w = sparse.prune_2_4(torch.randn(k, n, generator=gen))
    _, b_meta, _ = sparse.quantize_and_pack_2_4(w, -1)
    words = b_meta.to(torch.int64) & 0xFFFFFFFF
    _, idx = sparse.compress_2_4(packing.quantize(w, -1)[0])  # positions chosen on the quantized values
    for kk in range(0, k, 4):
        for nn_ in range(n):
            s, word, bit = meta_word_and_bits(kk, nn_)
            nib = (int(words[s, word]) >> bit) & 0xF
            i0, i1 = int(idx[kk // 2, nn_]), int(idx[kk // 2 + 1, nn_])
            assert nib == i0 | (i1 << 2), (kk, nn_)


def test_layout_as_mma_sp_reads_it():
    """Emulate what each lane hands to mma.sp.m16n8k32 (weights as the sparse operand A of the
    transposed product, one instruction per 16 columns of N x 32 rows of K) and rebuild the dense
    block from it, following the PTX ISA: A registers {a0 a1} row g chunk c, {a2 a3} row g + 8
    chunk c, {a4 a5} row g chunk c + 4, {a6 a7} row g + 8 chunk c + 4 (chunk = 4 columns of K,
    two kept values each); the metadata register of the lane pair selected by the sparsity
    selector (lanes 4 g + 2 sel and 4 g + 2 sel + 1): the first holds chunks 0..3, the second
    chunks 4..7, each as 16 bits of row g (low) and 16 bits of row g + 8 (high), a nibble
    i0 | i1 << 2 per chunk. The kernel uses selector j // 2 and word j % 2 for block j."""
    gen = torch.Generator().manual_seed(3)
    k, n = 64, 128
    w = sparse.prune_2_4(torch.randn(k, n, generator=gen))
    b_q, b_meta, b_s = sparse.quantize_and_pack_2_4(w, -1)
    dense_q, _ = sparse.unpack_2_4_parts(b_q, b_meta, b_s)
    qwords = b_q.to(torch.int64) & 0xFFFFFFFF
    mwords = b_meta.to(torch.int64) & 0xFFFFFFFF
    NIB = [packing.INTERLEAVE.index(e) for e in range(8)]  # nibble holding fragment element e

    for s in range(k // 32):
        for nt in range(n // 64):
            for j in range(4):
                rebuilt = torch.full((16, 32), 99, dtype=torch.int64)  # [row of N in block, K of strip]
                vals = {}  # (row, chunk) -> the two kept values
                for lane in range(32):
                    g, c = divmod(lane, 4)
                    word = int(qwords[s, 128 * nt + 4 * lane + j])
                    e = [((word >> (4 * NIB[x])) & 0xF) - 8 for x in range(8)]
                    # small-batch register order: a = {lo[0], hi[0], lo[1], hi[1]} = e(0,1), e(4,5), e(2,3), e(6,7)
                    vals[(g, c)] = (e[0], e[1])
                    vals[(g + 8, c)] = (e[4], e[5])
                    vals[(g, c + 4)] = (e[2], e[3])
                    vals[(g + 8, c + 4)] = (e[6], e[7])
                sel = j // 2
                for g in range(8):
                    for half in range(2):  # lane 4 g + 2 sel + half: chunks 4 half .. 4 half + 3
                        lane = 4 * g + 2 * sel + half
                        m = int(mwords[s, 64 * nt + 2 * lane + j % 2])
                        for row, base in ((g, 0), (g + 8, 16)):
                            for p in range(4):
                                ch = 4 * half + p
                                nib = (m >> (base + 4 * p)) & 0xF
                                i0, i1 = nib & 3, nib >> 2
                                assert i0 < i1
                                rebuilt[row, 4 * ch: 4 * ch + 4] = 0
                                rebuilt[row, 4 * ch + i0] = vals[(row, ch)][0]
                                rebuilt[row, 4 * ch + i1] = vals[(row, ch)][1]
                cols = slice(64 * nt + 16 * j, 64 * nt + 16 * j + 16)
                expect = dense_q[32 * s: 32 * s + 32, cols].t().to(torch.int64)
                assert torch.equal(rebuilt, expect), (s, nt, j)


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"K = 48, expected a positive multiple of 32"):
        sparse.quantize_and_pack_2_4(torch.zeros(48, 64), -1)
    with pytest.raises(ValueError, match=r"N = 32, expected a positive multiple of 64"):
        sparse.quantize_and_pack_2_4(torch.zeros(64, 32), -1)
    with pytest.raises(ValueError, match=r"must be a 2-D float tensor"):
        sparse.quantize_and_pack_2_4(torch.zeros(64, 64, dtype=torch.int32), -1)
    b_q, b_meta, b_s = sparse.quantize_and_pack_2_4(sparse_weight(64, 64), -1)
    with pytest.raises(ValueError, match=r"do not fit"):
        sparse.unpack_2_4(b_q, b_meta[:1], b_s)
    for g in (128, 64, 32, -1):
        for n in (128, 64, 192, 320):  # N in whole 64-column tiles, N % 128 == 64 included
            assert sparse.check_shape_2_4(256, n, g) is None
    assert sparse.N_MULTIPLE_2_4 == 64 and sparse.K_MULTIPLE_2_4 == 128
    for n in (96, 32, 200, 0):
        assert sparse.check_shape_2_4(256, n, 128) == f"out_features = {n}, expected a positive multiple of 64"
    assert "in_features = 96" in sparse.check_shape_2_4(96, 128, 128)
    assert "in_features = 96" in sparse.check_shape_2_4(96, 128, 32)  # K stays a multiple of 128 for every group size
    for g in (16, 256):
        assert f"group_size = {g}, expected one of (128, 64, 32, -1)" in sparse.check_shape_2_4(256, 128, g)
