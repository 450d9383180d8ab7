"""Does marlin's speedup hold under sustained load?  The ideal layer, held for a while per batch class.

    python -m benchmarks.sustained                 # M in {1, 16, 64, 256}, 60 s each (about 5 minutes)
    python -m benchmarks.sustained --quick         # 10 s each
    python -m benchmarks.sustained --dry-run       # CPU smoke run (tiny shape, 1 s each, no clocks)

For each batch class M, marlin_g128 and fp16 run in alternating bursts of about --burst-ms each
(so both see the same thermal and clock state) for --seconds; every call is timed with CUDA events.
Meanwhile ``nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu -lms 500``
samples the clocks in a subprocess (read only: clocks and power limits are never changed).

Writes benchmarks/results/<gpu>-sustained.json: per class and second the median call time of each
kernel and the speedup, the nvidia-smi samples, and per class whether the speedup held (median of
the last window within --tol of the first window; window = min(10 s, duration / 3)).
``python -m benchmarks.report`` plots it.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch

from . import bench_gemm as B
from . import bench_math as BM
from . import provenance as PV
from . import gemm_prep as GP
from . import shapes as S

SMI_FIELDS = ("sm_mhz", "mem_mhz", "power_w", "temp_c")
SMI_QUERY = "clocks.sm,clocks.mem,power.draw,temperature.gpu"
DEFAULT_MS = (1, 16, 64, 256)
HOLD_TOL = 0.05
KERNEL_PAIR = ("marlin_g128", "fp16")


# ----------------------------------------------------------------------------- pure helpers


def parse_smi_line(line: str) -> Optional[dict]:
    """'1980, 2619, 350.12, 45' -> {sm_mhz: 1980.0, ...}; fields nvidia-smi cannot read ('[N/A]') -> None."""
    parts = [p.strip() for p in line.strip().split(",")]
    if len(parts) != len(SMI_FIELDS):
        return None
    out = {}
    for name, p in zip(SMI_FIELDS, parts):
        try:
            out[name] = float(p)
        except ValueError:
            out[name] = None
    if all(v is None for v in out.values()):
        return None
    return out


def window_s(duration_s: float) -> float:
    """Length of the first / last window compared for stability."""
    return max(1.0, min(10.0, duration_s / 3.0))


def _median(xs):
    xs = [x for x in xs if x is not None and BM._finite(x)]
    return statistics.median(xs) if xs else None


def stability(rows: list[dict], duration_s: float, tol: float = HOLD_TOL, key: str = "speedup") -> dict:
    """Median of rows[key] in the first and last window (rows carry t_s, the start of their
    one-second bucket since the class started); holds = |last / first - 1| <= tol."""
    w = window_s(duration_s)
    rows = [r for r in rows if r["t_s"] < duration_s]  # the partial bucket past the deadline: out
    first = _median([r.get(key) for r in rows if r["t_s"] < w])
    last = _median([r.get(key) for r in rows if r["t_s"] >= duration_s - w])
    change = (last / first - 1.0) if (first and last) else None
    return {
        "window_s": w,
        "first": first,
        "last": last,
        "change": change,
        "tol": tol,
        "holds": (abs(change) <= tol) if change is not None else None,
    }


def clock_summary(samples: list[dict], t0: float, t1: float, duration_s: float) -> dict:
    """Median SM clock / power / temperature of the samples in the first and last window of [t0, t1)."""
    w = window_s(duration_s)
    first = [s for s in samples if t0 <= s["t_s"] < t0 + w]
    last = [s for s in samples if t1 - w <= s["t_s"] < t1]
    out = {}
    for name in SMI_FIELDS:
        out[f"{name}_first"] = _median([s.get(name) for s in first])
        out[f"{name}_last"] = _median([s.get(name) for s in last])
    return out


# ----------------------------------------------------------------------------- nvidia-smi sampler


class SmiSampler:
    """nvidia-smi in a subprocess, one line per interval; samples carry t_s since `t0`."""

    def __init__(self, t0: float, interval_ms: int = 500, gpu_id: Optional[str] = None):
        self.t0 = t0
        self.cmd = ["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits", f"-lms={interval_ms}"]
        if gpu_id:
            self.cmd.append(f"--id={gpu_id}")
        self.samples: list[dict] = []
        self.error: Optional[str] = None
        self._proc = None
        self._thread = None

    def start(self) -> bool:
        if shutil.which("nvidia-smi") is None:
            self.error = "nvidia-smi not found: no clock / power samples"
            return False
        try:
            self._proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        except OSError as e:
            self.error = f"nvidia-smi failed to start: {e}"
            return False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return True

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            s = parse_smi_line(line)
            if s is not None:
                s["t_s"] = time.monotonic() - self.t0
                self.samples.append(s)

    def stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is not None and not self.samples:
            err = (self._proc.stderr.read() if self._proc.stderr else "") or ""
            self.error = f"nvidia-smi exited with {self._proc.returncode}: {err.strip()[:200]}"
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=5)


def smi_gpu_id(dev: torch.device) -> tuple[Optional[str], str]:
    """The nvidia-smi id of torch's device (its UUID when nvidia-smi lists it), and how it was found."""
    if dev.type != "cuda" or shutil.which("nvidia-smi") is None:
        return None, "no nvidia-smi"
    uuid = str(getattr(torch.cuda.get_device_properties(dev), "uuid", "") or "")
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        listed = []
    for u in listed:
        if uuid and u.strip().lower().endswith(uuid.lower()):
            return u.strip(), "uuid"
    if len(listed) == 1:
        return None, "the only GPU"
    return str(dev.index or 0), "index (UUID not matched: may be another GPU if CUDA_VISIBLE_DEVICES is set)"


# ----------------------------------------------------------------------------- the run


class CallTimer:
    """Times each call of a burst: CUDA events between consecutive calls, or perf_counter on CPU."""

    def __init__(self, dev: torch.device, n: int):
        self.dev = dev
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)] if dev.type == "cuda" else None
        self.stamps: list[float] = []

    def burst(self, fn, n: int) -> list[float]:
        """n calls of fn(i); seconds per call."""
        if self.events is None:
            self.stamps = [time.perf_counter()]
            for i in range(n):
                fn(i)
                self.stamps.append(time.perf_counter())
            return [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        self.events[0].record()
        for i in range(n):
            fn(i)
            self.events[i + 1].record()
        self.events[n].synchronize()
        return [self.events[i].elapsed_time(self.events[i + 1]) * 1e-3 for i in range(n)]


def rotating_fns(preps: dict, a: torch.Tensor) -> dict:
    """{kernel: fn(i)} whose call i uses weight copy i % copies (gemm_prep's preps)."""
    return {name: (lambda f, c: (lambda i: f(i % c)))(p.make_fn(a), p.copies) for name, p in preps.items()}


def burst_timers(fns: dict, dev, burst_s: float, max_calls: int = 10000) -> tuple[dict, dict]:
    """({kernel: calls per burst of about burst_s}, {kernel: its CallTimer}), after two warm-up calls
    and one timed call of each."""
    counts, timers = {}, {}
    for name, fn in fns.items():
        fn(0)
        fn(1)
        t = CallTimer(dev, 1).burst(fn, 1)[0]
        counts[name] = max(1, min(max_calls, round(burst_s / max(t, 1e-7))))
        timers[name] = CallTimer(dev, counts[name])
    return counts, timers


def run_class(preps: dict, m: int, k: int, dev, seconds: float, burst_s: float) -> list[dict]:
    """Alternate bursts of marlin_g128 and fp16 for `seconds`; per-second medians."""
    a = torch.randn(m, k, dtype=torch.float16, device=dev)
    fns = rotating_fns(preps, a)
    counts, timers = burst_timers(fns, dev, burst_s)
    per_sec: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    t0 = time.monotonic()
    while True:  # one round = a burst of each kernel; a round counts for the second in which it ended
        got = {name: timers[name].burst(fn, counts[name]) for name, fn in fns.items()}
        now = time.monotonic() - t0
        for name, durations in got.items():
            per_sec[int(now)][name].extend(durations)
        if now >= seconds:
            break
    rows = []
    for sec in sorted(per_sec):
        d = per_sec[sec]
        row = {"t_s": sec}  # calls whose burst ended in [sec, sec + 1) s after the class started
        for name in KERNEL_PAIR:
            xs = d.get(name, [])
            row[f"{name}_us"] = statistics.median(xs) * 1e6 if xs else None
            row[f"n_{name}"] = len(xs)
        tm, tf = row["marlin_g128_us"], row["fp16_us"]
        row["speedup"] = tf / tm if (tm and tf) else None
        rows.append(row)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.sustained", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="10 s per batch class")
    g.add_argument("--dry-run", action="store_true", help="CPU smoke run: tiny shape, 1 s per class, no clocks")
    p.add_argument("--seconds", type=float, help="seconds per batch class (default 60; --quick 10)")
    p.add_argument("--ms", help="comma-separated batch classes (default 1,16,64,256)")
    p.add_argument("--shape", default=S.IDEAL, help="shape name from benchmarks/shapes.py (default: ideal)")
    p.add_argument("--burst-ms", type=float, default=50.0, help="length of one kernel's burst (default 50)")
    p.add_argument("--interval-ms", type=int, default=500, help="nvidia-smi sampling interval (default 500)")
    p.add_argument("--tol", type=float, default=HOLD_TOL, help="allowed change of the speedup, last vs first window")
    p.add_argument("--out", help="results JSON (default benchmarks/results/<gpu>-sustained.json)")
    B.add_provenance_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import marlin  # noqa: F401

    dev = B.pick_device(args.dry_run)
    seconds = args.seconds if args.seconds is not None else (1.0 if args.dry_run else 10.0 if args.quick else 60.0)
    ms = B._parse_list(args.ms, int) or ([1, 16] if args.dry_run else list(DEFAULT_MS))
    mode = "dry-run" if args.dry_run else "quick" if args.quick else "full"

    facts = PV.device_facts(dev)
    if args.dry_run:
        shape, (k, n) = "tiny_512x384", B.DRY_SHAPES["tiny_512x384"]
    else:
        known = {**S.BENCH_SHAPES, **S.MODEL_LAYERS, **S.roofline_shapes(), S.IDEAL: S.ideal_shape(facts["sms"])}
        if args.shape not in known:
            raise SystemExit(f"unknown shape {args.shape!r}")
        shape, (k, n) = args.shape, known[args.shape]
    meta = PV.collect_meta(dev, mode, kind="sustained", expect_rev=args.git_rev, expect_tree=args.csrc_tree)
    warn = PV.dirty_warning(meta)
    if warn:
        print(warn, file=sys.stderr, flush=True)
    out_path = Path(args.out) if args.out else (
        Path(tempfile.gettempdir()) / "marlin-sustained-dry-run.json" if args.dry_run
        else BM.RESULTS_DIR / f"{meta['gpu_slug']}-sustained.json"
    )

    print(f"{meta['gpu']}: {shape} (K={k}, N={n}), M in {ms}, {seconds:g} s each -> {out_path}", flush=True)
    preps, checks = {}, []
    try:
        for name in KERNEL_PAIR:
            preps[name] = GP.prepare(name, k, n, dev, facts["l2_bytes"], 2 if dev.type != "cuda" else 1)
            checks += [{"shape": shape, "kernel": name, "K": k, "N": n, **c} for c in preps[name].checks]
    except GP.CorrectnessError as e:
        print(f"ABORTED: {e}\nNo results file was written.", file=sys.stderr)
        return 2

    gpu_id, id_how = smi_gpu_id(dev)
    t_run0 = time.monotonic()
    sampler = SmiSampler(t_run0, args.interval_ms, gpu_id)
    sampling = dev.type == "cuda" and sampler.start()
    if dev.type == "cuda" and not sampling:
        print(f"WARNING: {sampler.error}", file=sys.stderr)
    classes = []
    try:
        for m in ms:
            c0 = time.monotonic() - t_run0
            rows = run_class(preps, m, k, dev, seconds, args.burst_ms * 1e-3)
            c1 = time.monotonic() - t_run0
            for r in rows:
                r["t_run_s"] = c0 + r["t_s"]
            st = stability(rows, seconds, args.tol)
            classes.append({"M": m, "t_start_s": c0, "t_end_s": c1, "seconds": rows, "stability": st})
            first, last = st["first"], st["last"]
            verdict = {True: "holds", False: "DOES NOT HOLD", None: "n/a"}[st["holds"]]
            print(f"M={m}: speedup first {st['window_s']:.0f} s {first or float('nan'):.2f}x, last "
                  f"{last or float('nan'):.2f}x -> {verdict}", flush=True)
    finally:
        if sampling:
            sampler.stop()
    samples = sampler.samples if sampling else []
    for c in classes:
        c["clocks"] = clock_summary(samples, c["t_start_s"], c["t_end_s"], seconds)
        for s in samples:
            if c["t_start_s"] <= s["t_s"] < c["t_end_s"]:
                s["M"] = c["M"]
    meta.update(
        {
            "shape": shape,
            "K": k,
            "N": n,
            "ms": ms,
            "seconds_per_class": seconds,
            "burst_ms": args.burst_ms,
            "tol": args.tol,
            "smi_cmd": " ".join(sampler.cmd) if dev.type == "cuda" else None,
            "smi_gpu": id_how,
            "smi_error": sampler.error,
            "method": (
                "per batch class: marlin_g128 and fp16 in alternating bursts of ~burst_ms each for "
                "seconds_per_class; every call timed with CUDA events; per-second medians; speedup = "
                "fp16 / marlin_g128; holds = |median(last window) / median(first window) - 1| <= tol, "
                "window = min(10 s, seconds / 3); clocks sampled read-only with nvidia-smi"
            ),
            "notes": [],
        }
    )
    result = {"meta": meta, "checks": checks, "classes": classes, "samples": samples}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(B.dump_results(result))
    print(f"wrote {out_path}")
    if warn:
        print(warn, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
