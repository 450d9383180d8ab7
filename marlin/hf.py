"""load_quantized: a Hugging Face causal LM from a Marlin checkpoint directory (see marlin-convert).

The model is built from config.json with its parameters on the meta device (no memory, no random
initialization), the layers the checkpoint stores as ``<prefix>.b_q`` are swapped for MarlinLinear
(MarlinLinear24 where a ``<prefix>.b_meta`` says the layer is 2:4-sparse), and then every tensor
of the checkpoint is assigned, strictly: a checkpoint tensor that the model does not use, or a
model tensor that the checkpoint does not give (after weight tying), is an error.
transformers is imported only when this is called.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from itertools import chain
from pathlib import Path
from typing import Iterator, Optional, Union

import torch
from torch import nn

from .convert.checkpoint import SafetensorsDir, read_json
from .convert.converter import MARLIN_FORMAT
from ._layer_common import is_rotation_shape
from .convert.errors import ConversionError

__all__ = ["load_quantized"]

log = logging.getLogger(__name__)

# Buffers that old checkpoints saved but that models recompute from the config (Llama's rotary
# frequencies); they are ignored instead of reported as unexpected.
_DERIVED_BUFFER_SUFFIXES = ("rotary_emb.inv_freq",)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Put every parameter registered inside on the meta device; buffers stay real.

    Non-persistent buffers (rotary frequencies) are computed by the model's constructor and are
    not in the checkpoint, so they must be real; parameters all come from the checkpoint.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _dtype_kwargs(dtype: torch.dtype) -> dict:
    """transformers renamed from_config's ``torch_dtype`` to ``dtype`` in 4.56."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _marlin_layers(ckpt: SafetensorsDir) -> dict:
    """{prefix: dict(k, n, group_size, bias, act_order, dtype, bits, zero_points, input_rotation[,
    sparsity])} from the checkpoint's headers, checked. The format of each layer follows from its
    tensors: the dtype from b_scales, the width from b_q's columns (2 N: 4 bits, 4 N: 8 bits), zero
    points from b_zeros, the input rotation's block from input_rotation [r, r] (None without it),
    2:4 sparsity (MarlinLinear24, sparsity "2:4") from b_meta."""
    from . import packing

    layers = {}
    for name, info in ckpt.tensors.items():
        if not name.endswith(".b_q"):
            continue
        prefix = name[: -len(".b_q")]
        if f"{prefix}.b_meta" in ckpt.tensors:
            if f"{prefix}.input_rotation" in ckpt.tensors:
                raise ConversionError(f"{prefix}: a 2:4 layer (b_meta) with input_rotation, which 2:4 layers do not take")
            layers[prefix] = _sparse_layer(ckpt, prefix)
            continue
        scales = ckpt.tensors.get(f"{prefix}.b_scales")
        if info.dtype != torch.int32 or len(info.shape) != 2:
            raise ConversionError(f"{name}: dtype {info.dtype} shape {list(info.shape)}, expected torch.int32 [K / 16, 2 N or 4 N]")
        if scales is None:
            raise ConversionError(f"{name} has no {prefix}.b_scales next to it")
        k = info.shape[0] * packing.TILE_K
        if len(scales.shape) != 2 or scales.dtype not in packing.SUPPORTED_DTYPES:
            raise ConversionError(
                f"{prefix}.b_scales: dtype {scales.dtype} shape {list(scales.shape)}, expected float16 or bfloat16 [groups, N]"
            )
        n = scales.shape[1]
        bits = {2 * n: 4, 4 * n: 8}.get(info.shape[1])
        if bits is None or k % scales.shape[0]:
            raise ConversionError(
                f"{name}: shape {list(info.shape)} does not fit {prefix}.b_scales {list(scales.shape)}: expected "
                f"[K / 16, 2 N] (4 bits) or [K / 16, 4 N] (8 bits) with N = {n} and groups dividing K"
            )
        zeros = ckpt.tensors.get(f"{prefix}.b_zeros")
        if zeros is not None and (tuple(zeros.shape) != tuple(scales.shape) or zeros.dtype != scales.dtype or bits != 4):
            raise ConversionError(
                f"{prefix}.b_zeros: dtype {zeros.dtype} shape {list(zeros.shape)}, expected the dtype and shape of "
                f"{prefix}.b_scales ({scales.dtype} {list(scales.shape)}) and 4-bit weights"
            )
        layers[prefix] = dict(
            k=k,
            n=n,
            group_size=packing.group_size_of(k, scales.shape[0]),
            bias=f"{prefix}.bias" in ckpt.tensors,
            act_order=f"{prefix}.perm" in ckpt.tensors,
            dtype=scales.dtype,
            bits=bits,
            zero_points=zeros is not None,
            input_rotation=_rotation_block(ckpt, prefix, k, scales.dtype),
        )
    if not layers:
        raise ConversionError(f"{ckpt.directory}: no Marlin layers ('*.b_q' tensors) in the checkpoint")
    return layers


def _rotation_block(ckpt: SafetensorsDir, prefix: str, k: int, dtype: torch.dtype) -> Optional[int]:
    """r of the layer's input_rotation [r, r] (of the layer's dtype, r dividing K), None without one."""
    rot = ckpt.tensors.get(f"{prefix}.input_rotation")
    if rot is None:
        return None
    shape = tuple(rot.shape)
    if not is_rotation_shape(shape, k) or rot.dtype != dtype:
        raise ConversionError(
            f"{prefix}.input_rotation: dtype {rot.dtype} shape {list(shape)}, expected {dtype} [r, r] with r dividing "
            f"K = {k}"
        )
    return shape[0]


def _sparse_layer(ckpt: SafetensorsDir, prefix: str) -> dict:
    """The spec of a 2:4 layer (MarlinLinear24: b_q [K/32, 2N], b_meta [K/32, N], fp16 or bf16
    b_scales: the layer's dtype; b_zeros of b_scales' dtype and shape with zero points), checked."""
    from . import packing, sparse

    b_q, meta = ckpt.tensors[f"{prefix}.b_q"], ckpt.tensors[f"{prefix}.b_meta"]
    scales = ckpt.tensors.get(f"{prefix}.b_scales")
    if scales is None:
        raise ConversionError(f"{prefix}.b_q has no {prefix}.b_scales next to it")
    ok = (
        b_q.dtype == torch.int32
        and meta.dtype == torch.int32
        and scales.dtype in sparse.DTYPES_2_4
        and len(b_q.shape) == len(meta.shape) == len(scales.shape) == 2
        and b_q.shape[0] == meta.shape[0] > 0
        and b_q.shape[1] == 2 * meta.shape[1] == 2 * scales.shape[1]
        and scales.shape[0] > 0
        and (meta.shape[0] * sparse.STRIP_K) % scales.shape[0] == 0
    )
    if not ok:
        raise ConversionError(
            f"{prefix}: 2:4 tensors b_q {b_q.dtype} {list(b_q.shape)}, b_meta {meta.dtype} {list(meta.shape)}, "
            f"b_scales {scales.dtype} {list(scales.shape)}; expected int32 [K / 32, 2 N], int32 [K / 32, N] and "
            "float16 or bfloat16 [groups, N] with groups dividing K"
        )
    if f"{prefix}.perm" in ckpt.tensors:
        raise ConversionError(f"{prefix}: a 2:4 layer (b_meta) with perm; the 2:4 format keeps the input order (no permutation)")
    zeros = ckpt.tensors.get(f"{prefix}.b_zeros")
    if zeros is not None and (tuple(zeros.shape) != tuple(scales.shape) or zeros.dtype != scales.dtype):
        raise ConversionError(
            f"{prefix}.b_zeros: dtype {zeros.dtype} shape {list(zeros.shape)}, expected the dtype and shape of "
            f"{prefix}.b_scales ({scales.dtype} {list(scales.shape)})"
        )
    k, n = meta.shape[0] * sparse.STRIP_K, meta.shape[1]
    return dict(
        k=k,
        n=n,
        group_size=packing.group_size_of(k, scales.shape[0]),
        bias=f"{prefix}.bias" in ckpt.tensors,
        act_order=False,
        dtype=scales.dtype,
        bits=4,
        zero_points=zeros is not None,
        sparsity="2:4",
    )


def _install_marlin_layers(model: nn.Module, layers: dict, device: torch.device) -> None:
    from .fuse import fused_group_parts, install_fused

    for prefix, spec in layers.items():
        parent_name, _, child = prefix.rpartition(".")
        try:
            old = model.get_submodule(prefix)
        except AttributeError:
            old = None
        if old is None:
            # a fused model's checkpoint (marlin.fuse_projections, then save_pretrained): qkv_proj
            # where the model has q/k/v_proj
            try:
                parent = model.get_submodule(parent_name) if parent_name else model
            except AttributeError:
                parent = None
            if parent is not None and fused_group_parts(parent, child) is not None:
                try:
                    install_fused(parent, child, _new_marlin_layer(spec, device))
                except ValueError as e:
                    raise ConversionError(f"{prefix}: {e}") from None
                continue
        if old is None:
            raise ConversionError(
                f"the checkpoint has a Marlin layer {prefix!r}, but the model built from config.json has no such module"
            )
        if not isinstance(old, nn.Linear) or (old.in_features, old.out_features) != (spec["k"], spec["n"]):
            raise ConversionError(
                f"{prefix}: the checkpoint holds a [{spec['k']} -> {spec['n']}] Marlin layer, but the model has {old!r}"
            )
        setattr(model.get_submodule(parent_name) if parent_name else model, child, _new_marlin_layer(spec, device))


def _new_marlin_layer(spec: dict, device: torch.device) -> nn.Module:
    """The empty Marlin layer a spec describes: MarlinLinear24 for a 2:4 one, else MarlinLinear."""
    common = dict(
        bias=spec["bias"],
        group_size=spec["group_size"],
        device=device,
        # specs built elsewhere (marlin.parallel) may describe only the shape: fp16 4-bit symmetric
        dtype=spec.get("dtype", torch.float16),
        zero_points=spec.get("zero_points", False),
    )
    if spec.get("sparsity") == "2:4":
        from .sparse_nn import MarlinLinear24

        return MarlinLinear24(spec["k"], spec["n"], **common)
    from .nn import MarlinLinear

    return MarlinLinear(spec["k"], spec["n"], act_order=spec["act_order"], bits=spec.get("bits", 4),
                        input_rotation=spec.get("input_rotation"), **common)


def load_quantized(
    model_dir: Union[str, Path],
    device: Optional[Union[str, torch.device]] = None,
    dtype: Optional[torch.dtype] = None,
    *,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Load a converted (Marlin) checkpoint directory as a transformers causal LM, in eval mode.

    ``device``: where the model goes (None: "cuda" if available, else "cpu"; the CPU op is a slow
    reference). ``dtype``: the model's dtype, which must be the one its Marlin layers compute in
    (their scales' dtype, float16 or bfloat16); None takes it from the checkpoint. The model
    class comes from config.json via transformers.AutoModelForCausalLM (``trust_remote_code`` is
    passed on). Raises ConversionError (a ValueError) when the directory is not a Marlin
    checkpoint or does not match the model its config.json describes.
    """
    try:
        import transformers
    except ImportError as e:  # pragma: no cover
        raise ImportError("load_quantized needs transformers: pip install 'transformers>=4.40'") from e
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"load_quantized: dtype = {dtype}, expected torch.float16, torch.bfloat16 or None")
    model_dir = Path(model_dir)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)

    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{config_path} not found; expected a model directory written by marlin-convert")
    raw = read_json(config_path)
    quant = raw.get("quantization_config") if isinstance(raw, dict) else None
    fmt = quant.get("checkpoint_format") if isinstance(quant, dict) else None
    if fmt != MARLIN_FORMAT:
        raise ConversionError(
            f"{config_path}: quantization_config.checkpoint_format = {fmt!r}, expected {MARLIN_FORMAT!r}; "
            "convert a GPTQ, AWQ or compressed-tensors checkpoint first: marlin-convert SRC DST"
        )

    config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    # The layers are swapped here; transformers must not try to set up GPTQ kernels itself.
    if hasattr(config, "quantization_config"):
        del config.quantization_config

    with SafetensorsDir(model_dir) as ckpt:
        layers = _marlin_layers(ckpt)
        dtype = _layers_dtype(layers, dtype, model_dir, "load_quantized")
        with _parameters_on_meta():
            model = transformers.AutoModelForCausalLM.from_config(
                config, trust_remote_code=trust_remote_code, **_dtype_kwargs(dtype)
            )
        _install_marlin_layers(model, layers, device)
        state = {}
        for name in ckpt.tensors:
            t = ckpt.get(name)
            if t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)  # e.g. norms saved in fp32; b_scales and b_zeros were checked to have dtype
            state[name] = t.to(device)

    _assign_checkpoint(model, state, model_dir, device, "load_quantized")
    return model


def _layers_dtype(layers: dict, dtype: Optional[torch.dtype], model_dir: Path, where: str) -> torch.dtype:
    """The dtype a model with these quantized layers is built in: the one their scales have (all
    the same), which an explicit ``dtype`` must equal (the layers compute in it; no silent cast)."""
    layer_dtypes = {spec.get("dtype", torch.float16) for spec in layers.values()}
    if len(layer_dtypes) != 1:
        raise ConversionError(f"{model_dir}: the quantized layers mix scale dtypes {sorted(map(str, layer_dtypes))}")
    (layer_dtype,) = layer_dtypes
    if dtype is not None and dtype != layer_dtype:
        raise ValueError(
            f"{where}: dtype = {dtype}, but the checkpoint's quantized layers compute in {layer_dtype} "
            "(their scales' dtype); pass that dtype or None"
        )
    return layer_dtype


def _assign_checkpoint(model: nn.Module, state: dict, model_dir: Path, device: torch.device, where: str) -> None:
    """Put the checkpoint tensors ``state`` into ``model`` (built on the meta device) and finish it
    on ``device`` in eval mode, shared by load_quantized and marlin.parallel.load_sharded.

    Ties the shared weights first, then refuses (ConversionError) a checkpoint that lacks a tensor
    the model has or holds one the model does not use: strict=False alone would leave meta tensors
    or drop weights silently. Derived buffers the layers rebuild themselves are ignored.
    """
    import transformers

    ignored = [k for k in state if k.endswith(_DERIVED_BUFFER_SUFFIXES)]
    result = model.load_state_dict(state, strict=False, assign=True)
    unexpected = [k for k in result.unexpected_keys if k not in ignored]
    model.tie_weights()  # e.g. lm_head.weight = embed_tokens.weight when the checkpoint stores one copy
    missing = [name for name, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if unexpected or missing:
        parts = []
        if missing:
            parts.append(f"{len(missing)} model tensor(s) not in the checkpoint, e.g. {missing[:5]}")
        if unexpected:
            parts.append(f"{len(unexpected)} checkpoint tensor(s) the model does not use, e.g. {unexpected[:5]}")
        raise ConversionError(f"{model_dir}: checkpoint and config.json do not match: " + "; ".join(parts))
    if ignored:
        log.info("%s: ignored %d derived buffers (%s, ...)", where, len(ignored), ignored[0])

    model.to(device)  # the non-persistent buffers built by the constructor (rotary frequencies)
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(model_dir)
    model.eval()
