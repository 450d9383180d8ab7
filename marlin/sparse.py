"""Executable specification of the 2:4-sparse Marlin weight format (Sparse-MARLIN).

A 2:4-sparse B [K, N] has at most two non-zeros in every group of four consecutive rows of K
(rows 4i .. 4i + 3) of each column. Such a matrix is stored as its two kept values per group and
their positions:

  * values  q_c [K / 2, N]: compressed row 2i and 2i + 1 hold the kept values of group i, the one
    at the lower position first. A group with fewer than two non-zeros keeps zeros at its lowest
    free positions, so that every group names two distinct positions (the tensor cores need
    that).
  * indices   [K / 2, N] in 0..3: the position inside the group of each kept value.

The sparse tensor-core instruction ``mma.sp.m16n8k32`` takes the sparse matrix as its left
operand, so the kernel computes C^T = B^T A^T: 16 columns of N by 32 rows of K per instruction.
Its left fragment of the compressed 16 x 16 block is, lane for lane, the fragment that
marlin.packing's dense tile gives a lane (columns g and g + 8, compressed rows 2c, 2c + 1,
2c + 8, 2c + 9; g = lane // 4, c = lane % 4). So:

  * ``b_q`` = the dense Marlin packing of q_c: int32 [K / 32, 2 N] (marlin.packing.pack of the
    compressed [K / 2, N] matrix; nothing new to learn).
  * ``b_scales``: the dense group structure along the *original* K, unchanged: fp16 or bf16
    (the activations' dtype) [K / group_size, N] permuted as marlin.packing.permute_scales does
    (group_size 128, 64 or 32), or [1, N] per column.
  * ``b_zeros`` (optional, asymmetric weights): the integer zero points z in 0..15 in exactly the
    shape, dtype and layout of ``b_scales``, as for the dense format. A kept value is then
    (u - z) * s with u its stored nibble (without zero points: (u - 8) * s). Pruned positions are
    exact zeros whatever z is: they are not stored, and the sparse tensor cores skip them.
  * ``b_meta`` int32 [K / 32, N]: the 2-bit indices, arranged so that each lane reads its
    metadata for one 32-row strip of a 64-column tile as one 8-byte load. A group's two indices
    form a nibble ``i0 | i1 << 2`` (i0 < i1). For strip s, tile nt and lane t = 4 g + c, the two
    words ``b_meta[s, 64 nt + 2 t + r]`` (r = 0, 1) hold the metadata of 16-column block
    j = 2 (c // 2) + r of the tile: bits 4 p .. 4 p + 3 (p = 0..3) are the nibble of group
    4 (c % 2) + p of the strip in column 16 j + g, bits 16 + 4 p .. the same group in column
    16 j + 8 + g. This is the register ``mma.sp`` expects from the lanes that supply metadata:
    lanes with c = 0, 1 supply blocks 0 and 1 (sparsity selector 0), lanes with c = 2, 3 blocks
    2 and 3 (selector 1); the first of each pair covers K rows 0..15 of the strip, the second
    rows 16..31; the low half is row g of the fragment, the high half row g + 8. No lane's
    load is wasted: 2 bits per kept value, 256 bytes per 32 x 64 strip tile.

Quantization is marlin.packing.quantize (round to nearest) of the pruned matrix, with its group
scales over the original rows: symmetric (zeros stay zero, q = 0) or, with ``sym=False``, with
zero points, whose range always includes 0 (a pruned zero quantizes to u = z exactly). The
positions come from the pruned weight, and a kept value is stored as its nibble u (for symmetric
weights u = q + 8). A group with fewer than two kept values names filler positions holding the
value that dequantizes to 0 (u = z, or q = 0). docs/FORMAT.md ("2:4 sparse") has a worked example;
csrc/cpu/gemm_2_4_cpu.cpp reads this layout for the CPU reference op.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from . import packing

__all__ = [
    "K_MULTIPLE_2_4",
    "N_MULTIPLE_2_4",
    "SUPPORTED_GROUP_SIZES_2_4",
    "DTYPES_2_4",
    "mask_2_4",
    "prune_2_4",
    "violations_2_4",
    "check_2_4",
    "compress_2_4",
    "decompress_2_4",
    "pack_meta",
    "unpack_meta",
    "quantize_and_pack_2_4",
    "pack_2_4",
    "unpack_2_4_parts",
    "unpack_2_4",
    "check_shape_2_4",
]

# What torch.ops.marlin.gemm_2_4 accepts (must match csrc/gemm_2_4_checks.h). The packing
# itself only needs K % 32 (one strip) and N % 64 (one tile); the op takes K in whole groups of
# 128 (one stage) and N in whole 64-column tiles, as the dense op does (tensor-parallel shards of
# real models have N % 128 == 64).
K_MULTIPLE_2_4 = 128
N_MULTIPLE_2_4 = 64
SUPPORTED_GROUP_SIZES_2_4 = (128, 64, 32, -1)  # -1: per column; each divides K_MULTIPLE_2_4
DTYPES_2_4 = (torch.float16, torch.bfloat16)  # activations, scales and output (one dtype per call)
STRIP_K = 32  # rows of the original K per packed row of b_q and b_meta

# The nibble of each valid (i0, i1) pair, and the pairs that a nibble may hold.
_VALID_NIBBLES = (0b0100, 0b1000, 0b1100, 0b1001, 0b1101, 0b1110)


def _check_2d_float(w: torch.Tensor, what: str) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{what}: w must be a 2-D float tensor [K, N], got {shape}")
    if w.shape[0] % 4:
        raise ValueError(f"{what}: K = {w.shape[0]} is not a multiple of 4 (2:4 groups run along K)")


def mask_2_4(w: torch.Tensor) -> torch.Tensor:
    """Bool [K, N]: the two largest magnitudes of every group of 4 rows of each column (ties: the
    lower row)."""
    _check_2d_float(w, "mask_2_4")
    k, n = w.shape
    mag = w.detach().abs().float().reshape(k // 4, 4, n)
    # stable order: sort by magnitude descending; equal magnitudes keep the lower row first
    order = torch.sort(mag, dim=1, descending=True, stable=True).indices
    mask = torch.zeros_like(mag, dtype=torch.bool)
    mask.scatter_(1, order[:, :2], True)
    return mask.reshape(k, n)


def prune_2_4(w: torch.Tensor) -> torch.Tensor:
    """Magnitude pruning to 2:4 along K: keeps the two largest |w| of every 4 rows of a column."""
    return torch.where(mask_2_4(w), w, torch.zeros((), dtype=w.dtype, device=w.device))


def violations_2_4(w: torch.Tensor) -> torch.Tensor:
    """The columns of w [K, N] with more than two non-zeros in some group of 4 rows (int64, sorted)."""
    _check_2d_float(w, "violations_2_4")
    k, n = w.shape
    nnz = (w.detach() != 0).reshape(k // 4, 4, n).sum(dim=1)  # [K/4, N]
    return torch.nonzero((nnz > 2).any(dim=0)).flatten()


def check_2_4(w: torch.Tensor, name: str = "w") -> None:
    """ValueError naming the columns (and one offending group of each) that break 2:4 along K."""
    bad = violations_2_4(w)
    if bad.numel() == 0:
        return
    k, n = w.shape
    nnz = (w.detach() != 0).reshape(k // 4, 4, n).sum(dim=1)
    shown = []
    for col in bad[:8].tolist():
        grp = int(torch.nonzero(nnz[:, col] > 2)[0])
        shown.append(f"column {col} (rows {4 * grp}..{4 * grp + 3} hold {int(nnz[grp, col])} non-zeros)")
    more = f" and {bad.numel() - 8} more columns" if bad.numel() > 8 else ""
    raise ValueError(
        f"{name} [K={k}, N={n}] is not 2:4 sparse along K (at most 2 non-zeros in every 4 consecutive rows "
        f"of a column): {bad.numel()} of {n} columns break it: " + ", ".join(shown) + more +
        ". Prune it first (marlin.sparse.prune_2_4)."
    )


def compress_2_4(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2:4 q [K, N] (any dtype; zeros are pruned) -> (values [K/2, N], indices int8 [K/2, N]).

    The non-zeros of each group first, then zeros at the lowest free positions; the pair sorted
    by position. Raises ValueError if a group has more than two non-zeros.
    """
    if q.dim() != 2 or q.shape[0] % 4:
        raise ValueError(f"compress_2_4: q must be 2-D [K, N] with K a multiple of 4, got {tuple(q.shape)}")
    check_2_4(q.float() if not q.is_floating_point() else q, "compress_2_4: q")
    k, n = q.shape
    keep = _positions_2_4(q != 0)
    values = torch.gather(q.reshape(k // 4, 4, n), 1, keep)
    return values.reshape(k // 2, n), keep.to(torch.int8).reshape(k // 2, n)


def _positions_2_4(nonzero: torch.Tensor) -> torch.Tensor:
    """The two positions int64 [K/4, 2, N] (ascending) that each group of 4 rows of the bool
    [K, N] ``nonzero`` names: its True rows first (at most two: checked by the callers), then the
    lowest free rows."""
    k, n = nonzero.shape
    pos = torch.arange(4, device=nonzero.device).view(1, 4, 1)
    # non-zeros first (8 + ...), then the lower position first (3 - pos)
    score = nonzero.reshape(k // 4, 4, n).to(torch.int64) * 8 + (3 - pos)
    return torch.topk(score, 2, dim=1).indices.sort(dim=1).values


def decompress_2_4(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Inverse of compress_2_4: values [K/2, N] at positions indices [K/2, N] -> dense [K, N]."""
    if values.shape != indices.shape or values.dim() != 2 or values.shape[0] % 2:
        raise ValueError(
            f"decompress_2_4: values {tuple(values.shape)} and indices {tuple(indices.shape)} must both be [K/2, N]"
        )
    k2, n = values.shape
    idx = indices.to(torch.int64).reshape(k2 // 2, 2, n)
    if int(idx.min()) < 0 or int(idx.max()) > 3 or bool((idx[:, 0] >= idx[:, 1]).any()):
        raise ValueError("decompress_2_4: each group's two indices must be distinct positions 0..3 in increasing order")
    dense = torch.zeros(k2 // 2, 4, n, dtype=values.dtype, device=values.device)
    dense.scatter_(1, idx, values.reshape(k2 // 2, 2, n))
    return dense.reshape(2 * k2, n)


@lru_cache(maxsize=None)
def _meta_order() -> torch.Tensor:
    """For (word w = 2 t + r of a strip tile, nibble p = 0..7): flat index go * 64 + col of the
    group go (0..7 in the strip) and tile column col whose index nibble sits there."""
    order = []
    for lane in range(32):
        g, c = divmod(lane, 4)
        for r in range(2):
            j = 2 * (c // 2) + r  # the 16-column block
            for p in range(8):
                go = 4 * (c % 2) + p % 4
                col = 16 * j + g + 8 * (p // 4)
                order.append(go * 64 + col)
    perm = torch.tensor(order, dtype=torch.long)
    assert torch.equal(perm.sort().values, torch.arange(8 * 64)), "meta order is not a permutation"
    return perm


def _check_strips(k: int, n: int, what: str) -> None:
    if k <= 0 or k % STRIP_K:
        raise ValueError(f"{what}: K = {k}, expected a positive multiple of {STRIP_K} (one packed strip of the 2:4 format)")
    if n <= 0 or n % packing.TILE_N:
        raise ValueError(f"{what}: N = {n}, expected a positive multiple of {packing.TILE_N} (the packed tile width)")


def pack_meta(indices: torch.Tensor) -> torch.Tensor:
    """indices int [K/2, N] (positions of the kept values, see compress_2_4) -> b_meta int32 [K/32, N]."""
    if indices.dim() != 2:
        raise ValueError(f"pack_meta: indices must be 2-D [K/2, N], got {tuple(indices.shape)}")
    k, n = 2 * indices.shape[0], indices.shape[1]
    _check_strips(k, n, "pack_meta")
    idx = indices.to(torch.int64).reshape(k // 4, 2, n)
    nib = idx[:, 0] | (idx[:, 1] << 2)  # [K/4, N]
    tiles = nib.reshape(k // STRIP_K, 8, n // 64, 64).permute(0, 2, 1, 3).reshape(k // STRIP_K, n // 64, 512)
    slots = tiles[..., _meta_order().to(nib.device)].reshape(k // STRIP_K, n // 64, 64, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=nib.device)
    words = (slots << shifts).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.reshape(k // STRIP_K, n).contiguous()


def unpack_meta(b_meta: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_meta: b_meta int32 [K/32, N] -> indices int8 [K/2, N]. ValueError on a nibble
    that is not a valid pair (two distinct positions, the lower first)."""
    if b_meta.dim() != 2 or b_meta.dtype != torch.int32:
        raise ValueError(f"unpack_meta: b_meta must be int32 [K/32, N], got {tuple(b_meta.shape)} {b_meta.dtype}")
    k, n = b_meta.shape[0] * STRIP_K, b_meta.shape[1]
    _check_strips(k, n, "unpack_meta")
    words = (b_meta.to(torch.int64) & 0xFFFFFFFF).reshape(k // STRIP_K, n // 64, 64, 1)
    slots = ((words >> torch.arange(0, 32, 4, dtype=torch.int64, device=b_meta.device)) & 0xF)
    slots = slots.reshape(k // STRIP_K, n // 64, 512)
    tiles = torch.empty_like(slots)
    tiles[..., _meta_order().to(b_meta.device)] = slots
    nib = tiles.reshape(k // STRIP_K, n // 64, 8, 64).permute(0, 2, 1, 3).reshape(k // 4, n)
    valid = torch.tensor(_VALID_NIBBLES, device=nib.device)
    if not bool(torch.isin(nib, valid).all()):
        bad = torch.nonzero(~torch.isin(nib, valid))[0].tolist()
        raise ValueError(
            f"unpack_meta: b_meta holds index nibble {int(nib[bad[0], bad[1]]):#06b} for rows "
            f"{4 * bad[0]}..{4 * bad[0] + 3} of column {bad[1]}; expected two distinct positions, the lower "
            f"first (one of {[bin(v) for v in _VALID_NIBBLES]})"
        )
    idx = torch.stack([nib & 3, nib >> 2], dim=1)  # [K/4, 2, N]
    return idx.reshape(k // 2, n).to(torch.int8)


def check_shape_2_4(in_features: int, out_features: int, group_size: int) -> Optional[str]:
    """None if gemm_2_4 takes B [K=in_features, N=out_features] with this group size, else why not."""
    if group_size not in SUPPORTED_GROUP_SIZES_2_4:
        return f"group_size = {group_size}, expected one of {SUPPORTED_GROUP_SIZES_2_4} (-1: per column)"
    if in_features <= 0 or in_features % K_MULTIPLE_2_4:
        return f"in_features = {in_features}, expected a positive multiple of {K_MULTIPLE_2_4}"
    if out_features <= 0 or out_features % N_MULTIPLE_2_4:
        return f"out_features = {out_features}, expected a positive multiple of {N_MULTIPLE_2_4}"
    return None


def quantize_and_pack_2_4(w: torch.Tensor, group_size: int = 128, dtype: torch.dtype = torch.float16, sym: bool = True):
    """Quantize and pack a 2:4-sparse B [K, N] (float) for torch.ops.marlin.gemm_2_4.

    ``w`` must already be 2:4 along K (ValueError naming the columns that are not; prune with
    prune_2_4). Returns (b_q int32 [K/32, 2N], b_meta int32 [K/32, N], b_scales [groups, N] of
    ``dtype``, float16 or bfloat16: the dtype the op then computes in) or, with ``sym=False``,
    (b_q, b_meta, b_scales, b_zeros), b_zeros the integer zero points in b_scales' shape, dtype
    and layout (pass it to the op as ``b_zeros``). The scales (and zero points) are
    marlin.packing.quantize's, over groups of ``group_size`` original rows (the op takes 128, 64,
    32 or -1, per column: SUPPORTED_GROUP_SIZES_2_4). With zero points the positions are those
    of w's non-zeros, also where a kept weight quantizes to its zero point (it then dequantizes to
    0 like the pruned ones, so the product is the same either way).
    """
    _check_2d_float(w, "quantize_and_pack_2_4")
    k, n = w.shape
    _check_strips(k, n, "quantize_and_pack_2_4")
    check_2_4(w, "quantize_and_pack_2_4: w")
    if dtype not in DTYPES_2_4:
        raise ValueError(f"quantize_and_pack_2_4: dtype = {dtype}, expected torch.float16 or torch.bfloat16")
    if not isinstance(sym, bool):
        raise ValueError(f"quantize_and_pack_2_4: sym = {sym!r}, expected True (symmetric) or False (zero points)")
    if sym:
        q, scales = packing.quantize(w, group_size, dtype=dtype)
        return pack_2_4(q, scales)
    # packing.quantize's range includes 0, so the pruned zeros quantize to u = z exactly
    u, scales, zeros = packing.quantize(w, group_size, sym=False, dtype=dtype)
    return _pack_2_4_zeros(u, scales, zeros, w.detach() != 0)


def _check_scales_2_4(name: str, t: torch.Tensor, k: int, n: int, what: str) -> int:
    """Rows of scales (or zeros) t, which must be [groups, N] with K / groups a multiple of 4 (whole
    2:4 groups of rows in each); ValueError otherwise."""
    if t.dim() != 2 or t.shape[1] != n or t.shape[0] < 1 or k % t.shape[0] or (k // t.shape[0]) % 4:
        raise ValueError(
            f"{what}: {name} {tuple(t.shape)}, expected [groups, {n}] with K / groups a multiple of 4 (K = {k})"
        )
    return t.shape[0]


def pack_2_4(q: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor] = None):
    """Pack an already quantized 2:4 layer (e.g. from a quantizer that chose its own scales:
    marlin-quantize) in natural order.

    Symmetric (``zeros`` None): q int8 [K, N] in -8..7, pruned values 0, and its scales
    [groups, N] (float16 or bfloat16, the dtype the op computes in) -> (b_q, b_meta, b_scales).
    With zero points: q = u, the stored values 0..15 [K, N], equal to the group's zero point z at
    the pruned positions (so that u - z is 2:4), and zeros [groups, N] the integer z (0..15) in
    the scales' dtype -> (b_q, b_meta, b_scales, b_zeros); the positions are the non-zeros of
    u - z. ValueError if q (u - z) is not 2:4 along K.
    """
    if q.dim() != 2:
        raise ValueError(f"pack_2_4: q must be 2-D [K, N], got {tuple(q.shape)}")
    k, n = q.shape
    _check_strips(k, n, "pack_2_4")
    if scales.dtype not in DTYPES_2_4:
        raise ValueError(f"pack_2_4: scales dtype {scales.dtype}, expected torch.float16 or torch.bfloat16")
    groups = _check_scales_2_4("scales", scales, k, n, "pack_2_4")
    if zeros is None:
        values, indices = compress_2_4(q)
        b_q, _ = packing.pack(values, torch.ones(1, n, dtype=torch.float16, device=q.device))
        return b_q, pack_meta(indices), packing.permute_scales(scales)
    if zeros.shape != scales.shape or zeros.dtype != scales.dtype:
        raise ValueError(
            f"pack_2_4: zeros {tuple(zeros.shape)} {zeros.dtype}, expected the scales' shape and dtype "
            f"{tuple(scales.shape)} {scales.dtype}"
        )
    zf = zeros.float()
    bad = ~((zf >= 0) & (zf <= 15) & (zf == zf.round()))
    if bool(bad.any()):
        raise ValueError(f"pack_2_4: zeros holds {float(zf[bad][0])}, expected integer zero points in [0, 15]")
    if q.is_floating_point() or int(q.min()) < 0 or int(q.max()) > 15:
        got = f"{q.dtype}" if q.is_floating_point() else f"[{int(q.min())}, {int(q.max())}]"
        raise ValueError(f"pack_2_4: with zeros, q holds the stored values u, integers in [0, 15]; got {got}")
    d = q.to(torch.int16) - zf.to(torch.int16).repeat_interleave(k // groups, dim=0)
    check_2_4(d.float(), "pack_2_4: q - zeros")
    return _pack_2_4_zeros(q, scales, zeros, d != 0)


def _pack_2_4_zeros(u: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, kept: torch.Tensor):
    """(b_q, b_meta, b_scales, b_zeros) of u [K, N] in 0..15 with natural-order scales and zeros,
    the positions those of the bool [K, N] ``kept`` (2:4, checked by the callers; it must cover
    every u != z). The filler positions of a group with fewer than two kept values hold z."""
    k, n = u.shape
    z_c = zeros.to(torch.int64).repeat_interleave(k // 2 // zeros.shape[0], dim=0)  # [K/2, N], per compressed row
    keep = _positions_2_4(kept)  # [K/4, 2, N]
    named = torch.gather(kept.reshape(k // 4, 4, n), 1, keep).reshape(k // 2, n)
    values = torch.gather(u.to(torch.int64).reshape(k // 4, 4, n), 1, keep).reshape(k // 2, n)
    values = torch.where(named, values, z_c)  # a filler dequantizes to exactly 0
    # packing.pack stores a signed v as the nibble v + 8: give it u - 8 so that the nibble is u
    b_q, _ = packing.pack((values - 8).to(torch.int8), torch.ones(1, n, dtype=torch.float16, device=u.device))
    b_meta = pack_meta(keep.reshape(k // 2, n))
    return b_q, b_meta, packing.permute_scales(scales), packing.permute_scales(zeros)


def unpack_2_4_parts(
    b_q: torch.Tensor, b_meta: torch.Tensor, b_scales: torch.Tensor, b_zeros: Optional[torch.Tensor] = None
):
    """Exact inverse of the packing (pack_2_4, quantize_and_pack_2_4), in natural order:
    (q int8 [K, N] in -8..7 with the pruned zeros in place, scales [groups, N] of b_scales' dtype)
    or, with b_zeros, (u int8 [K, N] in 0..15 holding the group's zero point at the pruned
    positions, scales, zeros [groups, N]); packing.dequantize(*parts) is the weight either way."""
    if b_q.dim() != 2 or b_meta.dim() != 2 or b_q.shape[0] != b_meta.shape[0] or b_q.shape[1] != 2 * b_meta.shape[1]:
        raise ValueError(
            f"unpack_2_4: b_q {tuple(b_q.shape)} and b_meta {tuple(b_meta.shape)} do not fit: expected "
            "b_q [K/32, 2N] and b_meta [K/32, N]"
        )
    values, _ = packing.unpack(b_q, torch.ones(1, b_meta.shape[1], dtype=torch.float16, device=b_q.device))
    indices = unpack_meta(b_meta)
    k, n = 2 * values.shape[0], values.shape[1]
    if b_scales.dim() != 2 or b_scales.shape[1] != n or k % b_scales.shape[0]:
        raise ValueError(f"unpack_2_4: b_scales {tuple(b_scales.shape)}, expected [groups, {n}] with groups dividing K = {k}")
    if b_zeros is None:
        return decompress_2_4(values, indices), packing.unpermute_scales(b_scales)
    if b_zeros.shape != b_scales.shape or b_zeros.dtype != b_scales.dtype:
        raise ValueError(
            f"unpack_2_4: b_zeros {tuple(b_zeros.shape)} {b_zeros.dtype}, expected b_scales' shape and dtype "
            f"{tuple(b_scales.shape)} {b_scales.dtype}"
        )
    rows = k // _check_scales_2_4("b_scales", b_scales, k, n, "unpack_2_4")  # rows per group: whole 2:4 groups
    zeros = packing.unpermute_scales(b_zeros)
    z = zeros.to(torch.int16)
    d_c = values.to(torch.int16) + 8 - z.repeat_interleave(rows // 2, dim=0)  # u - z of the kept values
    u = decompress_2_4(d_c, indices) + z.repeat_interleave(rows, dim=0)  # pruned positions: z
    return u.to(torch.int8), packing.unpermute_scales(b_scales), zeros


def unpack_2_4(
    b_q: torch.Tensor, b_meta: torch.Tensor, b_scales: torch.Tensor, b_zeros: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The dense dequantized B' [K, N] in float32 of a packed 2:4 layer (exact: scale * q, or
    scale * (u - z) with b_zeros, at the kept positions; 0 at the pruned ones)."""
    return packing.dequantize(*unpack_2_4_parts(b_q, b_meta, b_scales, b_zeros))
