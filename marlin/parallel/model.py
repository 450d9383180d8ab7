"""tensor_parallel: shard a model's linear layers in place, following transformers' ``tp_plan``.

    dist.init_process_group("nccl")                      # every rank holds the same model
    report = marlin.tensor_parallel(model)               # model.tp_plan, e.g. Llama's
    print(report)

The plan maps module names (``*`` matches one name part, e.g. ``model.layers.*.mlp.down_proj``)
to transformers' style names. The styles used here:

| style | layer becomes |
|---|---|
| ``colwise`` | ColumnParallelLinear, output kept sharded for the next layer (q/k/v, gate/up) |
| ``colwise_rep``, ``colwise_gather_output`` | ColumnParallelLinear with the output gathered (lm_head) |
| ``rowwise``, ``rowwise_rep`` | RowParallelLinear on the sharded input (o_proj, down_proj) |
| ``rowwise_split_input`` | RowParallelLinear on the full input, sliced locally |

Other styles (embeddings, packed projections, experts, sequence parallel) stay replicated and are
listed in the report. A module under a column or row style that is not a MarlinLinear or
nn.Linear (e.g. a projection fused by marlin.fuse_projections) is refused with ShardError: keeping
it whole while its neighbours are split would give wrong answers. Sharding q/k/v by
columns gives each rank num_heads / T query heads and num_key_value_heads / T key-value heads, so
both must divide by the world size (checked when the config has them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from ..nn import MarlinLinear
from .comm import rank_and_size
from .layers import ColumnParallelLinear, RowParallelLinear
from .shard import ShardError

__all__ = ["tensor_parallel", "TPReport", "model_tp_plan", "style_of"]

_COLUMN = {"colwise": False, "colwise_rep": True, "colwise_gather_output": True}
_ROW = {"rowwise": True, "rowwise_rep": True, "rowwise_split_input": False}


@dataclass
class TPReport:
    """What tensor_parallel did: (name, style) sharded, (name, why) kept replicated."""

    rank: int = 0
    world_size: int = 1
    sharded: list = field(default_factory=list)
    kept: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"rank {self.rank}/{self.world_size}: sharded {len(self.sharded)} layers, kept {len(self.kept)} replicated"]
        lines += [f"  kept {name}: {why}" for name, why in self.kept]
        return "\n".join(lines)


def model_tp_plan(model: nn.Module) -> dict:
    """The model's tensor-parallel plan with full module names: ``model.tp_plan`` (transformers >= 4.51),
    else the config's ``base_model_tp_plan`` under the base model prefix."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        return {f"{prefix}.{key}": style for key, style in base.items()}
    return dict(base)


def _compile(plan: dict) -> list:
    out = []
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not isinstance(style, str):
            raise TypeError(f"tensor_parallel: plan entry {pattern!r}: {style!r}, expected str: str")
        regex = "^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$"
        out.append((re.compile(regex), style))
    return out


def style_of(name: str, compiled: list) -> Optional[str]:
    """The style of the first plan pattern matching ``name`` in full, or None."""
    for regex, style in compiled:
        if regex.match(name):
            return style
    return None


def _check_heads(model: nn.Module, world_size: int, sharded_names: list) -> None:
    config = getattr(model, "config", None)
    if config is None or world_size == 1 or not any("attn" in n for n in sharded_names):
        return
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    for what, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if isinstance(value, int) and value % world_size:
            raise ShardError(
                f"tensor_parallel: config.{what} = {value} does not divide by world_size = {world_size}; "
                "each rank must hold whole attention heads"
            )


def tensor_parallel(
    model: nn.Module,
    plan: Optional[dict] = None,
    *,
    group=None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
) -> TPReport:
    """Replace, in place, the layers of ``model`` named by ``plan`` (default: model_tp_plan(model))
    with this rank's ColumnParallelLinear / RowParallelLinear shards. Every rank must call it on
    the same model. Raises ShardError (ValueError) naming the first layer that cannot be split,
    before any layer is replaced."""
    compiled = _compile(model_tp_plan(model) if plan is None else plan)
    if not compiled:
        raise ValueError("tensor_parallel: empty plan; pass plan={'model.layers.*.mlp.up_proj': 'colwise', ...}")
    if rank is None and world_size is None:
        rank, world_size = rank_and_size(group)
    report = TPReport(rank=rank, world_size=world_size)
    todo = []
    for name, module in model.named_modules():
        style = style_of(name, compiled)
        if style is None:
            continue
        if style not in _COLUMN and style not in _ROW:
            report.kept.append((name, f"style {style!r} is not supported for a {type(module).__name__}"))
        elif isinstance(module, (MarlinLinear, nn.Linear)):
            todo.append((name, module, style))
        else:
            # Keeping one projection whole while its neighbours are split would feed the row-parallel
            # layer full-width inputs: a wrong answer, so refuse.
            hint = " (fused projections: shard first, fuse never)" if type(module).__name__ == "FusedPart" else ""
            raise ShardError(
                f"tensor_parallel: {name} has style {style!r} but is a {type(module).__name__}{hint}; only "
                "MarlinLinear and nn.Linear layers can be split"
            )
    _check_heads(model, world_size, [name for name, _, _ in todo])
    new = {}
    for name, module, style in todo:  # build every shard first: an error leaves the model untouched
        kw = dict(group=group, rank=rank, world_size=world_size)
        if style in _COLUMN:
            new[name] = ColumnParallelLinear.from_layer(module, name, gather_output=_COLUMN[style], **kw)
        else:
            new[name] = RowParallelLinear.from_layer(module, name, input_is_parallel=_ROW[style], **kw)
    for name, layer in new.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        report.sharded.append((name, next(s for n, _, s in todo if n == name)))
    return report
