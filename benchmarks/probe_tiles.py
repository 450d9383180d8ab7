"""Development probe: time marlin.gemm with each forced tile configuration on a few layers.

    python -m benchmarks.probe_tiles            (PROBE_MS=1,8,16 PROBE_IDEAL=1 PROBE_TILES=... PROBE_SHAPES=... (names or KxN) to
                                                 choose points; MARLIN_WGMMA=0 for mma.sync only)
Same method as bench_gemm (weights rotated past L2, CUDA-graph replay, medians), fewer points.
Used to fill the tile table in csrc/cuda/marlin_gemm.cu; results go to benchmarks/NOTES.md.
"""

import os

import torch

import marlin
from benchmarks.timing import graph_median_us as time_us
from benchmarks.shapes import BENCH_SHAPES, ideal_shape, shape_by_name

# the Llama-2 7B / 70B layers, or PROBE_SHAPES=7B_o,Llama-3-8B/qkv,2048x8192,... (names of
# benchmarks/shapes.py, or K x N)
SHAPES = {s: shape_by_name(s) for s in os.environ["PROBE_SHAPES"].split(",")} if os.environ.get("PROBE_SHAPES") else dict(BENCH_SHAPES)
MS = [int(m) for m in os.environ.get("PROBE_MS", "1,4,8,16,32,64").split(",")]
# (None, None) = the planner's choice; then the tiled kernel's and the small-batch kernel's tiles
# (PROBE_TILES=auto,64x256,128x256 to choose)
_TILE_NAMES = os.environ.get("PROBE_TILES", "auto,128x128,64x256,128x256,128x512").split(",")
TILES = [(None, None) if t == "auto" else tuple(int(v) for v in t.split("x")) for t in _TILE_NAMES]


def main():
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    if os.environ.get("PROBE_IDEAL", "0") == "1":
        SHAPES["ideal"] = ideal_shape(props.multi_processor_count)
    print("time in us (fp16 column: torch.matmul)")
    print("shape        M |         fp16 | " + " | ".join(f"{str(t):>12}" for t in TILES))
    for name, (k, n) in SHAPES.items():
        copies = max(1, -(-4 * l2 // (k * n // 2)))
        b_q = torch.randint(-(2**31), 2**31 - 1, (copies, k // 16, 2 * n), dtype=torch.int32, device="cuda")
        b_s = (torch.rand(copies, k // 128, n, device="cuda") * 0.01 + 0.001).half()
        ws = marlin.make_workspace()
        for m in MS:
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            w16 = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(max(1, -(-4 * l2 // (k * n * 2))))]
            st = {"i": 0}

            def fp16():
                i = st["i"] = (st["i"] + 1) % len(w16)
                torch.matmul(a, w16[i].t())

            row = [time_us(fp16)]
            del w16
            for tk, tn in TILES:
                if tn is not None and n % tn:
                    row.append(float("nan"))
                    continue
                state = {"i": 0}

                def call():
                    i = state["i"] = (state["i"] + 1) % copies
                    marlin.gemm(a, b_q[i], b_s[i], ws, tile_k=tk, tile_n=tn)

                row.append(time_us(call))
            print(f"{name:10s} {m:4d} | " + " | ".join(f"{t:12.1f}" for t in row))
        del b_q, b_s
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
