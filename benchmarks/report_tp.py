"""Tensor-parallel decode results (benchmarks/bench_tp.py, ``meta.kind == "tp"``) -> markdown + PNG.

For ``<gpu>x<T>-tp.json``: tokens/s per batch for FP16 and Marlin, Marlin over FP16, and the plot
``<gpu>x<T>-tp.png``. When results of other world sizes of the same GPU lie next to it, a second
table sets each Marlin run against each FP16 run (e.g. Marlin on one GPU against FP16 on two).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.report_e2e import attention_note, pdl_note  # noqa: E402

__all__ = ["report_tp", "tokens_per_s"]


def tokens_per_s(data: dict) -> dict:
    """{kind: {batch: tokens/s}} of one results file (runs that failed, e.g. out of memory, omitted)."""
    return {r["kind"]: {p["batch"]: p["tokens_per_s"] for p in r["points"]} for r in data["runs"] if r.get("points")}


def _table(rows: dict, ratios: list) -> list:
    """rows: {column name: {batch: value}}; ratios: [(numerator column, denominator column), ...]."""
    names = list(rows)
    batches = sorted({b for col in rows.values() for b in col})
    head = "| batch | " + " | ".join(f"{n} tok/s" for n in names) + "".join(f" | {a} / {b}" for a, b in ratios) + " |"
    lines = [head, "|" + "---|" * (len(names) + 1 + len(ratios))]
    for b in batches:
        cells = [f"{rows[n][b]:.1f}" if b in rows[n] else "" for n in names]
        for num_col, den_col in ratios:
            num, den = rows[num_col].get(b), rows[den_col].get(b)
            cells.append(f"{num / den:.2f}x" if num and den else "")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return lines


def _siblings(path_stem: str, outdir: Path, here: Path) -> dict:
    """{world size: tokens_per_s} of the same GPU's tp results in the results file's directory."""
    m = re.fullmatch(r"(.+)x(\d+)-tp", path_stem)
    if not m:
        return {}
    out = {}
    for other in sorted(here.glob(f"{m.group(1)}x*-tp.json")):
        om = re.fullmatch(r".+x(\d+)-tp", other.stem)
        if om:
            out[int(om.group(1))] = tokens_per_s(json.loads(other.read_text()))
    return out


def _model_code(meta: dict) -> str:
    """How the model code around the linear layers ran (older results carry neither key)."""
    if "compiled" not in meta:
        return "Separate q/k/v and gate/up layers, element-wise code eager."
    fused = "q/k/v and gate/up fused per rank" if meta.get("fused_projections") else "separate q/k/v and gate/up"
    code = "compiled (torch.compile)" + pdl_note(meta) if meta["compiled"] else "eager"
    return f"{fused[0].upper()}{fused[1:]}, element-wise code {code}{attention_note(meta)}."


def _profile_lines(data: dict) -> list:
    """Where a profiled step's time goes (bench_tp --profile-batches): ms per step by kernel category
    (rank 0), and the idle rest of the timed step."""
    rows = [(r["kind"], p) for r in data["runs"] for p in r.get("points", []) if "profile" in p]
    if not rows:
        return []
    cats = []
    for _, p in rows:
        cats += [c for c in p["profile"]["us_per_step_by_category"] if c not in cats]
    alone = all("collectives_alone_us_per_step" in p["profile"] for _, p in rows)
    if alone:
        # the eager profile's collective kernels also wait for the other ranks' launches: that column
        # is left out; the rest of the step (collectives and gaps) is set beside the collectives alone
        cats = [c for c in cats if not c.startswith("collectives")]
    tail = " | rest: collectives + gaps | collectives alone |" if alone else " | idle |"
    lines = ["", "## Where a step's time goes (ms per step, rank 0's kernels)", "",
             "| kind | batch | step | " + " | ".join(cats) + tail, "|" + "---|" * (len(cats) + 4 + alone)]
    for kind, p in rows:
        by = p["profile"]["us_per_step_by_category"]
        cells = [f"{by[c] / 1e3:.2f}" if c in by else "" for c in cats]
        if alone:
            rest = 1e3 * p["ms_per_step"] - sum(by.get(c, 0.0) for c in cats)
            cells += [f"{rest / 1e3:.2f}", f"{p['profile']['collectives_alone_us_per_step'] / 1e3:.2f}"]
        else:
            cells.append(f"{p['profile']['idle_us_per_step'] / 1e3:.2f}")
        lines.append(f"| {kind} | {p['batch']} | {p['ms_per_step']:.2f} | " + " | ".join(cells) + " |")
    if alone:
        lines += ["", "The kernel columns come from a profile of eager calls of the step; rest is the timed step "
                  "(graph replay) minus them: the collectives and the gaps between kernels. In that profile a "
                  "collective's kernel also waits for the other ranks' launches, so it is not shown; collectives "
                  "alone is the step's all-reduces (two per layer) and lm_head's all-gather, with the step's "
                  "shapes, replayed on their own in one CUDA graph (slowest rank). Where it exceeds the rest, the "
                  "collectives cost less inside the step than back to back, and the rest bounds them."]
        if data.get("meta", {}).get("inductor_pdl"):
            lines[-1] += (" With programmatic dependent launch a kernel may start before the one ahead of it "
                          "ends and wait inside for it: its column then includes that wait (inductor's fused "
                          "kernels most), and the rest can come out negative.")
    elif any(p["profile"]["idle_us_per_step"] < 0 for _, p in rows):
        lines += ["", "A negative idle time means the profiled kernels took longer than the timed step. The profile "
                  "is taken over eager calls of the step, where a collective's kernel also waits for the other "
                  "ranks' launches (and, in results without `profile_aligned` in their meta, for the other ranks' "
                  "profiler start-up): read the collectives column as an upper bound, the other columns as they are."]
    return lines


def report_tp(data: dict, stem: str, outdir: Path, source_dir: Path | None = None) -> list:
    meta = data["meta"]
    world = meta.get("world_size", 1)
    tps = tokens_per_s(data)
    layers = meta.get("shape", {}).get("layers")
    lines = [
        f"# Tensor-parallel decode, TP={world}: {meta.get('gpu', '?')}",
        "",
        f"Llama-2-70B shape, {layers} layers, random weights; {meta.get('prompt')} prompt tokens in the cache, "
        f"{meta.get('steps')} greedy decode steps, one CUDA graph per step; median of {meta.get('repeats')} runs "
        "(slowest rank). " + _model_code(meta),
        "",
    ]
    lines += _table(tps, [(k, "fp16") for k in tps if k != "fp16"] if "fp16" in tps else [])
    failed = [f"{r['kind']}: {r['error']}" for r in data["runs"] if r.get("error")]
    if failed:
        lines += ["", "Not measured: " + "; ".join(failed)]
    siblings = _siblings(stem, outdir, source_dir or outdir)
    if len(siblings) > 1:
        cross = {}
        for w, kinds in sorted(siblings.items()):
            for kind, pts in kinds.items():
                cross[f"{kind} TP={w}"] = pts
        lines += ["", "## Across world sizes", ""]
        # each quantized kind on one GPU against FP16 on two (FP16 70B does not fit one GPU)
        pairs = [(f"{k} TP=1", "fp16 TP=2") for k in ("marlin", "marlin_24") if {f"{k} TP=1", "fp16 TP=2"} <= set(cross)]
        lines += _table(cross, pairs)
    lines += _profile_lines(data)
    md = outdir / f"{stem}.md"
    md.write_text("\n".join(lines) + "\n")

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, pts in tps.items():
        bs = sorted(pts)
        ax.plot(bs, [pts[b] for b in bs], marker="o", label=f"{kind}, TP={world}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Llama-2-70B shape ({layers} layers), TP={world}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    png = outdir / f"{stem}.png"
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return [f"wrote {md}", f"wrote {png}"]
