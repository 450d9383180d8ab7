"""marlin-convert on AutoAWQ "gemm" checkpoints written by an independent writer (tests/awq_writer.py)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from awq_writer import random_awq_layer, write_awq_checkpoint
from marlin import packing
from marlin.convert import ConversionError, convert_gptq_checkpoint
from marlin.convert.awq import AWQ_ORDER, unpack_awq
from marlin.nn import MarlinLinear

LAYERS = [("model.layers.0.mlp.up_proj", 256, 384, True), ("model.layers.0.mlp.down_proj", 384, 192, False)]


def make(tmp_path, group_size=128, **kw):
    layers = {p: random_awq_layer(k, n, group_size, seed=i, bias=b) for i, (p, k, n, b) in enumerate(LAYERS)}
    other = {"model.norm.weight": torch.ones(256, dtype=torch.float16)}
    return write_awq_checkpoint(tmp_path / "src", layers, other, group_size=group_size, **kw), layers


def rel_err(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def test_unpack_awq_order():
    # word = nibble i holds column AWQ_ORDER[i]: encode column j as value j
    word = sum(AWQ_ORDER[i] << (4 * i) for i in range(8))
    assert unpack_awq(torch.tensor([[word]], dtype=torch.int32)).tolist() == [list(range(8))]


@pytest.mark.parametrize("group_size,style", [(128, "config"), (64, "quant_config"), (32, "config"), (-1, "config")])
def test_convert_awq_matches_awq_formula(tmp_path, group_size, style):
    src, layers = make(tmp_path, group_size, config_style=style)
    dst = tmp_path / "dst"
    report = convert_gptq_checkpoint(src, dst, verify=True, quiet=True)
    assert sorted(report.layers) == sorted(layers) and report.max_verify_error < 1e-3
    tensors = load_file(str(dst / "model.safetensors"))
    for prefix, layer in layers.items():
        q, s, z = packing.unpack(tensors[f"{prefix}.b_q"], tensors[f"{prefix}.b_scales"], tensors[f"{prefix}.b_zeros"])
        assert torch.equal(packing.dequantize(q, s, z), layer.dequantize())  # exact
        k, n = layer.q.shape
        state = {key[len(prefix) + 1 :]: t for key, t in tensors.items() if key.startswith(prefix + ".")}
        module = MarlinLinear(k, n, bias=layer.bias is not None, group_size=group_size, zero_points=True)
        module.load_state_dict(state)
        x = torch.randn(3, k).half()
        ref = x.float() @ layer.dequantize()
        if layer.bias is not None:
            ref += torch.from_numpy(layer.bias).float()
        assert rel_err(module(x), ref) < 1e-3
    assert torch.equal(tensors["model.norm.weight"], torch.ones(256, dtype=torch.float16))
    name = "config.json" if style == "config" else "quant_config.json"
    qc = json.loads((dst / name).read_text())
    qc = qc["quantization_config"] if style == "config" else qc
    assert qc["quant_method"] == "marlin" and qc["sym"] is False and qc["bits"] == 4


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda c: c["quantization_config"].update(version="gemv"), "version = 'gemv' is not supported"),
        (lambda c: c["quantization_config"].update(bits=8), "bits = 8 is not supported"),
        (lambda c: c["quantization_config"].update(zero_point=False), "zero_point = False"),
        (lambda c: c["quantization_config"].update(group_size=48), "group_size = 48 is not supported"),
        (lambda c: c["quantization_config"].pop("bits"), "lacks bits"),
        (lambda c: c["quantization_config"].update(quant_method="bitsandbytes"), "expected 'gptq', 'awq' or 'compressed-tensors'"),
    ],
)
def test_awq_config_errors(tmp_path, edit, needle):
    src, _ = make(tmp_path)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=needle):
        convert_gptq_checkpoint(src, tmp_path / "dst", quiet=True)
    assert not (tmp_path / "dst").exists()


def test_awq_tensor_errors(tmp_path):
    from safetensors.torch import save_file

    src, _ = make(tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.qzeros"] = tensors["model.layers.0.mlp.up_proj.qzeros"][:, :-1].contiguous()
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"up_proj\.qzeros: shape \[2, 47\], expected \[2, 48\]"):
        convert_gptq_checkpoint(src, tmp_path / "dst", quiet=True)
    assert not (tmp_path / "dst").exists()
