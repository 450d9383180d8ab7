"""Development probe: large batches (prefill) against FP16 in one process, for setting and
checking the prefill kernel's rule.

    MARLIN_PREFILL=1 python -m benchmarks.probe_prefill    # every call the prefill kernel can run goes there
    MARLIN_PREFILL=0 python -m benchmarks.probe_prefill    # none does (the other kernels' plans)
    PROBE_SHAPES=7B_qkv,4096x2752 PROBE_MS=256,1024 PROBE_ROUNDS=8 PROBE_IDEAL=1 PROBE_OUT=x.json ...
    (PROBE_IDEAL=1 adds the SM-sized ideal layer, PROBE_IDEAL=only runs it alone; PROBE_24=1 adds
    marlin.gemm_2_4 on a 2:4-pruned copy of the layer, group 128: kernel marlin_24_g128)

Kernels: fp16 (F.linear, nn.Linear's layout), fp16_kn (a @ W with W [K, N]), marlin g128 and per
column (the planner's plan under the process's MARLIN_PREFILL). Each kernel's calls are captured in
one CUDA graph (weights rotated past L2); the graphs are replayed in rounds of a balanced order, so
that every kernel sees the same clock and power state; the median per kernel. Prints time and
speedup over the faster FP16; PROBE_OUT writes the points as JSON.
"""

import json
import os

import torch
import torch.nn.functional as F

import marlin
from marlin import sparse
from benchmarks.shapes import BENCH_SHAPES, ideal_shape, shape_by_name
from benchmarks.timing import round_orders

SHAPES = {s: shape_by_name(s) for s in os.environ["PROBE_SHAPES"].split(",")} if os.environ.get("PROBE_SHAPES") else dict(BENCH_SHAPES)
MS = [int(m) for m in os.environ.get("PROBE_MS", "256,512,1024,2048,4096").split(",")]
ROUNDS = int(os.environ.get("PROBE_ROUNDS", "8"))
CALLS = 6  # calls per graph replay


def _graph(fn):
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS):
            fn(i)
    return g


def _time(graphs):
    """Median per-call microseconds of each graph, replayed in the rounds of round_orders (balanced)."""
    samples = {name: [] for name in graphs}
    for order in round_orders(list(graphs), ROUNDS):
        for name in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            torch.cuda.synchronize()
            samples[name].append(start.elapsed_time(end) * 1000 / CALLS)
    return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


def main():
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    points = []
    if os.environ.get("PROBE_IDEAL") == "only":
        SHAPES.clear()
    if os.environ.get("PROBE_IDEAL") in ("1", "only"):
        SHAPES["ideal"] = ideal_shape(props.multi_processor_count)
    print(f"{props.name}, MARLIN_PREFILL={os.environ.get('MARLIN_PREFILL', '-1')}; us, and speedup over the faster fp16")
    print(f"{'shape':12s} {'M':>5s} | {'fp16':>9s} {'fp16_kn':>9s} | {'g128':>9s} {'gcol':>9s} | {'g128 x':>6s} {'gcol x':>6s}")
    for name, (k, n) in SHAPES.items():
        copies = max(1, -(-4 * l2 // (k * n // 2)))
        b_q = torch.randint(-(2**31), 2**31 - 1, (copies, k // 16, 2 * n), dtype=torch.int32, device="cuda")
        s_g = (torch.rand(copies, k // 128, n, device="cuda") * 0.01 + 0.001).half()
        s_c = (torch.rand(copies, 1, n, device="cuda") * 0.01 + 0.001).half()
        w_copies = max(1, -(-4 * l2 // (k * n * 2)))
        w_nk = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(w_copies)]
        w_kn = [w.t().contiguous() for w in w_nk]
        ws = marlin.make_workspace()
        w24 = None
        if os.environ.get("PROBE_24") == "1":
            w24 = [t for t in sparse.quantize_and_pack_2_4(sparse.prune_2_4(torch.randn(k, n, device="cuda")), 128)[:3]]
        for m in MS:
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            graphs = {
                "fp16": _graph(lambda i: F.linear(a, w_nk[i % w_copies])),
                "fp16_kn": _graph(lambda i: a @ w_kn[i % w_copies]),
                "marlin_g128": _graph(lambda i: marlin.gemm(a, b_q[i % copies], s_g[i % copies], ws)),
                "marlin_gcol": _graph(lambda i: marlin.gemm(a, b_q[i % copies], s_c[i % copies], ws)),
            }
            if w24 is not None:
                graphs["marlin_24_g128"] = _graph(lambda i: marlin.gemm_2_4(a, w24[0], w24[1], w24[2], ws))
            t = _time(graphs)
            best = min(t["fp16"], t["fp16_kn"])
            print(f"{name:12s} {m:5d} | {t['fp16']:9.1f} {t['fp16_kn']:9.1f} | {t['marlin_g128']:9.1f} "
                  f"{t['marlin_gcol']:9.1f} | {best / t['marlin_g128']:6.2f} {best / t['marlin_gcol']:6.2f}"
                  + (f" | 2:4 {t['marlin_24_g128']:9.1f} {best / t['marlin_24_g128']:6.2f}" if w24 else ""), flush=True)
            points += [{"shape": name, "K": k, "N": n, "M": m, "kernel": kern, "time_us": v} for kern, v in t.items()]
            del graphs
        del b_q, s_g, s_c, w_nk, w_kn, w24
        torch.cuda.empty_cache()
    if os.environ.get("PROBE_OUT"):
        meta = {"gpu": props.name, "torch": torch.__version__, "marlin_prefill": os.environ.get("MARLIN_PREFILL", "-1"),
                "git_rev": os.environ.get("MARLIN_GIT_REV", "")}
        with open(os.environ["PROBE_OUT"], "w") as f:
            json.dump({"meta": meta, "points": points}, f, indent=1)


if __name__ == "__main__":
    main()
