"""convert_gptq_checkpoint: a GPTQ, AWQ or compressed-tensors model directory in, a Marlin model directory out.

Order of work, so that a bad input costs nothing and leaves nothing behind:
  1. check DST, read and validate the quantization config;
  2. open every shard (validating the safetensors headers and the index) and check the name,
     shape and dtype of every quantized layer's tensors;
  3. only then convert, shard by shard, into a hidden directory next to DST, which is renamed to
     DST at the very end (or removed on any error, including a failed --verify).
The input is only ever read.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from tqdm.auto import tqdm

from .. import ops
from .checkpoint import INDEX_SUFFIX, PICKLE_SUFFIXES, SafetensorsDir, TensorInfo, read_json, write_json, write_shard
from .device import parse_device
from .errors import ConversionError
from .awq import AWQConfig, awq_to_marlin, check_awq_layer_tensors, dequantize_awq
from .compressed import CompressedTensorsConfig, check_ct_layer_tensors, ct_to_marlin, dequantize_ct
from .gptq import GPTQConfig, check_layer_tensors, dequantize_gptq, gptq_to_marlin
from .staging import check_destination, staged_directory
from .verify import VERIFY_TOLERANCE, verify_layer, verify_tolerance

__all__ = ["convert_gptq_checkpoint", "ConversionReport", "MARLIN_FORMAT", "CONFIG_FILE", "QUANTIZE_CONFIG_FILE"]

log = logging.getLogger(__name__)

MARLIN_FORMAT = "marlin"  # quantization_config.checkpoint_format of a converted checkpoint
CONFIG_FILE = "config.json"
QUANTIZE_CONFIG_FILE = "quantize_config.json"  # AutoGPTQ / GPTQModel's separate quantization config
AWQ_CONFIG_FILE = "quant_config.json"  # AutoAWQ's separate quantization config
_GPTQ_ONLY_SUFFIXES = ("qzeros", "scales", "g_idx")  # tensors that make no sense without a qweight


@dataclass
class ConversionReport:
    """What convert_gptq_checkpoint did."""

    src: Path
    dst: Path
    layers: list = field(default_factory=list)  # prefixes of the converted layers
    act_order_layers: list = field(default_factory=list)  # those stored with a perm
    sparse_layers: list = field(default_factory=list)  # those stored 2:4-sparse (MarlinLinear24)
    kept_dense: list = field(default_factory=list)  # (prefix, why) of a 2:4 checkpoint's dense layers
    copied_tensors: int = 0  # non-quantized tensors copied unchanged
    shards: list = field(default_factory=list)
    copied_files: list = field(default_factory=list)
    skipped_files: list = field(default_factory=list)  # (name, why)
    max_verify_error: Optional[float] = None  # None when not verified
    verify_tolerance: float = VERIFY_TOLERANCE

    def summary(self) -> str:
        lines = [
            f"converted {len(self.layers)} quantized layers ({len(self.act_order_layers)} with an act-order permutation) "
            f"and copied {self.copied_tensors} other tensors from {self.src} into {self.dst} "
            f"({len(self.shards)} shard{'s' if len(self.shards) != 1 else ''})"
        ]
        if self.sparse_layers or self.kept_dense:
            lines.append(f"2:4-sparse layers: {len(self.sparse_layers)}; dense: {len(self.kept_dense)}")
            lines += [f"  dense {prefix}: {why}" for prefix, why in self.kept_dense]
        if self.copied_files:
            lines.append(f"copied files: {', '.join(self.copied_files)}")
        for name, why in self.skipped_files:
            lines.append(f"skipped {name}: {why}")
        if self.max_verify_error is not None:
            lines.append(
                f"verified: max normwise relative error {self.max_verify_error:.2e} (bound {self.verify_tolerance:.0e})"
            )
        return "\n".join(lines)


@dataclass
class _QuantConfigs:
    config: dict  # config.json
    in_config: Optional[dict]  # config.json's quantization_config
    in_file: Optional[dict]  # quantize_config.json (GPTQ) or quant_config.json (AWQ)
    in_file_name: Optional[str]
    parsed: "SourceConfig"


SourceConfig = Union[GPTQConfig, AWQConfig, CompressedTensorsConfig]


def _parse_quant_config(qc: Any, where: str, awq_file: bool) -> SourceConfig:
    """AWQ or compressed-tensors when quant_method says so (AWQ also for AutoAWQ's own
    quant_config.json), else GPTQ, whose parser refuses any other method."""
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    method = method.lower() if isinstance(method, str) else method
    if method == "awq" or (awq_file and method is None):
        return AWQConfig.from_dict(qc, where)
    if method == "compressed-tensors":
        return CompressedTensorsConfig.from_dict(qc, where)
    return GPTQConfig.from_dict(qc, where)


def direct_gptq_config(cfg: SourceConfig, where: str) -> GPTQConfig:
    """``cfg`` where it is GPTQ's: the paths that read a checkpoint without a converted copy
    (gptq_config's from_pretrained, load_sharded) repack GPTQ layers only. Other methods have
    their own tensor layouts and are refused by name, with the way through marlin-convert."""
    if isinstance(cfg, GPTQConfig):
        return cfg
    method = "awq" if isinstance(cfg, AWQConfig) else "compressed-tensors"
    raise ConversionError(
        f"{where}: quant_method = {method!r}: not a GPTQ checkpoint, which is all that loads without conversion; "
        "convert it with marlin-convert and load the Marlin checkpoint"
    )


def _anchor(cfg: SourceConfig) -> str:
    """The tensor suffix that marks a quantized layer in the source format."""
    return "weight_packed" if isinstance(cfg, CompressedTensorsConfig) else "qweight"


def _read_quant_configs(src: Path) -> _QuantConfigs:
    config_path = src / CONFIG_FILE
    if not config_path.is_file():
        raise ConversionError(f"{config_path} not found; expected a Hugging Face model directory with a config.json")
    config = read_json(config_path)
    if not isinstance(config, dict):
        raise ConversionError(f"{config_path}: expected a JSON object, got a {type(config).__name__}")
    in_config = config.get("quantization_config")
    in_file, in_file_name = None, None
    for name in (QUANTIZE_CONFIG_FILE, AWQ_CONFIG_FILE):
        if (src / name).is_file():
            in_file, in_file_name = read_json(src / name), name
            break
    if in_config is None and in_file is None:
        raise ConversionError(
            f"{src}: no quantization config: {CONFIG_FILE} has no 'quantization_config' and there is no "
            f"{QUANTIZE_CONFIG_FILE} or {AWQ_CONFIG_FILE}"
        )
    parsed = [
        _parse_quant_config(qc, where, awq_file)
        for qc, where, awq_file in (
            (in_config, f"{config_path} (quantization_config)", False),
            (in_file, str(src / (in_file_name or "")), in_file_name == AWQ_CONFIG_FILE),
        )
        if qc is not None
    ]
    if len(parsed) == 2:
        a, b = parsed
        if type(a) is not type(b):
            raise ConversionError(f"{src}: {CONFIG_FILE} and {in_file_name} describe different methods (GPTQ vs AWQ)")
        keys = ("bits", "group_size", "sym", "checkpoint_format") if isinstance(a, GPTQConfig) else ("bits", "group_size")
        keys = ("bits", "group_size", "sym") if isinstance(a, CompressedTensorsConfig) else keys
        if any(getattr(a, k) != getattr(b, k) for k in keys):
            raise ConversionError(
                f"{src}: {CONFIG_FILE} and {in_file_name} disagree: "
                + ", ".join(f"{k} {getattr(a, k)!r} vs {getattr(b, k)!r}" for k in keys if getattr(a, k) != getattr(b, k))
            )
    return _QuantConfigs(config=config, in_config=in_config, in_file=in_file, in_file_name=in_file_name, parsed=parsed[0])


def _marlin_quant_config(qc: dict, cfg: SourceConfig) -> dict:
    """The input's quantization config (bits, group_size, desc_act, ... kept) marked as Marlin format."""
    out = dict(qc)
    if isinstance(cfg, AWQConfig):  # in the GPTQ field names that MarlinConfig reads; the rest is kept
        out.update(bits=cfg.bits, group_size=cfg.group_size, sym=False, desc_act=False, source_quant_method="awq")
    if isinstance(cfg, CompressedTensorsConfig):
        out = {  # compressed-tensors' nested config means nothing to Marlin layers: keep the facts only
            "bits": cfg.bits,
            "group_size": cfg.group_size,
            "sym": cfg.sym,
            "desc_act": False,
            "source_quant_method": "compressed-tensors",
        }
        if cfg.sparsity is not None:
            out["sparsity"] = cfg.sparsity
    # quant_method "marlin" routes transformers' from_pretrained to marlin's quantizer
    # (marlin.integrations.hf_quantizer); "gptq" would send it to the GPTQ kernels.
    out["quant_method"] = MARLIN_FORMAT
    out["checkpoint_format"] = MARLIN_FORMAT
    if "format" in out:  # GPTQModel's older name for the same field
        out["format"] = MARLIN_FORMAT
    return out


def _plan_layers(ckpt: SafetensorsDir, cfg: SourceConfig) -> tuple[dict, list]:
    """Split the tensors into quantized layers {prefix: {suffix: TensorInfo}} and pass-through names,
    and check every layer's names, shapes and dtypes."""
    anchor = "." + _anchor(cfg)
    prefixes = {name[: -len(anchor)] for name in ckpt.tensors if name.endswith(anchor)}
    if not prefixes:
        raise ConversionError(
            f"{ckpt.directory}: no quantized layers (no '*{anchor}' tensors); is this a GPTQ, AWQ or "
            "compressed-tensors checkpoint?"
        )
    layers: dict[str, dict[str, TensorInfo]] = {p: {} for p in prefixes}
    passthrough = []
    for name, info in ckpt.tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if prefix in layers:
            layers[prefix][suffix] = info
        elif suffix in _GPTQ_ONLY_SUFFIXES and anchor == ".qweight":
            raise ConversionError(f"{ckpt.directory}: tensor {name} (in {info.file}) has no {prefix}.qweight next to it")
        else:
            passthrough.append(name)
    for prefix, infos in sorted(layers.items()):
        shapes, dtypes = {s: i.shape for s, i in infos.items()}, {s: i.dtype for s, i in infos.items()}
        if isinstance(cfg, AWQConfig):
            check_awq_layer_tensors(prefix, shapes, dtypes, cfg.group_size)
            continue
        if isinstance(cfg, CompressedTensorsConfig):
            check_ct_layer_tensors(prefix, shapes, dtypes, cfg)
            continue
        check_layer_tensors(prefix, shapes, dtypes, cfg.group_size, cfg.bits)
        if "g_idx" not in infos and cfg.desc_act:
            raise ConversionError(f"layer {prefix}: {prefix}.g_idx is missing, but desc_act = true needs it")
    outputs = {f"{p}.{s}" for p in layers for s in ("b_q", "b_scales", "b_zeros", "perm", "b_meta")}
    clash = sorted(outputs & set(passthrough))
    if clash:
        raise ConversionError(f"{ckpt.directory}: tensor {clash[0]} would clash with a converted layer's output name")
    return layers, passthrough


def _copy_other_files(src: Path, out: Path, handled: set, report: ConversionReport) -> None:
    for path in sorted(src.iterdir()):
        name = path.name
        if name in handled:
            continue
        if path.is_dir():
            why = "a directory (only the files of the model directory are copied)"
        elif not path.is_file():
            why = "not a regular file"
        elif name.endswith(PICKLE_SUFFIXES):
            why = "a pickle file (never read or copied)"
        elif name.endswith(".safetensors") or name.endswith(INDEX_SUFFIX):
            why = "weights that the index does not list (not part of the converted checkpoint)"
        else:
            shutil.copyfile(path, out / name)  # follows symlinks (Hugging Face cache snapshots use them)
            report.copied_files.append(name)
            continue
        report.skipped_files.append((name, why))
        log.warning("marlin-convert: skipped %s: %s", path, why)


def convert_gptq_checkpoint(
    src: Union[str, Path],
    dst: Union[str, Path],
    *,
    overwrite: bool = False,
    verify: bool = False,
    device: Union[str, torch.device] = "cpu",
    quiet: bool = False,
) -> ConversionReport:
    """Convert a GPTQ, AWQ or compressed-tensors checkpoint directory ``src`` into a Marlin one, ``dst``.

    ``src`` is a Hugging Face model directory as written by AutoGPTQ, Optimum/transformers,
    GPTQModel or AutoAWQ (config.json with quantization_config, or quantize_config.json /
    quant_config.json; safetensors weights, one file or shards with their index). AWQ: the "gemm"
    layout, 4 bits with zero points, any supported group size. compressed-tensors (llm-compressor):
    "pack-quantized" W4A16 / W8A16, group or channel strategy, symmetric or (4 bits) asymmetric,
    with or without activation ordering (weight_g_idx); with a 2:4 ``sparsity_config`` (stored
    dense) its 2:4 layers become MarlinLinear24 layers (``<prefix>.b_q``, ``.b_meta``,
    ``.b_scales``, ``.b_zeros`` when asymmetric; marlin.convert.compressed says which qualify). GPTQ: bits 4 (sym true or false) or 8 (sym true),
    group_size 32, 64, 128 or -1, desc_act false or true, checkpoint_format "gptq" or "gptq_v2",
    scales in fp16 or bf16 (the converted layers compute in that dtype).

    ``dst`` gets the same shard files, each quantized layer ``<prefix>`` replaced by ``<prefix>.b_q``,
    ``<prefix>.b_scales``, ``<prefix>.b_zeros`` (sym false only), ``<prefix>.bias`` (if any) and
    ``<prefix>.perm`` (act-order only) --
    the state_dict keys of marlin.MarlinLinear -- and every other tensor copied unchanged; the
    index json; config.json with quantization_config.checkpoint_format = "marlin"; the other files
    (tokenizer, generation config, ...). ``dst`` must not exist unless ``overwrite``.

    ``verify`` checks every converted layer numerically on ``device`` (see marlin.convert.verify)
    and fails above the bound. ``quiet`` hides the progress bar.

    Raises ConversionError (a ValueError) with a message naming what is unsupported or broken;
    then nothing is written.
    """
    src = Path(src).absolute()
    dst = Path(dst).absolute()
    if not src.is_dir():
        raise ConversionError(f"source {src} is not a directory")
    check_destination(src, dst, overwrite)
    dev = parse_device(device) if verify else None
    configs = _read_quant_configs(src)
    cfg = configs.parsed
    report = ConversionReport(src=src, dst=dst)

    with SafetensorsDir(src) as ckpt:
        layers, passthrough = _plan_layers(ckpt, cfg)
        passthrough_set = set(passthrough)
        workspace = ops.make_workspace(dev) if dev is not None and dev.type == "cuda" else None
        with staged_directory(dst, overwrite) as out, tqdm(
            total=len(layers), desc="marlin-convert", unit="layer", disable=quiet
        ) as bar:
            weight_map: dict[str, str] = {}
            total_size = 0
            for shard in ckpt.shard_names:
                bar.set_postfix_str(shard, refresh=False)
                tensors: dict[str, torch.Tensor] = {}
                for name in ckpt.names_in(shard):
                    if name in passthrough_set:
                        tensors[name] = ckpt.get(name)
                        report.copied_tensors += 1
                    elif name.endswith("." + _anchor(cfg)):
                        prefix = name[: -len(_anchor(cfg)) - 1]
                        tensors.update(_convert_layer(ckpt, prefix, layers[prefix], cfg, dev, workspace, report))
                        bar.update(1)
                total_size += write_shard(out / shard, tensors)
                shutil.copymode(src / shard, out / shard)  # safetensors writes 0600; keep the input's mode
                weight_map.update({name: shard for name in tensors})
                report.shards.append(shard)
                del tensors

            if ckpt.index_name is not None:
                metadata = dict(ckpt.index_metadata, total_size=total_size)
                write_json(out / ckpt.index_name, {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))})
            quant_config = configs.in_config if configs.in_config is not None else configs.in_file
            write_json(
                out / CONFIG_FILE, dict(configs.config, quantization_config=_marlin_quant_config(quant_config, cfg))
            )
            handled = {CONFIG_FILE, *ckpt.shard_names}
            if ckpt.index_name is not None:
                handled.add(ckpt.index_name)
            if configs.in_file is not None:
                write_json(out / configs.in_file_name, _marlin_quant_config(configs.in_file, cfg))
                handled.add(configs.in_file_name)
            _copy_other_files(src, out, handled, report)
    return report


def _convert_layer(
    ckpt: SafetensorsDir,
    prefix: str,
    infos: dict,
    cfg: SourceConfig,
    dev: Optional[torch.device],
    workspace: Optional[torch.Tensor],
    report: ConversionReport,
) -> dict[str, torch.Tensor]:
    """The output tensors of one layer (its tensors may sit in other shards)."""
    gptq = {suffix: ckpt.get(f"{prefix}.{suffix}") for suffix in infos}
    if isinstance(cfg, AWQConfig):
        converted = awq_to_marlin(prefix, gptq["qweight"], gptq["qzeros"], gptq["scales"], group_size=cfg.group_size)
    elif isinstance(cfg, CompressedTensorsConfig):
        converted = ct_to_marlin(prefix, gptq, cfg)
    else:
        converted = gptq_to_marlin(
            prefix,
            gptq["qweight"],
            gptq["qzeros"],
            gptq["scales"],
            gptq.get("g_idx"),
            group_size=cfg.group_size,
            checkpoint_format=cfg.checkpoint_format,
            bits=cfg.bits,
            sym=cfg.sym,
        )
    out = converted.tensors(prefix)
    if "bias" in gptq:
        out[f"{prefix}.bias"] = gptq["bias"]
    if converted.perm is not None:
        report.act_order_layers.append(prefix)
    if converted.b_meta is not None:
        report.sparse_layers.append(prefix)
    elif converted.why_dense is not None:
        report.kept_dense.append((prefix, converted.why_dense))
    report.layers.append(prefix)
    if dev is not None:
        if isinstance(cfg, AWQConfig):
            reference = dequantize_awq(gptq["qweight"], gptq["qzeros"], gptq["scales"])
        elif isinstance(cfg, CompressedTensorsConfig):
            reference = dequantize_ct(gptq, cfg)
        else:
            reference = dequantize_gptq(
                gptq["qweight"], gptq["qzeros"], gptq["scales"], gptq.get("g_idx"), cfg.checkpoint_format, cfg.group_size, cfg.bits
            )
        err = verify_layer(prefix, reference, converted, device=dev, workspace=workspace)
        tolerance = verify_tolerance(converted.b_scales.dtype)
        report.verify_tolerance = max(report.verify_tolerance, tolerance)
        if not err <= tolerance:  # also catches nan
            raise ConversionError(
                f"verify: layer {prefix}: normwise relative error {err:.3e} of the converted layer against the "
                f"checkpoint's weights exceeds {tolerance:.0e}; nothing was written"
            )
        report.max_verify_error = max(err, report.max_verify_error or 0.0)
    return out
