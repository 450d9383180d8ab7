"""Incoherence processing: rotate a Llama-style model's residual stream by an orthogonal matrix,
folded into its weights, before quantizing (the idea of QuIP / QuaRot / SpinQuant).

Why: a few input channels of the residual stream carry outliers, and a per-column (or large
group) 4-bit scale must cover them for the whole column of K weights, so the other channels get
few levels. With x -> x Q (Q orthogonal) every channel becomes a mix of all of them: the outliers
are spread out, the weights that read the residual (q/k/v, gate/up, lm_head) have flatter rows,
and they quantize with less error. The full-precision model computes the same function:

  * each RMSNorm's weight g is folded into the layers reading its output (W -> W diag(g)) and set
    to 1; then RMSNorm(x Q) = RMSNorm(x) Q, because ||x Q|| = ||x||;
  * the embedding E -> E Q; readers W -> W Q (nn.Linear's [out, in]: the input dim); writers of
    the residual (o_proj, down_proj) W -> Q^T W and their bias b -> Q^T b (the output dim);
  * optionally (``heads``, off by default) each KV head's value vectors are rotated by their own
    orthogonal R_j (v_proj's rows of head j: R_j^T W; o_proj's columns of every query head that
    reads head j: W R_j), since attention mixes value vectors of tokens with scalar weights, which
    commutes with a right multiplication; this flattens o_proj's input too. It is off because
    GPTQ per column did better without it on SmolLM2-135M at both calibration seeds measured
    (benchmarks/NOTES.md, 2026-11-27 late night).

down_proj's input (after SiLU(gate) * up) cannot be rotated offline: with ``down_block`` r (64 by
default) it is rotated online instead. Block i's down_proj gets W -> W blockdiag(R_i, ..., R_i)
with R_i = random_hadamard(r, seed + 1000 + i), and an ``input_rotation`` buffer R_i with a
forward pre-hook that computes x blockdiag(R_i, ...) (x viewed as [..., K / r, r] times R_i), so
the float model still computes the same function; MarlinLinear keeps R_i (its input_rotation)
and applies it the same way, a small batched product per call (r = 64: 64 multiply-adds per
input, about a 1/N-th of the layer's own work). Per column on SmolLM2-135M it took GPTQ's
perplexity increase from +5.2% to +4.5% (benchmarks/NOTES.md, 2026-11-28).
Tied embeddings are untied: after the final norm is folded into lm_head, lm_head and the
embedding differ, so the model's config says ``tie_word_embeddings = False`` and lm_head gets
its own weight (the checkpoint then stores both, about vocab x hidden fp16 more).

Q is a randomized Hadamard-like matrix: for hidden = 2^k m, Q = diag(s) (O_m kron H_{2^k}),
with H the normalized Sylvester Hadamard matrix, O_m a random orthogonal matrix (QR of a Gaussian
matrix, signs fixed) and s random signs, all from a fixed seed. The Hadamard factor spreads
every channel evenly over 2^k channels (|entries| all equal, which bounds the largest
rotated weight best); the small random factor covers a dimension that is not a power of two
(SmolLM2: 576 = 9 x 64). Everything is computed in float64 and cast back to the model's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .._layer_common import rotate_blocks

__all__ = ["rotate_model", "random_hadamard", "rotate_input", "SUPPORTED_MODEL_TYPES", "ROTATION_SEED", "DOWN_BLOCK"]

# Llama-style decoders with plain RMSNorm (x / rms * g; Gemma's (1 + g) and LayerNorm's mean and
# bias are not handled) and q/k/v/o + gate/up/down projections.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ROTATION_SEED = 0
# down_proj's online rotation block: a power of two (a Hadamard factor with random signs), small
# enough that the product costs little beside the layer (SmolLM2: 1536 = 24 x 64)
DOWN_BLOCK = 64


def _hadamard(n: int) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix of order n (a power of two), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def _random_orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    """Haar-distributed orthogonal n x n matrix (QR of a Gaussian matrix, R's diagonal made positive)."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r)).unsqueeze(0)).contiguous()


def random_hadamard(n: int, seed: int = ROTATION_SEED) -> torch.Tensor:
    """The orthogonal n x n float64 matrix diag(s) (O_m kron H_{2^k}), n = 2^k m, m odd (see the module docstring)."""
    if n < 1:
        raise ValueError(f"random_hadamard: n = {n}, expected a positive dimension")
    gen = torch.Generator().manual_seed(seed)
    power = n & -n  # largest power of two dividing n
    odd = n // power
    q = _hadamard(power) if odd == 1 else torch.kron(_random_orthogonal(odd, gen), _hadamard(power))
    signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1
    return signs.unsqueeze(1) * q


def _decoder_parts(model: nn.Module):
    """(embedding, blocks, final norm, lm_head) of a supported model; ValueError naming what is not."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"rotate: model_type = {model_type!r} ({type(model).__name__}) is not supported; the rotation handles "
            f"Llama-style decoders with plain RMSNorm: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    base = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    parts = (getattr(base, "embed_tokens", None), getattr(base, "layers", None), getattr(base, "norm", None), head)
    if any(p is None for p in parts) or not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(
            f"rotate: {type(model).__name__} lacks model.embed_tokens, model.layers, model.norm or a bias-free "
            "nn.Linear lm_head, which the rotation expects of a Llama-style model"
        )
    for i, block in enumerate(parts[1]):
        attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or mlp is None or not all(isinstance(getattr(attn, n, None), nn.Linear) for n in names) or not all(
            isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")
        ):
            raise ValueError(f"rotate: block {i} of {type(model).__name__} is not a Llama-style block "
                             "(self_attn.q/k/v/o_proj and mlp.gate/up/down_proj as nn.Linear)")
        for norm in (getattr(block, "input_layernorm", None), getattr(block, "post_attention_layernorm", None)):
            if norm is None or getattr(norm, "bias", None) is not None or not isinstance(getattr(norm, "weight", None), torch.Tensor):
                raise ValueError(f"rotate: block {i} of {type(model).__name__} has no plain RMSNorm "
                                 "input_layernorm / post_attention_layernorm (a weight and no bias)")
    return parts


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data = value.to(dtype=param.dtype, device=param.device).contiguous()


def _fold_norm(norm: nn.Module, readers) -> None:
    """W -> W diag(g) for every reader of the norm's output, then g -> 1."""
    g = norm.weight.detach().to(torch.float64)
    for layer in readers:
        _set(layer.weight, layer.weight.detach().to(torch.float64) * g.to(layer.weight.device).unsqueeze(0))
    norm.weight.data.fill_(1.0)


def _read_rotated(layer: nn.Linear, q: torch.Tensor) -> None:
    _set(layer.weight, layer.weight.detach().to(torch.float64) @ q.to(layer.weight.device))


def rotate_input(module: nn.Module, args: tuple):
    """Forward pre-hook of a Linear with an ``input_rotation`` R [r, r]: its input x becomes
    x blockdiag(R, ..., R) (as MarlinLinear.forward computes it)."""
    x, *rest = args
    return (rotate_blocks(x, module.input_rotation), *rest)


def _rotate_input_online(layer: nn.Linear, r: torch.Tensor) -> None:
    """W -> W blockdiag(R, ...), and the layer's input is rotated by R (buffer + pre-hook), so that
    (x blockdiag(R)) (W blockdiag(R))^T = x W^T."""
    _set(layer.weight, rotate_blocks(layer.weight.detach().to(torch.float64), r.to(layer.weight.device)))
    layer.register_buffer("input_rotation", r.to(dtype=layer.weight.dtype, device=layer.weight.device))
    layer.register_forward_pre_hook(rotate_input)


def _write_rotated(layer: nn.Linear, q: torch.Tensor) -> None:
    q = q.to(layer.weight.device)
    _set(layer.weight, q.t() @ layer.weight.detach().to(torch.float64))
    if layer.bias is not None:
        _set(layer.bias, q.t() @ layer.bias.detach().to(torch.float64))


def _head_shape(attn: nn.Module, config) -> tuple:
    """(heads, KV heads, head dim) of an attention layer; ValueError where v_proj / o_proj do not fit them."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    v, o = attn.v_proj, attn.o_proj
    if v.out_features != kv_heads * head_dim or o.in_features != heads * head_dim or heads % kv_heads:
        raise ValueError(
            f"rotate: v_proj out {v.out_features} / o_proj in {o.in_features} do not match {kv_heads} KV heads and "
            f"{heads} heads of {head_dim}; the per-head rotation (heads=True) cannot be applied"
        )
    return heads, kv_heads, head_dim


def _rotate_heads(attn: nn.Module, config, seed: int) -> None:
    """Rotate each KV head's value vectors (v_proj's output) and undo it in o_proj's input."""
    heads, kv_heads, head_dim = _head_shape(attn, config)
    v, o = attn.v_proj, attn.o_proj
    wv = v.weight.detach().to(torch.float64).reshape(kv_heads, head_dim, -1)
    wo = o.weight.detach().to(torch.float64).reshape(o.out_features, heads, head_dim)
    bv = v.bias.detach().to(torch.float64).reshape(kv_heads, head_dim) if v.bias is not None else None
    group = heads // kv_heads  # query heads j * group ... (j + 1) * group - 1 read KV head j
    for j in range(kv_heads):
        r = random_hadamard(head_dim, seed + 1 + j).to(wv.device)
        wv[j] = r.t() @ wv[j]
        if bv is not None:
            bv[j] = r.t() @ bv[j]
        wo[:, j * group : (j + 1) * group] = wo[:, j * group : (j + 1) * group] @ r
    _set(v.weight, wv.reshape(v.weight.shape))
    _set(o.weight, wo.reshape(o.weight.shape))
    if bv is not None:
        _set(v.bias, bv.reshape(-1))


@torch.no_grad()
def rotate_model(
    model: nn.Module, *, heads: bool = False, down_block: Optional[int] = DOWN_BLOCK, seed: int = ROTATION_SEED
) -> None:
    """Fold the norms into their readers and rotate the residual stream (with ``heads``, each
    value head too; with ``down_block`` r, down_proj's input online in blocks of r, None: not) of
    a Llama-style causal LM, in place; its outputs stay the same up to rounding. Unties tied
    embeddings. ValueError for an architecture or shape it does not handle (before any change)."""
    embed, blocks, final_norm, head = _decoder_parts(model)
    q = random_hadamard(model.config.hidden_size, seed)
    if embed.weight.shape[1] != q.shape[0]:
        raise ValueError(f"rotate: embedding width {embed.weight.shape[1]} != hidden_size {q.shape[0]}")
    hidden = q.shape[0]
    if down_block is not None and (
        isinstance(down_block, bool) or not isinstance(down_block, int) or down_block <= 0 or down_block & (down_block - 1)
    ):
        raise ValueError(f"rotate: down_block = {down_block!r}, expected a power of two dividing down_proj's in_features, or None")
    for i, block in enumerate(blocks):  # every check before the first change
        attn, mlp = block.self_attn, block.mlp
        readers = {n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")} | {
            n: getattr(mlp, n) for n in ("gate_proj", "up_proj")}
        writers = {"o_proj": attn.o_proj, "down_proj": mlp.down_proj}
        bad = [f"{n}.in_features = {m.in_features}" for n, m in readers.items() if m.in_features != hidden] + [
            f"{n}.out_features = {m.out_features}" for n, m in writers.items() if m.out_features != hidden]
        if bad:
            raise ValueError(f"rotate: block {i}: {', '.join(bad)}, expected the residual width {hidden} (hidden_size)")
        if heads:
            _head_shape(attn, model.config)
        if down_block is not None and mlp.down_proj.in_features % down_block:
            raise ValueError(
                f"rotate: down_block = {down_block} does not divide block {i}'s down_proj.in_features = "
                f"{mlp.down_proj.in_features}"
            )
        if down_block is not None and hasattr(mlp.down_proj, "input_rotation"):
            raise ValueError(f"rotate: block {i}'s down_proj already has an input_rotation (rotated twice?)")
    if head.in_features != hidden:
        raise ValueError(f"rotate: lm_head.in_features = {head.in_features}, expected the residual width {hidden}")
    if head.weight is embed.weight or head.weight.data_ptr() == embed.weight.data_ptr():
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    for config in (model.config, getattr(model.config, "get_text_config", lambda: None)()):
        if config is not None and hasattr(config, "tie_word_embeddings"):
            config.tie_word_embeddings = False

    _set(embed.weight, embed.weight.detach().to(torch.float64) @ q.to(embed.weight.device))
    for i, block in enumerate(blocks):
        attn, mlp = block.self_attn, block.mlp
        _fold_norm(block.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj))
        _fold_norm(block.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))
        for layer in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _read_rotated(layer, q)
        for layer in (attn.o_proj, mlp.down_proj):
            _write_rotated(layer, q)
        if heads:
            _rotate_heads(attn, model.config, seed)
        if down_block is not None:
            _rotate_input_online(mlp.down_proj, random_hadamard(down_block, seed + 1000 + i))
    _fold_norm(final_norm, (head,))
    _read_rotated(head, q)
