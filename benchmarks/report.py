"""Plots and a markdown summary from benchmark results.

    python -m benchmarks.report                          # every benchmarks/results/*.json
    python -m benchmarks.report benchmarks/results/h100-80gb-hbm3.json [more.json ...] [--outdir DIR]

For a results file STEM.json of bench_gemm it writes into benchmarks/results/ (or --outdir):
  STEM-ideal.png     speedup over fp16 vs batch size on the "ideal" layer, with the memory-bound limit
  STEM-layers.png    speedup at batch 16 on every layer of the models in benchmarks/shapes.py
  STEM-roofline.png  achieved TFLOP/s vs arithmetic intensity on sq4096 .. sq32768, with the
                     measured copy bandwidth and fp16 tensor-core rate as the roofs
  STEM.md            the times, speedups and target checks as markdown
A figure whose points the file does not hold is skipped, and the markdown says so.  For a
sustained.py file it writes STEM.png (speedup, clocks and power over time) and STEM.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from . import bench_math as BM
from . import provenance as PV
from . import shapes as S  # noqa: E402

QUANT = ("marlin_g128", "marlin_gcol", "marlin_direct", "marlin_24_g128", "marlin_24_gcol", "torch_int4")
LABEL = {
    "fp16": "FP16 (F.linear, W [N, K])",
    "fp16_kn": "FP16 (a @ W, W [K, N])",
    "marlin_direct": "Marlin, group 128, workspace=None",
    "marlin_g128": "Marlin, group 128",
    "marlin_gcol": "Marlin, per-column",
    "marlin_24_g128": "Sparse-Marlin 2:4, group 128",
    "marlin_24_gcol": "Sparse-Marlin 2:4, per-column",
    "torch_int4": "torch INT4 (tinygemm, g128)",
}
COLOR = {"fp16": "tab:gray", "fp16_kn": "tab:brown", "marlin_g128": "tab:red", "marlin_gcol": "tab:orange",
         "marlin_direct": "tab:pink", "marlin_24_g128": "tab:green", "marlin_24_gcol": "tab:olive", "torch_int4": "tab:blue"}


def load(path: Path) -> dict:
    data = json.loads(Path(path).read_text())
    if "meta" not in data:
        raise ValueError(f"{path}: not a benchmark results file (no 'meta')")
    return data


def _f(x) -> float:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else float("nan")


# ----------------------------------------------------------------------------- gemm figures


def plot_ideal(points: list[dict], out: Path) -> str:
    pts = [p for p in points if p["shape"] == S.IDEAL]
    curves = {k: sorted(BM.speedups(pts, k).items(), key=lambda kv: kv[0][1]) for k in QUANT}
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return "skipped ideal-layer plot: no 'ideal' points with both fp16 and a quantized kernel"
    k_, n_ = int(pts[0]["K"]), int(pts[0]["N"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kern, kv in curves.items():
        ms = [m for (_, m), _ in kv]
        ax.plot(ms, [v for _, v in kv], marker="o", color=COLOR[kern], label=LABEL[kern])
    ideal = BM.ideal_speedup("marlin_g128", k_, n_)
    ax.axhline(ideal, color="black", ls="--", lw=1, label=f"ideal (weight bytes, g128) = {ideal:.2f}x")
    if any(k.startswith("marlin_24") for k in curves):  # the paper's Figure 9: sparse next to dense
        ideal24 = BM.ideal_speedup("marlin_24_g128", k_, n_)
        ax.axhline(ideal24, color="tab:green", ls="--", lw=1, label=f"ideal (weight bytes, 2:4 g128) = {ideal24:.2f}x")
    ax.axhline(1.0, color="gray", ls=":", lw=1)
    ms_all = sorted({m for kv in curves.values() for (_, m), _ in kv})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms_all)
    ax.set_xticklabels([str(m) for m in ms_all])
    ax.set_xlabel("batch size M")
    ax.set_ylabel("speedup over FP16")
    ax.set_ylim(bottom=0)
    ax.set_title(f"ideal layer K={k_}, N={n_}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return f"wrote {out.name}"


def layer_speedups(points: list[dict], m: int = S.LAYERS_M) -> dict[str, dict[str, float]]:
    """{'Llama-2-7B/qkv': {kernel: speedup}} at batch m; short names (7B_o) count as their model layer."""
    out: dict[str, dict[str, float]] = {}
    for kern in QUANT:
        for (shape, mm), v in BM.speedups(points, kern).items():
            full = S.ALIASES.get(shape, shape)
            if mm == m and full in S.MODEL_LAYERS:
                out.setdefault(full, {})[kern] = v
    return {name: out[name] for name in S.MODEL_LAYERS if name in out}


def plot_layers(points: list[dict], out: Path, m: int = S.LAYERS_M) -> str:
    sp = layer_speedups(points, m)
    if not sp:
        return f"skipped model-layer plot: no model-layer points at M={m} with fp16 and a quantized kernel"
    kernels = [k for k in QUANT if any(k in v for v in sp.values())]
    names = list(sp)
    width = 0.8 / len(kernels)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.5 * len(names) + 2), 5.2))
    for j, kern in enumerate(kernels):
        xs = [i + (j - (len(kernels) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, [_f(sp[nm].get(kern)) for nm in names], width, color=COLOR[kern], label=LABEL[kern])
    ax.axhline(BM.ideal_speedup("marlin_g128", 4096, 4096), color="black", ls="--", lw=1, label="ideal (g128)")
    ax.axhline(1.0, color="gray", ls=":", lw=1)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, fontsize=7, rotation=45, ha="right")
    top = max([_f(v) for d in sp.values() for v in d.values() if math.isfinite(_f(v))] + [3.9])
    ax.set_ylim(0, top * 1.2)
    ax.set_ylabel(f"speedup over FP16 at M={m}")
    ax.set_title(f"LLM layers: speedup over FP16 at batch {m}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", ncol=4 if len(names) > 12 else 2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return f"wrote {out.name}"


def plot_roofline(points: list[dict], meta: dict, out: Path) -> str:
    pts = [p for p in points if p["shape"].startswith("sq") and _f(p.get("time_us")) > 0]
    if not pts:
        return "skipped roofline plot: no sq* points (run bench_gemm --roofline)"
    bw, peak = _f(meta.get("copy_bw_GBps")), _f(meta.get("fp16_tflops"))
    sizes = sorted({p["shape"] for p in pts}, key=lambda s: int(s[2:]))
    markers = dict(zip(sizes, "osD^v<>p"))
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ai_all = []
    for kern in BM.KERNELS:
        for size in sizes:
            sel = sorted((p for p in pts if p["kernel"] == kern and p["shape"] == size), key=lambda p: p["M"])
            if not sel:
                continue
            ai = [BM.gemm_flops(p["K"], p["N"], p["M"]) / BM.kernel_bytes(kern, p["K"], p["N"], p["M"]) for p in sel]
            tf = [BM.tflops(BM.gemm_flops(p["K"], p["N"], p["M"]), p["time_us"]) for p in sel]
            ai_all += ai
            ax.plot(ai, tf, marker=markers[size], color=COLOR[kern], lw=0.8, ms=4,
                    label=f"{LABEL[kern]} {size}")
    msg = f"wrote {out.name}"
    if math.isfinite(bw) and math.isfinite(peak) and ai_all:
        lo, hi = min(ai_all) / 2, max(ai_all) * 2
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(xs, [min(bw * x / 1e3, peak) for x in xs], color="black", lw=1.5,
                label=f"roof: copy {bw:.0f} GB/s, fp16 {peak:.0f} TFLOP/s")
    else:
        msg += " (no roof: meta lacks copy_bw_GBps / fp16_tflops)"
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved: weights + A + C)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("roofline: square layers K = N, M = 1 .. 4096")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return msg


def plot_roofline_fraction(points: list[dict], meta: dict, out: Path, kernel: str = "marlin_g128",
                           max_m: int = 128) -> str:
    """Fraction of the roofline bound vs M (decode batches), one line per shape."""
    bw, peak = _f(meta.get("copy_bw_GBps")), _f(meta.get("fp16_tflops"))
    if not (math.isfinite(bw) and math.isfinite(peak)):
        return "skipped roofline-fraction plot: meta lacks copy_bw_GBps / fp16_tflops"
    pts = [p for p in points if p["kernel"] == kernel and p["M"] <= max_m and _f(p.get("time_us")) > 0
           and not p["shape"].startswith("sq")]
    if not pts:
        return f"skipped roofline-fraction plot: no {kernel} points at M <= {max_m}"
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    shapes = list(dict.fromkeys(BM.canonical_shape(p["shape"]) for p in pts))
    for i, shape in enumerate(shapes):
        sel = sorted((p for p in pts if BM.canonical_shape(p["shape"]) == shape), key=lambda p: p["M"])
        fr = [BM.roofline_fraction(kernel, p["K"], p["N"], p["M"], p["time_us"], bw, peak) for p in sel]
        ax.plot([p["M"] for p in sel], fr, marker="o", ms=3, lw=1, color=plt.cm.tab10(i % 10), label=shape)
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("batch size M")
    ax.set_ylabel("roofline bound / measured time")
    ax.set_title(f"{LABEL.get(kernel, kernel)}: fraction of the roofline ({meta.get('gpu')})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return f"wrote {out.name}"


# ----------------------------------------------------------------------------- markdown


def _cell(x, spec=".1f") -> str:
    x = _f(x)
    return format(x, spec) if math.isfinite(x) else "–"


def meta_lines(meta: dict) -> list[str]:
    keys = [
        ("gpu", "GPU"), ("sms", "SMs"), ("l2_bytes", "L2 bytes"), ("torch", "torch"), ("cuda", "CUDA"),
        ("git_rev", "git rev"), ("csrc_tree", "csrc tree (HEAD:csrc)"), ("csrc_worktree_tree", "csrc tree on disk"),
        ("git_dirty", "csrc dirty"), ("copy_bw_GBps", "copy bandwidth GB/s"), ("fp16_tflops", "fp16 TFLOP/s"),
        ("date", "date"), ("mode", "mode"),
    ]
    lines = ["| | |", "|---|---|"]
    check = provenance_check(meta)
    for key, label in keys:
        if key in meta:
            v = meta[key]
            if isinstance(v, float):
                v = f"{v:.0f}" if v > 10 else f"{v:.3g}"
            lines.append(f"| {label} | {v} |")
    out = lines
    if meta.get("method"):
        out += ["", f"Method: {meta['method']}"]
    if check:
        out += ["", check]
    if meta.get("git_dirty") is not False and not (check or "").startswith("Provenance: OK"):
        out += ["", "**WARNING: these results may not come from committed code (csrc dirty or unknown).**"]
    return out


def provenance_check(meta: dict) -> str:
    """Where the run could not tell (no git on the benchmark machine), compare its csrc tree hash with
    this checkout's git: the commit it names, else HEAD."""
    work = meta.get("csrc_worktree_tree")
    if meta.get("git_dirty") is not None or not work or not PV._git_usable():
        return ""
    rev = meta.get("git_rev") or "HEAD"
    tree = PV._git("rev-parse", f"{rev}:csrc")
    if tree is None:
        return f"Provenance: could not read `{rev}:csrc` from this checkout's git."
    if tree == work:
        return f"Provenance: OK: csrc/ of the run is tree {work} = `{rev}:csrc` of this checkout (checked at report time)."
    return (f"Provenance: **MISMATCH**: csrc/ of the run is tree {work}, `{rev}:csrc` here is {tree}: "
            "the results do not come from that commit.")


def targets_md(points: list[dict]) -> list[str]:
    lines = ["| target | threshold | statistic | value | median | min (where) | points | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in BM.evaluate_targets(points):
        if r["passed"] is None:
            lines.append(f"| {r['target']} | {r['threshold']:.1f}x | {r['stat']} | – | – | – | 0 | N/A |")
            continue
        w = r["worst"]
        cnt = f"{r['n']}/{r['expected']}" if r["expected"] else str(r["n"])
        lines.append(
            f"| {r['target']} | {r['threshold']:.1f}x | {r['stat']} | {r['value']:.2f}x | {r['median']:.2f}x | "
            f"{r['min']:.2f}x ({w['shape']}, M={w['M']}) | {cnt} | {'PASS' if r['passed'] else '**FAIL**'} |"
        )
    return lines


def times_md(points: list[dict], copy_bw, peak=None) -> list[str]:
    idx = BM.time_index(points)
    kernels = [k for k in BM.KERNELS if any(p["kernel"] == k for p in points)]
    quant = [k for k in kernels if k not in BM.BASELINES]
    kn = {}
    for p in points:
        kn.setdefault(BM.canonical_shape(p["shape"]), (int(p["K"]), int(p["N"])))
    head = "| shape | M | " + " | ".join(
        ["fp16 us (faster layout)"] + [f"{k} us | {k} x | {k} % copy BW | {k} % roofline" for k in quant]
    ) + " |"
    ncols = 2 + 1 + 4 * len(quant)
    lines = [head, "|" + "---|" * ncols]
    for shape, (k_, n_) in kn.items():
        for m in sorted({m for (s, m, _) in idx if s == shape}):
            t16 = BM.fp16_time(idx, shape, m)
            cells = [f"{shape} ({k_}x{n_})", str(m), _cell(t16)]
            for k in quant:
                t = idx.get((shape, m, k), float("nan"))
                sp = t16 / t if math.isfinite(t) and math.isfinite(t16) and t > 0 else float("nan")
                pct = 100 * BM.gbps(BM.kernel_bytes(k, k_, n_, m), t) / copy_bw if _f(copy_bw) > 0 else float("nan")
                roof = 100 * BM.roofline_fraction(k, k_, n_, m, t, _f(copy_bw), _f(peak))
                cells += [_cell(t), _cell(sp, ".2f"), _cell(pct, ".0f"), _cell(roof, ".0f")]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def checks_md(checks: list[dict]) -> list[str]:
    if not checks:
        return ["(none recorded)"]
    lines = ["| shape | kernel | M | rel. error | tolerance | columns | ok |", "|---|---|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c.get('shape')} | {c.get('kernel')} | {c.get('M')} | {_cell(c.get('rel_err'), '.2e')} | "
                     f"{c.get('tol')} | {c.get('columns')} | {'yes' if c.get('ok') else '**NO**'} |")
    return lines


def report_gemm(data: dict, stem: str, outdir: Path) -> list[str]:
    meta, points = data["meta"], data.get("points", [])
    msgs = [
        plot_ideal(points, outdir / f"{stem}-ideal.png"),
        plot_layers(points, outdir / f"{stem}-layers.png"),
        plot_roofline(points, meta, outdir / f"{stem}-roofline.png"),
        plot_roofline_fraction(points, meta, outdir / f"{stem}-roofline-fraction.png"),
    ]
    md = [f"# marlin.gemm benchmark: {meta.get('gpu')} ({meta.get('mode')})", ""]
    md += meta_lines(meta)
    md += ["", "## Figures", ""]
    for m in msgs:
        if m.startswith("wrote "):
            name = m.split()[1]
            md.append(f"![{name}]({name})")
            md.append("")
        else:
            md.append(f"- {m}")
    md += ["", "## Targets (marlin_g128 speedup over FP16)", ""] + targets_md(points)
    md += ["", "## Times (us per call) and speedups over FP16", "",
           "% roofline: max(bytes / copy bandwidth, 2MKN / FP16 rate) over the time, both rates measured in "
           "this run (meta); bytes = weights + A + C.", ""]
    md += times_md(points, meta.get("copy_bw_GBps"), meta.get("fp16_tflops"))
    md += ["", "## Correctness checks", ""] + checks_md(data.get("checks", []))
    if meta.get("notes"):
        md += ["", "## Notes", ""] + [f"- {n}" for n in meta["notes"]]
    (outdir / f"{stem}.md").write_text("\n".join(md) + "\n")
    return msgs + [f"wrote {stem}.md"]


# ----------------------------------------------------------------------------- sustained


def report_sustained(data: dict, stem: str, outdir: Path) -> list[str]:
    from .sustained import stability

    meta, classes, samples = data["meta"], data.get("classes", []), data.get("samples", [])
    msgs = []
    if classes:
        fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
        for c in classes:
            rows = c.get("seconds", [])
            xs = [r.get("t_run_s", c["t_start_s"] + r["t_s"]) for r in rows]
            axes[0].plot(xs, [_f(r.get("speedup")) for r in rows], marker=".", label=f"M={c['M']}")
            for ax in axes:
                ax.axvspan(c["t_start_s"], c["t_end_s"], color="gray", alpha=0.06)
        axes[0].set_ylabel("speedup over FP16")
        axes[0].legend(fontsize=8)
        if samples:
            ts = [s["t_s"] for s in samples]
            axes[1].plot(ts, [_f(s.get("sm_mhz")) for s in samples], color="tab:red", label="SM clock")
            axes[1].set_ylabel("SM clock (MHz)")
            ax2 = axes[1].twinx()
            ax2.plot(ts, [_f(s.get("mem_mhz")) for s in samples], color="tab:blue", ls="--", label="memory clock")
            ax2.set_ylabel("memory clock (MHz)")
            axes[2].plot(ts, [_f(s.get("power_w")) for s in samples], color="tab:green")
            axes[2].set_ylabel("power (W)")
            ax3 = axes[2].twinx()
            ax3.plot(ts, [_f(s.get("temp_c")) for s in samples], color="tab:purple", ls="--")
            ax3.set_ylabel("temperature (C)")
        else:
            axes[1].text(0.5, 0.5, "no nvidia-smi samples", ha="center", transform=axes[1].transAxes)
        axes[2].set_xlabel("seconds since start")
        for ax in axes:
            ax.grid(True, alpha=0.3)
        fig.suptitle(f"sustained: {meta.get('shape')} on {meta.get('gpu')}")
        fig.tight_layout()
        fig.savefig(outdir / f"{stem}.png", dpi=120)
        plt.close(fig)
        msgs.append(f"wrote {stem}.png")
    else:
        msgs.append("skipped sustained plot: no classes")
    dur = _f(meta.get("seconds_per_class"))
    tol = _f(meta.get("tol")) if meta.get("tol") is not None else 0.05
    md = [f"# marlin.gemm sustained load: {meta.get('gpu')} ({meta.get('shape')}, K={meta.get('K')}, N={meta.get('N')})", ""]
    md += meta_lines(meta)
    md += ["", f"![{stem}.png]({stem}.png)" if classes else "(no plot)", "",
           f"Speedup holds when the median of the last window is within {100 * tol:.0f}% of the first.", "",
           "| M | window s | speedup first | speedup last | change | SM MHz first | SM MHz last | power W first | power W last | verdict |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for c in classes:
        st = stability(c.get("seconds", []), dur, tol) if math.isfinite(dur) else c.get("stability", {})
        ck = c.get("clocks", {})
        verdict = {True: "holds", False: "**DOES NOT HOLD**", None: "n/a"}[st.get("holds")]
        md.append(
            f"| {c['M']} | {_cell(st.get('window_s'), '.0f')} | {_cell(st.get('first'), '.2f')} | "
            f"{_cell(st.get('last'), '.2f')} | {_cell(100 * _f(st.get('change')), '+.1f')}% | "
            f"{_cell(ck.get('sm_mhz_first'), '.0f')} | {_cell(ck.get('sm_mhz_last'), '.0f')} | "
            f"{_cell(ck.get('power_w_first'), '.0f')} | {_cell(ck.get('power_w_last'), '.0f')} | {verdict} |"
        )
    if meta.get("smi_error"):
        md += ["", f"nvidia-smi: {meta['smi_error']}"]
    (outdir / f"{stem}.md").write_text("\n".join(md) + "\n")
    return msgs + [f"wrote {stem}.md"]


def report(path: Path, outdir: Path | None = None) -> list[str]:
    path = Path(path)
    data = load(path)
    outdir = Path(outdir) if outdir else BM.RESULTS_DIR
    outdir.mkdir(parents=True, exist_ok=True)
    if data["meta"].get("kind") == "sustained" or "classes" in data:
        return report_sustained(data, path.stem, outdir)
    if data["meta"].get("kind") == "e2e":
        from .report_e2e import report_e2e

        return report_e2e(data, path.stem, outdir)
    if data["meta"].get("kind") == "tp":
        from .report_tp import report_tp

        return report_tp(data, path.stem, outdir, source_dir=path.parent)
    if data["meta"].get("kind") == "serving":
        from .report_e2e import report_serving

        return report_serving(data, path.stem, outdir)
    return report_gemm(data, path.stem, outdir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="*", help="results JSON files (default: benchmarks/results/*.json)")
    p.add_argument("--outdir", help="where to write (default: benchmarks/results/)")
    args = p.parse_args(argv)
    # by default every GEMM, whole-model and serving result; the accuracy files are benchmarks/accuracy.py's
    paths = [Path(x) for x in args.results] or sorted(
        f for f in BM.RESULTS_DIR.glob("*.json") if not f.name.startswith("accuracy-"))
    if not paths:
        print(f"no results files given and none in {BM.RESULTS_DIR}", file=sys.stderr)
        return 1
    rc = 0
    for path in paths:
        try:
            msgs = report(path, Path(args.outdir) if args.outdir else None)
        except (OSError, ValueError, KeyError) as e:
            print(f"{path}: {type(e).__name__}: {e}", file=sys.stderr)
            rc = 1
            continue
        print(f"{path}:")
        for m in msgs:
            print(f"  {m}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
