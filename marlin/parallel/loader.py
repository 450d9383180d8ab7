"""load_sharded: each tensor-parallel rank loads its own slices of a Marlin checkpoint directory.

    dist.init_process_group("nccl")               # torchrun --nproc-per-node T
    torch.cuda.set_device(local_rank)
    model = marlin.parallel.load_sharded("llama-marlin")

The model is built from config.json on the meta device (as marlin.load_quantized does), the
layers named by the tensor-parallel plan (default: the model's ``tp_plan``) become this rank's
ColumnParallelLinear / RowParallelLinear shards, and their tensors are read from the safetensors
files as slices (safetensors reads only the requested bytes of a memory-mapped file): a rank never
holds another rank's weights, on the GPU or in host memory. Everything else (embeddings, norms,
layers outside the plan) is read whole on every rank. Act-order layers also read their full
``perm`` (K int32 values) to plan the split.

A checkpoint saved after marlin.fuse_projections (q|k|v as ``qkv_proj``, gate|up as
``gate_up_proj``) is split by part: each rank reads each projection's own column slice of the fused
tensors and holds them side by side.

GPTQ checkpoints load directly too: each rank converts only its slices of each GPTQ layer (exact;
marlin.parallel.gptq_source says what is read). Converting once with ``marlin-convert`` and
loading the result is faster when the model is loaded often.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import safe_open
from torch import nn

from ..convert.checkpoint import SafetensorsDir, read_json
from ..convert.converter import MARLIN_FORMAT, QUANTIZE_CONFIG_FILE, _read_quant_configs, direct_gptq_config
from ..convert.errors import ConversionError
from ..convert.gptq import GPTQConfig
from ..hf import (_assign_checkpoint, _dtype_kwargs, _install_marlin_layers, _layers_dtype, _marlin_layers,
                  _parameters_on_meta)
from .._layer_common import new_workspace
from ..nn import MarlinLinear
from .comm import rank_and_size
from .gptq_source import GPTQSource
from .layers import (
    MARLIN_LAYERS,
    ColumnParallelLinear,
    RowParallelLinear,
    linear_column_shard,
    linear_row_shard,
    marlin_column_shard,
    marlin_column_shards_of_parts,
    marlin_row_shard,
)
from .model import (
    _COLUMN,
    _ROW,
    LLAMA_PLAN,
    TPReport,
    _compile,
    localize_attention,
    model_tp_plan,
    planned_layers,
    style_of,
)
from .shard import ShardError

__all__ = ["load_sharded"]

log = logging.getLogger(__name__)


class _SliceReader:
    """Reads whole tensors or slices of them from a validated SafetensorsDir's files."""

    def __init__(self, ckpt: SafetensorsDir, device: torch.device):
        self.ckpt, self.device = ckpt, device
        self._files: dict = {}
        self.used: set = set()

    def has(self, name: str) -> bool:
        return name in self.ckpt.tensors

    def get(self, name: str, index: Optional[tuple] = None) -> torch.Tensor:
        info = self.ckpt.tensors[name]
        handle = self._files.get(info.file)
        if handle is None:
            handle = self._files[info.file] = safe_open(str(self.ckpt.directory / info.file), framework="pt", device="cpu")
        self.used.add(name)
        t = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
        return t.to(self.device)


def _layer_access(reader: _SliceReader, name: str) -> tuple:
    """(take(buffer, index), has(buffer)) over the checkpoint tensors of the layer ``name``."""

    def take(buffer: str, index: tuple) -> torch.Tensor:
        return reader.get(f"{name}.{buffer}", index)

    def has(buffer: str) -> bool:
        return reader.has(f"{name}.{buffer}")

    return take, has


def _shard_marlin(module: nn.Module, name: str, style: str, reader: _SliceReader, kw: dict) -> nn.Module:
    take, has = _layer_access(reader, name)
    k, n = module.in_features, module.out_features
    rank, world_size = kw["rank"], kw["world_size"]
    if style in _COLUMN:
        local = marlin_column_shard(module, name, take, has, rank, world_size)
        return ColumnParallelLinear(local, k, n, gather_output=_COLUMN[style], **kw)
    perm = reader.get(f"{name}.perm").cpu() if has("perm") else None
    local, gather_index = marlin_row_shard(module, name, take, has, perm, rank, world_size)
    bias = reader.get(f"{name}.bias") if has("bias") else None
    return RowParallelLinear(
        local, k, n, bias=bias, gather_index=gather_index, input_is_parallel=_ROW[style], **kw
    )


def _shard_fused_groups(model: nn.Module, compiled: list, reader: _SliceReader, kw: dict, report: TPReport) -> set:
    """A checkpoint saved after marlin.fuse_projections holds q|k|v (gate|up) as one layer, which
    the loader installed with FusedParts in place of the parts. Where the plan splits every part by
    columns, each rank reads each part's own column slice from the fused tensors and holds them side
    by side (marlin_column_shards_of_parts, then fuse_group), split again by the local widths.
    Returns the part names sharded this way; ShardError where the plan wants anything else of them."""
    from ..fuse import DEFAULT_GROUPS, FusedPart, fuse_group, install_fused

    base_prefix = getattr(model, "base_model_prefix", "")
    done = set()
    for parent_name, parent in list(model.named_modules()):
        for fused_name, part_names in DEFAULT_GROUPS.items():
            layer = parent._modules.get(fused_name)
            if layer is None or not all(isinstance(parent._modules.get(n), FusedPart) for n in part_names):
                continue
            full = [f"{parent_name}.{n}" if parent_name else n for n in (fused_name, *part_names)]
            styles = [style_of(n, compiled, base_prefix) for n in full[1:]]
            if all(s is None for s in styles):
                continue  # outside the plan: read whole like any other tensor
            if any(s not in _COLUMN or _COLUMN[s] for s in styles):
                raise ShardError(
                    f"load_sharded: {full[0]} holds {list(part_names)} fused (a checkpoint saved after "
                    f"fuse_projections) and the plan gives them {styles}; a fused layer is split only where every "
                    "part is column-parallel without a gathered output ('colwise')"
                )
            if not isinstance(layer, MARLIN_LAYERS):
                raise ShardError(f"load_sharded: {full[0]} is a {type(layer).__name__}, expected a Marlin layer")

            take, has = _layer_access(reader, full[0])
            widths = [parent._modules[n].out_features for n in part_names]
            parts = marlin_column_shards_of_parts(layer, full[0], take, has, widths, kw["rank"], kw["world_size"])
            local = fuse_group(parts)
            install_fused(parent, fused_name, ColumnParallelLinear(local, layer.in_features, layer.out_features, **kw))
            report.sharded += list(zip(full[1:], styles))
            done.update(full[1:])
    return done


def _shard_linear(module: nn.Linear, name: str, style: str, reader: _SliceReader, kw: dict, dtype) -> nn.Module:
    rank, world_size = kw["rank"], kw["world_size"]
    k, n = module.in_features, module.out_features

    def get(suffix: str, index: tuple) -> torch.Tensor:
        t = reader.get(f"{name}.{suffix}", index)
        return t.to(dtype) if t.is_floating_point() else t

    def has(suffix: str) -> bool:
        return reader.has(f"{name}.{suffix}")

    if style in _COLUMN:
        local = linear_column_shard(module, name, get, has, rank, world_size)
        return ColumnParallelLinear(local, k, n, gather_output=_COLUMN[style], **kw)
    local = linear_row_shard(module, name, get, rank, world_size)
    bias = get("bias", (slice(None),)) if has("bias") else None
    return RowParallelLinear(local, k, n, bias=bias, input_is_parallel=_ROW[style], **kw)


def _shard_gptq(module: MarlinLinear, name: str, style: str, gptq: GPTQSource, kw: dict, device) -> nn.Module:
    k, n = module.in_features, module.out_features
    rank, world_size = kw["rank"], kw["world_size"]
    if style in _COLUMN:
        local = gptq.column(module, name, rank, world_size, device)
        layer = ColumnParallelLinear(local, k, n, gather_output=_COLUMN[style], **kw)
    else:
        local, gather_index, bias = gptq.row(module, name, rank, world_size, device)
        layer = RowParallelLinear(local, k, n, bias=bias, gather_index=gather_index, input_is_parallel=_ROW[style], **kw)
    gptq.reader.used.update(gptq.names(name))
    return layer


def report_names(report: TPReport) -> set:
    return {name for name, _ in report.sharded}


def _checkpoint_kind(model_dir: Path) -> Optional[GPTQConfig]:
    """None for a Marlin checkpoint, the parsed GPTQ config for a GPTQ one; ConversionError otherwise."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{config_path} not found; expected a Marlin or GPTQ model directory")
    raw = read_json(config_path)
    quant = raw.get("quantization_config") if isinstance(raw, dict) else None
    fmt = quant.get("checkpoint_format") if isinstance(quant, dict) else None
    if fmt == MARLIN_FORMAT:
        return None
    if quant is not None or (model_dir / QUANTIZE_CONFIG_FILE).is_file():
        # validates the config of each method; GPTQ's is the one converted per rank
        return direct_gptq_config(_read_quant_configs(model_dir).parsed, f"load_sharded: {model_dir}")
    raise ConversionError(
        f"{config_path}: no quantization_config (and no {QUANTIZE_CONFIG_FILE}); expected a Marlin checkpoint "
        "(marlin-convert) or a GPTQ one"
    )


def load_sharded(
    model_dir: Union[str, Path],
    device: Optional[Union[str, torch.device]] = None,
    dtype: Optional[torch.dtype] = None,
    *,
    plan: Optional[dict] = None,
    group=None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """This rank's part of a Marlin (or GPTQ) checkpoint directory as a transformers causal LM, in eval mode.

    ``device``: this rank's device (None: the current CUDA device if CUDA is available, else the
    CPU). ``dtype``: the model's dtype, which must be the one its quantized layers compute in (their
    scales' dtype, float16 or bfloat16); None takes it from the checkpoint. ``plan``: {module name pattern: style} as for marlin.tensor_parallel (None: the model's
    tp_plan). The rank and world size come from ``group`` (default process group). Raises
    ConversionError when the directory is not a Marlin checkpoint or does not match its config,
    ShardError naming the layer when a shard would break the kernel's shape rules. The report of
    what was sharded is ``model.tp_report``.
    """
    import transformers

    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"load_sharded: dtype = {dtype}, expected torch.float16, torch.bfloat16 or None")
    model_dir = Path(model_dir)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    rank, world_size = rank_and_size(group)
    kw = dict(group=group, rank=rank, world_size=world_size)

    gptq_cfg = _checkpoint_kind(model_dir)  # None: a Marlin checkpoint
    config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config

    report = TPReport(rank=rank, world_size=world_size)
    with SafetensorsDir(model_dir) as ckpt:
        reader = _SliceReader(ckpt, device)
        gptq = None if gptq_cfg is None else GPTQSource(reader, gptq_cfg)
        layers = _marlin_layers(ckpt) if gptq is None else gptq.specs
        dtype = _layers_dtype(layers, dtype, model_dir, "load_sharded")
        with _parameters_on_meta():
            model = transformers.AutoModelForCausalLM.from_config(
                config, trust_remote_code=trust_remote_code, **_dtype_kwargs(dtype)
            )
        _install_marlin_layers(model, layers, torch.device("meta"))  # shapes only; no memory
        compiled = _compile((model_tp_plan(model) or LLAMA_PLAN) if plan is None else plan)

        def tied(name: str, module: nn.Module) -> Optional[str]:
            if isinstance(module, nn.Linear) and not reader.has(f"{name}.weight"):
                return "weight not in the checkpoint (tied to another tensor): kept whole"
            return None

        done = _shard_fused_groups(model, compiled, reader, kw, report)
        todo = planned_layers(model, compiled, report, "load_sharded", keep=tied, done=done)
        for name, module, style in todo:
            if isinstance(module, MarlinLinear) and gptq is not None:
                new = _shard_gptq(module, name, style, gptq, kw, device)
            elif isinstance(module, MARLIN_LAYERS):  # dense or 2:4 (sliced alike: marlin.parallel.shard)
                new = _shard_marlin(module, name, style, reader, kw)
            else:
                new = _shard_linear(module, name, style, reader, kw, dtype)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
            report.sharded.append((name, style))
        state = {}
        if gptq is not None:  # GPTQ layers outside the plan: converted whole
            for prefix in layers:
                if prefix in report_names(report):
                    continue
                for buffer, t in gptq.whole(prefix, device).items():
                    state[f"{prefix}.{buffer}"] = t
                reader.used.update(gptq.names(prefix))
        for name in ckpt.tensors:
            if name in reader.used:
                continue
            t = reader.get(name)
            state[name] = t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    localize_attention(model, world_size)
    for module in model.modules():  # Marlin layers outside the plan were built on the meta device
        if isinstance(module, MARLIN_LAYERS) and module.workspace.is_meta:
            module.workspace = new_workspace(device)
    _assign_checkpoint(model, state, model_dir, device, "load_sharded")
    model.tp_report = report
    return model
