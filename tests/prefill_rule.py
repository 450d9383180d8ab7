"""The prefill kernel's schedule rules (csrc/cuda/prefill/prefill.cu), restated in Python for the
GPU tests that check the plans the planners log: the K split of a last round of few tiles, and the
tile height (128 or 256 rows) by the round-cost model of prefill_pick_tile_m."""

TILE_N, TILE_K = 128, 64
MAX_PARTS, MIN_PART_STAGES = 4, 16
STREAM_K, SPLIT_STAGES, STREAM_K_SHARE = -1, 16.0, 0.9  # prefill.h's kPrefillStreamK, kPrefillSplitStages, kPrefillStreamKShare
SPLIT_LEAD = 6  # prefill.h's kPrefillSplitLead
# (fixed stages per unit, a 128-row stage in 256-row ones, a split's chain beyond the last part's
# lead) per kind of call: prefill.cu's kGroupScalesModel, kPerColumnModel, kSparse24Model
GROUP_SCALES_MODEL, PER_COLUMN_MODEL, SPARSE_24_MODEL = (4.0, 0.6, 4.0), (0.0, 0.56, 12.0), (4.0, 0.6, 10.0)


def tiles(m: int, n: int, tile_m: int) -> int:
    return -(-m // tile_m) * (n // TILE_N)


def split(m: int, k: int, n: int, sms: int, tile_m: int = 256) -> tuple[int, int]:
    """(parts, first split tile) of the default schedule; (1, tiles) without a split; (STREAM_K, 0)
    where one round more than half full runs as one stream-K range."""
    t = tiles(m, n, tile_m)
    left = t % sms
    k_tiles = k // TILE_K
    if left and 2 * left > sms:
        share = left * k_tiles / sms
        if tile_m == 128 and t < sms and share >= MIN_PART_STAGES and share + SPLIT_STAGES < STREAM_K_SHARE * k_tiles:
            return (STREAM_K, 0)
        return (1, t)
    parts = min(MAX_PARTS, sms // left, k_tiles // MIN_PART_STAGES) if left else 1
    return (parts, t - left) if parts > 1 else (1, t)


def _model(per_column: bool, sparse24: bool) -> tuple[float, float, float]:
    return SPARSE_24_MODEL if sparse24 else PER_COLUMN_MODEL if per_column else GROUP_SCALES_MODEL


def cost(m: int, k: int, n: int, sms: int, tile_m: int, per_column: bool = False, sparse24: bool = False) -> float:
    fixed, short_stage, chain = _model(per_column, sparse24)
    t = tiles(m, n, tile_m)
    parts, first = split(m, k, n, sms, tile_m)
    stage = short_stage if tile_m == 128 else 1.0
    k_tiles = k // TILE_K
    if parts == STREAM_K:
        return fixed + (t * k_tiles / sms + SPLIT_STAGES) * stage
    whole = first if parts > 1 else t
    c = (whole // sms) * (fixed + k_tiles * stage)
    if parts > 1:
        c += fixed + (k_tiles / parts + SPLIT_LEAD * (1 - 1 / parts) + chain) * stage
    elif whole % sms:
        c += fixed + k_tiles * stage
    return c


def tile_m(m: int, k: int, n: int, sms: int, per_column: bool = False, sparse24: bool = False) -> int:
    """The default tile height: 128 below 256 rows, else the cheaper schedule (the 2:4 op's model
    in every format, per column's for the dense op's per-column formats, else group scales')."""
    if m < 256:
        return 128
    return 128 if cost(m, k, n, sms, 128, per_column, sparse24) < cost(m, k, n, sms, 256, per_column, sparse24) else 256


def pays(m: int, k: int, n: int, sms: int, min_fill: float, per_column: bool = False, sparse24: bool = False) -> bool:
    """Whether the planner takes the prefill kernel by default (prefill_pays at the rule's height)."""
    tm = tile_m(m, k, n, sms, per_column, sparse24)
    t = tiles(m, n, tm)
    parts = split(m, k, n, sms, tm)[0]
    tail = (t % sms) / sms if parts == STREAM_K else 1.0 / parts  # a split last round: 1 / parts; stream-K: as full as it is
    rounds = t // sms + (tail if t % sms else 0.0)
    return m >= (65 if tm == 128 else 256) and t >= min_fill * rounds * sms
