"""Fit of the 2:4 planner's plan costs (csrc/cuda/sparse/marlin_24.cu: PlanCost, kLatencyCost,
kFineCost) from forced plans timed on an H200 (benchmarks/results/2_4/h200-plan-cost.json, written
from benchmarks/probe_2_4.py runs with MARLIN_LOG_PLAN; NOTES.md 2026-11-29 (eighteenth)).

A plan of the mma.sync kernel on 256-column tiles is `parts` K parts for each column tile, summed in
a thread-block cluster or through global memory. Its features: stages per part (S), blocks on the
busiest SM (B: for a cluster plan from where the GPU places clusters, for a global one
ceil(blocks / SMs)), and for a global plan 1 and rows x parts / k-tiles. The time model is
t = a + stage S + shared_stage S B + block B + global (global_sum + global_rows rows parts / k-tiles),
fitted by least squares on relative error; `a` does not change a pick. Each layer is then left
out of the fit in turn and its pick compared with its fastest measured plan; the rows marked
"check" (timed after the fit, on the code that landed) test the landed constants.

    python -m benchmarks.fit_plan_cost_24
"""

from __future__ import annotations

import collections
import json
import math
import os

import numpy as np

DATA = os.path.join(os.path.dirname(__file__), "results", "2_4", "h200-plan-cost.json")
SMS = 132  # H200
BLOCKS_PER_SM = 3  # the 8- and 16-row mma.sync instances (group 128 and FINE) on the H200
# clusters of 2-8 blocks that the H200 places one block per SM, and that are resident at once at
# 3 blocks per SM (benchmarks/cluster_placement.cu, NOTES.md 2026-11-29 (seventeenth))
SPREAD = {2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15}
RESIDENT = {2: 198, 3: 124, 4: 92, 5: 69, 6: 62, 7: 47, 8: 45}
LONG_PART_STAGES = 24  # marlin_24.cu kLongPartStages
LANDED = {  # marlin_24.cu
    "latency": dict(stage=0.16, shared_stage=0.34, block=0.17, global_sum=1.03, global_rows=0.0),
    "fine": dict(stage=0.27, shared_stage=0.36, block=1.11, global_sum=0.47, global_rows=1.83),
}
TERMS = ("stage", "shared_stage", "block", "global_sum", "global_rows")


def load() -> list[dict]:
    with open(DATA) as f:
        d = json.load(f)
    return [dict(zip(d["columns"], row)) for row in d["rows"]]


def busiest(tiles: int, parts: int, cluster: bool) -> int:
    if cluster:
        return 1 if tiles <= SPREAD[parts] else -(-tiles // SPREAD[parts])
    return -(-tiles * parts // SMS)


def rows_of(m: int) -> int:
    return min(m, 8 if m <= 8 else 16)


def features(k: int, n: int, m: int, parts: int, cluster: bool) -> list[float] | None:
    """The terms of one plan, or None where the planner would not cost it (not one wave, a
    cluster plan whose clusters are not all resident, more than SMS / 2 column tiles)."""
    k_tiles, tiles = k // 128, n // 256
    cluster = cluster and parts > 1
    if tiles * parts > BLOCKS_PER_SM * SMS or 2 * tiles > SMS or (cluster and RESIDENT.get(parts, 0) < tiles):
        return None
    stages, b = math.ceil(k_tiles / parts), busiest(tiles, parts, cluster)
    glob = parts > 1 and not cluster
    return [stages, stages * b, b, float(glob), glob * rows_of(m) * parts / k_tiles]


def allowed(kind: str, f: list[float]) -> bool:
    """The global plans that the planner does not cost (and the fit leaves out): more than two
    blocks on an SM, and at 1-3 rows with group 128 two on an SM where the parts are short. The
    linear model has them cheaper than they ran: group 64 on 70B down at 1-4 rows, 12 parts (3
    blocks on an SM) 34.5-37.4 us against 8 parts 31.6-33.5; while two blocks on an SM pay on the
    FINE kernels' 13824 x 5120 at one row (12 parts, 9 stages each: 14.1 us against 17.3 for 8)."""
    stages, _, b, glob, _ = f
    if kind == "latency":
        return not (glob and (b > 2 or (b == 2 and stages < LONG_PART_STAGES)))
    return not (glob and b > 2)


def within_part_limit(p: dict) -> bool:
    """The planner's limit on global plans, parts^2 x rows <= 16 x k-tiles (the last block reads
    every part's rows; 16 rows for the 16-row slice): such plans are timed and fitted, never picked."""
    limit_rows = 16 if p["m"] > 8 else rows_of(p["m"])
    return p["cluster"] or p["parts"] ** 2 * limit_rows <= 16 * (p["k"] // 128)


def select(points: list[dict], kind: str) -> list[dict]:
    """The plans of one model's kind that the planner would cost or leave out (`allowed`)."""
    out = []
    for p in points:
        if p["wgmma"] or p["n"] % 256 or p["slice_rows"] not in (8, 16):
            continue
        if kind == "latency" and (p["fine"] or p["m"] > 3):
            continue
        if kind == "fine" and not p["fine"]:
            continue
        f = features(p["k"], p["n"], p["m"], p["parts"], p["cluster"])
        if f is not None:
            out.append({**p, "f": f, "allowed": allowed(kind, f)})
    return out


def fit(points: list[dict], kind: str) -> dict:
    points = [p for p in points if p["allowed"]]
    cols = [0, 1, 2, 3] + ([4] if kind == "fine" else [])
    a = np.array([[1.0] + [p["f"][c] for c in cols] for p in points])
    y = np.array([p["time_us"] for p in points])
    coef, *_ = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)
    terms = {TERMS[c]: float(v) for c, v in zip(cols, coef[1:])}
    return {t: terms.get(t, 0.0) for t in TERMS}


def cost(c: dict, f: list[float]) -> float:
    return sum(c[t] * v for t, v in zip(TERMS, f))


def pick_losses(points: list[dict], c: dict) -> dict:
    """Per (layer, rows, group): the time of the model's pick among the measured plans that it
    costs / the best of those. (Against every measured plan, the plans left out included, the
    FINE picks lose no more; the group-128 ones would lose up to 33% on 13824 x 5120 and 11008 x
    5120 at 3 rows, but only because the fit runs timed no plan of 6 parts through global memory
    there: the landed planner picks that one, 14.0 us, against 14.2 for 13 parts, role "check".)"""
    by = collections.defaultdict(dict)
    for p in filter(within_part_limit, points):
        if not p["allowed"]:
            continue
        key = (p["layer"], p["m"], p["group"], p["zero_points"])
        plan = (p["parts"], p["cluster"] and p["parts"] > 1)
        by[key][plan] = min(p["time_us"], by[key].get(plan, (math.inf, None))[0]), p["f"]
    out = {}
    for key, plans in by.items():
        best = min(t for t, _ in plans.values())
        pick = min(plans.values(), key=lambda tf: cost(c, tf[1]))
        out[key] = pick[0] / best - 1
    return out


def left_out_losses(train: list[dict], kind: str) -> list[float]:
    """Each layer left out of the fit in turn: its picks' losses over its best plans."""
    losses = []
    for layer in sorted({p["layer"] for p in train}):
        held = fit([p for p in train if p["layer"] != layer], kind)
        losses += list(pick_losses([p for p in train if p["layer"] == layer], held).values())
    return losses


def main() -> None:
    points = load()
    for kind in ("latency", "fine"):
        pts = select(points, kind)
        train = [p for p in pts if p["role"] == "fit"]
        c = fit(train, kind)
        print(f"{kind}: {sum(p['allowed'] for p in train)} plans; fitted " + ", ".join(f"{t} {v:.2f}" for t, v in c.items()))
        print("  landed   " + ", ".join(f"{t} {v:.2f}" for t, v in LANDED[kind].items()))
        losses = left_out_losses(train, kind)
        print(f"  each layer left out: its pick {100 * np.mean(losses):.1f}% over its best plan on average, "
              f"{100 * max(losses):.1f}% at most ({len(losses)} layer x rows points)")
        check = [p for p in pts if p["role"] == "check"]
        if check:
            lc = pick_losses(check, LANDED[kind])
            worst = sorted(lc.items(), key=lambda kv: -kv[1])[:3]
            print(f"  later runs, landed constants: {100 * np.mean(list(lc.values())):.1f}% on average over "
                  f"{len(lc)} points; worst " + ", ".join(f"{k[0]} M={k[1]} g{k[2]}{' zp' if k[3] else ''} +{100 * v:.0f}%" for k, v in worst))


if __name__ == "__main__":
    main()
