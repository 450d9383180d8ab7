"""Marlin checkpoints in transformers' ``from_pretrained``: a quantization config and a quantizer,
registered through transformers' public API (register_quantization_config / register_quantizer).

    import marlin, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained("llama-marlin", device_map="cuda")

A directory written by marlin-convert has ``quantization_config.quant_method = "marlin"`` in its
config.json, so transformers hands it to MarlinHfQuantizer, which

  1. before the weights are read (model on the meta device): reads the safetensors headers and
     swaps every nn.Linear that the checkpoint stores as ``<prefix>.b_q`` for a MarlinLinear of the
     matching shape, group size, bias and act-order permutation;
  2. lets transformers load every tensor (the MarlinLinear buffers are state_dict entries), with
     its own device_map, dtype, sharding and tied-weight handling;
  3. after loading: gives each layer a zeroed lock workspace on its device and checks each
     act-order permutation (checkpoints are untrusted input).

The model's dtype follows the checkpoint: Marlin layers compute in their scales' dtype (fp16 or
bf16), so when the dtype transformers settled on (the ``dtype`` argument, else config.json's, else
fp16) is another one, step 1 builds the rest of the model in the layers' dtype instead, with a
warning, and sets config.dtype to it. A checkpoint of a fused model (marlin.fuse_projections, then
save_pretrained) loads as a fused model.

A GPTQ checkpoint loads the same way, repacked at load time (no converted copy on disk), when its
config is replaced by the one from ``gptq_config(dir)``:

    model = AutoModelForCausalLM.from_pretrained(d, config=marlin.integrations.hf_quantizer.gptq_config(d))

Then step 1 installs holders for the GPTQ tensors and step 3 repacks each layer into a
MarlinLinear (marlin.convert.gptq, exact); ``model.save_pretrained`` then writes a Marlin checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..convert.checkpoint import SafetensorsDir, read_json
from ..convert.converter import _parse_quant_config, direct_gptq_config
from ..convert.errors import ConversionError
from ..convert.gptq import GPTQ_FORMATS, GPTQConfig, check_layer_tensors
from ..nn import MarlinLinear
from ..sparse_nn import MarlinLinear24

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["QUANT_METHOD", "MarlinConfig", "MarlinHfQuantizer", "gptq_config", "register"]

log = logging.getLogger(__name__)

QUANT_METHOD = "marlin"  # quantization_config.quant_method of a Marlin checkpoint
MARLIN_FORMAT = "marlin"  # quantization_config.checkpoint_format: the tensors are MarlinLinear buffers
SOURCE_FORMATS = (MARLIN_FORMAT,) + GPTQ_FORMATS  # gptq formats are repacked at load time


class MarlinConfig(QuantizationConfigMixin):
    """``quantization_config`` of a Marlin checkpoint (quant_method "marlin").

    ``checkpoint_format``: "marlin" (the tensors are MarlinLinear buffers, as marlin-convert
    writes them) or "gptq" / "gptq_v2" (GPTQ tensors, repacked into Marlin layers while loading;
    see gptq_config). The other fields describe the quantization (bits, group_size, sym,
    desc_act) and are kept as they are, with any extra keys, so that config.json round-trips.
    The layers themselves are described by the checkpoint's tensors, which are validated.
    """

    def __init__(
        self,
        bits: int = 4,
        group_size: int = 128,
        sym: bool = True,
        desc_act: bool = False,
        checkpoint_format: str = MARLIN_FORMAT,
        **kwargs,
    ):
        kwargs.pop("quant_method", None)
        self.quant_method = QUANT_METHOD
        self.bits = bits
        self.group_size = group_size
        self.sym = sym
        self.desc_act = desc_act
        self.checkpoint_format = checkpoint_format
        for key, value in kwargs.items():  # e.g. damp_percent, true_sequential, format: kept for the round trip
            setattr(self, key, value)
        self.post_init()

    def post_init(self) -> None:
        if not isinstance(self.checkpoint_format, str) or self.checkpoint_format.lower() not in SOURCE_FORMATS:
            raise ValueError(
                f"MarlinConfig: checkpoint_format = {self.checkpoint_format!r}, expected one of {SOURCE_FORMATS}"
            )
        self.checkpoint_format = self.checkpoint_format.lower()


def _checkpoint_dir(checkpoint_files) -> Path:
    if not checkpoint_files:
        raise ConversionError("marlin: from_pretrained gave no checkpoint files; a Marlin checkpoint is safetensors shards")
    dirs = {Path(f).parent for f in checkpoint_files}
    if len(dirs) != 1 or not all(str(f).endswith(".safetensors") for f in checkpoint_files):
        raise ConversionError(
            f"marlin: expected the checkpoint as safetensors files in one directory, got {[str(f) for f in checkpoint_files][:4]}"
        )
    return dirs.pop()


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


class _GPTQHolder(nn.Module):
    """Stands in for one nn.Linear while a GPTQ checkpoint loads: it holds the layer's GPTQ tensors
    as buffers (so transformers loads them by name) until they are repacked into a MarlinLinear."""

    def __init__(self, shapes: dict, dtypes: dict):
        super().__init__()
        for suffix, shape in shapes.items():
            self.register_buffer(suffix, torch.empty(shape, dtype=dtypes[suffix], device="meta"))


def _gptq_layers(ckpt: SafetensorsDir, group_size: int, bits: int = 4) -> dict:
    """{prefix: (shapes, dtypes)} of the GPTQ layers in the checkpoint, each checked from its header."""
    prefixes = sorted(name[: -len(".qweight")] for name in ckpt.tensors if name.endswith(".qweight"))
    if not prefixes:
        raise ConversionError(f"{ckpt.directory}: no GPTQ layers ('*.qweight' tensors) in the checkpoint")
    layers = {}
    for prefix in prefixes:
        infos = {
            name[len(prefix) + 1 :]: info
            for name, info in ckpt.tensors.items()
            if name.startswith(prefix + ".") and "." not in name[len(prefix) + 1 :]
        }
        shapes = {s: tuple(i.shape) for s, i in infos.items()}
        dtypes = {s: i.dtype for s, i in infos.items()}
        check_layer_tensors(prefix, shapes, dtypes, group_size, bits)
        layers[prefix] = (shapes, dtypes)
    return layers


class MarlinHfQuantizer(HfQuantizer):
    """Loads checkpoints with quant_method "marlin" (see the module doc). Inference only."""

    requires_calibration = True  # only pre-quantized checkpoints; quantize a float model with marlin.replace_linear

    def validate_environment(self, *args, **kwargs):
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("marlin: device_map puts layers on 'disk'; Marlin layers run on CUDA (or the CPU reference op)")

    def update_dtype(self, dtype: Optional[torch.dtype]) -> torch.dtype:
        if dtype is None or dtype == torch.float32:
            if dtype == torch.float32:
                log.info("marlin: not loading in torch.float32: Marlin layers compute in fp16 or bf16 (the checkpoint's)")
            dtype = torch.float16
        elif not _layer_takes_dtype(dtype):
            raise ValueError(
                f"marlin: dtype = {dtype}, but MarlinLinear does not compute in it; load with dtype=torch.float16 "
                "or torch.bfloat16 (or leave it out: the checkpoint's scales decide)"
            )
        self._dtype = dtype  # what the model is built in; the checkpoint's layers may overrule it
        return dtype

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        from ..hf import _install_marlin_layers, _marlin_layers

        _refuse_transformers_tp(model)

        directory = _checkpoint_dir(checkpoint_files)
        fmt = self.quantization_config.checkpoint_format
        with SafetensorsDir(directory) as ckpt:
            if fmt == MARLIN_FORMAT:
                layers = _marlin_layers(ckpt)
                _follow_layer_dtype(model, {spec["dtype"] for spec in layers.values()}, getattr(self, "_dtype", None))
                _install_marlin_layers(model, layers, torch.device("meta"))
            else:
                cfg = GPTQConfig.from_dict(dict(self.quantization_config.to_dict(), quant_method="gptq"), str(directory))
                self._gptq = cfg
                gptq_layers = _gptq_layers(ckpt, cfg.group_size, cfg.bits)
                _follow_layer_dtype(model, {dtypes["scales"] for _, dtypes in gptq_layers.values()},
                                    getattr(self, "_dtype", None))
                for prefix, (shapes, dtypes) in gptq_layers.items():
                    old = _existing_linear(model, prefix)
                    k, n = shapes["qweight"][0] * 32 // cfg.bits, shapes["qweight"][1]
                    if (old.in_features, old.out_features) != (k, n):
                        raise ConversionError(
                            f"{prefix}: the checkpoint holds a [{k} -> {n}] GPTQ layer, but the model has {old!r}"
                        )
                    _set_submodule(model, prefix, _GPTQHolder(shapes, dtypes))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        _refuse_transformers_tp(model)
        if self.quantization_config.checkpoint_format != MARLIN_FORMAT:
            _repack_gptq(model, self._gptq)
            # The model now holds Marlin layers: save_pretrained writes a Marlin checkpoint.
            self.quantization_config.checkpoint_format = MARLIN_FORMAT
        for name, module in model.named_modules():
            if isinstance(module, MarlinLinear):
                _finish_layer(name, module)
            elif isinstance(module, MarlinLinear24):
                _finish_sparse_layer(name, module)
        return model

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True  # the op has a fake kernel; forward has no host sync (tests/test_decode.py)


def _refuse_transformers_tp(model: nn.Module) -> None:
    """transformers' own tensor parallelism (from_pretrained(..., tp_plan=...) or a distributed_config)
    shards weights as DTensors along nn.Linear's layout, which cannot split Marlin's packed tensors:
    the first forward would fail deep inside the op. Refuse it at load time and name the way that
    works. (Checked before loading, where transformers has set the model's tensor-parallel size,
    and after, where it has made its own weights DTensors.)"""
    tp_size = getattr(model, "_tp_size", None)
    sharded = tp_size not in (None, 1)
    if not sharded:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # a torch without distributed tensors cannot have made any
            return
        sharded = any(isinstance(t, DTensor) for t in model.parameters())
    if sharded:
        raise ValueError(
            f"marlin: from_pretrained with transformers' tensor parallelism (tp_plan / distributed_config, "
            f"tp size {tp_size}) cannot shard Marlin's packed layers; load the checkpoint with "
            "marlin.parallel.load_sharded(model_dir) under torchrun instead (docs/PARALLEL.md)"
        )


def _follow_layer_dtype(model: nn.Module, layer_dtypes: set, built: Optional[torch.dtype]) -> None:
    """Before loading (parameters on meta): when the quantized layers compute in another dtype than
    the one the model was built in, make every floating parameter that dtype, so that transformers
    loads the other tensors (embeddings, norms, lm_head) in it, and record it in config.dtype."""
    if len(layer_dtypes) != 1:
        raise ConversionError(f"the checkpoint's quantized layers mix scale dtypes {sorted(map(str, layer_dtypes))}")
    (dtype,) = layer_dtypes
    if built is None or dtype == built:
        return
    log.warning(
        "marlin: loading in %s, the dtype of the checkpoint's quantized layers (their scales), not %s; "
        "pass dtype=%s to from_pretrained to silence this", dtype, built, dtype,
    )
    cast: dict = {}  # by identity: a parameter shared by two modules (tied embeddings) stays shared
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                if id(p) not in cast:
                    cast[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                module._parameters[name] = cast[id(p)]
    model.config.dtype = dtype


def _layer_takes_dtype(dtype: torch.dtype) -> bool:
    try:
        MarlinLinear(128, 128, bias=False, group_size=-1, device="meta", dtype=dtype)
    except (ValueError, TypeError):
        return False
    return True


def _existing_linear(model: nn.Module, prefix: str) -> nn.Linear:
    try:
        old = model.get_submodule(prefix)
    except AttributeError:
        raise ConversionError(
            f"the checkpoint has a quantized layer {prefix!r}, but the model built from config.json has no such module"
        ) from None
    if not isinstance(old, nn.Linear):
        raise ConversionError(f"{prefix}: the checkpoint holds a quantized linear layer, but the model has {old!r}")
    return old


def _repack_gptq(model: nn.Module, cfg: GPTQConfig) -> None:
    holders = [(name, m) for name, m in model.named_modules() if isinstance(m, _GPTQHolder)]
    for name, holder in holders:
        buffers = dict(holder.named_buffers())
        meta = [s for s, t in buffers.items() if t.is_meta]
        if meta:
            raise ConversionError(f"{name}: GPTQ tensor(s) {meta} were not loaded from the checkpoint")
        try:
            layer = MarlinLinear.from_gptq(
                buffers["qweight"],
                buffers["qzeros"],
                buffers["scales"],
                buffers.get("g_idx"),
                buffers.get("bias"),
                bits=cfg.bits,
                group_size=cfg.group_size,
                checkpoint_format=cfg.checkpoint_format,
                sym=cfg.sym,
            )
        except ConversionError as e:
            raise ConversionError(f"{name}: {e}") from None
        _set_submodule(model, name, layer)


def _finish_layer(name: str, layer: MarlinLinear) -> None:
    """After loading: a zeroed workspace on the layer's device, and a checked permutation."""
    from ..nn import _new_workspace

    device = layer.b_q.device
    # Always a new one: transformers materializes non-persistent buffers uninitialized, and the
    # kernel's locks must start at zero.
    layer.workspace = _new_workspace(device)
    if layer.perm is not None:
        expected = torch.arange(layer.in_features, device=device)
        if layer.perm.is_meta or not torch.equal(layer.perm.sort().values.long(), expected):
            raise ConversionError(f"{name}.perm: not a permutation of range({layer.in_features})")


def _finish_sparse_layer(name: str, layer: MarlinLinear24) -> None:
    """After loading a 2:4 layer: a zeroed workspace, and scales (and zero points) of the layer's
    dtype (the one its op computes in)."""
    from .._layer_common import new_workspace

    for what, t in (("scales", layer.b_scales), ("zero points", layer.b_zeros)):
        if t is not None and t.dtype != layer.dtype:
            raise ConversionError(
                f"{name}: a 2:4-sparse Marlin layer of dtype {layer.dtype} loaded with {t.dtype} {what}; "
                f"load with dtype={layer.dtype}"
            )
    layer.workspace = new_workspace(layer.b_q.device)


def gptq_config(model_dir: Union[str, Path], **from_pretrained_kwargs) -> "PretrainedConfig":
    """The config of the GPTQ checkpoint ``model_dir`` with its quantization config replaced by a
    MarlinConfig that repacks the GPTQ layers at load time. Pass it to from_pretrained:

        AutoModelForCausalLM.from_pretrained(d, config=gptq_config(d), device_map="cuda")

    The GPTQ config is validated first, as marlin-convert validates it (4-bit symmetric or with
    zero points, 8-bit symmetric; group 32, 64, 128 or per column; act-order): an unsupported
    checkpoint raises ConversionError (a ValueError) here.
    """
    from transformers import AutoConfig

    register()
    config = AutoConfig.from_pretrained(model_dir, **from_pretrained_kwargs)
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        raise ConversionError(f"{model_dir}: config.json has no quantization_config; expected a GPTQ checkpoint")
    quant = quant.to_dict() if hasattr(quant, "to_dict") else dict(quant)
    where = f"{model_dir}/config.json (quantization_config)"
    cfg = direct_gptq_config(_parse_quant_config(quant, where, awq_file=False), where)
    fields = {k: v for k, v in quant.items() if k not in ("quant_method", "checkpoint_format", "format")}
    fields.update(bits=cfg.bits, group_size=cfg.group_size, sym=cfg.sym, desc_act=cfg.desc_act)
    config.quantization_config = MarlinConfig(checkpoint_format=cfg.checkpoint_format, **fields).to_dict()
    return config


def register() -> bool:
    """Register MarlinConfig and MarlinHfQuantizer under quant_method "marlin" (idempotent)."""
    config_cls = AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD)
    quantizer_cls = AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD)
    if config_cls is None and quantizer_cls is None:
        register_quantization_config(QUANT_METHOD)(MarlinConfig)
        register_quantizer(QUANT_METHOD)(MarlinHfQuantizer)
        return True
    ours = config_cls is MarlinConfig and quantizer_cls is MarlinHfQuantizer
    if not ours:
        log.warning(
            "marlin: transformers already has a %r quantizer (%s, %s); marlin checkpoints load with marlin.load_quantized",
            QUANT_METHOD,
            getattr(config_cls, "__qualname__", config_cls),
            getattr(quantizer_cls, "__qualname__", quantizer_cls),
        )
    return ours


registered = register()  # importing this module is registering (see marlin.integrations)
