"""The compressed-tensors "pack-quantized" checkpoint format (llm-compressor W4A16 / W8A16), and
the conversion of one such layer into the Marlin format.

A quantized linear layer ``<prefix>`` (nn.Linear weight W [N, K], G groups along K) is stored as

    <prefix>.weight_packed      int32 [N, K * bits / 32]  values along K, element i at bits
                                                          bits * i of the row's bit stream, lowest
                                                          first, each stored as q + 2^(bits-1)
    <prefix>.weight_scale       fp16/bf16 [N, G]          G = K / group_size ("group"), 1 ("channel")
    <prefix>.weight_zero_point  int32 [N * bits / 32, G]  asymmetric only: zero points packed the
                                                          same way along N (dim 0)
    <prefix>.weight_shape       int [2]                   (N, K)
    <prefix>.weight_g_idx       int [K]                   optional (activation ordering "group")
    <prefix>.bias               [N]                       optional

and W[n, k] = scale[n, g(k)] * (q[n, k] - zp[n, g(k)]) with signed q and zp (zp = 0 when
symmetric). In Marlin's terms u = q + 2^(bits-1) and z = zp + 2^(bits-1): 4-bit symmetric and
8-bit symmetric layers become Marlin's symmetric formats, 4-bit asymmetric ones the 4-bit format
with zero points, all exact with the same scales.

2:4-sparse checkpoints (llm-compressor's 2:4 pruning, ``sparsity_config`` with
``sparsity_structure: "2:4"`` and the weights stored ``"dense"``, i.e. with the pruned zeros in
place: q = zp, W = 0): every layer whose weights (q - zp, with the same zero point conventions as
the dense path) have at most two non-zeros in each group of 4 inputs, and that the 2:4 kernel
takes (4-bit, symmetric or asymmetric, scales of a dtype it computes in, group 128, 64, 32 or
channel, no activation ordering, K a multiple of 128, N of 64), becomes a MarlinLinear24 layer (b_q,
b_meta, b_scales, and b_zeros when asymmetric; marlin/sparse.py), exact with the same scales and
zero points; the others convert as dense layers, and the report says why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import torch

from .. import ops, packing, sparse
from .errors import ConversionError
from .tensor_checks import check_layer_names, shape_str as _shape_str, tensor_expecter
from .gptq import MarlinTensors, act_order_permutation

__all__ = [
    "CompressedTensorsConfig",
    "CT_LAYER_SUFFIXES",
    "check_ct_layer_tensors",
    "unpack_ct",
    "ct_to_marlin",
    "dequantize_ct",
]

CT_LAYER_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "bias")
_SCALE_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CompressedTensorsConfig:
    """What a compressed-tensors quantization_config must say for the checkpoint to convert."""

    bits: int
    group_size: int  # -1 for the "channel" strategy
    sym: bool
    sparsity: Optional[str] = None  # "2:4": sparsity_config says the weights were pruned 2:4

    @classmethod
    def from_dict(cls, config: Any, source: str) -> "CompressedTensorsConfig":
        if not isinstance(config, dict):
            raise ConversionError(f"{source}: the quantization config is a {type(config).__name__}, expected a JSON object")
        groups = config.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ConversionError(f"{source}: compressed-tensors config without config_groups")
        parsed = {cls._parse_group(name, g, config.get("format"), source) for name, g in groups.items()}
        if len(parsed) != 1:
            raise ConversionError(
                f"{source}: the config groups quantize differently ({sorted(map(str, parsed))}); one scheme per "
                "checkpoint converts"
            )
        return replace(parsed.pop(), sparsity=cls._parse_sparsity(config.get("sparsity_config"), source))

    @staticmethod
    def _parse_sparsity(sc: Any, source: str) -> Optional[str]:
        """ "2:4" for a sparsity_config of 2:4 structure stored dense; None without one or for other
        structures (their weights convert as they are); ConversionError for compressed sparse storage."""
        if sc is None:
            return None
        where = f"{source}: sparsity_config"
        if not isinstance(sc, dict):
            raise ConversionError(f"{where} is a {type(sc).__name__}, expected a JSON object")
        fmt = sc.get("format", "dense")
        if fmt != "dense":
            raise ConversionError(
                f"{where}: format = {fmt!r} is not supported; only 'dense' (pruned zeros stored in place) converts"
            )
        return "2:4" if sc.get("sparsity_structure") == "2:4" else None

    @classmethod
    def _parse_group(cls, name: str, group: Any, top_format: Any, source: str) -> "CompressedTensorsConfig":
        where = f"{source}: config_groups.{name}"
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise ConversionError(f"{where}: expected an object with 'weights'")
        fmt = group.get("format") or top_format
        if fmt != "pack-quantized":
            raise ConversionError(f"{where}: format = {fmt!r} is not supported; only 'pack-quantized' converts")
        if group.get("input_activations") is not None:
            raise ConversionError(f"{where}: quantized input activations are not supported (weight-only W4A16/W8A16)")
        w = group["weights"]
        bits, sym, strategy = w.get("num_bits"), w.get("symmetric", True), w.get("strategy")
        if w.get("type", "int") != "int":
            raise ConversionError(f"{where}.weights: type = {w.get('type')!r}, expected 'int'")
        if isinstance(bits, bool) or bits not in (4, 8):
            raise ConversionError(f"{where}.weights: num_bits = {bits!r} is not supported, expected 4 or 8")
        if not isinstance(sym, bool) or (not sym and bits != 4):
            raise ConversionError(
                f"{where}.weights: symmetric = {sym!r} with num_bits = {bits}; zero points are supported for 4 bits only"
            )
        if strategy == "channel":
            group_size = -1
        elif strategy == "group":
            group_size = w.get("group_size")
            if isinstance(group_size, bool) or group_size not in packing.SUPPORTED_GROUP_SIZES:
                raise ConversionError(
                    f"{where}.weights: group_size = {group_size!r} is not supported, expected one of "
                    f"{packing.SUPPORTED_GROUP_SIZES[:-1]}"
                )
        else:
            raise ConversionError(f"{where}.weights: strategy = {strategy!r} is not supported, expected 'group' or 'channel'")
        if w.get("actorder") not in (None, False, "group"):
            raise ConversionError(f"{where}.weights: actorder = {w.get('actorder')!r} is not supported (None or 'group')")
        return cls(bits=bits, group_size=group_size, sym=sym)



def check_ct_layer_tensors(
    prefix: str, shapes: Mapping[str, tuple], dtypes: Mapping[str, Any], cfg: CompressedTensorsConfig
) -> tuple[int, int]:
    """Check one layer's tensor names, shapes and dtypes (no data needed); returns (K, N)."""
    required = ("weight_packed", "weight_scale", "weight_shape") + (() if cfg.sym else ("weight_zero_point",))
    check_layer_names(prefix, shapes, required, CT_LAYER_SUFFIXES)
    if cfg.sym and "weight_zero_point" in shapes:
        raise ConversionError(f"{prefix}.weight_zero_point: present, but the config says symmetric = true")
    per_word = 32 // cfg.bits
    wp = tuple(shapes["weight_packed"])
    if dtypes["weight_packed"] != torch.int32 or len(wp) != 2:
        raise ConversionError(f"{prefix}.weight_packed: dtype {dtypes['weight_packed']} shape {_shape_str(wp)}, expected torch.int32 [N, K / {per_word}]")
    n, k = wp[0], wp[1] * per_word
    reason = ops.check_shape(k, n, cfg.group_size, cfg.bits)
    if reason is not None:
        raise ConversionError(f"layer {prefix} (K = in_features = {k}, N = out_features = {n}) cannot be converted: {reason}")
    groups = packing.num_groups(k, cfg.group_size)

    expect = tensor_expecter(prefix, shapes, dtypes)

    ints = (torch.int32, torch.int64)
    expect("weight_scale", _SCALE_DTYPES, (n, groups), f"N = {n}, {groups} groups")
    expect("weight_zero_point", (torch.int32,), (n // per_word, groups), f"N / {per_word} words, {groups} groups")
    expect("weight_shape", ints, (2,), "(N, K)")
    expect("weight_g_idx", ints, (k,), f"K = {k}")
    expect("bias", (dtypes["weight_scale"],), (n,), f"N = {n}, the scales' dtype")
    return k, n


def unpack_ct(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32 / bits values per word along dim 1 (lowest bits first, offset
    2^(bits-1)) -> int16 [R, C * 32 / bits] signed values."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], packed.shape[1] * per_word).to(torch.int16) - (1 << (bits - 1))


def _signed_parts(tensors: Mapping[str, torch.Tensor], cfg: CompressedTensorsConfig):
    """(q [N, K], zp [N, G] or None) as signed int16, checked against weight_shape."""
    q = unpack_ct(tensors["weight_packed"].cpu(), cfg.bits)
    shape = [int(v) for v in tensors["weight_shape"].tolist()]
    if shape != list(q.shape):
        raise ConversionError(f"weight_shape {shape} does not match weight_packed's {list(q.shape)}")
    zp = None
    if "weight_zero_point" in tensors:
        zp = unpack_ct(tensors["weight_zero_point"].cpu().t().contiguous(), cfg.bits).t()  # packed along N
    return q, zp


def ct_to_marlin(prefix: str, tensors: Mapping[str, torch.Tensor], cfg: CompressedTensorsConfig) -> MarlinTensors:
    """Convert one pack-quantized layer (tensors by suffix) into the Marlin format. Exact."""
    shapes = {s: tuple(t.shape) for s, t in tensors.items()}
    dtypes = {s: t.dtype for s, t in tensors.items()}
    k, _ = check_ct_layer_tensors(prefix, shapes, dtypes, cfg)
    try:
        q, zp = _signed_parts(tensors, cfg)
    except ConversionError as e:
        raise ConversionError(f"{prefix}: {e}") from None
    scales = tensors["weight_scale"].cpu().t().contiguous()  # [G, N]
    perm = None
    if "weight_g_idx" in tensors:
        perm = act_order_permutation(prefix, tensors["weight_g_idx"].cpu(), scales.shape[0])
    b = q.t()  # B [K, N]
    bias = 1 << (cfg.bits - 1)
    z = None
    if not cfg.sym:
        z = (zp.t() + bias).contiguous()  # [G, N], unsigned: Marlin's z = zp + 8, as u = q + 8
        if int(z.min()) < 0 or int(z.max()) > 15:
            raise ConversionError(f"{prefix}.weight_zero_point: values outside [-8, 7]")
    why_dense = None
    if cfg.sparsity == "2:4":
        why_dense = _why_not_2_4(b, scales, z, cfg, perm)
        if why_dense is None:
            if z is None:
                b_q, b_meta, b_scales = sparse.pack_2_4(b.to(torch.int8).contiguous(), scales)
                return MarlinTensors(b_q=b_q, b_scales=b_scales, perm=None, bits=4, b_meta=b_meta)
            b_q, b_meta, b_scales, b_zeros = sparse.pack_2_4((b + bias).to(torch.int8).contiguous(), scales, z.to(scales.dtype))
            return MarlinTensors(b_q=b_q, b_scales=b_scales, perm=None, b_zeros=b_zeros, bits=4, b_meta=b_meta)
    if perm is not None:
        b = b.index_select(0, perm.to(torch.int64))
    if cfg.sym:
        b_q, b_scales = packing.pack(b.to(torch.int8).contiguous(), scales, bits=cfg.bits)
        return MarlinTensors(b_q=b_q, b_scales=b_scales, perm=perm, bits=cfg.bits, why_dense=why_dense)
    b_q, b_scales, b_zeros = packing.pack((b + bias).to(torch.int8).contiguous(), scales, z.to(scales.dtype), bits=4)
    return MarlinTensors(b_q=b_q, b_scales=b_scales, perm=perm, b_zeros=b_zeros, bits=4, why_dense=why_dense)


def _why_not_2_4(
    b: torch.Tensor, scales: torch.Tensor, z: Optional[torch.Tensor], cfg: CompressedTensorsConfig, perm
) -> Optional[str]:
    """None if the layer (codes B [K, N] in input order, its scales, Marlin's zero points z
    [G, N] or None) converts to the 2:4 format, else why not."""
    if cfg.bits != 4:
        return f"the 2:4 format holds 4-bit weights (this checkpoint: {cfg.bits}-bit)"
    if scales.dtype not in sparse.DTYPES_2_4:
        return f"{scales.dtype} scales: the 2:4 kernel computes in {', '.join(map(str, sparse.DTYPES_2_4))}"
    if perm is not None:
        return "activation ordering (weight_g_idx): the 2:4 format keeps the input order"
    shape = sparse.check_shape_2_4(b.shape[0], b.shape[1], cfg.group_size)
    if shape is not None:
        return f"the 2:4 kernel does not take it: {shape}"
    nonzero = b.float()  # where the weights are non-zero: q, or with zero points q - zp = u - z (pruned: q = zp)
    if z is not None:
        nonzero = nonzero + (1 << (cfg.bits - 1)) - z.float().repeat_interleave(b.shape[0] // z.shape[0], dim=0)
    bad = sparse.violations_2_4(nonzero).numel()
    if bad:
        return f"not 2:4 sparse: {bad} of its {b.shape[1]} output columns have more than two non-zeros in a group of 4 inputs"
    return None


def dequantize_ct(tensors: Mapping[str, torch.Tensor], cfg: CompressedTensorsConfig) -> torch.Tensor:
    """B = W^T [K, N] in float32 by the pack-quantized formula (exact), for verification."""
    q, zp = _signed_parts(tensors, cfg)
    n, k = q.shape
    scales = tensors["weight_scale"].cpu().float()  # [N, G]
    g_idx = tensors.get("weight_g_idx")
    if g_idx is None:
        g_idx = torch.arange(k) // (k // scales.shape[1])
    g_idx = g_idx.cpu().long()
    z = zp.float()[:, g_idx] if zp is not None else 0.0
    return (scales[:, g_idx] * (q.float() - z)).t().contiguous()
