"""Timing of one benchmark point: CUDA-graph or loop sampling, rounds in balanced kernel orders,
medians; plus the device's measured copy bandwidth and FP16 tensor rate."""

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
from .bench_math import GRAPH_BELOW_S, MAX_GRAPH_CALLS


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


class Skipped(Exception):
    """A point not measured on purpose (too slow a call); the message goes to meta.notes."""


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _plan(t_call: float, budget_s: float, n_variants: int, min_samples: int, max_samples: int) -> tuple[int, int]:
    """(samples, calls per sample) for a call of t_call seconds within budget_s of timed work.

    Where walking every copy raises the calls per sample, the samples drop so that the timed work
    stays ~budget_s: every kernel of a point then runs for about as long after the pause of its
    graph capture. Why: a GPU at its power limit clocks high for roughly the first 20 ms after a
    pause, and INT4 weights need 4x the copies of FP16 ones to pass 4 x L2, so with 10 samples
    each, fp16 ran 15 ms bursts at 4096 rows (2 copies) and marlin 69 ms ones (8 copies): on an
    H200 fp16 read 742 us there (841 us held for 0.4 s), marlin 860 us (862 held)."""
    total = max(1.0, budget_s / max(t_call, 1e-9))
    samples = int(min(max_samples, max(min_samples, total)))
    calls = max(1, int(total // samples))
    if calls >= n_variants:  # every sample walks all copies evenly
        calls = math.ceil(calls / n_variants) * n_variants
    elif n_variants * t_call <= budget_s:
        calls = n_variants
    if calls > MAX_GRAPH_CALLS:
        calls = max(n_variants, (MAX_GRAPH_CALLS // n_variants) * n_variants)
    if calls > 1:  # the same timed work for every kernel, whatever its copies
        samples = max(1, min(samples, round(total / calls)))
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
    t_call_s: Optional[float] = None,
) -> dict:
    """Per-call time of fn(i) (i selects the weight copy, cycled mod n_variants).

    Returns {"time_us", "timing" ("graph" | "events" | "wall"), "samples", "calls", "spread",
    "t_call_s"} where spread = (max - min) / median of the sample times and t_call_s the one-call
    estimate the samples were planned from.  Raises Skipped if the first call takes longer than
    max_call_s.  t_call_s (a later round of the same kernel and point, measure_point; GPU only):
    that estimate again, so the first call and the estimate call are not run again (on the long
    calls of large M they were most of a round's untimed work)."""
    if dev.type != "cuda":  # CPU (dry run): wall clock, a handful of calls
        t_call = _estimate_call(fn, n_variants, dev, max_call_s)
        samples, calls = _plan(t_call, budget_s, n_variants, min_samples, max_samples)
        times, i = [], 0
        for _ in range(samples):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(i % n_variants)
                i += 1
            times.append((time.perf_counter() - t0) / calls)
        return {**_summary(times, "wall", samples, calls), "t_call_s": t_call}
    if t_call_s is None:
        t_call_s = _estimate_call(fn, n_variants, dev, max_call_s)
    samples, calls = _plan(t_call_s, budget_s, n_variants, min_samples, max_samples)
    res = _sample(fn, n_variants, samples, calls, dev, use_graph and t_call_s < GRAPH_BELOW_S)
    return {**res, "t_call_s": t_call_s}


def _estimate_call(fn, n_variants: int, dev, max_call_s: Optional[float]) -> float:
    """One call's time in seconds from a second call (CUDA events; wall clock on the CPU) after a
    first one, which is the warm-up and, over max_call_s, raises Skipped."""
    t0 = time.perf_counter()
    fn(0)
    _sync(dev)
    first = time.perf_counter() - t0
    if max_call_s is not None and first > max_call_s:
        raise Skipped(f"one call took {first * 1e3:.0f} ms > {max_call_s * 1e3:.0f} ms")
    if dev.type != "cuda":
        t0 = time.perf_counter()
        fn(1 % n_variants)
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(1 % n_variants)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def _sample(fn, n_variants: int, samples: int, calls: int, dev, graph: bool) -> dict:
    """The timed samples: replays of one captured CUDA graph, or a plain loop (also where the
    capture fails, which the timing field then says)."""
    if graph:
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


def graph_median_us(fn, reps: int = 20, rounds: int = 7) -> float:
    """The development probes' quick timer (probe_tiles, probe_2_4): `reps` calls captured in one
    CUDA graph, replayed `rounds` times; the median per-call time in microseconds."""
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


def balanced_rounds(n: int) -> int:
    """Rounds of one full balanced order design for n kernels (round_orders): n for even n, 2n for odd."""
    return n if n % 2 == 0 else 2 * n


def round_orders(kernels: list[str], rounds: int) -> list[list[str]]:
    """The kernel order of each timing round, from a balanced (Williams) design: round r is the
    sequence 0, 1, n-1, 2, n-2, ... shifted by r (mod n), and for an odd n the same rounds again
    reversed. Over balanced_rounds(n) rounds every kernel runs once (twice for odd n) in every
    position and right after every other kernel, so no kernel always inherits the clocks and power
    state that the same neighbour left, nor always runs late in a round (a plain rotation keeps
    each kernel's predecessor and leaves the last ones of the list late in most rounds). Fewer
    rounds take the design's first rows, which still vary the predecessor; more repeat it."""
    n = len(kernels)
    if n == 0:
        return []
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    rows = [[(b + r) % n for b in base] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[kernels[i] for i in rows[r % len(rows)]] for r in range(max(1, rounds))]


def measure_point(preps: dict, shape: str, k: int, n: int, m: int, dev: torch.device, *, rounds: int,
                  budget_s: float, max_call_s: Optional[float], use_graph: bool, notes: list[str],
                  min_pooled: int = 9) -> list[dict]:
    """One point per kernel of ``preps`` at batch m: ``rounds`` rounds of budget_s / rounds each,
    the kernels back to back in round_orders' order; time_us = median of the pooled samples, at
    least min_pooled of them per kernel (ceil(min_pooled / rounds) per round: 3 at 3 rounds).

    Why rounds: on an H200 the power limiter lowers the SM clock for a second or more after a
    heavy kernel (nvidia-smi reports the 'SW power cap' reason), and the 16-row large-layer calls
    took 926 us right after 2 s of fp16 matmuls against 643 us after 3 s idle (benchmarks/NOTES.md,
    session 8).  Timing every kernel of one M together, in balanced orders, lets them share that
    state instead of charging it to whichever kernel runs after fp16's large-M points."""
    a = torch.randn(m, k, dtype=torch.float16, device=dev)
    pooled: dict[str, list[float]] = {kern: [] for kern in preps}
    info: dict[str, dict] = {kern: {"timing": None} for kern in preps}
    t_call: dict[str, float] = {}  # each kernel's one-call estimate from its first round
    for order in round_orders(list(preps), rounds):
        for kern in order:
            prep = preps[kern]
            if prep is None or info[kern]["timing"] in ("skipped", "error"):
                continue
            try:
                res = measure(
                    prep.make_fn(a), prep.copies, dev, budget_s=budget_s / max(1, rounds),
                    max_call_s=max_call_s if kern == "torch_int4" else None, use_graph=use_graph,
                    min_samples=max(1, -(-min_pooled // max(1, rounds))), t_call_s=t_call.get(kern),
                )
                if res.get("t_call_s") is not None:
                    t_call[kern] = res["t_call_s"]
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


def _spreads(points: list[dict]) -> list[float]:
    return [p["spread"] for p in points if p.get("time_us") is not None and not math.isnan(p.get("spread", math.nan))]


def widest_spread(points: list[dict]) -> float:
    """The largest spread ((max - min) / median of the pooled samples) among a point's timed kernels."""
    return max(_spreads(points), default=0.0)


# A kernel whose spread stands this many times above the median of the point's other kernels, and
# above this fraction of retime_spread, was disturbed too: on an H200 group 128 on 7B o at 64 rows
# spread 0.42 (13.1 us) while the other six kernels of its rounds spread 0.01-0.05 and the same
# kernel without a workspace took 10.3 us (benchmarks/NOTES.md, thirty-second). In the committed
# H200 and H100 full and formats files this picks 2-6 of 108 points per file.
RETIME_RELATIVE = 8.0
RETIME_RELATIVE_FLOOR = 0.4


def disturbed(points: list[dict], retime_spread: float) -> bool:
    """Whether a point is timed again: its widest spread above retime_spread, or above
    RETIME_RELATIVE_FLOOR * retime_spread and RETIME_RELATIVE times the median of the other kernels'."""
    spreads = sorted(_spreads(points))
    if not retime_spread or not spreads:
        return False
    worst = spreads[-1]
    if worst > retime_spread:
        return True
    others = spreads[:-1]
    return bool(others) and worst > RETIME_RELATIVE_FLOOR * retime_spread and worst > RETIME_RELATIVE * statistics.median(others)


def measure_point_steady(preps: dict, shape: str, k: int, n: int, m: int, dev: torch.device, *, retime_spread: float,
                         notes: list[str], **kw) -> list[dict]:
    """measure_point, and once more where a kernel's samples spread more than retime_spread, or far
    more than the point's other kernels' (disturbed): the run whose widest spread is smaller is kept,
    whole (every kernel of the point from the same run, so that they still share one stretch of the
    GPU's clocks and power state). 0 turns it off.

    Why: something outside the benchmark now and then disturbs a stretch of a point's samples (on an
    H200, bf16 on 7B qkv at M = 1 spread 1.9 and took 19.4 us where it takes 12.8, a 2:4 point
    15.7 and 14.7 us against 11.0; benchmarks/NOTES.md, twenty-ninth), and where that stretch is
    most of the samples the median moves with it. Most points spread 0.02-0.1."""
    first = measure_point(preps, shape, k, n, m, dev, notes=notes, **kw)
    worst = widest_spread(first)
    if not disturbed(first, retime_spread):
        return first
    notes2: list[str] = []  # (the second run's notes, less those the first already made)
    second = measure_point(preps, shape, k, n, m, dev, notes=notes2, **kw)
    notes += [note for note in notes2 if note not in notes]
    worst2 = widest_spread(second)
    keep, which = (second, 2) if worst2 < worst else (first, 1)
    for p in keep:
        p["retimed"] = {"widest_spreads": [round(worst, 3), round(worst2, 3)], "kept_run": which}
    notes.append(f"{shape} M={m}: re-timed (widest spread {worst:.2f}, then {worst2:.2f}); kept run {which}")
    return keep


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
