"""An independent writer of GPTQ checkpoints, for the conversion tests.

It follows the published GPTQ format (AutoGPTQ's QuantLinear.pack, Optimum, GPTQModel) and shares
no code with marlin: quantization and packing are written here again, in numpy, from the format
description, so that a misreading of the format in marlin.convert would not be mirrored here.

GPTQ works on the nn.Linear weight W [N, K] (out_features x in_features) and groups columns of K:
  * groups: with act-order, K is walked in a permuted order and group g is the g-th block of
    group_size columns in that order; g_idx[k] is the group of column k (not monotone then);
  * maxq = 2^bits - 1; symmetric: scale = 2 * max|w| / maxq, zero = (maxq + 1) / 2; asymmetric:
    scale = (max - min) / maxq over the range widened to include 0, zero = round(-min / scale);
  * q = clamp(round(w / scale) + zero, 0, maxq), with the scale already rounded to fp16;
  * qweight int32 [K / P, N] (P = 32 / bits): column n of W^T, P consecutive k per word, lowest bits first;
  * qzeros int32 [G, N / P]: P consecutive n per word, lowest bits first; the stored value is
    zero - 1 in checkpoint_format "gptq" and zero in "gptq_v2";
  * scales fp16 [G, N], g_idx int32 [K], bias fp16 [N].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import save_file



@dataclass
class GPTQLayer:
    """One quantized layer in natural (unpacked) form, plus its packed tensors."""

    q: np.ndarray  # int64 [K, N], 0..15
    zeros: np.ndarray  # int64 [G, N], the zero points of the formula
    scales: np.ndarray  # float16 [G, N]
    g_idx: np.ndarray  # int32 [K]
    bias: Optional[np.ndarray] = None  # float16 [N]
    bits: int = 4

    def dequantize(self) -> torch.Tensor:
        """W^T = B [K, N] in float32: scales[g_idx[k]] * (q[k] - zeros[g_idx[k]])."""
        s = self.scales.astype(np.float32)[self.g_idx]
        z = self.zeros[self.g_idx].astype(np.float32)
        return torch.from_numpy(s * (self.q.astype(np.float32) - z))

    def tensors(self, checkpoint_format: str) -> dict:
        """The tensors of this layer as stored in a checkpoint, by suffix."""
        stored_zeros = self.zeros - 1 if checkpoint_format == "gptq" else self.zeros
        out = {
            "qweight": torch.from_numpy(pack_along_k(self.q, self.bits)),
            "qzeros": torch.from_numpy(pack_along_n(stored_zeros, self.bits)),
            "scales": _to_torch(self.scales),
            "g_idx": torch.from_numpy(self.g_idx.copy()),
        }
        if self.bias is not None:
            out["bias"] = _to_torch(self.bias)
        return out


def pack_along_k(q: np.ndarray, bits: int = 4) -> np.ndarray:
    """q [K, N] -> int32 [K / P, N] (P = 32 / bits): word i holds rows Pi..Pi+P-1, row Pi+j at bits bits*j."""
    k, n = q.shape
    p, mask = 32 // bits, (1 << bits) - 1
    rows = (q.astype(np.int64) & mask).astype(np.uint32).reshape(k // p, p, n)
    words = np.zeros((k // p, n), dtype=np.uint32)
    for j in range(p):
        words |= rows[:, j, :] << np.uint32(bits * j)
    return words.view(np.int32)


def pack_along_n(z: np.ndarray, bits: int = 4) -> np.ndarray:
    """z [G, N] -> int32 [G, N / P]: word c holds columns Pc..Pc+P-1, column Pc+j at bits bits*j.
    A negative value (v1's zero - 1 for a zero of 0) wraps to its low bits."""
    g, n = z.shape
    p, mask = 32 // bits, (1 << bits) - 1
    cols = (z.astype(np.int64) & mask).astype(np.uint32).reshape(g, n // p, p)
    words = np.zeros((g, n // p), dtype=np.uint32)
    for j in range(p):
        words |= cols[:, :, j] << np.uint32(bits * j)
    return words.view(np.int32)


def quantize_gptq(
    weight: np.ndarray,
    group_size: int,
    *,
    sym: bool = True,
    act_order: bool = False,
    bias: Optional[np.ndarray] = None,
    rng: Optional[np.random.Generator] = None,
    bits: int = 4,
    scale_dtype=np.float16,
) -> GPTQLayer:
    """GPTQ-style round-to-nearest quantization of an nn.Linear weight [N, K] (float)."""
    maxq = (1 << bits) - 1
    w = np.asarray(weight, dtype=np.float32)
    n, k = w.shape
    gs = k if group_size == -1 else group_size
    groups = k // gs
    rng = rng or np.random.default_rng(0)
    order = rng.permutation(k) if act_order else np.arange(k)  # GPTQ sorts by the Hessian diagonal
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[order] = np.arange(k) // gs
    q = np.empty((k, n), dtype=np.int64)
    scales = np.empty((groups, n), dtype=np.float32)
    zeros = np.empty((groups, n), dtype=np.int64)
    for g in range(groups):
        cols = order[g * gs : (g + 1) * gs]
        block = w[:, cols]  # [N, gs]
        lo = np.minimum(block.min(axis=1), 0.0)
        hi = np.maximum(block.max(axis=1), 0.0)
        if sym:
            amax = np.maximum(-lo, hi)
            amax = np.where(amax == 0, 1.0, amax)
            scale = _round_scale(2 * amax / maxq, scale_dtype)
            zero = np.full(n, (maxq + 1) // 2)
        else:
            span = np.where(hi - lo == 0, 1.0, hi - lo)
            scale = _round_scale(span / maxq, scale_dtype)
            zero = np.round(-lo / scale).astype(np.int64)
        s = scale
        qg = np.clip(np.round(block / s[:, None]) + zero[:, None], 0, maxq).astype(np.int64)  # [N, gs]
        q[cols, :] = qg.T
        scales[g], zeros[g] = scale, zero
    return GPTQLayer(
        q=q,
        zeros=zeros,
        scales=_wrap(scales, scale_dtype),
        g_idx=g_idx,
        bias=None if bias is None else _wrap(bias.astype(np.float32), scale_dtype, round_=True),
        bits=bits,
    )


def _round_scale(x: np.ndarray, scale_dtype) -> np.ndarray:
    """Round float32 values to fp16 (numpy) or bf16 (round to nearest even on the float32 bits), as float32."""
    x = np.asarray(x, dtype=np.float32)
    if scale_dtype == "bfloat16":
        u = x.view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.astype(np.uint32).view(np.float32)
    return x.astype(np.float16).astype(np.float32)


def _wrap(values: np.ndarray, scale_dtype, round_: bool = False) -> np.ndarray:
    """Scales (or bias) as fp16 numpy values, or bf16 values held as float32 in a _BF16Array
    (numpy has no bf16), which tensors() stores as torch.bfloat16."""
    if scale_dtype == "bfloat16":
        return _BF16Array(_round_scale(values, "bfloat16") if round_ else values)
    return values.astype(np.float16)


class _BF16Array(np.ndarray):
    """float32 values that are exactly bf16 numbers."""

    def __new__(cls, values):
        return np.asarray(values, dtype=np.float32).view(cls)


def _to_torch(a: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(np.asarray(a).copy())
    return t.bfloat16() if isinstance(a, _BF16Array) else t


def random_layer(
    k: int, n: int, group_size: int, *, seed: int, act_order=False, sym=True, bias=True, bits=4, scale_dtype=np.float16
) -> GPTQLayer:
    """scale_dtype: np.float16 or "bfloat16" (bf16 scales and bias)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    b = rng.standard_normal(n).astype(np.float32) * 0.1 if bias else None
    return quantize_gptq(w, group_size, sym=sym, act_order=act_order, bias=b, rng=rng, bits=bits, scale_dtype=scale_dtype)


def write_gptq_checkpoint(
    path: Path,
    layers: dict,
    other_tensors: Optional[dict] = None,
    *,
    group_size: int = 128,
    bits: int = 4,
    sym: bool = True,
    desc_act: bool = False,
    checkpoint_format: str = "gptq",
    num_shards: int = 1,
    model_config: Optional[dict] = None,
    config_style: str = "config",
    extra_files: Optional[dict] = None,
) -> Path:
    """Write a GPTQ model directory: config, safetensors (1 file or ``num_shards`` shards with an
    index, tensors dealt round-robin so that a layer's tensors land in different shards), and
    ``extra_files`` {name: text}.

    ``config_style``: "config" (Optimum/GPTQModel: quantization_config inside config.json),
    "quantize_config" (AutoGPTQ: a separate quantize_config.json) or "both".
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for prefix, layer in layers.items():
        for suffix, t in layer.tensors(checkpoint_format).items():
            tensors[f"{prefix}.{suffix}"] = t
    for name, t in (other_tensors or {}).items():
        tensors[name] = t.detach().contiguous()

    names = sorted(tensors)
    if num_shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(num_shards):
            shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
            part = {name: tensors[name] for name in names[i::num_shards]}
            save_file(part, str(path / shard), metadata={"format": "pt"})
            weight_map.update({name: shard for name in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    quant = {"bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym, "damp_percent": 0.01}
    if checkpoint_format != "gptq" or config_style != "quantize_config":
        quant["checkpoint_format"] = checkpoint_format
    config = dict(model_config or {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    if config_style in ("config", "both"):
        config["quantization_config"] = dict(quant, quant_method="gptq")
    if config_style in ("quantize_config", "both"):
        (path / "quantize_config.json").write_text(json.dumps(quant, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name, text in (extra_files or {}).items():
        (path / name).write_text(text)
    return path
