"""Benchmark kernels: random weights in rotated copies, the call closures, and the correctness
check of every marlin kernel against an fp32 reference before it is timed."""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import hashlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from . import shapes as S
from .bench_math import (
    CHECK_MAX_ELEMS,
    CHECK_MS,
    CHECK_TOL,
    FORMAT_CHECK_TOL,
    FORMAT_KERNELS,
    INT4_GROUP,
    INT4_SANITY_TOL,
    MARLIN_24_DTYPE,
    MARLIN_24_GROUP,
    MARLIN_24_ZEROS,
    MARLIN_GROUP,
    VALUE_KERNELS,
    copies_needed,
    weight_bytes,
)
from .timing import _sync


# ---------------------------------------------------------------------------------------------
# Kernels: weights (random, rotated copies), call closures, correctness checks.
# ---------------------------------------------------------------------------------------------


class CorrectnessError(RuntimeError):
    """marlin produced a wrong result: the run must not write a results file."""


@dataclass
class Prepared:
    kernel: str
    copies: int
    bytes_per_copy: int
    make_fn: Callable[[torch.Tensor], Callable[[int], object]]
    checks: list = field(default_factory=list)
    tensors: list = field(default_factory=list)

    def free(self) -> None:
        self.tensors.clear()
        self.make_fn = None  # type: ignore[assignment]


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x64, r64 = x.double(), ref.double()
    if not torch.isfinite(x64).all():
        return float("inf")
    return ((x64 - r64).norm() / r64.norm().clamp_min(1e-30)).item()


def _ref_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a.float() @ w.float() without TF32."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return a.float() @ w.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _check_tiles(n: int, k: int, max_elems: int) -> list[int]:
    """64-column tiles to check: all if K * N <= max_elems, else first, last and evenly spaced."""
    tiles = n // 64
    budget = max(2, max_elems // (k * 64))
    if tiles <= budget:
        return list(range(tiles))
    return sorted({round(i * (tiles - 1) / (budget - 1)) for i in range(budget)})


def _dequant_tiles(b_q: torch.Tensor, b_scales: torch.Tensor, tiles: list[int], dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns of dequant(b_q, b_scales) for the given 64-column tiles, via packing.unpack (the spec),
    on the tensors' device: tile t is words 128 t .. 128 t + 127 of each row of b_q and columns
    64 t .. 64 t + 63 of b_scales (scales are permuted within a 64-column chunk only)."""
    from marlin import packing

    runs, start = [], None
    for i, t in enumerate(tiles):  # group consecutive tiles (at most 16 per unpack)
        if start is None:
            start = t
        nxt = tiles[i + 1] if i + 1 < len(tiles) else None
        if nxt != t + 1 or t + 1 - start >= 16:
            runs.append((start, t + 1))
            start = None
    ws, cols = [], []
    for t0, t1 in runs:
        q, s = packing.unpack(b_q[:, 128 * t0 : 128 * t1].contiguous(), b_scales[:, 64 * t0 : 64 * t1].contiguous())
        ws.append(packing.dequantize(q, s).to(dev))
        cols.append(torch.arange(64 * t0, 64 * t1))
    return torch.cat(ws, dim=1).to(dev), torch.cat(cols).to(dev)


def check_marlin(b_q, b_scales, k: int, n: int, dev, workspace, ms=CHECK_MS, max_elems=CHECK_MAX_ELEMS) -> list[dict]:
    """marlin.gemm vs fp32 a @ dequant on sampled columns; raises CorrectnessError above CHECK_TOL."""
    from marlin import ops as marlin_ops

    tiles = _check_tiles(n, k, max_elems)
    w, cols = _dequant_tiles(b_q, b_scales, tiles, dev)
    out = []
    for m in ms:
        a = torch.randn(m, k, dtype=torch.float16, device=dev)
        c = marlin_ops.gemm(a, b_q, b_scales, workspace)
        _sync(dev)
        ref = _ref_matmul(a, w)
        err = _rel_err(c[:, cols], ref)
        out.append({"M": m, "rel_err": err, "tol": CHECK_TOL, "columns": int(cols.numel()), "ok": err < CHECK_TOL})
        if not err < CHECK_TOL:
            raise CorrectnessError(
                f"marlin.gemm is WRONG: K={k} N={n} groups={b_scales.shape[0]} M={m}: normwise relative error "
                f"{err:.3g} vs fp32 reference on {cols.numel()} columns (tolerance {CHECK_TOL})"
            )
    return out


def _inner_k_tiles(k: int) -> int:
    for t in (8, 4, 2):
        if k % (16 * t) == 0:
            return t
    raise ValueError(f"K = {k} is not a multiple of 32: torch_int4 cannot take it")


def _random_like_clones(base: torch.Tensor, copies: int) -> list[torch.Tensor]:
    return [base] + [base.clone() for _ in range(copies - 1)]


def prepare(kernel: str, k: int, n: int, dev: torch.device, l2_bytes: int, min_copies: int = 1) -> Prepared:
    """Random weights for one kernel and shape, cloned so that copies * bytes >= 4 x L2.

    The contents are random words (never zeros), not quantized from a real matrix: the speed of
    these kernels should not depend on the values (marlin_g128_gauss, with the codes of a quantized
    Gaussian packed by packing.pack, is there to check it).  marlin's output is still checked
    against the spec (packing.unpack)."""
    nbytes = weight_bytes(kernel, k, n)
    copies = copies_needed(nbytes, l2_bytes, minimum=min_copies)

    if kernel == "fp16":
        # nn.Linear stores W [N, K]; F.linear computes a @ W.t(): the same call as torch.matmul(a, W.t())
        ws = _random_like_clones(torch.randn(n, k, dtype=torch.float16, device=dev), copies)

        def make_fn(a):
            return lambda i: torch.matmul(a, ws[i % copies].t())

        return Prepared(kernel, copies, nbytes, make_fn, tensors=ws)

    if kernel == "fp16_kn":
        # the same product with W stored [K, N] contiguous (a plain a @ W): at M = 1 cuBLAS is faster
        # in this layout on some shapes, so the baseline is the faster of the two
        ws = _random_like_clones(torch.randn(k, n, dtype=torch.float16, device=dev), copies)

        def make_fn(a):
            return lambda i: torch.matmul(a, ws[i % copies])

        return Prepared(kernel, copies, nbytes, make_fn, tensors=ws)

    if kernel in MARLIN_GROUP or kernel in VALUE_KERNELS:
        from marlin import ops as marlin_ops
        from marlin import packing

        group = MARLIN_GROUP.get(kernel) or VALUE_KERNELS[kernel]
        groups = 1 if group == -1 else k // group
        b_s = torch.empty(groups, n, dtype=torch.float16, device=dev).uniform_(0.001, 0.01)
        if kernel in VALUE_KERNELS:
            # a Gaussian weight quantized to 4 bits has codes of std ~2.7 levels around the middle
            # (max |w| of a group ~2.6 std = 7 levels); packed by the spec's own pack, on the device
            q = (torch.randn(k, n, device=dev, dtype=torch.float16) * 2.7).round_().clamp_(-8, 7).to(torch.int8)
            b_q, b_s = packing.pack(q, b_s)
            del q
        else:
            b_q = torch.randint(-(2**31), 2**31, (k // 16, 2 * n), dtype=torch.int32, device=dev)
        workspace = marlin_ops.make_workspace(dev) if dev.type == "cuda" else None
        checks = check_marlin(b_q, b_s, k, n, dev, workspace)
        bqs, bss = _random_like_clones(b_q, copies), _random_like_clones(b_s, copies)

        # marlin_direct: workspace=None, the op's own zeroed lock slot of the current stream
        call_ws = None if kernel == "marlin_direct" else workspace

        def make_fn(a):
            return lambda i: marlin_ops.gemm(a, bqs[i % copies], bss[i % copies], call_ws)

        return Prepared(kernel, copies, nbytes, make_fn, checks=checks, tensors=[bqs, bss, workspace])

    if kernel in MARLIN_24_GROUP:
        from marlin import ops as marlin_ops

        groups = 1 if MARLIN_24_GROUP[kernel] == -1 else k // MARLIN_24_GROUP[kernel]
        dtype = MARLIN_24_DTYPE.get(kernel, torch.float16)
        b_q = torch.randint(-(2**31), 2**31, (k // 32, 2 * n), dtype=torch.int32, device=dev)
        b_meta = random_meta_2_4(k, n, dev)
        b_s = torch.empty(groups, n, dtype=dtype, device=dev).uniform_(0.001, 0.01)
        b_z = torch.randint(0, 16, (groups, n), device=dev).to(dtype) if kernel in MARLIN_24_ZEROS else None
        checks = check_marlin_24(b_q, b_meta, b_s, k, n, dev, b_z=b_z, kernel=kernel)
        bqs, bms, bss = (_random_like_clones(t, copies) for t in (b_q, b_meta, b_s))
        bzs = _random_like_clones(b_z, copies) if b_z is not None else [None] * copies

        def make_fn(a):
            a_t = a.to(dtype)  # the activations in the kernel's dtype (converted once, outside the timing)
            return lambda i: marlin_ops.gemm_2_4(a_t, bqs[i % copies], bms[i % copies], bss[i % copies], None, bzs[i % copies])

        return Prepared(kernel, copies, nbytes, make_fn, checks=checks, tensors=[bqs, bms, bss, bzs])

    if kernel in FORMAT_KERNELS:
        return _prepare_format(kernel, k, n, dev, nbytes, copies)

    if kernel == "torch_int4":
        if dev.type != "cuda":
            raise RuntimeError("torch_int4 (aten._weight_int4pack_mm) runs on CUDA only")
        inner = _inner_k_tiles(k)
        sz = torch.empty(k // INT4_GROUP, n, 2, dtype=torch.bfloat16, device=dev)
        sz[..., 0].uniform_(0.001, 0.01)  # scale
        sz[..., 1].uniform_(-0.01, 0.01)  # zero: w = (q - 8) * scale + zero
        if n * (k // 2) < 2**31 - 1:
            u8 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)  # [N, K/2], even k high nibble
            packed = torch.ops.aten._convert_weight_to_int4pack(u8, inner)
            checks = [sanity_int4(u8, packed, sz, k, n, dev, inner)]
            del u8
        else:
            # _convert_weight_to_int4pack takes fewer than 2^31 elements: convert (and check) the first
            # columns only, and time on random words of the packed layout (speed does not depend on them)
            ns = min(n, 1024)
            u8 = torch.randint(0, 256, (ns, k // 2), dtype=torch.uint8, device=dev)
            small = torch.ops.aten._convert_weight_to_int4pack(u8, inner)
            check = sanity_int4(u8, small, sz[:, :ns].contiguous(), k, ns, dev, inner)
            check["note"] = f"first {ns} columns only (N*K/2 >= 2^31: timed on random packed words)"
            checks = [check]
            if small.dim() < 2 or small.shape[0] == 0 or ns % small.shape[0]:
                raise RuntimeError(f"unexpected int4pack layout {tuple(small.shape)} for N={ns}, K={k}")
            rows_per = ns // small.shape[0]  # N rows per leading index (8 for tinygemm's layout)
            if n % rows_per:
                raise RuntimeError(f"N = {n} is not a multiple of {rows_per}")
            shape = (n // rows_per,) + tuple(small.shape[1:])
            packed = torch.randint(-(2**31), 2**31, shape, dtype=small.dtype, device=dev)
            del u8, small
        pks, szs = _random_like_clones(packed, copies), _random_like_clones(sz, copies)

        def make_fn(a):
            a_bf = a.to(torch.bfloat16)
            return lambda i: torch.ops.aten._weight_int4pack_mm(a_bf, pks[i % copies], INT4_GROUP, szs[i % copies])

        return Prepared(kernel, copies, nbytes, make_fn, checks=checks, tensors=[pks, szs])

    raise ValueError(f"unknown kernel {kernel!r}")


def random_meta_2_4(k: int, n: int, dev) -> torch.Tensor:
    """Random valid 2:4 metadata int32 [K/32, N]: every nibble one of the six position pairs."""
    valid = torch.tensor([0b0100, 0b1000, 0b1100, 0b1001, 0b1101, 0b1110], dtype=torch.int64, device=dev)
    nib = valid[torch.randint(0, 6, (k // 32, n, 8), device=dev)]
    words = (nib << (4 * torch.arange(8, device=dev))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def check_marlin_24(b_q, b_meta, b_s, k: int, n: int, dev, ms=CHECK_MS, max_elems=CHECK_MAX_ELEMS, b_z=None,
                    kernel: str = "marlin.gemm_2_4") -> list[dict]:
    """marlin.gemm_2_4 (with the zero points b_z, if given) vs fp32 a @ dequant (marlin.sparse.unpack_2_4,
    the spec) on sampled 64-column tiles, activations in the scales' dtype; raises CorrectnessError
    above CHECK_TOL (fp16) or FORMAT_CHECK_TOL (bf16)."""
    from marlin import ops as marlin_ops
    from marlin import sparse

    def tile(x, t: int, width: int = 64):  # the words (or scale columns) of 64-column tile t
        return None if x is None else x[:, width * t: width * t + width].contiguous()

    tiles = _check_tiles(n, k, max_elems)
    w = torch.cat([sparse.unpack_2_4(tile(b_q, t, 128), tile(b_meta, t), tile(b_s, t), tile(b_z, t)) for t in tiles],
                  dim=1).to(dev)
    columns = torch.cat([torch.arange(64 * t, 64 * t + 64) for t in tiles]).to(dev)
    out = []
    tol = CHECK_TOL if b_s.dtype == torch.float16 else FORMAT_CHECK_TOL
    for m in ms:
        a = torch.randn(m, k, dtype=b_s.dtype, device=dev)
        c = marlin_ops.gemm_2_4(a, b_q, b_meta, b_s, None, b_z)
        _sync(dev)
        err = _rel_err(c[:, columns], _ref_matmul(a, w))
        out.append({"M": m, "rel_err": err, "tol": tol, "columns": int(columns.numel()), "ok": err < tol})
        if not err < tol:
            raise CorrectnessError(
                f"marlin.gemm_2_4 ({kernel}) is WRONG: K={k} N={n} groups={b_s.shape[0]} {b_s.dtype} "
                f"zero points={b_z is not None} M={m}: normwise relative error {err:.3g} vs fp32 reference on "
                f"{columns.numel()} columns (tolerance {tol})"
            )
    return out

def _prepare_format(kernel: str, k: int, n: int, dev, nbytes: int, copies: int) -> Prepared:
    """Random packed words, scales in [0.001, 0.01] and integer zero points 0..15 in one of the other
    formats (bench_math.FORMAT_KERNELS), checked on sampled tiles against packing.unpack (the spec)."""
    from marlin import ops as marlin_ops
    from marlin import packing

    dtype, bits, zeros, group = FORMAT_KERNELS[kernel]
    groups = 1 if group == -1 else k // group
    wpc = packing.words_per_column(bits)
    b_q = torch.randint(-(2**31), 2**31, (k // 16, wpc * n), dtype=torch.int32, device=dev)
    b_s = torch.empty(groups, n, dtype=dtype, device=dev).uniform_(0.001, 0.01)
    b_z = torch.randint(0, 16, (groups, n), device=dev).to(dtype) if zeros else None
    workspace = marlin_ops.make_workspace(dev) if dev.type == "cuda" else None

    def call(a, bq, bs, bz):
        return marlin_ops.gemm(a, bq, bs, workspace, b_zeros=bz, bits=bits)

    tiles = _check_tiles(n, k, CHECK_MAX_ELEMS // 8)  # unpacked one tile at a time: fewer of them
    ws, cols = [], []
    for t in tiles:  # one 64-column tile at a time: 64 * wpc words of each row of b_q
        part = packing.unpack(
            b_q[:, 64 * wpc * t : 64 * wpc * (t + 1)].contiguous(),
            b_s[:, 64 * t : 64 * (t + 1)].contiguous(),
            None if b_z is None else b_z[:, 64 * t : 64 * (t + 1)].contiguous(),
            bits=bits,
        )
        ws.append(packing.dequantize(*part).to(dev))
        cols.append(torch.arange(64 * t, 64 * (t + 1)))
    w, cols = torch.cat(ws, dim=1), torch.cat(cols).to(dev)
    checks = []
    for m in CHECK_MS:
        a = torch.randn(m, k, dtype=dtype, device=dev)
        c = call(a, b_q, b_s, b_z)
        _sync(dev)
        err = _rel_err(c[:, cols], _ref_matmul(a, w))
        checks.append({"M": m, "rel_err": err, "tol": FORMAT_CHECK_TOL, "columns": int(cols.numel()), "ok": err < FORMAT_CHECK_TOL})
        if not err < FORMAT_CHECK_TOL:
            raise CorrectnessError(
                f"marlin.gemm ({kernel}) is WRONG: K={k} N={n} M={m}: normwise relative error {err:.3g} vs fp32 "
                f"reference on {cols.numel()} columns (tolerance {FORMAT_CHECK_TOL})"
            )
    del w
    bqs, bss = _random_like_clones(b_q, copies), _random_like_clones(b_s, copies)
    bzs = _random_like_clones(b_z, copies) if b_z is not None else [None] * copies

    def make_fn(a):
        a_t = a.to(dtype)  # the activations in the format's dtype (converted once, outside the timing)
        return lambda i: call(a_t, bqs[i % copies], bss[i % copies], bzs[i % copies])

    return Prepared(kernel, copies, nbytes, make_fn, checks=checks, tensors=[bqs, bss, bzs, workspace])


def sanity_int4(u8, packed, sz, k: int, n: int, dev, inner: int, m: int = 16, max_cols: int = 256) -> dict:
    """torch_int4 vs bf16 matmul of its own dequantized weights on sampled columns (not fatal)."""
    cols = torch.linspace(0, n - 1, min(n, max_cols), device=dev).round().long().unique()
    u = u8[cols]  # [c, K/2]
    q = torch.stack([u >> 4, u & 15], dim=-1).reshape(len(cols), k).float()  # [c, K]
    s = sz[:, cols, 0].float().repeat_interleave(INT4_GROUP, dim=0)  # [K, c]
    z = sz[:, cols, 1].float().repeat_interleave(INT4_GROUP, dim=0)
    w = ((q.t() - 8) * s + z).to(torch.bfloat16)  # [K, c]
    a = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
    c = torch.ops.aten._weight_int4pack_mm(a, packed, INT4_GROUP, sz)
    err = _rel_err(c[:, cols], _ref_matmul(a, w))
    ok = err < INT4_SANITY_TOL
    return {"M": m, "rel_err": err, "tol": INT4_SANITY_TOL, "columns": int(len(cols)), "ok": ok, "inner_k_tiles": inner}
