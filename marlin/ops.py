"""Python entry points to the ``torch.ops.marlin`` ops, and their fake (meta) kernels.

The fake kernels repeat the C++ shape checks (csrc/gemm_checks.h) with ``torch._check`` so that
``torch.compile(fullgraph=True)`` traces models that call the ops and reports bad shapes early.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _C  # noqa: F401  (loads the library that defines the schemas)
from . import packing
from .sparse import K_MULTIPLE_2_4, N_MULTIPLE_2_4, STRIP_K, SUPPORTED_GROUP_SIZES_2_4, unpack_2_4

__all__ = [
    "gemm",
    "gemm_2_4",
    "workspace_size",
    "make_workspace",
    "K_MULTIPLE",
    "N_MULTIPLE",
    "GROUP_SIZES",
    "check_shape",
]

# What the gemm op accepts (must match csrc/gemm_checks.h).
K_MULTIPLE = 64
N_MULTIPLE = 64
GROUP_SIZES = (32, 64, 128)  # besides per column (-1)


def check_shape(in_features: int, out_features: int, group_size: int, bits: int = 4) -> Optional[str]:
    """None if gemm takes B [K=in_features, N=out_features] with this group size and width, else why not."""
    if isinstance(bits, bool) or bits not in packing.SUPPORTED_BITS:
        return f"bits = {bits!r}, expected one of {packing.SUPPORTED_BITS}"
    if isinstance(group_size, bool) or group_size not in packing.SUPPORTED_GROUP_SIZES:
        return f"group_size = {group_size!r}, expected one of {packing.SUPPORTED_GROUP_SIZES} (-1: per column)"
    if in_features <= 0 or in_features % K_MULTIPLE:
        return f"in_features = {in_features}, expected a positive multiple of {K_MULTIPLE}"
    if group_size != -1 and in_features % group_size:
        return f"in_features = {in_features} is not a multiple of group_size = {group_size}"
    if out_features <= 0 or out_features % N_MULTIPLE:
        return f"out_features = {out_features}, expected a positive multiple of {N_MULTIPLE}"
    return None


def workspace_size(device: torch.device | str | int | None = None) -> int:
    """int32 elements of the lock workspace for gemm on ``device``: two per multiprocessor."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        return 1
    return 2 * max(1, torch.cuda.get_device_properties(device).multi_processor_count)


def make_workspace(device: torch.device | str | int | None = None) -> torch.Tensor:
    """A zeroed workspace for gemm. Reusable across calls (the kernel leaves it zeroed), but not by
    two calls that may run concurrently on different streams."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    return torch.zeros(workspace_size(dev), dtype=torch.int32, device=dev)


def gemm(
    a: torch.Tensor,
    b_q: torch.Tensor,
    b_scales: torch.Tensor,
    workspace: Optional[torch.Tensor] = None,
    *,
    b_zeros: Optional[torch.Tensor] = None,
    bits: int = 4,
    tile_k: Optional[int] = None,
    tile_n: Optional[int] = None,
) -> torch.Tensor:
    """C[M, N] = a[M, K] @ dequant(b_q, b_scales, b_zeros) in a's dtype (float16 or bfloat16).
    See torch.ops.marlin.gemm and marlin.packing for the formats. Differentiable with respect to
    ``a`` (below: _GemmGrad)."""
    if torch.is_grad_enabled() and _wants_grad(a, b_scales, b_zeros):
        return _GemmGrad.apply(a, b_q, b_scales, b_zeros, workspace, tile_k, tile_n, bits)
    return torch.ops.marlin.gemm(a, b_q, b_scales, b_zeros, workspace, tile_k, tile_n, bits)


_DTYPES = (torch.float16, torch.bfloat16)


@torch.library.register_fake("marlin::gemm")
def _gemm_fake(a, b_q, b_scales, b_zeros=None, workspace=None, tile_k=None, tile_n=None, bits=4):
    torch._check(a.dim() == 2, lambda: f"marlin.gemm: a.dim() = {a.dim()}, expected 2 (a is [M, K])")
    torch._check(a.dtype in _DTYPES, lambda: f"marlin.gemm: a.dtype = {a.dtype}, expected torch.float16 or torch.bfloat16")
    torch._check(bits in (4, 8), lambda: f"marlin.gemm: bits = {bits}, expected 4 or 8")
    wpc = bits // 2
    torch._check(b_q.dim() == 2 and b_q.dtype == torch.int32, lambda: f"marlin.gemm: b_q must be int32 [K/16, {wpc}*N]")
    torch._check(b_scales.dim() == 2, lambda: "marlin.gemm: b_scales must be [groups, N]")
    torch._check(
        b_scales.dtype == a.dtype,
        lambda: f"marlin.gemm: b_scales.dtype = {b_scales.dtype} but a.dtype = {a.dtype}, expected the same dtype",
    )
    torch._check(b_q.shape[1] % wpc == 0, lambda: f"marlin.gemm: b_q.size(1) = {b_q.shape[1]}, expected {wpc}*N")
    k = b_q.shape[0] * 16
    n = b_q.shape[1] // wpc
    torch._check(a.shape[1] == k, lambda: f"marlin.gemm: a.size(1) = {a.shape[1]}, expected K = b_q.size(0) * 16 = {k}")
    torch._check(k % K_MULTIPLE == 0, lambda: f"marlin.gemm: K = {k}, expected a positive multiple of {K_MULTIPLE}")
    torch._check(n % N_MULTIPLE == 0, lambda: f"marlin.gemm: N = {n}, expected a positive multiple of {N_MULTIPLE}")
    torch._check(b_scales.shape[1] == n, lambda: f"marlin.gemm: b_scales.size(1) = {b_scales.shape[1]}, expected N = {n}")
    groups = b_scales.shape[0]
    torch._check(
        groups == 1 or any(groups * g == k for g in GROUP_SIZES),
        lambda: f"marlin.gemm: b_scales.size(0) = {groups}, expected 1 or K / group_size with group_size in {GROUP_SIZES}",
    )
    if b_zeros is not None:
        torch._check(bits == 4, lambda: "marlin.gemm: zero points are supported for 4-bit weights only")
        torch._check(
            b_zeros.dtype == a.dtype and tuple(b_zeros.shape) == tuple(b_scales.shape),
            lambda: "marlin.gemm: b_zeros must have the dtype of a and the shape of b_scales",
        )
    return a.new_empty((a.shape[0], n))


# -- 2:4-sparse INT4 weights (marlin/sparse.py; checks as csrc/gemm_2_4_checks.h) -------------
def gemm_2_4(
    a: torch.Tensor,
    b_q: torch.Tensor,
    b_meta: torch.Tensor,
    b_scales: torch.Tensor,
    workspace: Optional[torch.Tensor] = None,
    b_zeros: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """C[M, N] = a[M, K] @ dequant(b_q, b_meta, b_scales, b_zeros) for 2:4-sparse weights packed by
    marlin.sparse.quantize_and_pack_2_4; a, b_scales, b_zeros and the result all float16 or all
    bfloat16. ``b_zeros`` None: symmetric weights; else the zero points of
    ``quantize_and_pack_2_4(..., sym=False)``. See torch.ops.marlin.gemm_2_4. Differentiable with
    respect to ``a`` (below: _Gemm24Grad)."""
    if torch.is_grad_enabled() and _wants_grad(a, b_scales, b_zeros):
        return _Gemm24Grad.apply(a, b_q, b_meta, b_scales, workspace, b_zeros)
    return torch.ops.marlin.gemm_2_4(a, b_q, b_meta, b_scales, workspace, b_zeros)


@torch.library.register_fake("marlin::gemm_2_4")
def _gemm_2_4_fake(a, b_q, b_meta, b_scales, workspace=None, b_zeros=None):
    op = "marlin.gemm_2_4"
    torch._check(a.dim() == 2, lambda: f"{op}: a.dim() = {a.dim()}, expected 2 (a is [M, K])")
    torch._check(
        a.dtype in (torch.float16, torch.bfloat16), lambda: f"{op}: a.dtype = {a.dtype}, expected torch.float16 or torch.bfloat16"
    )
    torch._check(b_q.dim() == 2 and b_q.dtype == torch.int32, lambda: f"{op}: b_q must be int32 [K/32, 2*N]")
    torch._check(b_meta.dim() == 2 and b_meta.dtype == torch.int32, lambda: f"{op}: b_meta must be int32 [K/32, N]")
    torch._check(
        b_scales.dim() == 2 and b_scales.dtype == a.dtype,
        lambda: f"{op}: b_scales must be [groups, N] of a's dtype ({a.dtype}), got {b_scales.dtype}",
    )
    torch._check(b_q.shape[1] % 2 == 0, lambda: f"{op}: b_q.size(1) = {b_q.shape[1]}, expected 2*N")
    k = b_q.shape[0] * STRIP_K
    n = b_q.shape[1] // 2
    torch._check(a.shape[1] == k, lambda: f"{op}: a.size(1) = {a.shape[1]}, expected K = b_q.size(0) * 32 = {k}")
    torch._check(k > 0 and k % K_MULTIPLE_2_4 == 0, lambda: f"{op}: K = {k}, expected a positive multiple of {K_MULTIPLE_2_4}")
    torch._check(n > 0 and n % N_MULTIPLE_2_4 == 0, lambda: f"{op}: N = {n}, expected a positive multiple of {N_MULTIPLE_2_4}")
    torch._check(
        b_meta.shape[0] == b_q.shape[0] and b_meta.shape[1] == n,
        lambda: f"{op}: b_meta shape {tuple(b_meta.shape)}, expected [K/32, N] = [{k // STRIP_K}, {n}]",
    )
    torch._check(b_scales.shape[1] == n, lambda: f"{op}: b_scales.size(1) = {b_scales.shape[1]}, expected N = {n}")
    groups = b_scales.shape[0]
    group_sizes = [g for g in SUPPORTED_GROUP_SIZES_2_4 if g != -1]
    torch._check(
        groups == 1 or any(groups * g == k for g in group_sizes),
        lambda: f"{op}: b_scales.size(0) = {groups}, expected 1 (per-column scales) or K / group_size with group_size "
        f"{', '.join(map(str, group_sizes[:-1]))} or {group_sizes[-1]} along the original K (K = {k}: "
        f"{', '.join(str(k // g) for g in group_sizes[:-1])} or {k // group_sizes[-1]})",
    )
    if b_zeros is not None:
        torch._check(
            b_zeros.dtype == a.dtype,
            lambda: f"{op}: b_zeros.dtype = {b_zeros.dtype} but a.dtype = {a.dtype}; they must match (zero points "
            "are stored like the scales)",
        )
        torch._check(
            b_zeros.dim() == 2 and tuple(b_zeros.shape) == tuple(b_scales.shape),
            lambda: f"{op}: b_zeros shape {list(b_zeros.shape)}, expected the shape of b_scales {list(b_scales.shape)}",
        )
        torch._check(
            b_zeros.device == a.device,
            lambda: f"{op}: b_zeros is on {b_zeros.device} but a is on {a.device}; all tensors must be on one device",
        )
    return a.new_empty((a.shape[0], n))


# -- gradients: with respect to the activations only ----------------------------------------
# C = a @ W with W = dequant(packed weights) fixed, so dC/da = grad_C @ W^T. The raw ops have no
# autograd formula: a Python one registered on them would cost every eager call ~5 us of host
# time, also under no_grad (2.2 -> 7.2 us per call on the CPU machine), which eager decoding
# pays 100+ times a step. So the Python entry points (marlin.gemm, marlin.gemm_2_4, and the
# layers, which call them) take the autograd.Function below only when grad mode is on and an
# operand requires grad; otherwise they call the op directly. A backward through the raw
# torch.ops.marlin.* gets PyTorch's fallback (a warning, no gradient for `a`). The backward
# dequantizes W (exact, float32 [K, N] per call) and multiplies: correct rather than fast. The
# dequantization is an op of its own so that torch.compile traces the backward as one opaque
# node (the unpacking's index tables and checks do not run on fake tensors). The packed weights,
# scales and zero points are constants: asking for their gradient is refused at the forward.
@torch.library.custom_op("marlin::dequantize_weight", mutates_args=())
def _dequantize_weight(b_q: torch.Tensor, b_scales: torch.Tensor, b_zeros: Optional[torch.Tensor], bits: int) -> torch.Tensor:
    """The float32 [K, N] weight of marlin::gemm's operands (packing.unpack, then dequantize)."""
    return packing.dequantize(*packing.unpack(b_q, b_scales, b_zeros, bits))


@_dequantize_weight.register_fake
def _(b_q, b_scales, b_zeros, bits):
    return b_q.new_empty((b_q.shape[0] * 16, b_q.shape[1] // (bits // 2)), dtype=torch.float32)


@torch.library.custom_op("marlin::dequantize_weight_2_4", mutates_args=())
def _dequantize_weight_2_4(
    b_q: torch.Tensor, b_meta: torch.Tensor, b_scales: torch.Tensor, b_zeros: Optional[torch.Tensor]
) -> torch.Tensor:
    """The float32 [K, N] weight of marlin::gemm_2_4's operands, zeros at the pruned positions."""
    return unpack_2_4(b_q, b_meta, b_scales, b_zeros)


@_dequantize_weight_2_4.register_fake
def _(b_q, b_meta, b_scales, b_zeros):
    return b_q.new_empty((b_q.shape[0] * STRIP_K, b_meta.shape[1]), dtype=torch.float32)


def _wants_grad(a: torch.Tensor, b_scales: torch.Tensor, b_zeros: Optional[torch.Tensor]) -> bool:
    return a.requires_grad or b_scales.requires_grad or (b_zeros is not None and b_zeros.requires_grad)


def _refuse_weight_grads(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise ValueError(
                f"{op}: {name}.requires_grad is True, but the op differentiates with respect to `a` only "
                "(the quantized weights, scales and zero points are constants); detach it or set requires_grad=False"
            )


class _GemmGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b_q, b_scales, b_zeros, workspace, tile_k, tile_n, bits):
        _refuse_weight_grads("marlin.gemm", b_scales=b_scales, b_zeros=b_zeros)
        ctx.bits = bits
        ctx.save_for_backward(b_q, b_scales, b_zeros)
        return torch.ops.marlin.gemm(a, b_q, b_scales, b_zeros, workspace, tile_k, tile_n, bits)

    @staticmethod
    def backward(ctx, grad):
        b_q, b_scales, b_zeros = ctx.saved_tensors
        w = torch.ops.marlin.dequantize_weight(b_q, b_scales, b_zeros, ctx.bits)  # [K, N] float32
        return (grad.float() @ w.t()).to(grad.dtype), None, None, None, None, None, None, None


class _Gemm24Grad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b_q, b_meta, b_scales, workspace, b_zeros):
        _refuse_weight_grads("marlin.gemm_2_4", b_scales=b_scales, b_zeros=b_zeros)
        ctx.save_for_backward(b_q, b_meta, b_scales, b_zeros)
        return torch.ops.marlin.gemm_2_4(a, b_q, b_meta, b_scales, workspace, b_zeros)

    @staticmethod
    def backward(ctx, grad):
        b_q, b_meta, b_scales, b_zeros = ctx.saved_tensors
        w = torch.ops.marlin.dequantize_weight_2_4(b_q, b_meta, b_scales, b_zeros)  # [K, N] float32
        return (grad.float() @ w.t()).to(grad.dtype), None, None, None, None, None
