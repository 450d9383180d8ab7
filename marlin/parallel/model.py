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
it whole while its neighbours are split would give wrong answers (shard first, then fuse: fuse_projections
fuses each rank's column shards). Sharding q/k/v by
columns gives each rank num_heads / T query heads and num_key_value_heads / T key-value heads, so
both must divide by the world size (checked when the config has them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from ..nn import MarlinLinear
from ..sparse_nn import MarlinLinear24
from .comm import rank_and_size
from .layers import ColumnParallelLinear, RowParallelLinear
from .shard import ShardError

__all__ = ["tensor_parallel", "TPReport", "model_tp_plan", "style_of", "LLAMA_PLAN", "localize_attention"]

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
    plan = {}
    for attr in ("tp_plan", "_tp_plan"):
        try:
            value = getattr(model, attr, None)
        except Exception:  # noqa: BLE001  (a property of some transformers versions needs a device mesh)
            value = None
        if isinstance(value, dict) and value:
            plan = dict(value)
            break
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    for key, style in base.items():  # the config's plan is relative to the base model
        full = f"{prefix}.{key}" if prefix and hasattr(model, prefix) else key
        plan.setdefault(full, style)
    return plan


# Llama's plan (Llama, Mistral, Qwen2 and most decoder LMs use these names), for models or
# transformers versions without a tp_plan.
LLAMA_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}


def _compile(plan: dict) -> list:
    out = []
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not isinstance(style, str):
            raise TypeError(f"tensor_parallel: plan entry {pattern!r}: {style!r}, expected str: str")
        regex = "^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$"
        out.append((re.compile(regex), style))
    return out


def style_of(name: str, compiled: list, base_prefix: str = "") -> Optional[str]:
    """The style of the first plan pattern matching ``name`` in full, or None. With ``base_prefix``
    (e.g. "model"), a pattern relative to the base model ("layers.*.mlp.up_proj") matches too."""
    names = [name]
    if base_prefix and name.startswith(base_prefix + "."):
        names.append(name[len(base_prefix) + 1 :])
    for regex, style in compiled:
        if any(regex.match(n) for n in names):
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


def planned_layers(model: nn.Module, compiled: list, report: TPReport, where: str, keep=None, done=()) -> list:
    """(name, layer, style) of every layer of ``model`` that the compiled plan shards, checked
    against the model's head counts. A style this package does not apply, or a reason that
    ``keep(name, layer)`` gives (or None), keeps the layer whole, noted in ``report.kept``. A
    planned layer that is neither MarlinLinear nor nn.Linear raises ShardError naming ``where``.
    ``done``: names already sharded by the caller (the parts of a fused checkpoint layer), skipped."""
    base_prefix = getattr(model, "base_model_prefix", "")
    todo = []
    for name, module in model.named_modules():
        style = style_of(name, compiled, base_prefix)
        if style is None or name in done:
            continue
        if style not in _COLUMN and style not in _ROW:
            report.kept.append((name, f"style {style!r} is not supported for a {type(module).__name__}"))
        elif keep is not None and (why := keep(name, module)) is not None:
            report.kept.append((name, why))
        elif isinstance(module, (MarlinLinear, MarlinLinear24, nn.Linear)):
            todo.append((name, module, style))
        else:
            # Keeping one projection whole while its neighbours are split would feed the row-parallel
            # layer full-width inputs: a wrong answer, so refuse.
            hint = " (fused projections: shard first, then fuse_projections)" if type(module).__name__ == "FusedPart" else ""
            raise ShardError(
                f"{where}: {name} has style {style!r} but is a {type(module).__name__}{hint}; only "
                "MarlinLinear, MarlinLinear24 and nn.Linear layers can be split"
            )
    _check_heads(model, report.world_size, [name for name, _, _ in todo] + list(done))
    return todo


def tensor_parallel(
    model: nn.Module,
    plan: Optional[dict] = None,
    *,
    group=None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
) -> TPReport:
    """Replace, in place, the layers of ``model`` named by ``plan`` (default: model_tp_plan(model),
    or LLAMA_PLAN when the model has none)
    with this rank's ColumnParallelLinear / RowParallelLinear shards. Every rank must call it on
    the same model. Raises ShardError (ValueError) naming the first layer that cannot be split,
    before any layer is replaced."""
    if plan is None:
        plan = model_tp_plan(model) or LLAMA_PLAN
    compiled = _compile(plan)
    if not compiled:
        raise ValueError("tensor_parallel: empty plan; pass plan={'model.layers.*.mlp.up_proj': 'colwise', ...}")
    if rank is None and world_size is None:
        rank, world_size = rank_and_size(group)
    report = TPReport(rank=rank, world_size=world_size)
    todo = planned_layers(model, compiled, report, "tensor_parallel")
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
    localize_attention(model, world_size)
    return report


def localize_attention(model: nn.Module, world_size: int) -> None:
    """Head counts of attention modules whose q_proj is now a column shard, divided by the world size.

    Current transformers reshape q/k/v with ``-1`` heads and need nothing; older versions (and
    some remote-code models) reshape with ``self.num_heads`` / ``self.num_key_value_heads`` /
    ``self.hidden_size`` of the attention module, which must then count this rank's heads.
    """
    if world_size == 1:
        return
    for module in model.modules():
        q = getattr(module, "q_proj", None)
        # a fused checkpoint's q_proj is a FusedPart: its columns are sharded with its fused layer's
        shard = getattr(module, q.fused_name, None) if type(q).__name__ == "FusedPart" else q
        if not isinstance(shard, ColumnParallelLinear) or shard.gather_output or getattr(module, "_tp_localized", False):
            continue
        for attr in ("num_heads", "num_key_value_heads"):
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value % world_size == 0:
                setattr(module, attr, value // world_size)
        hidden = getattr(module, "hidden_size", None)
        if isinstance(hidden, int) and hidden == q.out_features:  # the attention width, not the model's
            module.hidden_size = hidden // world_size
        module._tp_localized = True
