"""marlin.quantize.rotate: the residual-stream rotation folded into the weights (incoherence processing).

The rotated full-precision model must compute the original's logits (float64: up to the float32
that LlamaRMSNorm computes in, ~1e-7 relative), tied embeddings get untied, and a model the
rotation does not handle is refused before anything changes. End to end on the tiny random Llama:
a rotated, quantized, written checkpoint loads (marlin.load_quantized and transformers'
from_pretrained) with the rotated embedding, norms of ones and its own lm_head, and reproduces the
quantizer's own outputs. Whether the rotation helps is measured on the real model
(benchmarks/accuracy.py --rotate): the tiny model's random weights have no outlier columns to spread.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import marlin  # noqa: E402
from marlin.nn import MarlinLinear  # noqa: E402
from marlin.quantize import cli  # noqa: E402
from marlin.quantize.rotate import random_hadamard, rotate_model  # noqa: E402
from marlin.quantize.runner import QuantizeConfig, quantize_model  # noqa: E402
from marlin.quantize.writer import REPORT_FILE, write_checkpoint  # noqa: E402

from quantize_fixtures import make_tiny, marlin_layer_weight, model_and_samples, output_errors  # noqa: E402

MODEL_TOL = 1e-2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("rotate"))


def small_llama(tied: bool = True, bias: bool = False, kv_heads: int = 2) -> torch.nn.Module:
    """A float64 random Llama with non-trivial norms (and biases): folding them must matter."""
    config = transformers.LlamaConfig(
        hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=kv_heads,
        vocab_size=100, tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 3.0)
            elif name.endswith("bias"):
                p.normal_()
    return model


@pytest.mark.parametrize("n", [1, 9, 64, 96, 576])
def test_random_hadamard_is_orthogonal_and_seeded(n):
    q = random_hadamard(n)
    assert torch.allclose(q @ q.t(), torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, random_hadamard(n)) and (n == 1 or not torch.equal(q, random_hadamard(n, seed=1)))


@pytest.mark.parametrize("tied, bias, kv_heads, heads", [(True, False, 2, True), (False, True, 3, True), (True, True, 6, False)])
def test_rotated_model_computes_the_same_logits(tied, bias, kv_heads, heads):
    model = small_llama(tied, bias, kv_heads)
    rotated = copy.deepcopy(model)
    rotate_model(rotated, heads=heads)
    x = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, got = model(x).logits, rotated(x).logits
    assert float((got - ref).norm() / ref.norm()) < 1e-5
    # the weights did change (a no-op would pass the check above), and the model is untied
    assert not torch.allclose(rotated.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
    assert rotated.lm_head.weight.data_ptr() != rotated.model.embed_tokens.weight.data_ptr()
    assert rotated.config.tie_word_embeddings is False
    norms = [m.weight for n, m in rotated.named_modules() if n.endswith("norm")]
    assert len(norms) == 5 and all(torch.equal(w, torch.ones_like(w)) for w in norms)
    # down_proj's input is rotated online (default block 64): a buffer and its pre-hook
    for i, block in enumerate(rotated.model.layers):
        assert torch.equal(block.mlp.down_proj.input_rotation, random_hadamard(64, 1000 + i))


def test_down_rotation_is_what_moves_down_proj():
    """down_block=None leaves down_proj's input alone; with it, the hook is what keeps the function:
    without the hook the outputs move (the rotation is not a no-op)."""
    model = small_llama()
    plain, online = copy.deepcopy(model), copy.deepcopy(model)
    rotate_model(plain, down_block=None)
    rotate_model(online)
    assert not hasattr(plain.model.layers[0].mlp.down_proj, "input_rotation")
    x = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(x).logits
        assert float((online(x).logits - ref).norm() / ref.norm()) < 1e-5
        for block in online.model.layers:
            block.mlp.down_proj._forward_pre_hooks.clear()
        assert float((online(x).logits - ref).norm() / ref.norm()) > 1e-2
    for bad in (48, 0, 3, True):
        with pytest.raises(ValueError, match="down_block"):
            rotate_model(copy.deepcopy(model), down_block=bad)
    with pytest.raises(ValueError, match="already has an input_rotation"):
        rotate_model(online)


def test_kept_layer_is_written_with_its_rotation_folded_back():
    """A down_proj left in full precision is written as a plain Linear computing the same function
    (transformers' nn.Linear would ignore an input_rotation key)."""
    from marlin.quantize.writer import _state_tensors

    model = small_llama()
    plain, online = copy.deepcopy(model), copy.deepcopy(model)
    rotate_model(plain, down_block=None)
    rotate_model(online)
    tensors = _state_tensors(online, {})
    assert not any(k.endswith("input_rotation") for k in tensors)
    for i in range(2):
        key = f"model.layers.{i}.mlp.down_proj.weight"
        want = plain.get_parameter(key).detach().to(torch.float16)
        assert not torch.equal(online.get_parameter(key).detach().to(torch.float16), want)
        assert torch.allclose(tensors[key].float(), want.float(), atol=2e-3, rtol=0)


def test_unsupported_models_are_refused_unchanged():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="model_type = 'gpt2'.*not supported"):
        rotate_model(gpt2)
    model = small_llama()
    before = copy.deepcopy(model.state_dict())
    model.model.layers[1].self_attn.o_proj = torch.nn.Linear(95, 96)  # does not match the heads: refused up front
    with pytest.raises(ValueError, match="per-head rotation"):
        rotate_model(model, heads=True)
    model.model.layers[1].self_attn.o_proj = torch.nn.Linear(96, 95)  # writes a residual of the wrong width
    with pytest.raises(ValueError, match=r"block 1: o_proj.out_features = 95, expected the residual width 96"):
        rotate_model(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if k in before and "layers.1.self_attn.o_proj" not in k)


def test_rotated_checkpoint_loads_and_reproduces_the_quantizer(tiny, tmp_path):
    _, src, calib = tiny
    model, tokenizer, samples = model_and_samples(src, calib, nsamples=4, max_len=64)
    fp_model = copy.deepcopy(model)
    rotate_model(model)
    results, reports = quantize_model(model, samples, QuantizeConfig(group_size=-1, act_order=True, sym=False), progress=False)
    out = tmp_path / "rot"
    write_checkpoint(model, results, reports, out, settings={"group_size": -1, "act_order": True, "sym": False,
                                                             "rotate": True}, tokenizer=tokenizer)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["rotated"] is True

    for loaded in (marlin.load_quantized(out, device="cpu"), transformers.AutoModelForCausalLM.from_pretrained(out)):
        assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.1.input_layernorm.weight"):
            want = model.get_parameter(name).detach().to(torch.float16)
            assert torch.equal(loaded.get_parameter(name).detach().cpu().to(torch.float16), want), name
        for name, res in results.items():
            layer = loaded.get_submodule(name)
            assert isinstance(layer, MarlinLinear) and torch.equal(marlin_layer_weight(layer), res.dequantized())
            rot = model.get_submodule(name).get_buffer("input_rotation") if name.endswith("down_proj") else None
            if rot is None:
                assert layer.input_rotation is None, name
            else:
                assert torch.equal(layer.input_rotation.cpu(), rot.to(torch.float16)), name
        loaded = loaded.float() if loaded.dtype != torch.float16 else loaded
        err, moved = output_errors(model, loaded, fp_model, samples[0])
        assert err < MODEL_TOL, f"loaded rotated checkpoint vs the quantizer's model: {err:.2e}"
        assert moved > 3 * err


def test_cli_rotate_flag_records_it(tiny, tmp_path, capsys):
    _, src, calib = tiny
    out = tmp_path / "q"
    argv = [str(src), str(out), "--calib", str(calib), "--nsamples", "4", "--seqlen-range", "16:48", "--rotate"]
    assert cli.main(argv) == 0
    assert "14 layers quantized" in capsys.readouterr().out
    settings = json.loads((out / REPORT_FILE).read_text())["settings"]
    assert settings["rotate"] is True and settings["rotate_down_block"] == 64
    assert json.loads((out / "config.json").read_text())["quantization_config"]["rotated"] is True
    assert cli.build_parser().parse_args([str(src), str(out), "--calib", str(calib)]).rotate is False
