"""Kernel time per call of a step function, by category, from torch.profiler (bench_e2e, bench_tp).

    summary = profile_calls(run, reset, device, steps=8)

runs ``reset(); run()`` twice to warm up, once more under the profiler as its own warm-up step
(dropped: it carries the profiler's start-up), then ``steps`` times recorded, and sums the device
time of every kernel (on the CPU: every op's own time) per call, by category (the first pattern of
CATEGORIES that the kernel's name matches). ``align`` (optional) runs after a device sync before
each recorded step: with several processes, a host barrier, so that a collective's kernel does not
count the time another rank spent elsewhere (profiler start-up, the previous step's end). Within
a step, eager launches still drift between ranks, and a collective's kernel waits for the slowest:
its time is an upper bound of what the replayed graph pays. ``run`` must be the step itself, not a
captured CUDA graph of it, so that the profiler sees each kernel; the caller compares
``kernel_us_per_step`` with the graph's time per step: the difference is idle time.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

__all__ = ["CATEGORIES", "category", "profile_calls"]

CATEGORIES = (  # first match wins
    # inductor names its kernels after the ops they fuse ("triton_red_fused_..._gemm_mean_..."), so
    # they must be recognised before the name patterns below
    ("fused elementwise (inductor)", re.compile(r"^triton_", re.I)),
    # marlin's decode attention: its op ("marlin::decode_attention") says marlin too
    ("attention", re.compile(r"decode_attention", re.I)),
    ("marlin GEMM", re.compile(r"marlin", re.I)),
    # NCCL's kernels ("ncclDevKernel_AllReduce_Sum_f16_RING_LL") and gloo's ops ("gloo:all_reduce")
    ("collectives (NCCL / gloo)", re.compile(r"nccl|gloo|all_?reduce|all_?gather", re.I)),
    # attention kernels may have "cutlass" or "gemm" in their names
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient", re.I)),
    ("FP16 GEMM", re.compile(r"gemm|gemv|cutlass|xmma|cublas|nvjet|splitk|^aten::(mm|addmm|bmm)$", re.I)),
    ("cache write / index", re.compile(r"index|scatter", re.I)),
    ("copy / cast / cat (aten)", re.compile(r"copy|cast|CatArray|cat_", re.I)),
    ("elementwise / reduce (aten)", re.compile(r"elementwise|reduce_kernel|reduction", re.I)),
)


def category(name: str) -> str:
    for cat, rx in CATEGORIES:
        if rx.search(name):
            return cat
    return "other"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def profile_calls(run: Callable[[], object], reset: Callable[[], None], dev: torch.device, steps: int = 8,
                  rows: int = 20, align: Callable[[], None] | None = None) -> dict:
    """Kernel time per call of ``run`` by category, calls per category, their sum and the top
    kernels (see the module doc)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    for _ in range(2):
        reset()
        run()
    _sync(dev)
    on_cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    # one warm-up step under the profiler (traced, then dropped), then `steps` recorded ones
    with profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as prof:
        for _ in range(steps + 1):  # the device is idle here: synced after the warm-up and after each step
            if align is not None:
                align()
            reset()
            run()
            _sync(dev)  # the step's kernels finish inside its own profiler step
            prof.step()
    per_cat: dict[str, float] = {}
    calls: dict[str, float] = {}
    kernels = []
    for ev in prof.key_averages():
        # the schedule's step annotations ("ProfilerStep#3") span a whole step, on the device too
        if ev.key.startswith("ProfilerStep"):
            continue
        if on_cuda:
            # kernels only: CPU-side ops carry their kernels' time too and would count it twice
            if "CUDA" not in str(getattr(ev, "device_type", "")):
                continue
            t = getattr(ev, "device_time_total", None)
            if t is None:
                t = getattr(ev, "cuda_time_total", 0)
        else:
            t = ev.self_cpu_time_total
        if not t:
            continue
        us = t / steps
        cat = category(ev.key)
        kernels.append((ev.key, us, ev.count / steps))
        per_cat[cat] = per_cat.get(cat, 0.0) + us
        calls[cat] = calls.get(cat, 0.0) + ev.count / steps
    kernels.sort(key=lambda x: -x[1])
    return {
        "us_per_step_by_category": {k: round(v, 2) for k, v in sorted(per_cat.items(), key=lambda kv: -kv[1])},
        "calls_per_step_by_category": {k: round(calls[k], 2) for k in per_cat},
        "kernel_us_per_step": round(sum(per_cat.values()), 2),
        "top_kernels": [{"name": k[:120], "us_per_step": round(us, 2), "calls_per_step": round(c, 2)}
                        for k, us, c in kernels[:rows]],
    }
