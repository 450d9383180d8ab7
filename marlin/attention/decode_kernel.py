"""Triton kernels of marlin.attention's single-query (decode) attention; imported only where Triton is.

One program per (sequence, key/value head, split of the key positions). It first scans its split
of the mask for the first and last visible position, then streams only the keys and values
between them, in blocks of ``BLOCK_N`` positions, with an online softmax in float32. A static KV
cache is allocated for the longest sequence, and a decode step's mask hides everything past each
sequence's length: SDPA reads (and cuDNN's kernel computes on) the whole cache, this reads only
the visible range. The query heads that share one key/value head (grouped-query attention) are
one program's rows, so each key and value is read once per step; q.k and p.v are tensor-core dots
with the rows padded to 16, also for one query head per key/value head (a float32 dot product per
position there streamed at half SDPA's speed on an H200: benchmarks/NOTES.md).

Where the splits are more than one, each program leaves its unnormalised sums, running maximum
and denominator in float32 scratch and a second kernel combines them; with one split the first
kernel writes the output itself.

Masks: none, boolean (True = visible) or additive (any float dtype). For the range scan an
additive value at or below ``masked_below`` (half the mask dtype's most negative finite number:
transformers writes masked positions as that number, or -inf) is masked; inside the range every
value is added exactly as SDPA adds it. A position outside the range has a weight of
exp(-huge) = 0 in float32 in SDPA too, unless the scores differ by more than ~|masked_below| / 2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode_op import MIN_SPLIT_LEN, masked_below, split_count, triton_pow2

LOG2E = 1.4426950408889634
# (the kernels' names say "attention" and not "marlin": benchmarks/kernel_profile.py files them as
# attention, not as GEMMs)


@triton.jit
def _visible_range(Mask, m_row, sm_n, start, end, masked_below, MASK_KIND: tl.constexpr, SCAN: tl.constexpr):
    """First visible position and one past the last in [start, end) (lo >= hi: none)."""
    lo = end
    hi = start
    if MASK_KIND == 0:
        lo = start
        hi = end
    else:
        for c in range(start, end, SCAN):
            offs = c + tl.arange(0, SCAN)
            inr = offs < end
            if MASK_KIND == 1:
                vis = (tl.load(Mask + m_row + offs * sm_n, mask=inr, other=0) != 0) & inr
            else:
                vis = (tl.load(Mask + m_row + offs * sm_n, mask=inr, other=0.0).to(tl.float32) > masked_below) & inr
            lo = tl.minimum(lo, tl.min(tl.where(vis, offs, end), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(vis, offs + 1, start), axis=0))
    return lo, hi


@triton.jit
def decode_attention_kernel(
    Q, K, V, Mask, Out, PartAcc, PartML,
    sq_b, sq_h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sm_b, sm_n, so_b, so_h,
    n_kv, split_len, scale_log2, masked_below,
    H_KV: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr, MASK_KIND: tl.constexpr,
    SPLIT: tl.constexpr, FP32: tl.constexpr, STAGES: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = bh // H_KV
    hk = bh % H_KV
    start = split * split_len
    end = tl.minimum(start + split_len, n_kv)
    m_row = b.to(tl.int64) * sm_b
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = hk * GROUP + g
    # q's load is issued before the mask scan waits for its own
    q = tl.load(Q + b.to(tl.int64) * sq_b + heads[:, None] * sq_h + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                other=0.0)
    lo, hi = _visible_range(Mask, m_row, sm_n, start, end, masked_below, MASK_KIND, SCAN)
    k_base = K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h
    v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        offs = n0 + tl.arange(0, BLOCK_N)
        inr = offs < hi
        kv_mask = inr[:, None] & d_ok[None, :]
        # keys, values and the mask of the block are all requested before any of them is used
        k = tl.load(k_base + offs[:, None].to(tl.int64) * sk_n + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs[:, None].to(tl.int64) * sv_n + d[None, :], mask=kv_mask, other=0.0)
        if MASK_KIND == 1:
            keep = (tl.load(Mask + m_row + offs * sm_n, mask=inr, other=0) != 0) & inr
        elif MASK_KIND == 2:
            bias = tl.load(Mask + m_row + offs * sm_n, mask=inr, other=0.0).to(tl.float32) * 1.4426950408889634
        if FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        if MASK_KIND == 1:
            s = tl.where(keep[None, :], s, float("-inf"))
        elif MASK_KIND == 2:
            s = tl.where(inr[None, :], s + bias[None, :], float("-inf"))
        else:
            s = tl.where(inr[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SPLIT:
        row = (b * (H_KV * GROUP) + heads).to(tl.int64) * n_splits + split
        tl.store(PartAcc + row[:, None] * BLOCK_D + d[None, :], acc, mask=g_ok[:, None])
        tl.store(PartML + row * 2, m_i, mask=g_ok)
        tl.store(PartML + row * 2 + 1, l_i, mask=g_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # nothing visible: zeros
        tl.store(Out + b.to(tl.int64) * so_b + heads[:, None] * so_h + d[None, :], out.to(Out.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def decode_attention_combine_kernel(
    PartAcc, PartML, Out, so_b, so_h, n_splits,
    H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < n_splits
    row = bh.to(tl.int64) * n_splits + s
    m = tl.load(PartML + row * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(PartML + row * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(s_ok, tl.exp2(m - m_use), 0.0)
    den = tl.sum(w * l, axis=0)
    acc = tl.load(PartAcc + row[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], axis=0)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(Out + b.to(tl.int64) * so_b + h * so_h + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


# the launch's tuning: key positions per block, warps per program, software-pipeline stages of the
# block loop (benchmarks/bench_attention.py --tunings compares others)
TUNING = {"block_n": 64, "warps": 4, "stages": 2, "min_split": MIN_SPLIT_LEN}


def launch(q, k, v, mask, scale: float, sms: int):
    """Runs the kernels on checked arguments (decode_op's shapes); returns the [B, H, D] output.
    ``sms``: the device's multiprocessor count (split_count). Works on CPU tensors under
    TRITON_INTERPRET=1 (the CPU tests)."""
    import torch

    b, h, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    if b == 0 or h == 0:
        return out
    # the kernels read head dims with unit stride (every cache transformers builds has it); other
    # views are copied
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    group = h // hkv
    block_g = max(16, triton_pow2(group))  # an MMA's rows; one query head pads to 16 too (MMA loads stream faster)
    block_d = triton_pow2(d)
    block_n = TUNING["block_n"]
    splits = split_count(b, hkv, n, sms, TUNING["min_split"])
    split_len = -(-n // splits)
    split_len = -(-split_len // block_n) * block_n  # whole blocks per program
    splits = -(-n // split_len) if n else 1
    if mask is None:
        kind, m_arg, sm_b, sm_n, below = 0, q, 0, 0, 0.0
    else:
        kind = 1 if mask.dtype == torch.bool else 2
        m_arg = mask.view(torch.uint8) if kind == 1 else mask
        sm_b = mask.stride(0) if mask.shape[0] > 1 else 0
        sm_n, below = mask.stride(1), (masked_below(mask.dtype) if kind == 2 else 0.0)
    if splits > 1:
        part_acc = torch.empty((b * h * splits, block_d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((b * h * splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    decode_attention_kernel[(b * hkv, splits)](
        q, k, v, m_arg, out, part_acc, part_ml,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        sm_b, sm_n, out.stride(0), out.stride(1),
        n, max(split_len, 1), scale * LOG2E, below,
        H_KV=hkv, GROUP=group, BLOCK_G=block_g, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=block_n, SCAN=256,
        MASK_KIND=kind, SPLIT=splits > 1, FP32=q.dtype == torch.float32, STAGES=TUNING["stages"],
        num_warps=TUNING["warps"],
    )
    if splits > 1:
        decode_attention_combine_kernel[(b * h,)](part_acc, part_ml, out, out.stride(0), out.stride(1), splits,
                                        H=h, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=triton_pow2(splits), num_warps=4)
    return out
