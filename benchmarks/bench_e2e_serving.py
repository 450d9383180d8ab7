"""Serving: time per output token and time to first token against request rate, FP16 vs Marlin.

    python -m benchmarks.bench_e2e_serving                          # Llama-2-7B shape, rates 1 .. 16 req/s
    python -m benchmarks.bench_e2e_serving --layers 8 --rates 2,8 --num-requests 16
    python -m benchmarks.bench_e2e_serving --engine transformers    # transformers' continuous batching
    python -m benchmarks.bench_e2e_serving --dry-run                # smoke run on a tiny model

Workload (fixed seed, so FP16 and Marlin serve the same requests): --num-requests requests with
ShareGPT-like lengths, prompt and output lengths drawn from log-normal distributions (medians
--prompt-median / --output-median tokens, sigma 0.8: most requests short, a long tail), clipped to
[4, --max-len]; random token ids; every request generates exactly its output length (no EOS).
Arrivals are a Poisson process at each --rates value (requests per second; "inf": all at once).
Per request: TTFT = first token - arrival, TPOT = (last token - first token) / (tokens - 1). Per
(kernel, rate): median and mean TPOT and TTFT, p90 TTFT, and the output tokens per second.

Engines (--engine):

  slots         (default) benchmarks/serving_engine.py: a minimal continuous-batching loop on the
                decode step of bench_e2e (decoder layers compiled with --compile, the step in CUDA
                graphs, one per power-of-two batch and --kv-bucket cache length, all captured and
                launched once before the measured rates; prefill one request at a time before the
                next step, the prompt padded to a power of two and replayed from a CUDA graph of
                the eager forward). An unmeasured round of the whole workload at once comes first.
                Measures what the GEMMs change when the rest of a serving step is lean.
  transformers  transformers' own continuous batching (model.continuous_batching_context_manager,
                paged KV cache, its own scheduler), as a transformers user serves: requests are
                submitted at their arrival times while the manager's thread batches them. Before
                the measured rates, an unmeasured round of --warmup-requests requests.

Writes benchmarks/results/<gpu>-serving[-<engine>][-<L>L].json (engine omitted for slots). The
model is benchmarks/e2e_model.py's (random weights; Marlin: replace_linear + fuse; marlin_24: the
same with 2:4-sparse layers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .bench_gemm import dump_results
from .bench_math import RESULTS_DIR
from .e2e_model import ATTENTIONS, MODEL_SPECS, build_model, free_memory, fuse_fp16, set_inductor_pdl, to_marlin
from .provenance import collect_meta

# run in this order (fp16_fused is undone after its rates; marlin converts the model; marlin_24
# converts a fresh copy of it, pruned 2:4 by magnitude): fp16 is transformers' layers, fp16_fused
# the same weights with q/k/v and gate/up stacked as serving engines run FP16 (bench_e2e's
# stricter baseline)
KERNELS = ("fp16", "fp16_fused", "marlin", "marlin_24")


def workload(n: int, prompt_median: int, output_median: int, max_len: int, vocab: int, seed: int) -> list[dict]:
    """``n`` requests {prompt: [ids], output_len}: log-normal lengths (sigma 0.8), fixed seed."""
    rng = np.random.default_rng(seed)
    p_len = np.clip(rng.lognormal(np.log(prompt_median), 0.8, n), 4, max_len).astype(int)
    o_len = np.clip(rng.lognormal(np.log(output_median), 0.8, n), 4, max_len).astype(int)
    return [{"prompt": rng.integers(0, vocab, int(p)).tolist(), "output_len": int(o)} for p, o in zip(p_len, o_len)]


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets in seconds of a Poisson process at ``rate`` requests/s (all 0 for inf)."""
    if not np.isfinite(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist()


def serve_slots(server, requests: list[dict], offsets: list[float], timeout_s: float) -> list[dict]:
    """The slots engine's run, as records in serve()'s form."""
    out = []
    for i, (req, rec) in enumerate(zip(requests, server.serve(requests, offsets, timeout_s))):
        r = {"id": f"r{i}", "prompt_len": len(req["prompt"]), "output_len": req["output_len"], **rec}
        if "error" not in r and r.get("tpot_s") is None:
            r["error"] = "one token only"
        out.append(r)
    return out


def make_server(model, args, reqs: list[dict], bar_desc: str):
    """A SlotServer for this workload (rows as long as its longest request), its decoder layers
    compiled as --compile says, every graph captured (with a progress bar); returns (server,
    seconds spent, undo) where undo() puts the layers back."""
    from tqdm.auto import tqdm

    from .e2e_model import compile_layers
    from .serving_engine import SlotServer

    t0 = time.perf_counter()
    max_len = max(len(r["prompt"]) + r["output_len"] for r in reqs)
    server = SlotServer(model, slots=args.slots, max_len=max_len, kv_bucket=args.kv_bucket)
    undo = compile_layers(model, args.backend) if args.compile == "layer" else (lambda: None)
    n = server.graph_count()
    with tqdm(total=n, desc=bar_desc, unit="graph", disable=n == 0) as bar:
        server.capture_all(progress=bar)
    return server, time.perf_counter() - t0, undo


def serve(model, requests: list[dict], offsets: list[float], warmup: bool, timeout_s: float,
          small_cache: bool = False, cuda_graph: Optional[bool] = None, cb_options: Optional[dict] = None) -> list[dict]:
    """Submit each request at its offset, wait for all; per request its arrival and token times.
    ``small_cache``: a few KV blocks instead of most of the free GPU memory (smoke runs, tests).
    ``cuda_graph``: the manager's use_cuda_graph (None: its own choice). ``cb_options``: more
    ContinuousBatchingConfig fields (compile level, padding intervals)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gc_ = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                           max_new_tokens=max(r["output_len"] for r in requests))
    done: dict = {}
    arrival: dict = {}
    # persistent: the manager (paged cache, captured graphs) is reused by the next call; main()
    # destroys it when the kernel changes.
    cb_kw = dict(num_blocks=8, max_batch_tokens=256) if small_cache else {}
    if cuda_graph is not None:
        cb_kw["use_cuda_graph"] = cuda_graph
    cb_kw.update(cb_options or {})
    cb_config = ContinuousBatchingConfig(**cb_kw) if cb_kw else None
    with model.continuous_batching_context_manager(generation_config=gc_, warmup=warmup, block=True,
                                                   persistent_manager=True,
                                                   continuous_batching_config=cb_config) as manager:
        t0 = time.perf_counter()
        for i, (req, off) in enumerate(zip(requests, offsets)):
            while (wait := t0 + off - time.perf_counter()) > 0:
                r = manager.get_result(timeout=min(wait, 0.05))  # collect while waiting
                if r is not None:
                    done[r.request_id] = r
            rid = f"r{i}"
            arrival[rid] = time.perf_counter()
            manager.add_request(req["prompt"], request_id=rid, max_new_tokens=req["output_len"], record_timestamps=True)
        deadline = time.perf_counter() + timeout_s
        while len(done) < len(requests) and time.perf_counter() < deadline:
            r = manager.get_result(timeout=0.5)
            if r is not None:
                done[r.request_id] = r
    out = []
    for i, req in enumerate(requests):
        rid = f"r{i}"
        r = done.get(rid)
        stamps = list(getattr(r, "timestamps", None) or []) if r is not None else []
        rec = {"id": rid, "prompt_len": len(req["prompt"]), "output_len": req["output_len"], "arrival": arrival[rid] - t0}
        if r is None or getattr(r, "error", None) or len(stamps) < 2:
            rec["error"] = "no result" if r is None else str(getattr(r, "error", None) or f"{len(stamps)} timestamps")
        else:
            rec.update(ttft_s=stamps[0] - arrival[rid], tpot_s=(stamps[-1] - stamps[0]) / (len(stamps) - 1),
                       end=stamps[-1] - t0, tokens=len(stamps))
        out.append(rec)
    return out


def summarize(recs: list[dict]) -> dict:
    ok = [r for r in recs if "error" not in r]
    if not ok:
        return {"ok": 0, "failed": len(recs)}
    tpot = [r["tpot_s"] * 1e3 for r in ok]
    ttft = sorted(r["ttft_s"] * 1e3 for r in ok)
    span = max(r["end"] for r in ok) - min(r["arrival"] for r in ok)
    return {"ok": len(ok), "failed": len(recs) - len(ok), "tpot_ms_median": statistics.median(tpot),
            "tpot_ms_mean": statistics.fmean(tpot), "ttft_ms_median": statistics.median(ttft),
            "ttft_ms_mean": statistics.fmean(ttft), "ttft_ms_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "output_tokens_per_s": sum(r["tokens"] for r in ok) / span if span > 0 else None}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_e2e_serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("slots", "transformers"), default="slots")
    p.add_argument("--slots", type=int, default=64, help="slots engine: requests served at once (KV cache rows)")
    p.add_argument("--kv-bucket", type=int, default=128, help="slots engine: cache-length granularity of its graphs")
    p.add_argument("--compile", choices=("layer", "none"), default="layer",
                   help="slots engine: decoder layers compiled with inductor (layer) or eager kernels (none); the "
                        "same for both kernels")
    p.add_argument("--backend", default="inductor", help="slots engine: torch.compile backend for --compile layer")
    p.add_argument("--inductor-pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="inductor's Triton kernels with programmatic dependent launch (as bench_e2e --inductor-pdl; "
                        "default: on where this torch has the option)")
    p.add_argument("--attention", choices=ATTENTIONS, default=None,
                   help="the models' attn_implementation, for every kernel alike (as bench_e2e --attention); "
                        "default: marlin_decode on the slots engine, sdpa on the transformers engine (its continuous "
                        "batching takes only its own attentions)")
    p.add_argument("--model", default="Llama-2-7B", choices=sorted(MODEL_SPECS))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--kernels", default="fp16,marlin")
    p.add_argument("--rates", default="1,2,4,8,16", help="requests per second, comma-separated; 'inf' allowed")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-median", type=int, default=128)
    p.add_argument("--output-median", type=int, default=128)
    p.add_argument("--max-len", type=int, default=512, help="longest prompt, and longest output, in tokens")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the last results of a rate")
    p.add_argument("--out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graph", choices=("auto", "on", "off"), default="auto",
                   help="the continuous batching manager's CUDA graphs (auto: transformers decides)")
    p.add_argument("--tf-compile-level", type=int, default=0,
                   help="transformers engine: ContinuousBatchingConfig.default_compile_level (0: eager; 1: compiled, "
                        "dynamic shapes; 2-3: max-autotune without cudagraphs)")
    p.add_argument("--q-padding", type=int, default=0,
                   help="transformers engine: query-token padding of its CUDA graphs (0: its default, 64)")
    p.add_argument("--kv-padding", type=int, default=0,
                   help="transformers engine: KV-token padding of its CUDA graphs (0: its default, 16384)")
    p.add_argument("--warmup-requests", default=None,
                   help="requests of the unmeasured first round, all at once: a number or 'all' (the whole workload; "
                        "default for the slots engine), default 2 for the transformers engine")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the manager's CUDA graph pre-capture (quicker start; the first requests then capture)")
    p.add_argument("--dry-run", action="store_true",
                   help="smoke run: tiny model, 4 short requests, 2 rates, on the CPU (on the GPU if there is one: "
                        "transformers' continuous batching does not serve a CPU model on a CUDA machine)")
    args = p.parse_args(argv)
    if args.attention is None:
        args.attention = "marlin_decode" if args.engine == "slots" else "sdpa"
    elif args.attention == "marlin_decode" and args.engine == "transformers":
        p.error("--attention marlin_decode: the transformers engine's continuous batching takes only its own "
                "attentions (sdpa, paged|eager, flash); use --engine slots")
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if any(k not in KERNELS for k in args.kernels):
        p.error(f"--kernels: expected a subset of {KERNELS}")
    args.kernels = [k for k in KERNELS if k in args.kernels]
    args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    args.cuda_graph_flag = {"auto": None, "on": True, "off": False}[args.cuda_graph]
    if args.warmup_requests is None:
        args.warmup_requests = "all" if args.engine == "slots" else "2"
    if args.warmup_requests != "all" and not (args.warmup_requests.isdigit() and int(args.warmup_requests) > 0):
        p.error(f"--warmup-requests: expected a positive number or 'all', got {args.warmup_requests!r}")
    if args.slots < 1 or args.kv_bucket < 1:
        p.error(f"--slots and --kv-bucket must be positive, got {args.slots} and {args.kv_bucket}")
    if args.dry_run:
        args.model, args.layers, args.num_requests, args.rates = "tiny", None, 4, [50.0, float("inf")]
        args.prompt_median, args.output_median, args.max_len = 6, 4, 12
        args.slots, args.kv_bucket = min(args.slots, 4), 8
        if args.engine == "slots" and args.compile == "layer" and not torch.cuda.is_available():
            args.backend = "eager"  # traced like inductor would be, no C++ toolchain needed
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    if torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    elif args.dry_run:
        dev = torch.device("cpu")
    else:
        print("bench_e2e_serving needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 1
    meta = collect_meta(dev, "dry-run" if args.dry_run else "serving", kind="serving")
    meta.update(transformers=transformers.__version__, engine=args.engine, model=args.model, rates=args.rates,
                num_requests=args.num_requests, prompt_median=args.prompt_median, output_median=args.output_median,
                warmup=not (args.dry_run or args.no_warmup), cuda_graph=args.cuda_graph,
                warmup_requests=args.warmup_requests, attention=args.attention)
    if args.engine == "transformers":
        meta.update(tf_compile_level=args.tf_compile_level, q_padding=args.q_padding, kv_padding=args.kv_padding)
    if args.engine == "slots":
        meta.update(slots=args.slots, kv_bucket=args.kv_bucket, compile=args.compile, backend=args.backend)
    meta["inductor_pdl"] = set_inductor_pdl(args.inductor_pdl)
    model = build_model(args.model, args.layers, dev, seed=args.seed, attention=args.attention)
    meta["layers"] = model.config.num_hidden_layers
    reqs = workload(args.num_requests, args.prompt_median, args.output_median, args.max_len,
                    model.config.vocab_size, args.seed)
    points, requests_out = [], []
    suffix = ("" if args.engine == "slots" else f"-{args.engine}") + (f"-{args.layers}L" if args.layers else "")
    out = Path(args.out) if args.out else (
        Path(tempfile.gettempdir()) / "marlin-bench-serving-dry-run.json" if args.dry_run
        else RESULTS_DIR / f"{meta['gpu_slug']}-serving{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(complete: bool) -> None:
        # after every rate too: a run stopped by a time limit keeps what it measured
        meta["complete"] = complete
        for b, key in (("fp16", "tpot_speedup"), ("fp16_fused", "tpot_speedup_over_fused")):
            base = {p["rate"]: p for p in points if p["kernel"] == b and p.get("tpot_ms_median")}
            for p in points:
                ref = base.get(p["rate"])
                if p["kernel"] in ("marlin", "marlin_24") and ref and p.get("tpot_ms_median"):
                    p[key] = ref["tpot_ms_median"] / p["tpot_ms_median"]
        out.write_text(dump_results({"meta": meta, "points": points, "requests": requests_out}))

    def record(kernel: str, rate: float, recs: list[dict], **extra) -> None:
        point = {"kernel": kernel, "rate": rate if np.isfinite(rate) else None, **summarize(recs), **extra}
        points.append(point)
        requests_out.extend(dict(r, kernel=kernel, rate=point["rate"]) for r in recs)
        print(f"{kernel:7} rate {rate:6} req/s: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in point.items() if k not in ("kernel", "rate")),
            flush=True)
        write(complete=False)

    def serve_kernel(kernel: str) -> None:
        if args.engine == "slots":
            server, setup_s, undo = make_server(model, args, reqs, f"{kernel} graphs")
            meta.setdefault("setup_s", {})[kernel] = round(setup_s, 2)
            meta.setdefault("prefill", {})[kernel] = (
                "eager" if not server.use_graphs else server.prefill_graph_error or
                f"CUDA graphs of {server.prefill_lens[0]}..{server.prefill_lens[-1]} tokens")
            try:
                # unmeasured: prefill shapes, allocator growth, first replays (the first measured rate
                # of a 2-request warm-up showed stalls of ~1 s on the H100)
                n_warm = len(reqs) if args.warmup_requests == "all" else min(len(reqs), int(args.warmup_requests))
                serve_slots(server, reqs[:n_warm], [0.0] * n_warm, args.timeout)
                for rate in args.rates:
                    recs = serve_slots(server, reqs, arrivals(len(reqs), rate, args.seed), args.timeout)
                    st = server.steps  # what the GEMMs and attention saw: rows per step, padded batch, cache length
                    record(kernel, rate, recs, steps=len(st), mean_rows=statistics.fmean(x[0] for x in st) if st else None,
                           mean_batch=statistics.fmean(x[1] for x in st) if st else None,
                           mean_kv_len=statistics.fmean(x[2] for x in st) if st else None)
            finally:
                undo()
                del server
                free_memory()
            return
        # an unmeasured round first: the manager's set-up (cache sizing, graph capture) is not a
        # request's latency. --warmup-requests all: the whole workload at once, which passes
        # through every batch size from all requests down to one, so that the CUDA graphs of the
        # padded sizes the measured rounds meet are captured before they are timed.
        kw = dict(warmup=not (args.dry_run or args.no_warmup), timeout_s=args.timeout, small_cache=args.dry_run,
                  cuda_graph=args.cuda_graph_flag,
                  cb_options={k: v for k, v in (("default_compile_level", args.tf_compile_level),
                                                ("q_padding_interval_size", args.q_padding),
                                                ("kv_padding_interval_size", args.kv_padding)) if v})
        n_warm = len(reqs) if args.warmup_requests == "all" else min(len(reqs), int(args.warmup_requests))
        serve(model, reqs[:n_warm], [0.0] * n_warm, **kw)
        for rate in args.rates:
            record(kernel, rate, serve(model, reqs, arrivals(len(reqs), rate, args.seed), **kw))
        model.destroy_cached_continuous_batching_manager()
        free_memory()

    for kernel in args.kernels:
        restore = fuse_fp16(model) if kernel == "fp16_fused" else (lambda: None)
        if kernel == "marlin":
            to_marlin(model, fuse=True)
            free_memory()
        elif kernel == "marlin_24":
            if "marlin" in args.kernels:  # the dense conversion replaced the FP16 weights: the same model anew
                del model
                free_memory()
                model = build_model(args.model, args.layers, dev, seed=args.seed, attention=args.attention)
            to_marlin(model, fuse=True, sparsity="2:4")
            free_memory()
        try:
            serve_kernel(kernel)
        finally:
            restore()
    write(complete=True)
    print(f"wrote {out}")
    return 0 if all(p.get("failed", 1) == 0 for p in points) else 3


if __name__ == "__main__":
    sys.exit(main())
