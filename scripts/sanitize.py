"""A small-batch and a large-batch gemm for compute-sanitizer (memcheck, racecheck, ...).

    compute-sanitizer --tool memcheck python scripts/sanitize.py [--formats | --prefill | --prefill-split | --prefill-streamk | --prefill-24 | --narrow] [--small] [--rows128]
Checks the results too, so a run that is clean but wrong still fails. --formats runs only the
instances of the other weight formats (bf16, zero points, groups 32/64, 8-bit, partial N tiles);
--prefill only the prefill kernel (H100/H200, sm_90a build), one case per instance (--prefill-split:
the same with K in three parts, MARLIN_PREFILL_SPLIT=3; --prefill-streamk: every tile's stages as
one stream-K range, MARLIN_PREFILL_SPLIT=-1; the 2:4 cases on both tile heights, 256 and
128 rows; --prefill-24 with either, or alone: only
its 2:4 cases; --small with any of them: only the cases of at most 2^20 outputs, short enough for
racecheck; --rows128 with any of them: every case on the 128-row tiles, MARLIN_PREFILL_ROWS=128);
--narrow only
the wgmma variant's 128-column tile (H100/H200).
"""

import os
import sys

import torch

import marlin
from marlin import packing

CASES = [  # (M, K, N, group size, forced tile): both kernels, split columns, several M slices
    (7, 1024, 640, 128, None),  # tiled kernel (N not a multiple of 256), split columns
    (200, 512, 768, -1, None),  # tiled kernel, four 64-row slices
    (5, 2048, 1536, 128, None),  # small-batch kernel (M <= 8), split columns
    (40, 1152, 2048, -1, (128, 512)),  # small-batch kernel, two 32-row slices, 512-column tile
    # on H100/H200 (sm_90a build) the wgmma variant: 16 rows with group sums and split columns;
    # 70 rows as one 128-row slice with group-scaled weights, and (512-column tile) as a 64-row
    # and a 6-row slice; 200 rows as a 128-row and a 72-row slice, per-column scales, columns
    # split in equal parts
    (13, 2048, 1536, 128, (128, 512)),
    (70, 1152, 1536, 128, None),
    (70, 1152, 2048, 128, (128, 512)),
    (200, 1152, 1536, -1, None),
    # 128-row slices (MARLIN_WG_SLICE=128 below) whose planned parts have no room as clusters on
    # 132 SMs, so plan_split takes fewer parts per column in clusters: 32 columns x 3 parts (4
    # planned), 20 columns x 5 parts (6 planned)
    (130, 4096, 4096, 128, None),
    (128, 4096, 5120, 128, None),
    # columns split in equal parts (16 columns x 8 parts): reduced through global memory by the
    # small-batch kernel at 3 rows; a 32-row slice (wgmma on H100/H200) with per-column scales
    # takes 6 parts per column in clusters instead
    (3, 4096, 4096, 128, None),
    (20, 8192, 4096, -1, (128, 256)),
    # on H100/H200: 48 columns x 2 parts in thread-block clusters, reduced through distributed
    # shared memory; at 1 row (mma.sync) and at 16 rows (wgmma, per-column scales)
    (1, 4096, 12288, 128, None),
    (16, 4096, 12288, -1, None),
    # the 8-row instances built for one block per SM (layers of >= 8 stages per SM): per column,
    # 32 columns x 4 parts reduced through global memory on 132 SMs
    (2, 8192, 8192, -1, None),
    # on H100/H200: 16 rows (wgmma) of 7B down, 16 columns x 8 parts reduced through global memory
    # (at 16 rows the planner keeps the planned parts where they do not fit as clusters)
    (16, 11008, 4096, 128, None),
]

# --narrow (H100/H200, MARLIN_WG_TILE_N=128): the wgmma variant's 128-column tile (fp16 group 128)
# at 16 rows (scaled weights; two blocks per SM, the planner's 16-row rule), in 32- and 64-row
# slices, and in 128-row slices (MARLIN_WG_SLICE=128 below; three stages) with a partial second
# slice; split columns in clusters (4096 x 4096) and through global memory (16 rows of 7B down;
# 4096 x 12288 in stream-K stripes)
NARROW_CASES = [
    (16, 11008, 4096, 128, None),
    (40, 4096, 4096, 128, None),
    (64, 2048, 4096, 128, None),
    (200, 4096, 12288, 128, None),
]


# (M, K, N, (dtype, bits, symmetric, group size), forced tile): one new instance of each kernel per
# format family, and the tiled kernel's partial last tile of N (its redirected copies must stay in
# bounds)
FORMAT_CASES = [
    (5, 1024, 1536, (torch.bfloat16, 4, False, 32), None),  # small-batch, bf16 zero points, 4 scale rows per stage
    # fp16 zero points in groups of 128 at <= 8 rows: the raw group-sum instance, columns split in
    # equal parts (16 columns x 8 parts), and with a partial last tile (N = 1600)
    (3, 4096, 4096, (torch.float16, 4, False, 128), None),
    (8, 1024, 1600, (torch.float16, 4, False, 128), None),
    # the bf16 group-sum instances (symmetric, zero points) alike; 4096 x 12288 (1536 stages) on
    # the one built for one block per SM
    (2, 4096, 12288, (torch.bfloat16, 4, True, 128), None),
    (7, 1024, 1600, (torch.bfloat16, 4, False, 128), None),
    # groups of 64 / 32 on run-time group sums (one-block instances only): fp16 groups of 64, bf16
    # zero points in groups of 32 with a partial last tile (N = 12352)
    (3, 4096, 12288, (torch.float16, 4, True, 64), None),
    (6, 4096, 12352, (torch.bfloat16, 4, False, 32), None),
    (13, 1152, 1536, (torch.float16, 8, True, 64), (128, 256)),  # small-batch, 16-row slice, 8-bit (wgmma on H100/H200)
    # on H100/H200 the wgmma variant: bf16 zero points in 64-row slices with 4 scale rows per stage;
    # 8-bit bf16 in one 128-row slice (MARLIN_WG_SLICE=128 below; three stages), columns split
    (40, 2048, 1536, (torch.bfloat16, 4, False, 32), (128, 256)),
    (100, 4096, 1536, (torch.bfloat16, 8, True, 128), None),
    # the small-batch kernel's partial last tile (N = 1600: 6 tiles of 256 and one of 64 columns),
    # mma.sync at 5 rows; wgmma (H100/H200; the tiled kernel elsewhere) at 24 rows with zero points
    # (N = 4160: 16 tiles and one of 64 columns)
    (5, 1024, 1600, (torch.bfloat16, 4, True, 64), None),
    (24, 8192, 4160, (torch.float16, 4, False, 32), None),
    (7, 1024, 640, (torch.float16, 4, False, -1), None),  # tiled, per-column zero points
    (40, 576, 192, (torch.bfloat16, 4, False, 64), None),  # tiled 64 x 256, one chunk of four valid
    # the wgmma instances with the group size fixed at 128 (H100/H200): fp16 zero points at 24 rows
    # (32-row slice) with a partial last tile, bf16 zero points in one 128-row slice, bf16 at 60 rows
    (24, 8192, 4160, (torch.float16, 4, False, 128), None),
    (100, 2048, 1536, (torch.bfloat16, 4, False, 128), (128, 256)),
    (60, 2048, 1536, (torch.bfloat16, 4, True, 128), (128, 256)),
    # the 128-column wgmma tile of those formats (default plan on 4096 x 4096): fp16 zero points in
    # a 64-row slice, bf16 at 24 rows with a partial last tile (N = 4160)
    (40, 4096, 4096, (torch.float16, 4, False, 128), None),
    (24, 4096, 4160, (torch.bfloat16, 4, True, 128), None),
    # ... and its 16-row slice with two blocks per SM (layers of at most 24 tiles of 256 columns):
    # bf16 zero points on 7B down (16 columns x 8 parts through global memory), bf16 at 12 rows
    # with a partial last tile, fp16 zero points on 4096 x 6144
    (16, 11008, 4096, (torch.bfloat16, 4, False, 128), None),
    (12, 8192, 4160, (torch.bfloat16, 4, True, 128), None),
    (16, 4096, 6144, (torch.float16, 4, False, 128), None),
    (100, 320, 1344, (torch.float16, 4, True, -1), None),  # tiled, fp16 per column, partial last tile
    (70, 1024, 1600, (torch.bfloat16, 8, True, 128), None),  # tiled, bf16 8-bit, partial last tile
]


# (M, K, N, format): the prefill kernel's instances (MARLIN_PREFILL=1 sends every call it can run
# there): fp16 group 128 with a partial last row tile, fp16 per column (K = 3 stages), bf16 zero
# points in groups of 32 (two group rows per stage), fp16 zero points in groups of 64, bf16 per
# column, 8-bit bf16 group 128 and fp16 per column; more stages than the ring in all but two; and
# more tiles than an H100 or H200 has SMs (fp16 per column, 2100 x 192 x 2048: 144 tiles), so that
# blocks take a second tile; and two cases of the default K split
PREFILL_CASES = [
    (300, 1024, 256, (torch.float16, 4, True, 128)),
    (257, 192, 384, (torch.float16, 4, True, -1)),
    (257, 512, 256, (torch.bfloat16, 4, False, 32)),
    (100, 512, 384, (torch.float16, 4, False, 64)),
    (70, 640, 128, (torch.bfloat16, 4, True, -1)),
    (300, 512, 256, (torch.bfloat16, 8, True, 128)),  # 8-bit: two boxes per stage, a 4-stage ring
    (257, 192, 384, (torch.float16, 8, True, -1)),
    (2100, 192, 2048, (torch.float16, 4, True, -1)),
    # the default K split of the last round's tiles (prefill_split): every tile of 4 in 2 parts;
    # 133 tiles on 132 SMs, the last one in 2 parts
    (257, 2048, 256, (torch.float16, 4, True, 128)),
    (1793, 2048, 2432, (torch.bfloat16, 4, True, 128)),
]


def run_format_case(m, k, n, fmt, tile):
    dtype, bits, sym, g = fmt
    w = torch.randn(k, n, device="cuda")
    if sym:
        q, s = packing.quantize(w, g, bits=bits, sym=True, dtype=dtype)
        z = None
        b_q, b_s = packing.pack(q, s, bits=bits)
        b_z = None
    else:
        q, s, z = packing.quantize(w, g, bits=bits, sym=False, dtype=dtype)
        b_q, b_s, b_z = packing.pack(q, s, z, bits=bits)
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    ws = marlin.make_workspace()
    c = marlin.gemm(a, b_q, b_s, ws, b_zeros=b_z, bits=bits, tile_k=tile and tile[0], tile_n=tile and tile[1])
    ref = a.double() @ packing.dequantize(q, s, z).double()
    err = ((c.double() - ref).norm() / ref.norm()).item()
    left = int(ws.abs().sum())
    tol = 8e-3 if dtype == torch.bfloat16 else 2e-3  # bf16 rounds each weight to 8 significant bits
    print(f"M={m} K={k} N={n} {dtype} bits={bits} sym={sym} group={g}: rel err {err:.2e}, workspace left {left}")
    return err < tol and left == 0


# (M, K, N, dtype, group, zero points): the prefill kernel's 2:4 instances (--prefill too): fp16
# group 128 with a partial last row tile and more tiles than SMs (2100 x 1152 x 2048: 144 tiles),
# bf16 per column, fp16 zero points in groups of 32 (two group rows per stage); a split one
PREFILL_24_CASES = [
    (2100, 1152, 2048, torch.float16, 128, False),
    (257, 2048, 256, torch.float16, 128, False),  # the default K split: 4 tiles in 2 parts
    (257, 256, 384, torch.bfloat16, -1, False),
    (300, 512, 256, torch.float16, 32, True),
]


# the same on the 128-row tiles (MARLIN_PREFILL_ROWS=128): a partial tile after a whole one with
# zero points in groups of 64; 2 x 2 tiles of a 2048-deep layer, the default split in 2 parts
PREFILL_24_ROWS128_CASES = [
    (200, 1152, 384, torch.float16, 64, True),
    (129, 2048, 256, torch.bfloat16, 128, False),
]


def run_2_4_case(m, k, n, dtype, g, zp):
    from marlin import sparse

    w = sparse.prune_2_4(torch.randn(k, n, device="cuda") + (0.5 if zp else 0.0))
    b_q, b_meta, b_s, *b_z = sparse.quantize_and_pack_2_4(w, g, dtype=dtype, sym=not zp)
    b_z = b_z[0] if b_z else None
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    c = marlin.gemm_2_4(a, b_q, b_meta, b_s, b_zeros=b_z)
    ref = a.double() @ sparse.unpack_2_4(b_q, b_meta, b_s, b_z).double()
    err = ((c.double() - ref).norm() / ref.norm()).item()
    tol = 8e-3 if dtype == torch.bfloat16 else 2e-3
    print(f"2:4 M={m} K={k} N={n} {dtype} group={g} zero points={zp}: rel err {err:.2e}")
    return err < tol


def main():
    os.environ.setdefault("MARLIN_LOG_PLAN", "1")  # each call's plan (partition) goes to the log
    # above 64 rows the planner picks 64-row slices on layers this small; 128-row ones are checked here
    os.environ.setdefault("MARLIN_WG_SLICE", "128")
    # the default cases keep the 256-column tile their comments describe; --narrow takes the 128-column
    # one; --formats leaves the tile to the planner (its cases name the plans they get)
    if "--formats" not in sys.argv[1:]:
        os.environ.setdefault("MARLIN_WG_TILE_N", "128" if "--narrow" in sys.argv[1:] else "256")
    torch.manual_seed(0)
    ok = True
    if any(f in sys.argv[1:] for f in ("--prefill", "--prefill-split", "--prefill-streamk", "--prefill-24")):
        os.environ["MARLIN_PREFILL"] = "1"  # read at the first call
        rows128 = "--rows128" in sys.argv[1:]
        if rows128:  # every prefill case on the 128-row tiles (gemm reads it at its first call)
            os.environ["MARLIN_PREFILL_ROWS"] = "128"
        if "--prefill-split" in sys.argv[1:]:
            os.environ["MARLIN_PREFILL_SPLIT"] = "3"  # K in three parts, partials and lock counters
        if "--prefill-streamk" in sys.argv[1:]:
            os.environ["MARLIN_PREFILL_SPLIT"] = "-1"  # stream-K: cut tiles, their partials and locks
        # --small: only the cases of at most 2^20 outputs (racecheck serialises the persistent
        # blocks' shared-memory traffic: a 2100 x 2048 case in parts runs for minutes)
        small = "--small" in sys.argv[1:]
        if "--prefill-24" not in sys.argv[1:]:  # --prefill-24: only the 2:4 cases
            for m, k, n, fmt in PREFILL_CASES:
                if not (small and m * n > 1 << 20):
                    ok &= run_format_case(m, k, n, fmt, None)
        for case in PREFILL_24_CASES:
            if not (small and case[0] * case[2] > 1 << 20):
                ok &= run_2_4_case(*case)
        os.environ["MARLIN_PREFILL_ROWS"] = "128"  # the 128-row tiles (read per call by the 2:4 op)
        for case in PREFILL_24_ROWS128_CASES:
            ok &= run_2_4_case(*case)
        if not rows128:
            del os.environ["MARLIN_PREFILL_ROWS"]
        torch.cuda.synchronize()
        return 0 if ok else 1
    if "--formats" in sys.argv[1:]:
        for case in FORMAT_CASES:
            ok &= run_format_case(*case)
        torch.cuda.synchronize()
        return 0 if ok else 1
    for m, k, n, g, tile in NARROW_CASES if "--narrow" in sys.argv[1:] else CASES:
        q, s = packing.quantize(torch.randn(k, n, device="cuda"), g)
        b_q, b_s = packing.pack(q, s)
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        ws = marlin.make_workspace()
        c = marlin.gemm(a, b_q, b_s, ws, tile_k=tile and tile[0], tile_n=tile and tile[1])
        ref = a.float() @ packing.dequantize(q, s)
        err = ((c.float() - ref).norm() / ref.norm()).item()
        left = int(ws.abs().sum())
        print(f"M={m} K={k} N={n} group={g}: rel err {err:.2e}, workspace left {left}")
        ok &= err < 2e-3 and left == 0
    torch.cuda.synchronize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
