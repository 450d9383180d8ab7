"""Development probe: time marlin.gemm with each forced tile configuration on a few layers.

    python -m benchmarks.probe_tiles
Same method as bench_gemm (weights rotated past L2, CUDA-graph replay, medians), fewer points.
Used to fill the tile table in csrc/cuda/marlin_gemm.cu; results go to benchmarks/NOTES.md.
"""

import torch

import marlin

SHAPES = {"7B_o": (4096, 4096), "70B_o": (8192, 8192), "7B_gateup": (4096, 22016), "70B_gateup": (8192, 57344)}
MS = [1, 4, 16, 32, 64, 128]
TILES = [(None, None), (128, 128), (64, 256)]


def time_us(fn, reps=20, rounds=7):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return sorted(times)[rounds // 2]


def main():
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print("shape        M | " + " | ".join(f"{str(t):>12}" for t in TILES))
    for name, (k, n) in SHAPES.items():
        copies = max(1, -(-4 * l2 // (k * n // 2)))
        b_q = torch.randint(-(2**31), 2**31 - 1, (copies, k // 16, 2 * n), dtype=torch.int32, device="cuda")
        b_s = (torch.rand(copies, k // 128, n, device="cuda") * 0.01 + 0.001).half()
        ws = marlin.make_workspace()
        for m in MS:
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            row = []
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
