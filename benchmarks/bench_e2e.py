"""Decode speed of a whole model: FP16 against Marlin, tokens per second by batch size.

Run from the repository root (CUDA build of marlin, transformers installed):

    python -m benchmarks.bench_e2e                              # Llama-2-7B shape, batch 1 .. 128
    python -m benchmarks.bench_e2e --layers 8 --batches 1,16    # quick: 8 of the 32 layers
    python -m benchmarks.bench_e2e --profile --profile-batches 1,16   # + where a decode step's time goes
    python -m benchmarks.bench_e2e --dry-run                    # CPU smoke run on a tiny model

Protocol (the paper's end-to-end setting): a prompt of 64 tokens, then 64 generated tokens, for
batch 1, 2, 4, ..., 128. The model is a transformers Llama of the named shape with random
weights (no download; benchmarks/e2e_model.py). Kernels:

  fp16            the model as built (nn.Linear, cuBLAS);
  fp16_fused      the same with q/k/v and gate/up each one nn.Linear (weights stacked), as
                  serving engines run FP16: the stricter baseline for the fused Marlin model;
  fp16_kn, fp16_fused_kn
                  fp16 / fp16_fused with every Linear's weight stored [K, N] (e2e_model.LinearKN:
                  x @ W), the layout cuBLAS streams faster on some shapes. Where both layouts of
                  a baseline ran, the speedups over it are over the faster one (as bench_gemm's
                  FP16 is the faster of fp16 and fp16_kn);
  marlin          every Linear but lm_head replaced by MarlinLinear (group 128), q/k/v and
                  gate/up fused (marlin.fuse_projections);
  marlin_unfused  the same without fusion (transformers' own layer split);
  marlin_24       every Linear but lm_head pruned to 2:4 by magnitude and replaced by
                  MarlinLinear24 (group 128), q/k/v and gate/up fused: the 2:4 kernel's speed
                  (random weights: the time does not depend on which ones are kept). Built
                  from a fresh copy of the FP16 model (same seed) when the dense kernels ran first.

Attention (--attention, every kernel alike): marlin_decode by default, as compile_for_decode
sets it (marlin's decode kernel for the one-token steps, SDPA for the prompts), or sdpa.

For each (kernel, mode, batch): ttft_ms is the prefill of the prompt (eager, as generate() runs
it; logits of the last token only); tpot_ms is the median over --samples blocks of the 64 decode
steps at positions 64 .. 127, each block timed whole with CUDA events; tokens_per_s = batch /
tpot. Modes (e2e_model.py): eager, graph (eager kernels in one CUDA graph), compiled (inductor,
fullgraph, in one CUDA graph), generate (model.generate() after marlin.compile_for_decode; its
TPOT includes generate()'s own per-token work). The same mode is used for FP16 and Marlin. Before timing, one step
of each captured mode is checked against the eager forward (relative error of the logits), and
a traced mode must trace without graph breaks; each point records its set-up time (compile,
warm-up, capture: setup_s) and how many graphs dynamo compiled for it (a new batch size compiles
once more, with the batch dimension symbolic).

Also recorded: weight bytes per step and the FP16 weight-read floor (bytes / measured copy
bandwidth), so that the FP16 baseline can be judged (the issue asks for FP16 within 1.3x of it at
batch 1). Writes benchmarks/results/<gpu>-e2e[-<layers>L].json: meta (GPU, torch, transformers,
git revision), points {"model", "layers", "batch", "kernel", "mode", "tpot_ms", "ttft_ms",
"tokens_per_s", ...}, and the speedups over FP16 per mode and batch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

from .bench_gemm import dump_results
from .bench_math import RESULTS_DIR
from .e2e_model import (ATTENTIONS, MODEL_SPECS, DecodeStep, build_model, compile_decode, compile_layers,
                        decode_forward, free_memory, fuse_fp16, profile_step, set_inductor_pdl, time_generate, to_kn, to_marlin, weight_bytes)
from .e2e_slots import SlotStep
from .provenance import collect_meta, dirty_warning
from .timing import measure_copy_bandwidth

# run in this order: each converts the model further (the FP16 variants are undone after their points)
KERNELS = ("fp16", "fp16_kn", "fp16_fused", "fp16_fused_kn", "marlin_unfused", "marlin", "marlin_24")
MODES = ("eager", "graph", "compiled", "generate")
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CHECK_TOL = 2e-2  # logits of a captured/compiled step vs eager: fp16 rounding differs, a wrong step is O(1)
# Issue 21 targets: decode tokens/s over FP16 (same mode), Llama-2-7B shape.
TARGETS = {1: 2.5, 16: 2.0, 64: 1.3, 128: 1.0}


def _list(s: str, conv=str) -> list:
    return [conv(x.strip()) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Llama-2-7B", choices=sorted(MODEL_SPECS))
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own)")
    p.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    p.add_argument("--kernels", default="fp16,marlin", help=f"subset of {','.join(KERNELS)}")
    p.add_argument("--modes", default="graph,compiled", help=f"subset of {','.join(MODES)}")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--samples", type=int, default=5, help="timed blocks of gen-len steps per point")
    p.add_argument("--backend", default=None,
                   help="torch.compile backend of the compiled mode (default inductor; eager in a dry run)")
    p.add_argument("--compile-scope", choices=("model", "layer"), default="model",
                   help="the compiled mode's torch.compile: the whole step (model), or each decoder layer on its own "
                        "(layer: loses the fusion across layer boundaries and, with transformers' StaticCache, "
                        "compiles each layer separately: not faster at 32 layers). Both kernels run with the same "
                        "scope")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode of the compiled mode, for both kernels alike (e.g. "
                        "max-autotune-no-cudagraphs; default: torch's default mode; the step is captured in a CUDA "
                        "graph by the benchmark either way, so modes with their own cudagraphs do not apply)")
    p.add_argument("--cache", choices=("static", "slots"), default="static",
                   help="the decode step's KV cache: transformers' StaticCache (static), or the serving engine's "
                        "(slots: one tensor for all layers; the compiled mode then compiles each decoder layer, 4 "
                        "compiles per kernel whatever the depth and batch sizes: for 32 layers and many batches)")
    p.add_argument("--inductor-pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="inductor's Triton kernels with programmatic dependent launch (torch._inductor.config."
                        "triton.enable_pdl; what compile_for_decode sets), for every kernel alike; default: on "
                        "where this torch has the option")
    p.add_argument("--attention", choices=ATTENTIONS, default="marlin_decode",
                   help="the models' attn_implementation, for every kernel alike: marlin_decode (the default, as "
                        "compile_for_decode sets it: marlin.attention's decode kernel for one-token steps, SDPA for "
                        "prompts) or sdpa (transformers' SDPA; cuDNN on Hopper)")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler summary (time by kernel category) of a decode step per kernel, in the "
                        "compiled mode if it runs, else the graph mode's traced step, else eager")
    p.add_argument("--profile-batches", default=None, help="batches to profile, comma-separated (default: the first)")
    p.add_argument("--out", help="results JSON (default benchmarks/results/<gpu>-e2e[-<L>L].json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="CPU smoke run: tiny model, eager and traced steps")
    p.add_argument("--csrc-tree", help="where this copy has no git: output of git rev-parse HEAD:csrc")
    p.add_argument("--git-rev", help="where this copy has no git: the commit it was taken from")
    args = p.parse_args(argv)
    args.batches = _list(args.batches, int)
    args.kernels = _list(args.kernels)
    args.modes = _list(args.modes)
    bad = [k for k in args.kernels if k not in KERNELS] + [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown kernel/mode {bad}; kernels: {KERNELS}, modes: {MODES}")
    args.kernels = [k for k in KERNELS if k in args.kernels]
    if args.compile_mode in ("reduce-overhead", "max-autotune"):
        p.error(f"--compile-mode {args.compile_mode}: uses its own CUDA graphs; the benchmark captures the step itself "
                "(take default or max-autotune-no-cudagraphs)")
    if args.cache == "slots" and "generate" in args.modes:
        p.error("--cache slots: the generate mode runs transformers' generate() with its own cache; drop it")
    if args.dry_run:
        args.model, args.layers, args.batches = "tiny", None, [1, 3]
        args.prompt_len, args.gen_len, args.samples = 8, 4, 1
        if args.backend is None:
            args.backend = "eager"  # no C++ toolchain needed; traces with fullgraph like inductor would
    args.backend = args.backend or "inductor"
    args.profile_batches = _list(args.profile_batches, int) if args.profile_batches else args.batches[:1]
    # the mode whose step is profiled: the compiled one (what compile_for_decode gives) when it runs
    args.profile_mode = next((m for m in ("compiled", "graph", "eager") if m in args.modes), None) if args.profile else None
    return args


def _reset_dynamo():
    import torch._dynamo

    torch._dynamo.reset()


def _dynamo_counts() -> dict:
    """Graphs dynamo has compiled and graph breaks it took, so far in this process."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"].get("unique_graphs", 0), "graph_breaks": sum(counters["graph_break"].values())}


def run_kernel(model, kernel: str, args, dev, points: list, notes: list, bar, profiles: list) -> None:
    layers = model.config.num_hidden_layers
    wbytes = weight_bytes(model)
    for mode in args.modes:
        _reset_dynamo()
        undo_layers = None
        if mode == "compiled" and (args.compile_scope == "layer" or args.cache == "slots"):
            undo_layers = compile_layers(model, args.backend, args.compile_mode)
            compiled = decode_forward  # eager around the compiled layers; the step is still one CUDA graph
        elif args.cache == "slots":
            compiled = None  # graph mode: the eager kernels of the slots step, captured
        else:
            compiled = None if mode == "eager" else compile_decode(mode, args.backend, args.compile_mode)  # all batches
        for batch in args.batches:
            bar.set_description(f"{kernel} {mode} batch {batch}")
            step = (SlotStep if args.cache == "slots" else DecodeStep)(model, batch, args.prompt_len, args.gen_len, dev,
                                                                       seed=args.seed)
            point = {"model": args.model, "layers": layers, "batch": batch, "kernel": kernel, "mode": mode,
                     "cache": args.cache,
                     "compile_scope": (args.compile_scope if args.cache == "static" else "layer") if mode == "compiled"
                     else None,
                     "prompt_len": args.prompt_len, "gen_len": args.gen_len, "weight_bytes": wbytes}
            fn = None
            if mode == "generate":
                try:
                    ttft, tpot = time_generate(model, batch, args.prompt_len, args.gen_len, dev, args.samples,
                                               args.backend, seed=args.seed,
                                               pdl=args.inductor_pdl and args.backend == "inductor")
                    point.update(ttft_ms=ttft * 1e3, tpot_ms=tpot * 1e3, tokens_per_s=batch / tpot)
                except Exception as e:
                    point["error"] = f"{type(e).__name__}: {e}"[:500]
                    notes.append(f"{kernel} {mode} batch {batch}: {point['error']}")
                    traceback.print_exc(limit=3)
                points.append(point)
                bar.write(_one_line(point))
                bar.update(1)
                del step
                free_memory()
                continue
            try:
                point["ttft_ms"] = statistics.median(step.prefill() for _ in range(3)) * 1e3
                before, t0 = _dynamo_counts(), time.perf_counter()
                fn = step.setup(mode, compiled)
                # compile (when this batch size needs it), warm-up and graph capture
                point["setup_s"] = round(time.perf_counter() - t0, 2)
                after = _dynamo_counts()
                point["new_graphs"] = after["graphs"] - before["graphs"]
                point["graph_breaks"] = after["graph_breaks"] - before["graph_breaks"]
                if mode != "eager" and point["graph_breaks"]:
                    raise RuntimeError(f"{point['graph_breaks']} graph breaks in a fullgraph trace")
                err = step.check(fn)
                point["check_rel_err"] = err
                if not err <= CHECK_TOL:
                    raise RuntimeError(f"{mode} step differs from the eager forward: relative error {err:.3g}")
                times = step.time_steps(fn, args.samples)
                tpot = statistics.median(times)
                point.update(tpot_ms=tpot * 1e3, tpot_min_ms=min(times) * 1e3, tokens_per_s=batch / tpot)
                if mode == args.profile_mode and batch in args.profile_batches:
                    bar.write(format_profile(_profile(step, mode, compiled, point, profiles)))
            except Exception as e:  # record and go on: one failing point must not lose the others
                point["error"] = f"{type(e).__name__}: {e}"[:500]
                notes.append(f"{kernel} {mode} batch {batch}: {point['error']}")
                traceback.print_exc(limit=3)
            points.append(point)
            bar.write(_one_line(point))  # as it comes: a run cut short still shows what it measured
            bar.update(1)
            del step, fn
            free_memory()
        if undo_layers is not None:
            undo_layers()
    _reset_dynamo()
    for attr in ("_compiled_call", "_last_compile_config"):  # generate()'s compiled forward of this kernel
        if hasattr(model, attr):
            delattr(model, attr)


def _profile(step: DecodeStep, mode: str, compiled, point: dict, profiles: list) -> dict:
    """Kernel times of this point's step (the compiled function, outside the graph), into
    ``profiles``; a failure is recorded there and does not lose the point."""
    kernel, batch = point["kernel"], point["batch"]
    call = step.eager_call() if mode == "eager" else step.step_callable(compiled)
    try:
        prof = profile_step(step, call)
        prof["idle_us_per_step"] = round(point["tpot_ms"] * 1e3 - prof["kernel_us_per_step"], 2)
    except Exception as e:
        prof = {"error": f"{type(e).__name__}: {e}"[:500]}
    profiles.append({"kernel": kernel, "mode": mode, "batch": batch, "tpot_ms": point["tpot_ms"], **prof})
    return profiles[-1]


def _one_line(p: dict) -> str:
    head = f"{p['kernel']:15} {p['mode']:9} batch {p['batch']:>4}"
    if "tpot_ms" not in p:
        return f"{head}  failed: {p.get('error', '?')[:100]}"
    return f"{head}  TPOT {p['tpot_ms']:8.3f} ms  {p['tokens_per_s']:9.1f} tok/s  TTFT {p['ttft_ms']:8.2f} ms"


BASELINES = ("fp16", "fp16_fused")
LAYOUTS = {"fp16": ("fp16", "fp16_kn"), "fp16_fused": ("fp16_fused", "fp16_fused_kn")}  # a baseline's kernels
FP16_KERNELS = LAYOUTS["fp16"] + LAYOUTS["fp16_fused"]


def speedups(points: list) -> list:
    """tokens/s of each kernel over each FP16 baseline that ran at the same (mode, batch): every
    kernel over "fp16" (transformers' layers, the issue's baseline; its targets), and the Marlin
    kernels over "fp16_fused" too (entries with baseline "fp16_fused"). A baseline is the faster
    of its layouts that ran (LAYOUTS; the entry's "baseline_kernel" says which)."""
    timed = {(p["kernel"], p["mode"], p["batch"]): p for p in points if p["kernel"] in FP16_KERNELS and "tpot_ms" in p}
    out = []
    for p in points:
        if "tpot_ms" not in p:
            continue
        for b in BASELINES:
            refs = [timed[(k, p["mode"], p["batch"])] for k in LAYOUTS[b] if (k, p["mode"], p["batch"]) in timed]
            if not refs or p["kernel"] in LAYOUTS[b] or (b == "fp16_fused" and p["kernel"] in FP16_KERNELS):
                continue
            ref = min(refs, key=lambda r: r["tpot_ms"])
            s = ref["tpot_ms"] / p["tpot_ms"]
            target = TARGETS.get(p["batch"]) if p["kernel"] not in FP16_KERNELS else None
            out.append({"kernel": p["kernel"], "mode": p["mode"], "batch": p["batch"], "baseline": b,
                        "baseline_kernel": ref["kernel"], "speedup": s, "target": target,
                        "met": (s >= target) if target is not None else None})
    return out


def format_table(points: list, sp: list, floor_ms: Optional[float]) -> str:
    rows = [f"{'kernel':15} {'mode':9} {'batch':>5} {'TPOT ms':>9} {'tok/s':>9} {'TTFT ms':>9} {'x FP16':>7} {'x fused':>7}"]
    spd = {(s.get("baseline", "fp16"), s["kernel"], s["mode"], s["batch"]): s["speedup"] for s in sp}
    for p in points:
        if "tpot_ms" not in p:
            rows.append(f"{p['kernel']:15} {p['mode']:9} {p['batch']:>5}   failed: {p.get('error', '?')[:60]}")
            continue
        xs = [spd.get((b, p["kernel"], p["mode"], p["batch"])) for b in BASELINES]
        rows.append(f"{p['kernel']:15} {p['mode']:9} {p['batch']:>5} {p['tpot_ms']:9.3f} {p['tokens_per_s']:9.1f} "
                    f"{p['ttft_ms']:9.2f} " + " ".join('       ' if x is None else f'{x:7.2f}' for x in xs))
    if floor_ms:
        rows.append(f"FP16 weight-read floor (weight bytes / copy bandwidth): {floor_ms:.3f} ms per step")
    return "\n".join(rows)


def format_profile(prof: dict) -> str:
    """A profile (see _profile) as text: time and calls by category, then the top kernels."""
    lines = [f"profile {prof['kernel']} {prof['mode']} batch {prof['batch']} (us per decode step; TPOT "
             f"{prof['tpot_ms'] * 1e3:.1f} us in the graph):"]
    if "error" in prof:
        return "\n".join(lines + [f"  failed: {prof['error']}"])
    calls = prof.get("calls_per_step_by_category", {})
    for cat, us in prof["us_per_step_by_category"].items():
        lines.append(f"  {cat:32} {us:10.1f}  ({calls.get(cat, 0):g} calls)")
    lines.append(f"  {'sum of kernels':32} {prof['kernel_us_per_step']:10.1f}")
    lines.append(f"  {'TPOT - sum (gaps)':32} {prof['idle_us_per_step']:10.1f}")
    for k in prof.get("top_kernels", [])[:12]:
        lines.append(f"    {k['us_per_step']:9.1f} us  x{k['calls_per_step']:<5g} {k['name'][:100]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm.auto import tqdm
    import transformers

    if args.dry_run:
        dev = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("bench_e2e needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 1
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
    meta = collect_meta(dev, "dry-run" if args.dry_run else "e2e", kind="e2e", expect_rev=args.git_rev,
                        expect_tree=args.csrc_tree)
    meta.update(transformers=transformers.__version__, model=args.model, batches=args.batches,
                modes=args.modes, kernels=args.kernels, backend=args.backend, samples=args.samples,
                compile_scope=args.compile_scope, cache=args.cache, compile_mode=args.compile_mode,
                profile_mode=args.profile_mode, attention=args.attention)
    args.inductor_pdl = meta["inductor_pdl"] = set_inductor_pdl(args.inductor_pdl)
    warn = dirty_warning(meta)
    suffix = f"-{args.layers}L" if args.layers else ""
    if args.out:
        out_path = Path(args.out)
    elif args.dry_run:
        out_path = Path(tempfile.gettempdir()) / "marlin-bench-e2e-dry-run.json"
    else:
        out_path = RESULTS_DIR / f"{meta['gpu_slug']}-e2e{suffix}.json"
    copy_bw = measure_copy_bandwidth(dev, nbytes=1 << 30) if dev.type == "cuda" else None
    meta["copy_bw_GBps"] = copy_bw

    model = build_model(args.model, args.layers, dev, seed=args.seed, attention=args.attention)
    meta["layers"] = model.config.num_hidden_layers
    fp16_bytes = weight_bytes(model)
    floor_ms = fp16_bytes / (copy_bw * 1e9) * 1e3 if copy_bw else None
    meta["fp16_weight_bytes"], meta["fp16_weight_read_ms"] = fp16_bytes, floor_ms
    points, notes, profiles = [], [], []
    meta["notes"] = notes
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def write(complete: bool) -> None:
        # after every kernel too: a run stopped by a time limit keeps what it measured
        meta["complete"] = complete
        out_path.write_text(dump_results({"meta": meta, "points": points, "speedups": speedups(points),
                                          "profiles": profiles}))

    total = len(args.kernels) * len(args.batches) * len(args.modes)
    with torch.no_grad(), tqdm(total=total, desc="bench_e2e", unit="point") as bar:
        converted = "fp16"
        for kernel in args.kernels:
            if kernel in FP16_KERNELS and kernel != "fp16":  # a variant of the FP16 model, undone after its points
                undo = [fuse_fp16(model)] if kernel.startswith("fp16_fused") else []
                if kernel.endswith("_kn"):
                    undo.append(to_kn(model))
                free_memory()
                try:
                    run_kernel(model, kernel, args, dev, points, notes, bar, profiles)
                finally:
                    for restore in reversed(undo):
                        restore()
                write(complete=False)
                continue
            if kernel == "marlin_24":
                if converted != "fp16":  # the dense conversion replaced the FP16 weights: the same model anew
                    del model
                    free_memory()
                    model = build_model(args.model, args.layers, dev, seed=args.seed, attention=args.attention)
                to_marlin(model, fuse=True, sparsity="2:4")
                converted = kernel
            elif kernel != "fp16" and converted == "fp16":
                to_marlin(model, fuse=(kernel == "marlin"))
                converted = kernel
            elif kernel == "marlin" and converted == "marlin_unfused":
                import marlin

                marlin.fuse_projections(model, strict=True)
                converted = kernel
            free_memory()
            run_kernel(model, kernel, args, dev, points, notes, bar, profiles)
            write(complete=False)
    sp = speedups(points)
    print(format_table(points, sp, floor_ms))
    for prof in profiles:
        print("\n" + format_profile(prof))
    if notes:
        print("Notes:\n  " + "\n  ".join(notes))
    write(complete=True)
    print(f"wrote {out_path}")
    if warn:
        print(warn, file=sys.stderr)
    return 0 if all("tpot_ms" in p for p in points) else 3


if __name__ == "__main__":
    sys.exit(main())
