"""Tensor-parallel wrappers around one rank's shard of a linear layer (MarlinLinear or nn.Linear).

    col = ColumnParallelLinear.from_layer(layer, name="q_proj")   # this rank's columns
    row = RowParallelLinear.from_layer(layer, name="o_proj")      # this rank's rows, one all-reduce

The rank and world size come from ``group`` (default: the default process group; one process
without torch.distributed counts as world size 1). Every rank must call with the same full layer
(or, with marlin.parallel.loader, with the same checkpoint), so that all ranks make the same plan.

* ColumnParallelLinear: x [..., K] (the same on every rank) -> this rank's y [..., N / T], or the
  full y [..., N] with ``gather_output`` (one all-gather).
* RowParallelLinear: this rank's input slice x [..., K / T] (``input_is_parallel``, the output of a
  column-parallel layer) or the full x [..., K] -> y [..., N], the partial products summed with one
  all-reduce, the bias added once after it. Act-order layers whose groups straddle the slices first
  all-gather the input (see marlin.parallel.shard).

The wrapper holds the local layer as ``.local`` so that its buffers keep their names under the
wrapper (``<name>.local.b_q``); ``in_features`` / ``out_features`` are the full layer's.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from .._layer_common import new_workspace, rotate_blocks
from ..nn import MarlinLinear
from ..sparse_nn import MarlinLinear24
from . import shard as sh
from .comm import all_gather_last, all_reduce_sum, rank_and_size

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "local_marlin",
    "local_linear",
    "marlin_column_shard",
    "marlin_row_shard",
    "linear_column_shard",
    "linear_row_shard",
    "MARLIN_LAYERS",
]

# The packed layer classes that shard by slicing (dense and 2:4-sparse; marlin.parallel.shard)
MARLIN_LAYERS = (MarlinLinear, MarlinLinear24)


def _own(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A compact copy, so that the full layer's storage can be freed after sharding."""
    return None if t is None else t.clone(memory_format=torch.contiguous_format)


def local_marlin(layer: MarlinLinear, in_features: int, out_features: int, tensors: dict) -> MarlinLinear:
    """A MarlinLinear like ``layer`` (same class, format attributes and dtype) holding ``tensors``.

    The copy keeps every attribute the layer's format adds (bit width, zero points, dtype...) and
    replaces the shape and the named buffers; buffers not in ``tensors`` that depend on the shape
    (bias, perm) are dropped. A new workspace is made for it.
    """
    new = copy.copy(layer)  # shallow: then give it its own registries before changing them
    new._parameters = dict(layer._parameters)
    new._buffers = dict(layer._buffers)
    new._modules = dict(layer._modules)
    new._non_persistent_buffers_set = set(layer._non_persistent_buffers_set)
    new.in_features, new.out_features = in_features, out_features
    for name in ("bias", "perm", "b_zeros"):
        if name in new._buffers:
            new._buffers[name] = None
    for name, t in tensors.items():
        new._buffers[name] = _own(t)
    device = new._buffers["b_q"].device
    new._buffers["workspace"] = new_workspace(device)
    return new


def local_linear(layer: nn.Linear, in_features: int, out_features: int, weight: torch.Tensor, bias) -> nn.Linear:
    """An nn.Linear holding ``weight`` [out, in] and ``bias`` (the FP16 baseline's shards)."""
    new = nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=layer.weight.dtype)
    new.weight = nn.Parameter(_own(weight.detach()), requires_grad=layer.weight.requires_grad)
    if bias is not None:
        new.bias = nn.Parameter(_own(bias.detach()), requires_grad=layer.bias.requires_grad)
    return new


def _rotation_tensor(template: nn.Module, take: sh.Take, has) -> dict:
    """{"input_rotation": R} where the layer rotates its input online (marlin-quantize --rotate),
    else {}. R [r, r] acts on each block of r inputs, so every rank keeps all of it: a column
    shard has the whole input, a row shard a slice of whole blocks (_check_row_rotation)."""
    if getattr(template, "input_rotation", None) is None:
        return {}
    if not has("input_rotation"):
        raise ValueError("the layer has an input_rotation but its source has no input_rotation tensor")
    return {"input_rotation": take("input_rotation", (slice(None), slice(None)))}


def _check_row_rotation(template: nn.Module, name: str, plan: sh.RowShard) -> None:
    """A row shard of a layer with an input rotation that rotates its own input slice [k0, k1) (no
    gather): the slice must be made of whole rotation blocks. (A gathering shard rotates the
    gathered full input: RowParallelLinear.)"""
    rot = getattr(template, "input_rotation", None)
    if rot is None or plan.gather_index is not None:
        return
    r = rot.shape[0]
    if plan.k0 % r or plan.k1 % r:
        raise ValueError(
            f"{name}: the rank's input slice [{plan.k0}, {plan.k1}) is not made of whole blocks of the layer's "
            f"{r}-wide input rotation; use a world size that splits in_features = {plan.k} into multiples of {r}"
        )


def marlin_column_shard(template: MarlinLinear, name: str, take: sh.Take, has, rank: int, world_size: int) -> MarlinLinear:
    """Rank ``rank``'s column shard of the layer ``template`` describes (it may live on the meta
    device), its tensors read with ``take(buffer, index)`` (buffers or a checkpoint)."""
    k, n = template.in_features, template.out_features
    plan = sh.plan_column(name, k, n, template.b_scales.shape[0], rank, world_size, _bits(template), _is_2_4(template))
    tensors = sh.column_tensors(plan, take, _words_per_column(template), has)
    tensors.update(_rotation_tensor(template, take, has))
    return local_marlin(template, k, plan.out_features, tensors)


def marlin_column_shards_of_parts(template: MarlinLinear, name: str, take: sh.Take, has, widths: list, rank: int,
                                  world_size: int) -> list:
    """For a layer holding fused parts side by side (``widths`` columns each, e.g. q|k|v of
    marlin.fuse_projections): each part's rank-``rank`` column shard, as separate local layers
    (in part order), read with ``take`` from the fused layer's tensors. Each part is split as that
    projection alone would be (ShardError naming the part when it cannot)."""
    k = template.in_features
    shards, offset = [], 0
    for i, width in enumerate(widths):
        part = sh.plan_column(f"{name} (part {i}, {width} columns)", k, width, template.b_scales.shape[0], rank,
                              world_size, _bits(template), _is_2_4(template))
        plan = sh.ColumnShard(name, k, template.out_features, offset + part.n0, offset + part.n1)
        tensors = sh.column_tensors(plan, take, _words_per_column(template), has)
        tensors.update(_rotation_tensor(template, take, has))
        shards.append(local_marlin(template, k, plan.out_features, tensors))
        offset += width
    return shards


def marlin_row_shard(
    template: MarlinLinear, name: str, take: sh.Take, has, perm: Optional[torch.Tensor], rank: int, world_size: int
) -> tuple:
    """(rank ``rank``'s row shard, its gather index or None); ``perm`` the layer's act-order
    permutation (a real tensor; the template's may be on the meta device)."""
    k, n = template.in_features, template.out_features
    scale_rows = template.b_scales.shape[0]
    plan = sh.plan_row(name, k, n, scale_rows, perm, rank, world_size, _bits(template), _is_2_4(template))
    _check_row_rotation(template, name, plan)
    tensors = sh.row_tensors(plan, take, scale_rows, has)
    tensors.update(_rotation_tensor(template, take, has))
    local = local_marlin(template, plan.in_features, n, tensors)
    if sh.single_group(plan, template.group_size):
        local.group_size = -1  # one group per shard: stored as per-column scales
    return local, plan.gather_index


def linear_column_shard(template: nn.Linear, name: str, take: sh.Take, has, rank: int, world_size: int) -> nn.Linear:
    """Rank ``rank``'s output columns of the nn.Linear ``template`` describes: rows of its weight
    [out, in] and of its bias, read with ``take(parameter, index)``."""
    k, n = template.in_features, template.out_features
    part = sh._check_split(name, "out_features", n, world_size, 1, "")
    rows = slice(rank * part, (rank + 1) * part)
    bias = take("bias", (rows,)) if has("bias") else None
    return local_linear(template, k, part, take("weight", (rows, slice(None))), bias)


def linear_row_shard(template: nn.Linear, name: str, take: sh.Take, rank: int, world_size: int) -> nn.Linear:
    """Rank ``rank``'s input rows of the nn.Linear ``template`` describes: columns of its weight
    [out, in], no bias (the row-parallel wrapper adds it once, after the all-reduce)."""
    k, n = template.in_features, template.out_features
    part = sh._check_split(name, "in_features", k, world_size, 1, "")
    return local_linear(template, part, n, take("weight", (slice(None), slice(rank * part, (rank + 1) * part))), None)


def _bits(layer: MarlinLinear) -> int:
    return getattr(layer, "bits", 4)


def _is_2_4(layer: nn.Module) -> bool:
    return isinstance(layer, MarlinLinear24)


def _words_per_column(layer: MarlinLinear) -> int:
    return layer.b_q.shape[1] // layer.out_features


def _buffer_take(layer: nn.Module):
    return lambda name, index: getattr(layer, name)[index]


def _has(layer: nn.Module):
    return lambda name: getattr(layer, name, None) is not None


def _checked_rank(layer: nn.Module, name: str, group, rank: Optional[int], world_size: Optional[int]) -> tuple:
    """(rank, world size) for sharding ``layer``, after checking that it is a layer we can shard."""
    if not isinstance(layer, (*MARLIN_LAYERS, nn.Linear)):
        raise TypeError(f"{name}: expected a MarlinLinear, MarlinLinear24 or nn.Linear to shard, got {type(layer).__name__}")
    return _rank_args(group, rank, world_size)


class _ShardedLinear(nn.Module):
    """What both wrappers hold: this rank's layer as ``.local`` (so that its buffers keep their
    names under the wrapper), the full layer's in/out features, the process group and the rank."""

    def __init__(self, local: nn.Module, in_features: int, out_features: int, group, rank, world_size):
        super().__init__()
        self.rank, self.world_size = _rank_args(group, rank, world_size)
        self.group = group
        self.local = local
        self.in_features, self.out_features = in_features, out_features

    def _mode_repr(self) -> str:
        """The wrapper's own settings, for extra_repr."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}/{self.world_size}, "
            + self._mode_repr()
        )


class ColumnParallelLinear(_ShardedLinear):
    """This rank's output columns of a linear layer (see the module docstring)."""

    def __init__(
        self,
        local: nn.Module,
        in_features: int,
        out_features: int,
        *,
        gather_output: bool = False,
        group=None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ):
        super().__init__(local, in_features, out_features, group, rank, world_size)
        self.gather_output = gather_output

    @classmethod
    def from_layer(
        cls, layer: nn.Module, name: str = "layer", *, gather_output: bool = False, group=None, rank=None, world_size=None
    ) -> "ColumnParallelLinear":
        """Shard ``layer`` by columns; ShardError (a ValueError naming ``name``) when the shard would
        break the packed tile width or the kernel's shape rules."""
        rank, world_size = _checked_rank(layer, name, group, rank, world_size)
        shard = marlin_column_shard if isinstance(layer, MARLIN_LAYERS) else linear_column_shard
        local = shard(layer, name, _buffer_take(layer), _has(layer), rank, world_size)
        k, n = layer.in_features, layer.out_features
        return cls(local, k, n, gather_output=gather_output, group=group, rank=rank, world_size=world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        return all_gather_last(y, self.group, self.world_size) if self.gather_output else y

    def _mode_repr(self) -> str:
        return f"gather_output={self.gather_output}"


class RowParallelLinear(_ShardedLinear):
    """This rank's input rows of a linear layer, summed over ranks (see the module docstring)."""

    def __init__(
        self,
        local: nn.Module,
        in_features: int,
        out_features: int,
        *,
        bias: Optional[torch.Tensor] = None,
        gather_index: Optional[torch.Tensor] = None,
        input_is_parallel: bool = True,
        group=None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
    ):
        super().__init__(local, in_features, out_features, group, rank, world_size)
        self.input_is_parallel = input_is_parallel
        part = in_features // self.world_size
        self.k0, self.k1 = self.rank * part, (self.rank + 1) * part
        self.register_buffer("bias", _own(bias))
        # Indices into the full input (act-order groups straddling the slices), or None.
        idx = None if gather_index is None else gather_index.to(device=_device_of(local), dtype=torch.int64)
        self.register_buffer("gather_index", idx)
        # A local layer with an input rotation (marlin-quantize --rotate) whose rows are gathered
        # from anywhere in K: the rotation acts on the full input's blocks, so this wrapper rotates
        # the gathered input before picking the rows, and the local layer does not.
        rot = getattr(local, "input_rotation", None) if idx is not None else None
        if rot is not None:
            local.input_rotation = None
        self.register_buffer("input_rotation", rot)

    @classmethod
    def from_layer(
        cls,
        layer: nn.Module,
        name: str = "layer",
        *,
        input_is_parallel: bool = True,
        group=None,
        rank=None,
        world_size=None,
    ) -> "RowParallelLinear":
        """Shard ``layer`` by input rows; ShardError naming ``name`` when a shard would split a group,
        a packed tile, or break the kernel's shape rules."""
        rank, world_size = _checked_rank(layer, name, group, rank, world_size)
        bias = layer.bias.detach() if layer.bias is not None else None
        gather_index = None
        if isinstance(layer, MARLIN_LAYERS):
            local, gather_index = marlin_row_shard(
                layer, name, _buffer_take(layer), _has(layer), getattr(layer, "perm", None), rank, world_size
            )
        else:
            local = linear_row_shard(layer, name, _buffer_take(layer), rank, world_size)
        return cls(
            local,
            layer.in_features,
            layer.out_features,
            bias=bias,
            gather_index=gather_index,
            input_is_parallel=input_is_parallel,
            group=group,
            rank=rank,
            world_size=world_size,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather_index is not None:
            if self.input_is_parallel:
                x = all_gather_last(x, self.group, self.world_size)
            if self.input_rotation is not None:
                x = rotate_blocks(x, self.input_rotation)
            x = x.index_select(-1, self.gather_index)
        elif not self.input_is_parallel and self.world_size > 1:
            x = x[..., self.k0 : self.k1]
        y = all_reduce_sum(self.local(x), self.group, self.world_size)
        return y + self.bias if self.bias is not None else y

    def _mode_repr(self) -> str:
        return f"input_is_parallel={self.input_is_parallel}, gathers_input={self.gather_index is not None}"


def _device_of(module: nn.Module) -> torch.device:
    for t in module.buffers():
        return t.device
    for t in module.parameters():
        return t.device
    return torch.device("cpu")


def _rank_args(group, rank: Optional[int], world_size: Optional[int]) -> tuple:
    """(rank, world size): from the group, unless both are given (planning without a process group)."""
    if rank is None and world_size is None:
        return rank_and_size(group)
    if rank is None or world_size is None:
        raise ValueError(f"rank = {rank}, world_size = {world_size}: give both or neither")
    return rank, world_size

