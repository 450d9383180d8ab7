"""Executable specification of the Marlin weight format.

Everything the CUDA kernel assumes about the bytes it reads is written down here, in plain torch,
so that the format can be read, tested bit-exactly and produced on any device.  docs/FORMAT.md
explains the same layout in prose with a worked example.

Notation: the weight matrix is B with shape [K, N] (K = in_features, N = out_features), so that a
layer computes C[M, N] = A[M, K] @ B.  ``nn.Linear.weight`` is B transposed.

Quantization (symmetric, round to nearest, as GPTQ's ``sym=True``):
    scale[g, n] = fp16(2 * max_k |B[k, n]| / 15)       over the K rows of group g
    q[k, n]     = clamp(round(B[k, n] / scale[g, n]), -8, 7)
    dequant     = scale[g(k), n] * q[k, n]             (exact in fp32: 11-bit mantissa x 4 bits)

Packing (the paper's section 3, "Maximizing Loading Bandwidth" and "Dequantization"):
  * B is cut into 16 x 64 tiles (16 rows of K, 64 columns of N).  One tile is 1024 nibbles =
    128 int32 words = 32 x 16 bytes: exactly one 16-byte load per lane of a warp.
  * Lane ``t`` of the warp gets the weights it needs as the B operand of ``mma.m16n8k16`` for the
    four 16 x 16 blocks of the tile: in block ``j`` it holds rows k = 2c, 2c+1, 2c+8, 2c+9
    (c = t % 4) of columns 16j + g and 16j + 8 + g (g = t // 4).  Those 8 values go in word ``j``.
  * Inside a word, fragment element e is stored in nibble p with e = INTERLEAVE[p]; listing the
    low 16-bit half (nibbles 3..0) and then the high half (nibbles 7..4) gives the paper's
    "64207531".  Then ``(w & 0x000f000f)`` yields the pair
    (e0, e1), ``(w & 0x00f000f0)`` yields (e2, e3), and the same after ``w >> 8`` yields (e4, e5),
    (e6, e7): two values per 32-bit operation, already in the tensor-core register order.
  * Stored nibble = q + 8 (unsigned 0..15).
  * Packed tensor ``b_q``: int32 [K / 16, 2 * N].  Row ``kt`` holds the tiles of K rows
    16 kt .. 16 kt + 15, tile ``nt`` at words 128 nt .. 128 nt + 127, lane t's 16 bytes at
    words 128 nt + 4 t .. 128 nt + 4 t + 3.
  * Scales ``b_scales``: fp16 [K / group_size, N].  With more than one group, each 64-column chunk
    is permuted so that position 8 i + j holds column i + 8 j: lane t then finds the scales of its
    8 columns (t // 4 + 8 m, m = 0..7) in one 16-byte vector.  With one group (per-column
    quantization) the scales are applied to the fp32 result instead and keep natural order.

The group size is not stored: it is K / b_scales.shape[0].  Today the kernel takes group size 128
and per-column (-1); the functions below take any group size that divides K into 16-row multiples,
and leave a place for zero points, so that 32/64 groups, bf16 and asymmetric formats can be added.
"""

from __future__ import annotations

from functools import lru_cache

import torch

__all__ = [
    "TILE_K",
    "TILE_N",
    "INTERLEAVE",
    "SUPPORTED_GROUP_SIZES",
    "quantize",
    "pack",
    "unpack",
    "dequantize",
    "quantize_and_pack",
    "permute_scales",
    "unpermute_scales",
    "num_groups",
    "group_size_of",
]

TILE_K = 16  # rows of K in one packed tile
TILE_N = 64  # columns of N in one packed tile
WORDS_PER_TILE = TILE_K * TILE_N // 8  # 128 int32 words
INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p holds fragment element INTERLEAVE[p]
SUPPORTED_GROUP_SIZES = (128, -1)  # what torch.ops.marlin.gemm accepts today (-1: per column)

_QMIN, _QMAX = -8, 7
_OFFSET = 8  # stored nibble = q + 8


def num_groups(k: int, group_size: int) -> int:
    """Rows of the scale tensor for K input features: 1 for per-column (-1), else K / group_size."""
    return 1 if group_size == -1 else k // group_size


def group_size_of(k: int, scale_rows: int) -> int:
    """Inverse of num_groups: -1 (per column) when there is a single scale row."""
    return -1 if scale_rows == 1 else k // scale_rows


def _check_group_size(k: int, group_size: int) -> None:
    if group_size == -1:
        return
    if not isinstance(group_size, int) or group_size <= 0 or group_size % TILE_K:
        raise ValueError(f"group_size = {group_size!r}, expected -1 (per column) or a positive multiple of {TILE_K}")
    if k % group_size:
        raise ValueError(f"K = {k} is not a multiple of group_size = {group_size}")


def _check_kn(k: int, n: int) -> None:
    if k <= 0 or k % TILE_K:
        raise ValueError(f"K = {k}, expected a positive multiple of {TILE_K} (the packed tile height)")
    if n <= 0 or n % TILE_N:
        raise ValueError(f"N = {n}, expected a positive multiple of {TILE_N} (the packed tile width)")


def quantize(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric INT4 quantization of B [K, N] (float).

    Returns ``q`` int8 [K, N] in [-8, 7] and ``scales`` fp16 [num_groups, N] in natural order.
    The scale is rounded to fp16 *before* q is computed, so that dequantize(q, scales) is the
    closest representable weight for the stored scale.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D float tensor [K, N], got shape {tuple(w.shape)} dtype {w.dtype}")
    k, n = w.shape
    _check_group_size(k, group_size)
    g = num_groups(k, group_size)
    wf = w.detach().float().reshape(g, k // g, n)
    amax = wf.abs().amax(dim=1)  # [g, N]
    scales = (amax * (2.0 / 15.0)).to(torch.float16)
    # An all-zero group (or one so small that its scale underflows fp16) gets scale 1: q is 0 there.
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(wf / scales.float().unsqueeze(1)).clamp_(_QMIN, _QMAX)
    return q.reshape(k, n).to(torch.int8), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """B = scale * q in float32 (exact), from natural-order q [K, N] and scales [groups, N]."""
    k, n = q.shape
    g = scales.shape[0]
    if scales.shape[1] != n or k % g:
        raise ValueError(f"scales shape {tuple(scales.shape)} does not fit q shape {tuple(q.shape)}")
    s = scales.float().repeat_interleave(k // g, dim=0)
    return q.float() * s


@lru_cache(maxsize=None)
def _tile_order() -> torch.Tensor:
    """For stored nibble slot o = 32 * lane + 8 * word + nibble: flat index k * 64 + n in the tile."""
    order = []
    for lane in range(32):
        g, c = divmod(lane, 4)
        for word in range(4):  # the 16-column block j of the 64-wide tile
            for nibble in range(8):
                e = INTERLEAVE[nibble]
                half, r = divmod(e, 4)  # which 8-column half of the block, which of the 4 rows
                k = 2 * c + (r % 2) + 8 * (r // 2)
                n = 16 * word + 8 * half + g
                order.append(k * TILE_N + n)
    perm = torch.tensor(order, dtype=torch.long)
    assert torch.equal(perm.sort().values, torch.arange(TILE_K * TILE_N)), "tile order is not a permutation"
    return perm


def permute_scales(scales: torch.Tensor) -> torch.Tensor:
    """Natural-order scales [groups, N] -> the layout the kernel reads (identity for one group)."""
    g, n = scales.shape
    if g == 1:
        return scales.contiguous()
    # Inside each 64-column chunk: position 8 i + j <- column i + 8 j (a transpose of 8 x 8).
    return scales.reshape(g, n // TILE_N, 8, 8).transpose(-1, -2).reshape(g, n).contiguous()


def unpermute_scales(b_scales: torch.Tensor) -> torch.Tensor:
    """Inverse of permute_scales (the 8 x 8 transpose is its own inverse)."""
    return permute_scales(b_scales)


def pack(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack natural-order q int8 [K, N] in [-8, 7] and scales fp16 [groups, N] into the Marlin layout.

    Returns ``b_q`` int32 [K / 16, 2 N] and ``b_scales`` fp16 [groups, N] (permuted when groups > 1).
    """
    if q.dim() != 2:
        raise ValueError(f"q must be 2-D [K, N], got shape {tuple(q.shape)}")
    k, n = q.shape
    _check_kn(k, n)
    if scales.dim() != 2 or scales.shape[1] != n or scales.shape[0] < 1 or k % scales.shape[0]:
        raise ValueError(f"scales shape {tuple(scales.shape)}, expected [groups, {n}] with groups dividing K = {k}")
    if (k // scales.shape[0]) % TILE_K:
        raise ValueError(f"group size {k // scales.shape[0]} is not a multiple of {TILE_K}")
    if scales.dtype != torch.float16:
        raise ValueError(f"scales.dtype = {scales.dtype}, expected torch.float16")
    if int(q.min()) < _QMIN or int(q.max()) > _QMAX:
        raise ValueError(f"q values must lie in [{_QMIN}, {_QMAX}], got [{int(q.min())}, {int(q.max())}]")

    u = q.to(torch.int64) + _OFFSET
    tiles = u.reshape(k // TILE_K, TILE_K, n // TILE_N, TILE_N).permute(0, 2, 1, 3)
    tiles = tiles.reshape(k // TILE_K, n // TILE_N, TILE_K * TILE_N)
    slots = tiles[..., _tile_order().to(u.device)].reshape(k // TILE_K, n // TILE_N, WORDS_PER_TILE, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=u.device)
    words = (slots << shifts).sum(dim=-1)  # 0 .. 2^32 - 1
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    b_q = words.reshape(k // TILE_K, 2 * n)
    return b_q.contiguous(), permute_scales(scales)


def unpack(b_q: torch.Tensor, b_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact inverse of pack: (b_q, b_scales) -> (q int8 [K, N], scales fp16 [groups, N] natural)."""
    if b_q.dim() != 2 or b_q.dtype != torch.int32 or b_q.shape[1] % (2 * TILE_N):
        raise ValueError(f"b_q must be int32 [K/16, 2N] with N a multiple of {TILE_N}, got {tuple(b_q.shape)} {b_q.dtype}")
    k, n = b_q.shape[0] * TILE_K, b_q.shape[1] // 2
    words = b_q.to(torch.int64) & 0xFFFFFFFF
    words = words.reshape(k // TILE_K, n // TILE_N, WORDS_PER_TILE, 1)
    slots = (words >> torch.arange(0, 32, 4, dtype=torch.int64, device=b_q.device)) & 0xF
    slots = slots.reshape(k // TILE_K, n // TILE_N, TILE_K * TILE_N)
    tiles = torch.empty_like(slots)
    tiles[..., _tile_order().to(b_q.device)] = slots
    u = tiles.reshape(k // TILE_K, n // TILE_N, TILE_K, TILE_N).permute(0, 2, 1, 3).reshape(k, n)
    q = (u - _OFFSET).to(torch.int8)
    return q, unpermute_scales(b_scales)


def quantize_and_pack(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize + pack for B [K, N]; returns (b_q, b_scales) ready for torch.ops.marlin.gemm."""
    q, scales = quantize(w, group_size)
    return pack(q, scales)
