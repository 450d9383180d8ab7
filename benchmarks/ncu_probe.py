"""Development probe: run one marlin.gemm configuration a few times, for Nsight Compute.

    ncu -k regex:marlin --launch-skip 2 --launch-count 1 python -m benchmarks.ncu_probe K N M [tile_k tile_n] [g]
Weights are random codes (the kernel's speed does not depend on them); g = 128 or -1 (per column);
tile_k / tile_n 0: the planner's pick (e.g. `... 4096 12288 4096 0 0 -1`).
"""

import sys

import torch

import marlin


def main():
    k, n, m = (int(x) for x in sys.argv[1:4])
    tile = (int(sys.argv[4]) or None, int(sys.argv[5]) or None) if len(sys.argv) > 5 else (None, None)  # 0: the planner's pick
    g = int(sys.argv[6]) if len(sys.argv) > 6 else 128
    groups = 1 if g == -1 else k // g
    b_q = torch.randint(-(2**31), 2**31 - 1, (k // 16, 2 * n), dtype=torch.int32, device="cuda")
    b_s = (torch.rand(groups, n, device="cuda") * 0.01 + 0.001).half()
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    ws = marlin.make_workspace()
    for _ in range(4):
        marlin.gemm(a, b_q, b_s, ws, tile_k=tile[0], tile_n=tile[1])
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
