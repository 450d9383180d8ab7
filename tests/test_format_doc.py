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
