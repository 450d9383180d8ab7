"""Development probe: the prefill kernel's tile height (128 or 256 rows) forced both ways against
the planner's default, for checking and re-fitting the round model of prefill_pick_tile_m.

    python -m benchmarks.probe_tile_height --shapes 70B_o,7B_qkv,5120x5120 --ms 256,320,576 --runs 2

Each setting runs `benchmarks.probe_prefill` in its own process (the knobs are read once per
process): `MARLIN_PREFILL=1 MARLIN_PREFILL_ROWS=128`, the same with 256, and the default plan, in
that order, `--runs` times. Kernels: dense group 128, dense per column, 2:4 group 128 (each has its
own model constants). Prints, per point and kernel, the speedup over the faster FP16 of the same
process (mean over runs) for both heights and the default, and flags the points where the
default is more than --tol slower than the faster forced height. --out writes every setting's
points and the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from statistics import mean

SETTINGS = {"128": {"MARLIN_PREFILL": "1", "MARLIN_PREFILL_ROWS": "128"},
            "256": {"MARLIN_PREFILL": "1", "MARLIN_PREFILL_ROWS": "256"},
            "default": {}}
KERNELS = ("marlin_g128", "marlin_gcol", "marlin_24_g128")


def summarize(runs: dict[str, list[list[dict]]], tol: float = 0.02) -> list[dict]:
    """runs: setting -> one list of probe_prefill points per run. One row per (shape, M, kernel):
    speedup over the faster FP16 of the same process for each setting (mean over runs), the faster
    forced height, and whether the default is more than `tol` slower than it."""
    speed: dict[tuple, dict[str, list[float]]] = {}
    for setting, run_list in runs.items():
        for points in run_list:
            t = {(p["shape"], p["K"], p["N"], p["M"], p["kernel"]): p["time_us"] for p in points}
            for (s, k, n, m, kern), us in t.items():
                if kern not in KERNELS:
                    continue
                fp16 = min(t[(s, k, n, m, "fp16")], t[(s, k, n, m, "fp16_kn")])
                speed.setdefault((s, k, n, m, kern), {}).setdefault(setting, []).append(fp16 / us)
    rows = []
    for (s, k, n, m, kern), by in sorted(speed.items(), key=lambda kv: (kv[0][0], kv[0][3], KERNELS.index(kv[0][4]))):
        x = {setting: mean(v) for setting, v in by.items()}
        row = {"shape": s, "K": k, "N": n, "M": m, "kernel": kern, **{f"x_{a}": x.get(a) for a in SETTINGS}}
        if "128" in x and "256" in x:
            row["faster"] = 128 if x["128"] >= x["256"] else 256
            if "default" in x:
                row["default_short"] = x["default"] < (1 - tol) * max(x["128"], x["256"])
        rows.append(row)
    return rows


def _run(setting: str, shapes: str, ms: str, rounds: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "points.json")
        env = {k: v for k, v in os.environ.items() if k not in ("MARLIN_PREFILL", "MARLIN_PREFILL_ROWS")}
        env.update(SETTINGS[setting], PROBE_SHAPES=shapes, PROBE_MS=ms, PROBE_ROUNDS=str(rounds), PROBE_24="1",
                   PROBE_OUT=out)
        r = subprocess.run([sys.executable, "-m", "benchmarks.probe_prefill"], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"probe_prefill ({setting}) failed:\n{r.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)["points"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", required=True, help="benchmarks/shapes.py names or KxN, comma-separated")
    p.add_argument("--ms", required=True, help="rows per call, comma-separated (the model decides from 256)")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12, help="probe_prefill's rounds per run")
    p.add_argument("--tol", type=float, default=0.02, help="flag a default more than this much slower")
    p.add_argument("--out", help="JSON with every setting's points and the summary")
    a = p.parse_args(argv)
    if a.runs < 1 or a.rounds < 1:
        raise SystemExit(f"--runs and --rounds must be >= 1, got {a.runs} and {a.rounds}")
    runs: dict[str, list[list[dict]]] = {s: [] for s in SETTINGS}
    for _ in range(a.runs):
        for setting in SETTINGS:
            runs[setting].append(_run(setting, a.shapes, a.ms, a.rounds))
    rows = summarize(runs, a.tol)
    print(f"{'shape':12s} {'M':>5s} {'kernel':15s} | x fp16: {'128':>6s} {'256':>6s} {'default':>7s} | faster")
    for r in rows:
        flag = "  <- default short" if r.get("default_short") else ""
        print(f"{r['shape']:12s} {r['M']:5d} {r['kernel']:15s} |         {r['x_128']:6.3f} {r['x_256']:6.3f} "
              f"{r['x_default']:7.3f} | {r['faster']}{flag}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"argv": sys.argv[1:], "runs": runs, "summary": rows}, f, indent=1)


if __name__ == "__main__":
    main()
