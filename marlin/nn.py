"""MarlinLinear, a drop-in for nn.Linear with INT4 weights, and replace_linear to swap them in.

    layer = marlin.MarlinLinear.from_linear(nn.Linear(4096, 11008).half().cuda())
    report = marlin.replace_linear(model)            # every eligible nn.Linear, lm_head excluded
    model = marlin.nn.load_quantized("llama-marlin")  # a converted GPTQ checkpoint (marlin-convert)

A MarlinLinear computes y = x @ B + bias with B [in_features, out_features] stored in the Marlin
format (marlin/packing.py), fp16 in and fp16 out. See docs/USAGE.md.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

import torch
from torch import nn

from . import ops, packing
from .hf import load_quantized

__all__ = ["MarlinLinear", "replace_linear", "ReplaceReport", "load_quantized"]

log = logging.getLogger(__name__)

# The packed word of eight q = 0 values (stored nibble q + 8 = 0x8): an unloaded layer computes 0.
_ZERO_WORD = 0x88888888 - 2**32


def _new_workspace(device: torch.device) -> torch.Tensor:
    """A zeroed lock workspace for gemm on ``device`` (the CPU op ignores it; one element suffices)."""
    if device.type == "cuda":
        return ops.make_workspace(device)
    return torch.zeros(1, dtype=torch.int32, device=device)


class MarlinLinear(nn.Module):
    """y = x @ dequant(b_q, b_scales) + bias, for x fp16 [..., in_features] -> y fp16 [..., out_features].

    Buffers (all in ``state_dict`` except ``workspace``):
      * ``b_q``       int32 [in_features / 16, 2 * out_features]: INT4 weights, Marlin layout;
      * ``b_scales``  fp16 [groups, out_features]: groups = in_features / group_size, or 1 (group_size -1);
      * ``bias``      fp16 [out_features], or None;
      * ``perm``      int32 [in_features], or None: act-order checkpoints store the rows of B
                      sorted by group; the layer then computes x[..., perm] @ B;
      * ``workspace`` int32, non-persistent: the kernel's lock buffer, zeroed, one per layer
                      (so one layer must not run on two CUDA streams at the same time).

    The input must be float16 (TypeError otherwise: the kernel computes in fp16, and a silent cast
    would hide a model that runs in another dtype). ``.to(dtype)``/``.float()``/``.bfloat16()``
    leave the layer in fp16: its scales are part of the weight format. A new layer holds zero
    weights; fill it with ``from_linear``, ``from_gptq`` or ``load_state_dict``.

    forward has no host synchronisation and no data-dependent control flow, so it works under
    torch.compile(fullgraph=True) and CUDA graph capture.
    """

    _version = 1  # of the state_dict layout; _load_from_state_dict refuses newer versions

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group_size: int = 128,
        device: Optional[Union[torch.device, str]] = None,
        dtype: torch.dtype = torch.float16,
        act_order: bool = False,
    ):
        super().__init__()
        if dtype != torch.float16:
            raise ValueError(f"MarlinLinear: dtype = {dtype}, expected torch.float16 (the kernel computes in fp16 only)")
        reason = ops.check_shape(in_features, out_features, group_size)
        if reason is not None:
            raise ValueError(
                f"MarlinLinear(in_features={in_features}, out_features={out_features}, group_size={group_size}) "
                f"is not supported by the kernel: {reason}. It takes in_features a positive multiple of "
                f"{ops.K_MULTIPLE}, out_features a positive multiple of {ops.N_MULTIPLE}, and group_size "
                f"one of {packing.SUPPORTED_GROUP_SIZES} (-1: per column); keep such a layer as nn.Linear."
            )
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        groups = packing.num_groups(in_features, group_size)
        self.register_buffer(
            "b_q",
            torch.full((in_features // packing.TILE_K, 2 * out_features), _ZERO_WORD, dtype=torch.int32, device=device),
        )
        dev = self.b_q.device
        self.register_buffer("b_scales", torch.ones(groups, out_features, dtype=torch.float16, device=dev))
        self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float16, device=dev) if bias else None)
        self.register_buffer("perm", torch.arange(in_features, dtype=torch.int32, device=dev) if act_order else None)
        self.register_buffer("workspace", _new_workspace(dev), persistent=False)

    # -- construction from float or GPTQ weights ---------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, *, sparsity: Optional[str] = None) -> nn.Module:
        """Round-to-nearest symmetric INT4 quantization of ``linear`` (marlin.packing.quantize),
        on the device of its weight. Raises ValueError for shapes the kernel cannot take.
        ``sparsity="2:4"`` prunes to 2:4 and returns a marlin.MarlinLinear24 instead."""
        if sparsity is not None:
            from . import sparse_nn

            sparse_nn.check_sparsity(sparsity, "MarlinLinear.from_linear")
            return sparse_nn.MarlinLinear24.from_linear(linear, group_size)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear: expected an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight
        if weight.is_meta:
            raise ValueError("from_linear: the layer's weight is on the meta device (no values to quantize)")
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            group_size=group_size,
            device=weight.device,
        )
        b_q, b_scales = packing.quantize_and_pack(weight.detach().t(), group_size)  # B = weight^T [K, N]
        layer.b_q.copy_(b_q)
        layer.b_scales.copy_(b_scales)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias.detach())
        return layer

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
    ) -> "MarlinLinear":
        """A layer from one GPTQ layer's tensors (see marlin.convert.gptq for the format).

        Supported: bits 4, symmetric zeros (8), group_size 128 or -1, any g_idx that gives every
        group group_size rows (act-order included: then the layer gets a ``perm``). ``g_idx``
        None means no act-order. ``checkpoint_format`` "gptq" (stored zeros are zero - 1) or
        "gptq_v2". The layer lives on qweight's device. Raises ValueError (ConversionError).
        """
        from .convert.errors import ConversionError
        from .convert.gptq import gptq_to_marlin

        if bits != 4:
            raise ConversionError(f"from_gptq: bits = {bits!r} is not supported; the Marlin kernel takes 4-bit weights only")
        converted = gptq_to_marlin(
            "from_gptq", qweight, qzeros, scales, g_idx, group_size=group_size, checkpoint_format=checkpoint_format
        )
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
            raise ConversionError(f"from_gptq: bias shape {tuple(bias.shape)}, expected [{n}] (out_features)")
        layer = cls(
            k, n, bias=bias is not None, group_size=group_size, device=qweight.device, act_order=converted.perm is not None
        )
        layer.b_q.copy_(converted.b_q)
        layer.b_scales.copy_(converted.b_scales)
        if converted.perm is not None:
            layer.perm.copy_(converted.perm)
        if bias is not None:
            layer.bias.copy_(bias.detach())
        return layer

    # -- compute ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Both checks depend only on dtype and shape, which torch.compile specializes on, so they
        # cost nothing in a compiled graph.
        if x.dtype != torch.float16:
            raise TypeError(
                f"MarlinLinear: input dtype is {x.dtype}, expected torch.float16 (the kernel computes in fp16; "
                "run the model in half precision, e.g. model.half())"
            )
        if x.shape[-1] != self.in_features:
            raise ValueError(f"MarlinLinear: input shape {tuple(x.shape)}, expected [..., {self.in_features}]")
        lead = x.shape[:-1]
        a = x.reshape(-1, self.in_features)
        if self.perm is not None:
            a = a.index_select(1, self.perm)
        y = ops.gemm(a, self.b_q, self.b_scales, self.workspace)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"group_size={self.group_size}, act_order={self.perm is not None}"
        )

    # -- device moves and state_dict ----------------------------------------------------------
    def _apply(self, fn, recurse=True):
        # Keep fp16: a dtype change of the scales (bf16 has fewer mantissa bits) would change the
        # weights. Device moves and to_empty still apply.
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(device=out.device)

        old_workspace = self.workspace
        super()._apply(keep_dtype, recurse)
        # The workspace must be zeroed and sized for its device: make a new one whenever it was
        # moved or re-allocated (to_empty), but keep it when nothing changed, so that a CUDA graph
        # captured earlier still points at live memory.
        if self.workspace is not old_workspace or self.workspace.device != self.b_q.device:
            self.workspace = _new_workspace(self.b_q.device)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        version = local_metadata.get("version")
        # None: no metadata (e.g. a converted safetensors checkpoint), which is written in the current layout.
        if version is not None and version > self._version:
            error_msgs.append(
                f"{prefix}: state_dict version {version} was written by a newer marlin (this one reads up to "
                f"{self._version}); upgrade marlin"
            )
            return
        perm_key = prefix + "perm"
        if self.perm is None and perm_key in state_dict:
            # An act-order checkpoint: take its permutation (built without act_order=True, the
            # layer has no perm buffer yet; ignoring the key would give wrong outputs).
            self.perm = torch.empty(self.in_features, dtype=torch.int32, device=self.b_q.device)
        scales = state_dict.get(prefix + "b_scales")
        if isinstance(scales, torch.Tensor) and scales.dim() == 2 and scales.shape[0] != self.b_scales.shape[0]:
            error_msgs.append(
                f"{prefix}b_scales: {scales.shape[0]} scale rows, i.e. group size "
                f"{packing.group_size_of(self.in_features, scales.shape[0])}, but this layer was built with "
                f"group_size={self.group_size} ({self.b_scales.shape[0]} rows)"
            )
        if isinstance(scales, torch.Tensor) and scales.dtype != torch.float16:
            error_msgs.append(f"{prefix}b_scales: dtype {scales.dtype}, expected torch.float16")
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if self.perm is not None and perm_key in state_dict and not self.perm.is_meta:
            # Load time only (reads the values): a perm that is not a permutation would silently
            # duplicate and drop input features.
            expected = torch.arange(self.in_features, device=self.perm.device)
            if self.perm.shape != (self.in_features,) or not torch.equal(self.perm.sort().values.long(), expected):
                error_msgs.append(f"{perm_key}: not a permutation of range({self.in_features})")


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
    name, shapes the kernel cannot take (in/out features not multiples of 128), subclasses of
    nn.Linear (they may use their weight directly, as nn.MultiheadAttention does), weights on the
    meta device. With ``strict`` a selected layer that cannot be converted raises ValueError instead.

    The model should run in fp16 (e.g. ``model.half()``): MarlinLinear takes fp16 inputs only.
    A Linear shared by several parents is converted once and replaced everywhere.

    With ``fuse`` the projections that read the same input (q/k/v, gate/up) are then merged into
    one layer each by marlin.fuse_projections (exact; its report is ``report.fused``).

    ``sparsity="2:4"``: 2:4-sparse layers instead (marlin.replace_linear_2_4, whose report also
    gives per layer the share of the weight norm that pruning removed; not with ``fuse``).
    """
    if sparsity is not None:
        from . import sparse_nn

        sparse_nn.check_sparsity(sparsity, "replace_linear")
        if fuse:
            raise ValueError("replace_linear: fuse=True is not supported with sparsity='2:4' (2:4 layers are not fused)")
        return sparse_nn.replace_linear_2_4(model, group_size, include, exclude, strict=strict)
    if group_size not in packing.SUPPORTED_GROUP_SIZES:
        raise ValueError(f"replace_linear: group_size = {group_size!r}, expected one of {packing.SUPPORTED_GROUP_SIZES} (-1: per column)")
    include_p, exclude_p = _as_patterns(include, "include"), _as_patterns(exclude, "exclude") or ()
    report = ReplaceReport()
    converted: dict[int, nn.Module] = {}  # id(old Linear) -> its MarlinLinear (shared layers)
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
            why, selected = _skip_reason(name, child, include_p, exclude_p, group_size)
            if why is not None:
                if selected and strict:
                    raise ValueError(f"replace_linear: cannot replace {name}: {why}")
                report.skipped.append((name, why))
                log.log(logging.WARNING if selected else logging.INFO, "replace_linear: kept %s: %s", name, why)
                continue
            new = MarlinLinear.from_linear(child, group_size)
            converted[id(child)] = new
            setattr(parent, child_name, new)
            report.replaced.append(name)
    if isinstance(model, nn.Linear):
        report.skipped.append(("", "the model itself is an nn.Linear; wrap it or use MarlinLinear.from_linear"))
    log.info("replace_linear: replaced %d layers, kept %d", len(report.replaced), len(report.skipped))
    if fuse:
        from .fuse import fuse_projections  # imports this module: import here, not at the top

        report.fused = fuse_projections(model)
    return report


def _skip_reason(name, linear, include, exclude, group_size) -> tuple[Optional[str], bool]:
    """(why the layer is kept, or None; whether the name filters selected it)."""
    pattern = _matches(name, exclude)
    if pattern is not None:
        return f"excluded by pattern {pattern!r}", False
    if include is not None and _matches(name, include) is None:
        return f"not matched by include {list(include)}", False
    if type(linear) is not nn.Linear:
        return f"{type(linear).__name__} is a subclass of nn.Linear (only plain nn.Linear is replaced)", True
    reason = ops.check_shape(linear.in_features, linear.out_features, group_size)
    if reason is not None:
        return f"shape not supported by the kernel: {reason}", True
    if linear.weight.is_meta:
        return "weight is on the meta device (no values to quantize)", True
    return None, True
