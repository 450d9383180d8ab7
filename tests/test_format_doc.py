"""docs/FORMAT.md against marlin.packing: the worked example's numbers are recomputed here and must
equal both the values hardcoded below and the text of the doc, so that doc and code cannot drift."""

from pathlib import Path

import pytest
import torch

from marlin import packing

DOC = Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md"

LANES = (0, 1, 4, 31)

# Output 2 of the worked example: tile words 4 t .. 4 t + 3 (unsigned) for
# q = (k + n + n // 16) % 16 - 8 on one 16 x 64 tile.
EXPECTED_WORDS = {
    0: (0x19910880, 0x2AA21991, 0x3BB32AA2, 0x4CC43BB3),
    1: (0x3BB32AA2, 0x4CC43BB3, 0x5DD54CC4, 0x6EE65DD5),
    4: (0x2AA21991, 0x3BB32AA2, 0x4CC43BB3, 0x5DD54CC4),
    31: (0xE66ED55D, 0xF77FE66E, 0x0880F77F, 0x19910880),
}

# Output 1 for lane 0: (k, n) of nibbles p = 0..7 of word 0.
EXPECTED_LANE0_WORD0 = [(0, 0), (8, 0), (0, 8), (8, 8), (1, 0), (9, 0), (1, 8), (9, 8)]

# Output 3: dequant_int4x8 of lane 0, word 0 -> (t0, t1, t2, t3) bits and the q pairs they give.
EXPECTED_DEQUANT = [
    (0x64016400, (-8, -7)),
    (0x64906480, (0, 1)),
    (0x64096408, (0, 1)),
    (0x64106400, (-8, -7)),
]

NIBBLE_OF = [packing.INTERLEAVE.index(e) for e in range(8)]


def locate(k, n):
    """The doc's closed formula: weight (k, n) of B is bits shift .. shift+3 of b_q[row, col]."""
    kt, rk, nt, rn = k // 16, k % 16, n // 64, n % 64
    j, half, g = rn // 16, (rn % 16) // 8, rn % 8
    c, r = (rk % 8) // 2, rk % 2 + 2 * (rk // 8)
    t, e = 4 * g + c, 4 * half + r
    return kt, 128 * nt + 4 * t + j, 4 * NIBBLE_OF[e]


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def _kn():
    k = torch.arange(16).view(16, 1).expand(16, 64)
    n = torch.arange(64).view(1, 64).expand(16, 64)
    return k, n


def _words(q: torch.Tensor) -> list[int]:
    b_q, _ = packing.pack(q.to(torch.int8), torch.ones(1, 64, dtype=torch.float16))
    assert b_q.shape == (1, 128) and b_q.dtype == torch.int32
    return [w & 0xFFFFFFFF for w in b_q.view(-1).tolist()]


def _nibbles(q: torch.Tensor) -> list[list[list[int]]]:
    w = _words(q)
    return [[[(w[4 * t + j] >> (4 * p)) & 0xF for p in range(8)] for j in range(4)] for t in range(32)]


def _where():
    """[lane][word][nibble] -> (k, n), recovered through pack alone, as in the doc's snippet."""
    k, n = _kn()
    kk = _nibbles(k - 8)
    lo, hi = _nibbles(n % 16 - 8), _nibbles(n // 16 - 8)
    return [[[(kk[t][j][p], lo[t][j][p] + 16 * hi[t][j][p]) for p in range(8)] for j in range(4)] for t in range(32)]


def test_worked_example_words(doc):
    k, n = _kn()
    w = _words((k + n + n // 16) % 16 - 8)
    for t in LANES:
        got = tuple(w[4 * t + j] for j in range(4))
        assert got == EXPECTED_WORDS[t], (t, [hex(x) for x in got])
        line = f"lane {t:2d}: " + " ".join(f"0x{x:08x}" for x in got)
        assert line in doc, f"docs/FORMAT.md lacks the line {line!r}"


def test_worked_example_positions(doc):
    where = _where()
    assert where[0][0] == EXPECTED_LANE0_WORD0
    for t in LANES:
        cells = [" ".join(f"{kk},{nn}" for kk, nn in where[t][j]) for j in range(4)]
        row = f"| {t} | " + " | ".join(cells) + " |"
        assert row in doc, f"docs/FORMAT.md lacks the table row {row!r}"
    # and the whole tile follows the fragment rule stated in the doc
    for t in range(32):
        g, c = divmod(t, 4)
        for j in range(4):
            for p in range(8):
                e = packing.INTERLEAVE[p]
                rows = (2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9)
                assert where[t][j][p] == (rows[e % 4], 16 * j + 8 * (e // 4) + g), (t, j, p)


def test_worked_example_dequant(doc):
    k, n = _kn()
    x = _words((k + n + n // 16) % 16 - 8)[0]
    steps = [(x, 0x000F000F, True), (x, 0x00F000F0, False), (x >> 8, 0x000F000F, True), (x >> 8, 0x00F000F0, False)]
    for i, ((src, mask, sub), (bits, pair)) in enumerate(zip(steps, EXPECTED_DEQUANT)):
        t = (src & mask) | 0x64006400
        assert t == bits, (i, hex(t))
        v = torch.tensor([t], dtype=torch.int64).to(torch.int32).view(torch.float16).tolist()
        r = [a - 1032 for a in v] if sub else [a / 16 - 72 for a in v]
        assert tuple(r) == pair, (i, r)
        assert f"t{i} = 0x{t:08x}" in doc


def test_dequant_gives_fragments_for_every_word():
    # The doc's claim: (t0, t1) is {b0,b1},{b2,b3} of n8 block 2j, (t2, t3) of block 2j + 1.
    q = torch.randint(-8, 8, (16, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    w = _words(q)
    for t in range(32):
        g, c = divmod(t, 4)
        rows = [2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9]
        for j in range(4):
            x = w[4 * t + j]
            vals = []
            for src, mask, sub in [(x, 0x000F000F, True), (x, 0x00F000F0, False), (x >> 8, 0x000F000F, True),
                                   (x >> 8, 0x00F000F0, False)]:
                h = (src & mask) | 0x64006400
                lo16, hi16 = h & 0xFFFF, h >> 16
                for m in (lo16, hi16):
                    vals.append((m & 0x3FF) - 8 if sub else (m & 0x3FF) // 16 - 8)
            want = [int(q[r, 16 * j + g]) for r in rows] + [int(q[r, 16 * j + 8 + g]) for r in rows]
            assert vals == want, (t, j)


def test_locate_formula(doc):
    assert "locate(17, 70) = (1, 224, 16)" in doc
    assert locate(17, 70) == (1, 224, 16)
    assert NIBBLE_OF == [0, 4, 1, 5, 2, 6, 3, 7]
    gen = torch.Generator().manual_seed(0)
    k, n = 48, 192
    q = torch.randint(-8, 8, (k, n), dtype=torch.int8, generator=gen)
    b_q, _ = packing.pack(q, torch.ones(1, n, dtype=torch.float16))
    words = b_q.tolist()
    for kk in range(k):
        for nn in range(n):
            row, col, shift = locate(kk, nn)
            assert ((words[row][col] >> shift) & 0xF) - 8 == q[kk, nn], (kk, nn)


def test_scale_table(doc):
    s = packing.permute_scales(torch.arange(64).repeat(2, 1).half())[0].int().view(8, 8)
    for i in range(8):
        assert s[i].tolist() == [i + 8 * m for m in range(8)]
        row = f"| {i} | {4 * i}..{4 * i + 3} | " + " | ".join(str(v) for v in s[i].tolist()) + " |"
        assert row in doc, f"docs/FORMAT.md lacks the table row {row!r}"
    # one group keeps natural order
    one = torch.arange(64).view(1, 64).half()
    assert torch.equal(packing.permute_scales(one), one)


def test_doc_constants(doc):
    assert packing.INTERLEAVE == (0, 2, 4, 6, 1, 3, 5, 7)
    assert "INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)" in doc
    assert packing.TILE_K == 16 and packing.TILE_N == 64
    assert packing.SUPPORTED_GROUP_SIZES == (32, 64, 128, -1)
    assert "SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)" in doc
    assert packing.group_size_of(256, 1) == -1 and packing.group_size_of(256, 2) == 128


# -- 8-bit weights and zero points (sections 3b and 4) ----------------------------------------------
EXPECTED_WORDS_8 = {
    0: (0x90108000, 0x98188808, 0xA0209010, 0xA8289818, 0xB030A020, 0xB838A828, 0xC040B030, 0xC848B838),
    1: (0xB030A020, 0xB838A828, 0xC040B030, 0xC848B838, 0xD050C040, 0xD858C848, 0xE060D050, 0xE868D858),
    4: (0x91118101, 0x99198909, 0xA1219111, 0xA9299919, 0xB131A121, 0xB939A929, 0xC141B131, 0xC949B939),
    31: (0xF777E767, 0xFF7FEF6F, 0x0787F777, 0x0F8FFF7F, 0x17970787, 0x1F9F0F8F, 0x27A71797, 0x2FAF1F9F),
}


def locate8(k, n):
    """The doc's closed formula for 8 bits: weight (k, n) is bits shift .. shift+7 of b_q[row, col]."""
    kt, rk, nt, rn = k // 16, k % 16, n // 64, n % 64
    j, half, g = rn // 16, (rn % 16) // 8, rn % 8
    c, r = (rk % 8) // 2, rk % 2 + 2 * (rk // 8)
    t = 4 * g + c
    return kt, 256 * nt + 8 * t + 2 * j + half, 8 * packing.INTERLEAVE_8.index(r)


def prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte sel[i] of the 8 bytes {b, a}."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(pool[(sel >> (4 * i)) & 0x7] << (8 * i) for i in range(4))


def _words8():
    k, n = _kn()
    b_q, _ = packing.pack(((16 * k + n) % 256 - 128).to(torch.int8), torch.ones(1, 64, dtype=torch.float16), bits=8)
    assert b_q.shape == (1, 256)
    return [w & 0xFFFFFFFF for w in b_q.view(-1).tolist()]


def test_8bit_worked_example(doc):
    assert packing.INTERLEAVE_8 == (0, 2, 1, 3) and "INTERLEAVE_8 = (0, 2, 1, 3)" in doc
    w = _words8()
    for t in LANES:
        got = tuple(w[8 * t + i] for i in range(8))
        assert got == EXPECTED_WORDS_8[t], (t, [hex(x) for x in got])
        line = f"lane {t:2d}: " + " ".join(f"0x{x:08x}" for x in got)
        assert line in doc, f"docs/FORMAT.md lacks the line {line!r}"
    for sel, bits, pair in [(0x5250, 0x64106400, (-128, -112)), (0x5351, 0x64906480, (0, 16))]:
        h = prmt(w[0], 0x64646464, sel)
        assert h == bits
        v = torch.tensor([h], dtype=torch.int64).to(torch.int32).view(torch.float16).tolist()
        assert tuple(a - 1152 for a in v) == pair
        assert f"prmt(w, 0x64646464, 0x{sel:04x}) = 0x{h:08x}" in doc


def test_8bit_prmt_gives_fragments_for_every_word():
    q = torch.randint(-128, 128, (16, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    b_q, _ = packing.pack(q, torch.ones(1, 64, dtype=torch.float16), bits=8)
    w = [x & 0xFFFFFFFF for x in b_q.view(-1).tolist()]
    for t in range(32):
        g, c = divmod(t, 4)
        rows = [2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9]
        for j in range(4):
            for h in range(2):
                x = w[8 * t + 2 * j + h]
                vals = []
                for sel in (0x5250, 0x5351):
                    r = prmt(x, 0x64646464, sel)
                    vals += [((r >> s) & 0x3FF) - 128 for s in (0, 16)]  # fp16 1024 + u -> u - 128
                assert vals == [int(q[r, 16 * j + 8 * h + g]) for r in rows], (t, j, h)


def test_locate8_formula(doc):
    assert "locate8(17, 70) = (1, 448, 16)" in doc and locate8(17, 70) == (1, 448, 16)
    k, n = 32, 128
    q = torch.randint(-128, 128, (k, n), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    b_q, _ = packing.pack(q, torch.ones(1, n, dtype=torch.float16), bits=8)
    words = b_q.tolist()
    for kk in range(k):
        for nn in range(n):
            row, col, shift = locate8(kk, nn)
            assert ((words[row][col] >> shift) & 0xFF) - 128 == q[kk, nn], (kk, nn)


def test_zero_point_worked_example(doc):
    col = torch.cat([torch.tensor([-0.2, 0.0, 0.13, 0.55]), torch.linspace(-0.15, 0.5, 28)])
    q, s, z = packing.quantize(col.view(32, 1).repeat(1, 64), 32, sym=False)
    assert s[0, 0].item() == 0.04998779296875 and z[0, 0].item() == 4.0
    assert q[:4, 0].tolist() == [0, 4, 7, 15]
    deq = packing.dequantize(q, s, z)[:4, 0].tolist()
    assert [f"{v:.8f}".rstrip("0").rstrip(".") for v in deq] == ["-0.19995117", "0", "0.14996338", "0.54986572"]
    assert "scale = fp16(0.75 / 15) = 0.04998779296875       zero = round(0.2 / scale) = 4" in doc
    assert "B'    = scale * (u - 4) = -0.19995117  0.0  0.14996338  0.54986572" in doc
    zz = (torch.arange(64) % 16).repeat(2, 1).half()
    stored = [int(v) for v in packing.permute_scales(zz)[0, :16].tolist()]
    assert ", ".join(map(str, stored)) in doc
