"""The checkpoint marlin-quantize writes, and the per-block state that lets it resume.

Output directory DST (what marlin.load_quantized reads, the same layout as marlin-convert's):
  * ``model.safetensors``: for each quantized layer its MarlinLinear state dict (``<name>.b_q``,
    ``<name>.b_scales``, ``<name>.b_zeros`` with zero points, ``<name>.perm`` with act-order
    groups, ``<name>.bias`` if any) or, with 2:4 sparsity, its MarlinLinear24 state dict
    (``b_q``, ``b_meta``, ``b_scales``, ``b_zeros`` with zero points, ``bias``); every other tensor of the model's state dict
    in fp16 (embeddings, norms, head, layers kept in full precision); tied tensors once (a
    rotated model, marlin.quantize.rotate, is untied: its embedding and lm_head both stored);
  * ``config.json`` with ``quantization_config`` (quant_method and checkpoint_format "marlin",
    so that transformers' from_pretrained loads it too; bits, sym, sparsity, group_size,
    desc_act, rotated, and how it was made), tokenizer files, generation_config.json;
  * ``quantize_report.json`` and ``quantize_report.md``: every layer's relative output error on
    the calibration data (and round to nearest's, for comparison; with 2:4, magnitude pruning
    then round to nearest, and the share of the weight norm the pruning removed), or why it was
    kept.
DST appears complete or not at all: everything is written into a hidden staging directory next to
it, renamed at the end (marlin.convert.staging).

Resuming: each finished block is saved to ``.<DST name>.quantize-resume/block-NNNN.safetensors``
(its layers' q, scales, perm and report rows) next to DST, with ``manifest.json`` holding the
settings and a fingerprint of the calibration samples. A rerun with the same settings loads the
finished blocks instead of quantizing them again (their stored weights are put into the model and
run, to give the next block its inputs). The directory is removed once DST is written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .. import ops, packing, sparse
from .._layer_common import rotate_blocks
from ..convert.checkpoint import write_json
from ..convert.converter import MARLIN_FORMAT
from ..convert.staging import replace_file, staged_directory
from .gptq import GPTQResult
from .runner import BlockOutcome, LayerReport

__all__ = ["ResumeStore", "samples_fingerprint", "write_checkpoint", "report_markdown", "WEIGHTS_FILE", "REPORT_FILE"]

WEIGHTS_FILE = "model.safetensors"
REPORT_FILE = "quantize_report.json"
REPORT_MD = "quantize_report.md"


def samples_fingerprint(samples: Sequence[torch.Tensor]) -> str:
    """sha256 of the calibration token ids (a resume must use the very same samples)."""
    digest = hashlib.sha256()
    for ids in samples:
        digest.update(ids.to(torch.int64).contiguous().cpu().numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()


class ResumeStore:
    """Finished blocks of an interrupted run, in ``.<DST name>.quantize-resume`` next to DST."""

    def __init__(self, dst: Path, manifest: dict):
        self.dst = Path(dst)
        self.directory = self.dst.parent / f".{self.dst.name}.quantize-resume"
        self.manifest = manifest

    def load(self) -> dict:
        """{block index: BlockOutcome} of the finished blocks; refuses a manifest that does not
        match this run (other settings or calibration data)."""
        if not self.directory.is_dir():
            return {}
        path = self.directory / "manifest.json"
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: unreadable resume manifest ({e}); remove {self.directory} to start over") from None
        if stored != self.manifest:
            diff = sorted(k for k in set(stored) | set(self.manifest) if stored.get(k) != self.manifest.get(k))
            raise ValueError(
                f"{self.directory} holds an interrupted run with other settings ({', '.join(diff)} differ); "
                "rerun with the same settings, pass --no-resume, or remove that directory"
            )
        done = {}
        for file in sorted(self.directory.glob("block-*.safetensors")):
            index = int(file.stem.split("-")[1])
            if not file.with_suffix(".json").is_file():
                continue  # interrupted while writing this block: quantize it again
            tensors = load_file(str(file))
            rows = json.loads(file.with_suffix(".json").read_text(encoding="utf-8"))
            results = {}
            for row in rows:
                if row["status"] != "quantized":
                    continue
                name = row["name"]
                results[name] = GPTQResult(
                    q=tensors[f"{name}.q"],
                    scales=tensors[f"{name}.scales"],
                    perm=tensors.get(f"{name}.perm"),
                    group_size=self.manifest["group_size"],
                    error=row["error"],
                    rtn_error=row["rtn_error"],
                    zeros=tensors.get(f"{name}.zeros"),
                    bits=self.manifest.get("bits", 4),
                    sparsity=self.manifest.get("sparsity"),
                    pruned_fraction=row.get("pruned_fraction"),
                )
            done[index] = BlockOutcome(index, results, [LayerReport(**row) for row in rows])
        return done

    def start(self) -> None:
        self.directory.mkdir(exist_ok=True)
        write_json(self.directory / "manifest.json", self.manifest)

    def save_block(self, outcome: BlockOutcome) -> None:
        """Write one block (tensors, then report rows; the .json last marks it complete)."""
        tensors = {}
        for name, res in outcome.results.items():
            tensors[f"{name}.q"] = res.q
            tensors[f"{name}.scales"] = res.scales
            if res.zeros is not None:
                tensors[f"{name}.zeros"] = res.zeros
            if res.perm is not None:
                tensors[f"{name}.perm"] = res.perm
        base = self.directory / f"block-{outcome.index:04d}"
        replace_file(
            base.with_suffix(".safetensors"), lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        )
        rows = json.dumps([r.as_dict() for r in outcome.reports], indent=1)
        replace_file(base.with_suffix(".json"), lambda tmp: tmp.write_text(rows, encoding="utf-8"))

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _marlin_tensors(name: str, res: GPTQResult, bias: Optional[torch.Tensor]) -> dict:
    """The layer's MarlinLinear (or, 2:4, MarlinLinear24) state dict entries."""
    if res.sparsity is not None:
        packed = sparse.pack_2_4(res.q, res.scales, res.zeros)  # positions: the non-zeros of q (of u - z)
        out = {f"{name}.b_q": packed[0], f"{name}.b_meta": packed[1], f"{name}.b_scales": packed[2]}
        if res.zeros is not None:
            out[f"{name}.b_zeros"] = packed[3]
    else:
        packed = packing.pack(res.q, res.scales, res.zeros, bits=res.bits)
        out = {f"{name}.b_q": packed[0], f"{name}.b_scales": packed[1]}
        if res.zeros is not None:
            out[f"{name}.b_zeros"] = packed[2]
    if res.perm is not None:
        out[f"{name}.perm"] = res.perm.to(torch.int32)
    if bias is not None:
        out[f"{name}.bias"] = bias.detach().to(torch.float16)
    return out


def _state_tensors(model: nn.Module, results: dict) -> dict:
    """The checkpoint's tensors: Marlin tensors for quantized layers, fp16 copies of the rest."""
    out: dict = {}
    seen: dict = {}  # storage pointer -> first name (tied weights are stored once)
    state = model.state_dict()
    quantized_keys = {f"{name}.{s}" for name in results for s in ("weight", "bias")}
    for name, res in results.items():
        out.update(_marlin_tensors(name, res, state.get(f"{name}.bias")))
    # a layer kept in full precision whose input is rotated online (marlin.quantize.rotate) is
    # written as a plain Linear: the rotation folded back into its weight, W blockdiag(R)^T, since
    # transformers' nn.Linear would ignore an input_rotation key
    for name, module in model.named_modules():
        rot = getattr(module, "input_rotation", None)
        if name not in results and isinstance(module, nn.Linear) and isinstance(rot, torch.Tensor):
            w = rotate_blocks(module.weight.detach().to(torch.float64), rot.detach().to(torch.float64).t())
            out[f"{name}.weight"] = w.to(torch.float16)
            quantized_keys |= {f"{name}.weight", f"{name}.input_rotation"}
    for key, tensor in state.items():
        if key in quantized_keys:
            continue
        ptr = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if ptr in seen:
            continue
        seen[ptr] = key
        out[key] = tensor.detach().to(torch.float16) if tensor.is_floating_point() else tensor.detach()
    return out


def report_markdown(reports: Sequence[LayerReport], settings: dict) -> str:
    lines = [
        "# marlin-quantize report",
        "",
        "Settings: " + ", ".join(f"{k} = {v}" for k, v in settings.items()),
        "",
        "Relative output error ||X W^T - X W_q^T|| / ||X W^T|| of each layer on its calibration inputs "
        "(the inputs it saw with the earlier blocks already quantized); `rtn` is round to nearest of "
        "the same weights on the same inputs.",
    ]
    sparse_run = any(r.pruned_fraction is not None for r in reports)
    if sparse_run:
        lines[-1] += (
            " With 2:4 sparsity, `rtn` prunes by magnitude and then rounds to nearest, and `pruned` is "
            "||W at the pruned positions|| / ||W||."
        )
        lines += ["", "| layer | in | out | status | error | rtn error | pruned | note |", "|---|---:|---:|---|---:|---:|---:|---|"]
    else:
        lines += ["", "| layer | in | out | status | error | rtn error | note |", "|---|---:|---:|---|---:|---:|---|"]
    for r in reports:
        err = f"{r.error:.4f}" if r.error is not None else ""
        rtn = f"{r.rtn_error:.4f}" if r.rtn_error is not None else ""
        pruned = (f" {r.pruned_fraction:.1%} |" if r.pruned_fraction is not None else " |") if sparse_run else ""
        lines.append(f"| {r.name} | {r.in_features} | {r.out_features} | {r.status} | {err} | {rtn} |{pruned} {r.reason} |")
    quantized = [r for r in reports if r.status == "quantized"]
    if quantized:
        mean = sum(r.error for r in quantized) / len(quantized)
        mean_rtn = sum(r.rtn_error for r in quantized) / len(quantized)
        lines += ["", f"{len(quantized)} layers quantized, mean error {mean:.4f} (round to nearest {mean_rtn:.4f}); "
                  f"{len(reports) - len(quantized)} kept in full precision."]
    return "\n".join(lines) + "\n"


def write_checkpoint(
    model: nn.Module,
    results: dict,
    reports: Sequence[LayerReport],
    dst: Path,
    *,
    settings: dict,
    tokenizer=None,
    overwrite: bool = False,
) -> None:
    """Write the Marlin checkpoint of a quantized ``model`` (see the module docstring), atomically."""
    dst = Path(dst)
    for name, res in results.items():
        k, n = res.q.shape
        reason = ops.check_shape(k, n, res.group_size, res.bits)
        if reason is None and res.sparsity is not None:
            reason = sparse.check_shape_2_4(k, n, res.group_size)
        if reason is not None:
            raise ValueError(f"{name}: quantized with a shape the Marlin kernel cannot load ({reason})")
    tensors = _state_tensors(model, results)
    config = model.config.to_dict()
    # quant_method "marlin" routes transformers' from_pretrained to marlin's quantizer
    # (marlin.integrations), as marlin-convert's checkpoints do; the layers' formats are in
    # their tensors (b_zeros, b_meta, b_q's width).
    config["quantization_config"] = {
        "quant_method": MARLIN_FORMAT,
        "checkpoint_format": MARLIN_FORMAT,
        "bits": settings.get("bits", 4),
        "sym": settings.get("sym", True),
        "sparsity": settings.get("sparsity"),
        "group_size": settings["group_size"],
        "desc_act": bool(settings.get("act_order", False)),
        # the weights act on a rotated residual stream (marlin.quantize.rotate): folded into the
        # weights, except down_proj's input, which its layers rotate at run time (input_rotation)
        "rotated": bool(settings.get("rotate", False)),
        "quantizer": "marlin-quantize",
        "settings": settings,
    }
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "float16"
    report = {"settings": settings, "layers": [r.as_dict() for r in reports]}
    with staged_directory(dst, overwrite) as out:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        write_json(out / "config.json", config)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        write_json(out / REPORT_FILE, report)
        (out / REPORT_MD).write_text(report_markdown(reports, settings), encoding="utf-8")
