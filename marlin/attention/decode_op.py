"""``torch.ops.marlin.decode_attention``: attention of one query token per sequence over a KV cache.

    out = torch.ops.marlin.decode_attention(q, k, v, mask, scale)

q [B, H, D], k and v [B, Hkv, N, D] (any strides; H a multiple of Hkv:
grouped-query attention without repeating k and v), mask None or [B, N] / [1, N] (boolean, True =
visible, or additive in any float dtype, broadcast over heads), scale the factor on q.k. Returns
[B, H, D] in q's dtype: softmax(scale * q.k + mask) @ v per head, in float32 inside. A sequence
with no visible position gets zeros (SDPA: NaN with -inf masks, the mean of v with finite ones).

On CUDA it runs marlin.attention.decode_kernel (Triton), which skips the masked head and tail of
each sequence's cache; elsewhere a reference in float32 torch ops. The op is defined in Python,
not in csrc/torch_bindings.cpp, because its kernels are Triton's, compiled at the first call.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

__all__ = ["decode_attention", "split_count", "masked_below"]

# how many of a sequence's positions one program takes at least before they are split over more
# programs (decode_kernel.TUNING has the kernel's block of positions)
MIN_SPLIT_LEN = 256
MAX_SPLITS = 16


def masked_below(mask_dtype: torch.dtype) -> float:
    """The additive mask value at or below which a position counts as masked for the range scan
    (half the dtype's most negative finite number; transformers masks with that number or -inf)."""
    return float(torch.finfo(mask_dtype).min) / 2


def split_count(batch: int, kv_heads: int, n_kv: int, sms: int, min_len: int = MIN_SPLIT_LEN) -> int:
    """How many programs share one sequence and key/value head: enough to give each SM two
    programs, no fewer than ``min_len`` positions each, at most MAX_SPLITS. Shapes only (a CUDA
    graph replays it)."""
    want = max(1, (2 * sms) // max(1, batch * kv_heads))
    return max(1, min(want, math.ceil(n_kv / min_len), MAX_SPLITS))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
    torch._check(q.dim() == 3, lambda: f"marlin.decode_attention: q must be [B, H, D], got shape {tuple(q.shape)}")
    torch._check(k.dim() == 4 and v.dim() == 4,
                 lambda: f"marlin.decode_attention: k and v must be [B, Hkv, N, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    torch._check(k.shape == v.shape, lambda: f"marlin.decode_attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    torch._check(q.dtype in (torch.float16, torch.bfloat16, torch.float32),
                 lambda: f"marlin.decode_attention: q.dtype = {q.dtype}, expected float16, bfloat16 or float32")
    torch._check(k.dtype == q.dtype and v.dtype == q.dtype,
                 lambda: f"marlin.decode_attention: q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype}, expected all the same")
    b, h, d = q.shape
    torch._check(k.shape[0] == b, lambda: f"marlin.decode_attention: k.shape[0] = {k.shape[0]}, expected the batch {b}")
    torch._check(k.shape[3] == d, lambda: f"marlin.decode_attention: k.shape[3] = {k.shape[3]}, expected q's head size {d}")
    torch._check(k.shape[1] >= 1 and h % k.shape[1] == 0,
                 lambda: f"marlin.decode_attention: {h} query heads are not a multiple of {k.shape[1]} key/value heads")
    if mask is not None:
        torch._check(mask.dim() == 2 and mask.shape[0] in (1, b) and mask.shape[1] == k.shape[2],
                     lambda: f"marlin.decode_attention: mask shape {tuple(mask.shape)}, expected [{b}, {k.shape[2]}] or "
                             f"[1, {k.shape[2]}]")
        torch._check(mask.dtype == torch.bool or mask.is_floating_point(),
                     lambda: f"marlin.decode_attention: mask.dtype = {mask.dtype}, expected bool or a float dtype")


def _reference(q, k, v, mask, scale: float) -> torch.Tensor:
    """float32 torch ops, the CPU implementation and the tests' reference of the skip rule."""
    b, h, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    group = h // hkv
    qf = q.float().reshape(b, hkv, group, d)
    s = torch.einsum("bkgd,bknd->bkgn", qf, k.float()) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            vis = mask
            bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        else:
            vis = mask > masked_below(mask.dtype)
            bias = mask.float()
        # the kernel drops the masked head and tail of each row (positions outside [first visible,
        # last visible]); inside, every value is added as it is
        idx = torch.arange(n, device=mask.device)
        first = torch.where(vis, idx, n).amin(dim=1, keepdim=True)
        last = torch.where(vis, idx, -1).amax(dim=1, keepdim=True)
        inside = (idx >= first) & (idx <= last)
        if mask.dtype == torch.bool:
            bias = bias.masked_fill(~vis, float("-inf"))
        bias = bias.masked_fill(~inside, float("-inf"))
        s = s + bias.expand(b, n)[:, None, None, :]
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    den = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bkgn,bknd->bkgd", p, v.float()) / torch.where(den > 0, den, torch.ones_like(den))
    return out.reshape(b, h, d).to(q.dtype)


@torch.library.custom_op("marlin::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                     scale: float) -> torch.Tensor:
    _check(q, k, v, mask)
    return _reference(q, k, v, mask, scale)


@decode_attention.register_fake
def _(q, k, v, mask, scale):
    _check(q, k, v, mask)
    return q.new_empty(q.shape)


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@decode_attention.register_kernel("cuda")
def _(q, k, v, mask, scale):
    _check(q, k, v, mask)
    from .decode_kernel import launch  # Triton: imported at the first CUDA call

    return launch(q, k, v, mask, scale, _sms(q.device.index if q.device.index is not None else torch.cuda.current_device()))


def triton_pow2(x: int) -> int:
    """The next power of two >= x (Triton's block sizes)."""
    return 1 << max(0, (int(x) - 1).bit_length())
