"""MarlinLinear, a drop-in for nn.Linear with 4- or 8-bit weights, and replace_linear to swap them in.

    layer = marlin.MarlinLinear.from_linear(nn.Linear(4096, 11008).half().cuda())
    report = marlin.replace_linear(model)            # every eligible nn.Linear, lm_head excluded
    model = marlin.nn.load_quantized("llama-marlin")  # a converted checkpoint (marlin-convert)

A MarlinLinear computes y = x @ B + bias with B [in_features, out_features] stored in one of the
Marlin formats (marlin/packing.py), in float16 or bfloat16. See docs/USAGE.md and docs/FORMAT.md.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from . import ops, packing
from ._layer_common import QuantizedLinearBase, check_rotation_block, is_rotation_shape, rotate_blocks
from ._layer_common import new_workspace as _new_workspace  # noqa: F401  (also imported from here by other modules)
from .hf import load_quantized

__all__ = ["MarlinLinear", "replace_linear", "ReplaceReport", "load_quantized"]

log = logging.getLogger(__name__)


def _zero_word(bits: int) -> int:
    """The packed int32 word whose values all equal the symmetric zero (u = 8 or 128): an unloaded
    layer computes 0 (with zero points 8 too)."""
    value = 0x88888888 if bits == 4 else 0x80808080
    return value - 2**32


class MarlinLinear(QuantizedLinearBase):
    """y = x @ dequant(b_q, b_scales, b_zeros) + bias, for x [..., in_features] -> y [..., out_features].

    The layer has one compute dtype, float16 or bfloat16 (``dtype``): the input, the scales, the
    zero points, the bias and the output all have it. Weights: ``bits`` 4 (symmetric, or with
    ``zero_points``) or 8 (symmetric), in groups of ``group_size`` input rows (32, 64, 128) or
    one scale per output column (-1).

    Buffers (all in ``state_dict`` except ``workspace``):
      * ``b_q``       int32 [in_features / 16, 2 * out_features] (4 bits) or [.., 4 * out_features]
                      (8 bits): the weights, Marlin layout;
      * ``b_scales``  dtype [groups, out_features]: groups = in_features / group_size, or 1 (group_size -1);
      * ``b_zeros``   dtype [groups, out_features] (integer zero points 0..15), or None (symmetric);
      * ``bias``      dtype [out_features], or None;
      * ``perm``      int32 [in_features], or None: act-order checkpoints store the rows of B
                      sorted by group; the layer then computes x[..., perm] @ B;
      * ``input_rotation``  dtype [r, r], or None: an orthogonal matrix R applied to every block of
                      r consecutive inputs before the product (before ``perm``): the layer computes
                      (x blockdiag(R, ..., R)) @ B. ``marlin-quantize --rotate`` writes it for
                      down_proj, whose input cannot be rotated offline (marlin.quantize.rotate);
      * ``workspace`` int32, non-persistent: the kernel's lock buffer, zeroed, one per layer
                      (so one layer must not run on two CUDA streams at the same time).

    The input must have the layer's dtype (TypeError otherwise: a silent cast would hide a model
    that runs in another dtype). ``.to(dtype)``/``.float()``/``.half()`` leave the layer's dtype
    as it is: its scales are part of the weight format. A new layer holds zero weights; fill it
    with ``from_linear``, ``from_gptq`` or ``load_state_dict``.

    forward has no host synchronisation and no data-dependent control flow, so it works under
    torch.compile(fullgraph=True) and CUDA graph capture.
    """

    # Of the state_dict layout; _load_from_state_dict refuses newer versions. 1: fp16, 4-bit
    # symmetric, group 128 or -1. 2: adds bf16, 8 bits, zero points (b_zeros), groups 32 and 64;
    # a version-1 state dict is a valid version-2 one (same keys, fp16, 4-bit symmetric).
    # 3: adds the optional input_rotation; a version-2 state dict is a valid version-3 one.
    _version = 3

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group_size: int = 128,
        device: Optional[Union[torch.device, str]] = None,
        dtype: torch.dtype = torch.float16,
        act_order: bool = False,
        *,
        bits: int = 4,
        zero_points: bool = False,
        input_rotation: Optional[int] = None,
    ):
        super().__init__()
        if dtype not in packing.SUPPORTED_DTYPES:
            raise ValueError(f"MarlinLinear: dtype = {dtype}, expected torch.float16 or torch.bfloat16")
        if isinstance(bits, bool) or bits not in packing.SUPPORTED_BITS:
            raise ValueError(f"MarlinLinear: bits = {bits!r}, expected one of {packing.SUPPORTED_BITS}")
        if zero_points and bits != 4:
            raise ValueError(f"MarlinLinear: zero_points=True with bits = {bits}; zero points exist for 4-bit weights only")
        reason = ops.check_shape(in_features, out_features, group_size, bits)
        if reason is not None:
            raise ValueError(
                f"MarlinLinear(in_features={in_features}, out_features={out_features}, group_size={group_size}) "
                f"is not supported by the kernel: {reason}. It takes in_features a positive multiple of "
                f"{ops.K_MULTIPLE} and of the group size, out_features a positive multiple of {ops.N_MULTIPLE}, and "
                f"group_size one of {packing.SUPPORTED_GROUP_SIZES} (-1: per column); keep such a layer as nn.Linear."
            )
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.bits = bits
        self.dtype = dtype
        groups = packing.num_groups(in_features, group_size)
        width = packing.words_per_column(bits) * out_features
        self.register_buffer(
            "b_q",
            torch.full((in_features // packing.TILE_K, width), _zero_word(bits), dtype=torch.int32, device=device),
        )
        dev = self.b_q.device
        self.register_buffer("b_scales", torch.ones(groups, out_features, dtype=dtype, device=dev))
        self.register_buffer("b_zeros", torch.full((groups, out_features), 8.0, dtype=dtype, device=dev) if zero_points else None)
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=dev) if bias else None)
        self.register_buffer("perm", torch.arange(in_features, dtype=torch.int32, device=dev) if act_order else None)
        if input_rotation is not None:
            check_rotation_block(input_rotation, in_features, "MarlinLinear: input_rotation")
        self.register_buffer(
            "input_rotation",
            torch.eye(input_rotation, dtype=dtype, device=dev) if input_rotation is not None else None,
        )
        self.register_buffer("workspace", _new_workspace(dev), persistent=False)

    @property
    def zero_points(self) -> bool:
        return self.b_zeros is not None

    # -- construction from float or GPTQ weights ---------------------------------------------
    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group_size: int = 128,
        *,
        bits: int = 4,
        sym: bool = True,
        dtype: Optional[torch.dtype] = None,
        sparsity: Optional[str] = None,
    ) -> nn.Module:
        """Round-to-nearest quantization of ``linear`` (marlin.packing.quantize), on the device of its
        weight: ``bits`` 4 or 8, ``sym=False`` for 4-bit zero points. ``dtype`` (default: the
        weight's dtype if it is bfloat16 or float16, else float16) is the layer's compute dtype.
        Raises ValueError for shapes and formats the kernel cannot take.
        ``sparsity="2:4"`` prunes to 2:4 and returns a marlin.MarlinLinear24 instead (4-bit,
        symmetric or with ``sym=False`` zero points; ``dtype`` as here)."""
        if sparsity is not None:
            from . import sparse_nn

            sparse_nn.check_sparsity(sparsity, "MarlinLinear.from_linear")
            if bits != 4:
                raise ValueError(f"from_linear: sparsity='2:4' with bits = {bits!r}; the 2:4 format holds 4-bit weights only")
            return sparse_nn.MarlinLinear24.from_linear(linear, group_size, dtype=dtype, sym=sym)
        layer, weight = cls._empty_for(linear, group_size, dtype, bits=bits, zero_points=not sym)
        packed = packing.quantize_and_pack(weight.detach().t(), group_size, bits=bits, sym=sym, dtype=layer.dtype)  # B = W^T
        layer.b_q.copy_(packed[0])
        layer.b_scales.copy_(packed[1])
        if not sym:
            layer.b_zeros.copy_(packed[2])
        layer._copy_bias(linear)
        rotation = getattr(linear, "input_rotation", None)
        if isinstance(rotation, torch.Tensor):
            # a Linear of a rotated model (marlin.quantize.rotate) computes (x R) W^T: keep R
            layer._set_input_rotation(rotation)
        return layer

    def _set_input_rotation(self, rotation: torch.Tensor) -> None:
        """Give the layer the input rotation ``rotation`` ([r, r], r dividing in_features)."""
        if rotation.dim() != 2 or rotation.shape[0] != rotation.shape[1]:
            raise ValueError(f"MarlinLinear: input_rotation of shape {tuple(rotation.shape)}, expected a square [r, r]")
        check_rotation_block(rotation.shape[0], self.in_features, "MarlinLinear: input_rotation")
        self.input_rotation = rotation.detach().to(device=self.b_q.device, dtype=self.dtype).clone()

    @classmethod
    def from_gptq(
        cls,
        qweight: torch.Tensor,
        qzeros: torch.Tensor,
        scales: torch.Tensor,
        g_idx: Optional[torch.Tensor],
        bias: Optional[torch.Tensor] = None,
        *,
        bits: int = 4,
        group_size: int = 128,
        checkpoint_format: str = "gptq",
        sym: Optional[bool] = None,
    ) -> "MarlinLinear":
        """A layer from one GPTQ layer's tensors (see marlin.convert.gptq for the format).

        Supported: bits 4 or 8, group_size 32, 64, 128 or -1, any g_idx that gives every group
        group_size rows (act-order included: then the layer gets a ``perm``); ``g_idx`` None
        means no act-order. ``sym`` None decides from the zero points (all 2^(bits-1):
        symmetric, else 4-bit zero points); True/False insist. ``checkpoint_format`` "gptq"
        (stored zeros are zero - 1) or "gptq_v2". The layer computes in the scales' dtype and
        lives on qweight's device. Raises ValueError (ConversionError).
        """
        from .convert.errors import ConversionError
        from .convert.gptq import gptq_to_marlin

        converted = gptq_to_marlin(
            "from_gptq",
            qweight,
            qzeros,
            scales,
            g_idx,
            group_size=group_size,
            checkpoint_format=checkpoint_format,
            bits=bits,
            sym=sym,
        )
        k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
            raise ConversionError(f"from_gptq: bias shape {tuple(bias.shape)}, expected [{n}] (out_features)")
        layer = cls(
            k,
            n,
            bias=bias is not None,
            group_size=group_size,
            device=qweight.device,
            dtype=scales.dtype,
            act_order=converted.perm is not None,
            bits=bits,
            zero_points=converted.b_zeros is not None,
        )
        layer.load_converted(converted)
        if bias is not None:
            layer.bias.copy_(bias.detach())
        return layer

    def load_converted(self, converted) -> None:
        """Copy a converted layer (marlin.convert.gptq.MarlinTensors) into this layer's buffers."""
        self.b_q.copy_(converted.b_q)
        self.b_scales.copy_(converted.b_scales)
        if converted.b_zeros is not None:
            self.b_zeros.copy_(converted.b_zeros)
        if converted.perm is not None:
            self.perm.copy_(converted.perm)

    # -- compute ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self._flat_input(x, self.dtype)
        if self.input_rotation is not None:
            a = rotate_blocks(a, self.input_rotation)
        if self.perm is not None:
            a = a.index_select(1, self.perm)
        y = ops.gemm(a, self.b_q, self.b_scales, self.workspace, b_zeros=self.b_zeros, bits=self.bits)
        return self._output(y, x.shape[:-1])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"group_size={self.group_size}, act_order={self.perm is not None}, dtype={self.dtype}, "
            f"bits={self.bits}, zero_points={self.zero_points}"
            + (f", input_rotation={self.input_rotation.shape[0]}" if self.input_rotation is not None else "")
        )

    # -- state_dict (device moves: QuantizedLinearBase._apply) ----------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # Version 1 (fp16, 4-bit symmetric) has the keys and layout of version 2's fp16 4-bit
        # symmetric layers, so it loads as it is; the checks below refuse it for any other format.
        if not self._version_readable(local_metadata, prefix, error_msgs):
            return
        perm_key = prefix + "perm"
        if self.perm is None and perm_key in state_dict:
            # An act-order checkpoint: take its permutation (built without act_order=True, the
            # layer has no perm buffer yet; ignoring the key would give wrong outputs).
            self.perm = torch.empty(self.in_features, dtype=torch.int32, device=self.b_q.device)
        rot_key = prefix + "input_rotation"
        rot = state_dict.get(rot_key)
        if isinstance(rot, torch.Tensor):
            # a rotated checkpoint's layer (marlin-quantize --rotate): the rotation is part of what
            # the layer computes, so it is taken as the permutation is (ignoring it: wrong outputs)
            if not is_rotation_shape(rot.shape, self.in_features):
                error_msgs.append(
                    f"{rot_key}: shape {list(rot.shape)}, expected a square [r, r] with r dividing in_features = "
                    f"{self.in_features}"
                )
                return
            if self.input_rotation is None or self.input_rotation.shape != rot.shape:
                self.input_rotation = torch.empty(rot.shape, dtype=self.dtype, device=self.b_q.device)
        self._check_format(state_dict, prefix, error_msgs)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if self.perm is not None and perm_key in state_dict and not self.perm.is_meta:
            # Load time only (reads the values): a perm that is not a permutation would silently
            # duplicate and drop input features.
            expected = torch.arange(self.in_features, device=self.perm.device)
            if self.perm.shape != (self.in_features,) or not torch.equal(self.perm.sort().values.long(), expected):
                error_msgs.append(f"{perm_key}: not a permutation of range({self.in_features})")

    def _check_format(self, state_dict, prefix, error_msgs) -> None:
        """The checkpoint's format (group size, dtype, bits, zero points) must be the layer's:
        load_state_dict copies values and would cast a dtype silently."""
        self._check_scale_rows(state_dict, prefix, error_msgs)
        for name in ("b_scales", "b_zeros", "bias", "input_rotation"):
            t = state_dict.get(prefix + name)
            if isinstance(t, torch.Tensor) and t.dtype != self.dtype:
                error_msgs.append(f"{prefix}{name}: dtype {t.dtype}, but this layer computes in {self.dtype}")
        b_q = state_dict.get(prefix + "b_q")
        if isinstance(b_q, torch.Tensor) and b_q.dim() == 2 and b_q.shape[1] != self.b_q.shape[1]:
            bits = {2 * self.out_features: 4, 4 * self.out_features: 8}.get(b_q.shape[1])
            what = f"{bits}-bit weights" if bits else "not a Marlin width"
            error_msgs.append(
                f"{prefix}b_q: width {b_q.shape[1]} ({what}), but this layer was built with bits={self.bits} "
                f"(width {self.b_q.shape[1]})"
            )
        has_zeros = (prefix + "b_zeros") in state_dict
        # only where the state dict holds this layer (a partial load, e.g. load_sharded's of the
        # layers it did not shard itself, leaves the others as they are)
        if (prefix + "b_q") in state_dict and has_zeros != self.zero_points:
            error_msgs.append(
                f"{prefix}b_zeros: the checkpoint {'has' if has_zeros else 'has no'} zero points, but this layer was "
                f"built with zero_points={self.zero_points}"
            )


# -- replace_linear ---------------------------------------------------------------------------
@dataclass
class ReplaceReport:
    """What replace_linear did: the names it replaced, and (name, why) for each Linear it kept."""

    replaced: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    fused: Optional[object] = None  # marlin.fuse.FuseReport when replace_linear(..., fuse=True)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} nn.Linear layers with MarlinLinear, kept {len(self.skipped)}"]
        lines += [f"  kept {name}: {why}" for name, why in self.skipped]
        if self.fused is not None:
            lines.append(str(self.fused))
        return "\n".join(lines)


def _matches(name: str, patterns: Iterable[str]) -> Optional[str]:
    """The first pattern that selects module ``name``, or None.

    A pattern with a wildcard (* ? [) is an fnmatch pattern for the whole dotted name
    ("model.layers.*.mlp.*"); any other pattern selects every name that contains it ("lm_head",
    "self_attn.q_proj").
    """
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            if fnmatch.fnmatchcase(name, pattern):
                return pattern
        elif pattern in name:
            return pattern
    return None


def _as_patterns(value: Union[None, str, Sequence[str]], arg: str) -> Optional[tuple]:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    patterns = tuple(value)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"replace_linear: {arg} = {value!r}, expected a string or a sequence of strings")
    return patterns


def replace_linear(
    model: nn.Module,
    group_size: int = 128,
    include: Union[None, str, Sequence[str]] = None,
    exclude: Union[None, str, Sequence[str]] = ("lm_head",),
    *,
    strict: bool = False,
    bits: int = 4,
    sym: bool = True,
    fuse: bool = False,
    sparsity: Optional[str] = None,
) -> ReplaceReport:
    """Swap every eligible ``nn.Linear`` of ``model`` for a MarlinLinear (quantized with
    MarlinLinear.from_linear), in place, and return a ReplaceReport.

    A layer is replaced if its name matches ``include`` (None: every layer) and not ``exclude``
    (wins over include). Patterns: with a wildcard (* ? [) an fnmatch pattern on the full dotted
    name, e.g. "model.layers.*.mlp.*"; otherwise a substring, e.g. "lm_head".

    Kept as they are, with the reason in the report (and logged: WARNING for layers that were
    selected but cannot be converted, INFO for the ones filtered out by name): layers excluded by
    name, shapes the kernel cannot take (in/out features not multiples of 64 or of the group
    size), subclasses of
    nn.Linear (they may use their weight directly, as nn.MultiheadAttention does), weights on the
    meta device. With ``strict`` a selected layer that cannot be converted raises ValueError instead.

    ``bits`` (4 or 8) and ``sym`` (False: 4-bit zero points) choose the weight format. Each new
    layer computes in its Linear's dtype if that is bfloat16 or float16, else float16 (so run an
    fp32 model in fp16 afterwards, e.g. ``model.half()``). A Linear shared by several parents is
    converted once and replaced everywhere.

    With ``fuse`` the projections that read the same input (q/k/v, gate/up) are then merged into
    one layer each by marlin.fuse_projections (exact; its report is ``report.fused``).

    ``sparsity="2:4"``: 2:4-sparse layers instead (marlin.replace_linear_2_4, whose report also
    gives per layer the share of the weight norm that pruning removed; ``fuse`` merges its layers
    the same way).
    """
    if sparsity is not None:
        from . import sparse_nn

        sparse_nn.check_sparsity(sparsity, "replace_linear")
        if bits != 4:
            raise ValueError(f"replace_linear: sparsity='2:4' with bits = {bits!r}; the 2:4 format holds 4-bit weights only")
        report = sparse_nn.replace_linear_2_4(model, group_size, include, exclude, strict=strict, sym=sym)
        _mark_config(model, report, group_size=group_size, bits=4, sym=sym, sparsity=sparsity)
        if fuse:
            from .fuse import fuse_projections  # imports this module: import here, not at the top

            report.fused = fuse_projections(model)
        return report
    if group_size not in packing.SUPPORTED_GROUP_SIZES:
        raise ValueError(f"replace_linear: group_size = {group_size!r}, expected one of {packing.SUPPORTED_GROUP_SIZES} (-1: per column)")
    if isinstance(bits, bool) or bits not in packing.SUPPORTED_BITS:
        raise ValueError(f"replace_linear: bits = {bits!r}, expected one of {packing.SUPPORTED_BITS}")
    if not sym and bits != 4:
        raise ValueError(f"replace_linear: sym=False with bits = {bits}; zero points exist for 4-bit weights only")
    include_p, exclude_p = _as_patterns(include, "include"), _as_patterns(exclude, "exclude") or ()
    report = ReplaceReport()
    _swap_linears(
        model,
        report,
        "replace_linear",
        strict,
        skip_reason=lambda name, child: _skip_reason(
            name, child, include_p, exclude_p, lambda k, n: ops.check_shape(k, n, group_size, bits), "kernel"
        ),
        convert=lambda name, child: MarlinLinear.from_linear(child, group_size, bits=bits, sym=sym),
        layer_class=MarlinLinear,
    )
    log.info("replace_linear: replaced %d layers, kept %d", len(report.replaced), len(report.skipped))
    _mark_config(model, report, group_size=group_size, bits=bits, sym=sym)
    if fuse:
        from .fuse import fuse_projections  # imports this module: import here, not at the top

        report.fused = fuse_projections(model)
    return report


def _mark_config(model: nn.Module, report, **fields) -> None:
    """A transformers model with replaced layers says so in its config, so that save_pretrained
    writes a checkpoint that from_pretrained loads (marlin.integrations.mark_marlin_config)."""
    if report.replaced:
        from .integrations import mark_marlin_config

        mark_marlin_config(model, quantizer="marlin.replace_linear", **fields)


def _swap_linears(
    model: nn.Module,
    report: ReplaceReport,
    where: str,
    strict: bool,
    skip_reason: Callable[[str, nn.Linear], tuple[Optional[str], bool]],
    convert: Callable[[str, nn.Linear], nn.Module],
    layer_class: type,
) -> None:
    """The walk that replace_linear and replace_linear_2_4 share: every nn.Linear child of every
    module of ``model`` becomes ``convert(name, linear)`` unless ``skip_reason(name, linear)`` gives
    a reason to keep it (see _skip_reason); ``report`` gets the names. A Linear held in several
    places is converted once and the one new layer put in each place."""
    converted: dict[int, nn.Module] = {}  # id(old Linear) -> its new layer (shared layers)
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        # _modules rather than named_children(), which lists a child held twice by one parent once.
        for child_name, child in list(parent._modules.items()):
            if not isinstance(child, nn.Linear):
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if id(child) in converted:
                setattr(parent, child_name, converted[id(child)])
                report.replaced.append(name)
                continue
            why, selected = skip_reason(name, child)
            if why is not None:
                if selected and strict:
                    raise ValueError(f"{where}: cannot replace {name}: {why}")
                report.skipped.append((name, why))
                log.log(logging.WARNING if selected else logging.INFO, "%s: kept %s: %s", where, name, why)
                continue
            new = convert(name, child)
            converted[id(child)] = new
            setattr(parent, child_name, new)
            report.replaced.append(name)
    if isinstance(model, nn.Linear):
        report.skipped.append(
            ("", f"the model itself is an nn.Linear; wrap it or use {layer_class.__name__}.from_linear")
        )


def _skip_reason(
    name, linear, include, exclude, shape_reason: Callable[[int, int], Optional[str]], kernel: str
) -> tuple[Optional[str], bool]:
    """(why the layer is kept, or None; whether the name filters selected it). ``shape_reason(K, N)``
    says why ``kernel`` cannot take the shape, or None."""
    pattern = _matches(name, exclude)
    if pattern is not None:
        return f"excluded by pattern {pattern!r}", False
    if include is not None and _matches(name, include) is None:
        return f"not matched by include {list(include)}", False
    if type(linear) is not nn.Linear:
        return f"{type(linear).__name__} is a subclass of nn.Linear (only plain nn.Linear is replaced)", True
    reason = shape_reason(linear.in_features, linear.out_features)
    if reason is not None:
        return f"shape not supported by the {kernel}: {reason}", True
    if linear.weight.is_meta:
        return "weight is on the meta device (no values to quantize)", True
    return None, True
