"""A small-batch and a large-batch gemm_2_4 (symmetric and with zero points) for compute-sanitizer
(memcheck, racecheck, synccheck).

    compute-sanitizer --tool memcheck python scripts/sanitize_2_4.py
    SANITIZE_QUICK=1 compute-sanitizer --tool racecheck python scripts/sanitize_2_4.py   (two plans only)
    SANITIZE_CASES=fine,zp ...   (only those groups of cases: dense, fine, bf16, zp; racecheck on
                                  every case takes longer than a device call)
    SANITIZE_PLANS=0,10 ...      (only those plans, by their index in PLANS)
Checks the results against the spec too, so a run that is clean but wrong still fails.
"""

import os
import sys

import torch

import marlin
from marlin import sparse

CASES = [  # (M, K, N, group size): 8/16/32/64-row slices, the three tiles, K split into parts or not
    (1, 1024, 512, 128),  # K split (fp32 partials + the last block's reduction, or in clusters)
    (13, 512, 384, -1),  # 128-column tile, 16-row slice, per-column scales
    (13, 512, 192, 128),  # N % 128 == 64 (a tensor-parallel shard): the 64-column tile, 16-row slice
    (70, 4096, 1024, 128),  # two 64-row slices (the last partial); sm_90a: two 64-row wgmma slices
    (200, 256, 4096, -1),  # many slices, one K part: C written directly
    (24, 1024, 512, 128),  # sm_90a: the 32-row wgmma slice, K split
    (40, 2048, 768, -1),  # sm_90a: the 64-row wgmma slice (3-stage late refill), 3 column tiles
    (130, 1024, 512, 128),  # sm_90a: 128-row wgmma block slices (MARLIN_2_4_WARP_SLICES=2)
    (13, 1024, 512, 128),  # sm_90a: the 16-row wgmma slice (its 3-stage instance: MARLIN_2_4_STAGES=3)
]
# groups of 64 and 32 (a scale row per strip after the ring): the mma.sync and wgmma loops
FINE_CASES = [(1, 1024, 512, 64), (24, 1024, 512, 32), (40, 2048, 768, 64), (130, 1024, 512, 32), (13, 1024, 512, 64)]
# bf16 activations, scales and output: the mma.sync and (sm_90a) the wgmma instances of that type
BF16_CASES = [(1, 1024, 512, 128), (24, 1024, 512, 128), (40, 2048, 768, -1), (40, 1024, 512, 32)]
# zero points (b_zeros, loaded like the scales): the mma.sync loop at M = 1 (K split), and at M = 40
# (sm_90a: the 64-row wgmma slice) in groups of 64, with bf16, and per column (scale rows of 1 and
# the zero-point row permuted into shared memory once before the loop) on both loops
ZP_CASES = [
    (1, 1024, 512, 128, torch.float16),
    (40, 2048, 768, 64, torch.bfloat16),
    (40, 2048, 768, -1, torch.float16),
    (1, 1024, 512, -1, torch.float16),
]
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
    {"MARLIN_2_4_STAGES": "3", "MARLIN_2_4_WGMMA": "1"},  # sm_90a, 9-16 rows: the 3-stage 16-row slice
]
if os.environ.get("SANITIZE_QUICK") == "1":  # racecheck / synccheck are slow: the planner's plan and clusters
    PLANS = PLANS[:1] + PLANS[2:3]
if os.environ.get("SANITIZE_PLANS"):  # e.g. SANITIZE_PLANS=0,10: only these plans (indices into PLANS)
    _picked = os.environ["SANITIZE_PLANS"].split(",")
    if not all(i.strip().isdigit() and int(i) < len(PLANS) for i in _picked):
        raise SystemExit(f"SANITIZE_PLANS: {os.environ['SANITIZE_PLANS']!r}, expected comma-separated indices 0..{len(PLANS) - 1}")
    PLANS = [PLANS[int(i)] for i in _picked]


def main():
    torch.manual_seed(0)
    ok = True
    groups = {
        "dense": [(*c, torch.float16, False) for c in CASES],
        "fine": [(*c, torch.float16, False) for c in FINE_CASES],
        "bf16": [(*c, torch.bfloat16, False) for c in BF16_CASES],
        "zp": [(*c, True) for c in ZP_CASES],
    }
    chosen = os.environ.get("SANITIZE_CASES", ",".join(groups)).split(",")
    unknown = [g for g in chosen if g not in groups]
    if unknown:
        raise SystemExit(f"SANITIZE_CASES: unknown group(s) {unknown}, expected some of {list(groups)}")
    cases = [c for g in chosen for c in groups[g]]
    for m, k, n, g, dtype, zp in cases:
        w = torch.randn(k, n, device="cuda")
        if zp:  # an offset per column, so that the zero points spread over 0..15
            w += 3 * torch.rand(1, n, device="cuda") - 1.5
        packed = sparse.quantize_and_pack_2_4(sparse.prune_2_4(w), g, dtype=dtype, sym=not zp)
        b_q, b_meta, b_s = packed[:3]
        b_z = packed[3] if zp else None
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        ref = a.float() @ sparse.unpack_2_4(b_q, b_meta, b_s, b_z)
        for env in PLANS:
            os.environ.update(env)
            c = marlin.gemm_2_4(a, b_q, b_meta, b_s, b_zeros=b_z)
            for key in env:
                del os.environ[key]
            err = ((c.float() - ref).norm() / ref.norm()).item()
            print(f"M={m} K={k} N={n} g={g} {dtype}{' zp' if zp else ''} {env or 'planned'}: rel err {err:.2e}")
            ok &= err < (2e-3 if dtype == torch.float16 else 8e-3)
    torch.cuda.synchronize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
