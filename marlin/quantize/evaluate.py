"""Perplexity on held-out text with a fixed context and stride (``marlin-eval``).

Windows of ``context`` tokens start every ``stride`` tokens. Each window scores the tokens after
the previous window's end, each with the window's earlier tokens as its context. With stride ==
context the windows are disjoint and each window's first token is not scored (nothing in the
window precedes it); a smaller stride gives the scored tokens more context at more cost.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Union

import torch
from tqdm.auto import tqdm

from .calib import read_texts

__all__ = ["perplexity", "evaluate_path", "is_marlin_checkpoint"]


@torch.no_grad()
def perplexity(
    model,
    token_ids: torch.Tensor,
    *,
    context: int = 512,
    stride: Optional[int] = None,
    device: Union[str, torch.device, None] = None,
    progress: bool = False,
) -> dict:
    """{"ppl", "nll", "tokens", "context", "stride", "windows"} of ``model`` on the 1-D ``token_ids``."""
    ids = token_ids.reshape(-1)
    stride = context if stride is None else stride
    if context < 2:
        raise ValueError(f"context = {context}, expected at least 2 tokens")
    if not 1 <= stride <= context:
        raise ValueError(f"stride = {stride}, expected 1 <= stride <= context = {context}")
    if ids.numel() < 2:
        raise ValueError(f"evaluation text has {ids.numel()} tokens, expected at least 2")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    total, nll, windows, prev_end, scored = ids.numel(), 0.0, 0, 1, 0
    starts = list(range(0, max(total - 1, 1), stride))
    bar = tqdm(total=total - 1, desc="perplexity", unit="tok", disable=not progress)
    for begin in starts:
        end = min(begin + context, total)
        if end <= prev_end:
            continue
        window = ids[begin:end].to(device).unsqueeze(0)
        logits = model(input_ids=window, use_cache=False).logits[0].float()
        # Window index of the first scored token: the first not scored before, and never the
        # window's own first token (nothing in the window predicts it).
        first = max(prev_end, begin + 1) - begin
        logp = torch.log_softmax(logits[first - 1 : -1], dim=-1)
        targets = window[0, first:]
        nll -= float(logp.gather(1, targets.unsqueeze(1)).sum())
        scored += targets.numel()
        bar.update(end - prev_end)
        windows += 1
        prev_end = end
        if end == total:
            break
    bar.close()
    return {
        "ppl": math.exp(nll / scored),
        "nll": nll,
        "tokens": scored,
        "context": context,
        "stride": stride,
        "windows": windows,
    }


def is_marlin_checkpoint(path: Union[str, Path]) -> bool:
    """True when ``path``'s config.json says checkpoint_format "marlin"."""
    from ..convert.checkpoint import read_json

    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    raw = read_json(config)
    quant = raw.get("quantization_config") if isinstance(raw, dict) else None
    return isinstance(quant, dict) and quant.get("checkpoint_format") == "marlin"


def evaluate_path(
    model: Union[str, Path],
    text: Union[str, Path],
    *,
    context: int = 512,
    stride: Optional[int] = None,
    max_tokens: Optional[int] = None,
    device: Union[str, torch.device] = "cpu",
    gguf_file: Optional[str] = None,
    progress: bool = True,
) -> dict:
    """Perplexity of a Marlin checkpoint (through MarlinLinear, fp16) or a full-precision model
    (fp16 on a GPU; float32 on the CPU, where fp16 matmuls are slow) on ``text``."""
    import transformers

    from ..hf import load_quantized
    from ..convert.device import parse_device
    from .source import load_model, load_tokenizer, resolve_source

    dev = parse_device(device)
    body = read_texts(text)
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens = {max_tokens}, expected at least 2")
    if is_marlin_checkpoint(model):
        net = load_quantized(model, device=dev)
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        kind = "marlin"
    else:
        source = resolve_source(model, gguf_file)
        net = load_model(source, dtype=torch.float16 if dev.type == "cuda" else torch.float32).to(dev)
        tokenizer = load_tokenizer(source)
        kind = "full precision (fp16)" if dev.type == "cuda" else "full precision (fp32 on the CPU)"
    ids = tokenizer(body, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    result = perplexity(net, ids, context=context, stride=stride, device=dev, progress=progress)
    result.update(kind=kind, model=str(model), text=str(text))
    return result
