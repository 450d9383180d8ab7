"""from_pretrained follows the checkpoint's dtype, and a fused model's checkpoint loads back (CPU op).

A Marlin layer computes in its scales' dtype. A bf16 checkpoint whose config.json says float16
(or a caller who asks for float16) must still give a working bf16 model, the same one
load_quantized gives, not a float16 model around bf16 layers that fails on its first forward.
A model fused with marlin.fuse_projections and saved with save_pretrained holds qkv_proj /
gate_up_proj tensors; from_pretrained and load_quantized must rebuild the fused model from them.
"""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import marlin  # noqa: E402
from marlin.convert import ConversionError, convert_gptq_checkpoint  # noqa: E402
from marlin.fuse import FusedPart  # noqa: E402
from marlin.integrations import hf_quantizer  # noqa: E402

from conftest import rel_err  # noqa: E402
from test_convert import MODEL_TOL, edit_json, llama_gptq_checkpoint  # noqa: E402

AutoModelForCausalLM = transformers.AutoModelForCausalLM


def ids(batch=2, seq=9, seed=0):
    return torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """(gptq dir, marlin dir, fp32 reference) of a tiny Llama with bf16 scales, whose config.json
    says float16 (as a source config may, independently of its scales)."""
    tmp = tmp_path_factory.mktemp("bf16")
    src, ref = llama_gptq_checkpoint(tmp, act_order=False, group_size=128, dtype=torch.bfloat16)
    dst = tmp / "marlin"
    convert_gptq_checkpoint(src, dst, quiet=True)
    for d in (src, dst):
        edit_json(d / "config.json", lambda c: c.update(dtype="float16", torch_dtype="float16"))
    return src, dst, ref


@pytest.mark.parametrize("asked", [None, torch.float16, torch.float32])
def test_bf16_checkpoint_loads_in_bf16(bf16_checkpoint, asked, caplog):
    _, dst, ref = bf16_checkpoint
    kw = {} if asked is None else {"dtype": asked}
    with caplog.at_level(logging.WARNING, logger="marlin.integrations.hf_quantizer"):
        model = AutoModelForCausalLM.from_pretrained(dst, **kw)
    assert "loading in torch.bfloat16, the dtype of the checkpoint's quantized layers" in caplog.text
    assert model.dtype == torch.bfloat16 and model.config.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    x = ids()
    with torch.no_grad():
        logits = model(x).logits
        assert logits.dtype == torch.bfloat16
        assert torch.equal(logits, marlin.load_quantized(dst, device="cpu")(x).logits)
        assert rel_err(logits.float(), ref(x).logits) < 2 * MODEL_TOL  # bf16 activations round more coarsely


def test_bf16_asked_for_gives_no_warning(bf16_checkpoint, caplog):
    _, dst, _ = bf16_checkpoint
    with caplog.at_level(logging.WARNING, logger="marlin.integrations.hf_quantizer"):
        model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and "loading in" not in caplog.text


def test_bf16_gptq_checkpoint_repacked_at_load_time_follows_its_scales(bf16_checkpoint):
    src, dst, _ = bf16_checkpoint
    model = AutoModelForCausalLM.from_pretrained(src, config=hf_quantizer.gptq_config(src))
    assert model.dtype == torch.bfloat16
    x = ids(seed=2)
    with torch.no_grad():
        assert torch.equal(model(x).logits, marlin.load_quantized(dst, device="cpu")(x).logits)


@pytest.fixture(scope="module")
def fused_saved(tmp_path_factory):
    """(original fused model, directory it was saved to): from_pretrained, fuse, save_pretrained."""
    tmp = tmp_path_factory.mktemp("fused")
    src, _ = llama_gptq_checkpoint(tmp, act_order=False, group_size=128)
    convert_gptq_checkpoint(src, tmp / "marlin", quiet=True)
    model = AutoModelForCausalLM.from_pretrained(tmp / "marlin")
    report = marlin.fuse_projections(model, strict=True)
    assert len(report.fused) == 2 * model.config.num_hidden_layers
    model.save_pretrained(tmp / "saved")
    return model, tmp / "saved"


def _assert_same_fused_model(loaded, original):
    attn = loaded.model.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedPart) and isinstance(attn.qkv_proj, marlin.MarlinLinear)
    assert isinstance(loaded.model.layers[1].mlp.up_proj, FusedPart)
    want = original.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    x = ids(seed=3)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, original(x).logits)
    kw = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(loaded.generate(x[:1], **kw), original.generate(x[:1], **kw))


def test_fused_checkpoint_loads_with_from_pretrained(fused_saved):
    original, saved = fused_saved
    loaded = AutoModelForCausalLM.from_pretrained(saved)
    _assert_same_fused_model(loaded, original)
    for m in loaded.modules():  # the fused layers got their zeroed lock buffers too
        if isinstance(m, marlin.MarlinLinear):
            assert not m.workspace.is_meta and not m.workspace.any()


def test_fused_checkpoint_loads_with_load_quantized(fused_saved):
    original, saved = fused_saved
    _assert_same_fused_model(marlin.load_quantized(saved, device="cpu"), original)


def test_fused_checkpoint_that_does_not_fit_the_config_is_refused(fused_saved, tmp_path):
    _, saved = fused_saved
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in saved.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    # one kv head fewer: q/k/v of the model built from the config no longer add up to qkv_proj
    edit_json(bad / "config.json", lambda c: c.update(num_key_value_heads=1))
    with pytest.raises(ConversionError, match=r"qkv_proj: install_fused: qkv_proj is \[256 -> 512\], but its parts"):
        marlin.load_quantized(bad, device="cpu")
    with pytest.raises(ConversionError, match="out_features add up"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_replace_linear_then_save_pretrained_loads_back(tmp_path):
    # Without quant_method "marlin" in the saved config, from_pretrained would build nn.Linear
    # layers, find none of their weights and initialize them at random.
    from conftest import tiny_llama_config

    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)  # built in fp16, as from_pretrained builds it
    try:
        model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    finally:
        torch.set_default_dtype(prev)
    report = marlin.replace_linear(model, group_size=64, fuse=True)
    assert report.replaced and model.config.quantization_config["quant_method"] == "marlin"
    assert model.config.quantization_config["group_size"] == 64
    model.save_pretrained(tmp_path / "saved")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    _assert_same_fused_model(loaded, model)
    _assert_same_fused_model(marlin.load_quantized(tmp_path / "saved", device="cpu"), model)


def test_replace_linear_keeps_an_existing_quantization_config():
    from conftest import tiny_llama_config

    model = transformers.LlamaForCausalLM(tiny_llama_config()).half().eval()
    model.config.quantization_config = {"quant_method": "marlin", "checkpoint_format": "marlin", "note": "mine"}
    marlin.replace_linear(model)
    assert model.config.quantization_config["note"] == "mine"
    plain = torch.nn.Sequential(torch.nn.Linear(128, 128).half())
    marlin.replace_linear(plain)  # not a transformers model: nothing to mark, no error
    assert isinstance(plain[0], marlin.MarlinLinear)


def test_fused_checkpoint_loads_sharded_by_part(fused_saved):
    # load_sharded splits a fused q|k|v layer by part, each rank reading q's, k's and v's own column
    # slice (tests/tp_workers.py's load_fused checks two ranks); in one process the whole fused
    # layer comes back, computing what the saved model computes. A plan that splits a fused part
    # any other way than by columns is refused before anything is read.
    from marlin.parallel import ColumnParallelLinear, ShardError
    from marlin.parallel.loader import load_sharded
    from marlin.parallel.model import LLAMA_PLAN

    original, saved = fused_saved
    model = load_sharded(saved, device="cpu", plan=LLAMA_PLAN)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, ColumnParallelLinear) and isinstance(attn.q_proj, FusedPart)
    assert torch.equal(attn.qkv_proj.local.b_q, original.model.layers[0].self_attn.qkv_proj.b_q)
    x = ids(seed=3)
    with torch.no_grad():
        assert torch.equal(model(x).logits, original(x).logits)
    with pytest.raises(ShardError, match=r"qkv_proj holds \['q_proj', 'k_proj', 'v_proj'\] fused"):
        load_sharded(saved, device="cpu", plan={**LLAMA_PLAN, "model.layers.*.self_attn.k_proj": "rowwise"})


