"""Tensor-parallel decode throughput: Llama-2-70B shape, random weights, FP16 vs Marlin, TP = world size.

    torchrun --nproc-per-node 2 -m benchmarks.bench_tp                 # TP=2, 80 layers, batch 1..64
    torchrun --nproc-per-node 1 -m benchmarks.bench_tp --kinds marlin  # TP=1 (FP16 70B needs 2 GPUs)
    python -m benchmarks.bench_tp --dry-run                            # CPU smoke run, tiny shape

Protocol (the paper's end-to-end runs): a 64-token prompt already in the KV cache, then 64 greedy
decode steps for every sequence of the batch; tokens/s = batch * 64 / time of the 64 steps.
Each step (embedding, all layers with their all-reduces, norm, lm_head with its all-gather, argmax)
is one CUDA graph, replayed 64 times (``--no-graph``: eager). Both sides run the same model code
(benchmarks/tp_model.py: q/k/v and gate/up fused per rank, the element-wise code between the GEMMs
compiled with torch.compile on GPUs; ``--compile off`` runs it eagerly) and differ only in the
linear layers; lm_head is FP16 and vocabulary-
parallel on both. Each rank builds only its own shards. A point's time is the median over
``--repeats`` runs of the slowest rank. Results: ``benchmarks/results/<gpu>x<T>-tp.json``
(``--out``), and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .e2e_model import set_inductor_pdl
from .tp_model import ATTENTIONS, LLAMA2_70B, DecodeModel, LlamaShape, random_linear  # noqa: F401

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TINY = LlamaShape(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=512, layers=2)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=LLAMA2_70B.layers, help="decoder layers (default 80, the full model)")
    p.add_argument("--batches", default="1,2,4,8,16,32,64", help="comma-separated batch sizes")
    p.add_argument("--kinds", default="fp16,marlin", help="comma-separated: fp16, marlin, marlin_24 (2:4-sparse)")
    p.add_argument("--prompt", type=int, default=64, help="tokens already in the cache")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-graph", action="store_true", help="eager steps instead of one CUDA graph per step")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile the layers' element-wise code (auto: on GPUs, off on the CPU)")
    p.add_argument("--inductor-pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="the compiled element-wise code's Triton kernels with programmatic dependent launch (as "
                        "bench_e2e --inductor-pdl; default: on where this torch has the option and the code is compiled)")
    p.add_argument("--attention", choices=tuple(ATTENTIONS), default="marlin_decode",
                   help="the decode step's attention, for every kind alike: marlin_decode (marlin's decode kernel, "
                        "as compile_for_decode sets it; the default) or sdpa")
    p.add_argument("--profile-batches", default="",
                   help="comma-separated batches whose step is also profiled (torch.profiler over eager calls of the "
                        "step, kernel time by category: GEMMs, collectives, attention, element-wise; rank 0's)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, a 2-layer tiny shape; writes to the temp dir")
    return p.parse_args(argv)


def init(cpu: bool = False) -> tuple:
    """(rank, world size, device) from torchrun's environment; one process without it. cpu=True
    (the dry run) stays on the CPU with gloo even where a GPU is visible."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available() and not cpu
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return rank, world, device


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(seconds: float, world: int, device) -> float:
    """The slowest rank's time (every rank waits for the others at each collective anyway)."""
    if world == 1:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def compiled(args, device) -> bool:
    return args.compile == "on" or (args.compile == "auto" and device.type == "cuda")


def make_runner(fn, graph: bool, device, warmups: int = 3):
    """A function running ``fn`` once: a CUDA graph replay of it, or ``fn`` itself (eager)."""
    if not graph or device.type != "cuda":
        fn()  # warm-up (and compilation) outside the timing
        return fn
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up outside the capture: NCCL communicators, cuBLAS handles
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def median_seconds(run, calls: int, args, world: int, device, reset=None) -> float:
    """Median over --repeats of the slowest rank's time for ``calls`` runs (``reset`` before each)."""
    times = []
    for _ in range(args.repeats):
        if reset is not None:
            reset()
        sync(device)
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        sync(device)
        times.append(slowest(time.perf_counter() - t0, world, device))
    return statistics.median(times)


def time_point(model: DecodeModel, args, batch: int, world: int, device) -> dict:
    model.prepare(batch)
    model.pos.fill_(args.prompt)  # the warm-up steps before capture must stay inside the cache
    run = make_runner(model.step, not args.no_graph, device)
    sec = median_seconds(run, args.steps, args, world, device, reset=lambda: model.pos.fill_(args.prompt))
    point = {
        "batch": batch,
        "seconds": sec,
        "ms_per_step": 1e3 * sec / args.steps,
        "tokens_per_s": batch * args.steps / sec,
        "graph": (not args.no_graph) and device.type == "cuda",
    }
    if batch in profile_batches(args):
        point["profile"] = profile_point(model, args, world, device, 1e3 * point["ms_per_step"])
        if world > 1:
            point["profile"]["collectives_alone_us_per_step"] = collectives_alone_us(model, args, batch, world, device)
    return point


def profile_batches(args) -> set:
    return {int(b) for b in args.profile_batches.split(",") if b}


def profile_point(model: DecodeModel, args, world: int, device, step_us: float) -> dict:
    """The step's kernels by category (benchmarks/kernel_profile.py) from eager calls of the step
    (the kernels the graph replays, each visible to the profiler); every rank steps (the
    collectives need them all), rank 0's profile is kept. idle_us_per_step: the timed step
    (graph replay) minus the kernels' sum. The ranks meet at a host barrier (gloo) before each
    profiled step; an NCCL barrier would put its own waiting kernel into the step."""
    from .kernel_profile import profile_calls

    align = None
    if world > 1:
        group = _host_group()
        align = lambda: dist.barrier(group=group)  # noqa: E731
    prof = profile_calls(model.step, lambda: model.pos.fill_(args.prompt), device, steps=4, align=align)
    prof["idle_us_per_step"] = round(step_us - prof["kernel_us_per_step"], 2)
    if world > 1:
        dist.barrier()
    return prof


def collectives_alone_us(model: DecodeModel, args, batch: int, world: int, device) -> float:
    """A step's collectives on their own, us per step (slowest rank, median of --repeats): the two
    all-reduces per layer of [batch, hidden] and lm_head's all-gather of [batch, vocab / world],
    fp16, the same calls the model makes, in one CUDA graph on GPUs (eager on the CPU). In a
    profile of eager steps a collective's kernel also waits for the other ranks' launches, so this
    is the figure to set beside the other kernels' time."""
    from marlin.parallel.comm import all_gather_last, all_reduce_sum

    s = model.shape
    x = torch.randn(batch, s.hidden, device=device, dtype=torch.float16) * 0.01
    logits = torch.randn(batch, s.vocab // world, device=device, dtype=torch.float16)

    def calls():
        for _ in range(2 * s.layers):
            all_reduce_sum(x, None, world)
        all_gather_last(logits, None, world)

    run = make_runner(calls, True, device, warmups=1)
    run()
    reps = max(1, min(args.steps, 16))
    return round(1e6 * median_seconds(run, reps, args, world, device) / reps, 2)


_HOST_GROUP = None


def _host_group():
    """A gloo group of every rank (made once, by all ranks at the same point: the first profiled
    batch), for barriers that launch nothing on the GPU."""
    global _HOST_GROUP
    if _HOST_GROUP is None:
        _HOST_GROUP = dist.new_group(backend="gloo")
    return _HOST_GROUP


def weight_bytes(model: DecodeModel) -> int:
    """This rank's bytes of layer weights (what a decode step reads), embeddings and lm_head excluded."""
    return sum(t.numel() * t.element_size() for t in model.layers.parameters()) + sum(
        t.numel() * t.element_size() for name, t in model.layers.named_buffers() if name.endswith(("b_q", "b_meta", "b_scales"))
    )


def run_kind(kind: str, shape: LlamaShape, args, batches, rank, world, device) -> dict:
    max_len = args.prompt + args.steps
    model = DecodeModel(shape, kind, max_len, rank, world, device, compile=compiled(args, device),
                        attention=args.attention)
    out = {"kind": kind, "weight_bytes_per_rank": weight_bytes(model), "points": []}
    for batch in batches:
        point = time_point(model, args, batch, world, device)
        out["points"].append(point)
        if rank == 0:
            print(f"  {kind:6s} TP={world} batch {batch:3d}: {point['ms_per_step']:8.3f} ms/step  "
                  f"{point['tokens_per_s']:9.1f} tok/s", flush=True)
            if "profile" in point:
                cats = ", ".join(f"{c} {us / 1e3:.2f}" for c, us in point["profile"]["us_per_step_by_category"].items())
                print(f"    ms per step by kernel category: {cats}; idle {point['profile']['idle_us_per_step'] / 1e3:.2f}",
                      flush=True)
                if "collectives_alone_us_per_step" in point["profile"]:
                    print(f"    collectives alone: {point['profile']['collectives_alone_us_per_step'] / 1e3:.2f} "
                          "ms per step", flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def table(result: dict) -> str:
    """Markdown: tokens/s per batch and kind, and each quantized kind over FP16."""
    kinds = {r["kind"]: {p["batch"]: p for p in r["points"]} for r in result["runs"]}
    batches = sorted({b for pts in kinds.values() for b in pts})
    over = [k for k in kinds if k != "fp16"] if "fp16" in kinds else []
    head = "| batch | " + " | ".join(f"{k} tok/s" for k in kinds) + "".join(f" | {k} / fp16" for k in over) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for b in batches:
        cells = [f"{kinds[k][b]['tokens_per_s']:.1f}" if b in kinds[k] else "" for k in kinds]
        for k in over:
            both = b in kinds[k] and b in kinds["fp16"]
            cells.append(f"{kinds[k][b]['tokens_per_s'] / kinds['fp16'][b]['tokens_per_s']:.2f}x" if both else "")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def meta(device, world: int, shape: LlamaShape, args) -> dict:
    info = {"kind": "tp", "world_size": world, "shape": shape.__dict__, "prompt": args.prompt, "steps": args.steps,
            "repeats": args.repeats, "torch": torch.__version__, "fused_projections": True,
            "compiled": compiled(args, device), "attention": args.attention,
            # profiled steps start together at a host barrier after a dropped warm-up step
            "profile_aligned": True,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:  # git revision and device facts, as in the other results files
        from .provenance import device_facts, git_info_here

        info.update(device_facts(device))
        info["git"] = git_info_here()  # MARLIN_GIT_REV / MARLIN_CSRC_TREE of the checkout win
    except Exception as e:  # noqa: BLE001  (provenance must not cost the measurement)
        info["provenance_error"] = repr(e)
        info.setdefault("gpu_slug", "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device).replace(" ", "-").lower())
    if device.type == "cuda":
        try:
            version = torch.cuda.nccl.version()  # a tuple in current torch, an int in old ones
            info["nccl"] = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
        except Exception as e:  # noqa: BLE001
            info["nccl"] = repr(e)
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, device = init(cpu=args.dry_run)
    shape = TINY if args.dry_run else LlamaShape(**{**LLAMA2_70B.__dict__, "layers": args.layers})
    if args.dry_run:
        args.steps, args.repeats, args.prompt = min(args.steps, 4), 1, min(args.prompt, 4)
    batches = [int(b) for b in args.batches.split(",") if b]
    kinds = [k for k in args.kinds.split(",") if k]
    # inductor's programmatic launch, process-wide as in bench_e2e; nothing to launch without compile
    pdl = set_inductor_pdl(args.inductor_pdl) if compiled(args, device) else False
    result = {"meta": {**meta(device, world, shape, args), "inductor_pdl": pdl}, "runs": []}
    if rank == 0:
        what = "a tiny shape (dry run)" if args.dry_run else "Llama-2-70B shape"
        print(f"decode, {shape.layers} layers of {what}, TP={world}, {args.prompt}+{args.steps} tokens", flush=True)
    for kind in kinds:
        try:
            result["runs"].append(run_kind(kind, shape, args, batches, rank, world, device))
        except torch.cuda.OutOfMemoryError as e:  # FP16 70B on one GPU
            result["runs"].append({"kind": kind, "error": f"out of memory: {str(e).splitlines()[0]}", "points": []})
            if rank == 0:
                print(f"  {kind}: out of memory at TP={world}", flush=True)
            torch.cuda.empty_cache()
    if rank == 0:
        ok = {"meta": result["meta"], "runs": [r for r in result["runs"] if r["points"]]}
        if ok["runs"]:
            print(table(ok))
        out = args.out
        if out is None:
            base = Path(os.environ.get("TMPDIR", "/tmp")) if args.dry_run else RESULTS_DIR
            out = base / f"{result['meta'].get('gpu_slug', 'gpu')}x{world}-tp.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
