"""Figure and markdown for a bench_e2e results file (called by benchmarks.report for kind "e2e").

STEM.png: like the paper's Figure 11: decode tokens/s of FP16 and Marlin against batch size
(left) and Marlin's speedup over FP16 in the same mode (right), one line per (kernel, mode),
with the issue's targets marked. STEM.md: the times, speedups, targets and the FP16 baseline
check (its decode step against the time to read its weights at the measured copy bandwidth).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"graph": "--", "compiled": "-", "eager": ":"}
COLOR = {"fp16": "tab:gray", "fp16_kn": "tab:brown", "fp16_fused": "tab:blue", "fp16_fused_kn": "tab:cyan",
         "marlin": "tab:red", "marlin_unfused": "tab:orange", "marlin_24": "tab:purple"}
FLOOR_FACTOR = 1.3  # the issue: FP16's decode step within 1.3x of its weight-read time at batch 1


def _ok(points):
    return [p for p in points if p.get("tpot_ms")]


def _over(sp: list, baseline: str = "fp16") -> list:
    """The speedups over one baseline (files from before fp16_fused have no "baseline": fp16)."""
    return [x for x in sp if x.get("baseline", "fp16") == baseline]


def plot(data: dict, out: Path) -> str:
    points, sp = _ok(data.get("points", [])), _over(data.get("speedups", []))
    if not points:
        return "no timed points: no figure"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kernel in COLOR:
        for mode in STYLE:
            pts = sorted((p for p in points if p["kernel"] == kernel and p["mode"] == mode), key=lambda p: p["batch"])
            if pts:
                ax1.plot([p["batch"] for p in pts], [p["tokens_per_s"] for p in pts], STYLE[mode], marker="o",
                         color=COLOR[kernel], label=f"{kernel} ({mode})")
            s = sorted((x for x in sp if x["kernel"] == kernel and x["mode"] == mode), key=lambda x: x["batch"])
            if s:
                ax2.plot([x["batch"] for x in s], [x["speedup"] for x in s], STYLE[mode], marker="o",
                         color=COLOR[kernel], label=f"{kernel} ({mode})")
    targets = sorted({(x["batch"], x["target"]) for x in sp if x.get("target")})
    if targets:
        ax2.scatter([b for b, _ in targets], [t for _, t in targets], marker="_", s=300, color="k", label="target")
    ax2.axhline(1.0, color="k", lw=0.8)
    meta = data["meta"]
    for ax, ylabel in ((ax1, "decode tokens / s"), (ax2, "speedup over FP16 (same mode)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{meta.get('model')} ({meta.get('layers')} layers), {meta.get('gpu')}: "
                 f"{points[0]['prompt_len']} prompt + {points[0]['gen_len']} generated tokens")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return f"wrote {out.name}"


def _verdict(x: Optional[dict]) -> str:
    return "" if not x or x.get("target") is None else f">= {x['target']}: {'met' if x['met'] else 'missed'}"


def pdl_note(meta: dict) -> str:
    """Whether inductor's kernels ran with programmatic dependent launch (files before the flag say nothing)."""
    if "inductor_pdl" not in meta:
        return ""
    return f"; inductor's kernels {'with' if meta['inductor_pdl'] else 'without'} programmatic dependent launch"


def attention_note(meta: dict) -> str:
    """The models' attention (files before the option ran transformers' SDPA)."""
    att = meta.get("attention", "sdpa")
    what = {"sdpa": "SDPA", "marlin_decode": "marlin_decode (decode steps on marlin's decode attention)"}
    return f"; attention {what.get(att, att)}"


def markdown(data: dict, figure_msg: str, extra_figures: tuple = ()) -> list[str]:
    meta, points, sp = data["meta"], data.get("points", []), _over(data.get("speedups", []))
    fused = {(x["kernel"], x["mode"], x["batch"]): x for x in _over(data.get("speedups", []), "fp16_fused")}
    md = [f"# End-to-end decode: {meta.get('model')} ({meta.get('layers')} layers) on {meta.get('gpu')}", ""]
    md += [f"torch {meta.get('torch')}, transformers {meta.get('transformers')}, git {str(meta.get('git_rev'))[:12]}"
           f"{' (dirty)' if meta.get('git_dirty') else ''}, {meta.get('date')}; compile backend {meta.get('backend')}"
           f"{pdl_note(meta)}{attention_note(meta)}", ""]
    if figure_msg.startswith("wrote "):
        name = figure_msg.split()[1]
        md += [f"![{name}]({name})", ""]
    else:
        md += [f"- {figure_msg}", ""]
    spd = {(x["kernel"], x["mode"], x["batch"]): x for x in sp}
    # the targets against both baselines: transformers' layers ("fp16"), and the same weights
    # stacked as Marlin's fused layers are ("fp16_fused": the baseline within the honesty bound)
    md += ["| kernel | mode | batch | TPOT ms | tokens/s | TTFT ms | x FP16 | target | x FP16 fused | target (fused) |",
           "|---|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for p in points:
        if not p.get("tpot_ms"):
            md.append(f"| {p['kernel']} | {p['mode']} | {p['batch']} | failed: {p.get('error', '?')[:80]} | | | | | | |")
            continue
        x = spd.get((p["kernel"], p["mode"], p["batch"]))
        xf = fused.get((p["kernel"], p["mode"], p["batch"]))
        speedup = "" if not x else f"{x['speedup']:.2f}"
        speedup_fused = "" if not xf else f"{xf['speedup']:.2f}"
        md.append(f"| {p['kernel']} | {p['mode']} | {p['batch']} | {p['tpot_ms']:.3f} | {p['tokens_per_s']:.1f} | "
                  f"{p['ttft_ms']:.2f} | {speedup} | {_verdict(x)} | {speedup_fused} | {_verdict(xf)} |")
    if any(p["kernel"].endswith("_kn") for p in points):  # bench_e2e counts each baseline's faster layout
        refs = {(x["baseline"], x["mode"], x["batch"]): x.get("baseline_kernel", x["baseline"])
                for x in data.get("speedups", [])}
        counts = [f"{b} at {sum(k.endswith('_kn') for (bb, _, _), k in refs.items() if bb == b)} of "
                  f"{sum(bb == b for bb, _, _ in refs)} (mode, batch) points" for b in ("fp16", "fp16_fused")]
        md += ["", "x FP16 / x FP16 fused: over the faster layout of each baseline (nn.Linear's [N, K] weight, or the "
               "[K, N] one of `fp16_kn` / `fp16_fused_kn`); the [K, N] layout was the faster for " + ", ".join(counts) + "."]
    floor = meta.get("fp16_weight_read_ms")
    if floor:
        md += ["", f"FP16 weight-read floor: {meta.get('fp16_weight_bytes', 0) / 1e9:.2f} GB of weights per step / "
               f"{meta.get('copy_bw_GBps', 0):.0f} GB/s copy bandwidth = {floor:.3f} ms."]
        for p in _ok(points):
            if p["kernel"].startswith("fp16") and p["batch"] == 1:  # every FP16 layout and fusion
                r = p["tpot_ms"] / floor
                md.append(f"- {p['kernel']} {p['mode']} at batch 1: {p['tpot_ms']:.3f} ms = {r:.2f}x the floor "
                          f"({'within' if r <= FLOOR_FACTOR else 'above'} {FLOOR_FACTOR}x)")
    for msg in extra_figures:
        if msg.startswith("wrote "):
            md += ["", f"![{msg.split()[1]}]({msg.split()[1]})"]
    for prof in _profiles(data):
        head = f"## Where a decode step's time goes: {prof.get('kernel')}, {prof.get('mode', 'compiled')}, batch {prof.get('batch')}"
        md += ["", head, ""]
        if "error" in prof:
            md.append(f"profile failed: {prof['error']}")
            continue
        calls = prof.get("calls_per_step_by_category", {})
        md += ["| category | us per step | calls per step |", "|---|---:|---:|"]
        md += [f"| {c} | {us:.1f} | {calls.get(c, '')} |" for c, us in prof.get("us_per_step_by_category", {}).items()]
        if "kernel_us_per_step" in prof:
            md += [f"| sum of kernels | {prof['kernel_us_per_step']:.1f} | |",
                   f"| TPOT in the graph minus the sum (gaps) | {prof['idle_us_per_step']:.1f} | |"]
        md += ["", "| kernel | us per step | calls |", "|---|---:|---:|"]
        md += [f"| `{k['name'][:80]}` | {k['us_per_step']:.1f} | {k['calls_per_step']} |" for k in prof.get("top_kernels", [])[:12]]
    if meta.get("notes"):
        md += ["", "## Notes", ""] + [f"- {n}" for n in meta["notes"]]
    return md


def _profiles(data: dict) -> list[dict]:
    """The results' profiles: a list of {kernel, mode, batch, ...}; files written before profiles
    were per (kernel, batch) hold a dict kernel -> profile."""
    profs = data.get("profiles") or []
    if isinstance(profs, dict):
        return [dict(prof, kernel=kernel) for kernel, prof in profs.items()]
    return [_without_step_annotation(p) for p in profs]


def _without_step_annotation(prof: dict) -> dict:
    """The profile without the profiler's own step annotation. kernel_profile of commit d846586
    (results of 2026-11-28) counted that annotation ("ProfilerStep*", one per step, as long as
    the whole step) as a kernel of category "other"; its top_kernels entry says how much to take
    out of "other", the sum of kernels and the gaps. Later profiles skip it at the source."""
    step = next((k for k in prof.get("top_kernels", []) if k["name"].startswith("ProfilerStep")), None)
    if step is None or "us_per_step_by_category" not in prof:
        return prof
    prof = dict(prof)
    by = dict(prof["us_per_step_by_category"])
    calls = dict(prof.get("calls_per_step_by_category", {}))
    left = round(by.get("other", 0.0) - step["us_per_step"], 2)
    if abs(left) < 0.01:
        by.pop("other", None)
        calls.pop("other", None)
    else:
        by["other"] = left
        calls["other"] = round(calls.get("other", 0.0) - step["calls_per_step"], 2)
    prof["us_per_step_by_category"] = dict(sorted(by.items(), key=lambda kv: -kv[1]))
    prof["calls_per_step_by_category"] = calls
    prof["top_kernels"] = [k for k in prof["top_kernels"] if k is not step]
    if "kernel_us_per_step" in prof:
        prof["kernel_us_per_step"] = round(prof["kernel_us_per_step"] - step["us_per_step"], 2)
        if "idle_us_per_step" in prof:
            prof["idle_us_per_step"] = round(prof["idle_us_per_step"] + step["us_per_step"], 2)
    return prof


# stacking order and colours of the profile figure (categories of kernel_profile.CATEGORIES)
_PROFILE_ORDER = ("marlin GEMM", "FP16 GEMM", "attention", "collectives (NCCL / gloo)", "fused elementwise (inductor)",
                  "cache write / index", "copy / cast / cat (aten)", "elementwise / reduce (aten)", "other", "gaps")


def plot_profiles(data: dict, out: Path) -> str:
    """STEM-profile.png: one stacked bar per profiled (kernel, mode, batch): kernel time per decode
    step by category, plus the gaps (the graph's TPOT minus the kernels' sum)."""
    profs = [p for p in _profiles(data) if "us_per_step_by_category" in p]
    if not profs:
        return "no profiles: no profile figure"
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(profs) + 2), 4.5))
    labels = [f"{p['kernel']}\n{p.get('mode', 'compiled')} b{p['batch']}" for p in profs]
    bottom = [0.0] * len(profs)
    cmap = plt.get_cmap("tab10")
    for i, cat in enumerate(_PROFILE_ORDER):
        vals = [max(0.0, p.get("idle_us_per_step", 0.0)) if cat == "gaps" else p["us_per_step_by_category"].get(cat, 0.0)
                for p in profs]
        if any(vals):
            color = "lightgrey" if cat == "gaps" else cmap(i % 10)
            ax.bar(labels, [v / 1e3 for v in vals], bottom=[b / 1e3 for b in bottom], label=cat, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
    meta = data["meta"]
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Where a decode step's time goes: {meta.get('model')} ({meta.get('layers')} layers), {meta.get('gpu')}",
                 fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return f"wrote {out.name}"


def report_e2e(data: dict, stem: str, outdir: Path) -> list[str]:
    msg = plot(data, outdir / f"{stem}.png")
    msgs = [msg]
    if _profiles(data):
        msgs.append(plot_profiles(data, outdir / f"{stem}-profile.png"))
    (outdir / f"{stem}.md").write_text("\n".join(markdown(data, msg, msgs[1:])) + "\n")
    return msgs + [f"wrote {stem}.md"]


# -- serving (bench_e2e_serving) ------------------------------------------------------------------
def _engine(meta: dict) -> str:
    if meta.get("engine", "transformers") == "transformers":  # results from before --engine were transformers'
        return "continuous batching (transformers)"
    compiled = "compiled layers" if meta.get("compile") == "layer" else "eager kernels"
    prefill = sorted(set((meta.get("prefill") or {}).values()))  # per kernel; results before it: eager
    prefill = "; prefill: " + " / ".join(prefill) if prefill else "; prefill eager"
    return f"continuous batching (slots engine: {meta.get('slots')} rows, {compiled}, CUDA graphs{prefill})"


def report_serving(data: dict, stem: str, outdir: Path) -> list[str]:
    """STEM.png: median TPOT and TTFT against request rate per kernel (like the paper's Figures
    12-13); STEM.md: the table with Marlin's TPOT speedup (dense, and 2:4 where it ran)."""
    meta, points = data["meta"], [p for p in data.get("points", []) if p.get("tpot_ms_median")]
    msgs = []
    if points:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        rates = sorted({p["rate"] for p in points if p["rate"] is not None})
        top = (max(rates) * 2) if rates else 1.0  # where "all at once" (rate None) is drawn
        for kernel in ("fp16", "fp16_fused", "marlin", "marlin_24"):
            pts = sorted((p for p in points if p["kernel"] == kernel), key=lambda p: p["rate"] or top)
            if not pts:
                continue
            xs = [p["rate"] or top for p in pts]
            ax1.plot(xs, [p["tpot_ms_median"] for p in pts], marker="o", color=COLOR[kernel], label=kernel)
            ax2.plot(xs, [p["ttft_ms_median"] for p in pts], marker="o", color=COLOR[kernel], label=kernel)
        for ax, ylabel in ((ax1, "median TPOT (ms)"), (ax2, "median TTFT (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("request rate (req/s; rightmost: all at once)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"Serving {meta.get('model')} ({meta.get('layers')} layers), {meta.get('gpu')}: "
                     f"{meta.get('num_requests')} requests\n{_engine(meta)}")
        fig.tight_layout()
        fig.savefig(outdir / f"{stem}.png", dpi=120)
        plt.close(fig)
        msgs.append(f"wrote {stem}.png")
    md = [f"# Serving: {meta.get('model')} ({meta.get('layers')} layers) on {meta.get('gpu')}", "",
          f"torch {meta.get('torch')}, transformers {meta.get('transformers')}, git {str(meta.get('git_rev'))[:12]}; "
          f"{meta.get('num_requests')} requests, median prompt {meta.get('prompt_median')}, "
          f"median output {meta.get('output_median')} tokens; {_engine(meta)}{pdl_note(meta)}{attention_note(meta)}", ""]
    if msgs:
        md += [f"![{stem}.png]({stem}.png)", ""]
    md += ["| kernel | rate req/s | TPOT ms (median) | TTFT ms (median) | TTFT p90 | out tok/s | TPOT x FP16 | TPOT x fused "
           "| rows per step | cache len per step | failed |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in data.get("points", []):
        def f(key, spec=".2f"):
            v = p.get(key)
            return "" if v is None else format(v, spec)
        md.append(f"| {p['kernel']} | {p['rate'] if p['rate'] is not None else 'all at once'} | {f('tpot_ms_median')} | "
                  f"{f('ttft_ms_median')} | {f('ttft_ms_p90')} | {f('output_tokens_per_s', '.1f')} | "
                  f"{f('tpot_speedup')} | {f('tpot_speedup_over_fused')} | {f('mean_rows', '.1f')} | {f('mean_kv_len', '.0f')} | {p.get('failed', '')} |")
    (outdir / f"{stem}.md").write_text("\n".join(md) + "\n")
    return msgs + [f"wrote {stem}.md"]
