"""The model side of bench_e2e: a Llama of a real shape with random weights, its Marlin versions,
and a decode step that can be compiled and captured in a CUDA graph.

No download: the model is built from a config (Llama-2 shapes, benchmarks/shapes.py), on the GPU,
in fp16, with random N(0, 0.02) weights (the timing does not depend on the values; random values
keep every activation finite). The Marlin versions quantize these weights with replace_linear
(lm_head stays FP16, as a converted GPTQ checkpoint keeps it) and optionally fuse q/k/v, gate/up.

A decode step is one forward of ``batch`` new tokens against a transformers StaticCache holding
``prompt_len`` tokens. Each call writes its keys and values at the cache's own position counter
(a device tensor that the call advances), so a captured graph replays consecutive decode steps;
``reset`` puts the counter back. Modes:

  eager     the model's forward as transformers runs it (host overhead and launch gaps included);
  graph     the forward traced by torch.compile(backend="eager", fullgraph=True) (the same eager
            kernels, and transformers' tracing-time branches instead of the host synchronisations
            its mask code does in eager mode) and captured in one CUDA graph;
  compiled  torch.compile(fullgraph=True) with inductor (fused elementwise kernels) and captured
            in one CUDA graph: what marlin.compile_for_decode sets up through generate();
  generate  model.generate() itself after marlin.compile_for_decode (time_generate): the
            compiled step plus generate()'s own per-token work, as a user gets it.
"""

from __future__ import annotations

import gc
from typing import Callable, Optional

import torch

from . import shapes as S
from .kernel_profile import profile_calls

__all__ = ["MODEL_SPECS", "build_model", "to_marlin", "fuse_fp16", "LinearKN", "to_kn", "weight_bytes", "eager", "cache_kwarg", "decode_forward", "compile_decode", "compile_layers", "DecodeStep",
           "time_generate", "profile_step"]

TINY = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "num_hidden_layers": 2}


# Depth and vocabulary of the models benchmarks/shapes.py describes by their layer shapes
# (config.json of each: num_hidden_layers, vocab_size).
_DEPTH_VOCAB = {"Llama-2-7B": (32, 32000), "Llama-2-13B": (40, 32000), "Llama-3-8B": (32, 128256)}


def _spec(cfg: S.ModelConfig) -> dict:
    layers, vocab = _DEPTH_VOCAB[cfg.name]
    return {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "vocab_size": vocab, "num_hidden_layers": layers}


MODEL_SPECS = {cfg.name: _spec(cfg) for cfg in S.MODELS if cfg.name in _DEPTH_VOCAB}
MODEL_SPECS["tiny"] = TINY


# build_model's attentions (the benches' --attention choices)
ATTENTIONS = ("sdpa", "marlin_decode")


def build_model(name: str, layers: Optional[int], dev: torch.device, seed: int = 0, attention: str = "sdpa"):
    """A transformers LlamaForCausalLM of the named shape (``layers`` overrides the depth), fp16,
    random weights, eval mode, on ``dev``; ``attention``: its attn_implementation ("sdpa", or
    "marlin_decode": marlin's decode attention for one-token steps, SDPA for prompts)."""
    import transformers

    if attention == "marlin_decode":
        from marlin.integrations import hf_attention

        hf_attention.register()
    spec = dict(MODEL_SPECS[name])
    if layers:
        spec["num_hidden_layers"] = layers
    config = transformers.LlamaConfig(**spec, max_position_embeddings=4096, attn_implementation=attention)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(dev):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)  # norm weights
    return model.eval()


def free_memory() -> None:
    """Drop unreferenced tensors and hand the CUDA allocator's cache back (between conversions and
    kernels, so that the next model's copies fit)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def to_marlin(model, fuse: bool, group_size: int = 128, sparsity=None):
    """Quantize every Linear but lm_head in place (marlin.replace_linear; ``sparsity="2:4"``:
    magnitude-pruned 2:4 layers), then fuse if asked."""
    import marlin

    report = marlin.replace_linear(model, group_size=group_size, exclude=("lm_head",), strict=True, sparsity=sparsity)
    fused = marlin.fuse_projections(model, strict=True) if fuse else None
    return report, fused


@torch.no_grad()
def fuse_fp16(model) -> Callable[[], None]:
    """FP16 with the same fusion as Marlin: each q/k/v and gate/up group of nn.Linear becomes one
    nn.Linear whose weight is the parts' weights stacked (exact), installed with
    marlin.fuse.install_fused, as serving engines run FP16 (vLLM's QKV and merged gate/up layers).
    Returns a function that puts the original layers back (the stacked copies are freed)."""
    from torch import nn

    from marlin.fuse import DEFAULT_GROUPS, fused_group_parts, install_fused

    undo = []
    for parent in list(model.modules()):
        for fused_name, names in DEFAULT_GROUPS.items():
            parts = fused_group_parts(parent, fused_name)
            if parts is None or not all(type(p) is nn.Linear for p in parts):
                continue
            w = parts[0].weight
            layer = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts),
                              bias=parts[0].bias is not None, device=w.device, dtype=w.dtype)
            layer.weight.copy_(torch.cat([p.weight for p in parts]))
            if layer.bias is not None:
                layer.bias.copy_(torch.cat([p.bias for p in parts]))
            install_fused(parent, fused_name, layer)
            undo.append((parent, fused_name, dict(zip(names, parts))))

    def restore() -> None:
        for parent, fused_name, originals in undo:
            del parent._modules[fused_name]
            parent._modules.update(originals)

    return restore


class LinearKN(torch.nn.Module):
    """An nn.Linear with its weight stored transposed, [in_features, out_features] contiguous:
    y = x @ W (+ bias). cuBLAS streams this layout faster than nn.Linear's [out, in] on some shapes
    at small M and slower on others (bench_gemm's "fp16_kn": at M = 1 up to 13% faster on an H100,
    up to 9% on an H200), so bench_e2e's FP16 baselines can run both layouts and count the faster."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_kn = torch.nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight_kn)
        return y if self.bias is None else y + self.bias

    def to_linear(self) -> torch.nn.Linear:
        """The nn.Linear this came from (the weight transposed back: exact)."""
        w = self.weight_kn
        layer = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=w.device,
                                dtype=w.dtype)
        with torch.no_grad():
            layer.weight.copy_(w.t())
            if self.bias is not None:
                layer.bias.copy_(self.bias)
        return layer


@torch.no_grad()
def to_kn(model) -> Callable[[], None]:
    """Every nn.Linear of ``model`` (fused ones included; lm_head too unless it shares the
    embedding's weight) as a LinearKN, in place, one layer at a time (each original is freed as
    its copy is made). Returns a function that puts nn.Linear layers back."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    swapped = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and not (tied and name == "lm_head")]
    for parent, name in swapped:  # holding no other reference, so each original goes with its swap
        parent._modules[name] = LinearKN(parent._modules[name])

    def restore() -> None:
        for parent, name in swapped:
            parent._modules[name] = parent._modules[name].to_linear()

    return restore


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every persistent tensor except the embedding table (of which
    a step reads only one row per token)."""
    return sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if "embed_tokens" not in n)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def eager():
    """A context in which torch.compile'd code runs eagerly (torch.compiler.set_stance): prefills
    and reference forwards where the decoder layers are compiled (compile_layers)."""
    import contextlib

    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


def cache_kwarg(model) -> str:
    """The name under which this transformers version's forward takes the KV cache: ``cache``
    (5.2x) or ``past_key_values`` (up to 5.1x). An unknown name is not an error there: it goes into
    ``**kwargs`` unread while the model builds a fresh DynamicCache, so every decode step would
    attend to its own token only and leave the static cache unread (and untimed)."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`")


def decode_forward(model, ids, pos, cache):
    """One decode step: logits [batch, 1, vocab] of ``ids`` at positions ``pos``, cache updated."""
    return model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache}).logits


def set_inductor_pdl(on: Optional[bool]) -> bool:
    """--inductor-pdl / --no-inductor-pdl: programmatic dependent launch on or off for every
    inductor kernel this process compiles (FP16 and Marlin models alike), as compile_for_decode
    sets it. None (the default): on where this torch's inductor has the option. Returns what was
    set; exits with a message for an explicit --inductor-pdl that this torch lacks."""
    from marlin.decode import inductor_pdl_supported

    supported = inductor_pdl_supported()
    if on and not supported:
        raise SystemExit(f"--inductor-pdl: torch {torch.__version__} has no torch._inductor.config.triton.enable_pdl")
    if not supported:
        return False
    import torch._inductor.config as inductor_config

    inductor_config.triton.enable_pdl = on = on is not False
    return on


def compile_decode(mode: str, backend: str = "inductor", compile_mode: Optional[str] = None) -> Callable:
    """decode_forward traced with fullgraph=True: backend "eager" for mode "graph" (the eager
    kernels), ``backend`` for mode "compiled" (with torch.compile's ``compile_mode``, e.g.
    "max-autotune-no-cudagraphs"; None: its default). One compiled function serves every batch
    size of a model: dynamo compiles batch 1 as is, and on the next batch size recompiles once
    with the batch dimension symbolic (its automatic dynamic shapes), which the other sizes then
    reuse."""
    if mode == "graph":
        return torch.compile(decode_forward, backend="eager", fullgraph=True)
    return torch.compile(decode_forward, backend=backend, fullgraph=True, mode=compile_mode)


def compile_layers(model, backend: str = "inductor", compile_mode: Optional[str] = None) -> Callable[[], None]:
    """Compile each decoder layer on its own (torch.compile(fullgraph=True) per layer; embedding,
    rotary tables, mask, final norm and lm_head stay eager), for the "compiled" mode's layer scope.
    Returns a function that undoes it.

    Why: compiling the whole step traces and lowers every layer (compile + capture took 43-54 s
    per kernel and batch shape at 32 layers against 8-17 s at 8 layers). Layers share their code,
    and their number is made a traced integer here (allow_unspec_int_on_nn_module), so a cache
    that offsets a tensor by it (the slots engine's SlotCache) compiles once for all layers and
    shapes of a class. transformers' StaticCache indexes a Python list with it, which specializes:
    one compile per layer, no faster than the whole step (32 layers: no point within 165 s on the
    H100). Hence the raised recompile limit (and the reset of dynamo's caches, here and on undo). The step is still captured whole in one CUDA graph (DecodeStep.setup); what
    it loses against the whole-model compile is the fusion across layer boundaries (the residual
    add of one layer with the next layer's norm) and inductor's work on the eager parts."""
    import torch._dynamo
    import torch._dynamo.config as dcfg

    torch._dynamo.reset()  # another model's entries would count against this one's recompile limit
    name = "recompile_limit" if hasattr(dcfg, "recompile_limit") else "cache_size_limit"
    old_limit = getattr(dcfg, name)
    layers = list(model.model.layers)
    setattr(dcfg, name, max(old_limit, 4 * len(layers) + 8))  # a layer per shape, a few shapes
    # layer numbers as traced integers: a cache that indexes a tensor with it (the slots engine's)
    # compiles once for all layers; a list index still specializes (StaticCache: one per layer)
    old_unspec = dcfg.allow_unspec_int_on_nn_module
    dcfg.allow_unspec_int_on_nn_module = True
    for layer in layers:
        layer.compile(fullgraph=True, backend=backend, mode=compile_mode)

    def undo() -> None:
        for layer in layers:
            layer._compiled_call_impl = None
        setattr(dcfg, name, old_limit)
        dcfg.allow_unspec_int_on_nn_module = old_unspec
        torch._dynamo.reset()

    return undo


class DecodeStep:
    """One model, one batch size: a static cache filled by a prompt, and a decode step in a mode."""

    def __init__(self, model, batch: int, prompt_len: int, gen_len: int, dev: torch.device, seed: int = 0):
        import transformers

        self.model, self.batch, self.prompt_len, self.gen_len, self.dev = model, batch, prompt_len, gen_len, dev
        self.cache = transformers.StaticCache(config=model.config, max_cache_len=prompt_len + gen_len)
        gen = torch.Generator(device=dev).manual_seed(seed)
        vocab = model.config.vocab_size
        self.prompt = torch.randint(0, vocab, (batch, prompt_len), device=dev, generator=gen)
        self.ids = torch.randint(0, vocab, (batch, 1), device=dev, generator=gen)
        self.pos = torch.full((batch, 1), prompt_len, dtype=torch.long, device=dev)
        self.graph = None
        self.out = None

    def reset(self, length: int) -> None:
        """Put the cache's write position at ``length`` (the cached values stay)."""
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(length)

    @torch.no_grad()
    def prefill(self) -> float:
        """Run the prompt through the model (eager, as generate() runs it); returns seconds."""
        self.reset(0)
        _sync(self.dev)
        kw = {cache_kwarg(self.model): self.cache}
        with eager():  # eager as generate() runs it, also where the layers are compiled
            if self.dev.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                self.model(input_ids=self.prompt, use_cache=True, logits_to_keep=1, **kw)
                b.record()
                b.synchronize()
                return a.elapsed_time(b) * 1e-3
            import time

            t0 = time.perf_counter()
            self.model(input_ids=self.prompt, use_cache=True, logits_to_keep=1, **kw)
            return time.perf_counter() - t0

    def eager_call(self) -> Callable[[], torch.Tensor]:
        return lambda: decode_forward(self.model, self.ids, self.pos, self.cache)

    @torch.no_grad()
    def setup(self, mode: str, compiled: Optional[Callable] = None) -> Callable[[], torch.Tensor]:
        """The callable that runs one decode step in ``mode``: "eager", or a captured graph of
        ``compiled`` (decode_forward under torch.compile, see compile_decode) on CUDA."""
        self.prefill()  # fills the cache (and lazily allocates it) before any capture
        if mode == "eager":
            return self.eager_call()
        fn = self.step_callable(compiled)
        if self.dev.type != "cuda":
            self.reset(self.prompt_len)
            fn()  # CPU dry runs: traced (compiled once here, not in the timing), no graph
            return fn
        stream = torch.cuda.Stream(self.dev)
        stream.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(stream):
            for _ in range(3):  # compile, autotune, and let cuBLAS/op workspaces settle off the graph
                self.reset(self.prompt_len)
                fn()
        torch.cuda.current_stream(self.dev).wait_stream(stream)
        self.reset(self.prompt_len)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn()
        return self._replay

    def step_callable(self, compiled: Optional[Callable]) -> Callable[[], torch.Tensor]:
        """One step through ``compiled`` (decode_forward under torch.compile) on this step's state."""
        return lambda: compiled(self.model, self.ids, self.pos, self.cache)

    def _replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out

    @torch.no_grad()
    def check(self, step: Callable[[], torch.Tensor]) -> float:
        """Normwise relative error of one step's logits against the eager forward at the same
        cache state (a wrong capture or compile shows up here)."""
        self.reset(self.prompt_len)
        with eager():  # the reference is eager also where the layers are compiled
            ref = self.eager_call()().float().clone()
        self.reset(self.prompt_len)
        out = step().float()
        if not torch.isfinite(out).all():
            return float("inf")
        return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()

    @torch.no_grad()
    def time_steps(self, step: Callable[[], torch.Tensor], samples: int) -> list[float]:
        """Seconds per decode step: ``samples`` blocks of gen_len consecutive steps (the positions
        prompt_len .. prompt_len + gen_len - 1, as generation walks them), each block timed whole."""
        times = []
        for _ in range(samples):
            self.reset(self.prompt_len)
            _sync(self.dev)
            if self.dev.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(self.gen_len):
                    step()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e-3 / self.gen_len)
            else:
                import time

                t0 = time.perf_counter()
                for _ in range(self.gen_len):
                    step()
                times.append((time.perf_counter() - t0) / self.gen_len)
        return times


# -- the user's path: generate() after compile_for_decode ----------------------------------------
def _timed(fn, dev) -> float:
    _sync(dev)
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e-3
    import time

    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.no_grad()
def time_generate(model, batch: int, prompt_len: int, gen_len: int, dev, samples: int, backend: str,
                  seed: int = 0, pdl: Optional[bool] = None) -> tuple[float, float]:
    """(ttft, tpot) in seconds of ``model.generate`` as a user runs it after
    marlin.compile_for_decode (static cache, compiled decode steps in CUDA graphs; the model's
    projections are left as they are): ttft is a generate() of one new token (the prefill),
    tpot = (time of gen_len new tokens - ttft) / (gen_len - 1); medians of ``samples``.
    Includes generate()'s own per-step work (logits processing, stopping criteria). ``pdl``: as
    compile_for_decode's."""
    import marlin

    gen = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=dev, generator=gen)
    mask = torch.ones_like(ids)
    on_cpu = dev.type != "cuda"
    marlin.compile_for_decode(model, fuse=False, backend=backend, mode=None if on_cpu else "reduce-overhead",
                              compile_on_cpu=on_cpu, pdl=pdl)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)

    def run(n):
        return lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    for _ in range(2):  # compile and record the graphs (a second shape may recompile once)
        run(gen_len)()
    full = sorted(_timed(run(gen_len), dev) for _ in range(samples))[samples // 2]
    first = sorted(_timed(run(1), dev) for _ in range(samples))[samples // 2]
    return first, (full - first) / max(1, gen_len - 1)


# -- profile ----------------------------------------------------------------------------------
def profile_step(step_obj: DecodeStep, fn: Callable[[], torch.Tensor], steps: int = 8, rows: int = 20) -> dict:
    """Kernel time per decode step by category (kernel_profile.profile_calls) over ``steps`` calls
    of ``fn``, a decode step of ``step_obj``: the compiled function itself, not its captured graph,
    so that the profiler sees each kernel; each call starts from the prompt's cache length."""
    return profile_calls(fn, lambda: step_obj.reset(step_obj.prompt_len), step_obj.dev, steps, rows)
