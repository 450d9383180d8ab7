"""A small-batch and a large-batch gemm_2_4 for compute-sanitizer (memcheck, racecheck, synccheck).

    compute-sanitizer --tool memcheck python scripts/sanitize_2_4.py
Checks the results against the spec too, so a run that is clean but wrong still fails.
"""

import os
import sys

import torch

os.environ.setdefault("MARLIN_2_4_CUDA", "1")  # the 2:4 kernel is off by default until validated

import marlin  # noqa: E402
from marlin import sparse  # noqa: E402

CASES = [  # (M, K, N, group size): 8/16/32-row slices, both tiles, K split into parts or not
    (1, 1024, 512, 128),  # 256-column tile, K split (fp32 partials + the reduction launch)
    (13, 512, 384, -1),  # 128-column tile, 16-row slice, per-column scales
    (70, 4096, 1024, 128),  # three 32-row slices (the last partial)
    (200, 256, 4096, -1),  # many slices, one K part: C written directly
]


def main():
    torch.manual_seed(0)
    ok = True
    for m, k, n, g in CASES:
        w = sparse.prune_2_4(torch.randn(k, n, device="cuda"))
        b_q, b_meta, b_s = sparse.quantize_and_pack_2_4(w, g)
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        c = marlin.gemm_2_4(a, b_q, b_meta, b_s)
        ref = a.float() @ sparse.unpack_2_4(b_q, b_meta, b_s)
        err = ((c.float() - ref).norm() / ref.norm()).item()
        print(f"M={m} K={k} N={n} g={g}: rel err {err:.2e}")
        ok &= err < 2e-3
    torch.cuda.synchronize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
