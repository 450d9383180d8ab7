"""The GPTQ checkpoint format, and the conversion of one GPTQ layer into the Marlin format.

AutoGPTQ, Optimum/transformers and GPTQModel store each quantized linear layer ``<prefix>``
(K = in_features, N = out_features, G = number of groups) as

    <prefix>.qweight  int32 [K / P, N]  P = 32 / bits values per word along K, lowest bits first:
                                        q[P i + j, n] = (qweight[i, n] >> bits j) & (2^bits - 1)
    <prefix>.qzeros   int32 [G, N / P]  P zero points per word along N, lowest bits first
    <prefix>.scales   fp16  [G, N]      (bf16 in some newer checkpoints)
    <prefix>.g_idx    int32 [K]         the group of each input row k
    <prefix>.bias     fp16  [N]         optional

and the weight is  W[k, n] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]).  The stored zero
point is zero - 1 in checkpoint_format "gptq" (AutoGPTQ's historical off-by-one) and zero itself in
"gptq_v2".  G = K / group_size, or 1 for per-column quantization (group_size = -1).  Symmetric
checkpoints (sym = true) have zero = 2^(bits-1) everywhere: they become Marlin's symmetric formats
(4 or 8 bits); asymmetric 4-bit ones (sym = false) become 4-bit weights with zero points.

With act-order (desc_act) GPTQ quantizes the rows of K in a data-dependent order and numbers the
groups in that order, so g_idx is not monotone: the rows of one group are scattered over K.  Marlin
needs each group to be group_size consecutive rows.  Sorting K by g_idx (stably) gives such an
order ``perm``; the converted layer stores the rows W[perm] and the module computes
x[..., perm] @ W[perm], which equals x @ W.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from .. import ops, packing
from .errors import ConversionError
from .tensor_checks import check_layer_names, shape_str as _shape_str, tensor_expecter

__all__ = [
    "GPTQConfig",
    "GPTQ_FORMATS",
    "LAYER_SUFFIXES",
    "MarlinTensors",
    "check_layer_tensors",
    "default_g_idx",
    "unpack_rows",
    "unpack_cols",
    "zero_points",
    "act_order_permutation",
    "gptq_to_marlin",
    "dequantize_gptq",
]

GPTQ_FORMATS = ("gptq", "gptq_v2")
LAYER_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "bias")
_REQUIRED_SUFFIXES = ("qweight", "qzeros", "scales")
_SUPPORTED_BITS = (4, 8)
_SCALE_DTYPES = (torch.float16, torch.bfloat16)


def _per_word(bits: int) -> int:
    return 32 // bits  # values per int32 word


def _symmetric_zero(bits: int) -> int:
    return 1 << (bits - 1)  # the zero point of symmetric GPTQ: 8 or 128


def _describe_group_size(group_size: int) -> str:
    return "per column" if group_size == -1 else f"group size {group_size}"


@dataclass(frozen=True)
class GPTQConfig:
    """The fields of a GPTQ quantization config that decide whether and how a checkpoint converts."""

    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    checkpoint_format: str

    @classmethod
    def from_dict(cls, config: Any, source: str) -> "GPTQConfig":
        """Parse and validate ``quantization_config`` (config.json) or quantize_config.json.

        ``source`` names where the dict came from, for the error messages.
        """
        if not isinstance(config, dict):
            raise ConversionError(f"{source}: the quantization config is a {type(config).__name__}, expected a JSON object")
        method = config.get("quant_method", "gptq")
        if method == "marlin":
            raise ConversionError(f"{source}: quant_method = 'marlin': this checkpoint is already converted")
        if not isinstance(method, str) or method.lower() != "gptq":
            raise ConversionError(
                f"{source}: quant_method = {method!r}, expected 'gptq', 'awq' or 'compressed-tensors' (the methods "
                "marlin-convert converts)"
            )
        if config.get("is_marlin_format"):
            raise ConversionError(
                f"{source}: is_marlin_format = true: this is AutoGPTQ's own Marlin layout, not a GPTQ checkpoint; "
                "convert the original GPTQ checkpoint instead"
            )
        # GPTQModel writes "checkpoint_format" (older versions "format"); AutoGPTQ before 0.8 neither.
        fmt = config.get("checkpoint_format", config.get("format", "gptq"))
        if not isinstance(fmt, str):
            raise ConversionError(f"{source}: checkpoint_format = {fmt!r}, expected one of {GPTQ_FORMATS}")
        fmt = fmt.lower()
        if fmt == "marlin":
            raise ConversionError(f"{source}: checkpoint_format = 'marlin': this checkpoint is already converted")
        if fmt not in GPTQ_FORMATS:
            raise ConversionError(f"{source}: checkpoint_format = {fmt!r} is not supported, expected one of {GPTQ_FORMATS}")

        missing = [key for key in ("bits", "group_size", "sym") if key not in config]
        if missing:
            raise ConversionError(
                f"{source}: the quantization config lacks {', '.join(repr(k) for k in missing)} "
                f"(it has {sorted(config)}); a GPTQ config states bits, group_size and sym"
            )
        bits, group_size, sym = config["bits"], config["group_size"], config["sym"]
        desc_act = config.get("desc_act", False)  # decides nothing here: g_idx says where each row went
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in _SUPPORTED_BITS:
            raise ConversionError(
                f"{source}: bits = {bits!r} is not supported; the Marlin kernel takes 4- or 8-bit weights"
            )
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in packing.SUPPORTED_GROUP_SIZES:
            raise ConversionError(
                f"{source}: group_size = {group_size!r} is not supported; the Marlin kernel takes "
                f"one of {packing.SUPPORTED_GROUP_SIZES} (-1: per column)"
            )
        if not isinstance(sym, bool):
            raise ConversionError(f"{source}: sym = {sym!r}, expected true or false")
        if not sym and bits != 4:
            raise ConversionError(
                f"{source}: sym = false with bits = {bits}: zero points are supported for 4-bit weights only "
                "(8-bit weights must be symmetric)"
            )
        if not isinstance(desc_act, bool):
            raise ConversionError(f"{source}: desc_act = {desc_act!r}, expected true or false")
        return cls(bits=bits, group_size=group_size, sym=sym, desc_act=desc_act, checkpoint_format=fmt)


@dataclass
class MarlinTensors:
    """One converted layer: the MarlinLinear buffers (``perm`` None when no permutation is needed,
    ``b_zeros`` None for symmetric weights) and the op's ``bits``; or, with ``b_meta``, a 2:4-sparse
    layer's MarlinLinear24 buffers (b_q, b_meta, b_scales, and b_zeros with zero points:
    marlin.sparse's format)."""

    b_q: torch.Tensor
    b_scales: torch.Tensor
    perm: Optional[torch.Tensor]
    b_zeros: Optional[torch.Tensor] = None
    bits: int = 4
    b_meta: Optional[torch.Tensor] = None
    why_dense: Optional[str] = None  # a layer of a 2:4 checkpoint kept dense: why

    def tensors(self, prefix: str) -> dict:
        """The MarlinLinear (MarlinLinear24) state_dict entries of this layer (bias aside)."""
        out = {f"{prefix}.b_q": self.b_q, f"{prefix}.b_scales": self.b_scales}
        if self.b_meta is not None:
            out[f"{prefix}.b_meta"] = self.b_meta
        if self.b_zeros is not None:
            out[f"{prefix}.b_zeros"] = self.b_zeros
        if self.perm is not None:
            out[f"{prefix}.perm"] = self.perm
        return out



def check_layer_tensors(
    prefix: str, shapes: Mapping[str, tuple], dtypes: Mapping[str, Any], group_size: int, bits: int = 4
) -> tuple[int, int]:
    """Check the names, shapes and dtypes of one GPTQ layer's tensors (no data needed).

    ``shapes``/``dtypes`` map suffixes ("qweight", ...) to the tensor's shape and torch dtype.
    Returns (K, N). Raises ConversionError naming the tensor, what it is and what was expected.
    """
    check_layer_names(prefix, shapes, _REQUIRED_SUFFIXES, LAYER_SUFFIXES, "a GPTQ layer")

    expect = tensor_expecter(prefix, shapes, dtypes)

    per_word = _per_word(bits)
    qw_shape = tuple(shapes["qweight"])
    if dtypes["qweight"] != torch.int32 or len(qw_shape) != 2:
        raise ConversionError(
            f"{prefix}.qweight: dtype {dtypes['qweight']} shape {_shape_str(qw_shape)}, expected torch.int32 "
            f"[K / {per_word}, N] ({bits}-bit)"
        )
    k, n = qw_shape[0] * per_word, qw_shape[1]
    if n % per_word:
        raise ConversionError(f"layer {prefix}: N = out_features = {n} is not a multiple of {per_word} ({bits}-bit qzeros)")
    reason = ops.check_shape(k, n, group_size, bits)
    if reason is not None:
        raise ConversionError(
            f"layer {prefix} (K = in_features = {k}, N = out_features = {n}, {_describe_group_size(group_size)}) "
            f"cannot be converted: {reason}"
        )
    groups = packing.num_groups(k, group_size)
    grouping = f"K / group_size = {k} / {group_size}" if group_size != -1 else "one row per column (group_size -1)"
    expect("scales", _SCALE_DTYPES, (groups, n), f"{grouping} groups, N = {n}")
    expect(
        "qzeros", (torch.int32,), (groups, n // per_word), f"{groups} groups, N / {per_word} = {n // per_word} words"
    )
    expect("g_idx", (torch.int32, torch.int64), (k,), f"one group index per input row, K = {k}")
    expect("bias", (dtypes["scales"],), (n,), f"N = {n}, the scales' dtype")
    return k, n


def default_g_idx(k: int, group_size: int) -> torch.Tensor:
    """g_idx of a checkpoint without act-order: row k is in group k // group_size (0 when per column)."""
    rows = torch.arange(k, dtype=torch.int32)
    return torch.zeros_like(rows) if group_size == -1 else rows // group_size


def unpack_rows(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [R, C] holding P = 32 / bits values per word along rows -> int16 [P R, C] (value j -> row P r + j)."""
    per_word = _per_word(bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device).view(1, per_word, 1)
    values = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # [R, P, C]; the mask undoes the sign extension
    return values.reshape(packed.shape[0] * per_word, packed.shape[1]).to(torch.int16)


def unpack_cols(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [R, C] holding P = 32 / bits values per word along columns -> int16 [R, P C] (value j -> column P c + j)."""
    per_word = _per_word(bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device).view(1, 1, per_word)
    values = (packed.unsqueeze(2) >> shifts) & ((1 << bits) - 1)  # [R, C, P]
    return values.reshape(packed.shape[0], packed.shape[1] * per_word).to(torch.int16)


def zero_points(qzeros: torch.Tensor, checkpoint_format: str, bits: int = 4) -> torch.Tensor:
    """The zero points int16 [G, N] that the weight formula subtracts, from the stored qzeros."""
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"checkpoint_format = {checkpoint_format!r}, expected one of {GPTQ_FORMATS}")
    stored = unpack_cols(qzeros, bits)
    return stored + 1 if checkpoint_format == "gptq" else stored


def _check_symmetric(prefix: str, zeros: torch.Tensor, checkpoint_format: str, bits: int) -> None:
    sym_zero = _symmetric_zero(bits)
    wrong = zeros != sym_zero
    if bool(wrong.any()):
        g, n = (int(i) for i in wrong.nonzero()[0])
        hint = ""
        if checkpoint_format == "gptq":  # a gptq_v2 checkpoint labelled "gptq" reads as zero 9 everywhere
            hint = " ('gptq' stores zero - 1; if this checkpoint stores the zeros as they are, it is 'gptq_v2')"
        raise ConversionError(
            f"{prefix}.qzeros: the config says sym = true, but {int(wrong.sum())} of {zeros.numel()} zero points "
            f"are not {sym_zero} (e.g. {int(zeros[g, n])} at group {g}, column {n}, checkpoint_format "
            f"'{checkpoint_format}'{hint}). If the checkpoint is asymmetric, its config must say sym = false."
        )


def _check_zero_range(prefix: str, zeros: torch.Tensor, checkpoint_format: str) -> None:
    """Zero points of an asymmetric 4-bit layer must lie in [0, 15]. In 'gptq' (v1) a zero of 0
    was stored as -1, which AutoGPTQ's packing wrapped into 15 and OR-ed into the neighbouring
    columns' zeros: such a layer reads as 16 here and cannot be recovered."""
    bad = (zeros < 0) | (zeros > 15)
    if bool(bad.any()):
        g, n = (int(i) for i in bad.nonzero()[0])
        raise ConversionError(
            f"{prefix}.qzeros: zero point {int(zeros[g, n])} at group {g}, column {n} is outside [0, 15] "
            f"(checkpoint_format '{checkpoint_format}': a zero of 0 stored as -1 by the v1 'gptq' packing "
            "corrupts the word; re-export the checkpoint as 'gptq_v2')"
        )


def act_order_permutation(prefix: str, g_idx: torch.Tensor, groups: int) -> Optional[torch.Tensor]:
    """The order of K that makes every group contiguous, int32 [K]; None when it is the identity.

    Checks that g_idx puts exactly K / groups rows into each group, which Marlin's fixed-size
    groups need; GPTQ always does (it numbers the groups while walking K in its order).
    """
    k = g_idx.shape[0]
    g_idx = g_idx.to(torch.int64)
    lo, hi = int(g_idx.min()), int(g_idx.max())
    if lo < 0 or hi >= groups:
        raise ConversionError(f"{prefix}.g_idx: values lie in [{lo}, {hi}], expected group indices in [0, {groups - 1}]")
    counts = torch.bincount(g_idx, minlength=groups)
    rows = k // groups
    bad = (counts != rows).nonzero()
    if bad.numel():
        g = int(bad[0])
        raise ConversionError(
            f"{prefix}.g_idx: group {g} has {int(counts[g])} input rows, expected {rows} in every group "
            f"(K = {k}, {groups} groups); cannot make the groups contiguous"
        )
    perm = torch.sort(g_idx, stable=True).indices
    if torch.equal(perm, torch.arange(k, device=perm.device)):
        return None
    return perm.to(torch.int32)


def gptq_to_marlin(
    prefix: str,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor],
    *,
    group_size: int,
    checkpoint_format: str = "gptq",
    bits: int = 4,
    sym: Optional[bool] = True,
) -> MarlinTensors:
    """Convert one GPTQ layer into the Marlin format. Raises ConversionError.

    ``sym`` True: every zero point must be 2^(bits-1) (else an error), giving Marlin's symmetric
    4- or 8-bit format; False (4 bits): the zero points are kept (b_zeros); None: symmetric if
    every zero point is 2^(bits-1), else zero points. The values are exact: W = scales[g] * (q - z)
    in GPTQ and in Marlin, with the same scales. Only the order of rows (act-order) and the
    packing change.
    """
    if bits not in _SUPPORTED_BITS:
        raise ConversionError(f"layer {prefix}: bits = {bits!r}, expected one of {_SUPPORTED_BITS}")
    shapes = {"qweight": qweight.shape, "qzeros": qzeros.shape, "scales": scales.shape}
    dtypes = {"qweight": qweight.dtype, "qzeros": qzeros.dtype, "scales": scales.dtype}
    if g_idx is not None:
        shapes["g_idx"], dtypes["g_idx"] = g_idx.shape, g_idx.dtype
    k, _ = check_layer_tensors(prefix, shapes, dtypes, group_size, bits)
    if checkpoint_format not in GPTQ_FORMATS:
        raise ConversionError(f"layer {prefix}: checkpoint_format = {checkpoint_format!r}, expected one of {GPTQ_FORMATS}")
    groups = scales.shape[0]

    zeros = zero_points(qzeros.cpu(), checkpoint_format, bits)
    if sym is None:
        sym = bool((zeros == _symmetric_zero(bits)).all())
    if sym:
        _check_symmetric(prefix, zeros, checkpoint_format, bits)
    elif bits != 4:
        raise ConversionError(f"layer {prefix}: asymmetric {bits}-bit weights; zero points are supported for 4 bits only")
    else:
        _check_zero_range(prefix, zeros, checkpoint_format)
    if g_idx is None:
        g_idx = default_g_idx(k, group_size)
    perm = act_order_permutation(prefix, g_idx.cpu(), groups)

    q = unpack_rows(qweight.cpu(), bits)
    if perm is not None:
        q = q.index_select(0, perm.to(torch.int64))
    s = scales.cpu().contiguous()
    if sym:
        q_marlin = (q - _symmetric_zero(bits)).to(torch.int8)  # [0, 2^bits) -> signed
        b_q, b_scales = packing.pack(q_marlin, s, bits=bits)
        return MarlinTensors(b_q=b_q, b_scales=b_scales, perm=perm, bits=bits)
    b_q, b_scales, b_zeros = packing.pack(q.to(torch.int8), s, zeros.to(s.dtype), bits=4)
    return MarlinTensors(b_q=b_q, b_scales=b_scales, perm=perm, b_zeros=b_zeros, bits=4)


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor],
    checkpoint_format: str = "gptq",
    group_size: Optional[int] = None,
    bits: int = 4,
) -> torch.Tensor:
    """W [K, N] in float32 by the GPTQ formula W = scales[g_idx] * (q - zero[g_idx]) (exact).

    This is the reference the conversion is verified against; it uses the stored zero points
    as they are, so it does not assume symmetry. ``group_size`` is only needed without g_idx.
    """
    q = unpack_rows(qweight, bits).to(torch.float32)
    k = q.shape[0]
    if g_idx is None:
        if group_size is None:
            group_size = packing.group_size_of(k, scales.shape[0])
        g_idx = default_g_idx(k, group_size).to(qweight.device)
    g = g_idx.to(torch.int64)
    zeros = zero_points(qzeros, checkpoint_format, bits).to(torch.float32)
    return scales.to(torch.float32)[g] * (q - zeros[g])
