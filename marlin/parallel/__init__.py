"""Tensor parallelism for Marlin layers on torch.distributed (NCCL on GPUs, gloo on CPUs).

    import torch.distributed as dist, marlin
    dist.init_process_group("nccl")                     # launched with torchrun --nproc-per-node T
    model = marlin.parallel.load_sharded("llama-marlin", device=f"cuda:{rank}")   # reads only its slices
    # or, with a model every rank already holds:
    marlin.tensor_parallel(model)                       # shards per the model's tp_plan, in place

Modules: ``shard`` (which part of a packed layer a rank holds: plain slices of the packed tensors),
``comm`` (the two collectives), ``layers`` (ColumnParallelLinear / RowParallelLinear), ``model``
(tensor_parallel for transformers models), ``loader`` (sharded loading from safetensors).
See docs/PARALLEL.md.
"""

from .layers import ColumnParallelLinear, RowParallelLinear
from .loader import load_sharded
from .model import TPReport, tensor_parallel
from .shard import ShardError

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ShardError", "TPReport", "load_sharded", "tensor_parallel"]
