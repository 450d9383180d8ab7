"""Which part of a packed Marlin layer each tensor-parallel rank holds, read straight off the packed
tensors (never by dequantizing).

Why plain slicing is exact: ``b_q`` [K / 16, W N] (W int32 words per column: 2 for 4-bit, 4 for
8-bit) stores B in 16 x 64 tiles, tile (kt, nt) at row kt, words W 64 nt .. W 64 (nt + 1) - 1.
Scales (and zero points) are [groups, N] with the columns permuted only inside each 64-column chunk.
So
  * columns n0 .. n1 (multiples of 64) are ``b_q[:, W n0 : W n1]`` and ``b_scales[:, n0 : n1]``;
  * rows k0 .. k1 (multiples of 16 and of the group size) are ``b_q[k0 / 16 : k1 / 16]`` and
    ``b_scales[k0 / gs : k1 / gs]`` (per-column scales, one row, are kept whole).
tests/test_parallel_shard.py checks both against ``packing.unpack``.
2:4-sparse layers (MarlinLinear24, marlin/sparse.py) slice the same way: ``b_q`` [K / 32, 2 N] and
``b_meta`` [K / 32, N] hold 32-row strips of 64-column tiles, so columns n0 .. n1 are
``b_q[:, 2 n0 : 2 n1]`` and ``b_meta[:, n0 : n1]``, and rows k0 .. k1 (multiples of 128, the
kernel's K multiple, and of the group size) are rows k0 / 32 .. k1 / 32 of both.

Column parallel (split N): rank r holds columns [r N / T, (r + 1) N / T). An act-order ``perm``
acts on K, which every rank sees whole, so each rank keeps all of it.

Row parallel (split K): rank r receives input features [r K / T, (r + 1) K / T) and its partial
products are summed across ranks. Without act-order it holds the same rows of B. With act-order
the stored rows are B[perm], sorted by group, and each group's rows come from anywhere in K. Two
cases:
  * every group's rows lie inside one rank's input slice ("aligned"): the rank holds its groups
    (tile-aligned row blocks of b_q) and a local permutation of its own slice; no extra traffic;
  * some group straddles two slices (the usual case for GPTQ act-order, which orders K by the
    Hessian): no exact fixed-group split of the rank's own slice exists, so the rank holds the
    contiguous stored rows [r K / T, (r + 1) K / T) (whole groups) and reads the input features
    perm[those rows] from the gathered full input ("gather": one all-gather of the activations,
    M x K halves, per such layer and step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import ops, packing, sparse

__all__ = [
    "ShardError",
    "COLUMN",
    "ROW",
    "ColumnShard",
    "RowShard",
    "plan_column",
    "plan_row",
    "row_groups",
]

COLUMN = "column"
ROW = "row"


class ShardError(ValueError):
    """A layer cannot be split for tensor parallelism; the message names the layer and the rule."""


@dataclass(frozen=True)
class ColumnShard:
    """Rank ``rank``'s columns [n0, n1) of a layer with N columns."""

    name: str
    k: int
    n: int
    n0: int
    n1: int

    @property
    def out_features(self) -> int:
        return self.n1 - self.n0


@dataclass(frozen=True)
class RowShard:
    """Rank ``rank``'s rows of a layer with K rows.

    ``blocks``: the stored (packed, possibly act-order sorted) row ranges [p0, p1) it holds, in
    order, each made of whole groups and 16-row tiles. ``local_perm``: int64 [K / T] indices into the
    rank's own input slice (aligned act-order), or None. ``gather_index``: int64 [K / T] indices into
    the full, gathered input (act-order with straddling groups), or None. ``k0, k1``: the rank's
    input slice.
    """

    name: str
    k: int
    n: int
    k0: int
    k1: int
    blocks: tuple
    local_perm: Optional[torch.Tensor]
    gather_index: Optional[torch.Tensor]

    @property
    def in_features(self) -> int:
        return self.k1 - self.k0

    @property
    def gathers_input(self) -> bool:
        return self.gather_index is not None


def _group_size(k: int, scale_rows: int) -> int:
    return packing.group_size_of(k, scale_rows)


def _check_split(name: str, what: str, total: int, world_size: int, multiple: int, why: str) -> int:
    if world_size < 1:
        raise ShardError(f"{name}: world_size = {world_size}, expected >= 1")
    if total % world_size:
        raise ShardError(f"{name}: {what} = {total} does not split evenly over {world_size} ranks")
    part = total // world_size
    if part % multiple:
        raise ShardError(
            f"{name}: {what} = {total} over {world_size} ranks gives {part} per rank, which is not a multiple of "
            f"{multiple} ({why}); use fewer ranks or keep this layer replicated"
        )
    return part


def _check_kernel(name: str, k: int, n: int, group_size: int, world_size: int, bits: int, is_2_4: bool = False) -> None:
    reason = sparse.check_shape_2_4(k, n, group_size) if is_2_4 else ops.check_shape(k, n, group_size, bits)
    if reason is not None:
        raise ShardError(
            f"{name}: the shard of each of {world_size} ranks would be a [{k} -> {n}] layer (group size "
            f"{group_size}), which the Marlin {'2:4 ' if is_2_4 else ''}kernel does not take: {reason}; use fewer "
            "ranks or keep this layer replicated"
        )


def plan_column(
    name: str, k: int, n: int, scale_rows: int, rank: int, world_size: int, bits: int = 4, is_2_4: bool = False
) -> ColumnShard:
    """Columns of rank ``rank``; ShardError naming the layer when a shard breaks the tile or kernel
    rules. ``is_2_4``: a 2:4-sparse layer (its kernel's shape rules)."""
    _check_rank(name, rank, world_size)
    part = _check_split(name, "out_features", n, world_size, packing.TILE_N, "the packed tile width")
    _check_kernel(name, k, part, _group_size(k, scale_rows), world_size, bits, is_2_4)
    return ColumnShard(name, k, n, rank * part, (rank + 1) * part)


def row_groups(perm: torch.Tensor, group_rows: int, world_size: int) -> Optional[torch.Tensor]:
    """For act-order weights: the rank owning each stored group (int64 [groups]) when every group's
    input features lie in one rank's slice, else None (some group straddles two slices)."""
    k = perm.numel()
    owner = perm.to(torch.int64).reshape(-1, group_rows) // (k // world_size)  # rank of each row
    first = owner[:, 0]
    if not bool((owner == first.unsqueeze(1)).all()):
        return None
    return first


def plan_row(
    name: str,
    k: int,
    n: int,
    scale_rows: int,
    perm: Optional[torch.Tensor],
    rank: int,
    world_size: int,
    bits: int = 4,
    is_2_4: bool = False,
) -> RowShard:
    """Rows of rank ``rank`` (see the module docstring); ``perm`` the layer's act-order permutation
    (2:4 layers have none). ``is_2_4``: a 2:4-sparse layer, whose shards take K in multiples of 128."""
    _check_rank(name, rank, world_size)
    gs = _group_size(k, scale_rows)
    group_rows = k if gs == -1 else gs
    if is_2_4:  # every 2:4 group size divides the kernel's K multiple
        multiple, why = sparse.K_MULTIPLE_2_4, "the 2:4 kernel's K multiple"
    else:
        multiple = packing.TILE_K if gs == -1 else gs
        why = "the packed tile height" if gs == -1 else f"whole groups of {gs} rows"
    part = _check_split(name, "in_features", k, world_size, multiple, why)
    _check_kernel(name, part, n, gs, world_size, bits, is_2_4)
    k0, k1 = rank * part, (rank + 1) * part
    if perm is None or world_size == 1:
        return RowShard(name, k, n, k0, k1, ((k0, k1),), _as_long(perm), None)
    if perm.shape != (k,):
        raise ShardError(f"{name}: perm shape {tuple(perm.shape)}, expected [{k}]")
    perm = perm.to(torch.int64).cpu()
    owner = row_groups(perm, group_rows, world_size) if gs != -1 else None
    if owner is not None:
        mine = (owner == rank).nonzero().flatten().tolist()
        blocks = _merge([(g * gs, (g + 1) * gs) for g in mine])
        rows = torch.cat([perm[p0:p1] for p0, p1 in blocks])
        return RowShard(name, k, n, k0, k1, tuple(blocks), rows - k0, None)
    return RowShard(name, k, n, k0, k1, ((k0, k1),), None, perm[k0:k1].clone())


def _as_long(perm: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if perm is None else perm.to(torch.int64).cpu()


def _check_rank(name: str, rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ShardError(f"{name}: rank = {rank}, expected 0 <= rank < world_size = {world_size}")


def _merge(blocks: list) -> list:
    """Adjacent [p0, p1) ranges joined, so that a contiguous selection is one slice (one read)."""
    out: list = []
    for p0, p1 in blocks:
        if out and out[-1][1] == p0:
            out[-1] = (out[-1][0], p1)
        else:
            out.append((p0, p1))
    return out


def single_group(shard: RowShard, group_size: int) -> bool:
    """True when a grouped layer's row shard holds exactly one group.

    The kernel infers the group size from the number of scale rows, and one row means per-column
    scales, which it reads in natural column order. One group spanning the whole shard is the same
    arithmetic as per-column scales, but the stored row is in the grouped (permuted) order: it must
    be put back in natural order, and the local layer has group size -1.
    """
    return group_size != -1 and shard.in_features == group_size


def to_natural_order(scales: torch.Tensor) -> torch.Tensor:
    """Grouped-layout scale rows [g, N] back to natural column order (the 8 x 8 transpose inside
    each 64-column chunk, packing.permute_scales, applied whatever g is)."""
    g, n = scales.shape
    return scales.reshape(g, n // packing.TILE_N, 8, 8).transpose(-1, -2).reshape(g, n).contiguous()


# -- taking the slices ------------------------------------------------------------------------
# ``take(name, index)`` returns tensor ``name`` indexed by ``index`` (a tuple of slices): a view of
# an in-memory buffer, or a partial read of a safetensors file (marlin.parallel.loader).
Take = Callable[[str, tuple], torch.Tensor]


def column_tensors(shard: ColumnShard, take: Take, words_per_column: int, has: Callable[[str], bool]) -> dict:
    """The rank's b_q, b_scales (and b_zeros, bias when present) for a column shard."""
    n0, n1 = shard.n0, shard.n1
    out = {
        "b_q": take("b_q", (slice(None), slice(words_per_column * n0, words_per_column * n1))),
        "b_scales": take("b_scales", (slice(None), slice(n0, n1))),
    }
    if has("b_meta"):  # 2:4: the kept values' positions, one word per column and strip
        out["b_meta"] = take("b_meta", (slice(None), slice(n0, n1)))
    if has("b_zeros"):
        out["b_zeros"] = take("b_zeros", (slice(None), slice(n0, n1)))
    if has("bias"):
        out["bias"] = take("bias", (slice(n0, n1),))
    if has("perm"):
        out["perm"] = take("perm", (slice(None),))
    return out


def row_tensors(shard: RowShard, take: Take, scale_rows: int, has: Callable[[str], bool]) -> dict:
    """The rank's b_q, b_scales (and b_zeros) for a row shard; the local perm when aligned act-order.
    The bias is not part of a row shard: it is added once, after the partial sums are reduced."""
    gs = _group_size(shard.k, scale_rows)

    def rows(name: str, per: int) -> torch.Tensor:
        parts = [take(name, (slice(p0 // per, p1 // per),)) for p0, p1 in shard.blocks]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    if has("b_meta"):  # 2:4: b_q and b_meta in 32-row strips
        out = {"b_q": rows("b_q", sparse.STRIP_K), "b_meta": rows("b_meta", sparse.STRIP_K)}
    else:
        out = {"b_q": rows("b_q", packing.TILE_K)}
    for name in ("b_scales", "b_zeros"):
        if name == "b_scales" or has(name):
            out[name] = take(name, (slice(None),)) if gs == -1 else rows(name, gs)
            if single_group(shard, gs):
                out[name] = to_natural_order(out[name])
    if shard.local_perm is not None:
        out["perm"] = shard.local_perm.to(device=out["b_q"].device, dtype=torch.int32)
    return out
