"""Serving: time per output token and time to first token against request rate, FP16 vs Marlin,
through transformers' own continuous batching (model.continuous_batching_context_manager).

    python -m benchmarks.bench_e2e_serving                          # Llama-2-7B shape, rates 1 .. 16 req/s
    python -m benchmarks.bench_e2e_serving --layers 8 --rates 2,8 --num-requests 16
    python -m benchmarks.bench_e2e_serving --dry-run                # smoke run on a tiny model

Workload (fixed seed, so FP16 and Marlin serve the same requests): --num-requests requests with
ShareGPT-like lengths, prompt and output lengths drawn from log-normal distributions (medians
--prompt-median / --output-median tokens, sigma 0.8: most requests short, a long tail), clipped to
[4, --max-len]; random token ids; every request generates exactly its output length (no EOS).
Arrivals are a Poisson process at each --rates value (requests per second; "inf": all at once).

Requests are submitted at their arrival times from this thread while the manager's background
thread batches them (transformers' continuous batching, paged KV cache). Per request, from the
token timestamps the manager records: TTFT = first token - arrival, TPOT = (last token - first
token) / (tokens - 1). Per (kernel, rate): median and mean TPOT and TTFT, p90 TTFT, and the
output tokens per second over the run. Before the measured rates, an unmeasured round of
--warmup-requests requests (all at once) sets the manager up; transformers captures a CUDA graph
for each new padded batch size it meets, so short runs need ``--warmup-requests all`` to time
steady-state steps rather than captures. Writes benchmarks/results/<gpu>-serving[-<L>L].json.
The model is benchmarks/e2e_model.py's (random weights; Marlin: replace_linear + fuse).
"""

from __future__ import annotations

import argparse
import gc
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
from .e2e_model import MODEL_SPECS, build_model, to_marlin
from .provenance import collect_meta

KERNELS = ("fp16", "marlin")


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


def serve(model, requests: list[dict], offsets: list[float], warmup: bool, timeout_s: float,
          small_cache: bool = False, cuda_graph: Optional[bool] = None) -> list[dict]:
    """Submit each request at its offset, wait for all; per request its arrival and token times.
    ``small_cache``: a few KV blocks instead of most of the free GPU memory (smoke runs, tests).
    ``cuda_graph``: the manager's use_cuda_graph (None: its own choice)."""
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
    p.add_argument("--model", default="Llama-2-7B", choices=sorted(MODEL_SPECS))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--kernels", default="fp16,marlin")
    p.add_argument("--rates", default="1,2,4,8,16", help="requests per second, comma-separated; 'inf' allowed")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-median", type=int, default=128)
    p.add_argument("--output-median", type=int, default=128)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the last results of a rate")
    p.add_argument("--out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graph", choices=("auto", "on", "off"), default="auto",
                   help="the continuous batching manager's CUDA graphs (auto: transformers decides)")
    p.add_argument("--warmup-requests", default="2",
                   help="requests of the unmeasured first round, all at once: a number or 'all' (the whole workload)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the manager's CUDA graph pre-capture (quicker start; the first requests then capture)")
    p.add_argument("--dry-run", action="store_true",
                   help="smoke run: tiny model, 4 short requests, 2 rates, on the CPU (on the GPU if there is one: "
                        "transformers' continuous batching does not serve a CPU model on a CUDA machine)")
    args = p.parse_args(argv)
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if any(k not in KERNELS for k in args.kernels):
        p.error(f"--kernels: expected a subset of {KERNELS}")
    args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    args.cuda_graph_flag = {"auto": None, "on": True, "off": False}[args.cuda_graph]
    if args.warmup_requests != "all" and not (args.warmup_requests.isdigit() and int(args.warmup_requests) > 0):
        p.error(f"--warmup-requests: expected a positive number or 'all', got {args.warmup_requests!r}")
    if args.dry_run:
        args.model, args.layers, args.num_requests, args.rates = "tiny", None, 4, [50.0, float("inf")]
        args.prompt_median, args.output_median, args.max_len = 6, 4, 12
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
    meta.update(transformers=transformers.__version__, model=args.model, rates=args.rates,
                num_requests=args.num_requests, prompt_median=args.prompt_median, output_median=args.output_median,
                warmup=not (args.dry_run or args.no_warmup), cuda_graph=args.cuda_graph,
                warmup_requests=args.warmup_requests)
    model = build_model(args.model, args.layers, dev, seed=args.seed)
    meta["layers"] = model.config.num_hidden_layers
    reqs = workload(args.num_requests, args.prompt_median, args.output_median, args.max_len,
                    model.config.vocab_size, args.seed)
    points, requests_out = [], []
    suffix = f"-{args.layers}L" if args.layers else ""
    out = Path(args.out) if args.out else (
        Path(tempfile.gettempdir()) / "marlin-bench-serving-dry-run.json" if args.dry_run
        else RESULTS_DIR / f"{meta['gpu_slug']}-serving{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(complete: bool) -> None:
        # after every rate too: a run stopped by a time limit keeps what it measured
        meta["complete"] = complete
        fp16 = {p["rate"]: p for p in points if p["kernel"] == "fp16" and p.get("tpot_ms_median")}
        for p in points:
            base = fp16.get(p["rate"])
            if p["kernel"] != "fp16" and base and p.get("tpot_ms_median"):
                p["tpot_speedup"] = base["tpot_ms_median"] / p["tpot_ms_median"]
        out.write_text(dump_results({"meta": meta, "points": points, "requests": requests_out}))

    for kernel in args.kernels:
        if kernel == "marlin":
            to_marlin(model, fuse=True)
        # an unmeasured round first: the manager's set-up (cache sizing, graph capture) is not a
        # request's latency. --warmup-requests all: the whole workload at once, which passes
        # through every batch size from all requests down to one, so that the CUDA graphs of the
        # padded sizes the measured rounds meet are captured before they are timed.
        kw = dict(warmup=not (args.dry_run or args.no_warmup), timeout_s=args.timeout, small_cache=args.dry_run,
                  cuda_graph=args.cuda_graph_flag)
        n_warm = len(reqs) if args.warmup_requests == "all" else min(len(reqs), int(args.warmup_requests))
        serve(model, reqs[:n_warm], [0.0] * n_warm, **kw)
        for rate in args.rates:
            recs = serve(model, reqs, arrivals(len(reqs), rate, args.seed), **kw)
            point = {"kernel": kernel, "rate": rate if np.isfinite(rate) else None, **summarize(recs)}
            points.append(point)
            requests_out += [dict(r, kernel=kernel, rate=point["rate"]) for r in recs]
            print(f"{kernel:7} rate {rate:6} req/s: " + ", ".join(
                f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in point.items() if k not in ("kernel", "rate")))
            write(complete=False)
        model.destroy_cached_continuous_batching_manager()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    write(complete=True)
    print(f"wrote {out}")
    return 0 if all(p.get("failed", 1) == 0 for p in points) else 3


if __name__ == "__main__":
    sys.exit(main())
