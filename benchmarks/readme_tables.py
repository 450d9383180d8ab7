"""The README's result tables, computed from the committed results files.

    python -m benchmarks.readme_tables            # print every table, each under its files' names
    python -m benchmarks.readme_tables --check    # exit 1 where a README table differs from its files

A table in the README is the output of one function below on one or two files of
benchmarks/results/; `--check` (and tests/test_readme_tables.py, on CI) fails when the README holds a
different table, so a re-measured file cannot leave the README's numbers behind, and a number
edited by hand shows.  The prose around the tables quotes figures too; those are not checked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, Optional

from . import bench_math as BM

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

# the kernel tables' layers, in the README's order, with the names it gives them
LAYERS = (("ideal", "ideal"), ("70B_gateup", "70B gate_up"), ("70B_down", "70B down"), ("70B_o", "70B o"),
          ("70B_qkv", "70B qkv"), ("7B_gateup", "7B gate_up"), ("7B_qkv", "7B qkv"), ("7B_down", "7B down"),
          ("7B_o", "7B o"))
KERNEL_TABLE_M = (1, 16, 32, 64, 128, 256, 1024, 4096)
# the formats tables: kernel -> column, each as time relative to fp16 group 128
FORMAT_COLUMNS = (("marlin_bf16_g128", "bf16 g128"), ("marlin_zp_g128", "zero points g128"), ("marlin_g64", "g64"),
                  ("marlin_g32", "g32"), ("marlin_u8_g128", "8-bit g128"), ("marlin_24_g128", "2:4 g128"))
FORMAT_TABLE_M = (1, 8, 16, 32, 64, 128, 256, 1024, 4096)


def _load(name: str, results: Path) -> dict:
    return json.loads((results / name).read_text())


def kernel_table(data: dict) -> list[str]:
    """marlin_g128's speedup over the faster FP16 layout per layer and M; at M = 1 also its share of
    the copy bandwidth measured in the same run; the best M = 1 speedup in bold."""
    idx = BM.time_index(data["points"])
    dims = {BM.canonical_shape(p["shape"]): (int(p["K"]), int(p["N"])) for p in data["points"]}
    copy_bw = float(data["meta"]["copy_bw_GBps"])
    speed = {(s, m): BM.fp16_time(idx, s, m) / idx[(s, m, "marlin_g128")] for s, _ in LAYERS for m in KERNEL_TABLE_M}
    best = max(speed[(s, 1)] for s, _ in LAYERS)
    lines = ["| layer (K x N) | " + " | ".join(f"M={m}" for m in KERNEL_TABLE_M) + " |",
             "|---|" + "---|" * len(KERNEL_TABLE_M)]
    for shape, name in LAYERS:
        k, n = dims[shape]
        bw = 100 * BM.gbps(BM.kernel_bytes("marlin_g128", k, n, 1), idx[(shape, 1, "marlin_g128")]) / copy_bw
        first = f"{speed[(shape, 1)]:.2f}x"
        if speed[(shape, 1)] == best:
            first = f"**{first}**"
        cells = [f"{first} ({bw:.0f}% BW)"] + [f"{speed[(shape, m)]:.2f}x" for m in KERNEL_TABLE_M[1:]]
        lines.append(f"| {name} {k} x {n} | " + " | ".join(cells) + " |")
    return lines


def formats_table(data: dict) -> list[str]:
    """Each format's time relative to fp16 group 128 in the same run: median over the layers / the
    worst layer, per M."""
    idx = BM.time_index(data["points"])
    shapes = sorted({s for (s, _, k) in idx if k == "marlin_g128"})
    lines = ["| M | " + " | ".join(label for _, label in FORMAT_COLUMNS) + " |", "|---|" + "---|" * len(FORMAT_COLUMNS)]
    for m in FORMAT_TABLE_M:
        cells = []
        for kernel, _ in FORMAT_COLUMNS:
            r = [idx[(s, m, kernel)] / idx[(s, m, "marlin_g128")] for s in shapes if (s, m, kernel) in idx]
            cells.append(f"{statistics.median(r):.2f} / {max(r):.2f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def _batch_table(batches: list[int], rows: list[tuple[str, Callable[[int], str]]]) -> list[str]:
    """A table with one column per batch and one row per (label, cell of a batch)."""
    lines = ["| batch | " + " | ".join(str(b) for b in batches) + " |", "|---|" + "---|" * len(batches)]
    return lines + [f"| {label} | " + " | ".join(cell(b) for b in batches) + " |" for label, cell in rows]


def e2e_table(data: dict) -> list[str]:
    """Time per output token per batch: FP16 and fused FP16 (the faster weight layout of each), Marlin
    and Marlin 2:4, and the speedups over them."""
    tpot: dict[tuple[str, int], float] = {}
    for p in data["points"]:
        if p.get("mode", "compiled") == "compiled" and p.get("tpot_ms"):
            tpot[(p["kernel"], int(p["batch"]))] = float(p["tpot_ms"])
    batches = sorted({b for (k, b) in tpot if k == "marlin"})

    def faster(kernel: str, b: int) -> float:
        return min(t for t in (tpot.get((kernel, b)), tpot.get((kernel + "_kn", b))) if t is not None)

    rows = [("FP16 ms per token", lambda b: f"{faster('fp16', b):.2f}"),
            ("FP16 fused ms per token", lambda b: f"{faster('fp16_fused', b):.2f}"),
            ("Marlin ms per token", lambda b: f"{tpot[('marlin', b)]:.2f}"),
            ("Marlin x FP16", lambda b: f"{faster('fp16', b) / tpot[('marlin', b)]:.2f}x"),
            ("Marlin x FP16 fused", lambda b: f"{faster('fp16_fused', b) / tpot[('marlin', b)]:.2f}x"),
            ("Marlin 2:4 ms per token", lambda b: f"{tpot[('marlin_24', b)]:.2f}"),
            ("2:4 x FP16 fused", lambda b: f"{faster('fp16_fused', b) / tpot[('marlin_24', b)]:.2f}x")]
    return _batch_table(batches, rows)


def tp_table(two: dict, one: dict) -> list[str]:
    """Tokens per second of the tensor-parallel files: FP16 and Marlin at TP=2, the speedups of Marlin
    and 2:4 over FP16 there, and Marlin on one GPU."""
    def rates(data: dict) -> dict[tuple[str, int], float]:
        return {(r["kind"], int(p["batch"])): float(p["tokens_per_s"]) for r in data["runs"] for p in r["points"]}

    t2, t1 = rates(two), rates(one)
    batches = sorted({b for (k, b) in t2 if k == "fp16"})
    rows = [("FP16 TP=2 tokens/s", lambda b: f"{t2[('fp16', b)]:.1f}"),
            ("Marlin TP=2 tokens/s", lambda b: f"{t2[('marlin', b)]:.1f}"),
            ("Marlin TP=2 x FP16 TP=2", lambda b: f"{t2[('marlin', b)] / t2[('fp16', b)]:.2f}x"),
            ("Marlin 2:4 TP=2 x FP16 TP=2", lambda b: f"{t2[('marlin_24', b)] / t2[('fp16', b)]:.2f}x"),
            ("Marlin on one GPU tokens/s", lambda b: f"{t1[('marlin', b)]:.1f}")]
    return _batch_table(batches, rows)


def serving_table(data: dict) -> list[str]:
    """Per request rate: median time per output token of FP16, fused FP16, Marlin and Marlin 2:4, the
    speedups over them, median time to first token, and the mean rows per decode step."""
    point = {(p["kernel"], float(p["rate"])): p for p in data["points"]}
    kinds = ("fp16", "fp16_fused", "marlin", "marlin_24")
    lines = ["| request rate | FP16 / FP16 fused / Marlin / Marlin 2:4 TPOT (median) | Marlin x FP16 | Marlin x FP16 fused | "
             "2:4 x FP16 fused | TTFT FP16 / fused / Marlin / 2:4 (median) | rows per step FP16 / fused / Marlin / 2:4 |",
             "|---|---|---|---|---|---|---|"]
    for rate in sorted({r for (k, r) in point if k == "marlin"}):
        p = {k: point[(k, rate)] for k in kinds}
        tpot = {k: p[k]["tpot_ms_median"] for k in kinds}
        cells = [f"{rate:g} req/s", " / ".join(f"{tpot[k]:.2f}" for k in kinds) + " ms",
                 f"{tpot['fp16'] / tpot['marlin']:.2f}x", f"{tpot['fp16_fused'] / tpot['marlin']:.2f}x",
                 f"{tpot['fp16_fused'] / tpot['marlin_24']:.2f}x",
                 " / ".join(f"{p[k]['ttft_ms_median']:.1f}" for k in kinds) + " ms",
                 " / ".join(f"{p[k]['mean_rows']:.1f}" for k in kinds)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# (files, function): every table of results that the README shows
TABLES: tuple[tuple[tuple[str, ...], Callable[..., list[str]]], ...] = (
    (("h200.json",), kernel_table),
    (("h100-80gb-hbm3.json",), kernel_table),
    (("h100-80gb-hbm3-formats.json",), formats_table),
    (("h200-formats.json",), formats_table),
    (("h100-80gb-hbm3-e2e.json",), e2e_table),
    (("h200-e2e.json",), e2e_table),
    (("h100-80gb-hbm3-serving.json",), serving_table),
    (("h200x2-tp.json", "h200x1-tp.json"), tp_table),
)


def tables(results: Path = RESULTS) -> list[tuple[str, list[str]]]:
    """(files, table lines) for every entry of TABLES whose files are there."""
    out = []
    for files, fn in TABLES:
        if all((results / f).exists() for f in files):
            out.append((", ".join(files), fn(*(_load(f, results) for f in files))))
    return out


def check(readme_text: str, results: Path = RESULTS) -> list[str]:
    """One message per table whose lines do not stand in the README as one block, with the first
    line that differs (a table missing from the README counts too)."""
    lines = readme_text.splitlines()
    problems = []
    for files, table in tables(results):
        body = table[2:]  # the README may word a header cell differently; the rows carry the numbers
        starts = [i for i, line in enumerate(lines) if line.split("|")[1:2] == body[0].split("|")[1:2]]
        if any(lines[i:i + len(body)] == body for i in starts):
            continue
        # the README block most like the table (two tables may share a first row label) and its first
        # differing row
        best: Optional[str] = None
        if starts:
            i = max(starts, key=lambda s: sum(a == b for a, b in zip(body, lines[s:s + len(body)])))
            j = next(j for j, want in enumerate(body) if i + j >= len(lines) or lines[i + j] != want)
            have = lines[i + j] if i + j < len(lines) else "(end of file)"
            best = f"README line {i + j + 1}: {have!r}, from the files: {body[j]!r}"
        problems.append(f"{files}: the README does not hold this table" + (f" ({best})" if best else " (no row of it)"))
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare with README.md; exit 1 on a difference")
    p.add_argument("--readme", type=Path, default=REPO / "README.md")
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.check:
        problems = check(args.readme.read_text(), args.results)
        for msg in problems:
            print(msg)
        print(f"{len(tables(args.results)) - len(problems)} of {len(tables(args.results))} tables match {args.readme}")
        return 1 if problems else 0
    for files, table in tables(args.results):
        print(f"{files}:\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
