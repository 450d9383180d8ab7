"""The prefill kernel's schedule rules (csrc/cuda/prefill/prefill.cu), restated in Python for the
GPU tests that check the plans the planners log: the K split of a last round of few tiles, and the
tile height (128 or 256 rows) by the round-cost model of prefill_pick_tile_m."""

TILE_N, TILE_K = 128, 64
MAX_PARTS, MIN_PART_STAGES = 4, 16
UNIT_FIXED_STAGES, SHORT_STAGE_COST, SPLIT_STAGES = 4.0, 0.6, 16.0


def tiles(m: int, n: int, tile_m: int) -> int:
    return -(-m // tile_m) * (n // TILE_N)


def split(m: int, k: int, n: int, sms: int, tile_m: int = 256) -> tuple[int, int]:
    """(parts, first split tile) of the default schedule; (1, tiles) without a split."""
    t = tiles(m, n, tile_m)
    left = t % sms
    parts = min(MAX_PARTS, sms // left, k // TILE_K // MIN_PART_STAGES) if left and 2 * left <= sms else 1
    return (parts, t - left) if parts > 1 else (1, t)


def cost(m: int, k: int, n: int, sms: int, tile_m: int) -> float:
    t = tiles(m, n, tile_m)
    parts, first = split(m, k, n, sms, tile_m)
    stage = SHORT_STAGE_COST if tile_m == 128 else 1.0
    k_tiles = k // TILE_K
    whole = first if parts > 1 else t
    c = (whole // sms) * (UNIT_FIXED_STAGES + k_tiles * stage)
    if parts > 1:
        c += UNIT_FIXED_STAGES + (k_tiles / parts + SPLIT_STAGES) * stage
    elif whole % sms:
        c += UNIT_FIXED_STAGES + k_tiles * stage
    return c


def tile_m(m: int, k: int, n: int, sms: int) -> int:
    """The default tile height: 128 below 256 rows, else the cheaper schedule."""
    if m < 256:
        return 128
    return 128 if cost(m, k, n, sms, 128) < cost(m, k, n, sms, 256) else 256


def pays(m: int, k: int, n: int, sms: int, min_fill: float) -> bool:
    """Whether the planner takes the prefill kernel by default (prefill_pays at the rule's height)."""
    tm = tile_m(m, k, n, sms)
    t = tiles(m, n, tm)
    rounds = t // sms + (1.0 / split(m, k, n, sms, tm)[0] if t % sms else 0.0)  # a split last round: 1 / parts
    return m >= (65 if tm == 128 else 256) and t >= min_fill * rounds * sms
