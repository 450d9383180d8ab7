"""transformers attention ``"marlin_decode"``: marlin's decode attention for one-token steps, SDPA otherwise.

    import marlin.integrations.hf_attention as hf_attention
    hf_attention.register()                         # once; marlin.compile_for_decode does it
    model.set_attn_implementation("marlin_decode")  # or from_pretrained(..., attn_implementation=...)

A decode step's attention is one query per sequence against the whole static cache: SDPA (cuDNN
on Hopper) reads all of it, masked tail included, and runs a prefill kernel's tiles for one row.
``torch.ops.marlin.decode_attention`` reads only each sequence's visible range, once per key/value
head. Everything it does not take goes to transformers' own ``sdpa_attention_forward`` unchanged:
prompts (more than one query), dropout, position biases (ALiBi, T5), soft-capping, attention
weights asked for, and masks that differ per head or per query. Masks are built as for "sdpa"
(the same mask function is registered under the name).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["NAME", "register", "marlin_decode_attention_forward"]

NAME = "marlin_decode"


def _decode_mask(mask: Optional[torch.Tensor], batch: int, kv_len: int):
    """The [B or 1, N] mask decode_attention takes, or False where the mask does not fit it."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[3] != kv_len:
        return False
    if mask.shape[0] not in (1, batch):
        return False
    if mask.dtype != torch.bool and not mask.is_floating_point():
        return False
    return mask[:, 0, 0, :]


def marlin_decode_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
):
    """transformers' attention-function signature: query [B, H, q_len, D], key / value
    [B, Hkv, N, D]; returns ([B, q_len, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = _decode_mask(attention_mask, query.shape[0], key.shape[2])
    simple = (
        query.shape[2] == 1
        and mask is not False
        and dropout == 0.0
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
        and key.shape[-1] == query.shape[-1] == value.shape[-1]
        and query.shape[1] % key.shape[1] == 0
        and key.dtype == query.dtype == value.dtype
        and query.dtype in (torch.float16, torch.bfloat16, torch.float32)
    )
    if not simple:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.marlin.decode_attention(query[:, :, 0, :], key, value, mask, float(scale))
    return out.unsqueeze(1), None  # [B, 1, H, D], contiguous


def register() -> bool:
    """Registers ``"marlin_decode"`` with transformers' attention and mask interfaces (idempotent).
    Returns False where transformers (or its attention interface) is missing."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    # (torch.ops.marlin.decode_attention is defined by `import marlin`, which this package's import ran)
    AttentionInterface.register(NAME, marlin_decode_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return True
