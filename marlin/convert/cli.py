"""``marlin-convert SRC DST``: the command line for marlin.convert.convert_gptq_checkpoint."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .converter import convert_gptq_checkpoint
from .errors import run_reporting_errors
from .verify import VERIFY_TOLERANCE

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="marlin-convert",
        description=(
            "Convert a GPTQ checkpoint directory (AutoGPTQ, Optimum/transformers, GPTQModel; 4-bit symmetric "
            "or asymmetric, 8-bit symmetric, group size 32, 64, 128 or -1, with or without act-order), an "
            "AutoAWQ 'gemm' checkpoint (4-bit with zero points) or a compressed-tensors 'pack-quantized' one "
            "(llm-compressor; 2:4-pruned layers become 2:4-sparse), safetensors only, into the Marlin format "
            "read by marlin.load_quantized. SRC is never modified; DST is written completely or not at all."
        ),
    )
    parser.add_argument("src", metavar="SRC", help="GPTQ, AWQ or compressed-tensors model directory (config.json, *.safetensors, tokenizer, ...)")
    parser.add_argument("dst", metavar="DST", help="output directory; must not exist (see --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument(
        "--verify",
        action="store_true",
        help=f"check every converted layer on random inputs against the checkpoint's weights (fails above a "
        f"normwise relative error of {VERIFY_TOLERANCE:.0e}, 8x that for bf16 layers)",
    )
    parser.add_argument("--device", default="cpu", help="where --verify runs the Marlin op: cpu (default) or cuda")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the converter; returns the exit status (0 ok, 1 conversion error, 2 usage error)."""
    args = build_parser().parse_args(argv)
    # OSError: e.g. DST's parent is not writable, disk full
    report, status = run_reporting_errors(
        "marlin-convert",
        lambda: convert_gptq_checkpoint(
            args.src, args.dst, overwrite=args.overwrite, verify=args.verify, device=args.device, quiet=args.quiet
        ),
    )
    if status:
        return status
    if not args.quiet:
        print(report.summary())
    return 0


if __name__ == "__main__":  # python -m marlin.convert.cli
    sys.exit(main())
