"""The prefill kernel's stream-K piece arithmetic (csrc/cuda/prefill/prefill_kernel.cuh, restated
here formula for formula) on random (tiles, stages per tile, grid) cases: every stage of every
tile runs exactly once, a block needs no more than the kernel's `sk_pieces` units, a cut tile's
parts are its consecutive blocks from the one holding its first stage, and their partial slots
(2 f + j) are distinct and below the 2 x grid slots the planner allocates. The GPU tests run the
kernel itself with every tile forced onto stream-K (tests/test_gemm_cuda_prefill.py)."""

import random


def _pieces(tiles, k_tiles, grid):
    """Every (block, tile, kt0, kt1, lock, part) the kernel's unit_at gives, and its sk_pieces."""
    stages = tiles * k_tiles
    sk_pieces = ((stages + grid - 1) // grid + k_tiles - 2) // k_tiles + 1
    start_of = lambda b: stages * b // grid  # noqa: E731  (sk_start)
    block_of = lambda st: ((st + 1) * grid - 1) // stages  # noqa: E731  (sk_block_of)
    out = []
    for u in range((sk_pieces + 1) * grid):  # one unit past the kernel's, to see that it is empty
        b, j = u % grid, u // grid
        s0, s1 = start_of(b), start_of(b + 1)
        start = s0 if j == 0 else (s0 // k_tiles + j) * k_tiles
        if start >= s1:
            continue
        assert j < sk_pieces, (tiles, k_tiles, grid, b, j)
        tile = start // k_tiles
        t0 = tile * k_tiles
        kt0, kt1 = start - t0, min(s1, t0 + k_tiles) - t0
        lock = part = -1
        if kt0 > 0 or kt1 < k_tiles:
            lock = block_of(t0)
            part = b - lock
            parts = block_of(t0 + k_tiles - 1) - lock + 1  # unit_parts
            assert 0 <= part < parts
        out.append((b, tile, kt0, kt1, lock, part))
    return out


def test_stream_k_pieces():
    rng = random.Random(0)
    cases = 0
    while cases < 1500:
        grid = rng.choice([1, 2, 3, 7, 66, 114, 132, 133])
        k_tiles = rng.choice([1, 2, 3, 16, 64, 86, 128, 172, 448])
        tiles = rng.randint(1, 3 * grid + 5)
        if tiles * k_tiles < grid or tiles * k_tiles * grid >= 2**31:  # the planner's conditions
            continue
        cases += 1
        covered = [0] * (tiles * k_tiles)
        slots, cut = {}, {}
        for b, tile, kt0, kt1, lock, part in _pieces(tiles, k_tiles, grid):
            for kt in range(kt0, kt1):
                covered[tile * k_tiles + kt] += 1
            if lock >= 0:
                slot = 2 * lock + part
                assert slot < 2 * grid and lock < grid
                assert slot not in slots and (tile, part) not in cut, (tiles, k_tiles, grid, tile, part)
                slots[slot] = tile
                cut[(tile, part)] = b
        assert covered == [1] * (tiles * k_tiles), (tiles, k_tiles, grid)
        by_tile = {}
        for (tile, part), b in cut.items():
            by_tile.setdefault(tile, []).append((part, b))
        for tile, ps in by_tile.items():  # parts 0..P-1 on consecutive blocks
            ps.sort()
            assert [p for p, _ in ps] == list(range(len(ps))) and len(ps) >= 2
            assert [b for _, b in ps] == list(range(ps[0][1], ps[0][1] + len(ps)))
