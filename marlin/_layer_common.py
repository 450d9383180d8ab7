"""What the quantized linear layers share: MarlinLinear (marlin/nn.py, dense) and MarlinLinear24
(marlin/sparse_nn.py, 2:4-sparse).

Both hold packed weights in buffers (``b_q``, ``b_scales``, optional ``bias``) plus a zeroed lock
``workspace``, keep their dtype through ``.to()``/``.half()`` (the scales are part of the weight
format), check their input the same way and refuse state dicts from a newer marlin. The format-
specific parts (buffers, packing, the op that computes) stay in each class.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import ops, packing


def new_workspace(device: torch.device) -> torch.Tensor:
    """A zeroed lock workspace for the gemm ops on ``device`` (the CPU ops ignore it; one element suffices)."""
    if device.type == "cuda":
        return ops.make_workspace(device)
    return torch.zeros(1, dtype=torch.int32, device=device)


def rotate_blocks(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [..., K] with every block of r consecutive features multiplied by ``rotation`` [r, r]:
    x blockdiag(R, ..., R), one batched product (MarlinLinear's input_rotation and the float
    model's pre-hook of marlin.quantize.rotate compute it alike)."""
    r = rotation.shape[0]
    return torch.matmul(x.reshape(*x.shape[:-1], x.shape[-1] // r, r), rotation.to(x.dtype)).reshape(x.shape)


def rotation_block_problem(r, in_features: int) -> Optional[str]:
    """Why ``r`` cannot be the block of an input rotation of a layer with ``in_features`` inputs, or None."""
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        return f"{r!r} is not a positive block size"
    if in_features % r:
        return f"{r} does not divide in_features = {in_features}"
    return None


def is_rotation_shape(shape, in_features: int) -> bool:
    """Whether ``shape`` is an input rotation's [r, r], r a block size dividing ``in_features``."""
    shape = tuple(shape)
    return len(shape) == 2 and shape[0] == shape[1] and rotation_block_problem(shape[0], in_features) is None


def check_rotation_block(r, in_features: int, what: str) -> None:
    """ValueError naming ``what`` unless ``r`` is a block size dividing ``in_features``."""
    problem = rotation_block_problem(r, in_features)
    if problem is not None:
        raise ValueError(f"{what}: {problem}; expected a block size r dividing in_features (an [r, r] rotation)")


def float_weight(linear: nn.Module) -> torch.Tensor:
    """The weight of the nn.Linear that from_linear quantizes; TypeError / ValueError when there is none to read."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"from_linear: expected an nn.Linear, got {type(linear).__name__}")
    if linear.weight.is_meta:
        raise ValueError("from_linear: the layer's weight is on the meta device (no values to quantize)")
    return linear.weight


class QuantizedLinearBase(nn.Module):
    """Base of MarlinLinear and MarlinLinear24. A subclass registers ``b_q``, ``b_scales``, ``bias``
    (or None) and a non-persistent ``workspace``, sets ``in_features``, ``out_features`` and
    ``group_size``, and sets ``_version`` (its state_dict layout)."""

    _version: int

    # -- from_linear ---------------------------------------------------------------------------
    @classmethod
    def _empty_for(cls, linear: nn.Module, group_size: int, dtype: Optional[torch.dtype], **format_kwargs):
        """(an empty layer of ``linear``'s shape, bias and device, and ``linear``'s weight), the layer in
        ``dtype`` or, for None, the weight's dtype rule: bf16 stays bf16, everything else becomes
        fp16. ``format_kwargs``: the subclass's format arguments (bits, zero points)."""
        weight = float_weight(linear)
        if dtype is None:
            dtype = weight.dtype if weight.dtype in packing.SUPPORTED_DTYPES else torch.float16
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            group_size=group_size,
            device=weight.device,
            dtype=dtype,
            **format_kwargs,
        )
        return layer, weight

    def _copy_bias(self, linear: nn.Linear) -> None:
        if linear.bias is not None:
            self.bias.copy_(linear.bias.detach())

    # -- forward -------------------------------------------------------------------------------
    def _dtype_advice(self, got: torch.dtype) -> str:
        """How to fix an input of dtype ``got``: run the model in the layer's dtype, or, where ``got``
        is the other dtype the kernels compute in, build the layer in it."""
        advice = f"the layer's compute dtype; run the model in that dtype, e.g. model.to({self.dtype})"
        if got in (torch.float16, torch.bfloat16):
            return advice + f", or build the layer with dtype={got}"
        return advice + "; the kernels compute in torch.float16 or torch.bfloat16"

    def _flat_input(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x [..., in_features] as [M, in_features], after checking its dtype (TypeError) and width
        (ValueError). Both checks depend only on dtype and shape, which torch.compile specializes
        on, so they cost nothing in a compiled graph."""
        if x.dtype != dtype:
            raise TypeError(
                f"{type(self).__name__}: input dtype is {x.dtype}, expected {dtype} ({self._dtype_advice(x.dtype)})"
            )
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__}: input shape {tuple(x.shape)}, expected [..., {self.in_features}]")
        return x.reshape(-1, self.in_features)

    def _output(self, y: torch.Tensor, lead: torch.Size) -> torch.Tensor:
        """The op's y [M, out_features] plus the bias, shaped [*lead, out_features]."""
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    # -- device moves --------------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        # Keep the dtype: a dtype change of the scales (bf16 has fewer mantissa bits than fp16,
        # fp16 less range than bf16) would change the weights. Device moves and to_empty still apply.
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(device=out.device)

        old_workspace = self.workspace
        super()._apply(keep_dtype, recurse)
        # The workspace must be zeroed and sized for its device: make a new one whenever it was
        # moved or re-allocated (to_empty), but keep it when nothing changed, so that a CUDA graph
        # captured earlier still points at live memory.
        if self.workspace is not old_workspace or self.workspace.device != self.b_q.device:
            self.workspace = new_workspace(self.b_q.device)
        return self

    # -- state_dict checks (called from each class's _load_from_state_dict) --------------------
    def _version_readable(self, local_metadata: dict, prefix: str, error_msgs: list) -> bool:
        """False (and an error) when the state dict was written in a newer layout than this class
        reads. No version (e.g. a converted safetensors checkpoint) means the current layout."""
        version = local_metadata.get("version")
        if version is not None and version > self._version:
            error_msgs.append(
                f"{prefix}: {type(self).__name__} state_dict version {version} was written by a newer marlin "
                f"(this one reads up to {self._version}); upgrade marlin"
            )
            return False
        return True

    def _check_scale_rows(self, state_dict: dict, prefix: str, error_msgs: list) -> None:
        """The checkpoint's group size (its number of scale rows) must be the layer's:
        load_state_dict would otherwise fail with a bare size mismatch."""
        scales: Optional[torch.Tensor] = state_dict.get(prefix + "b_scales")
        if isinstance(scales, torch.Tensor) and scales.dim() == 2 and scales.shape[0] != self.b_scales.shape[0]:
            error_msgs.append(
                f"{prefix}b_scales: {scales.shape[0]} scale rows, i.e. group size "
                f"{packing.group_size_of(self.in_features, scales.shape[0])}, but this layer was built with "
                f"group_size={self.group_size} ({self.b_scales.shape[0]} rows)"
            )
