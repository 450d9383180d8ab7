"""Executable specification of the Marlin weight formats.

Everything the kernels assume about the bytes they read is written down here, in plain torch, so
that the formats can be read, tested bit-exactly and produced on any device.  docs/FORMAT.md
explains the same layouts in prose with worked examples.

Notation: the weight matrix is B with shape [K, N] (K = in_features, N = out_features), so that a
layer computes C[M, N] = A[M, K] @ B.  ``nn.Linear.weight`` is B transposed.

Formats (``torch.ops.marlin.gemm(a, b_q, b_scales, b_zeros, ..., bits=...)``):

  =========================  ====  =======  ========================  ======================
  format                     bits  b_zeros  stored value u            weight
  =========================  ====  =======  ========================  ======================
  4-bit symmetric (GPTQ)     4     None     u = q + 8 in [0, 15]      (u - 8) * s = q * s
  4-bit zero points (AWQ)    4     given    u in [0, 15]              (u - z) * s
  8-bit symmetric            8     None     u = q + 128 in [0, 255]   (u - 128) * s = q * s
  =========================  ====  =======  ========================  ======================

  Scales ``s`` (and zero points ``z``) have the activation dtype, float16 or bfloat16; the
  product (u - z) * s is exact in fp32 (a small integer times an 8- or 11-bit mantissa).
  Groups: 32, 64 or 128 consecutive rows of K share a scale (and zero point), or one scale per
  column (group_size -1).  The group size is not stored: it is K / b_scales.shape[0].

Quantization (round to nearest, GPTQ's conventions, ``maxq = 2^bits - 1``):
    symmetric:   s = dtype(2 * max|B| / maxq) over a group, q = clamp(round(B / s), -2^(bits-1), 2^(bits-1) - 1)
    zero points: lo = min(min B, 0), hi = max(max B, 0), s = dtype((hi - lo) / maxq),
                 z = clamp(round(-lo / s), 0, maxq), u = clamp(round(B / s) + z, 0, maxq)
The scale is rounded to its dtype *before* q is computed, so that the dequantized weight is the
closest representable one for the stored scale.  In this module ``q`` is the signed value
(u - 2^(bits-1)) for symmetric formats and the stored unsigned value u for zero-point formats, so
that dequant = (q - z) * s with z = 0 in the symmetric case.

Packing (the paper's section 3, "Maximizing Loading Bandwidth" and "Dequantization"):
  * B is cut into 16 x 64 tiles (16 rows of K, 64 columns of N).  Lane ``t`` of a warp holds the
    weights it needs as the B operand of ``mma.m16n8k16`` for the four 16 x 16 blocks j of the
    tile: rows k = 2c, 2c+1, 2c+8, 2c+9 (c = t % 4) of columns 16j + g and 16j + 8 + g
    (g = t // 4).  Fragment element e = 0..3 are those rows of column 16j + g, e = 4..7 the
    same rows of column 16j + 8 + g.
  * 4 bits: a tile is 128 int32 words; lane t's 16 bytes are words 4t .. 4t + 3, word j holds
    block j's 8 values, fragment element INTERLEAVE[p] in nibble p.  Listing the low 16-bit half
    (nibbles 3..0) and then the high half (nibbles 7..4) gives the paper's "64207531": then
    ``(w & 0x000f000f)`` yields the pair (e0, e1), ``(w & 0x00f000f0)`` yields (e2, e3), and the
    same after ``w >> 8`` yields (e4, e5), (e6, e7): two values per 32-bit operation, already in
    the tensor-core register order.  ``b_q`` is int32 [K / 16, 2 N].
  * 8 bits: a tile is 256 int32 words; lane t's 32 bytes are words 8t .. 8t + 7, word 2j + h
    holds column half h (h = 0: column 16j + g, h = 1: column 16j + 8 + g) of block j, fragment
    element INTERLEAVE_8[p] in byte p, i.e. bytes (e0, e2, e1, e3): one byte permute
    (``prmt`` with selectors 0x5250 / 0x5351 on an fp16 magic number) yields the pair (e0, e1),
    the other (e2, e3).  ``b_q`` is int32 [K / 16, 4 N].
  * Row ``kt`` of ``b_q`` holds the tiles of K rows 16 kt .. 16 kt + 15, tile ``nt`` at words
    W nt .. W nt + W - 1 (W = 128 for 4 bits, 256 for 8 bits).
  * Scales ``b_scales`` [K / group_size, N]: with more than one group, each 64-column chunk is
    permuted so that position 8 i + j holds column i + 8 j: lane t then finds the scales of its
    8 columns (t // 4 + 8 m, m = 0..7) in one 16-byte vector.  With one group (per-column
    quantization) the scales keep natural order (the kernel applies them to the fp32 result).
  * Zero points ``b_zeros`` (4 bits only): the integer z as a value of the scales' dtype, in
    exactly the scales' shape and layout (permuted the same way), so the kernel loads them as it
    loads the scales.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

__all__ = [
    "TILE_K",
    "TILE_N",
    "INTERLEAVE",
    "INTERLEAVE_8",
    "SUPPORTED_GROUP_SIZES",
    "SUPPORTED_BITS",
    "SUPPORTED_DTYPES",
    "quantize",
    "pack",
    "unpack",
    "dequantize",
    "quantize_and_pack",
    "permute_scales",
    "unpermute_scales",
    "num_groups",
    "group_size_of",
    "words_per_column",
]

TILE_K = 16  # rows of K in one packed tile
TILE_N = 64  # columns of N in one packed tile
INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)  # 4 bits: nibble p holds fragment element INTERLEAVE[p]
INTERLEAVE_8 = (0, 2, 1, 3)  # 8 bits: byte p holds fragment element INTERLEAVE_8[p] of its column half
SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)  # what torch.ops.marlin.gemm accepts (-1: per column)
SUPPORTED_BITS = (4, 8)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # activations, scales, zero points, output


def words_per_column(bits: int) -> int:
    """int32 words of b_q per column of B for every 16 rows of K: b_q is [K / 16, words * N]."""
    return 16 * bits // 32


def _bias(bits: int) -> int:
    return 1 << (bits - 1)  # implicit zero point of the symmetric formats: 8 or 128


def num_groups(k: int, group_size: int) -> int:
    """Rows of the scale tensor for K input features: 1 for per-column (-1), else K / group_size."""
    return 1 if group_size == -1 else k // group_size


def group_size_of(k: int, scale_rows: int) -> int:
    """Inverse of num_groups: -1 (per column) when there is a single scale row."""
    return -1 if scale_rows == 1 else k // scale_rows


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits = {bits!r}, expected one of {SUPPORTED_BITS}")


def _check_group_size(k: int, group_size: int) -> None:
    if group_size == -1:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % TILE_K:
        raise ValueError(f"group_size = {group_size!r}, expected -1 (per column) or a positive multiple of {TILE_K}")
    if k % group_size:
        raise ValueError(f"K = {k} is not a multiple of group_size = {group_size}")


def _check_kn(k: int, n: int) -> None:
    if k <= 0 or k % TILE_K:
        raise ValueError(f"K = {k}, expected a positive multiple of {TILE_K} (the packed tile height)")
    if n <= 0 or n % TILE_N:
        raise ValueError(f"N = {n}, expected a positive multiple of {TILE_N} (the packed tile width)")


def _scale_dtype(w: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    if dtype is None:
        return w.dtype if w.dtype in SUPPORTED_DTYPES else torch.float16
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype = {dtype}, expected torch.float16 or torch.bfloat16")
    return dtype


def quantize(w: torch.Tensor, group_size: int = 128, bits: int = 4, sym: bool = True, dtype: Optional[torch.dtype] = None):
    """Round-to-nearest quantization of B [K, N] (float) in groups of ``group_size`` rows (-1: per column).

    Returns ``(q, scales)`` for symmetric formats (q int8 = u - 2^(bits-1)) and
    ``(q, scales, zeros)`` with ``sym=False`` (4 bits only; q int8 = u in [0, 15], zeros integer
    values in [0, 15]).  Scales and zeros are [num_groups, N] in natural order, of ``dtype``
    (default: w's dtype if it is float16 or bfloat16, else float16).
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D float tensor [K, N], got shape {tuple(w.shape)} dtype {w.dtype}")
    _check_bits(bits)
    if not sym and bits != 4:
        raise ValueError(f"sym=False (zero points) with bits = {bits}: zero points are supported for 4-bit weights only")
    sdtype = _scale_dtype(w, dtype)
    k, n = w.shape
    _check_group_size(k, group_size)
    g = num_groups(k, group_size)
    maxq = (1 << bits) - 1
    wf = w.detach().float().reshape(g, k // g, n)
    if sym:
        amax = wf.abs().amax(dim=1)  # [g, N]
        scales = (amax * (2.0 / maxq)).to(sdtype)
    else:
        lo = wf.amin(dim=1).clamp(max=0)
        hi = wf.amax(dim=1).clamp(min=0)
        scales = ((hi - lo) / maxq).to(sdtype)
    # An all-zero group (or one so small that its scale underflows) gets scale 1: its weights are 0.
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    sf = scales.float().unsqueeze(1)
    if sym:
        q = torch.round(wf / sf).clamp_(-_bias(bits), _bias(bits) - 1)
        return q.reshape(k, n).to(torch.int8), scales
    zeros = torch.round(-lo / scales.float()).clamp_(0, maxq)
    u = (torch.round(wf / sf) + zeros.unsqueeze(1)).clamp_(0, maxq)
    return u.reshape(k, n).to(torch.int8), scales, zeros.to(sdtype)


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor] = None) -> torch.Tensor:
    """B = (q - z) * s in float32 (exact), from natural-order q [K, N], scales and zeros [groups, N].

    Without zeros, z = 0 (q is the signed value of a symmetric format)."""
    k, n = q.shape
    g = scales.shape[0]
    if scales.dim() != 2 or scales.shape[1] != n or g < 1 or k % g:
        raise ValueError(f"scales shape {tuple(scales.shape)} does not fit q shape {tuple(q.shape)}")
    s = scales.float().repeat_interleave(k // g, dim=0)
    if zeros is None:
        return q.float() * s
    if zeros.shape != scales.shape:
        raise ValueError(f"zeros shape {tuple(zeros.shape)}, expected the scales' shape {tuple(scales.shape)}")
    return (q.float() - zeros.float().repeat_interleave(k // g, dim=0)) * s


@lru_cache(maxsize=None)
def _tile_order(bits: int = 4) -> torch.Tensor:
    """For stored value slot o of a tile (word o // (32 / bits), position o % (32 / bits) in it):
    the flat index k * 64 + n in the 16 x 64 tile."""
    order = [0] * (TILE_K * TILE_N)
    for lane in range(32):
        g, c = divmod(lane, 4)
        for j in range(4):  # the 16-column block of the 64-wide tile
            for e in range(8):  # fragment element
                half, r = divmod(e, 4)  # which 8-column half of the block, which of the 4 rows
                k = 2 * c + (r % 2) + 8 * (r // 2)
                n = 16 * j + 8 * half + g
                if bits == 4:
                    slot = 32 * lane + 8 * j + INTERLEAVE.index(e)
                else:
                    slot = 32 * lane + 4 * (2 * j + half) + INTERLEAVE_8.index(r)
                order[slot] = k * TILE_N + n
    perm = torch.tensor(order, dtype=torch.long)
    assert torch.equal(perm.sort().values, torch.arange(TILE_K * TILE_N)), "tile order is not a permutation"
    return perm


def permute_scales(scales: torch.Tensor) -> torch.Tensor:
    """Natural-order scales (or zeros) [groups, N] -> the layout the kernel reads (identity for one group)."""
    g, n = scales.shape
    if g == 1:
        return scales.contiguous()
    # Inside each 64-column chunk: position 8 i + j <- column i + 8 j (a transpose of 8 x 8).
    return scales.reshape(g, n // TILE_N, 8, 8).transpose(-1, -2).reshape(g, n).contiguous()


def unpermute_scales(b_scales: torch.Tensor) -> torch.Tensor:
    """Inverse of permute_scales (the 8 x 8 transpose is its own inverse)."""
    return permute_scales(b_scales)


def _check_scales(name: str, t: torch.Tensor, k: int, n: int) -> None:
    if t.dim() != 2 or t.shape[1] != n or t.shape[0] < 1 or k % t.shape[0]:
        raise ValueError(f"{name} shape {tuple(t.shape)}, expected [groups, {n}] with groups dividing K = {k}")
    if (k // t.shape[0]) % TILE_K:
        raise ValueError(f"group size {k // t.shape[0]} is not a multiple of {TILE_K}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}.dtype = {t.dtype}, expected torch.float16 or torch.bfloat16")


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor] = None, bits: int = 4):
    """Pack natural-order q int8 [K, N], scales [groups, N] (and zeros) into the Marlin layout.

    Symmetric (zeros None): q in [-2^(bits-1), 2^(bits-1) - 1]; returns (b_q, b_scales).
    Zero points (4 bits): q = u in [0, 15], zeros integer values in [0, 15] of the scales' dtype
    and shape; returns (b_q, b_scales, b_zeros).  b_q is int32 [K / 16, words_per_column(bits) * N].
    """
    _check_bits(bits)
    if q.dim() != 2:
        raise ValueError(f"q must be 2-D [K, N], got shape {tuple(q.shape)}")
    k, n = q.shape
    _check_kn(k, n)
    _check_scales("scales", scales, k, n)
    if zeros is None:
        lo, hi = -_bias(bits), _bias(bits) - 1
    else:
        if bits != 4:
            raise ValueError(f"zeros given with bits = {bits}: zero points are supported for 4-bit weights only")
        if zeros.shape != scales.shape or zeros.dtype != scales.dtype:
            raise ValueError(
                f"zeros {tuple(zeros.shape)} {zeros.dtype}, expected the scales' shape and dtype "
                f"{tuple(scales.shape)} {scales.dtype}"
            )
        zf = zeros.float()
        if not bool(((zf >= 0) & (zf <= 15) & (zf == zf.round())).all()):
            raise ValueError("zeros must hold integer values in [0, 15]")
        lo, hi = 0, 15
    if int(q.min()) < lo or int(q.max()) > hi:
        raise ValueError(f"q values must lie in [{lo}, {hi}] for this format, got [{int(q.min())}, {int(q.max())}]")

    u = q.to(torch.int64) + (_bias(bits) if zeros is None else 0)
    per_word = 32 // bits
    tile_words = TILE_K * TILE_N // per_word
    tiles = u.reshape(k // TILE_K, TILE_K, n // TILE_N, TILE_N).permute(0, 2, 1, 3)
    tiles = tiles.reshape(k // TILE_K, n // TILE_N, TILE_K * TILE_N)
    slots = tiles[..., _tile_order(bits).to(u.device)].reshape(k // TILE_K, n // TILE_N, tile_words, per_word)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=u.device)
    words = (slots << shifts).sum(dim=-1)  # 0 .. 2^32 - 1
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    b_q = words.reshape(k // TILE_K, words_per_column(bits) * n).contiguous()
    if zeros is None:
        return b_q, permute_scales(scales)
    return b_q, permute_scales(scales), permute_scales(zeros)


def unpack(b_q: torch.Tensor, b_scales: torch.Tensor, b_zeros: Optional[torch.Tensor] = None, bits: int = 4):
    """Exact inverse of pack: returns (q, scales) or, with b_zeros, (q, scales, zeros), in natural order."""
    _check_bits(bits)
    wpc = words_per_column(bits)
    if b_q.dim() != 2 or b_q.dtype != torch.int32 or b_q.shape[1] % (wpc * TILE_N):
        raise ValueError(
            f"b_q must be int32 [K/16, {wpc}N] with N a multiple of {TILE_N} for bits = {bits}, "
            f"got {tuple(b_q.shape)} {b_q.dtype}"
        )
    if b_zeros is not None and bits != 4:
        raise ValueError(f"b_zeros given with bits = {bits}: zero points are supported for 4-bit weights only")
    k, n = b_q.shape[0] * TILE_K, b_q.shape[1] // wpc
    per_word = 32 // bits
    words = b_q.to(torch.int64) & 0xFFFFFFFF
    words = words.reshape(k // TILE_K, n // TILE_N, TILE_K * TILE_N // per_word, 1)
    slots = (words >> torch.arange(0, 32, bits, dtype=torch.int64, device=b_q.device)) & ((1 << bits) - 1)
    slots = slots.reshape(k // TILE_K, n // TILE_N, TILE_K * TILE_N)
    tiles = torch.empty_like(slots)
    tiles[..., _tile_order(bits).to(b_q.device)] = slots
    u = tiles.reshape(k // TILE_K, n // TILE_N, TILE_K, TILE_N).permute(0, 2, 1, 3).reshape(k, n)
    if b_zeros is None:
        return (u - _bias(bits)).to(torch.int8), unpermute_scales(b_scales)
    return u.to(torch.int8), unpermute_scales(b_scales), unpermute_scales(b_zeros)


def quantize_and_pack(
    w: torch.Tensor, group_size: int = 128, bits: int = 4, sym: bool = True, dtype: Optional[torch.dtype] = None
):
    """quantize + pack for B [K, N]; returns (b_q, b_scales) or (b_q, b_scales, b_zeros) with sym=False,
    ready for ``torch.ops.marlin.gemm(a, b_q, b_scales, b_zeros, bits=bits)``."""
    parts = quantize(w, group_size, bits=bits, sym=sym, dtype=dtype)
    return pack(*parts, bits=bits)
