"""A small-batch and a large-batch gemm_2_4 for compute-sanitizer (memcheck, racecheck, synccheck).

    compute-sanitizer --tool memcheck python scripts/sanitize_2_4.py
    SANITIZE_QUICK=1 compute-sanitizer --tool racecheck python scripts/sanitize_2_4.py   (two plans only)
Checks the results against the spec too, so a run that is clean but wrong still fails.
"""

import os
import sys

import torch

import marlin
from marlin import sparse

CASES = [  # (M, K, N, group size): 8/16/32/64-row slices, both tiles, K split into parts or not
    (1, 1024, 512, 128),  # K split (fp32 partials + the last block's reduction, or in clusters)
    (13, 512, 384, -1),  # 128-column tile, 16-row slice, per-column scales
    (70, 4096, 1024, 128),  # two 64-row slices (the last partial); sm_90a: two 64-row wgmma slices
    (200, 256, 4096, -1),  # many slices, one K part: C written directly
    (24, 1024, 512, 128),  # sm_90a: the 32-row wgmma slice, K split
    (40, 2048, 768, -1),  # sm_90a: the 64-row wgmma slice (3-stage late refill), 3 column tiles
    (130, 1024, 512, 128),  # sm_90a: 128-row wgmma block slices (MARLIN_2_4_WARP_SLICES=2)
]
# groups of 64 and 32 (a scale row per strip after the ring): the mma.sync and wgmma loops
FINE_CASES = [(1, 1024, 512, 64), (24, 1024, 512, 32), (40, 2048, 768, 64), (130, 1024, 512, 32)]
# bf16 activations, scales and output: the mma.sync and (sm_90a) the wgmma instances of that type
BF16_CASES = [(1, 1024, 512, 128), (24, 1024, 512, 128), (40, 2048, 768, -1), (40, 1024, 512, 32)]
# each case under the planner's choice, with the K parts forced through global memory, forced
# into clusters (sm_90+), with 128-row slices, under the first kernel's plan, and (sm_90a, where
# M > 8 runs the sparse wgmma) its early-refill variant, the mma.sync kernel instead, and two K
# warpgroups per block (with K parts in clusters or through global memory)
# (csrc/cuda/sparse/gemm_2_4_cuda.cpp reads these per call)
PLANS = [
    {},
    {"MARLIN_2_4_CLUSTERS": "0", "MARLIN_2_4_PARTS": "3"},
    {"MARLIN_2_4_CLUSTERS": "1", "MARLIN_2_4_PARTS": "4", "MARLIN_2_4_PDL": "1"},
    {"MARLIN_2_4_WARP_SLICES": "4"},
    {"MARLIN_2_4_PLAN": "legacy"},
    {"MARLIN_2_4_WG_LATE": "0", "MARLIN_2_4_WGMMA": "1"},
    {"MARLIN_2_4_WGMMA": "0"},
    {"MARLIN_2_4_WARP_SLICES": "2"},
    {"MARLIN_2_4_KW": "2", "MARLIN_2_4_WGMMA": "1"},
    {"MARLIN_2_4_KW": "2", "MARLIN_2_4_WGMMA": "1", "MARLIN_2_4_CLUSTERS": "0", "MARLIN_2_4_PARTS": "3"},
]
if os.environ.get("SANITIZE_QUICK") == "1":  # racecheck / synccheck are slow: the planner's plan and clusters
    PLANS = PLANS[:1] + PLANS[2:3]


def main():
    torch.manual_seed(0)
    ok = True
    cases = [(*c, torch.float16) for c in CASES + FINE_CASES] + [(*c, torch.bfloat16) for c in BF16_CASES]
    for m, k, n, g, dtype in cases:
        w = sparse.prune_2_4(torch.randn(k, n, device="cuda"))
        b_q, b_meta, b_s = sparse.quantize_and_pack_2_4(w, g, dtype=dtype)
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        ref = a.float() @ sparse.unpack_2_4(b_q, b_meta, b_s)
        for env in PLANS:
            os.environ.update(env)
            c = marlin.gemm_2_4(a, b_q, b_meta, b_s)
            for key in env:
                del os.environ[key]
            err = ((c.float() - ref).norm() / ref.norm()).item()
            print(f"M={m} K={k} N={n} g={g} {dtype} {env or 'planned'}: rel err {err:.2e}")
            ok &= err < (2e-3 if dtype == torch.float16 else 8e-3)
    torch.cuda.synchronize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
