"""Time marlin.gemm against FP16 torch.matmul and torch's INT4 kernel (tinygemm) on LLM layer shapes.

Run from the repository root:

    python -m benchmarks.bench_gemm              # full sweep: 7B/70B layers + "ideal", M = 1 .. 4096
    python -m benchmarks.bench_gemm --quick      # subset (about a minute)
    python -m benchmarks.bench_gemm --layers     # every layer of benchmarks/shapes.py MODELS at M = 16
    python -m benchmarks.bench_gemm --roofline   # square layers sq4096 .. sq32768, M = 1 .. 4096
    python -m benchmarks.bench_gemm --dry-run    # CPU smoke run of the whole pipeline (no timing claims)

Writes benchmarks/results/<gpu>[-<mode>].json (see benchmarks/README.md for the schema) and prints a
table and the check of the issue's speed targets.  What is timed and why (benchmarks/README.md,
"Method", has the long form):

  * fp16: ``torch.matmul(a, w)`` with ``w = W.t()``, W an [N, K] contiguous fp16 tensor: exactly
    what ``nn.Linear`` (F.linear) computes and the layout a checkpoint stores.
  * fp16_kn: ``torch.matmul(a, W)`` with W [K, N] contiguous.  Every speedup is over the faster of
    fp16 and fp16_kn (bench_math.fp16_time): cuBLAS is faster in one layout or the other by shape.
  * marlin_g128 / marlin_gcol: ``marlin.ops.gemm(a, b_q, b_scales, workspace)`` with group size
    128 / one scale per column; one reusable workspace, so no per-call allocation + memset is timed.
  * marlin_direct: group 128 with ``workspace=None``, as a direct ``torch.ops.marlin.gemm`` call
    makes it (the op then uses its stream's own zeroed lock slot).
  * torch_int4: ``torch.ops.aten._weight_int4pack_mm`` (tinygemm), bf16 activations, group 128.
  * Other weight formats, on request with --kernels (bench_math.FORMAT_KERNELS): marlin_bf16_g128,
    marlin_bf16_gcol (bf16 activations and scales), marlin_zp_g128 (4-bit with zero points),
    marlin_g64, marlin_g32, marlin_u8_g128, marlin_u8_gcol (8-bit weights), and
    marlin_24_bf16_g128 (2:4 sparse, bf16), marlin_24_g64, marlin_24_g32 (2:4 sparse, groups of 64
    and 32), marlin_24_zp_g128 (2:4 sparse with zero points, group 128); compare each with
    marlin_g128 (marlin_24_g128) for the cost of the format.
  * marlin_g128_gauss, on request: group 128 with the codes of a quantized Gaussian matrix instead
    of uniform random words (the other kernels' weights), to check that the speed does not depend
    on the values.
  * Weights rotate through ``copies`` identical-size tensors with copies * bytes >= 4 x L2, so that
    no call finds its weights in L2 (in a model, each layer's weights are read once per token).
  * Calls shorter than 2 ms are captured in a CUDA graph (launch overhead excluded, as in a
    model run under CUDA graphs), longer ones are timed as a plain loop; CUDA events.
  * All kernels of one (shape, M) are timed together, in rounds whose kernel orders come from a
    balanced design (timing.round_orders; by default the whole design), and the median is taken
    over the pooled samples (at least 9).  A GPU's power limiter slows the clock for a while after
    heavy work, so timing one kernel's whole M sweep after another's would charge one kernel for the
    other's power draw.  A point whose samples spread too widely is timed once more
    (--retime-spread; timing.measure_point_steady).
  * Before a marlin kernel is timed on a shape, its output is checked against an fp32
    reference of ``a @ dequant(b_q, b_scales)`` (packing.unpack is the spec); a wrong result aborts
    the run and no results file is written.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import hashlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from . import shapes as S
from .bench_math import ALL_KERNELS, INT4_SANITY_TOL, KERNELS, L2_FACTOR, METHOD, RESULTS_DIR, evaluate_targets, format_table, format_targets
from .provenance import collect_meta, device_facts, dirty_warning
from .timing import _free, balanced_rounds, measure_copy_bandwidth, measure_fp16_peak, measure_point_steady
from .gemm_prep import CorrectnessError, Prepared, prepare


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

DRY_SHAPES = {"tiny_256x256": (256, 256), "tiny_512x384": (512, 384)}


def _parse_list(s: Optional[str], conv=str) -> Optional[list]:
    if s is None:
        return None
    return [conv(x.strip()) for x in s.split(",") if x.strip()]


def resolve_plan(args, sms: int) -> tuple[str, dict[str, tuple[int, int]], list[int], list[str]]:
    """(mode, {shape: (K, N)}, ms, kernels) from the command line."""
    known = dict(S.BENCH_SHAPES)
    known.update(S.MODEL_LAYERS)
    known.update(S.roofline_shapes())
    known.update(DRY_SHAPES)
    if sms:
        known[S.IDEAL] = S.ideal_shape(sms)
    if args.dry_run:
        mode, names, ms, kernels = "dry-run", list(DRY_SHAPES), [1, 16], list(KERNELS)
    elif args.layers:
        mode, names, ms, kernels = "layers", list(S.MODEL_LAYERS), [S.LAYERS_M], list(KERNELS)
    elif args.roofline:
        mode, names, ms, kernels = "roofline", list(S.roofline_shapes()), list(S.DEFAULT_MS), ["fp16", "fp16_kn", "marlin_g128"]
    elif args.quick:
        mode, names, ms, kernels = "quick", list(S.QUICK_SHAPES), list(S.QUICK_MS), list(KERNELS)
    else:
        mode, names, ms, kernels = "full", list(S.DEFAULT_SHAPES), list(S.DEFAULT_MS), list(KERNELS)
    if args.shapes:
        names = _parse_list(args.shapes)
    if args.ms:
        ms = _parse_list(args.ms, int)
    if args.kernels:
        kernels = _parse_list(args.kernels)
    bad = [s for s in names if s not in known]
    if bad:
        raise SystemExit(f"unknown shape(s) {bad}; known: {sorted(known)}")
    badk = [k for k in kernels if k not in ALL_KERNELS]
    if badk:
        raise SystemExit(f"unknown kernel(s) {badk}; known: {list(ALL_KERNELS)}")
    if any(m <= 0 for m in ms):
        raise SystemExit("--ms must be positive")
    if args.retime_spread < 0:
        raise SystemExit(f"--retime-spread must be 0 (never) or more, got {args.retime_spread}")
    if args.rounds < 0:
        raise SystemExit(f"--rounds must be 0 (the whole balanced design) or more, got {args.rounds}")
    # fp16 first: speedups need it, and its time is the reference
    kernels = sorted(dict.fromkeys(kernels), key=ALL_KERNELS.index)
    return mode, {s: known[s] for s in names}, ms, kernels


def default_out(meta: dict, mode: str) -> Path:
    if mode == "dry-run":
        return Path(tempfile.gettempdir()) / "marlin-bench-dry-run.json"
    suffix = "" if mode == "full" else f"-{mode}"
    return RESULTS_DIR / f"{meta['gpu_slug']}{suffix}.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_gemm", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="M in {1,16,64,256}; shapes 7B_o, 70B_o, 70B_gateup, ideal")
    g.add_argument("--layers", action="store_true", help="every layer of the models in benchmarks/shapes.py at M=16")
    g.add_argument("--roofline", action="store_true", help="square layers sq4096..sq32768, fp16 and marlin_g128")
    g.add_argument("--dry-run", action="store_true", help="CPU smoke run on tiny shapes (the CPU reference op)")
    p.add_argument("--shapes", help="comma-separated shape names (overrides the mode's list)")
    p.add_argument("--ms", help="comma-separated batch sizes M")
    p.add_argument("--kernels", help=f"comma-separated subset of {','.join(ALL_KERNELS)}")
    p.add_argument("--out", help="results JSON path (default benchmarks/results/<gpu>[-<mode>].json)")
    p.add_argument("--budget-ms", type=float, default=40.0, help="timed GPU work per point (default 40)")
    p.add_argument(
        "--max-call-ms", type=float, default=500.0,
        help="torch_int4 points whose first call takes longer are skipped (time null, noted in meta)",
    )
    p.add_argument(
        "--rounds", type=int, default=0,
        help="timing rounds per (shape, M); the kernels of one M run back to back, in orders from a balanced "
        "design, and the samples of all rounds are pooled; 0 (default): the whole design, every kernel once in "
        "every position and right after every other kernel (the number of kernels, twice that if it is odd)",
    )
    p.add_argument(
        "--retime-spread", type=float, default=0.5,
        help="where a kernel's pooled samples spread more than this ((max - min) / median), or more than 0.4 of it "
        "and 8x the median of the point's other kernels, time the whole point (every kernel) once more and keep "
        "the run whose widest spread is smaller (default 0.5; 0: never)",
    )
    p.add_argument("--no-graph", action="store_true", help="time plain loops only (no CUDA graphs)")
    p.add_argument("--seed", type=int, default=0)
    add_provenance_args(p)
    return p.parse_args(argv)


def add_provenance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--csrc-tree", help="where this copy has no git: the expected `git rev-parse HEAD:csrc` "
        "(env MARLIN_CSRC_TREE); git_dirty is then whether csrc/ on disk differs from it",
    )
    p.add_argument("--git-rev", help="where this copy has no git: the commit it was taken from (env MARLIN_GIT_REV)")


def pick_device(dry_run: bool) -> torch.device:
    """The CPU for a --dry-run smoke test, else the current CUDA device (exit if there is none)."""
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --dry-run for a CPU smoke test of the pipeline")
    return torch.device("cuda", torch.cuda.current_device())


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    import marlin  # noqa: F401  (registers torch.ops.marlin)

    dev = pick_device(args.dry_run)
    torch.manual_seed(args.seed)

    facts = device_facts(dev)
    mode, shape_map, ms, kernels = resolve_plan(args, facts["sms"])
    meta = collect_meta(dev, mode, expect_rev=args.git_rev, expect_tree=args.csrc_tree)
    out_path = Path(args.out) if args.out else default_out(meta, mode)
    warn = dirty_warning(meta)
    if warn:
        print(warn, file=sys.stderr, flush=True)
    if meta.get("build_older_than_csrc"):
        print("WARNING: marlin/_C*.so is older than csrc/: rebuild before timing", file=sys.stderr)

    l2 = facts["l2_bytes"]
    min_copies = 2 if dev.type != "cuda" else 1  # exercise the rotation in the dry run too
    budget_s = args.budget_ms * 1e-3 if dev.type == "cuda" else 2e-3
    rounds = args.rounds or balanced_rounds(len(kernels))
    # (a CPU dry run's wall-clock samples spread far more than a GPU's: not re-timed)
    retime_spread = args.retime_spread if dev.type == "cuda" else 0.0
    print(f"{meta['gpu']}: {facts['sms']} SMs, L2 {l2 / 2**20:.0f} MiB; mode {mode}; {len(shape_map)} shapes x "
          f"{len(ms)} M x {len(kernels)} kernels -> {out_path}", flush=True)
    copy_bw = measure_copy_bandwidth(dev, nbytes=(2 << 30) if dev.type == "cuda" else (16 << 20))
    peak = measure_fp16_peak(dev, n=8192 if dev.type == "cuda" else 256, samples=10 if dev.type == "cuda" else 3)
    print(f"copy bandwidth {copy_bw:.0f} GB/s (read + write), fp16 matmul {peak:.0f} TFLOP/s", flush=True)
    meta.update(
        {
            "copy_bw_GBps": copy_bw,
            "fp16_tflops": peak,
            "method": METHOD,
            "l2_factor": L2_FACTOR,
            "budget_ms": args.budget_ms,
            "rounds": rounds,
            "retime_spread": retime_spread,
            "max_call_ms": args.max_call_ms,
            "graphs": not args.no_graph,
            "shapes": {s: list(kn) for s, kn in shape_map.items()},
            "ms": ms,
            "kernels": kernels,
        }
    )

    points: list[dict] = []
    checks: list[dict] = []
    notes: list[str] = []
    bar = tqdm(total=len(shape_map) * len(ms) * len(kernels), unit="pt", dynamic_ncols=True)
    try:
        for shape, (k, n) in shape_map.items():
            # every kernel of the shape is prepared first, so that the kernels of one M are timed
            # back to back (same clocks and power state; see measure_point)
            preps: dict[str, Optional[Prepared]] = {}
            for kernel in kernels:
                bar.set_description(f"{shape} prepare {kernel}")
                preps[kernel] = None
                try:
                    preps[kernel] = prepare(kernel, k, n, dev, l2, min_copies)
                except CorrectnessError:
                    raise
                except Exception as e:  # noqa: BLE001 - record and go on
                    msg = f"{shape} {kernel}: preparation failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    notes.append(msg)
                    tqdm.write("NOTE " + msg)
                prep = preps[kernel]
                for c in prep.checks if prep else []:
                    checks.append({"shape": shape, "kernel": kernel, "K": k, "N": n, **c})
                    if kernel == "torch_int4":
                        tqdm.write(f"torch_int4 sanity {shape}: rel err {c['rel_err']:.2e} "
                                   f"({'ok' if c['ok'] else 'ABOVE ' + str(INT4_SANITY_TOL)})")
            shape_points = []
            for m in ms:
                bar.set_description(f"{shape} M={m}")
                shape_points += measure_point_steady(
                    preps, shape, k, n, m, dev, rounds=rounds, budget_s=budget_s,
                    max_call_s=args.max_call_ms * 1e-3, use_graph=not args.no_graph, notes=notes,
                    retime_spread=retime_spread,
                )
                bar.update(len(kernels))
            for prep in preps.values():
                if prep is not None:
                    prep.free()
            preps = {}
            _free(dev)
            # stored shape by shape, kernel by kernel, M ascending (readable diffs of results files)
            shape_points.sort(key=lambda p: (kernels.index(p["kernel"]), ms.index(p["M"])))
            points += shape_points
            tqdm.write(format_table(shape_points, copy_bw))
    except CorrectnessError as e:
        bar.close()
        print("\n" + "X" * 100 + f"\nABORTED: {e}\nNo results file was written.\n" + "X" * 100, file=sys.stderr)
        return 2
    bar.close()

    targets = evaluate_targets(points)
    print(format_targets(targets))
    if notes:
        print("Notes:\n  " + "\n  ".join(notes))
    meta["notes"] = notes
    result = {"meta": meta, "points": points, "checks": checks, "targets": targets}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(dump_results(result))
    print(f"wrote {out_path}")
    if warn:
        print(warn, file=sys.stderr)
    return 0


def dump_results(result: dict) -> str:
    """Strict JSON (NaN -> null); meta indented, each element of a top-level list on one line
    (one point per line: readable diffs when results are committed)."""
    parts = []
    for key, val in _jsonable(result).items():
        if isinstance(val, list):
            body = ",\n".join("  " + json.dumps(v) for v in val)
            parts.append(f" {json.dumps(key)}: [\n{body}\n ]" if val else f" {json.dumps(key)}: []")
        else:
            parts.append(f" {json.dumps(key)}: " + json.dumps(val, indent=2).replace("\n", "\n "))
    return "{\n" + ",\n".join(parts) + "\n}\n"


def _jsonable(x):
    """NaN / inf -> None (strict JSON), recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


if __name__ == "__main__":
    sys.exit(main())
