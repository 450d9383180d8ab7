"""fuse_projections: one Marlin layer for the projections that read the same input.

Transformers keeps q_proj / k_proj / v_proj and gate_proj / up_proj as separate layers. Each is a
small GEMM (4096 x 1024 for k and v in Llama-3-8B), where the kernel cannot fill the GPU, and each
is one more launch. Fused, they are one wider GEMM: q|k|v is 4096 x 6144, gate|up 4096 x 28672.

    report = marlin.fuse_projections(model)     # after replace_linear or from_pretrained
    print(report)

How, without touching the model's code or dequantizing anything:

  * The fused layer is the concatenation of the parts' packed buffers along N (b_q, b_scales,
    zero points, bias, and a 2:4 layer's b_meta). This is exact: the Marlin layout stores each
    64-column tile, and each 64-column block of scales, on its own (marlin/packing.py; the 2:4
    layout keeps the same tiles, marlin/sparse.py), so the packed form of [W_q | W_k] is
    [packed W_q | packed W_k] whenever every part's N is a multiple of 64 (tests/test_fuse.py
    checks it bit for bit against the packers).
  * It is registered next to the parts (``self_attn.qkv_proj``, ``mlp.gate_up_proj``), and each
    part becomes a FusedPart: called with input x, it runs the fused layer once and returns its
    columns; the next part called with the same tensor x gets its columns from that one result.
    A part called with any other tensor recomputes, so the result never depends on the order in
    which the model calls its projections. The last part to read a result drops it, so nothing
    is kept between forward passes. torch.compile traces this into a single GEMM per group.

Parts are fused only when they can share one GEMM: all MarlinLinear, or all 2:4-sparse
MarlinLinear24, with the same input size, the same weight format (buffers, dtypes, group size)
and the same act-order permutation (or none). Everything else is left alone and listed in the report.

On a tensor-parallel model (marlin.tensor_parallel or marlin.parallel.load_sharded first: shard,
then fuse) the parts are ColumnParallelLinear shards of one rank; their local layers are fused
as above into one ColumnParallelLinear holding this rank's q|k|v (or gate|up) columns side by
side, split by the local widths. Shards that gather their output (lm_head-style) are not fused.

A fused model's state_dict holds the fused names (``qkv_proj.b_q``). It loads back into a fused
model (load_state_dict), and a fused model saved with save_pretrained loads with from_pretrained
or marlin.load_quantized: the loaders see a ``qkv_proj`` layer where the model built from its
config has q/k/v_proj and install it with install_fused (the split sizes come from the parts).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch
from torch import nn

from .nn import MarlinLinear
from .sparse_nn import MarlinLinear24

__all__ = ["DEFAULT_GROUPS", "FuseReport", "FusedPart", "fuse_projections", "fuse_group", "install_fused",
           "fused_group_parts"]

log = logging.getLogger(__name__)

# fused name -> the sibling projections it replaces (Llama, Mistral, Qwen2 and most decoder LMs).
DEFAULT_GROUPS: Mapping[str, tuple] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

_TILE_N = 64  # columns per tile of the Marlin layout (weights and scales)
_PER_COLUMN = ("b_q", "b_meta", "b_scales", "b_zeros", "bias")  # buffers whose last dim runs over N
_FUSIBLE = (MarlinLinear, MarlinLinear24)  # the layer classes whose packed buffers concatenate along N
# plain attributes that describe one layer, not its format: not compared between parts
_PER_LAYER = ("out_features", "pruned_fraction")


@dataclass
class FuseReport:
    """What fuse_projections did: (fused module name, [part names]) and (parent, why) for groups kept apart."""

    fused: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fused {len(self.fused)} groups of projections, kept {len(self.skipped)} apart"]
        lines += [f"  kept {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


class _SplitResult:
    """The fused layer's last output, shared by the parts of one group (plain object, no state_dict)."""

    def __init__(self, layer: nn.Module, sizes: Sequence[int]):
        self.layer = layer
        self.sizes = list(sizes)
        self.x: Optional[torch.Tensor] = None
        self.parts: Optional[tuple] = None
        self.unread = 0

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self.x is not x:
            self.parts = self.layer(x).split(self.sizes, dim=-1)
            self.x = x
            self.unread = len(self.sizes)
        out = self.parts[index]
        self.unread -= 1
        if self.unread <= 0:  # every part has read this result: keep no activations alive
            self.x = self.parts = None
        return out


class FusedPart(nn.Module):
    """Stands where one projection was: returns its columns of the group's fused layer.

    It owns no tensors; the fused layer is registered on the same parent (``fused_name``).
    """

    def __init__(self, shared: _SplitResult, index: int, fused_name: str, in_features: int, out_features: int):
        super().__init__()
        self._shared = shared
        self.index = index
        self.fused_name = fused_name
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._shared.part(x, self.index)

    def extra_repr(self) -> str:
        start = sum(self._shared.sizes[: self.index])  # local widths: a column shard's columns on this rank
        return f"{self.fused_name}[..., {start}:{start + self._shared.sizes[self.index]}]"


def _column_shard_class():
    # imported at call time: marlin.parallel's loader reaches this module (marlin.hf's install_fused),
    # so a module-level import here would close a cycle
    from .parallel.layers import ColumnParallelLinear

    return ColumnParallelLinear


def _local_width(part: nn.Module) -> int:
    """The columns a part computes on this rank (a column shard's local layer's, else its own)."""
    return part.local.out_features if isinstance(part, _column_shard_class()) else part.out_features


def _why_not_shards(parts: Sequence[nn.Module]) -> Optional[str]:
    """_why_not for ColumnParallelLinear parts: one rank's shards that can share one local GEMM."""
    first = parts[0]
    if not all(type(p) is type(first) for p in parts):
        return "not all parts are column-parallel shards (" + ", ".join(type(p).__name__ for p in parts) + ")"
    if any(p.gather_output for p in parts):
        return "a part gathers its output over the ranks (gather_output=True)"
    if any((p.group, p.rank, p.world_size) != (first.group, first.rank, first.world_size) for p in parts):
        return "the parts are shards of different ranks or process groups"
    return _why_not([p.local for p in parts])  # column shards: local in_features = the full input's


def _why_not(parts: Sequence[nn.Module]) -> Optional[str]:
    """None if the parts can share one GEMM, else the reason."""
    first = parts[0]
    if any(isinstance(p, _column_shard_class()) for p in parts):
        return _why_not_shards(parts)
    if type(first) not in _FUSIBLE or not all(type(p) is type(first) for p in parts):
        return "not all parts are MarlinLinear, or all MarlinLinear24 (" + ", ".join(type(p).__name__ for p in parts) + ")"
    if any(p.in_features != first.in_features for p in parts):
        return "different in_features " + str([p.in_features for p in parts])
    if any(p.out_features % _TILE_N for p in parts):
        return f"out_features {[p.out_features for p in parts]} not all multiples of {_TILE_N}"
    names = {n for n, b in first.named_buffers(recurse=False) if b is not None} - {"bias"}
    for p in parts[1:]:
        other = {n for n, b in p.named_buffers(recurse=False) if b is not None} - {"bias"}
        if other != names:
            return f"different buffers {sorted(names)} vs {sorted(other)}"
    for name in names - {"workspace"}:
        ref = getattr(first, name)
        for p in parts[1:]:
            b = getattr(p, name)
            if b.dtype != ref.dtype or b.device != ref.device or b.dim() != ref.dim() or b.shape[:-1] != ref.shape[:-1]:
                return f"{name}: {ref.dtype} {tuple(ref.shape)} on {ref.device} vs {b.dtype} {tuple(b.shape)} on {b.device}"
    if any(p.bias is not None and p.bias.dtype != p.b_scales.dtype for p in parts):
        return "a bias dtype differs from its scales"
    if any(getattr(p, "input_rotation", None) is not None for p in parts):
        return "an input rotation (marlin-quantize --rotate) on a part"
    perm = getattr(first, "perm", None)  # MarlinLinear24 has no act-order permutation
    if perm is not None and not all(torch.equal(p.perm, perm) for p in parts[1:]):
        return "different act-order permutations (each part permutes its input its own way)"
    attrs = {k: v for k, v in vars(first).items() if not k.startswith("_") and k not in _PER_LAYER}
    for p in parts[1:]:
        other = {k: v for k, v in vars(p).items() if not k.startswith("_") and k not in _PER_LAYER}
        if other != attrs:
            return f"different settings {attrs} vs {other}"
    return None


def _clone_with_own_state(layer: nn.Module) -> nn.Module:
    """A new module of layer's class sharing its plain attributes but with its own buffer,
    parameter and submodule tables (format-generic: whatever settings MarlinLinear has are kept)."""
    new = layer.__class__.__new__(layer.__class__)
    new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in layer.__dict__.items()})
    return new


@torch.no_grad()
def fuse_group(parts: Sequence[nn.Module]) -> nn.Module:
    """One layer of the parts' class (MarlinLinear or MarlinLinear24) computing their outputs side
    by side (exact; see the module doc).

    Raises ValueError when the parts cannot share one GEMM (see _why_not)."""
    why = _why_not(parts)
    if why is not None:
        raise ValueError(f"fuse_group: cannot fuse these layers: {why}")
    first = parts[0]
    column_shard = _column_shard_class()
    if isinstance(first, column_shard):  # one rank's shards: fuse the local layers, wrap them again
        local = fuse_group([p.local for p in parts])
        return column_shard(local, first.in_features, sum(p.out_features for p in parts), gather_output=False,
                            group=first.group, rank=first.rank, world_size=first.world_size)
    fused = _clone_with_own_state(first)
    fused.out_features = sum(p.out_features for p in parts)
    for name in _PER_COLUMN:
        if name == "bias":
            continue
        if getattr(first, name, None) is not None:
            setattr(fused, name, torch.cat([getattr(p, name) for p in parts], dim=-1))
    if any(p.bias is not None for p in parts):
        ref = first.b_scales
        fused.bias = torch.cat(
            [p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=ref.dtype, device=ref.device) for p in parts]
        )
    if getattr(first, "perm", None) is not None:
        fused.perm = first.perm.clone()
    if hasattr(first, "pruned_fraction"):
        fused.pruned_fraction = None  # a per-layer pruning figure (replace_linear's report has the parts')
    fused.workspace = torch.zeros_like(first.workspace)  # its own zeroed lock buffer
    return fused


def fuse_projections(
    model: nn.Module, groups: Optional[Mapping[str, Sequence[str]]] = None, *, strict: bool = False
) -> FuseReport:
    """Fuse, in place, every group of sibling projections (``groups``: fused name -> part names,
    default DEFAULT_GROUPS: q/k/v and gate/up) that can share one Marlin GEMM; see the module doc.

    A module that has some but not all of a group's parts, or whose parts cannot be fused (e.g.
    still nn.Linear, different act-order permutations), is listed in ``report.skipped``; with
    ``strict`` that raises ValueError instead. Modules without any of the parts are ignored.
    """
    groups = DEFAULT_GROUPS if groups is None else groups
    report = FuseReport()
    for parent_name, parent in list(model.named_modules()):
        for fused_name, part_names in groups.items():
            present = [n for n in part_names if n in parent._modules]
            if not present:
                continue
            where = f"{parent_name}.{fused_name}" if parent_name else fused_name
            if len(present) != len(part_names):
                why = f"has {present} but not all of {list(part_names)}"
            elif fused_name in parent._modules or hasattr(parent, fused_name):
                why = f"already has an attribute {fused_name!r}"
            else:
                why = _why_not([parent._modules[n] for n in part_names])
            if why is not None:
                if strict:
                    raise ValueError(f"fuse_projections: cannot fuse {where}: {why}")
                report.skipped.append((where, why))
                log.info("fuse_projections: kept %s apart: %s", where, why)
                continue
            parts = [parent._modules[n] for n in part_names]
            fused = fuse_group(parts)
            shared = _SplitResult(fused, [_local_width(p) for p in parts])
            parent.add_module(fused_name, fused)
            for i, (name, p) in enumerate(zip(part_names, parts)):
                parent._modules[name] = FusedPart(shared, i, fused_name, p.in_features, p.out_features)
            report.fused.append((where, [f"{parent_name}.{n}" if parent_name else n for n in part_names]))
    log.info("fuse_projections: fused %d groups, kept %d apart", len(report.fused), len(report.skipped))
    return report


def fused_group_parts(parent: nn.Module, fused_name: str, groups: Optional[Mapping[str, Sequence[str]]] = None):
    """The part modules that ``parent.<fused_name>`` would stand for (e.g. q/k/v_proj for
    qkv_proj), or None when fused_name is not a group's name or parent lacks any of its parts."""
    groups = DEFAULT_GROUPS if groups is None else groups
    names = groups.get(fused_name)
    if names is None or not all(n in parent._modules for n in names):
        return None
    return [parent._modules[n] for n in names]


def install_fused(parent: nn.Module, fused_name: str, layer: nn.Module,
                  groups: Optional[Mapping[str, Sequence[str]]] = None) -> None:
    """Register ``layer``, a Marlin layer holding a group's parts side by side (as fuse_group
    makes it, e.g. read back from a fused model's checkpoint), as ``parent.<fused_name>`` and put
    FusedParts in place of the parts, split by the parts' out_features (nn.Linear or Marlin
    layers of the model built from its config). Raises ValueError when parent lacks the group's
    parts or their shapes do not add up to the layer's."""
    parts = fused_group_parts(parent, fused_name, groups)
    if parts is None:
        raise ValueError(f"install_fused: the module has no complete group of parts for {fused_name!r}")
    names = (DEFAULT_GROUPS if groups is None else groups)[fused_name]
    ins = [getattr(p, "in_features", None) for p in parts]
    outs = [getattr(p, "out_features", None) for p in parts]
    if any(i != layer.in_features for i in ins) or None in outs or sum(outs) != layer.out_features:
        raise ValueError(
            f"install_fused: {fused_name} is [{layer.in_features} -> {layer.out_features}], but its parts "
            f"{list(names)} are {[f'[{i} -> {o}]' for i, o in zip(ins, outs)]}: in_features must match and "
            "out_features add up"
        )
    if any(o % _TILE_N for o in outs):
        raise ValueError(f"install_fused: the parts' out_features {outs} are not all multiples of {_TILE_N}")
    sizes = outs
    if isinstance(layer, _column_shard_class()):  # one rank's columns of every part: split by local widths
        world = layer.world_size
        if any(o % world for o in outs) or sum(o // world for o in outs) != layer.local.out_features:
            raise ValueError(
                f"install_fused: {fused_name} holds {layer.local.out_features} columns on this rank, not the parts' "
                f"{outs} over {world} ranks"
            )
        sizes = [o // world for o in outs]
    shared = _SplitResult(layer, sizes)
    parent.add_module(fused_name, layer)
    for i, (name, p) in enumerate(zip(names, parts)):
        parent._modules[name] = FusedPart(shared, i, fused_name, p.in_features, p.out_features)
