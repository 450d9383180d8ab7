"""quantize_checkpoint: a transformers model in, a Marlin checkpoint out (``marlin-quantize``).

Order of work, so that bad input costs nothing: check the destination, the options, the model
files and the calibration text; then load, draw the samples, quantize block by block (saving each
finished block for a resume) and write the checkpoint atomically.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch

from ..convert.staging import check_destination
from ..convert.device import parse_device
from .calib import CalibrationSpec, draw_samples, read_texts
from .clip import DEFAULT_GRID
from .gptq import resolve_clip_objective
from .rotate import DOWN_BLOCK, rotate_model
from .runner import QuantizeConfig, find_blocks, quantize_model
from .source import load_model, load_tokenizer, resolve_source
from .writer import REPORT_FILE, ResumeStore, samples_fingerprint, write_checkpoint

__all__ = ["quantize_checkpoint", "QuantizeSummary", "check_sparsity"]

@dataclass
class QuantizeSummary:
    dst: Path
    quantized: int = 0
    kept: list = field(default_factory=list)  # (name, why)
    resumed_blocks: int = 0
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    peak_device_mb: Optional[float] = None
    mean_error: Optional[float] = None
    mean_rtn_error: Optional[float] = None
    mean_pruned: Optional[float] = None  # 2:4: mean share of the weight norm pruned

    def text(self) -> str:
        lines = [f"wrote {self.dst}: {self.quantized} layers quantized, {len(self.kept)} kept in full precision"]
        if self.mean_error is not None:
            lines.append(
                f"mean relative output error on the calibration data {self.mean_error:.4f} "
                f"(round to nearest{' after magnitude pruning' if self.mean_pruned is not None else ''}: "
                f"{self.mean_rtn_error:.4f}); per layer in {self.dst / REPORT_FILE}"
            )
        if self.mean_pruned is not None:
            lines.append(f"2:4 pruning removed on average {self.mean_pruned:.1%} of each layer's weight norm")
        for name, why in self.kept[:10]:
            lines.append(f"kept {name}: {why}")
        if len(self.kept) > 10:
            lines.append(f"... and {len(self.kept) - 10} more (see the report)")
        extra = f", resumed {self.resumed_blocks} finished blocks" if self.resumed_blocks else ""
        mem = f", peak device memory {self.peak_device_mb:.0f} MB" if self.peak_device_mb is not None else ""
        lines.append(f"took {self.seconds:.0f} s{extra}; peak host memory {self.peak_rss_mb:.0f} MB{mem}")
        return "\n".join(lines)


def check_sparsity(sparsity: Optional[str]) -> None:
    """None is dense; '2:4' is joint 2:4 pruning (SparseGPT) for the Sparse-MARLIN layer
    (marlin.MarlinLinear24); anything else is refused."""
    if sparsity is None or sparsity == "2:4":
        return
    raise ValueError(f"sparsity = {sparsity!r}, expected '2:4' (the only pattern of the sparse kernel) or none")


def quantize_checkpoint(
    model: Union[str, Path],
    dst: Union[str, Path],
    *,
    calib: Union[str, Path],
    group_size: int = 128,
    act_order: bool = False,
    clip: bool = True,
    clip_grid: tuple = DEFAULT_GRID,
    clip_objective: str = "auto",
    clip_shift: bool = False,
    refit: int = 0,
    damp: float = 0.01,
    true_sequential: bool = True,
    fp_target: bool = True,
    nsamples: int = 256,
    seqlen_range: tuple = (32, 512),
    seed: int = 0,
    sparsity: Optional[str] = None,
    bits: int = 4,
    sym: Optional[bool] = None,
    rotate: bool = False,
    device: Union[str, torch.device] = "cpu",
    gguf_file: Optional[str] = None,
    overwrite: bool = False,
    resume: bool = True,
    progress: bool = True,
) -> QuantizeSummary:
    """Quantize the causal LM at ``model`` (safetensors directory or GGUF) with the paper's GPTQ
    variant and write a Marlin checkpoint to ``dst`` (loadable with marlin.load_quantized).

    ``calib``: a text file or a directory of .txt files; ``nsamples`` windows of its tokens with
    lengths drawn from ``seqlen_range`` (MIN, MAX) with ``seed`` (MIN == MAX: fixed length).
    ``clip``: the group-wise clip search, scored by ``clip_objective`` ("auto": "columnwise" per
    column, "compensated" with groups; or "hessian"; marlin.quantize.gptq), ``clip_shift``: each
    end of a zero-point range shrinks on its own; ``refit``: rounds of refitting the scales and
    zero points to GPTQ's codes (marlin.quantize.refit); ``act_order``: GPTQ's descending-activation order; ``true_sequential``
    and ``fp_target``: see marlin.quantize.runner.
    ``bits`` 4 or 8 and ``sym`` (False: 4-bit zero points; None: zero points for dense 4-bit,
    the format that loses least, symmetric for 8-bit, which has no zero points, and for 2:4, whose
    zero points are taken on request, sym=False): the weight format. ``sparsity``
    "2:4": prune to 2:4 jointly with the quantization (2:4 Marlin layers; group 128, 64, 32 or -1).
    ``rotate``: first rotate the residual stream by an orthogonal matrix folded into the weights
    and down_proj's input online in blocks of 64 (without ``sparsity``: MarlinLinear's
    input_rotation; marlin.quantize.rotate; Llama, Mistral, Qwen2), which unties tied embeddings.
    Layers whose shapes the kernel does not take stay in full precision (listed in the report).
    Raises ValueError for bad input, before anything is loaded or written.
    """
    start = time.perf_counter()
    dst = Path(dst).absolute()
    source = resolve_source(model, gguf_file)
    check_destination(source.directory, dst, overwrite)
    check_sparsity(sparsity)
    if sym is None:
        sym = not (bits == 4 and sparsity is None)
    dev = parse_device(device)
    config = QuantizeConfig(
        group_size=group_size,
        act_order=act_order,
        clip=clip,
        clip_grid=tuple(clip_grid),
        clip_objective=clip_objective,
        clip_shift=clip_shift,
        refit=refit,
        damp=damp,
        true_sequential=true_sequential,
        fp_target=fp_target,
        bits=bits,
        sym=sym,
        sparsity=sparsity,
    )
    spec = CalibrationSpec(nsamples=nsamples, min_len=seqlen_range[0], max_len=seqlen_range[1], seed=seed)
    text = read_texts(calib)

    tokenizer = load_tokenizer(source)
    net = load_model(source, dtype=torch.float32 if dev.type == "cpu" else torch.float16)
    find_blocks(net)  # an unsupported architecture fails here, before the calibration runs
    # down_proj's online rotation needs MarlinLinear's input_rotation, which 2:4 layers do not have
    down_block = DOWN_BLOCK if rotate and sparsity is None else None
    if rotate:
        rotate_model(net, down_block=down_block)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    samples = draw_samples(ids, spec)

    settings = {
        "bits": bits,
        "sym": sym,
        "sparsity": sparsity,
        "rotate": rotate,
        "rotate_down_block": down_block,
        "group_size": group_size,
        "act_order": act_order,
        "clip_search": clip,
        "clip_grid": list(config.clip_grid) if clip else None,
        "clip_objective": resolve_clip_objective(clip_objective, group_size) if clip else None,
        "clip_shift": clip_shift if clip else None,
        "refit": refit,
        "damp": damp,
        "true_sequential": true_sequential,
        "fp_target": fp_target,
        "nsamples": nsamples,
        "seqlen_range": [spec.min_len, spec.max_len],
        "seed": seed,
        "calibration": str(Path(calib)),
        "calibration_tokens": int(sum(s.numel() for s in samples)),
        "model": source.describe(),
    }
    manifest = dict(settings, samples_sha256=samples_fingerprint(samples))
    store = ResumeStore(dst, manifest)
    if not resume:
        store.remove()
    done = store.load()
    store.start()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    results, reports = quantize_model(
        net, samples, config, device=dev, done=done, on_block_done=store.save_block, progress=progress
    )
    if not results:
        reasons = sorted({r.reason for r in reports})
        raise ValueError(f"no layer of {source.describe()} could be quantized ({'; '.join(reasons[:3])}); nothing written")
    write_checkpoint(net, results, reports, dst, settings=settings, tokenizer=tokenizer, overwrite=overwrite)
    store.remove()

    summary = QuantizeSummary(dst=dst, resumed_blocks=len(done))
    quantized = [r for r in reports if r.status == "quantized"]
    summary.quantized = len(quantized)
    summary.kept = [(r.name, r.reason) for r in reports if r.status != "quantized"]
    if quantized:
        summary.mean_error = sum(r.error for r in quantized) / len(quantized)
        summary.mean_rtn_error = sum(r.rtn_error for r in quantized) / len(quantized)
        pruned = [r.pruned_fraction for r in quantized if r.pruned_fraction is not None]
        if pruned:
            summary.mean_pruned = sum(pruned) / len(pruned)
    summary.seconds = time.perf_counter() - start
    summary.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if dev.type == "cuda":
        summary.peak_device_mb = torch.cuda.max_memory_allocated(dev) / 2**20
    return summary
