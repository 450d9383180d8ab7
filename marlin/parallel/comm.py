"""The two collectives tensor-parallel layers need, on torch.distributed (NCCL on GPUs, gloo on CPUs).

Both work in eager mode and under CUDA-graph capture with NCCL (in-place collectives on the
current stream; no host synchronisation).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["rank_and_size", "all_reduce_sum", "all_gather_last"]


def rank_and_size(group: Optional[dist.ProcessGroup] = None) -> tuple:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialized, so that
    a model can be "sharded" for one process without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given, but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_reduce_sum(y: torch.Tensor, group: Optional[dist.ProcessGroup], world_size: int) -> torch.Tensor:
    """Sum of ``y`` over the ranks (in place; returns y)."""
    if world_size > 1:
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y


def all_gather_last(x: torch.Tensor, group: Optional[dist.ProcessGroup], world_size: int) -> torch.Tensor:
    """The ranks' ``x`` [..., D] concatenated in rank order along the last dim: [..., world_size D]."""
    if world_size == 1:
        return x
    lead, d = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, d).contiguous()
    out = torch.empty((world_size * flat.shape[0], d), dtype=x.dtype, device=x.device)
    _all_gather_single(out, flat, group=group)  # rank r's rows at out[r M : (r + 1) M]
    out = out.view(world_size, flat.shape[0], d).transpose(0, 1)
    return out.reshape(*lead, world_size * d)


# torch 2.13 renamed all_gather_into_tensor (kept as a deprecated alias) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
