"""An independent writer of AutoAWQ "GEMM" checkpoints, for the conversion tests.

Written from AutoAWQ's published format (WQLinear_GEMM.from_linear and its pseudo-quantizer), in
numpy, sharing no code with marlin.convert.awq:
  * per group of group_size input features and per output column: max_val, min_val over the group,
    scale = (max_val - min_val) / 15 (clamped to >= 1e-5), zero = clamp(-round(min_val / scale), 0, 15),
    q = clamp(round(w / scale) + zero, 0, 15), scale stored in fp16 (rounded before q is computed);
  * qweight int32 [K, N / 8]: for each input feature k, word c packs columns 8c..8c+7 with
    column 8c + ORDER[i] in bits 4i..4i+3, ORDER = [0, 2, 4, 6, 1, 3, 5, 7];
  * qzeros int32 [G, N / 8] packed the same way; scales fp16 [G, N]; bias fp16 [N].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import save_file

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass
class AWQLayer:
    q: np.ndarray  # int64 [K, N] 0..15
    zeros: np.ndarray  # int64 [G, N]
    scales: np.ndarray  # float16 [G, N]
    bias: Optional[np.ndarray] = None

    def dequantize(self) -> torch.Tensor:
        rows = self.q.shape[0] // self.scales.shape[0]
        s = np.repeat(self.scales.astype(np.float32), rows, axis=0)
        z = np.repeat(self.zeros.astype(np.float32), rows, axis=0)
        return torch.from_numpy(s * (self.q.astype(np.float32) - z))

    def tensors(self) -> dict:
        out = {
            "qweight": torch.from_numpy(pack_columns(self.q)),
            "qzeros": torch.from_numpy(pack_columns(self.zeros)),
            "scales": torch.from_numpy(self.scales.copy()),
        }
        if self.bias is not None:
            out["bias"] = torch.from_numpy(self.bias.copy())
        return out


def pack_columns(v: np.ndarray) -> np.ndarray:
    """[R, N] of 4-bit values -> int32 [R, N / 8] in AWQ's interleaved column order."""
    r, n = v.shape
    cols = v.astype(np.uint32).reshape(r, n // 8, 8)
    words = np.zeros((r, n // 8), dtype=np.uint32)
    for i in range(8):
        words |= cols[:, :, ORDER[i]] << np.uint32(4 * i)
    return words.view(np.int32)


def quantize_awq(weight: np.ndarray, group_size: int, bias: Optional[np.ndarray] = None) -> AWQLayer:
    """Round-to-nearest AWQ quantization of an nn.Linear weight [N, K] (no activation-aware scaling:
    that changes the weights, not the format)."""
    w = np.asarray(weight, dtype=np.float32).T  # [K, N]
    k, n = w.shape
    gs = k if group_size == -1 else group_size
    g = w.reshape(k // gs, gs, n)
    max_val, min_val = g.max(axis=1), g.min(axis=1)
    scales = (np.maximum(max_val - min_val, 1e-5) / 15).astype(np.float16)
    s = scales.astype(np.float32)
    zeros = np.clip(-np.round(min_val / s), 0, 15).astype(np.int64)
    q = np.clip(np.round(g / s[:, None, :]) + zeros[:, None, :], 0, 15).astype(np.int64).reshape(k, n)
    return AWQLayer(q=q, zeros=zeros, scales=scales, bias=None if bias is None else bias.astype(np.float16))


def random_awq_layer(k: int, n: int, group_size: int, *, seed: int, bias=True) -> AWQLayer:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05 + 0.01
    b = rng.standard_normal(n).astype(np.float32) * 0.1 if bias else None
    return quantize_awq(w, group_size, b)


def write_awq_checkpoint(
    path: Path,
    layers: dict,
    other_tensors: Optional[dict] = None,
    *,
    group_size: int = 128,
    config_style: str = "config",
    model_config: Optional[dict] = None,
    version: str = "gemm",
) -> Path:
    """A single-file AWQ model directory. config_style "config": transformers' AwqConfig inside
    config.json; "quant_config": AutoAWQ's separate quant_config.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"{p}.{s}": t for p, layer in layers.items() for s, t in layer.tensors().items()}
    tensors.update({name: t.detach().contiguous() for name, t in (other_tensors or {}).items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = dict(model_config or {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    if config_style == "config":
        config["quantization_config"] = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": version,
        }
    else:
        (path / "quant_config.json").write_text(
            json.dumps({"zero_point": True, "q_group_size": group_size, "w_bit": 4, "version": version.upper()})
        )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
