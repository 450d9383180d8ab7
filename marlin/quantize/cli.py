"""``marlin-quantize MODEL OUT`` and ``marlin-eval MODEL --text FILE``: the command lines."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from ..convert.errors import ConversionError, run_reporting_errors
from .calib import parse_seqlen_range
from .clip import DEFAULT_GRID

__all__ = ["main", "eval_main", "build_parser", "build_eval_parser"]


THREADS_HELP = (
    "CPU threads for torch (default: torch's choice); on a machine whose cores are busy with other work, 1 can be "
    "several times faster (docs/QUANTIZE.md)"
)
# Bad input of either command: exit status 1 with the message (NotImplementedError: a feature
# that a model or option asks for and the quantizer does not have).
INPUT_ERRORS = (ValueError, NotImplementedError, ConversionError, OSError)


def _add_run_options(p: argparse.ArgumentParser, device_help: str, quiet_help: str) -> None:
    """The options both commands share: where to compute, which .gguf, threads, quiet."""
    p.add_argument("--device", default="cpu", help=device_help)
    p.add_argument("--gguf-file", default=None, help="which .gguf of MODEL to read when it has several")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--quiet", action="store_true", help=quiet_help)


def _set_threads(threads: Optional[int]) -> None:
    if threads is None:
        return
    if threads < 1:
        raise SystemExit(f"--threads {threads}: expected a positive number of threads")
    import torch

    torch.set_num_threads(threads)


def _group_size(text: str) -> int:
    value = int(text)
    if value not in (128, 64, 32, -1):
        raise argparse.ArgumentTypeError(f"group size {value}, expected 128, 64, 32 or -1 (per column)")
    return value


def _seqlen(text: str) -> tuple:
    try:
        return parse_seqlen_range(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="marlin-quantize",
        description=(
            "Quantize a transformers causal LM (safetensors directory or GGUF) to a Marlin 4-bit checkpoint with "
            "the MARLIN paper's GPTQ variant: group-wise clip search and calibration samples of varying length. "
            "Runs block by block; OUT is written completely or not at all, with a per-layer error report; an "
            "interrupted run resumes where it stopped."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="model directory (config.json + *.safetensors, or one .gguf) or a .gguf file")
    p.add_argument("out", metavar="OUT", help="output directory (must not exist, see --overwrite)")
    p.add_argument("--calib", required=True, metavar="FILE|DIR", help="calibration text: a file or a directory of .txt files")
    p.add_argument("--group-size", type=_group_size, default=128, help="rows of K per scale: 128 (default), 64, 32, -1")
    p.add_argument("--act-order", action="store_true", help="quantize inputs in order of decreasing activation size")
    p.add_argument(
        "--clip-search",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"choose each group's scale among shrink factors {DEFAULT_GRID[0]}..{DEFAULT_GRID[-1]} of its range by "
        "Hessian-weighted error (default on)",
    )
    p.add_argument("--nsamples", type=int, default=256, help="calibration samples (default 256; 128 takes half the time "
                   "and activation memory and is a little less accurate)")
    p.add_argument(
        "--seqlen-range",
        type=_seqlen,
        default=(32, 512),
        metavar="MIN:MAX",
        help="sample lengths in tokens, drawn uniformly (default 32:512); one number for fixed-length samples",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration sampling (default 0)")
    p.add_argument(
        "--clip-objective",
        choices=["auto", "compensated", "columnwise", "hessian"],
        default="auto",
        help="how the clip search scores a group's rounding error: with what remains after GPTQ's update of the "
        "later columns (compensated), also of the group's own later columns (columnwise), or with the group's "
        "block of the Hessian (hessian); auto (default): columnwise per column, compensated with groups",
    )
    p.add_argument(
        "--clip-shift",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with zero points, the clip search shrinks each end of the range by its own factor, which also "
        "shifts the range (the grid's square of candidates; default off)",
    )
    p.add_argument(
        "--refit",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="refit each group's scale and zero point to GPTQ's codes by least squares on the layer's objective; "
        "each round after the first re-runs GPTQ with the refit values (default 0: off)",
    )
    p.add_argument("--damp", type=float, default=0.01, help="Hessian dampening, fraction of its mean diagonal (0.01)")
    p.add_argument(
        "--true-sequential",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="inside a block, quantize q/k/v, then o, then gate/up, then down, each on inputs from the quantized "
        "layers before it (default on)",
    )
    p.add_argument(
        "--fp-target",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fit each layer to the full-precision model's outputs rather than to its own weight on the quantized "
        "model's inputs (default on; a second stream of hidden states through the original blocks)",
    )
    p.add_argument(
        "--sparsity",
        default=None,
        choices=["2:4"],
        help="prune to 2:4 jointly with the quantization (SparseGPT) for the 2:4 Marlin layers: 4-bit symmetric "
        "(default) or with zero points (--asym), group size 128, 64, 32 or -1, no --act-order",
    )
    p.add_argument("--bits", type=int, choices=[4, 8], default=4, help="weight bits: 4 (default) or 8 (symmetric)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument(
        "--sym", dest="sym", action="store_true", default=None,
        help="symmetric weights (default for --bits 8, which has no zero points, and for --sparsity 2:4)",
    )
    sym.add_argument(
        "--asym", dest="sym", action="store_false",
        help="4-bit weights with a zero point per group, the clip search shrinking min and max (default for 4-bit "
        "dense weights; with --sparsity 2:4 on request)",
    )
    p.add_argument(
        "--rotate",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="rotate the residual stream by an orthogonal matrix folded into the weights, and down_proj's input "
        "online in blocks of 64 (dense layers), before quantizing (spreads outlier channels; Llama, Mistral, Qwen2; "
        "unties tied embeddings; default off; recommended with --group-size -1: on SmolLM2-135M per column it "
        "took GPTQ from 6.1-6.9%% to 4.3-4.5%% over fp16, docs/QUANTIZE.md)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--no-resume", action="store_true", help="discard the finished blocks of an interrupted run")
    _add_run_options(p, "where a block and its Hessians are computed: cpu (default) or cuda", "no progress bar and no summary")
    return p


def _run(prog: str, args: argparse.Namespace, command, **kwargs):
    """Run ``command(MODEL, **kwargs)`` with the shared options; (result, 0) or (None, 1) on bad input."""
    _set_threads(args.threads)
    return run_reporting_errors(
        prog,
        lambda: command(args.model, device=args.device, gguf_file=args.gguf_file, progress=not args.quiet, **kwargs),
        INPUT_ERRORS,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status: 0 ok, 1 bad input or failure, 2 usage error."""
    args = build_parser().parse_args(argv)
    from .pipeline import quantize_checkpoint

    summary, status = _run(
        "marlin-quantize",
        args,
        quantize_checkpoint,
        dst=args.out,
        calib=args.calib,
        group_size=args.group_size,
        act_order=args.act_order,
        clip=args.clip_search,
        clip_objective=args.clip_objective,
        clip_shift=args.clip_shift,
        refit=args.refit,
        damp=args.damp,
        true_sequential=args.true_sequential,
        fp_target=args.fp_target,
        nsamples=args.nsamples,
        seqlen_range=args.seqlen_range,
        seed=args.seed,
        sparsity=args.sparsity,
        bits=args.bits,
        sym=args.sym,
        rotate=args.rotate,
        overwrite=args.overwrite,
        resume=not args.no_resume,
    )
    if status:
        return status
    if not args.quiet:
        print(summary.text())
    return 0


def build_eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="marlin-eval",
        description=(
            "Perplexity of a causal LM on held-out text, with a fixed context and stride. MODEL is a Marlin "
            "checkpoint (run through marlin's layers: the CPU reference op, or the CUDA kernel on a GPU) or a "
            "full-precision model directory / .gguf (the FP16 baseline)."
        ),
    )
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--text", required=True, metavar="FILE|DIR", help="evaluation text: a file or a directory of .txt files")
    p.add_argument("--context", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--stride", type=int, default=None, help="window step; tokens scored per window (default: context)")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens of the text")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_run_options(p, "cpu (default) or cuda", "no progress bar")
    return p


def eval_main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_eval_parser().parse_args(argv)
    from .evaluate import evaluate_path

    result, status = _run(
        "marlin-eval", args, evaluate_path, text=args.text, context=args.context, stride=args.stride, max_tokens=args.max_tokens
    )
    if status:
        return status
    if args.json:
        print(json.dumps(result))
    else:
        print(f"perplexity {result['ppl']:.4f} over {result['tokens']} tokens ({result['kind']}, context {result['context']})")
    return 0


if __name__ == "__main__":  # python -m marlin.quantize.cli
    sys.exit(main())
