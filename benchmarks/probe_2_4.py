"""Development probe: the 2:4 kernel's plans against dense Marlin g128 and FP16 on a few layers.

    python -m benchmarks.probe_2_4 [--out probe.json]
        PROBE_SHAPES=7B_qkv,70B_gateup,14336x4096  PROBE_IDEAL=1  PROBE_MS=1,16,64
        PROBE_PLANS=auto,legacy,p4,p8g,t128,wg,wg_s1   (see plan_env)
        PROBE_GROUP=128 (or 64, 32: the FINE kernels)  PROBE_ZP=1 (zero points; FINE too)
Same method as bench_gemm (weights rotated past L2, CUDA-graph replay, medians), fewer points, and
several plans of gemm_2_4 in one process: csrc/cuda/sparse/gemm_2_4_cuda.cpp reads its tuning
variables on every call. Weights are random (valid 2:4 metadata): the time does not depend on
the values. Used to fit the planner in csrc/cuda/sparse/marlin_24.cu; results go to
benchmarks/NOTES.md.
"""

import argparse
import json
import os
import sys

import torch

import marlin
from benchmarks.timing import graph_median_us as time_us
from benchmarks.gemm_prep import random_meta_2_4
from benchmarks.shapes import ideal_shape, shape_by_name

_NAMES = os.environ.get("PROBE_SHAPES", "7B_qkv,7B_o,70B_gateup,70B_down")
SHAPES = {s: shape_by_name(s) for s in _NAMES.split(",") if s}  # a name or "KxN"
MS = [int(m) for m in os.environ.get("PROBE_MS", "1,8,16,32,64,128").split(",")]
GROUP = int(os.environ.get("PROBE_GROUP", "128"))  # the 2:4 weights' scale group (dense stays g128)
ZP = os.environ.get("PROBE_ZP", "0") == "1"  # the 2:4 weights with zero points
if GROUP not in (32, 64, 128):
    raise SystemExit(f"PROBE_GROUP: {GROUP}, expected 32, 64 or 128")


def plan_env(name: str) -> dict:
    """auto: the planner; legacy: the first kernel's plan; pN: N K parts (clusters by the
    planner's rule); pNg: N parts through global memory; pNc: in clusters wherever they fit;
    t128 / t256: the tile width; s1 / s2 / s4: 32-row warp slices per block (M > 16); st3: the
    3-stage instances (M <= 16); kw1 / kw2: one / two K warpgroups per block (the late-refill
    wgmma); pdl: programmatic dependent launch; mma: the mma.sync kernel where the sparse wgmma
    would run (sm_90a, M > 8); wg: the sparse wgmma, wgl: its late-refill variant (the default),
    wge: its early-refill one, fill8: the fill rule where the three-part rule (1-8 rows, many
    column tiles) would run, wg_<plan> / wgl_<plan> / wge_<plan>: with
    another plan's knobs (e.g. wg_s1: 64-row block slices above 64 rows); a+b: both plans' knobs
    (e.g. mma+p4c: the mma.sync kernel with 4 parts in clusters)."""
    if "+" in name:
        env = {}
        for part in name.split("+"):
            env.update(plan_env(part))
        return env
    if name == "auto":
        return {}
    if name == "mma":
        return {"MARLIN_2_4_WGMMA": "0"}
    if name.startswith("wge"):
        return {**plan_env("wg" + name[3:]), "MARLIN_2_4_WG_LATE": "0"}
    if name.startswith("wgl"):
        return {**plan_env("wg" + name[3:]), "MARLIN_2_4_WG_LATE": "1"}
    if name.startswith("wg"):
        rest = name[2:].lstrip("_")
        return {"MARLIN_2_4_WGMMA": "1", **(plan_env(rest) if rest else {})}
    if name == "legacy":
        return {"MARLIN_2_4_PLAN": "legacy"}
    if name == "pdl":
        return {"MARLIN_2_4_PDL": "1"}
    if name == "st3":
        return {"MARLIN_2_4_STAGES": "3"}
    if name == "fill8":
        return {"MARLIN_2_4_WAVE8": "0"}
    if name.startswith("kw"):
        return {"MARLIN_2_4_KW": name[2:]}
    if name.startswith("s"):
        return {"MARLIN_2_4_WARP_SLICES": name[1:]}
    if name.startswith("t"):
        return {"MARLIN_2_4_TILE_N": name[1:]}
    if name.startswith("p"):
        env = {"MARLIN_2_4_PARTS": name[1:].rstrip("gc")}
        if name[-1] in "gc":
            env["MARLIN_2_4_CLUSTERS"] = "0" if name.endswith("g") else "1"
        return env
    raise ValueError(f"PROBE_PLANS: unknown plan {name!r} (auto, legacy, pdl, t128, t256, s1, s2, s4, st3, fill8, kw1, kw2, pN, pNg, pNc, mma, wg, wgl, wge, wg_<plan>, wgl_<plan>, wge_<plan>, a+b)")


PLANS = os.environ.get("PROBE_PLANS", "auto,legacy").split(",")
_KNOBS = (
    "MARLIN_2_4_PLAN",
    "MARLIN_PDL",
    "MARLIN_2_4_PDL",
    "MARLIN_2_4_TILE_N",
    "MARLIN_2_4_PARTS",
    "MARLIN_2_4_CLUSTERS",
    "MARLIN_2_4_WARP_SLICES",
    "MARLIN_2_4_STAGES",
    "MARLIN_2_4_WGMMA",
    "MARLIN_2_4_WG_LATE",
    "MARLIN_2_4_KW",
    "MARLIN_2_4_WAVE8",
    "MARLIN_LOG_PLAN",
)


def with_env(env: dict, fn):
    """fn() with the variables of `env` set and the other tuning variables unset."""
    saved = {k: os.environ.pop(k) for k in _KNOBS if k in os.environ}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)


def random_meta(rows: int, n: int) -> torch.Tensor:
    """int32 [rows, n] of valid 2:4 metadata: 64 random rows repeated (the int64 intermediates of
    a whole ideal layer would take ~30 GB)."""
    word = random_meta_2_4(32 * min(rows, 64), n, "cuda")
    return word.repeat(-(-rows // word.shape[0]), 1)[:rows].contiguous()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("PROBE_OUT"))
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    if os.environ.get("PROBE_IDEAL", "0") == "1":
        SHAPES["ideal"] = ideal_shape(props.multi_processor_count)
    envs = {p: plan_env(p) for p in PLANS}
    rows = []
    print(f"2:4 weights: group {GROUP}{', zero points' if ZP else ''}; dense: group 128")
    print(f"{props.name}: time in us; ratio = dense g128 / 2:4 (> 1: 2:4 faster)")
    print(f"{'shape':12s} {'M':>4s} {'fp16':>9s} {'dense':>9s} " + " ".join(f"{p:>9s}" for p in PLANS) + "  ratio(auto)")
    for name, (k, n) in SHAPES.items():
        if k % GROUP:
            raise SystemExit(f"PROBE_GROUP: {GROUP} does not divide K = {k} of {name}")
        torch.manual_seed(0)
        sp_bytes = k * n * 3 // 8
        cs = max(1, -(-4 * l2 // sp_bytes))
        sp = [
            (
                torch.randint(-(2**31), 2**31 - 1, (k // 32, 2 * n), dtype=torch.int32, device="cuda"),
                random_meta(k // 32, n),
                (torch.rand(k // GROUP, n, device="cuda") * 0.01 + 0.001).half(),
                None,  # workspace: the op's own zeroed lock slot
                torch.randint(0, 16, (k // GROUP, n), device="cuda").half() if ZP else None,
            )
            for _ in range(cs)
        ]
        cd = max(1, -(-4 * l2 // (k * n // 2)))
        dn = [
            (
                torch.randint(-(2**31), 2**31 - 1, (k // 16, 2 * n), dtype=torch.int32, device="cuda"),
                (torch.rand(k // 128, n, device="cuda") * 0.01 + 0.001).half(),
            )
            for _ in range(cd)
        ]
        ws = marlin.make_workspace()
        for m in MS:
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            c16 = max(1, -(-4 * l2 // (k * n * 2)))
            w16 = [torch.randn(n, k, device="cuda", dtype=torch.float16) for _ in range(c16)]
            st = {"i": 0}

            def rot(lst):
                st["i"] += 1
                return lst[st["i"] % len(lst)]

            row = {"shape": name, "k": k, "n": n, "m": m}
            row["fp16"] = time_us(lambda: torch.matmul(a, rot(w16).t()))
            row["dense_g128"] = time_us(lambda: marlin.gemm(a, *rot(dn), ws))
            for p, env in envs.items():
                try:
                    with_env({**env, "MARLIN_LOG_PLAN": "1"}, lambda: marlin.gemm_2_4(a, *sp[0]))  # the plan, to stderr
                    row[p] = with_env(env, lambda: time_us(lambda: marlin.gemm_2_4(a, *rot(sp))))
                except RuntimeError as e:  # a forced plan the shape cannot take
                    print(f"{name} M={m} {p}: {str(e).splitlines()[0]}", file=sys.stderr)
                    row[p] = float("nan")
            rows.append(row)
            ratio = row["dense_g128"] / row[PLANS[0]]
            print(
                f"{name:12s} {m:4d} {row['fp16']:9.1f} {row['dense_g128']:9.1f} "
                + " ".join(f"{row[p]:9.1f}" for p in PLANS)
                + f"  {ratio:5.2f}x (fp16/2:4 {row['fp16'] / row[PLANS[0]]:4.2f}x)",
                flush=True,
            )
            w16 = None  # free before the next M's copies
        sp = dn = None
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": props.name, "plans": PLANS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
