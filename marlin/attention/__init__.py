"""Attention for decode steps (one query token per sequence over a KV cache).

``torch.ops.marlin.decode_attention`` (marlin.attention.decode_op): a Triton kernel on CUDA that
reads only the visible part of a static cache, in one pass over each key/value head for all the
query heads that share it. ``marlin.integrations.hf_attention`` puts it behind transformers'
attention interface as ``attn_implementation="marlin_decode"`` (SDPA for everything else).
"""

from .decode_op import decode_attention, masked_below, split_count

__all__ = ["decode_attention", "masked_below", "split_count"]
