"""MarlinLinear's input_rotation (written by marlin-quantize --rotate for down_proj): the layer
computes (x blockdiag(R, ..., R)) @ B, before its act-order permutation; the buffer survives
state_dict round trips (taken from a state dict like ``perm``), bad shapes and dtypes are refused
with messages naming them, and the layers that cannot carry it (tensor-parallel shards, fused
projections, 2:4 layers) refuse it instead of dropping it. CPU reference op."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from marlin import ops, packing
from marlin.fuse import fuse_projections
from marlin.nn import MarlinLinear
from marlin.parallel.layers import marlin_column_shard, marlin_row_shard
from marlin.quantize.rotate import random_hadamard
from marlin.sparse_nn import MarlinLinear24

K, N = 256, 128


def rotated_linear(seed: int = 0, r: int = 64) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(K, N).half()
    lin.register_buffer("input_rotation", random_hadamard(r, seed).half())
    return lin


@pytest.mark.parametrize("act_order", [False, True])
def test_forward_rotates_the_input_before_the_permutation(act_order):
    lin = rotated_linear()
    layer = MarlinLinear.from_linear(lin, group_size=64, sym=False)
    if act_order:
        layer.perm = torch.randperm(K, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    x = torch.randn(3, 5, K, generator=torch.Generator().manual_seed(2)).half()
    y = layer(x)
    # float64 reference: rotate, permute, multiply by the layer's own dequantized weights
    r = lin.input_rotation.double()
    a = (x.double().reshape(15, K // 64, 64) @ r).reshape(15, K)
    a = a.half().double()  # the layer rounds the rotated input to its dtype before the product
    if act_order:
        a = a[:, layer.perm.long()]
    w = packing.dequantize(*packing.unpack(layer.b_q, layer.b_scales, layer.b_zeros, bits=4)).double()  # [K, N] as stored
    ref = (a @ w + layer.bias.double()).reshape(3, 5, N)
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 2e-3
    # and it is not the unrotated product
    plain = (x.double().reshape(15, K)[:, layer.perm.long()] if act_order else x.double().reshape(15, K)) @ w
    assert float((y.double().reshape(15, N) - plain - layer.bias.double()).abs().max() / ref.abs().max()) > 0.05


def test_state_dict_round_trip_takes_the_rotation():
    layer = MarlinLinear.from_linear(rotated_linear(), group_size=64)
    state = layer.state_dict()
    assert state["input_rotation"].shape == (64, 64)
    fresh = MarlinLinear(K, N, group_size=64)  # built without it: the state dict brings it
    fresh.load_state_dict(state)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(5)).half()
    assert torch.equal(fresh(x), layer(x))
    assert "input_rotation=64" in repr(fresh)
    sized = MarlinLinear(K, N, group_size=64, input_rotation=128)  # another block size: replaced
    sized.load_state_dict(state)
    assert sized.input_rotation.shape == (64, 64) and torch.equal(sized(x), layer(x))


def test_bad_rotations_are_refused():
    with pytest.raises(ValueError, match=r"input_rotation: 48 does not divide in_features = 256"):
        MarlinLinear(K, N, input_rotation=48)
    with pytest.raises(ValueError, match=r"input_rotation: 0 is not a positive block size"):
        MarlinLinear(K, N, input_rotation=0)
    state = MarlinLinear.from_linear(rotated_linear(), group_size=64).state_dict()
    for bad, match in (
        (torch.eye(48, dtype=torch.float16), r"input_rotation: shape \[48, 48\], expected a square \[r, r\] with r dividing"),
        (torch.ones(64, 32, dtype=torch.float16), r"input_rotation: shape \[64, 32\]"),
        (torch.eye(64, dtype=torch.float32), r"input_rotation: dtype torch.float32, but this layer computes in torch.float16"),
    ):
        with pytest.raises(RuntimeError, match=match):
            MarlinLinear(K, N, group_size=64).load_state_dict(dict(state, input_rotation=bad))


def test_layers_that_cannot_carry_it_refuse_it():
    lin = rotated_linear()
    with pytest.raises(ValueError, match="MarlinLinear24.from_linear: the Linear rotates its input online"):
        MarlinLinear24.from_linear(lin, group_size=128)
    layer = MarlinLinear.from_linear(lin, group_size=64)
    parent = nn.Module()
    parent.gate_proj = layer
    parent.up_proj = MarlinLinear.from_linear(rotated_linear(1), group_size=64)
    report = fuse_projections(parent)
    assert any("input rotation" in why for _, why in report.skipped), report.skipped
    assert isinstance(parent.gate_proj, MarlinLinear)


@pytest.mark.parametrize("act_order", [None, "aligned"])
def test_tensor_parallel_shards_keep_the_rotation(act_order):
    """Column shards keep R (the whole input); row shards rotate their own slice of whole blocks:
    the ranks' partial sums add up to the full layer (no process group needed for the shards)."""
    layer = MarlinLinear.from_linear(rotated_linear(), group_size=64, sym=False)
    if act_order == "aligned":  # each group's rows inside one rank's half of K, groups interleaved
        gen = torch.Generator().manual_seed(3)
        halves = [torch.randperm(K // 2, generator=gen) + h * K // 2 for h in range(2)]
        groups = [halves[g % 2][(g // 2) * 64:(g // 2 + 1) * 64] for g in range(K // 64)]
        layer.perm = torch.cat(groups).to(torch.int32)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(4)).half()
    full = layer(x).double()
    take, has = (lambda name, index: getattr(layer, name)[index]), (lambda name: getattr(layer, name, None) is not None)
    cols = [marlin_column_shard(layer, "up", take, has, r, 2) for r in range(2)]
    assert all(torch.equal(c.input_rotation, layer.input_rotation) for c in cols)
    got = torch.cat([c(x) for c in cols], dim=-1).double()
    assert float((got - full).abs().max() / full.abs().max()) < 2e-3
    total = layer.bias.double().clone()
    for r in range(2):
        local, gather = marlin_row_shard(layer, "down", take, has, layer.perm, r, 2)
        assert gather is None and torch.equal(local.input_rotation, layer.input_rotation)
        total = total + local(x[:, r * K // 2:(r + 1) * K // 2].contiguous()).double()
    assert float((total - full).abs().max() / full.abs().max()) < 3e-3


def test_row_shards_of_blocks_the_rank_does_not_hold_whole_are_refused():
    layer = MarlinLinear.from_linear(rotated_linear(r=128), group_size=64)
    take, has = (lambda name, index: getattr(layer, name)[index]), (lambda name: getattr(layer, name, None) is not None)
    with pytest.raises(ValueError, match=r"down: the rank's input slice \[64, 128\) is not made of whole blocks"):
        marlin_row_shard(layer, "down", take, has, None, 1, 4)


def test_gathering_row_shards_rotate_the_full_input(monkeypatch):
    """Act-order groups straddling the ranks: each rank gathers the full input and picks its rows;
    the RowParallelLinear rotates the gathered input first (its local layer does not), and the
    ranks' partial sums add up to the full layer (the all-reduce replaced by a sum here)."""
    import marlin.parallel.layers as L

    monkeypatch.setattr(L, "all_reduce_sum", lambda y, group, world_size: y)
    layer = MarlinLinear.from_linear(rotated_linear(), group_size=64, sym=False)
    layer.perm = torch.randperm(K, generator=torch.Generator().manual_seed(5)).to(torch.int32)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(6)).half()
    full = layer(x).double()
    total = torch.zeros_like(full)
    for r in range(2):
        row = L.RowParallelLinear.from_layer(layer, "down", input_is_parallel=False, rank=r, world_size=2)
        assert row.gather_index is not None and row.local.input_rotation is None
        assert torch.equal(row.input_rotation, layer.input_rotation)
        total += row(x).double() - (layer.bias.double() if r else 0)  # the bias is added on every rank
    assert float((total - full).abs().max() / full.abs().max()) < 3e-3


def test_torch_compile_fullgraph_traces_the_rotation():
    """No graph break from the rotation (aot_eager on the CPU: the tracing, as test_nn's)."""
    layer = MarlinLinear.from_linear(rotated_linear(), group_size=64)
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(7)).half()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), layer(x))


def test_cpu_reference_op_is_what_runs():
    assert ops.check_shape(K, N, 64, 4) is None  # the shapes above are ones the kernel takes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_forward_eager_and_compiled_match_the_cpu_layer():
    layer = MarlinLinear.from_linear(rotated_linear(), group_size=64, sym=False)
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(6)).half()
    y_cpu = layer(x).double()
    layer.cuda()
    y = layer(x.cuda())
    assert float((y.cpu().double() - y_cpu).abs().max() / y_cpu.abs().max()) < 2e-3
    compiled = torch.compile(layer, fullgraph=True)
    got = compiled(x.cuda()).double()  # inductor may run the small product its own way: one rounding apart
    assert float((got - y.double()).abs().max() / y.double().abs().max()) < 2e-3
