"""A minimal continuous-batching server for bench_e2e_serving: the compiled, CUDA-graphed decode
step of bench_e2e with requests joining and leaving between steps.

What a transformers user gets for serving is its own engine (``generate_batch`` /
``continuous_batching_context_manager``, measured by bench_e2e_serving --engine transformers).
This loop exists to measure what the weight GEMMs change when the rest of the step is as lean as
in a serving engine that compiles and graphs its decode step. It is a benchmark tool, not a
server, and is kept minimal:

  * slots: up to ``slots`` requests at once, each owning one row of a per-layer KV cache of shape
    [slots, kv_heads, max_len, head_dim] (SlotCache). A new request takes the lowest free row;
    a finished one frees its row (no copy).
  * prefill: one request at a time, straight into its row (TTFT includes waiting for the steps
    and prefills ahead of it). New arrivals are prefilled before the next decode step, as in
    vLLM's default scheduling without chunked prefill. The prompt is padded at its end to the
    next prefill length (powers of two from 16, and the row length), and each length is one CUDA
    graph of the eager forward (``prefill_lens``, captured by ``capture_all``), as serving
    engines graph their prefills too: an eager prefill of a 7B model spends ~35 ms launching
    kernels, against a few ms of GPU work, and stalls every running request that long. The
    padding is invisible: it comes after the prompt under the causal mask, so no prompt token
    sees it, and its keys and values land in cache positions that each decode step overwrites
    before its mask lets it see them.
  * decode: one step for every row below B, the smallest power of two above the highest
    occupied row, attending to the first Lb cache positions (the longest row rounded up to
    ``kv_bucket``). Rows that are free compute and are ignored; their position does not move.
    Each (B, Lb) pair is one CUDA graph, captured before the measured run (``capture_all``). The
    step writes its tokens and advances positions on the device, so the host only waits for the
    step to end (one synchronisation per step, when it stamps the tokens, as a streaming server
    would) and never copies tokens back during the run.
  * the model's forward is transformers' own (Llama attention through SDPA with an explicit mask
    of the valid positions of each row); the decoder layers can be compiled (e2e_model.
    compile_layers), which both kernels get alike.

Every request generates exactly its output length (no EOS), greedy decoding.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
from transformers import Cache

from .e2e_model import cache_kwarg, eager

__all__ = ["SlotCache", "SlotServer"]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class SlotCache(Cache):
    """KV cache with one row per request slot, for transformers' attention modules: they call
    ``update(key_states, value_states, layer_idx, ...)`` and attend to what it returns.

    Decode (one new token per row, rows 0..B-1): writes each row's key/value at that row's
    position (``bind``) and returns the first Lb positions of rows 0..B-1 (Lb = len of the bound
    range tensor); the caller's mask hides the positions past each row's length. Prefill (one
    rows from ``prefill_row`` on, one per prompt of the batch): writes the prompts' keys/values at
    positions 0..P-1 of those rows and returns them as they are (the prompt attends to itself under the caller's causal mask)."""

    def __init__(self, layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(layers=[])
        # one tensor for all layers, layer l's rows at l * slots ..: a compiled decoder layer
        # offsets its rows by its layer number as a traced integer, so every layer runs the same
        # compiled code (a per-layer list is indexed by a constant: one compile per layer). Writes
        # index this tensor itself, not a view of it: inductor updates a mutated input in place,
        # while a write through a view of one became a copy of the whole cache per call.
        self.slots = slots
        shape = (layers * slots, kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.rows = torch.arange(slots, device=device)
        self.pos: Optional[torch.Tensor] = None
        self.kv_range: Optional[torch.Tensor] = None
        self.prefill_row = None  # first row of a prefill: an int, or a one-element long tensor

    def __len__(self) -> int:
        return self.keys.shape[0] // self.slots

    def bind(self, pos: torch.Tensor, kv_range: torch.Tensor) -> None:
        self.pos, self.kv_range, self.prefill_row = pos, kv_range, None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        base = layer_idx * self.slots
        b = key_states.shape[0]
        if self.prefill_row is not None:  # rows prefill_row .. + batch of the prompt(s)
            rows = self.rows[:b] + (base + self.prefill_row)  # an int, or a device tensor in a graph
            n = key_states.shape[2]
            self.keys[rows, :, :n] = key_states
            self.values[rows, :, :n] = value_states
            return key_states, value_states
        rows = self.rows[:b] + base
        self.keys[rows, :, self.pos] = key_states[:, :, 0]
        self.values[rows, :, self.pos] = value_states[:, :, 0]
        lb = self.kv_range.shape[0]
        return self.keys[base:base + b, :, :lb], self.values[base:base + b, :, :lb]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # asked only without position_ids; never here
        return 0


def decode_step(model, ids, pos, kv_range, active, cache: SlotCache, out):
    """One step for rows 0..B-1 (B = ids.shape[0]): next tokens into ``out`` and ``ids``, positions
    of the active rows advanced; returns the logits [B, 1, vocab]. Everything stays on the device
    (graph-capturable)."""
    cache.bind(pos, kv_range)
    dtype = cache.keys.dtype
    visible = kv_range[None, :] <= pos[:, None]  # [B, Lb]: a row sees its positions 0..pos
    mask = torch.zeros(visible.shape, dtype=dtype, device=ids.device).masked_fill(~visible, torch.finfo(dtype).min)
    logits = model(input_ids=ids, position_ids=pos[:, None], attention_mask=mask[:, None, None, :], use_cache=True,
                   **{cache_kwarg(model): cache}).logits
    nxt = logits[:, -1].argmax(-1)
    out.copy_(nxt)
    ids[:, 0].copy_(nxt)
    pos.add_(active)
    return logits


class SlotServer:
    """Serves requests [{prompt: [ids], output_len}] arriving at given offsets (seconds) on
    ``model`` (see the module doc). ``step_fn``: decode_step, or a compiled version of it (its
    layers compiled beforehand: same callable). Returns per request its arrival and token times."""

    def __init__(self, model, slots: int, max_len: int, kv_bucket: int = 128, use_graphs: Optional[bool] = None):
        cfg = model.config
        self.model, self.dev = model, next(model.parameters()).device
        self.slots, self.kv_bucket = slots, kv_bucket
        self.max_len = -(-max_len // kv_bucket) * kv_bucket
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        self.cache = SlotCache(cfg.num_hidden_layers, slots, self.max_len, cfg.num_key_value_heads, head_dim, dtype,
                               self.dev)
        self.ids = torch.zeros(slots, 1, dtype=torch.long, device=self.dev)
        self.pos = torch.zeros(slots, dtype=torch.long, device=self.dev)
        self.active = torch.zeros(slots, dtype=torch.long, device=self.dev)
        self.out = torch.zeros(slots, dtype=torch.long, device=self.dev)
        self.kv_range = torch.arange(self.max_len, device=self.dev)
        # prefill inputs, static for its graphs: the padded prompt, its row and last position
        self.prefill_lens = sorted({min(1 << i, self.max_len) for i in range(4, self.max_len.bit_length() + 1)})
        self.prompt_ids = torch.zeros(1, self.max_len, dtype=torch.long, device=self.dev)
        self.prompt_row = torch.zeros(1, dtype=torch.long, device=self.dev)
        self.prompt_last = torch.zeros(1, dtype=torch.long, device=self.dev)
        self.causal = {p: torch.full((p, p), torch.finfo(dtype).min, dtype=dtype, device=self.dev).triu(1)[None, None]
                       for p in self.prefill_lens}
        self.use_graphs = (self.dev.type == "cuda") if use_graphs is None else use_graphs
        self.graphs: dict = {}
        self.prefill_graphs: dict = {}
        self.prefill_graph_error: Optional[str] = None  # why prefills run eager on CUDA, if they do
        self.step_fn: Callable = decode_step
        self.steps: list[tuple[int, int, int]] = []  # last serve(): (occupied rows, B, Lb) per decode step

    # -- one decode step for a (B, Lb) bucket --------------------------------------------------
    def _args(self, b: int, lb: int):
        return (self.model, self.ids[:b], self.pos[:b], self.kv_range[:lb], self.active[:b], self.cache, self.out[:b])

    @torch.no_grad()
    def _capture(self, b: int, lb: int) -> "torch.cuda.CUDAGraph":
        return self._capture_fn(lambda: self.step_fn(*self._args(b, lb)))

    @torch.no_grad()
    def _capture_fn(self, fn: Callable[[], object]) -> "torch.cuda.CUDAGraph":
        # a step or prefill changes ids/pos/active/out, device state the server relies on: saved
        # here and put back after the warm-up and capture runs (their cache writes land where the
        # next real step or prefill of that row writes anyway)
        state = (self.ids, self.pos, self.active, self.out)
        saved = tuple(t.clone() for t in state)
        s = torch.cuda.Stream(self.dev)
        s.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(s):
            for _ in range(2):  # compile (if compiled), autotune, workspaces: outside the graph
                fn()
        torch.cuda.current_stream(self.dev).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for buf, old in zip(state, saved):
            buf.copy_(old)
        return graph

    def buckets(self) -> list[tuple[int, int]]:
        bs = [1 << i for i in range(self.slots.bit_length()) if 1 << i < self.slots] + [self.slots]
        return [(b, lb) for b in bs for lb in range(self.kv_bucket, self.max_len + 1, self.kv_bucket)]

    def capture_all(self, progress=None) -> float:
        """Capture the graph of every (B, Lb) bucket now (not while a measured run waits); seconds."""
        t0 = time.perf_counter()
        if self.use_graphs:
            state = (self.ids, self.pos, self.active, self.out)
            saved = tuple(t.clone() for t in state)
            for b, lb in self.buckets():
                if (b, lb) not in self.graphs:
                    self.graphs[(b, lb)] = self._capture(b, lb)
                    self.graphs[(b, lb)].replay()  # a graph's first launch costs more than the next ones
                if progress is not None:
                    progress.update(1)
            for p in self.prefill_lens:
                if p not in self.prefill_graphs and self.prefill_graph_error is None:
                    try:
                        self.prefill_graphs[p] = self._capture_fn(lambda p=p: self._prefill_step(p))
                        self.prefill_graphs[p].replay()
                    except RuntimeError as e:  # e.g. a transformers version whose forward syncs
                        self.prefill_graph_error = f"prefill of {p} tokens not capturable, prefills run eager: {e}"
                        self.prefill_graphs.clear()
                        print(f"warning: {self.prefill_graph_error}", flush=True)
                if progress is not None:
                    progress.update(1)
            for buf, old in zip(state, saved):
                buf.copy_(old)
            torch.cuda.synchronize(self.dev)
        return time.perf_counter() - t0

    def graph_count(self) -> int:
        """How many graphs capture_all captures (decode buckets and prefill lengths)."""
        return len(self.buckets()) + len(self.prefill_lens) if self.use_graphs else 0

    def _step(self, b: int, lb: int) -> None:
        if not self.use_graphs:
            with torch.no_grad():
                self.step_fn(*self._args(b, lb))
            return
        g = self.graphs.get((b, lb))
        if g is None:
            g = self.graphs[(b, lb)] = self._capture(b, lb)
        g.replay()

    # -- prefill ------------------------------------------------------------------------------
    def _prefill_step(self, p: int) -> None:
        """The prompt in prompt_ids[:, :p] (padded; its last token at prompt_last) into row
        prompt_row: cache written, first token into ids, the row's position and activity set.
        Device state only (graph-capturable); eager even where the layers are compiled (a prompt
        length is not a shape to compile for)."""
        self.cache.prefill_row = self.prompt_row
        try:
            with eager():
                logits = self.model(input_ids=self.prompt_ids[:, :p], position_ids=self.kv_range[None, :p],
                                    attention_mask=self.causal[p], use_cache=True, logits_to_keep=self.prompt_last,
                                    **{cache_kwarg(self.model): self.cache}).logits
        finally:
            self.cache.prefill_row = None
        self.ids.index_copy_(0, self.prompt_row, logits[:, -1].argmax(-1)[:, None])
        self.pos.index_copy_(0, self.prompt_row, self.prompt_last + 1)
        self.active.index_fill_(0, self.prompt_row, 1)

    @torch.no_grad()
    def _prefill(self, row: int, prompt: list[int]) -> None:
        n = len(prompt)
        p = next(p for p in self.prefill_lens if p >= n)  # n <= max_len, the last length (serve() checked)
        self.prompt_ids[0, :n].copy_(torch.tensor(prompt, dtype=torch.long))
        self.prompt_row.fill_(row)
        self.prompt_last.fill_(n - 1)
        g = self.prefill_graphs.get(p) if self.use_graphs else None
        if g is not None:
            g.replay()
        else:
            self._prefill_step(p)

    # -- the serving loop ---------------------------------------------------------------------
    def serve(self, requests: list[dict], offsets: list[float], timeout_s: float = 600.0,
              collect_tokens: bool = False) -> list[dict]:
        """Run the workload; per request {arrival, ttft_s, tpot_s, end, tokens} (seconds from the
        start) or {error}. A request longer than a row fails (ValueError before the run).
        ``collect_tokens``: also the generated ids ("ids"; a device-to-host copy per step, for tests)."""
        for i, r in enumerate(requests):
            if len(r["prompt"]) + r["output_len"] > self.max_len:
                raise ValueError(f"request {i}: prompt {len(r['prompt'])} + output {r['output_len']} tokens exceed "
                                 f"the server's max_len {self.max_len}")
        order = sorted(range(len(requests)), key=lambda i: offsets[i])
        nxt = 0
        rows: list[Optional[dict]] = [None] * self.slots
        length = [0] * self.slots  # host copy of each row's cache length (stale for free rows)
        out: list[dict] = [{} for _ in requests]
        done = 0
        self.steps = []
        sync = torch.cuda.synchronize if self.dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        while done < len(requests):
            now = time.perf_counter() - t0
            if now > timeout_s:
                break
            # admit every request that has arrived, while rows are free (prefill first)
            while nxt < len(order) and offsets[order[nxt]] <= now and None in rows:
                i = order[nxt]
                nxt += 1
                row = rows.index(None)
                self._prefill(row, requests[i]["prompt"])
                sync()
                t = time.perf_counter() - t0
                rows[row] = {"i": i, "left": requests[i]["output_len"] - 1, "stamps": [t]}
                if collect_tokens:
                    rows[row]["ids"] = [int(self.ids[row, 0])]
                length[row] = len(requests[i]["prompt"])
                out[i] = {"arrival": offsets[i]}
                if rows[row]["left"] == 0:
                    done += self._finish(row, rows, out)
                now = time.perf_counter() - t0
            busy = [r for r in range(self.slots) if rows[r] is not None]
            if not busy:
                if nxt < len(order):
                    time.sleep(max(0.0, min(offsets[order[nxt]] - now, 0.01)))
                continue
            b = min(_next_pow2(busy[-1] + 1), self.slots)
            longest = max(length[:b]) + 1
            lb = min(-(-longest // self.kv_bucket) * self.kv_bucket, self.max_len)
            self._step(b, lb)
            self.steps.append((len(busy), b, lb))
            sync()
            t = time.perf_counter() - t0
            toks = self.out[:b].tolist() if collect_tokens else None
            for r in busy:
                if toks is not None:
                    rows[r]["ids"].append(toks[r])
                length[r] += 1
                rows[r]["stamps"].append(t)
                rows[r]["left"] -= 1
                if rows[r]["left"] == 0:
                    done += self._finish(r, rows, out)
                    length[r] = 0  # a free row does not widen Lb (its stale position stays readable)
        for i, r in enumerate(requests):
            if "stamps" not in out[i]:
                out[i] = {"arrival": offsets[i], "error": "not finished within the time limit"}
        return [self._record(o) for o in out]

    def _finish(self, row: int, rows: list, out: list) -> int:
        state = rows[row]
        out[state["i"]]["stamps"] = state["stamps"]
        if "ids" in state:
            out[state["i"]]["ids"] = state["ids"]
        rows[row] = None
        self.active[row] = 0
        return 1  # (the caller zeroes the row's host length)

    @staticmethod
    def _record(o: dict) -> dict:
        if "error" in o:
            return o
        s = o["stamps"]
        rec = {"arrival": o["arrival"], "ttft_s": s[0] - o["arrival"], "end": s[-1], "tokens": len(s)}
        rec["tpot_s"] = (s[-1] - s[0]) / (len(s) - 1) if len(s) > 1 else None
        if "ids" in o:
            rec["ids"] = o["ids"]
        return rec
