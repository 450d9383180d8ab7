"""The one place where the benchmarked matrix shapes are written down.

A linear layer computes C[M, N] = A[M, K] @ B[K, N] with K = in_features and N = out_features;
M is the batch size (tokens in flight).  Every shape below is derived from a model's published
configuration (Hugging Face ``config.json`` field names in the comments) by these rules:

    qkv      K = hidden_size            N = (num_attention_heads + 2 * num_key_value_heads) * head_dim
    o        K = hidden_size            N = hidden_size
    gate_up  K = hidden_size            N = 2 * intermediate_size      (gated MLP: gate and up fused)
    up       K = hidden_size            N = intermediate_size          (plain MLP, Falcon)
    down     K = intermediate_size      N = hidden_size

with head_dim = hidden_size / num_attention_heads.  Fused qkv and gate_up matrices are what
inference engines (vLLM, TGI, gpt-fast) actually multiply, so they are what we time.

The benchmark's short names ("7B_qkv", "70B_down", ...) are aliases of the Llama-2 layers; the
"ideal" layer is sized from the GPU: K = 1024 * SMs, N = 256 * SMs (the paper's section 5
"ideal" matrix, large enough that every SM streams a long, even share of the weights).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ModelConfig",
    "MODELS",
    "model_layers",
    "MODEL_LAYERS",
    "BENCH_SHAPES",
    "shape_by_name",
    "ALIASES",
    "CANONICAL",
    "SMALL_SHAPES",
    "LARGE_SHAPES",
    "DEFAULT_SHAPES",
    "QUICK_SHAPES",
    "IDEAL",
    "ideal_shape",
    "ROOFLINE_SIZES",
    "roofline_shapes",
    "DEFAULT_MS",
    "QUICK_MS",
    "LAYERS_M",
]


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    gated_mlp: bool  # True: gate_proj + up_proj fused (Llama); False: one up projection (Falcon)
    source: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


MODELS: tuple[ModelConfig, ...] = (
    # meta-llama/Llama-2-7b-hf config.json: hidden_size 4096, intermediate_size 11008,
    # num_attention_heads 32, num_key_value_heads 32 (plain multi-head attention), head_dim 128.
    ModelConfig("Llama-2-7B", 4096, 11008, 32, 32, True, "meta-llama/Llama-2-7b-hf config.json"),
    # meta-llama/Llama-2-13b-hf: hidden_size 5120, intermediate_size 13824, 40 heads, 40 kv heads.
    ModelConfig("Llama-2-13B", 5120, 13824, 40, 40, True, "meta-llama/Llama-2-13b-hf config.json"),
    # meta-llama/Llama-2-70b-hf: hidden_size 8192, intermediate_size 28672, 64 heads, 8 kv heads (GQA).
    ModelConfig("Llama-2-70B", 8192, 28672, 64, 8, True, "meta-llama/Llama-2-70b-hf config.json"),
    # meta-llama/Meta-Llama-3-8B: hidden_size 4096, intermediate_size 14336, 32 heads, 8 kv heads.
    ModelConfig("Llama-3-8B", 4096, 14336, 32, 8, True, "meta-llama/Meta-Llama-3-8B config.json"),
    # meta-llama/Meta-Llama-3-70B: hidden_size 8192, intermediate_size 28672, 64 heads, 8 kv heads.
    ModelConfig("Llama-3-70B", 8192, 28672, 64, 8, True, "meta-llama/Meta-Llama-3-70B config.json"),
    # tiiuae/falcon-180B: hidden_size 14848, num_attention_heads 232, num_kv_heads 8
    # (new_decoder_architecture), head_dim 14848 / 232 = 64; the MLP is dense_h_to_4h /
    # dense_4h_to_h with ffn size 4 * hidden_size = 59392 and no gate.
    ModelConfig("Falcon-180B", 14848, 4 * 14848, 232, 8, False, "tiiuae/falcon-180B config.json"),
)


def model_layers(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """{layer name: (K, N)} of one transformer block of ``cfg``."""
    h, d = cfg.hidden_size, cfg.head_dim
    out = {
        "qkv": (h, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d),
        "o": (h, h),
    }
    if cfg.gated_mlp:
        out["gate_up"] = (h, 2 * cfg.intermediate_size)
    else:
        out["up"] = (h, cfg.intermediate_size)
    out["down"] = (cfg.intermediate_size, h)
    return out


# "Llama-3-8B/qkv" -> (K, N), in model order then layer order.
MODEL_LAYERS: dict[str, tuple[int, int]] = {
    f"{cfg.name}/{layer}": kn for cfg in MODELS for layer, kn in model_layers(cfg).items()
}

# The benchmark's short names, as aliases of the model layers above.
ALIASES: dict[str, str] = {
    "7B_qkv": "Llama-2-7B/qkv",
    "7B_o": "Llama-2-7B/o",
    "7B_gateup": "Llama-2-7B/gate_up",
    "7B_down": "Llama-2-7B/down",
    "70B_qkv": "Llama-2-70B/qkv",
    "70B_o": "Llama-2-70B/o",
    "70B_gateup": "Llama-2-70B/gate_up",
    "70B_down": "Llama-2-70B/down",
}
# and back: the model layer name -> the short name (so that a --layers run counts for the targets)
CANONICAL: dict[str, str] = {v: k for k, v in ALIASES.items()}

BENCH_SHAPES: dict[str, tuple[int, int]] = {short: MODEL_LAYERS[full] for short, full in ALIASES.items()}

IDEAL = "ideal"
SMALL_SHAPES = ("7B_qkv", "7B_o", "7B_gateup", "7B_down")
LARGE_SHAPES = ("70B_qkv", "70B_o", "70B_gateup", "70B_down", IDEAL)
DEFAULT_SHAPES = SMALL_SHAPES + LARGE_SHAPES
QUICK_SHAPES = ("7B_o", "70B_o", "70B_gateup", IDEAL)


def shape_by_name(name: str, env: str = "PROBE_SHAPES") -> tuple[int, int]:
    """(K, N) of a named shape of this module (BENCH_SHAPES, MODEL_LAYERS) or of "KxN" (the probes'
    PROBE_SHAPES entries); a clear exit naming `env` otherwise."""
    if name in BENCH_SHAPES:
        return BENCH_SHAPES[name]
    if name in MODEL_LAYERS:
        return MODEL_LAYERS[name]
    k, _, n = name.partition("x")
    if not (k.isdigit() and n.isdigit()):
        raise SystemExit(f"{env}: {name!r} is neither a shape of benchmarks/shapes.py nor K x N (e.g. 4096x4096)")
    return int(k), int(n)


def ideal_shape(sms: int) -> tuple[int, int]:
    """(K, N) of the SM-sized "ideal" layer: K = 1024 * SMs, N = 256 * SMs."""
    return 1024 * sms, 256 * sms


# Square-ish layers for the roofline plot: K = N = size.
ROOFLINE_SIZES = (4096, 8192, 16384, 32768)


def roofline_shapes() -> dict[str, tuple[int, int]]:
    return {f"sq{s}": (s, s) for s in ROOFLINE_SIZES}


DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
QUICK_MS = (1, 16, 64, 256)
LAYERS_M = 16
