"""MarlinLinear24: a drop-in for nn.Linear with 2:4-sparse INT4 weights (Sparse-MARLIN).

    layer = marlin.MarlinLinear24.from_linear(nn.Linear(4096, 11008).half())  # prunes to 2:4
    layer = marlin.MarlinLinear24.from_linear(linear, sym=False)  # with zero points
    report = marlin.replace_linear_2_4(model)        # every eligible nn.Linear, lm_head excluded
    print(report)                                    # per layer: share of the weight norm pruned

The layer computes y = x @ B + bias with B [in_features, out_features] 2:4-sparse along
in_features and stored in the format of marlin/sparse.py (torch.ops.marlin.gemm_2_4).
``MarlinLinear.from_linear(linear, sparsity="2:4")`` and ``replace_linear(model, sparsity="2:4")``
lead here too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
from torch import nn

from . import ops, packing, sparse
from ._layer_common import QuantizedLinearBase, new_workspace
from .nn import ReplaceReport, _as_patterns, _skip_reason, _swap_linears

__all__ = ["MarlinLinear24", "SparseReplaceReport", "replace_linear_2_4", "SPARSITIES"]

log = logging.getLogger(__name__)

SPARSITIES = ("2:4",)  # what sparsity= accepts besides None (dense)

# Empty layer: every kept value q = 0 (nibble 8) at positions (0, 1) (nibble 0b0100 per group).
_ZERO_WORD = 0x88888888 - 2**32
_META_01 = 0x44444444


def check_sparsity(sparsity: Optional[str], where: str) -> None:
    if sparsity is not None and sparsity not in SPARSITIES:
        raise ValueError(f"{where}: sparsity = {sparsity!r}, expected None (dense) or one of {SPARSITIES}")


class MarlinLinear24(QuantizedLinearBase):
    """y = x @ dequant(b_q, b_meta, b_scales, b_zeros) + bias, x [..., in_features] -> [..., out_features].

    The layer has one compute dtype, float16 or bfloat16 (``dtype``): the input, the scales, the
    zero points, the bias and the output. Weights: 4-bit symmetric, or with ``zero_points`` (a
    kept value is (u - z) * s; pruned ones are zero either way), in groups of ``group_size``
    input rows (128, 64, 32) or one scale per output column (-1).

    Buffers (all in ``state_dict`` except ``workspace``):
      * ``b_q``       int32 [in_features / 32, 2 * out_features]: the kept INT4 values;
      * ``b_meta``    int32 [in_features / 32, out_features]: their positions (2 bits each);
      * ``b_scales``  dtype [groups, out_features]: groups = in_features / group_size, or 1 (-1);
      * ``b_zeros``   dtype [groups, out_features] (integer zero points 0..15), or None (symmetric),
                      as in MarlinLinear;
      * ``bias``      dtype [out_features], or None;
      * ``workspace`` int32, non-persistent: the kernel's lock buffer.

    ``pruned_fraction`` (not saved) is ||W - W_2:4|| / ||W|| of the float weight that from_linear
    pruned, or None. The input must have the layer's dtype (TypeError otherwise).
    ``.half()``/``.float()``/``.to(dtype)`` leave the layer's dtype as it is: its scales are part of
    the weight format.
    """

    # Of the state_dict layout; _load_from_state_dict refuses newer versions. 1: b_q, b_meta,
    # b_scales, bias (symmetric). 2: adds zero points (b_zeros, as MarlinLinear's version 2); a
    # version-1 state dict is a valid version-2 symmetric one (same keys and bytes).
    _version = 2

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group_size: int = 128,
        device: Optional[Union[torch.device, str]] = None,
        dtype: torch.dtype = torch.float16,
        *,
        zero_points: bool = False,
    ):
        super().__init__()
        if dtype not in sparse.DTYPES_2_4:
            raise ValueError(f"MarlinLinear24: dtype = {dtype}, expected torch.float16 or torch.bfloat16")
        reason = sparse.check_shape_2_4(in_features, out_features, group_size)
        if reason is not None:
            raise ValueError(
                f"MarlinLinear24(in_features={in_features}, out_features={out_features}, group_size={group_size}) "
                f"is not supported by the 2:4 kernel: {reason}. It takes in_features a positive multiple of "
                f"{sparse.K_MULTIPLE_2_4}, out_features a positive multiple of {sparse.N_MULTIPLE_2_4} and group_size "
                f"128, 64, 32 or -1 (per column); keep such a layer as nn.Linear."
            )
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.dtype = dtype
        self.pruned_fraction: Optional[float] = None
        strips = in_features // sparse.STRIP_K
        self.register_buffer("b_q", torch.full((strips, 2 * out_features), _ZERO_WORD, dtype=torch.int32, device=device))
        dev = self.b_q.device
        self.register_buffer("b_meta", torch.full((strips, out_features), _META_01, dtype=torch.int32, device=dev))
        groups = packing.num_groups(in_features, group_size)
        self.register_buffer("b_scales", torch.ones(groups, out_features, dtype=dtype, device=dev))
        # zero point 8 with the empty layer's nibbles 8: it computes 0, as the symmetric one does
        self.register_buffer("b_zeros", torch.full((groups, out_features), 8.0, dtype=dtype, device=dev) if zero_points else None)
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=dev) if bias else None)
        self.register_buffer("workspace", new_workspace(dev), persistent=False)

    @property
    def zero_points(self) -> bool:
        return self.b_zeros is not None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group_size: int = 128,
        *,
        prune: bool = True,
        dtype: Optional[torch.dtype] = None,
        sym: bool = True,
    ) -> "MarlinLinear24":
        """Magnitude-prune ``linear`` to 2:4 along in_features (marlin.sparse.prune_2_4), then quantize
        (round to nearest INT4: symmetric, or with zero points for ``sym=False``) on the device of
        its weight. With ``prune=False`` the weight must be 2:4 already (e.g. from SparseGPT):
        ValueError naming the columns that are not. ``dtype`` (default: the weight's dtype if it is
        bfloat16 or float16, else float16) is the layer's compute dtype.
        """
        if isinstance(getattr(linear, "input_rotation", None), torch.Tensor):
            raise ValueError(
                "MarlinLinear24.from_linear: the Linear rotates its input online (input_rotation, marlin.quantize.rotate), "
                "which 2:4 layers do not take; use MarlinLinear, or rotate with down_block=None"
            )
        layer, weight = cls._empty_for(linear, group_size, dtype, zero_points=not sym)
        w = weight.detach().t()  # B = weight^T [K, N]; groups of 4 run along K
        if prune:
            pruned = sparse.prune_2_4(w)
            norm = w.float().norm()
            layer.pruned_fraction = float((w.float() - pruned.float()).norm() / norm) if norm > 0 else 0.0
            w = pruned
        packed = sparse.quantize_and_pack_2_4(w, group_size, dtype=layer.dtype, sym=sym)
        layer.b_q.copy_(packed[0])
        layer.b_meta.copy_(packed[1])
        layer.b_scales.copy_(packed[2])
        if not sym:
            layer.b_zeros.copy_(packed[3])
        layer._copy_bias(linear)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self._flat_input(x, self.dtype)
        y = ops.gemm_2_4(a, self.b_q, self.b_meta, self.b_scales, self.workspace, self.b_zeros)
        return self._output(y, x.shape[:-1])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"group_size={self.group_size}, dtype={self.dtype}, zero_points={self.zero_points}, sparsity=2:4"
        )

    def dequantized_weight(self) -> torch.Tensor:
        """The dense float32 weight [out_features, in_features] the layer computes with (exact)."""
        return sparse.unpack_2_4(self.b_q, self.b_meta, self.b_scales, self.b_zeros).t()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # A dense MarlinLinear's state_dict first: its version numbers MarlinLinear's layouts, not ours.
        b_q = state_dict.get(prefix + "b_q")
        if isinstance(b_q, torch.Tensor) and prefix + "b_meta" not in state_dict:
            error_msgs.append(
                f"{prefix}: the state_dict has b_q but no b_meta: it holds a dense MarlinLinear, not a 2:4 layer "
                "(load it into MarlinLinear)"
            )
            return
        # Version 1 (symmetric) has the keys and bytes of version 2's symmetric layers: it loads as
        # it is, and the zero-point check below refuses it for a layer built with zero points.
        if not self._version_readable(local_metadata, prefix, error_msgs):
            return
        self._check_scale_rows(state_dict, prefix, error_msgs)
        for key, want in (
            ("b_q", torch.int32),
            ("b_meta", torch.int32),
            ("b_scales", self.dtype),
            ("b_zeros", self.dtype),
            ("bias", self.dtype),
        ):
            t = state_dict.get(prefix + key)
            if isinstance(t, torch.Tensor) and t.dtype != want:
                error_msgs.append(f"{prefix}{key}: dtype {t.dtype}, expected {want} (the layer's dtype is {self.dtype})")
        has_zeros = (prefix + "b_zeros") in state_dict
        # only where the state dict holds this layer (load_state_dict(strict=False) of other parts)
        if (prefix + "b_q") in state_dict and has_zeros != self.zero_points:
            error_msgs.append(
                f"{prefix}b_zeros: the checkpoint {'has' if has_zeros else 'has no'} zero points, but this layer was "
                f"built with zero_points={self.zero_points}"
            )
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


@dataclass
class SparseReplaceReport(ReplaceReport):
    """ReplaceReport plus, per replaced layer, ||W - W_2:4|| / ||W||: the share of the weight's
    norm that the 2:4 pruning removed (before quantization)."""

    pruned: dict = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} nn.Linear layers with 2:4-sparse MarlinLinear24, kept {len(self.skipped)}"]
        lines += [f"  {name}: pruning removed {frac:.1%} of the weight norm" for name, frac in self.pruned.items()]
        lines += [f"  kept {name}: {why}" for name, why in self.skipped]
        if self.fused is not None:
            lines.append(str(self.fused))
        return "\n".join(lines)


def replace_linear_2_4(
    model: nn.Module,
    group_size: int = 128,
    include: Union[None, str, Sequence[str]] = None,
    exclude: Union[None, str, Sequence[str]] = ("lm_head",),
    *,
    strict: bool = False,
    prune: bool = True,
    sym: bool = True,
) -> SparseReplaceReport:
    """Swap every eligible ``nn.Linear`` of ``model`` for a MarlinLinear24 (pruned to 2:4 by
    magnitude, then quantized), in place. ``include``/``exclude``/``strict`` as in
    marlin.replace_linear; ``sym=False``: 4-bit zero points. ``prune=False``: the weights must be
    2:4 already (a layer that is not is kept, or raises with ``strict``). Returns a
    SparseReplaceReport (``pruned``: per layer the share of the weight norm removed)."""
    if group_size not in sparse.SUPPORTED_GROUP_SIZES_2_4:
        raise ValueError(f"replace_linear_2_4: group_size = {group_size!r}, expected 128, 64, 32 or -1 (per column)")
    include_p, exclude_p = _as_patterns(include, "include"), _as_patterns(exclude, "exclude") or ()
    report = SparseReplaceReport()

    def convert(name: str, child: nn.Linear) -> MarlinLinear24:
        new = MarlinLinear24.from_linear(child, group_size, prune=prune, sym=sym)
        if new.pruned_fraction is not None:
            report.pruned[name] = new.pruned_fraction
            log.info("replace_linear_2_4: %s: pruning removed %.1f%% of the weight norm", name, 100 * new.pruned_fraction)
        return new

    _swap_linears(
        model,
        report,
        "replace_linear_2_4",
        strict,
        skip_reason=lambda name, child: _skip_reason_2_4(name, child, include_p, exclude_p, group_size, prune),
        convert=convert,
        layer_class=MarlinLinear24,
    )
    return report


def _skip_reason_2_4(name, linear, include, exclude, group_size, prune) -> tuple[Optional[str], bool]:
    """(why the layer is kept, or None; whether the name filters selected it): marlin.nn's reasons
    for the 2:4 kernel's shapes, and with ``prune=False`` a weight that is not 2:4 already."""
    why, selected = _skip_reason(
        name, linear, include, exclude, lambda k, n: sparse.check_shape_2_4(k, n, group_size), "2:4 kernel"
    )
    if why is None and not prune and sparse.violations_2_4(linear.weight.detach().t()).numel():
        return "weight is not 2:4 sparse along in_features (prune=False)", True
    return why, selected
