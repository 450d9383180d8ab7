"""The AutoAWQ "GEMM" checkpoint format, and the conversion of one AWQ layer into the Marlin format.

AutoAWQ (and transformers' AwqConfig, version "gemm") store each quantized linear layer
``<prefix>`` (K = in_features, N = out_features, G = K / group_size groups) as

    <prefix>.qweight  int32 [K, N / 8]   8 4-bit values per word along N, in AWQ's column order
    <prefix>.qzeros   int32 [G, N / 8]   the zero points, packed the same way
    <prefix>.scales   fp16  [G, N]
    <prefix>.bias     fp16  [N]          optional

and the weight is  W[k, n] = scales[k // group_size, n] * (q[k, n] - zero[k // group_size, n]),
with q and zero in [0, 15] (no off-by-one, no act-order). Inside a word, nibble i (bits 4i..4i+3)
holds column 8c + AWQ_ORDER[i] of the word's 8 columns, AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7) (the
order of AutoAWQ's own GEMM kernel's dequantization); column 8c + j therefore sits in nibble
AWQ_ORDER.index(j).  The layer becomes Marlin's 4-bit format with zero points: u = q, z = zero,
the same scales. Exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from .. import ops, packing
from .errors import ConversionError
from .tensor_checks import check_layer_names, shape_str as _shape_str, tensor_expecter
from .gptq import MarlinTensors

__all__ = [
    "AWQ_ORDER",
    "AWQConfig",
    "AWQ_LAYER_SUFFIXES",
    "check_awq_layer_tensors",
    "unpack_awq",
    "awq_to_marlin",
    "dequantize_awq",
]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8
AWQ_LAYER_SUFFIXES = ("qweight", "qzeros", "scales", "bias")
_REQUIRED = ("qweight", "qzeros", "scales")
_SCALE_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AWQConfig:
    """The fields of an AWQ quantization config (config.json's quantization_config or AutoAWQ's
    quant_config.json) that decide whether and how a checkpoint converts."""

    bits: int
    group_size: int
    version: str

    @classmethod
    def from_dict(cls, config: Any, source: str) -> "AWQConfig":
        if not isinstance(config, dict):
            raise ConversionError(f"{source}: the quantization config is a {type(config).__name__}, expected a JSON object")
        method = config.get("quant_method", "awq")
        if not isinstance(method, str) or method.lower() != "awq":
            raise ConversionError(f"{source}: quant_method = {method!r}, expected 'awq'")
        # transformers writes bits / group_size; AutoAWQ's quant_config.json w_bit / q_group_size.
        bits = config.get("bits", config.get("w_bit"))
        group_size = config.get("group_size", config.get("q_group_size"))
        if bits is None or group_size is None:
            raise ConversionError(
                f"{source}: the AWQ config lacks bits (w_bit) or group_size (q_group_size); it has {sorted(config)}"
            )
        version = config.get("version", "gemm")
        if not isinstance(version, str) or version.lower() != "gemm":
            raise ConversionError(
                f"{source}: version = {version!r} is not supported; only AutoAWQ's 'gemm' layout converts "
                "(re-save the model with version 'gemm')"
            )
        if isinstance(bits, bool) or bits != 4:
            raise ConversionError(f"{source}: bits = {bits!r} is not supported; AWQ checkpoints convert from 4 bits")
        if config.get("zero_point", True) is not True:
            raise ConversionError(
                f"{source}: zero_point = {config.get('zero_point')!r}: AWQ without zero points is not supported"
            )
        if isinstance(group_size, bool) or group_size not in packing.SUPPORTED_GROUP_SIZES:
            raise ConversionError(
                f"{source}: group_size = {group_size!r} is not supported; the Marlin kernel takes one of "
                f"{packing.SUPPORTED_GROUP_SIZES} (-1: per column)"
            )
        return cls(bits=4, group_size=group_size, version="gemm")



def check_awq_layer_tensors(
    prefix: str, shapes: Mapping[str, tuple], dtypes: Mapping[str, Any], group_size: int
) -> tuple[int, int]:
    """Check the names, shapes and dtypes of one AWQ layer's tensors (no data needed); (K, N)."""
    check_layer_names(prefix, shapes, _REQUIRED, AWQ_LAYER_SUFFIXES, "an AWQ layer")
    qw = tuple(shapes["qweight"])
    if dtypes["qweight"] != torch.int32 or len(qw) != 2:
        raise ConversionError(f"{prefix}.qweight: dtype {dtypes['qweight']} shape {_shape_str(qw)}, expected torch.int32 [K, N / 8]")
    k, n = qw[0], qw[1] * 8
    reason = ops.check_shape(k, n, group_size)
    if reason is not None:
        raise ConversionError(f"layer {prefix} (K = in_features = {k}, N = out_features = {n}) cannot be converted: {reason}")
    groups = packing.num_groups(k, group_size)

    expect = tensor_expecter(prefix, shapes, dtypes)

    expect("scales", _SCALE_DTYPES, (groups, n), f"{groups} groups, N = {n}")
    expect("qzeros", (torch.int32,), (groups, n // 8), f"{groups} groups, N / 8 = {n // 8} words")
    expect("bias", (dtypes["scales"],), (n,), f"N = {n}, the scales' dtype")
    return k, n


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] in AWQ's packing -> int16 [R, 8 C] in natural column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8]: nibble i = column AWQ_ORDER[i]
    where = torch.tensor([AWQ_ORDER.index(j) for j in range(8)], device=packed.device)
    return nibbles[..., where].reshape(packed.shape[0], packed.shape[1] * 8).to(torch.int16)


def awq_to_marlin(
    prefix: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, group_size: int
) -> MarlinTensors:
    """Convert one AWQ layer into Marlin's 4-bit format with zero points. Raises ConversionError."""
    shapes = {"qweight": qweight.shape, "qzeros": qzeros.shape, "scales": scales.shape}
    dtypes = {"qweight": qweight.dtype, "qzeros": qzeros.dtype, "scales": scales.dtype}
    check_awq_layer_tensors(prefix, shapes, dtypes, group_size)
    q = unpack_awq(qweight.cpu()).to(torch.int8)
    s = scales.cpu().contiguous()
    zeros = unpack_awq(qzeros.cpu()).to(s.dtype)
    b_q, b_scales, b_zeros = packing.pack(q, s, zeros, bits=4)
    return MarlinTensors(b_q=b_q, b_scales=b_scales, perm=None, b_zeros=b_zeros, bits=4)


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: Optional[int] = None
) -> torch.Tensor:
    """W [K, N] in float32 by the AWQ formula (exact): the reference the conversion is verified against."""
    q = unpack_awq(qweight).to(torch.float32)
    k = q.shape[0]
    rows = k // scales.shape[0]
    z = unpack_awq(qzeros).to(torch.float32).repeat_interleave(rows, dim=0)
    return scales.to(torch.float32).repeat_interleave(rows, dim=0) * (q - z)
