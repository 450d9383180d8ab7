"""New / base time of an A/B run (scripts/ab_csrc.sh): per kernel and M, the median over the layers
of new / base, each point's time the fastest of its rounds (a disturbed round only slows a point).

    python -m benchmarks.ab_compare OUTDIR            # reads OUTDIR/ab_{base,new}_<round>.json
    python -m benchmarks.ab_compare OUTDIR --layers   # and each layer's ratio

The rounds alternate the order of the two trees (base first, then new first), so that neither
always runs on a warmer or cooler GPU; < 1 means the new tree is faster."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

_NAME = re.compile(r"ab_(base|new)_(\d+)\.json$")


def load(outdir: Path) -> dict[tuple[str, str, str, int], float]:
    """{(tree, kernel, shape, M): the fastest time in us over the rounds}; untimed points left out."""
    best: dict[tuple[str, str, str, int], float] = {}
    files = sorted(p for p in Path(outdir).iterdir() if _NAME.search(p.name))
    if not files:
        raise SystemExit(f"ab_compare: no ab_base_<r>.json / ab_new_<r>.json in {outdir}")
    for path in files:
        tree = _NAME.search(path.name).group(1)
        for p in json.loads(path.read_text())["points"]:
            t = p.get("time_us")
            if t is None:
                continue
            key = (tree, p["kernel"], p["shape"], int(p["M"]))
            best[key] = min(t, best.get(key, t))
    return best


def ratios(best: dict[tuple[str, str, str, int], float]) -> dict[tuple[str, int], dict[str, float]]:
    """{(kernel, M): {shape: new / base}} over the points timed in both trees."""
    out: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for (tree, kernel, shape, m), t in best.items():
        if tree == "new" and ("base", kernel, shape, m) in best:
            out[(kernel, m)][shape] = t / best[("base", kernel, shape, m)]
    return dict(out)


def table(rat: dict[tuple[str, int], dict[str, float]], per_layer: bool = False) -> str:
    lines = ["| kernel | M | layers | median new / base | fastest (layer) | slowest (layer) |",
             "|---|---:|---:|---:|---|---|"]
    for (kernel, m) in sorted(rat):
        r = rat[(kernel, m)]
        lo, hi = min(r, key=r.get), max(r, key=r.get)
        lines.append(f"| {kernel} | {m} | {len(r)} | {statistics.median(r.values()):.3f} | "
                     f"{r[lo]:.3f} ({lo}) | {r[hi]:.3f} ({hi}) |")
        if per_layer:
            lines += [f"|  |  | {s} | {v:.3f} |  |  |" for s, v in sorted(r.items())]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir", type=Path)
    p.add_argument("--layers", action="store_true", help="each layer's ratio under its kernel and M")
    args = p.parse_args(argv)
    rat = ratios(load(args.outdir))
    if not rat:
        print("ab_compare: no point was timed in both trees", file=sys.stderr)
        return 1
    print(table(rat, args.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
