"""GPTQ checkpoints for load_sharded: each rank converts only its slice of each GPTQ layer.

The GPTQ layout (marlin.convert.gptq) packs w = 32 / bits rows of K per int32 of ``qweight``
[K / w, N] (8 for 4 bits, 4 for 8 bits) and w columns of N per int32 of ``qzeros`` [G, N / w];
scales are [G, N]. So
  * a column shard n0:n1 (multiples of 64) reads ``qweight[:, n0:n1]``, ``scales[:, n0:n1]``,
    ``qzeros[:, n0/w : n1/w]`` and the whole ``g_idx`` (K ints), and converts that slice: the
    act-order permutation acts on K, which the column shard keeps whole;
  * a row shard k0:k1 without act-order reads ``qweight[k0/w : k1/w]`` and the groups' rows of
    ``scales`` and ``qzeros``;
  * a row shard of an act-order layer needs the stored (sorted) rows of whole groups, which are
    scattered over the file's rows: that layer is read and converted whole on the host, one layer
    at a time, and then sliced like a Marlin layer.
The conversion is marlin.convert.gptq.gptq_to_marlin, exact (the same checks and errors as
marlin-convert), in the checkpoint's format: 4- or 8-bit symmetric, or 4-bit with zero points
(``sym = false``: the shards carry b_zeros like b_scales).
"""

from __future__ import annotations

from typing import Optional

from .. import packing
from ..convert.errors import ConversionError
from ..convert.gptq import GPTQConfig, act_order_permutation, check_layer_tensors, gptq_to_marlin
from ..nn import MarlinLinear
from . import shard as sh
from .layers import local_marlin, marlin_row_shard

__all__ = ["GPTQSource"]

class GPTQSource:
    """The GPTQ layers of a checkpoint: their shapes for the meta model, and per-rank conversion."""

    def __init__(self, reader, cfg: GPTQConfig):
        self.reader, self.cfg = reader, cfg
        ckpt = reader.ckpt
        prefixes = sorted({name[: -len(".qweight")] for name in ckpt.tensors if name.endswith(".qweight")})
        if not prefixes:
            raise ConversionError(f"{ckpt.directory}: no quantized layers (no '*.qweight' tensors)")
        self.specs: dict = {}
        self.perms: dict = {}
        for prefix in prefixes:
            infos = {s: ckpt.tensors[f"{prefix}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx", "bias")
                     if f"{prefix}.{s}" in ckpt.tensors}
            k, n = check_layer_tensors(
                prefix, {s: i.shape for s, i in infos.items()}, {s: i.dtype for s, i in infos.items()}, cfg.group_size,
                cfg.bits,
            )
            perm = None
            if "g_idx" in infos:  # K ints: small, and needed to know whether the layer is act-order
                g_idx = reader.get(f"{prefix}.g_idx").cpu()
                perm = act_order_permutation(prefix, g_idx, packing.num_groups(k, cfg.group_size))
            self.perms[prefix] = perm
            # the MarlinLinear format the layer converts to (gptq_to_marlin with sym = cfg.sym)
            self.specs[prefix] = dict(
                k=k, n=n, group_size=cfg.group_size, bias="bias" in infos, act_order=perm is not None, bits=cfg.bits,
                zero_points=not cfg.sym, dtype=infos["scales"].dtype,
            )

    def names(self, prefix: str) -> list:
        return [f"{prefix}.{s}" for s in ("qweight", "qzeros", "scales", "g_idx", "bias") if self.reader.has(f"{prefix}.{s}")]

    def _convert(self, prefix: str, rows: Optional[slice] = None, cols: Optional[slice] = None):
        """gptq_to_marlin on a slice: ``rows`` of K (multiples of the group size) or ``cols`` of N."""
        r, gs = self.reader, self.cfg.group_size
        per_word = 32 // self.cfg.bits  # values per int32 of qweight (along K) and qzeros (along N)
        qrows = slice(None) if rows is None else slice(rows.start // per_word, rows.stop // per_word)
        grows = slice(None) if rows is None or gs == -1 else slice(rows.start // gs, rows.stop // gs)
        qcols = slice(None) if cols is None else cols
        zcols = slice(None) if cols is None else slice(cols.start // per_word, cols.stop // per_word)
        qweight = r.get(f"{prefix}.qweight", (qrows, qcols)).cpu()
        qzeros = r.get(f"{prefix}.qzeros", (grows, zcols)).cpu()
        scales = r.get(f"{prefix}.scales", (grows, qcols)).cpu()
        # Row slices are only taken without act-order, where g_idx is the default k // group_size.
        g_idx = r.get(f"{prefix}.g_idx").cpu() if rows is None and r.has(f"{prefix}.g_idx") else None
        return gptq_to_marlin(prefix, qweight, qzeros, scales, g_idx, group_size=gs,
                              checkpoint_format=self.cfg.checkpoint_format, bits=self.cfg.bits, sym=self.cfg.sym)

    @staticmethod
    def _buffers(mt, device) -> dict:
        """b_q, b_scales, and b_zeros and perm where the layer has them, on ``device``."""
        out = {"b_q": mt.b_q.to(device), "b_scales": mt.b_scales.to(device)}
        for name in ("b_zeros", "perm"):
            if getattr(mt, name) is not None:
                out[name] = getattr(mt, name).to(device)
        return out

    def whole(self, prefix: str, device) -> dict:
        """The full layer's MarlinLinear buffers."""
        out = self._buffers(self._convert(prefix), device)
        if self.reader.has(f"{prefix}.bias"):
            out["bias"] = self.reader.get(f"{prefix}.bias")
        return out

    def column(self, module: MarlinLinear, prefix: str, rank: int, world_size: int, device) -> MarlinLinear:
        spec = self.specs[prefix]
        k, n, gs = spec["k"], spec["n"], spec["group_size"]
        plan = sh.plan_column(prefix, k, n, packing.num_groups(k, gs), rank, world_size, spec["bits"])
        tensors = self._buffers(self._convert(prefix, cols=slice(plan.n0, plan.n1)), device)
        if self.reader.has(f"{prefix}.bias"):
            tensors["bias"] = self.reader.get(f"{prefix}.bias", (slice(plan.n0, plan.n1),))
        return local_marlin(module, k, plan.out_features, tensors)

    def row(self, module: MarlinLinear, prefix: str, rank: int, world_size: int, device) -> tuple:
        """(local layer, gather index or None, full bias or None)."""
        spec = self.specs[prefix]
        k, n, gs = spec["k"], spec["n"], spec["group_size"]
        perm = self.perms[prefix]
        bias = self.reader.get(f"{prefix}.bias") if self.reader.has(f"{prefix}.bias") else None
        if perm is not None:  # stored rows of whole groups are scattered over the file: convert whole
            full = self.whole(prefix, device)
            local, gather_index = marlin_row_shard(
                module, prefix, lambda b, index: full[b][index], lambda b: b in full, perm, rank, world_size
            )
            return local, gather_index, bias
        plan = sh.plan_row(prefix, k, n, packing.num_groups(k, gs), None, rank, world_size, spec["bits"])
        local = local_marlin(module, plan.in_features, n, self._buffers(self._convert(prefix, rows=slice(plan.k0, plan.k1)), device))
        if sh.single_group(plan, gs):
            local.group_size = -1  # gptq_to_marlin packed the one scale row as per-column (natural order)
        return local, None, bias
