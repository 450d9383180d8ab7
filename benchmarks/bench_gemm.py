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
  * marlin_g128 / marlin_gcol: ``marlin.ops.gemm(a, b_q, b_scales, workspace)`` with group size
    128 / one scale per column; one reusable workspace, so no per-call allocation + memset is timed.
  * torch_int4: ``torch.ops.aten._weight_int4pack_mm`` (tinygemm), bf16 activations, group 128.
  * Weights rotate through ``copies`` identical-size tensors with copies * bytes >= 4 x L2, so that
    no call finds its weights in L2 (in a model, each layer's weights are read once per token).
  * Calls shorter than 2 ms are captured in a CUDA graph (launch overhead excluded, as in a
    model run under CUDA graphs), longer ones are timed as a plain loop; CUDA events.
  * All kernels of one (shape, M) are timed together, in rounds (default 3) whose kernel order
    rotates, and the median is taken over the pooled samples (3 to 10 per round).  A GPU's power
    limiter slows the clock for a while after heavy work, so timing one kernel's whole M sweep
    after another's would charge one kernel for the other's power draw.
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

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"

KERNELS = ("fp16", "marlin_g128", "marlin_gcol", "torch_int4")
QUANT_KERNELS = ("marlin_g128", "marlin_gcol", "torch_int4")
MARLIN_GROUP = {"marlin_g128": 128, "marlin_gcol": -1}
INT4_GROUP = 128  # torch_int4's group size

L2_FACTOR = 4  # weights rotate through at least this many times the L2 size
CHECK_TOL = 2e-3  # marlin: normwise relative error vs the fp32 reference (fatal above)
CHECK_MS = (1, 16, 67)  # batch sizes of the correctness check (67: a partial 16-row block)
CHECK_MAX_ELEMS = 1 << 26  # weights dequantized for the check, per shape (sampled 64-column tiles)
INT4_SANITY_TOL = 5e-2  # torch_int4: relative error vs bf16 matmul of its own dequantized weights
GRAPH_BELOW_S = 2e-3  # calls shorter than this are timed inside a CUDA graph
MAX_GRAPH_CALLS = 2000

METHOD = (
    "per-call time = median over the samples of all rounds (3..10 samples per round) of (CUDA-event "
    "time of a sample / calls in it); per (shape, M) the kernels run back to back in rounds "
    "(default 3, budget split between them), the kernel order rotating by one each round; "
    "calls < 2 ms captured in a CUDA graph and replayed, longer calls timed as a plain loop; "
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
    if kernel == "marlin_gcol":
        return 1
    if kernel in ("marlin_g128", "torch_int4"):
        return k // 128
    return 0


def weight_bytes(kernel: str, k: int, n: int) -> int:
    """Bytes of one copy of a kernel's weight operand(s) for B [K, N]."""
    if kernel == "fp16":
        return 2 * k * n
    if kernel in ("marlin_g128", "marlin_gcol"):
        return k * n // 2 + 2 * n * scale_rows(kernel, k)  # int4 codes + fp16 scales
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


def speedups(points: Iterable[dict], kernel: str = "marlin_g128") -> dict[tuple[str, int], float]:
    """{(canonical shape, M): fp16 time / kernel time} where both were measured."""
    idx = time_index(points)
    out = {}
    for (shape, m, kern), t in idx.items():
        if kern != kernel:
            continue
        t16 = idx.get((shape, m, "fp16"), float("nan"))
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
    """Per shape and M: fp16 time, and for each quantized kernel: time, speedup, GB/s, % of copy BW."""
    if not points:
        return "(no points)"
    idx = time_index(points)
    shapes_kn: dict[str, tuple[int, int]] = {}
    for p in points:
        shapes_kn.setdefault(canonical_shape(p["shape"]), (int(p["K"]), int(p["N"])))
    kernels_present = [k for k in KERNELS if any(p["kernel"] == k for p in points)]
    quant = [k for k in kernels_present if k != "fp16"]
    short = {"marlin_g128": "g128", "marlin_gcol": "gcol", "torch_int4": "int4"}
    head = f"{'M':>6} | {'fp16 us':>9}"
    for k in quant:
        head += f" | {short[k] + ' us':>9} {'x':>5} {'GB/s':>6} {'%BW':>4}"
    lines = []
    for shape, (k_, n_) in shapes_kn.items():
        lines.append(f"{shape}  (K={k_}, N={n_})")
        lines.append(head)
        ms = sorted({m for (s, m, _) in idx if s == shape})
        for m in ms:
            t16 = idx.get((shape, m, "fp16"), float("nan"))
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


# ---------------------------------------------------------------------------------------------
# Provenance: git, the csrc tree hash (computed without git too), device facts.
# ---------------------------------------------------------------------------------------------


def _gitignore_patterns(repo: Path) -> list[str]:
    pats = []
    try:
        for line in (repo / ".gitignore").read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#") and not line.startswith("!"):
                pats.append(line)
    except OSError:
        pass
    return pats


def _ignored(name: str, is_dir: bool, patterns: list[str]) -> bool:
    for pat in patterns:
        dir_only = pat.endswith("/")
        p = pat.rstrip("/")
        if "/" in p:  # anchored / path patterns: only meaningful at the repo root
            continue
        if dir_only and not is_dir:
            continue
        if fnmatch(name, p):
            return True
    return False


def git_tree_hash(path: Path, ignore: Optional[list[str]] = None) -> Optional[str]:
    """The git tree object id of the directory as it is on disk (what ``git write-tree`` would give
    for it once added), so that a copy of the tree without .git can still be compared with
    ``git rev-parse HEAD:csrc``.  None if it holds no files."""
    ignore = _gitignore_patterns(REPO) if ignore is None else ignore
    entries = []
    for entry in os.scandir(path):
        if entry.name == ".git":
            continue
        if entry.is_symlink():
            target = os.readlink(entry.path).encode()
            sha = hashlib.sha1(b"blob %d\0" % len(target) + target).hexdigest()
            entries.append((entry.name, "120000", sha))
        elif entry.is_dir():
            if _ignored(entry.name, True, ignore):
                continue
            sub = git_tree_hash(Path(entry.path), ignore)
            if sub is not None:
                entries.append((entry.name + "/", "40000", sub))
        elif entry.is_file():
            if _ignored(entry.name, False, ignore):
                continue
            data = Path(entry.path).read_bytes()
            sha = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            mode = "100755" if os.access(entry.path, os.X_OK) else "100644"
            entries.append((entry.name, mode, sha))
    if not entries:
        return None
    entries.sort(key=lambda e: e[0].encode())  # git orders a directory as its name + "/"
    body = b"".join(f"{mode} {name.rstrip('/')}".encode() + b"\0" + bytes.fromhex(sha) for name, mode, sha in entries)
    return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()


def _git(*args: str) -> Optional[str]:
    try:
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _git_usable() -> bool:
    """git answers for this repository itself (not for a parent folder's repository, nor for an
    empty one: a copy of the tree, as on a device machine, may sit in either) and HEAD exists."""
    top = _git("rev-parse", "--show-toplevel")
    try:
        ours = top is not None and Path(top).resolve() == REPO.resolve()
    except OSError:
        return False
    # a repository without commits (a copied tree that was `git init`ed) cannot say what is committed
    return ours and _git("rev-parse", "--verify", "-q", "HEAD") is not None


def git_info(expect_rev: Optional[str] = None, expect_tree: Optional[str] = None) -> dict:
    """git_rev, csrc_tree (committed), csrc_worktree_tree (on disk), git_dirty and the dirty paths.

    git_dirty: when ``expect_tree`` is given (``--csrc-tree``, e.g. the caller's ``git rev-parse
    HEAD:csrc``), whether the on-disk tree differs from it (a copy may carry an unrelated or stale
    git); otherwise, with git, whether ``git status --porcelain csrc`` lists anything; None when it
    cannot be told."""
    try:
        work = git_tree_hash(REPO / "csrc")
    except OSError:
        work = None
    if expect_tree is not None:
        # given explicitly (a copy whose git, if any, is not the caller's): trust it only as far as
        # the on-disk tree hash matches it
        rev, tree, status, source = expect_rev, expect_tree, None, "given"
    elif _git_usable():
        rev = _git("rev-parse", "HEAD")
        tree = _git("rev-parse", "HEAD:csrc")
        status = _git("status", "--porcelain", "--", "csrc")
        source = "git"
    else:
        rev, tree, status, source = expect_rev, expect_tree, None, "given" if expect_tree else "none"
    if status is not None:
        dirty_files = [line[3:] for line in status.splitlines() if line.strip()]
        dirty: Optional[bool] = bool(dirty_files)
    else:
        dirty_files = []
        dirty = (work != tree) if (work is not None and tree is not None) else None
    return {
        "git_rev": rev,
        "csrc_tree": tree,
        "csrc_worktree_tree": work,
        "git_dirty": dirty,
        "git_dirty_files": dirty_files,
        "provenance_source": source,
    }


def build_is_stale() -> Optional[bool]:
    """True if marlin/_C*.so is older than the newest file under csrc/ (a rebuild was forgotten)."""
    try:
        so = max((REPO / "marlin").glob("_C*.so"), key=lambda p: p.stat().st_mtime)
        newest = max(p.stat().st_mtime for p in (REPO / "csrc").rglob("*") if p.is_file())
    except (ValueError, OSError):
        return None
    return so.stat().st_mtime < newest


def dirty_warning(meta: dict) -> Optional[str]:
    if meta.get("git_dirty") is True:
        files = ", ".join(meta.get("git_dirty_files") or []) or "(tree hash differs from HEAD:csrc)"
        return (
            "!" * 100 + "\nWARNING: csrc/ has uncommitted changes: " + files + "\n"
            "These timings come from code that is not committed. Do NOT commit this results file;\n"
            "commit the kernel first, rebuild, and run again.\n" + "!" * 100
        )
    if meta.get("git_dirty") is None:
        return (
            "!" * 100 + "\nWARNING: cannot tell whether csrc/ matches a commit (no git repository here).\n"
            f"csrc/ on disk is tree {meta.get('csrc_worktree_tree')}. Pass --csrc-tree $(git rev-parse HEAD:csrc)\n"
            "(or MARLIN_CSRC_TREE) from the checkout, or let benchmarks.report compare it with your git.\n" + "!" * 100
        )
    return None


def device_facts(dev: torch.device) -> dict:
    if dev.type != "cuda":
        return {"gpu": "cpu", "gpu_slug": "cpu", "sms": 0, "l2_bytes": 0, "capability": None, "gpu_mem_bytes": None}
    p = torch.cuda.get_device_properties(dev)
    return {
        "gpu": p.name,
        "gpu_slug": sanitize_gpu_name(p.name),
        "sms": p.multi_processor_count,
        "l2_bytes": int(getattr(p, "L2_cache_size", 0)),
        "capability": f"{p.major}.{p.minor}",
        "gpu_mem_bytes": int(p.total_memory),
        "gpu_uuid": str(getattr(p, "uuid", "")) or None,
    }


def collect_meta(dev: torch.device, mode: str, kind: str = "gemm", expect_rev=None, expect_tree=None) -> dict:
    meta = {"kind": kind, "mode": mode}
    meta.update(device_facts(dev))
    meta.update(
        {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "host": platform.node(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv[1:],
            "fp16_reduced_precision_reduction": bool(torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
        }
    )
    expect_rev = expect_rev or os.environ.get("MARLIN_GIT_REV") or None
    expect_tree = expect_tree or os.environ.get("MARLIN_CSRC_TREE") or None
    meta.update(git_info(expect_rev, expect_tree))
    meta["build_older_than_csrc"] = build_is_stale()
    return meta


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


class Skipped(Exception):
    """A point not measured on purpose (too slow a call); the message goes to meta.notes."""


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _plan(t_call: float, budget_s: float, n_variants: int, min_samples: int, max_samples: int) -> tuple[int, int]:
    """(samples, calls per sample) for a call of t_call seconds within budget_s of timed work."""
    total = max(1.0, budget_s / max(t_call, 1e-9))
    samples = int(min(max_samples, max(min_samples, total)))
    calls = max(1, int(total // samples))
    if calls >= n_variants:  # every sample walks all copies evenly
        calls = math.ceil(calls / n_variants) * n_variants
    elif n_variants * t_call <= budget_s:
        calls = n_variants
    if calls > MAX_GRAPH_CALLS:
        calls = max(n_variants, (MAX_GRAPH_CALLS // n_variants) * n_variants)
    return samples, calls


def measure(
    fn: Callable[[int], object],
    n_variants: int,
    dev: torch.device,
    *,
    budget_s: float = 0.04,
    max_call_s: Optional[float] = None,
    use_graph: bool = True,
    min_samples: int = 3,
    max_samples: int = 10,
) -> dict:
    """Per-call time of fn(i) (i selects the weight copy, cycled mod n_variants).

    Returns {"time_us", "timing" ("graph" | "events" | "wall"), "samples", "calls", "spread"} where
    spread = (max - min) / median of the sample times.  Raises Skipped if the first call takes
    longer than max_call_s."""
    t0 = time.perf_counter()
    fn(0)
    _sync(dev)
    first = time.perf_counter() - t0
    if max_call_s is not None and first > max_call_s:
        raise Skipped(f"one call took {first * 1e3:.0f} ms > {max_call_s * 1e3:.0f} ms")

    if dev.type != "cuda":  # CPU (dry run): wall clock, a handful of calls
        t0 = time.perf_counter()
        fn(1 % n_variants)
        t_call = time.perf_counter() - t0
        samples, calls = _plan(t_call, budget_s, n_variants, min_samples, max_samples)
        times, i = [], 0
        for _ in range(samples):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(i % n_variants)
                i += 1
            times.append((time.perf_counter() - t0) / calls)
        return _summary(times, "wall", samples, calls)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(1 % n_variants)
    end.record()
    end.synchronize()
    t_call = start.elapsed_time(end) * 1e-3
    samples, calls = _plan(t_call, budget_s, n_variants, min_samples, max_samples)

    if use_graph and t_call < GRAPH_BELOW_S:
        try:
            return _measure_graph(fn, n_variants, samples, calls)
        except Exception as e:  # noqa: BLE001 - fall back to a plain loop, and say so
            _sync(dev)
            torch.cuda.empty_cache()
            res = _measure_loop(fn, n_variants, samples, calls, dev)
            res["timing"] = "events (graph capture failed: " + str(e).splitlines()[0][:120] + ")"
            return res
    return _measure_loop(fn, n_variants, samples, calls, dev)


def _measure_graph(fn, n_variants: int, samples: int, calls: int) -> dict:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
        for i in range(min(n_variants, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % n_variants)
    graph.replay()  # warm
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
    for a, b in events:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) * 1e-3 / calls for a, b in events]
    del graph
    return _summary(times, "graph", samples, calls)


def _measure_loop(fn, n_variants: int, samples: int, calls: int, dev) -> dict:
    i = 2 % n_variants
    fn(i)  # one more warm call, continuing the rotation
    i += 1
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
    for a, b in events:
        a.record()
        for _ in range(calls):
            fn(i % n_variants)
            i += 1
        b.record()
    torch.cuda.synchronize(dev)
    times = [a.elapsed_time(b) * 1e-3 / calls for a, b in events]
    return _summary(times, "events", samples, calls)


def _summary(times: list[float], how: str, samples: int, calls: int) -> dict:
    med = statistics.median(times)
    return {
        "time_us": med * 1e6,
        "timing": how,
        "samples": samples,
        "calls": calls,
        "spread": (max(times) - min(times)) / med if med > 0 else float("nan"),
        "times_s": list(times),  # the samples, pooled over rounds by measure_point (not stored)
    }


def round_orders(kernels: list[str], rounds: int) -> list[list[str]]:
    """The kernel order of each timing round: round r starts r places further along the list, so
    that each kernel follows a different one from round to round (no kernel always inherits the
    clocks and power state that the same neighbour left)."""
    n = len(kernels)
    return [[kernels[(r + i) % n] for i in range(n)] for r in range(max(1, rounds))] if n else []


def measure_point(preps: dict, shape: str, k: int, n: int, m: int, dev: torch.device, *, rounds: int,
                  budget_s: float, max_call_s: Optional[float], use_graph: bool, notes: list[str]) -> list[dict]:
    """One point per kernel of ``preps`` at batch m: ``rounds`` rounds of budget_s / rounds each,
    the kernels back to back in round_orders' order; time_us = median of the pooled samples.

    Why rounds: on an H200 the power limiter lowers the SM clock for a second or more after a
    heavy kernel (nvidia-smi reports the 'SW power cap' reason), and the 16-row large-layer calls
    took 926 us right after 2 s of fp16 matmuls against 643 us after 3 s idle (benchmarks/NOTES.md,
    session 8).  Timing every kernel of one M together, in rotating order, lets them share that
    state instead of charging it to whichever kernel runs after fp16's large-M points."""
    a = torch.randn(m, k, dtype=torch.float16, device=dev)
    pooled: dict[str, list[float]] = {kern: [] for kern in preps}
    info: dict[str, dict] = {kern: {"timing": None} for kern in preps}
    for order in round_orders(list(preps), rounds):
        for kern in order:
            prep = preps[kern]
            if prep is None or info[kern]["timing"] in ("skipped", "error"):
                continue
            try:
                res = measure(
                    prep.make_fn(a), prep.copies, dev, budget_s=budget_s / max(1, rounds),
                    max_call_s=max_call_s if kern == "torch_int4" else None, use_graph=use_graph,
                )
                pooled[kern] += res["times_s"]
                info[kern].update(timing=res["timing"], calls=res["calls"],
                                  samples=info[kern].get("samples", 0) + res["samples"])
            except Skipped as e:
                info[kern]["timing"] = "skipped"
                notes.append(f"{shape} {kern} M={m}: skipped: {e}")
            except Exception as e:  # noqa: BLE001 - record and go on
                info[kern]["timing"] = "error"
                msg = f"{shape} {kern} M={m}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                notes.append(msg)
                print("NOTE " + msg, file=sys.stderr, flush=True)
            finally:
                _sync(dev)
    out = []
    for kern, prep in preps.items():
        point = {"shape": shape, "K": k, "N": n, "M": m, "kernel": kern, "time_us": None, "timing": None,
                 "copies": prep.copies if prep else None}
        point.update(info[kern])
        if pooled[kern] and point["timing"] not in ("skipped", "error"):
            summary = _summary(pooled[kern], point["timing"], point["samples"], point["calls"])
            del summary["times_s"]
            point.update(summary, rounds=max(1, rounds))
        out.append(point)
    return out


def measure_copy_bandwidth(dev: torch.device, nbytes: int = 2 << 30, samples: int = 10) -> float:
    """Device-to-device copy: (bytes read + bytes written) / time, GB/s, median of samples."""
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        nbytes = int(min(nbytes, free // 4))
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    times = []
    for _ in range(samples):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    _free(dev)
    return 2 * nbytes / statistics.median(times) / 1e9


def measure_fp16_peak(dev: torch.device, n: int = 8192, samples: int = 10, per_sample: int = 5) -> float:
    """torch.matmul of two random fp16 [n, n] matrices: TFLOP/s, median of samples."""
    a = torch.randn(n, n, dtype=torch.float16, device=dev)
    b = torch.randn(n, n, dtype=torch.float16, device=dev)
    for _ in range(3):
        torch.matmul(a, b)
    _sync(dev)
    times = []
    for _ in range(samples):
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(per_sample):
                torch.matmul(a, b)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) * 1e-3 / per_sample)
        else:
            t0 = time.perf_counter()
            for _ in range(per_sample):
                torch.matmul(a, b)
            times.append((time.perf_counter() - t0) / per_sample)
    del a, b
    _free(dev)
    return 2 * n**3 / statistics.median(times) / 1e12


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Kernels: weights (random, rotated copies), call closures, correctness checks.
# ---------------------------------------------------------------------------------------------


class CorrectnessError(RuntimeError):
    """marlin produced a wrong result: the run must not write a results file."""


@dataclass
class Prepared:
    kernel: str
    copies: int
    bytes_per_copy: int
    make_fn: Callable[[torch.Tensor], Callable[[int], object]]
    checks: list = field(default_factory=list)
    tensors: list = field(default_factory=list)

    def free(self) -> None:
        self.tensors.clear()
        self.make_fn = None  # type: ignore[assignment]


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x64, r64 = x.double(), ref.double()
    if not torch.isfinite(x64).all():
        return float("inf")
    return ((x64 - r64).norm() / r64.norm().clamp_min(1e-30)).item()


def _ref_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a.float() @ w.float() without TF32."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return a.float() @ w.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _check_tiles(n: int, k: int, max_elems: int) -> list[int]:
    """64-column tiles to check: all if K * N <= max_elems, else first, last and evenly spaced."""
    tiles = n // 64
    budget = max(2, max_elems // (k * 64))
    if tiles <= budget:
        return list(range(tiles))
    return sorted({round(i * (tiles - 1) / (budget - 1)) for i in range(budget)})


def _dequant_tiles(b_q: torch.Tensor, b_scales: torch.Tensor, tiles: list[int], dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns of dequant(b_q, b_scales) for the given 64-column tiles, via packing.unpack (the spec),
    on the tensors' device: tile t is words 128 t .. 128 t + 127 of each row of b_q and columns
    64 t .. 64 t + 63 of b_scales (scales are permuted within a 64-column chunk only)."""
    from marlin import packing

    runs, start = [], None
    for i, t in enumerate(tiles):  # group consecutive tiles (at most 16 per unpack)
        if start is None:
            start = t
        nxt = tiles[i + 1] if i + 1 < len(tiles) else None
        if nxt != t + 1 or t + 1 - start >= 16:
            runs.append((start, t + 1))
            start = None
    ws, cols = [], []
    for t0, t1 in runs:
        q, s = packing.unpack(b_q[:, 128 * t0 : 128 * t1].contiguous(), b_scales[:, 64 * t0 : 64 * t1].contiguous())
        ws.append(packing.dequantize(q, s).to(dev))
        cols.append(torch.arange(64 * t0, 64 * t1))
    return torch.cat(ws, dim=1).to(dev), torch.cat(cols).to(dev)


def check_marlin(b_q, b_scales, k: int, n: int, dev, workspace, ms=CHECK_MS, max_elems=CHECK_MAX_ELEMS) -> list[dict]:
    """marlin.gemm vs fp32 a @ dequant on sampled columns; raises CorrectnessError above CHECK_TOL."""
    from marlin import ops as marlin_ops

    tiles = _check_tiles(n, k, max_elems)
    w, cols = _dequant_tiles(b_q, b_scales, tiles, dev)
    out = []
    for m in ms:
        a = torch.randn(m, k, dtype=torch.float16, device=dev)
        c = marlin_ops.gemm(a, b_q, b_scales, workspace)
        _sync(dev)
        ref = _ref_matmul(a, w)
        err = _rel_err(c[:, cols], ref)
        out.append({"M": m, "rel_err": err, "tol": CHECK_TOL, "columns": int(cols.numel()), "ok": err < CHECK_TOL})
        if not err < CHECK_TOL:
            raise CorrectnessError(
                f"marlin.gemm is WRONG: K={k} N={n} groups={b_scales.shape[0]} M={m}: normwise relative error "
                f"{err:.3g} vs fp32 reference on {cols.numel()} columns (tolerance {CHECK_TOL})"
            )
    return out


def _inner_k_tiles(k: int) -> int:
    for t in (8, 4, 2):
        if k % (16 * t) == 0:
            return t
    raise ValueError(f"K = {k} is not a multiple of 32: torch_int4 cannot take it")


def _random_like_clones(base: torch.Tensor, copies: int) -> list[torch.Tensor]:
    return [base] + [base.clone() for _ in range(copies - 1)]


def prepare(kernel: str, k: int, n: int, dev: torch.device, l2_bytes: int, min_copies: int = 1) -> Prepared:
    """Random weights for one kernel and shape, cloned so that copies * bytes >= 4 x L2.

    The contents are random (never zeros), not quantized from a real matrix: the speed of these
    kernels does not depend on the values, and packing.pack runs on the CPU (too slow for the
    ideal layer).  marlin's output is still checked against the spec (packing.unpack)."""
    nbytes = weight_bytes(kernel, k, n)
    copies = copies_needed(nbytes, l2_bytes, minimum=min_copies)

    if kernel == "fp16":
        # nn.Linear stores W [N, K]; F.linear computes a @ W.t(): the same call as torch.matmul(a, W.t())
        ws = _random_like_clones(torch.randn(n, k, dtype=torch.float16, device=dev), copies)

        def make_fn(a):
            return lambda i: torch.matmul(a, ws[i % copies].t())

        return Prepared(kernel, copies, nbytes, make_fn, tensors=ws)

    if kernel in MARLIN_GROUP:
        from marlin import ops as marlin_ops

        groups = 1 if MARLIN_GROUP[kernel] == -1 else k // MARLIN_GROUP[kernel]
        b_q = torch.randint(-(2**31), 2**31, (k // 16, 2 * n), dtype=torch.int32, device=dev)
        b_s = torch.empty(groups, n, dtype=torch.float16, device=dev).uniform_(0.001, 0.01)
        workspace = marlin_ops.make_workspace(dev) if dev.type == "cuda" else None
        checks = check_marlin(b_q, b_s, k, n, dev, workspace)
        bqs, bss = _random_like_clones(b_q, copies), _random_like_clones(b_s, copies)

        def make_fn(a):
            return lambda i: marlin_ops.gemm(a, bqs[i % copies], bss[i % copies], workspace)

        return Prepared(kernel, copies, nbytes, make_fn, checks=checks, tensors=[bqs, bss, workspace])

    if kernel == "torch_int4":
        if dev.type != "cuda":
            raise RuntimeError("torch_int4 (aten._weight_int4pack_mm) runs on CUDA only")
        inner = _inner_k_tiles(k)
        sz = torch.empty(k // INT4_GROUP, n, 2, dtype=torch.bfloat16, device=dev)
        sz[..., 0].uniform_(0.001, 0.01)  # scale
        sz[..., 1].uniform_(-0.01, 0.01)  # zero: w = (q - 8) * scale + zero
        if n * (k // 2) < 2**31 - 1:
            u8 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)  # [N, K/2], even k high nibble
            packed = torch.ops.aten._convert_weight_to_int4pack(u8, inner)
            checks = [sanity_int4(u8, packed, sz, k, n, dev, inner)]
            del u8
        else:
            # _convert_weight_to_int4pack takes fewer than 2^31 elements: convert (and check) the first
            # columns only, and time on random words of the packed layout (speed does not depend on them)
            ns = min(n, 1024)
            u8 = torch.randint(0, 256, (ns, k // 2), dtype=torch.uint8, device=dev)
            small = torch.ops.aten._convert_weight_to_int4pack(u8, inner)
            check = sanity_int4(u8, small, sz[:, :ns].contiguous(), k, ns, dev, inner)
            check["note"] = f"first {ns} columns only (N*K/2 >= 2^31: timed on random packed words)"
            checks = [check]
            if small.dim() < 2 or small.shape[0] == 0 or ns % small.shape[0]:
                raise RuntimeError(f"unexpected int4pack layout {tuple(small.shape)} for N={ns}, K={k}")
            rows_per = ns // small.shape[0]  # N rows per leading index (8 for tinygemm's layout)
            if n % rows_per:
                raise RuntimeError(f"N = {n} is not a multiple of {rows_per}")
            shape = (n // rows_per,) + tuple(small.shape[1:])
            packed = torch.randint(-(2**31), 2**31, shape, dtype=small.dtype, device=dev)
            del u8, small
        pks, szs = _random_like_clones(packed, copies), _random_like_clones(sz, copies)

        def make_fn(a):
            a_bf = a.to(torch.bfloat16)
            return lambda i: torch.ops.aten._weight_int4pack_mm(a_bf, pks[i % copies], INT4_GROUP, szs[i % copies])

        return Prepared(kernel, copies, nbytes, make_fn, checks=checks, tensors=[pks, szs])

    raise ValueError(f"unknown kernel {kernel!r}")


def sanity_int4(u8, packed, sz, k: int, n: int, dev, inner: int, m: int = 16, max_cols: int = 256) -> dict:
    """torch_int4 vs bf16 matmul of its own dequantized weights on sampled columns (not fatal)."""
    cols = torch.linspace(0, n - 1, min(n, max_cols), device=dev).round().long().unique()
    u = u8[cols]  # [c, K/2]
    q = torch.stack([u >> 4, u & 15], dim=-1).reshape(len(cols), k).float()  # [c, K]
    s = sz[:, cols, 0].float().repeat_interleave(INT4_GROUP, dim=0)  # [K, c]
    z = sz[:, cols, 1].float().repeat_interleave(INT4_GROUP, dim=0)
    w = ((q.t() - 8) * s + z).to(torch.bfloat16)  # [K, c]
    a = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
    c = torch.ops.aten._weight_int4pack_mm(a, packed, INT4_GROUP, sz)
    err = _rel_err(c[:, cols], _ref_matmul(a, w))
    ok = err < INT4_SANITY_TOL
    return {"M": m, "rel_err": err, "tol": INT4_SANITY_TOL, "columns": int(len(cols)), "ok": ok, "inner_k_tiles": inner}


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
        mode, names, ms, kernels = "roofline", list(S.roofline_shapes()), list(S.DEFAULT_MS), ["fp16", "marlin_g128"]
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
    badk = [k for k in kernels if k not in KERNELS]
    if badk:
        raise SystemExit(f"unknown kernel(s) {badk}; known: {list(KERNELS)}")
    if any(m <= 0 for m in ms):
        raise SystemExit("--ms must be positive")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    # fp16 first: speedups need it, and its time is the reference
    kernels = sorted(dict.fromkeys(kernels), key=KERNELS.index)
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
    p.add_argument("--kernels", help=f"comma-separated subset of {','.join(KERNELS)}")
    p.add_argument("--out", help="results JSON path (default benchmarks/results/<gpu>[-<mode>].json)")
    p.add_argument("--budget-ms", type=float, default=40.0, help="timed GPU work per point (default 40)")
    p.add_argument(
        "--max-call-ms", type=float, default=500.0,
        help="torch_int4 points whose first call takes longer are skipped (time null, noted in meta)",
    )
    p.add_argument(
        "--rounds", type=int, default=3,
        help="timing rounds per (shape, M); the kernels of one M run back to back, in an order that "
        "rotates from round to round, and the samples of all rounds are pooled (default 3)",
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
            "rounds": args.rounds,
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
                shape_points += measure_point(
                    preps, shape, k, n, m, dev, rounds=args.rounds, budget_s=budget_s,
                    max_call_s=args.max_call_ms * 1e-3, use_graph=not args.no_graph, notes=notes,
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
