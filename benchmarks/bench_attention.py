"""Decode attention alone: torch.ops.marlin.decode_attention against SDPA on decode shapes.

    python -m benchmarks.bench_attention                      # Llama-2-7B and Llama-3-8B heads
    python -m benchmarks.bench_attention --out /tmp/att.json

One query token per sequence against a KV cache of N positions of which the first ``visible`` x N
are visible (the rest masked, as in a static cache): the e2e protocol's cache (N = 128, 64-128
visible: 3/4 on average) and longer ones. Kernels, each timed in CUDA graphs over KV caches
rotated through more memory than L2 (benchmarks.timing.measure):

  sdpa_add       F.scaled_dot_product_attention with an additive mask [B, 1, 1, N] (what the
                 compiled decode step passes; cuDNN on Hopper); GQA through enable_gqa;
  sdpa_bool      the same with a boolean mask (what transformers' eager step passes);
  marlin_decode  torch.ops.marlin.decode_attention with the additive mask.

Reported: microseconds per call, and marlin_decode's GB/s of the visible keys and values (the
bytes a decode step must read).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

HEADS = {"Llama-2-7B": (32, 32, 128), "Llama-3-8B": (32, 8, 128)}  # query heads, key/value heads, head size
# (positions, visible fraction, batches)
CACHES = [(128, 0.75, (1, 4, 16, 64, 128)), (1024, 0.5, (1, 16, 64)), (4096, 0.5, (1, 16))]
L2_ROTATE_BYTES = 256 << 20


def _case(h, hkv, d, b, n, visible, copies, dev):
    k = torch.randn(copies, b, hkv, n, d, dtype=torch.float16, device=dev)
    v = torch.randn_like(k)
    q = torch.randn(b, h, 1, d, dtype=torch.float16, device=dev)
    seen = torch.arange(n, device=dev)[None, :] < max(1, int(n * visible))
    add = torch.zeros(b, n, dtype=torch.float16, device=dev).masked_fill(~seen, torch.finfo(torch.float16).min)
    return q, k, v, add, seen.expand(b, n)


def run(args) -> list[dict]:
    from .timing import measure

    import marlin.attention  # noqa: F401  (torch.ops.marlin.decode_attention)
    from marlin.attention import decode_kernel

    dev = torch.device("cuda")
    points = []
    for model in args.models:
        h, hkv, d = HEADS[model]
        for n, visible, batches in CACHES:
            for b in batches:
                kv_bytes = 2 * b * hkv * n * d * 2
                copies = max(1, min(8, -(-L2_ROTATE_BYTES // kv_bytes)))
                q, k, v, add, seen = _case(h, hkv, d, b, n, visible, copies, dev)
                gqa = dict(enable_gqa=True) if h != hkv else {}
                fns = {
                    "sdpa_add": lambda i: F.scaled_dot_product_attention(q, k[i], v[i], attn_mask=add[:, None, None, :],
                                                                          **gqa),
                    "sdpa_bool": lambda i: F.scaled_dot_product_attention(q, k[i], v[i],
                                                                           attn_mask=seen[:, None, None, :], **gqa),
                    "marlin_decode": lambda i: torch.ops.marlin.decode_attention(q[:, :, 0], k[i], v[i], add, d ** -0.5),
                }
                mine = fns["marlin_decode"]
                for tuning in args.tunings:  # the launch's other tunings, timed under their own names
                    fns["marlin_" + tuning] = lambda i, t=tuning: _with_tuning(decode_kernel, t, lambda: mine(i))
                ref = fns["sdpa_add"](0)[:, :, 0].float()
                got = fns["marlin_decode"](0).float()
                err = ((got - ref).norm() / ref.norm()).item()
                row = {"model": model, "batch": b, "positions": n, "visible": visible, "kv_bytes": kv_bytes,
                       "rel_err_vs_sdpa": err}
                for name, fn in fns.items():
                    try:
                        t = measure(fn, copies, dev)["time_us"]
                    except RuntimeError as e:  # e.g. no SDPA backend for a mask type
                        print(f"{model} b{b} n{n} {name}: {e}", file=sys.stderr)
                        t = None
                    row[name + "_us"] = t
                points.append(row)
                base = min(t for t in (row["sdpa_add_us"], row["sdpa_bool_us"]) if t)
                vis_gb = kv_bytes * visible / 1e9
                print(f"{model:10s} b={b:4d} N={n:5d} sdpa_add {row['sdpa_add_us']:8.1f} sdpa_bool "
                      f"{row['sdpa_bool_us'] or float('nan'):8.1f} marlin {row['marlin_decode_us']:8.1f} us  "
                      f"x{base / row['marlin_decode_us']:.2f}  visible {vis_gb / row['marlin_decode_us'] * 1e6:6.0f} "
                      f"GB/s  err {err:.1e}" + "".join(f"  {t} {row['marlin_' + t + '_us']:.1f}" for t in args.tunings),
                      flush=True)
                del q, k, v, add, seen
                torch.cuda.empty_cache()
    return points


def _with_tuning(decode_kernel, tuning: str, call):
    """call() under decode_kernel.TUNING from "BLOCK_N x WARPS x STAGES x MIN_SPLIT" (e.g. 32x4x2x64)."""
    keep = dict(decode_kernel.TUNING)
    bn, w, st, ms = (int(x) for x in tuning.split("x"))
    decode_kernel.TUNING.update(block_n=bn, warps=w, stages=st, min_split=ms)
    try:
        return call()
    finally:
        decode_kernel.TUNING.update(keep)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(HEADS), help=f"comma-separated subset of {','.join(HEADS)}")
    p.add_argument("--tunings", default="",
                   help="other launch tunings of marlin_decode to time, comma-separated BLOCK_NxWARPSxSTAGESxMIN_SPLIT "
                        "(e.g. 32x4x2x64,64x8x3x256)")
    p.add_argument("--out", help="results JSON")
    args = p.parse_args(argv)
    args.tunings = [t for t in args.tunings.split(",") if t]
    args.models = [m for m in args.models.split(",") if m]
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU", file=sys.stderr)
        return 1
    from .bench_gemm import dump_results
    from .provenance import collect_meta

    dev = torch.device("cuda", torch.cuda.current_device())
    meta = collect_meta(dev, "attention", kind="attention")
    points = run(args)
    if args.out:
        with open(args.out, "w") as f:
            f.write(dump_results({"meta": meta, "points": points}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
