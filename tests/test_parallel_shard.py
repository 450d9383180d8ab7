"""Sharding packed Marlin layers for tensor parallelism, one process (no torch.distributed).

Each rank's shard is built with an explicit rank and world size, and the ranks' results are
combined here the way the collectives would (concatenation for column-parallel, a sum for
row-parallel). Checks:
  * the shards' packed tensors unpack (packing.unpack) to exactly the expected column / row slices
    of the full layer's q and scales: slicing the packed layout is exact, never a requantization;
  * combined outputs equal the full layer's float64 reference, for act-order weights whose groups
    lie inside one rank's input slice (local permutation) and whose groups straddle the slices
    (gathered input), with group 128 and per-column scales;
  * shards that break the tile or kernel rules raise ShardError naming the layer.

Tolerance: each rank's partial output is rounded to fp16 once and the partials are summed in fp16
(as NCCL sums fp16), a few roundings of <= 2^-11 relative: 3e-3 normwise; a wrong slice, scale
or permutation gives errors of order 1.
"""

from __future__ import annotations

import pytest
import torch

from marlin import packing
from marlin.nn import MarlinLinear
from marlin.parallel import ColumnParallelLinear, RowParallelLinear, ShardError
from marlin.parallel import shard as sh

from conftest import random_layer, rel_err

TOL = 3e-3


def marlin_layer(k, n, group_size, *, perm=None, bias=True, seed=0):
    """A MarlinLinear with random weights; returns (layer, float64 B in original input order)."""
    q, scales, b_q, b_scales = random_layer(k, n, group_size, seed=seed)
    layer = MarlinLinear(k, n, bias=bias, group_size=group_size, act_order=perm is not None)
    layer.b_q.copy_(b_q)
    layer.b_scales.copy_(b_scales)
    gen = torch.Generator().manual_seed(seed + 1)
    if bias:
        layer.bias.copy_(torch.randn(n, generator=gen).half())
    w = packing.dequantize(q, scales).double()  # stored row i belongs to input feature perm[i]
    if perm is not None:
        layer.perm.copy_(perm)
        full = torch.empty_like(w)
        full[perm.long()] = w
        w = full
    return layer, w


def reference(layer, w, x):
    y = x.double() @ w
    return y + layer.bias.double() if layer.bias is not None else y


def random_input(m, k, seed=5):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).half()


def aligned_perm(k, world, group_size, seed=3, interleave=False):
    """An act-order permutation whose every group's rows lie in one rank's input slice."""
    gen = torch.Generator().manual_seed(seed)
    part = k // world
    blocks = []
    for r in range(world):
        rows = r * part + torch.randperm(part, generator=gen)
        blocks += list(rows.reshape(-1, group_size))
    if interleave:  # stored groups of different ranks alternate: each rank holds several row blocks
        blocks = [blocks[i] for i in torch.randperm(len(blocks), generator=gen).tolist()]
    return torch.cat(blocks).to(torch.int32)


def straddling_perm(k, seed=4):
    return torch.randperm(k, generator=torch.Generator().manual_seed(seed)).to(torch.int32)


# -- the packed slices are exact ------------------------------------------------------------------
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("world", [2, 4])
def test_column_shards_unpack_to_column_slices(group_size, world):
    k, n = 256, 1024
    q, scales, b_q, b_scales = random_layer(k, n, group_size, seed=11)
    layer = MarlinLinear(k, n, group_size=group_size)
    layer.b_q.copy_(b_q)
    layer.b_scales.copy_(b_scales)
    for r in range(world):
        col = ColumnParallelLinear.from_layer(layer, "q_proj", rank=r, world_size=world)
        part = n // world
        lq, ls = packing.unpack(col.local.b_q, col.local.b_scales)
        assert torch.equal(lq, q[:, r * part : (r + 1) * part])
        assert torch.equal(ls, scales[:, r * part : (r + 1) * part])
        assert col.local.out_features == part and col.out_features == n


@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("k, world", [(1024, 2), (1024, 4), (512, 4)])
def test_row_shards_unpack_to_row_slices(group_size, k, world):
    """(512, 4): one group per rank, which the kernel reads as per-column scales (natural order)."""
    n = 256
    q, scales, b_q, b_scales = random_layer(k, n, group_size, seed=12)
    layer = MarlinLinear(k, n, group_size=group_size)
    layer.b_q.copy_(b_q)
    layer.b_scales.copy_(b_scales)
    part = k // world
    for r in range(world):
        row = RowParallelLinear.from_layer(layer, "o_proj", rank=r, world_size=world)
        lq, ls = packing.unpack(row.local.b_q, row.local.b_scales)
        assert torch.equal(lq, q[r * part : (r + 1) * part])
        want = scales if group_size == -1 else scales[r * part // 128 : (r + 1) * part // 128]
        assert torch.equal(ls, want)
        assert row.local.group_size == (-1 if part == 128 else group_size)
        assert row.local.bias is None and row.gather_index is None


# -- outputs: concatenated columns, summed rows -------------------------------------------------
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [128, -1])
def test_column_parallel_outputs_concatenate_to_the_layer(act_order, group_size):
    k, n, world = 512, 512, 2
    perm = straddling_perm(k) if act_order else None  # K is whole on every rank: any perm works
    layer, w = marlin_layer(k, n, group_size, perm=perm)
    x = random_input(7, k)
    parts = [ColumnParallelLinear.from_layer(layer, "up", rank=r, world_size=world)(x) for r in range(world)]
    assert rel_err(torch.cat(parts, -1), reference(layer, w, x)) < TOL


def row_parallel_sum(layer, x, world, name="down"):
    """The rank-by-rank computation of RowParallelLinear with the collectives done by hand."""
    total, shards = None, []
    for r in range(world):
        row = RowParallelLinear.from_layer(layer, name, rank=r, world_size=world)
        shards.append(row)
        a = x.index_select(-1, row.gather_index) if row.gather_index is not None else x[..., row.k0 : row.k1]
        y = row.local(a)
        total = y if total is None else total + y  # fp16 sum, as the all-reduce
    if layer.bias is not None:
        total = total + shards[0].bias
    return total, shards


@pytest.mark.parametrize("k, world", [(1024, 2), (1024, 4), (256, 2)])
@pytest.mark.parametrize("group_size", [128, -1])
def test_row_parallel_sums_to_the_layer(k, world, group_size):
    n = 256
    layer, w = marlin_layer(k, n, group_size)
    x = random_input(5, k)
    y, _ = row_parallel_sum(layer, x, world)
    assert rel_err(y, reference(layer, w, x)) < TOL


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("k, world", [(1024, 2), (1024, 4), (512, 4)])
def test_act_order_aligned_groups_permute_the_local_slice(k, world, interleave):
    n = 256
    perm = aligned_perm(k, world, 128, interleave=interleave)
    layer, w = marlin_layer(k, n, 128, perm=perm)
    x = random_input(9, k)
    y, shards = row_parallel_sum(layer, x, world)
    assert all(s.gather_index is None and s.local.perm is not None for s in shards)
    for s in shards:  # the local permutation stays inside the rank's slice
        assert sorted(s.local.perm.tolist()) == list(range(k // world))
    assert rel_err(y, reference(layer, w, x)) < TOL


@pytest.mark.parametrize("k, world", [(1024, 2), (1024, 4), (256, 2)])
@pytest.mark.parametrize("group_size", [128, -1])
def test_act_order_straddling_groups_gather_the_input(k, world, group_size):
    n = 256
    perm = straddling_perm(k)
    layer, w = marlin_layer(k, n, group_size, perm=perm)
    assert sh.row_groups(perm, 128, world) is None  # the case that needs the gathered input
    x = random_input(3, k)
    y, shards = row_parallel_sum(layer, x, world)
    assert all(s.gather_index is not None and s.local.perm is None for s in shards)
    # Rank r holds the stored rows of its whole groups, and reads their features wherever they are.
    for r, s in enumerate(shards):
        part = k // world
        assert torch.equal(s.gather_index, perm[r * part : (r + 1) * part].long())
    assert rel_err(y, reference(layer, w, x)) < TOL


def test_one_straddling_group_is_enough_to_gather():
    """Groups aligned except one pair of rows swapped across the slice boundary."""
    k, n, world = 512, 128, 2
    perm = aligned_perm(k, world, 128)
    i = int((perm == 0).nonzero())
    j = int((perm == k - 1).nonzero())
    perm[i], perm[j] = perm[j].clone(), perm[i].clone()
    layer, w = marlin_layer(k, n, 128, perm=perm)
    x = random_input(4, k)
    y, shards = row_parallel_sum(layer, x, world)
    assert all(s.gather_index is not None for s in shards)
    assert rel_err(y, reference(layer, w, x)) < TOL


def test_world_size_one_is_the_layer():
    layer, w = marlin_layer(256, 256, 128, perm=straddling_perm(256))
    x = random_input(2, 256)
    col = ColumnParallelLinear.from_layer(layer, rank=0, world_size=1)
    row = RowParallelLinear.from_layer(layer, rank=0, world_size=1)
    assert torch.equal(col(x), layer(x)) and torch.equal(row.local(x) + row.bias, layer(x))


def test_fp16_linear_shards_for_the_baseline():
    lin = torch.nn.Linear(256, 512).half()
    x = random_input(3, 256)
    ref = lin(x.float().half())
    cols = [ColumnParallelLinear.from_layer(lin, rank=r, world_size=2)(x) for r in range(2)]
    assert torch.equal(torch.cat(cols, -1), ref)
    rows = [RowParallelLinear.from_layer(lin, rank=r, world_size=2) for r in range(2)]
    y = rows[0].local(x[:, :128]).float() + rows[1].local(x[:, 128:]).float() + lin.bias.float()
    assert rel_err(y, x.double() @ lin.weight.double().t() + lin.bias.double()) < TOL


# -- refusals -----------------------------------------------------------------------------------------
def test_column_shard_narrower_than_a_tile_names_the_layer():
    layer, _ = marlin_layer(256, 256, 128)
    with pytest.raises(ShardError, match=r"model\.layers\.0\.self_attn\.k_proj: out_features = 256 over 8 ranks gives 32.*tile width"):
        ColumnParallelLinear.from_layer(layer, "model.layers.0.self_attn.k_proj", rank=0, world_size=8)
    with pytest.raises(ShardError, match=r"k_proj: out_features = 256 does not split evenly over 3 ranks"):
        ColumnParallelLinear.from_layer(layer, "k_proj", rank=0, world_size=3)


def test_row_shard_the_kernel_refuses_names_the_layer():
    layer, _ = marlin_layer(256, 128, -1)  # per column: 32-row shards are whole tiles, but K < 64
    with pytest.raises(ShardError, match=r"down_proj: the shard of each of 8 ranks would be a \[32 -> 128\] layer"):
        RowParallelLinear.from_layer(layer, "down_proj", rank=0, world_size=8)


def test_row_shard_that_splits_a_group_names_the_layer():
    layer, _ = marlin_layer(384, 128, 128)
    with pytest.raises(ShardError, match=r"o_proj: in_features = 384 over 2 ranks gives 192.*whole groups of 128"):
        RowParallelLinear.from_layer(layer, "o_proj", rank=1, world_size=2)


def test_bad_rank_and_type():
    layer, _ = marlin_layer(256, 256, 128)
    with pytest.raises(ShardError, match="rank = 2, expected 0 <= rank < world_size = 2"):
        ColumnParallelLinear.from_layer(layer, rank=2, world_size=2)
    with pytest.raises(TypeError, match="expected a MarlinLinear, MarlinLinear24 or nn.Linear"):
        RowParallelLinear.from_layer(torch.nn.ReLU(), rank=0, world_size=2)
    with pytest.raises(ValueError, match="give both or neither"):
        RowParallelLinear.from_layer(layer, rank=0)


# -- 2:4-sparse layers (MarlinLinear24): sliced the same way, 32-row strips and b_meta ------------
def sparse_layer(k, n, group_size, sym, seed=0):
    """A MarlinLinear24 (pruned and quantized from a random fp16 Linear) and its exact float64 B."""
    from torch import nn

    from marlin.sparse_nn import MarlinLinear24

    torch.manual_seed(seed)
    layer = MarlinLinear24.from_linear(nn.Linear(k, n).half(), group_size, sym=sym)
    return layer, layer.dequantized_weight().t().double()


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "zp"])
@pytest.mark.parametrize("group_size", [128, 64, 32, -1])
@pytest.mark.parametrize("world", [2, 4])
def test_2_4_column_parallel_outputs_concatenate_to_the_layer(world, group_size, sym):
    k, n = 256, 512  # N / 4 = 128; N / 2 = 256
    layer, w = sparse_layer(k, n, group_size, sym)
    x = random_input(7, k)
    shards = [ColumnParallelLinear.from_layer(layer, "gate_up", rank=r, world_size=world) for r in range(world)]
    assert all(s.local.b_meta.shape == (k // 32, n // world) for s in shards)
    y = torch.cat([s(x) for s in shards], -1)
    assert rel_err(y, reference(layer, w, x)) < TOL
    assert rel_err(y, layer(x)) < TOL


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "zp"])
@pytest.mark.parametrize("group_size", [128, 64, 32, -1])
@pytest.mark.parametrize("k, world", [(512, 2), (512, 4), (1024, 2)])
def test_2_4_row_parallel_sums_to_the_layer(k, world, group_size, sym):
    n = 256
    layer, w = sparse_layer(k, n, group_size, sym, seed=1)
    x = random_input(5, k)
    y, shards = row_parallel_sum(layer, x, world)
    assert all(s.local.b_q.shape == (k // world // 32, 2 * n) and s.local.b_meta.shape == (k // world // 32, n) for s in shards)
    assert rel_err(y, reference(layer, w, x)) < TOL


def test_2_4_column_shards_in_64_column_tiles():
    layer, w = sparse_layer(256, 384, 128, True, seed=2)  # 384 / 2 = 192: the 64-column tile's width
    x = random_input(3, 256)
    y = torch.cat([ColumnParallelLinear.from_layer(layer, "up", rank=r, world_size=2)(x) for r in range(2)], -1)
    assert rel_err(y, reference(layer, w, x)) < TOL


def test_2_4_row_shard_below_the_kernel_k_multiple_names_the_layer():
    layer, _ = sparse_layer(256, 128, 64, True)
    with pytest.raises(ShardError, match=r"down_proj: in_features = 256 over 4 ranks gives 64.*2:4 kernel's K multiple"):
        RowParallelLinear.from_layer(layer, "down_proj", rank=0, world_size=4)
    with pytest.raises(ShardError, match=r"up: out_features = 128 over 4 ranks gives 32.*tile width"):
        ColumnParallelLinear.from_layer(layer, "up", rank=0, world_size=4)
