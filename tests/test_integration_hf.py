"""transformers' from_pretrained on Marlin checkpoints (marlin.integrations), on the CPU op.

The checkpoints are a tiny random Llama quantized by tests/gptq_writer.py (independent of marlin)
and converted by marlin-convert; the reference is the same Llama in fp32 with the dequantized GPTQ
weights (MODEL_TOL as in tests/test_convert.py). Loading through from_pretrained must give exactly
the model load_quantized gives (same buffers, so bit-identical logits and the same tokens).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import marlin  # noqa: E402
from marlin.convert import ConversionError, convert_gptq_checkpoint  # noqa: E402
from marlin.integrations import hf_quantizer  # noqa: E402
from marlin.nn import MarlinLinear  # noqa: E402

from conftest import rel_err  # noqa: E402
from test_convert import MODEL_TOL, edit_json, llama_gptq_checkpoint, rewrite_tensor  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
AutoModelForCausalLM = transformers.AutoModelForCausalLM


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(gptq dir, marlin dir, fp32 reference model) for an act-order group-128 tiny Llama."""
    tmp = tmp_path_factory.mktemp("hf")
    src, ref = llama_gptq_checkpoint(tmp, act_order=True, group_size=128)
    dst = tmp / "marlin"
    convert_gptq_checkpoint(src, dst, quiet=True)
    return src, dst, ref


def ids(batch=2, seq=9, seed=0):
    return torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(seed))


def marlin_layers(model) -> dict:
    return {n: m for n, m in model.named_modules() if isinstance(m, MarlinLinear)}


def test_converted_config_names_marlin(checkpoints):
    _, dst, _ = checkpoints
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "marlin" and qc["checkpoint_format"] == "marlin"


def test_config_round_trip():
    from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig

    d = {"quant_method": "marlin", "bits": 4, "group_size": -1, "sym": True, "desc_act": False,
         "checkpoint_format": "marlin", "damp_percent": 0.05}
    cfg = AutoQuantizationConfig.from_dict(dict(d))
    assert isinstance(cfg, hf_quantizer.MarlinConfig)
    assert cfg.to_dict() == d  # extra keys kept, nothing added
    assert isinstance(AutoHfQuantizer.from_config(cfg, pre_quantized=True), hf_quantizer.MarlinHfQuantizer)
    with pytest.raises(ValueError, match="checkpoint_format = 'awq', expected one of"):
        hf_quantizer.MarlinConfig(checkpoint_format="awq")


def test_from_pretrained_matches_reference_and_load_quantized(checkpoints):
    _, dst, ref = checkpoints
    model = AutoModelForCausalLM.from_pretrained(dst)
    layers = marlin_layers(model)
    assert len(layers) == 14 and all(m.perm is not None for m in layers.values())
    assert model.dtype == torch.float16 and not model.training
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    for m in layers.values():  # a fresh zeroed lock buffer, not uninitialized memory
        assert m.workspace.device == m.b_q.device and not m.workspace.any()
    x = ids()
    loaded = marlin.load_quantized(dst, device="cpu")
    with torch.no_grad():
        logits = model(x).logits
        assert rel_err(logits, ref(x).logits) < MODEL_TOL
        assert torch.equal(logits, loaded(x).logits)
    out = model.generate(x[:1], max_new_tokens=5, do_sample=False)
    assert torch.equal(out, loaded.generate(x[:1], max_new_tokens=5, do_sample=False))
    assert model.generation_config.max_new_tokens == 3  # generation_config.json was read


def test_from_pretrained_device_map_and_dtype(checkpoints):
    _, dst, _ = checkpoints
    model = AutoModelForCausalLM.from_pretrained(dst, device_map="cpu", dtype=torch.float16)
    assert all(b.device.type == "cpu" for b in model.buffers())
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)  # fp32 asked: the layers need fp16
    assert model.dtype == torch.float16
    with pytest.raises(ValueError, match="dtype = torch.float64, but MarlinLinear does not compute in it"):
        AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float64)


def test_gptq_checkpoint_repacked_at_load_time(checkpoints, tmp_path):
    src, dst, _ = checkpoints
    converted = AutoModelForCausalLM.from_pretrained(dst)
    model = AutoModelForCausalLM.from_pretrained(src, config=hf_quantizer.gptq_config(src))
    got, want = marlin_layers(model), marlin_layers(converted)
    assert got.keys() == want.keys()
    for name in got:  # the same exact buffers as marlin-convert writes
        for buf in ("b_q", "b_scales", "perm"):
            assert torch.equal(getattr(got[name], buf), getattr(want[name], buf)), (name, buf)
    x = ids(seed=1)
    with torch.no_grad():
        assert torch.equal(model(x).logits, converted(x).logits)
    # save_pretrained writes a Marlin checkpoint, which loads back as such
    model.save_pretrained(tmp_path / "resaved")
    qc = json.loads((tmp_path / "resaved" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "marlin" and qc["checkpoint_format"] == "marlin"
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved")
    with torch.no_grad():
        assert torch.equal(again(x).logits, converted(x).logits)


def test_gptq_config_refuses_unsupported(checkpoints, tmp_path):
    src, dst, _ = checkpoints
    with pytest.raises(ConversionError, match="already converted"):
        hf_quantizer.gptq_config(dst)
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    edit_json(bad / "config.json", lambda c: c["quantization_config"].update(bits=3))
    with pytest.raises(ConversionError, match="bits = 3 is not supported"):
        hf_quantizer.gptq_config(bad)
    # an AWQ checkpoint: told to convert, not told that 'awq' was expected
    edit_json(bad / "config.json", lambda c: c["quantization_config"].update(bits=4, quant_method="awq", zero_point=True,
                                                                          version="gemm"))
    with pytest.raises(ConversionError, match="quant_method = 'awq': not a GPTQ checkpoint.*convert it with marlin-convert"):
        hf_quantizer.gptq_config(bad)


def test_bad_checkpoints_are_refused(checkpoints, tmp_path):
    import shutil

    _, dst, _ = checkpoints
    bad = tmp_path / "perm"
    shutil.copytree(dst, bad)
    name = "model.layers.0.self_attn.q_proj.perm"
    rewrite_tensor(bad, name, lambda t: torch.zeros_like(t))  # right shape and dtype, not a permutation
    with pytest.raises(ConversionError, match=f"{name}: not a permutation"):
        AutoModelForCausalLM.from_pretrained(bad)
    bad = tmp_path / "scales"
    shutil.copytree(dst, bad)
    name = "model.layers.1.mlp.up_proj.b_scales"
    rewrite_tensor(bad, name, lambda t: t[:, :128].contiguous())
    with pytest.raises(ConversionError, match="b_scales"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_float_model_with_marlin_config_is_refused(tmp_path):
    from conftest import tiny_llama_config

    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path / "float")
    with pytest.raises(ValueError, match="pre-quantized"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=hf_quantizer.MarlinConfig())


def _python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_is_cheap_and_registration_lazy():
    # import marlin does not import transformers; importing transformers' quantizers (as
    # from_pretrained does) registers marlin; either import order works.
    out = _python(
        "import sys, marlin\n"
        "print('transformers' in sys.modules)\n"
        "import transformers\n"
        "print('transformers.quantizers' in sys.modules)\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as M\n"
        "print(M['marlin'].__name__)\n"
    )
    assert out.split() == ["False", "False", "MarlinHfQuantizer"]
    out = _python(
        "import transformers.modeling_utils, marlin\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as M\n"
        "print(M['marlin'].__name__)\n"
    )
    assert out.split() == ["MarlinHfQuantizer"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_from_pretrained_on_cuda(checkpoints):
    _, dst, ref = checkpoints
    model = AutoModelForCausalLM.from_pretrained(dst, device_map="cuda")
    assert all(b.is_cuda for b in model.buffers())
    for m in marlin_layers(model).values():
        assert m.workspace.is_cuda and not m.workspace.any()
    x = ids()
    with torch.no_grad():
        assert rel_err(model(x.cuda()).logits.cpu(), ref(x).logits) < MODEL_TOL
    out = model.generate(x[:1].cuda(), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 13)
