"""Development probe: each kernel's time, SM clock and power under sustained back-to-back calls.

    PWR_SHAPES=70B_o,7B_gateup PWR_MS=1024,4096 PWR_KERNELS=fp16,fp16_kn,marlin_g128,marlin_gcol \
        python -m benchmarks.probe_power out.json

At large M every kernel on an H200 runs at the 700 W limit, where the SM clock is what the kernel's
power draw per cycle leaves, so a ratio of call times mixes the kernels' cycles with their clocks.
This probe runs each kernel in bursts of PWR_BURST seconds (default 0.4) of back-to-back calls,
PWR_ROUNDS rounds (default 3) in rotating order, while nvidia-smi samples clocks and power every
20 ms (read only), and prints per kernel: the median call time after the first quarter of each
burst, the median SM clock and power in the same windows, and their product in cycles (kcycles).
Kernels are bench_gemm's (gemm_prep names); weights rotate through more memory than L2.
benchmarks/NOTES.md, 2026-11-28 (ninth), has its first table.
"""

import json
import os
import statistics
import sys
import time

import torch

import marlin  # noqa: F401  (registers the ops)
from benchmarks import gemm_prep as GP
from benchmarks import provenance as PV
from benchmarks import shapes as S
from benchmarks import sustained as SU
from benchmarks.sustained import SmiSampler, smi_gpu_id


def _window_median(samples, windows, key):
    """Median of nvidia-smi's `key` over the samples in the last three quarters of each window."""
    vals = [s[key] for s in samples for (a, b) in windows if a + 0.25 * (b - a) <= s["t_s"] <= b and s.get(key) is not None]
    return statistics.median(vals) if vals else None


def main(out_path):
    dev = torch.device("cuda")
    facts = PV.device_facts(dev)
    shapes = os.environ.get("PWR_SHAPES", "70B_o").split(",")
    ms = [int(x) for x in os.environ.get("PWR_MS", "4096").split(",")]
    kernels = os.environ.get("PWR_KERNELS", "fp16,fp16_kn,marlin_g128").split(",")
    burst_s = float(os.environ.get("PWR_BURST", "0.4"))
    rounds = int(os.environ.get("PWR_ROUNDS", "3"))
    gid, _ = smi_gpu_id(dev)
    t0 = time.monotonic()
    sampler = SmiSampler(t0, 20, gid)
    sampler.start()
    rows = []
    for shape in shapes:
        k, n = S.ideal_shape(facts["sms"]) if shape == "ideal" else S.shape_by_name(shape)
        preps = {name: GP.prepare(name, k, n, dev, facts["l2_bytes"], 1) for name in kernels}
        for m in ms:
            a = torch.randn(m, k, dtype=torch.float16, device=dev)
            fns = SU.rotating_fns(preps, a)
            counts, timers = SU.burst_timers(fns, dev, burst_s, max_calls=20000)
            time.sleep(1.0)
            windows = {name: [] for name in fns}
            calls = {name: [] for name in fns}
            for r in range(rounds):
                for name in kernels[r % len(kernels):] + kernels[:r % len(kernels)]:
                    start = time.monotonic() - t0
                    d = timers[name].burst(fns[name], counts[name])
                    windows[name].append((start, time.monotonic() - t0))
                    calls[name] += d[len(d) // 4:]
            time.sleep(0.2)
            for name in fns:
                us = statistics.median(calls[name]) * 1e6
                mhz = _window_median(sampler.samples, windows[name], "sm_mhz")
                row = dict(shape=shape, K=k, N=n, M=m, kernel=name, us=us, sm_mhz=mhz,
                           power_w=_window_median(sampler.samples, windows[name], "power_w"),
                           temp_c=_window_median(sampler.samples, windows[name], "temp_c"),
                           kcycles=us * mhz / 1e3 if mhz else None, tflops=2 * m * k * n / us / 1e6)
                rows.append(row)
                print(f"{shape:10s} M={m:5d} {name:14s} {us:9.1f} us {row['tflops']:6.0f} TF  sm {mhz} MHz  "
                      f"{row['power_w']} W  kcycles {row['kcycles'] and round(row['kcycles'])}", flush=True)
        for p in preps.values():
            p.free()
        torch.cuda.empty_cache()
    sampler.stop()
    with open(out_path, "w") as f:
        json.dump(dict(facts=facts, rows=rows, samples=sampler.samples), f)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "probe_power.json")
