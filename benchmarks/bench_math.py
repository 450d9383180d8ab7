"""Pure helpers of the gemm benchmark (no GPU): kernel names, byte and flop counts, speedups,
the issue's speed targets and the printed tables.  Unit-tested on CPU (tests/test_benchmarks.py)."""

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


REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"

# marlin_direct right after marlin_g128: the kernels of a point run back to back in this order
# (rotated each round), and the two compared with each other then share the GPU's clock and power
# state (benchmarks/README.md, "Rounds").
KERNELS = ("fp16", "fp16_kn", "marlin_g128", "marlin_direct", "marlin_gcol", "marlin_24_g128", "marlin_24_gcol", "torch_int4")
# FP16 is timed in both weight layouts; every speedup is over the faster of the two (fp16_time)
BASELINES = ("fp16", "fp16_kn")
QUANT_KERNELS = ("marlin_g128", "marlin_gcol", "marlin_direct", "marlin_24_g128", "marlin_24_gcol", "torch_int4")
# marlin_direct: group 128 called with workspace=None (the op's own per-stream lock slots)
MARLIN_GROUP = {"marlin_g128": 128, "marlin_gcol": -1, "marlin_direct": 128}
# 2:4-sparse weights (marlin.ops.gemm_2_4, marlin/sparse.py): group size along the original K;
# MARLIN_24_ON_REQUEST (bf16 activations and scales, groups of 64 and 32, zero points) with the
# other formats
MARLIN_24_GROUP = {"marlin_24_g128": 128, "marlin_24_gcol": -1, "marlin_24_bf16_g128": 128, "marlin_24_g64": 64,
                   "marlin_24_g32": 32, "marlin_24_zp_g128": 128}
MARLIN_24_DTYPE = {"marlin_24_bf16_g128": torch.bfloat16}  # the others: float16
MARLIN_24_ZEROS = ("marlin_24_zp_g128",)  # with b_zeros (random integer zero points 0..15)
MARLIN_24_ON_REQUEST = ("marlin_24_bf16_g128", "marlin_24_g64", "marlin_24_g32", "marlin_24_zp_g128")
INT4_GROUP = 128  # torch_int4's group size
# The other weight formats (issue 22), timed on request (--kernels): name -> (activation dtype,
# bits, zero points, group size). Speedups are over FP16 as for marlin_g128; compare them with
# marlin_g128 for the cost of each format (bf16, zero points, smaller groups, 8-bit weights).
FORMAT_KERNELS = {
    "marlin_bf16_g128": (torch.bfloat16, 4, False, 128),
    "marlin_bf16_gcol": (torch.bfloat16, 4, False, -1),
    "marlin_zp_g128": (torch.float16, 4, True, 128),
    "marlin_g64": (torch.float16, 4, False, 64),
    "marlin_g32": (torch.float16, 4, False, 32),
    "marlin_u8_g128": (torch.float16, 8, False, 128),
    "marlin_u8_gcol": (torch.float16, 8, False, -1),
}
# fp16 group 128 with the codes of a quantized Gaussian matrix (mostly near the middle of the
# range) instead of uniform random words, packed on the device: checks that the kernel's speed does
# not depend on the weight values, which the other kernels' random words assume (on request).
VALUE_KERNELS = {"marlin_g128_gauss": 128}
ALL_KERNELS = KERNELS + tuple(FORMAT_KERNELS) + MARLIN_24_ON_REQUEST + tuple(VALUE_KERNELS)
FORMAT_CHECK_TOL = 8e-3  # bf16 rounds each dequantized weight to 8 bits (2^-9 relative, as bf16 matmul)

L2_FACTOR = 4  # weights rotate through at least this many times the L2 size
CHECK_TOL = 2e-3  # marlin: normwise relative error vs the fp32 reference (fatal above)
CHECK_MS = (1, 16, 67)  # batch sizes of the correctness check (67: a partial 16-row block)
CHECK_MAX_ELEMS = 1 << 26  # weights dequantized for the check, per shape (sampled 64-column tiles)
INT4_SANITY_TOL = 5e-2  # torch_int4: relative error vs bf16 matmul of its own dequantized weights
GRAPH_BELOW_S = 2e-3  # calls shorter than this are timed inside a CUDA graph
MAX_GRAPH_CALLS = 2000

METHOD = (
    "per-call time = median over the samples of all rounds (at least 9 in all, up to 10 per round) of "
    "(CUDA-event time of a sample / calls in it); per (shape, M) the kernels run back to back in rounds "
    "(budget split between them), the orders one full balanced (Williams) design: every kernel in "
    "every position and right after every other kernel equally often; a point whose samples spread "
    "more than meta.retime_spread ((max - min) / median), or one kernel more than 0.4 of it and 8x the "
    "median of the others, timed once more, the run with the smaller widest spread kept whole; "
    "calls < 2 ms captured in a CUDA graph and replayed, longer calls timed as a plain loop; "
    "the samples of every kernel add up to about the same timed work (fewer samples where walking "
    "all weight copies takes more calls per sample), so that none runs a longer burst; "
    "weights rotate through copies with copies*bytes >= 4*L2; one warm-up call plus one estimate "
    "call first; fp16 = torch.matmul(a, W.t()) with W [N,K] contiguous (nn.Linear layout); marlin "
    "with a reused workspace; torch_int4 = aten._weight_int4pack_mm, bf16 activations, group 128, "
    "innerKTiles 8; activations fp16 randn [M,K] (stay in L2 across calls, as in a model); weights "
    "random (uniform int4 codes, scales in [0.001, 0.01])"
)



# ---------------------------------------------------------------------------------------------
# Pure helpers (no GPU): names, byte counts, speedups, targets, tables.  Unit-tested on CPU.
# ---------------------------------------------------------------------------------------------


def sanitize_gpu_name(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3': lower case, vendor prefix dropped, runs of
    anything but letters and digits turned into one '-'."""
    s = name.strip().lower()
    s = re.sub(r"^nvidia[\s_-]+", "", s)
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
    return s or "unknown-gpu"


def scale_rows(kernel: str, k: int) -> int:
    if kernel in ("marlin_gcol", "marlin_24_gcol"):
        return 1
    if kernel in MARLIN_24_GROUP:
        return k // MARLIN_24_GROUP[kernel]
    if kernel in ("marlin_g128", "marlin_direct", "marlin_g128_gauss", "torch_int4"):
        return k // 128
    return 0


def weight_bytes(kernel: str, k: int, n: int) -> int:
    """Bytes of one copy of a kernel's weight operand(s) for B [K, N]."""
    if kernel in FORMAT_KERNELS:
        _, bits, zeros, group = FORMAT_KERNELS[kernel]
        groups = 1 if group == -1 else k // group
        return k * n * bits // 8 + 2 * n * groups * (2 if zeros else 1)  # codes + scales (+ zero points)
    if kernel in BASELINES:
        return 2 * k * n
    if kernel in MARLIN_GROUP or kernel in VALUE_KERNELS:
        return k * n // 2 + 2 * n * scale_rows(kernel, k)  # int4 codes + fp16 scales
    if kernel in MARLIN_24_GROUP:
        # kept int4 values (K/2 per column) + 2-bit positions + fp16 scales (+ zero points, one
        # row per scale row): 3 bits per weight
        zero_rows = scale_rows(kernel, k) if kernel in MARLIN_24_ZEROS else 0
        return k * n // 4 + k * n // 8 + 2 * n * (scale_rows(kernel, k) + zero_rows)
    if kernel == "torch_int4":
        return k * n // 2 + 4 * n * scale_rows(kernel, k)  # int4 codes + bf16 (scale, zero) pairs
    raise ValueError(f"unknown kernel {kernel!r}")


def io_bytes(k: int, n: int, m: int) -> int:
    """Activation A [M, K] read plus output C [M, N] written, 2 bytes each (fp16 / bf16)."""
    return 2 * m * k + 2 * m * n


def kernel_bytes(kernel: str, k: int, n: int, m: int) -> int:
    """The minimum bytes a kernel must move: its weights once, A once, C once."""
    return weight_bytes(kernel, k, n) + io_bytes(k, n, m)


def gemm_flops(k: int, n: int, m: int) -> int:
    return 2 * m * k * n


def gbps(nbytes: float, time_us: float) -> float:
    """Effective bandwidth in GB/s (1e9 bytes per second)."""
    if not _finite(time_us) or time_us <= 0:
        return float("nan")
    return nbytes / (time_us * 1e3)


def tflops(flops: float, time_us: float) -> float:
    if not _finite(time_us) or time_us <= 0:
        return float("nan")
    return flops / (time_us * 1e6)


def ideal_speedup(kernel: str, k: int, n: int) -> float:
    """Memory-bound speedup limit over fp16: bytes of fp16 weights / bytes of the kernel's weights
    (16 / (4 + 16/128) = 3.88 for group 128)."""
    return weight_bytes("fp16", k, n) / weight_bytes(kernel, k, n)


def roofline_us(kernel: str, k: int, n: int, m: int, copy_bw_gbps: float, fp16_tflops: float) -> float:
    """The physical bound of one call, us: max(bytes moved / measured copy bandwidth, 2MKN / measured
    FP16 tensor rate); bytes = the kernel's weights + A + C (kernel_bytes)."""
    if not (_finite(copy_bw_gbps) and _finite(fp16_tflops)) or copy_bw_gbps <= 0 or fp16_tflops <= 0:
        return float("nan")
    t_mem = kernel_bytes(kernel, k, n, m) / (copy_bw_gbps * 1e3)
    t_math = gemm_flops(k, n, m) / (fp16_tflops * 1e6)
    return max(t_mem, t_math)


def roofline_fraction(kernel: str, k: int, n: int, m: int, time_us: float, copy_bw_gbps: float,
                      fp16_tflops: float) -> float:
    """roofline_us / measured time: 1.0 = at the bound."""
    if not _finite(time_us) or time_us <= 0:
        return float("nan")
    return roofline_us(kernel, k, n, m, copy_bw_gbps, fp16_tflops) / time_us


def copies_needed(nbytes: int, l2_bytes: int, factor: int = L2_FACTOR, minimum: int = 1) -> int:
    """Copies of a weight tensor of nbytes so that copies * nbytes >= factor * L2 (at least 1)."""
    if nbytes <= 0:
        raise ValueError("nbytes must be positive")
    return max(minimum, 1, math.ceil(factor * max(0, l2_bytes) / nbytes))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def canonical_shape(name: str) -> str:
    """Model-layer names that alias a benchmark shape ('Llama-2-70B/o') -> the short name ('70B_o')."""
    return S.CANONICAL.get(name, name)


def time_index(points: Iterable[dict]) -> dict[tuple[str, int, str], float]:
    """{(canonical shape, M, kernel): time_us}, None/NaN as NaN."""
    out = {}
    for p in points:
        t = p.get("time_us")
        out[(canonical_shape(p["shape"]), int(p["M"]), p["kernel"])] = float(t) if _finite(t) else float("nan")
    return out


def fp16_time(idx: dict, shape: str, m: int) -> float:
    """The FP16 baseline of one point: the faster of F.linear (fp16) and a @ W[K, N] (fp16_kn),
    whichever of them were measured; NaN if neither was."""
    times = [idx.get((shape, m, b), float("nan")) for b in BASELINES]
    times = [t for t in times if _finite(t) and t > 0]
    return min(times) if times else float("nan")


def speedups(points: Iterable[dict], kernel: str = "marlin_g128") -> dict[tuple[str, int], float]:
    """{(canonical shape, M): FP16 baseline time (fp16_time) / kernel time} where both were measured."""
    idx = time_index(points)
    out = {}
    for (shape, m, kern), t in idx.items():
        if kern != kernel:
            continue
        t16 = fp16_time(idx, shape, m)
        if _finite(t) and _finite(t16) and t > 0:
            out[(shape, m)] = t16 / t
    return out


@dataclass(frozen=True)
class Target:
    """One speed target of the issue: a statistic of marlin_g128's speedup over fp16."""

    label: str
    shapes: tuple[str, ...]
    ms: tuple[int, ...]  # the batch sizes; empty: every M >= min_m
    stat: str  # "median" or "min" (every point)
    threshold: float
    min_m: int = 0

    def selects(self, shape: str, m: int) -> bool:
        return shape in self.shapes and (m in self.ms if self.ms else m >= self.min_m)


_SMALL_M = (1, 2, 4, 8, 16)
# Where the issue says only ">= x" for a batch size (M = 32, 64, 128), the median over the large
# layers is checked; the "min" value is printed beside it.  Change `stat` here to tighten.
TARGETS: tuple[Target, ...] = (
    Target("large layers (70B + ideal), M=1..16: median", S.LARGE_SHAPES, _SMALL_M, "median", 3.3),
    Target("large layers (70B + ideal), M=1..16: every point", S.LARGE_SHAPES, _SMALL_M, "min", 3.0),
    Target("7B layers, M=1..16: median", S.SMALL_SHAPES, _SMALL_M, "median", 2.5),
    Target("7B_o, M=1..16: every point", ("7B_o",), _SMALL_M, "min", 2.0),
    Target("large layers, M=32: median", S.LARGE_SHAPES, (32,), "median", 3.0),
    Target("large layers, M=64: median", S.LARGE_SHAPES, (64,), "median", 2.2),
    Target("large layers, M=128: median", S.LARGE_SHAPES, (128,), "median", 1.4),
    Target("all 7B/70B/ideal layers, M>=256: every point", S.DEFAULT_SHAPES, (), "min", 0.6, min_m=256),
    # the prefill issue: within 10% of FP16 from 256 rows (group 128; per column in its text too)
    Target("all 7B/70B/ideal layers, M>=256: every point within 10% of FP16", S.DEFAULT_SHAPES, (), "min", 0.9,
           min_m=256),
)


def evaluate_targets(points: Iterable[dict], kernel: str = "marlin_g128", targets=TARGETS) -> list[dict]:
    """Each target with the measured value; passed None where the points hold no data for it."""
    sp = speedups(list(points), kernel)
    results = []
    for t in targets:
        sel = {key: v for key, v in sp.items() if t.selects(*key)}
        expected = len(t.shapes) * len(t.ms) if t.ms else None
        r = {
            "target": t.label,
            "kernel": kernel,
            "stat": t.stat,
            "threshold": t.threshold,
            "n": len(sel),
            "expected": expected,
            "value": None,
            "median": None,
            "min": None,
            "worst": None,
            "passed": None,
        }
        if sel:
            vals = list(sel.values())
            worst_key = min(sel, key=sel.get)
            r["median"] = statistics.median(vals)
            r["min"] = sel[worst_key]
            r["worst"] = {"shape": worst_key[0], "M": worst_key[1]}
            r["value"] = r["median"] if t.stat == "median" else r["min"]
            r["passed"] = bool(r["value"] >= t.threshold)
        results.append(r)
    return results


def format_targets(results: list[dict]) -> str:
    lines = ["Targets (marlin_g128 speedup over fp16):"]
    for r in results:
        if r["passed"] is None:
            lines.append(f"  N/A   {r['target']} >= {r['threshold']:.1f}x: no data in this run")
            continue
        verdict = "PASS" if r["passed"] else "FAIL"
        count = f"{r['n']}/{r['expected']}" if r["expected"] else f"{r['n']}"
        worst = r["worst"]
        extra = f"median {r['median']:.2f}x, min {r['min']:.2f}x at {worst['shape']} M={worst['M']}"
        lines.append(
            f"  {verdict}  {r['target']} >= {r['threshold']:.1f}x: {r['stat']} = {r['value']:.2f}x "
            f"({count} points; {extra})"
        )
    return "\n".join(lines)


def _fmt(x: float, spec: str, width: int) -> str:
    return format(x, spec).rjust(width) if _finite(x) else "-".rjust(width)


def format_table(points: list[dict], copy_bw_gbps: Optional[float] = None) -> str:
    """Per shape and M: FP16 time (the faster layout), and for each quantized kernel: time, speedup, GB/s, % of copy BW."""
    if not points:
        return "(no points)"
    idx = time_index(points)
    shapes_kn: dict[str, tuple[int, int]] = {}
    for p in points:
        shapes_kn.setdefault(canonical_shape(p["shape"]), (int(p["K"]), int(p["N"])))
    kernels_present = [k for k in ALL_KERNELS if any(p["kernel"] == k for p in points)]
    quant = [k for k in kernels_present if k not in BASELINES]
    short = {"marlin_g128": "g128", "marlin_gcol": "gcol", "marlin_direct": "direct", "marlin_24_g128": "24g128",
             "marlin_24_gcol": "24gcol", "torch_int4": "int4"}
    short.update({k: k[len("marlin_"):] for k in (*FORMAT_KERNELS, *MARLIN_24_ON_REQUEST, *VALUE_KERNELS)})
    head = f"{'M':>6} | {'fp16 us':>9}"
    for k in quant:
        head += f" | {short[k] + ' us':>9} {'x':>5} {'GB/s':>6} {'%BW':>4}"
    lines = []
    for shape, (k_, n_) in shapes_kn.items():
        lines.append(f"{shape}  (K={k_}, N={n_})")
        lines.append(head)
        ms = sorted({m for (s, m, _) in idx if s == shape})
        for m in ms:
            t16 = fp16_time(idx, shape, m)
            row = f"{m:>6} | {_fmt(t16, '.1f', 9)}"
            for k in quant:
                t = idx.get((shape, m, k), float("nan"))
                bw = gbps(kernel_bytes(k, k_, n_, m), t)
                pct = 100 * bw / copy_bw_gbps if copy_bw_gbps else float("nan")
                sp = t16 / t if _finite(t) and _finite(t16) and t > 0 else float("nan")
                row += f" | {_fmt(t, '.1f', 9)} {_fmt(sp, '.2f', 5)} {_fmt(bw, '.0f', 6)} {_fmt(pct, '.0f', 4)}"
            lines.append(row)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
