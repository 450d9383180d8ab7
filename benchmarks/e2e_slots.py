"""bench_e2e's decode step on the slots engine's KV cache (``--cache slots``).

The same protocol as e2e_model.DecodeStep (a batch of ``prompt_len``-token prompts, then decode
steps at positions prompt_len .. prompt_len + gen_len - 1, each attending to a cache of
prompt_len + gen_len entries under a mask), with the cache of benchmarks/serving_engine.py
instead of transformers' StaticCache: one tensor for all layers, indexed by the layer number as a
traced integer. With the decoder layers compiled (e2e_model.compile_layers), every layer and every
batch size past the first two share compiled code: 4 compiles per kernel whatever the depth, where
compiling the whole step took 43-54 s per kernel and batch shape at 32 layers (H100). What differs
from the StaticCache step: the cache write (one index_put per layer instead of index_copy_), the
mask (built from the positions in the step) and the eager code between the layers (embedding,
rotary tables, final norm, lm_head stay uncompiled, in the same CUDA graph).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .e2e_model import DecodeStep, cache_kwarg, eager
from .serving_engine import SlotCache, decode_step

__all__ = ["SlotStep"]


class SlotStep(DecodeStep):
    """DecodeStep's interface (prefill, setup, check, time_steps, reset) on a SlotCache."""

    def __init__(self, model, batch: int, prompt_len: int, gen_len: int, dev: torch.device, seed: int = 0):
        cfg = model.config
        self.model, self.batch, self.prompt_len, self.gen_len, self.dev = model, batch, prompt_len, gen_len, dev
        n = prompt_len + gen_len
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        self.cache = SlotCache(cfg.num_hidden_layers, batch, n, cfg.num_key_value_heads, head_dim, dtype, dev)
        gen = torch.Generator(device=dev).manual_seed(seed)
        vocab = cfg.vocab_size
        self.prompt = torch.randint(0, vocab, (batch, prompt_len), device=dev, generator=gen)
        self.ids = torch.randint(0, vocab, (batch, 1), device=dev, generator=gen)
        self.pos = torch.full((batch,), prompt_len, dtype=torch.long, device=dev)
        self.active = torch.ones(batch, dtype=torch.long, device=dev)
        self.next_ids = torch.zeros(batch, dtype=torch.long, device=dev)
        self.kv_range = torch.arange(n, device=dev)
        self.graph = None
        self.out = None

    def reset(self, length: int) -> None:
        self.pos.fill_(length)

    @torch.no_grad()
    def prefill(self) -> float:
        """All prompts at once into rows 0..batch-1 (eager); returns seconds."""
        import time

        b, n = self.prompt.shape
        dtype = self.cache.keys.dtype
        causal = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=self.dev).triu(1)
        kw = {cache_kwarg(self.model): self.cache}
        self.cache.prefill_row = 0
        try:
            if self.dev.type == "cuda":
                torch.cuda.synchronize(self.dev)
            t0 = time.perf_counter()
            with eager():
                self.model(input_ids=self.prompt, position_ids=torch.arange(n, device=self.dev)[None].expand(b, n),
                           attention_mask=causal[None, None].expand(b, 1, n, n), use_cache=True, logits_to_keep=1, **kw)
            if self.dev.type == "cuda":
                torch.cuda.synchronize(self.dev)
            return time.perf_counter() - t0
        finally:
            self.cache.prefill_row = None

    def step_callable(self, compiled: Optional[Callable]) -> Callable[[], torch.Tensor]:
        # compiled is unused: the layers are compiled in place (compile_layers) or not at all
        return lambda: decode_step(self.model, self.ids, self.pos, self.kv_range, self.active, self.cache,
                                   self.next_ids)

    def eager_call(self) -> Callable[[], torch.Tensor]:
        step = self.step_callable(None)

        def run():
            with eager():
                return step()

        return run

    @torch.no_grad()
    def check(self, step: Callable[[], torch.Tensor]) -> float:
        ids = self.ids.clone()  # a step feeds its tokens back into ids: both runs start from the same
        self.reset(self.prompt_len)
        ref = self.eager_call()().float().clone()
        self.ids.copy_(ids)
        self.reset(self.prompt_len)
        out = step().float()
        self.ids.copy_(ids)
        if not torch.isfinite(out).all():
            return float("inf")
        return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
