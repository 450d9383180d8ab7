"""A minimal Llama decoder for tensor-parallel decode benchmarks: one rank's shard, random weights.

Only what a decode step needs, written so that one whole step (embedding, every layer, norm,
lm_head, greedy next token, position + 1) can be captured as one CUDA graph together with its NCCL
collectives: a static KV cache, the position held in a device tensor, no host synchronisation.

Each rank builds only its own shards (no full model is ever materialised), with the wrappers of
marlin.parallel around the local layers, the same code path as a sharded real model:
  * q/k/v and gate/up: ColumnParallelLinear (num_heads / T, num_kv_heads / T and
    intermediate / T per rank), o/down: RowParallelLinear (one all-reduce each);
  * lm_head: ColumnParallelLinear over the vocabulary, output gathered (FP16 on both sides, as in
    the paper's vLLM runs where lm_head stays in 16 bits); embeddings replicated.
Linear layers are FP16 nn.Linear ("fp16"), MarlinLinear with random packed INT4 weights and
group-128 scales ("marlin") or 2:4-sparse MarlinLinear24 ("marlin_24", random values, every group
of 4 keeping its first two); the rest (norms, attention, cache) is identical on both sides.

As a serving engine runs a decoder, q/k/v are one column-parallel layer per rank and gate/up
another (each rank's q, k and v shards side by side), and the element-wise work between the
GEMMs (residual add + RMSNorm, rotary, SiLU-mul) runs as torch.compile'd functions
(``compile=True``), so that a layer is a dozen or so kernels instead of several times as many
small eager ones (counted from the code, not profiled); attention (SDPA, or marlin's decode kernel,
over the static cache), the cache writes and the collectives stay eager.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from marlin.nn import MarlinLinear
from marlin.parallel import ColumnParallelLinear, RowParallelLinear
from marlin.sparse_nn import MarlinLinear24


@dataclass(frozen=True)
class LlamaShape:
    hidden: int = 8192
    intermediate: int = 28672
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 32000
    layers: int = 80
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0


LLAMA2_70B = LlamaShape()


def random_linear(kind: str, k: int, n: int, device, gen: torch.Generator) -> nn.Module:
    """A [k -> n] layer with random weights whose outputs keep a sane scale (~ unit variance in)."""
    if kind == "fp16":
        layer = nn.Linear(k, n, bias=False, device="meta", dtype=torch.float16)
        w = torch.randn(n, k, device=device, dtype=torch.float16, generator=gen) * (k**-0.5)
        layer.weight = nn.Parameter(w, requires_grad=False)
        return layer
    if kind == "marlin":
        layer = MarlinLinear(k, n, bias=False, group_size=128, device=device)
        layer.b_q.copy_(torch.randint(-(2**31), 2**31, layer.b_q.shape, device=device, dtype=torch.int64, generator=gen))
        # uniform nibbles in [-8, 7] have std ~4.6: scale so that outputs are ~ unit variance
        layer.b_scales.fill_(1.0 / (4.6 * k**0.5))
        return layer
    if kind == "marlin_24":
        layer = MarlinLinear24(k, n, bias=False, group_size=128, device=device)
        layer.b_q.copy_(torch.randint(-(2**31), 2**31, layer.b_q.shape, device=device, dtype=torch.int64, generator=gen))
        # b_meta keeps the empty layer's valid indices (the first two of every 4); k / 2 non-zeros
        layer.b_scales.fill_(1.0 / (4.6 * (k / 2) ** 0.5))
        return layer
    raise ValueError(f"kind = {kind!r}, expected 'fp16', 'marlin' or 'marlin_24'")


class RMSNorm(nn.Module):
    """A norm's weight and epsilon; the layers apply them with their ``Ops`` (rms_norm, add_rms_norm)."""

    def __init__(self, dim: int, eps: float, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=torch.float16), requires_grad=False)
        self.eps = eps


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).half() * w


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float) -> tuple:
    """(x + delta, its RMSNorm): the residual add of one block fused with the next block's norm."""
    s = x + delta
    return s, rms_norm(s, w, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rotate_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    return rotate(q, cos, sin), rotate(k, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a fused gate/up output [.., 2 * I] (gate columns first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def sdpa_attention(q, cache_k, cache_v, mask, scale):
    """q [B, H, 1, D] over the cache [B, Hkv, L, D] under mask [1, 1, 1, L]: [B, H, 1, D]."""
    return F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask, enable_gqa=True, scale=scale)


def marlin_decode_attention(q, cache_k, cache_v, mask, scale):
    """The same on marlin's decode kernel (only the visible positions are read): [B, H, D]."""
    return torch.ops.marlin.decode_attention(q[:, :, 0], cache_k, cache_v, mask[:, 0, 0], scale)


ATTENTIONS = {"sdpa": sdpa_attention, "marlin_decode": marlin_decode_attention}


class Ops:
    """The element-wise functions a layer calls, compiled once per model (dynamic shapes: one
    compilation serves every batch above 1) or plain, and its attention ("sdpa" or
    "marlin_decode", eager either way)."""

    def __init__(self, compile: bool, attention: str = "sdpa"):
        wrap = (lambda f: torch.compile(f, dynamic=True)) if compile else (lambda f: f)
        self.rms_norm, self.add_rms_norm = wrap(rms_norm), wrap(add_rms_norm)
        self.rotate_pair, self.silu_mul = wrap(rotate_pair), wrap(silu_mul)
        self.compiled = compile
        self.attention = ATTENTIONS[attention]


class Layer(nn.Module):
    """One decoder layer's shard: local heads, local intermediate columns, two all-reduces."""

    def __init__(self, s: LlamaShape, kind: str, rank: int, world: int, device, gen, ops: Ops, group=None):
        super().__init__()
        self.heads, self.kv_heads, self.hd = s.heads // world, s.kv_heads // world, s.head_dim
        kw = dict(group=group, rank=rank, world_size=world)

        def col(k, n):
            return ColumnParallelLinear(random_linear(kind, k, n // world, device, gen), k, n, **kw)

        def row(k, n):
            return RowParallelLinear(random_linear(kind, k // world, n, device, gen), k, n, **kw)

        self.qkv = col(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim)
        self.o = row(s.heads * s.head_dim, s.hidden)
        self.gate_up = col(s.hidden, 2 * s.intermediate)
        self.down = row(s.intermediate, s.hidden)
        self.norm1, self.norm2 = RMSNorm(s.hidden, s.rms_eps, device), RMSNorm(s.hidden, s.rms_eps, device)
        self.ops = ops

    def forward(self, x, delta, cache_k, cache_v, pos, cos, sin, mask):
        """x: the residual stream before this layer's input is complete; delta: the previous layer's
        MLP output still to be added (None for the first layer). Returns (residual, MLP output)."""
        b, ops, eps = x.shape[0], self.ops, self.norm1.eps
        if delta is None:
            h = ops.rms_norm(x, self.norm1.weight, eps)
        else:
            x, h = ops.add_rms_norm(x, delta, self.norm1.weight, eps)
        q, k, v = self.qkv(h).split([self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], dim=-1)
        q, k = ops.rotate_pair(q.view(b, self.heads, 1, self.hd), k.view(b, self.kv_heads, 1, self.hd), cos, sin)
        cache_k.index_copy_(2, pos, k)  # static cache [B, kv, L, hd]; pos is a device tensor [1]
        cache_v.index_copy_(2, pos, v.view(b, self.kv_heads, 1, self.hd))
        att = ops.attention(q, cache_k, cache_v, mask, self.hd ** -0.5)
        x, h = ops.add_rms_norm(x, self.o(att.reshape(b, self.heads * self.hd)), self.norm2.weight, eps)
        return x, self.down(ops.silu_mul(self.gate_up(h)))


class DecodeModel(nn.Module):
    """One rank's shard of a Llama-shaped decoder with a static KV cache of ``max_len`` positions."""

    def __init__(self, s: LlamaShape, kind: str, max_len: int, rank: int, world: int, device, group=None,
                 compile: bool = False, attention: str = "sdpa"):
        super().__init__()
        if s.heads % world or s.kv_heads % world:
            raise ValueError(f"heads {s.heads} / kv heads {s.kv_heads} do not divide by world size {world}")
        gen = torch.Generator(device=device).manual_seed(1234)  # same replicated weights on every rank
        self.embed = nn.Parameter(
            torch.randn(s.vocab, s.hidden, device=device, dtype=torch.float16, generator=gen), requires_grad=False
        )
        gen.manual_seed(1000 + rank)  # each rank's own shards
        self.ops = Ops(compile, attention)
        self.layers = nn.ModuleList(Layer(s, kind, rank, world, device, gen, self.ops, group) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden, s.rms_eps, device)
        head = random_linear("fp16", s.hidden, s.vocab // world, device, gen)
        self.lm_head = ColumnParallelLinear(head, s.hidden, s.vocab, gather_output=True, group=group, rank=rank, world_size=world)
        self.shape, self.world, self.max_len, self.device = s, world, max_len, device
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, device=device).float() / s.head_dim))
        ang = torch.outer(torch.arange(max_len, device=device).float(), inv)
        self.cos = torch.cat((ang, ang), -1).cos().half()
        self.sin = torch.cat((ang, ang), -1).sin().half()
        self.positions = torch.arange(max_len, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.prepare(1)

    def prepare(self, batch: int) -> None:
        """A KV cache for ``batch`` sequences, filled with random values (as after a prompt)."""
        s = self.shape
        self.cache_k = self.cache_v = None  # free the previous batch's cache first
        shape = (s.layers, batch, s.kv_heads // self.world, self.max_len, s.head_dim)
        self.cache_k = torch.randn(shape, device=self.device, dtype=torch.float16) * 0.1
        self.cache_v = torch.randn(shape, device=self.device, dtype=torch.float16) * 0.1
        gen = torch.Generator(device=self.device).manual_seed(batch)  # the same tokens on every rank
        self.ids = torch.randint(0, s.vocab, (batch,), device=self.device, generator=gen)

    @torch.no_grad()
    def step(self) -> None:
        """One decode step for every sequence: reads self.ids and self.pos, writes the greedy next
        ids and advances pos (all on the device, so that it replays as a graph)."""
        x = self.embed[self.ids]
        cos, sin = self.cos[self.pos].view(1, 1, 1, -1), self.sin[self.pos].view(1, 1, 1, -1)
        mask = (self.positions <= self.pos).view(1, 1, 1, -1)
        delta = None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, delta, self.cache_k[i], self.cache_v[i], self.pos, cos, sin, mask)
        _, h = self.ops.add_rms_norm(x, delta, self.norm.weight, self.norm.eps)
        logits = self.lm_head(h)
        self.ids.copy_(logits.argmax(-1))
        self.pos.add_(1)
