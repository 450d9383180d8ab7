"""A tiny random Llama with a tokenizer, saved as a Hugging Face directory, for marlin-quantize tests.

Everything is made here (no download): a byte-level BPE tokenizer trained on a few paragraphs of
generated text, and a 2-block Llama whose Linear shapes the Marlin kernel takes.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

WORDS = (
    "the king queen lord lady speak hath doth thou thee night day love war crown sword castle field "
    "honour death life heaven earth fair foul sweet bitter friend enemy father mother son daughter"
).split()


def make_text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_words // 12):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ".")
    return "\n".join(lines) + "\n"


def make_tokenizer(text: str):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text], vocab_size=320, min_frequency=1, special_tokens=["<s>", "</s>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>")


def make_model_dir(path: Path, *, intermediate_size: int = 512, seed: int = 0) -> Path:
    """Save a tiny random LlamaForCausalLM (safetensors) and its tokenizer to ``path``."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    text = make_text(3000, seed=1)
    tokenizer = make_tokenizer(text)
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # outlier input channels, as real models have: GPTQ and clipping matter there
        for block in model.model.layers:
            block.input_layernorm.weight[:4] = 6.0
            block.post_attention_layernorm.weight[:4] = 6.0
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def make_tiny(root: Path) -> tuple[Path, Path, Path]:
    """(root, model dir, calibration text file) under ``root``: the tiny Llama and its text."""
    src = make_model_dir(root / "src")
    calib = root / "calib.txt"
    calib.write_text(make_text(4000, seed=2))
    return root, src, calib


def model_and_samples(src: Path, calib: Path, nsamples: int = 8, min_len: int = 16, max_len: int = 96):
    """(float model, tokenizer, calibration samples) as marlin-quantize would load and draw them."""
    from marlin.quantize.calib import CalibrationSpec, draw_samples
    from marlin.quantize.source import load_model, load_tokenizer, resolve_source

    source = resolve_source(src)
    model = load_model(source)
    tokenizer = load_tokenizer(source)
    ids = tokenizer(calib.read_text(), return_tensors="pt").input_ids[0]
    return model, tokenizer, draw_samples(ids, CalibrationSpec(nsamples=nsamples, min_len=min_len, max_len=max_len))


def marlin_layer_weight(layer) -> torch.Tensor:
    """nn.Linear-style weight [N, K] of a MarlinLinear (any format), in the original input order."""
    from marlin import packing

    b = packing.dequantize(*packing.unpack(layer.b_q, layer.b_scales, layer.b_zeros, bits=layer.bits))
    if layer.perm is not None:
        out = torch.empty_like(b)
        out[layer.perm.long()] = b
        b = out
    return b.t()


def output_errors(fake, loaded, full, x) -> tuple[float, float]:
    """(loaded vs fake-quantized, full precision vs fake-quantized) normwise relative logit errors
    on the token ids x: the first says the checkpoint computes what the quantizer computed, the
    second how far quantization moved the model (so the first check can tell the two apart)."""
    with torch.no_grad():
        ref = fake(x).logits.double()
        got = loaded(x).logits.double()
        fp = full(x).logits.double()
    return float((got - ref).norm() / ref.norm()), float((fp - ref).norm() / fp.norm())
