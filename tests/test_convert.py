"""GPTQ -> Marlin conversion (marlin.convert, marlin-convert) and load_quantized.

The GPTQ checkpoints are written by tests/gptq_writer.py, which shares no code with marlin. The
converted weights must equal the GPTQ dequantization W = s[g_idx] * (q - z) exactly (same fp16
scales, same integers, rows permuted by perm); outputs are compared with LAYER_TOL / MODEL_TOL,
justified in tests/test_nn.py and marlin/convert/verify.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_llama_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from marlin import packing
from marlin.convert import ConversionError, convert_gptq_checkpoint
from marlin.convert import converter as converter_module
from marlin.convert.cli import main as cli_main
from marlin.nn import MarlinLinear, load_quantized

from gptq_writer import quantize_gptq, random_layer, write_gptq_checkpoint

LAYER_TOL = 1e-3
MODEL_TOL = 1e-2
REPO = Path(__file__).resolve().parents[1]
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (prefix, in_features K, out_features N, bias)
LAYERS = [
    ("model.layers.0.self_attn.q_proj", 256, 256, False),
    ("model.layers.0.mlp.up_proj", 256, 384, True),
    ("model.layers.0.mlp.down_proj", 384, 256, False),
]
EXTRA_FILES = {"tokenizer.json": '{"version": "1.0"}', "generation_config.json": '{"do_sample": false}'}


def other_tensors() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model.embed_tokens.weight": torch.randn(64, 256, generator=g).half(),
        "model.norm.weight": torch.ones(256, dtype=torch.float16),
        "lm_head.weight": torch.randn(64, 256, generator=g).half(),
    }


def make_layers(group_size=128, act_order=False, sym=True, shapes=LAYERS, bits=4, scale_dtype=np.float16) -> dict:
    return {
        prefix: random_layer(
            k, n, group_size, seed=i, act_order=act_order, sym=sym, bias=bias, bits=bits, scale_dtype=scale_dtype
        )
        for i, (prefix, k, n, bias) in enumerate(shapes)
    }


def make_src(tmp_path, *, layers=None, group_size=128, act_order=False, fmt="gptq", num_shards=2, **kw) -> tuple:
    layers = layers if layers is not None else make_layers(group_size, act_order)
    src = write_gptq_checkpoint(
        tmp_path / "src",
        layers,
        other_tensors(),
        group_size=group_size,
        desc_act=act_order,
        checkpoint_format=fmt,
        num_shards=num_shards,
        extra_files=EXTRA_FILES,
        **kw,
    )
    return src, layers


def tree_hash(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def load_dir(path: Path) -> dict:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def rel_err(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def marlin_weight(tensors: dict, prefix: str) -> torch.Tensor:
    """B [K, N] of a converted layer in the natural order of the input features."""
    b_q, b_s, b_z = tensors[f"{prefix}.b_q"], tensors[f"{prefix}.b_scales"], tensors.get(f"{prefix}.b_zeros")
    bits = 4 if b_q.shape[1] == 2 * b_s.shape[1] else 8
    b = packing.dequantize(*packing.unpack(b_q, b_s, b_z, bits=bits))
    perm = tensors.get(f"{prefix}.perm")
    if perm is None:
        return b
    natural = torch.empty_like(b)
    natural[perm.long()] = b
    return natural


def assert_converted(src: Path, dst: Path, layers: dict, group_size: int, num_shards: int, bits: int = 4) -> dict:
    tensors = load_dir(dst)
    shard_names = sorted(p.name for p in dst.glob("*.safetensors"))
    assert shard_names == sorted(p.name for p in src.glob("*.safetensors")) and len(shard_names) == num_shards
    if num_shards > 1:
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(tensors)
        for name, shard in index["weight_map"].items():
            with safe_open(str(dst / shard), "pt") as f:
                assert name in f.keys()
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for prefix, layer in layers.items():
        assert f"{prefix}.qweight" not in tensors
        assert torch.equal(marlin_weight(tensors, prefix), layer.dequantize())  # exact
        gptq = layer.tensors("gptq_v2")
        if layer.bias is not None:
            assert torch.equal(tensors[f"{prefix}.bias"], gptq["bias"])
        # the keys load into a MarlinLinear as they are (strict), which computes x @ W
        k, n = layer.q.shape
        state = {key[len(prefix) + 1 :]: t for key, t in tensors.items() if key.startswith(prefix + ".")}
        dtype = gptq["scales"].dtype
        module = MarlinLinear(
            k, n, bias=layer.bias is not None, group_size=group_size, dtype=dtype, bits=bits, zero_points="b_zeros" in state
        )
        module.load_state_dict(state)
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(0)).to(dtype)
        ref = x.float() @ layer.dequantize()
        if layer.bias is not None:
            ref += gptq["bias"].float()
        assert rel_err(module(x), ref) < (LAYER_TOL if dtype == torch.float16 else 8e-3)
    for name, t in other_tensors().items():
        assert torch.equal(tensors[name], t)
    for name, text in EXTRA_FILES.items():
        assert (dst / name).read_text() == text
    config = json.loads((dst / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["checkpoint_format"] == "marlin" and qc["bits"] == bits and qc["group_size"] == group_size
    return tensors


def assert_no_output(tmp_path: Path, dst: Path) -> None:
    assert not dst.exists()
    leftovers = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]
    assert leftovers == [], leftovers


# -- successful conversions -----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [128, -1])
def test_convert_sharded_matches_gptq(tmp_path, fmt, act_order, group_size):
    src, layers = make_src(tmp_path, group_size=group_size, act_order=act_order, fmt=fmt, num_shards=2)
    before = tree_hash(src)
    dst = tmp_path / "dst"
    report = convert_gptq_checkpoint(src, dst, quiet=True)
    tensors = assert_converted(src, dst, layers, group_size, num_shards=2)
    assert tree_hash(src) == before
    assert sorted(report.layers) == sorted(layers) and report.copied_tensors == 3
    has_perm = act_order and group_size != -1  # one group: every order is already "sorted"
    assert sorted(report.act_order_layers) == (sorted(layers) if has_perm else [])
    assert all((f"{p}.perm" in tensors) == has_perm for p in layers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


@pytest.mark.parametrize(
    "fmt, bits, sym, group_size, act_order, scale_dtype",
    [
        ("gptq", 4, False, 128, True, np.float16),  # AutoGPTQ v1 asymmetric
        ("gptq_v2", 4, False, 32, True, np.float16),  # GPTQModel v2 asymmetric, group 32
        ("gptq_v2", 4, False, -1, False, "bfloat16"),
        ("gptq", 8, True, 128, True, np.float16),  # 8-bit GPTQ
        ("gptq_v2", 8, True, -1, False, np.float16),
        ("gptq", 4, True, 64, True, "bfloat16"),  # group 64, bf16 scales
        ("gptq_v2", 4, True, 32, False, np.float16),
    ],
)
def test_convert_formats(tmp_path, fmt, bits, sym, group_size, act_order, scale_dtype):
    layers = make_layers(group_size, act_order, sym=sym, bits=bits, scale_dtype=scale_dtype)
    if fmt == "gptq" and not sym:
        for layer in layers.values():  # v1 cannot store a zero of 0 (test_gptq_v1_zero_of_zero_is_refused)
            layer.zeros[layer.zeros == 0] = 1
    src, _ = make_src(tmp_path, layers=layers, group_size=group_size, act_order=act_order, fmt=fmt, bits=bits, sym=sym)
    dst = tmp_path / "dst"
    report = convert_gptq_checkpoint(src, dst, quiet=True, verify=True)
    tensors = assert_converted(src, dst, layers, group_size, num_shards=2, bits=bits)
    assert all((f"{p}.b_zeros" in tensors) == (not sym) for p in layers)
    assert report.max_verify_error < (1e-3 if scale_dtype == np.float16 else 8e-3)


def test_convert_asymmetric_v1_zero_of_zero_is_refused(tmp_path):
    layers = make_layers(128, sym=False)
    layers["model.layers.0.mlp.up_proj"].zeros[1, 5] = 0
    src, _ = make_src(tmp_path, layers=layers, sym=False, fmt="gptq")
    with pytest.raises(ConversionError, match=r"up_proj\.qzeros: zero point 16 at group 1, column 5 is outside \[0, 15\]"):
        convert_gptq_checkpoint(src, tmp_path / "dst", quiet=True)
    assert_no_output(tmp_path, tmp_path / "dst")


@pytest.mark.parametrize("style", ["quantize_config", "both"])
def test_convert_single_file_autogptq_layout(tmp_path, style):
    src, layers = make_src(tmp_path, act_order=True, num_shards=1, config_style=style)
    dst = tmp_path / "dst"
    convert_gptq_checkpoint(src, dst, quiet=True)
    assert_converted(src, dst, layers, 128, num_shards=1)
    assert not (dst / "model.safetensors.index.json").exists()
    assert json.loads((dst / "quantize_config.json").read_text())["checkpoint_format"] == "marlin"


def test_convert_with_verify_cpu(tmp_path):
    src, layers = make_src(tmp_path, act_order=True)
    report = convert_gptq_checkpoint(src, tmp_path / "dst", verify=True, quiet=True)
    assert report.max_verify_error is not None and report.max_verify_error < 1e-3
    assert "verified" in report.summary()


def test_verify_catches_a_wrong_conversion(tmp_path, monkeypatch):
    src, _ = make_src(tmp_path, act_order=True)
    real = converter_module.gptq_to_marlin

    def drop_perm(*args, **kwargs):  # a converter that forgets the act-order permutation
        out = real(*args, **kwargs)
        out.perm = None
        return out

    monkeypatch.setattr(converter_module, "gptq_to_marlin", drop_perm)
    dst = tmp_path / "dst"
    with pytest.raises(ConversionError, match=r"verify: layer .*normwise relative error .* exceeds 1e-03"):
        convert_gptq_checkpoint(src, dst, verify=True, quiet=True)
    assert_no_output(tmp_path, dst)


def test_gptq_format_stored_zero_convention(tmp_path):
    # A gptq_v2 checkpoint (zeros stored as 8) labelled "gptq" reads as zero 9: refused, with a hint.
    src, _ = make_src(tmp_path, fmt="gptq_v2")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "gptq"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="the config says sym = true, but 768 of 768 zero points are not 8.*'gptq_v2'"):
        convert_gptq_checkpoint(src, tmp_path / "dst", quiet=True)


# -- destination handling and the command line ----------------------------------------------------
def test_cli_and_overwrite(tmp_path, capsys):
    src, layers = make_src(tmp_path)
    dst = tmp_path / "dst"
    assert cli_main([str(src), str(dst), "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    marker = dst / "marker.txt"
    marker.write_text("old output")
    assert cli_main([str(src), str(dst), "--quiet"]) == 1
    assert "exists" in capsys.readouterr().err and marker.exists()
    assert cli_main([str(src), str(dst), "--overwrite", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "converted 3 quantized layers" in out and "verified" in out
    assert not marker.exists()
    assert_converted(src, dst, layers, 128, num_shards=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_script_wrapper(tmp_path):
    # Without PYTHONPATH, as a user runs it from a checkout that was built in place but not
    # installed (the script finds the package next to scripts/).
    src, layers = make_src(tmp_path, num_shards=1)
    dst = tmp_path / "dst"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "convert_gptq.py"), str(src), str(dst), "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    assert_converted(src, dst, layers, 128, num_shards=1)


def test_destination_inside_source_is_refused(tmp_path):
    src, _ = make_src(tmp_path)
    with pytest.raises(ConversionError, match="overlap"):
        convert_gptq_checkpoint(src, src / "out", quiet=True)
    with pytest.raises(ConversionError, match="overlap"):
        convert_gptq_checkpoint(src, src, overwrite=True, quiet=True)
    assert not (src / "out").exists()


# -- refused inputs: a clear error, no output, input untouched ------------------------------------
def shard_of(src: Path, name: str) -> Path:
    index = src / "model.safetensors.index.json"
    if index.exists():
        return src / json.loads(index.read_text())["weight_map"][name]
    return src / "model.safetensors"


def rewrite_tensor(src: Path, name: str, new) -> None:
    path = shard_of(src, name)
    tensors = load_file(str(path))
    if new is None:
        del tensors[name]
    else:
        tensors[name] = new(tensors[name])
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_json(path: Path, edit) -> None:
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


Q = "model.layers.0.mlp.up_proj"  # a layer to break


def truncate(src):
    path = shard_of(src, f"{Q}.qweight")
    path.write_bytes(path.read_bytes()[:-100])


def corrupt_header(src):
    path = shard_of(src, f"{Q}.qweight")
    data = bytearray(path.read_bytes())
    data[8:20] = b"not json ..."
    path.write_bytes(bytes(data))


def drop_key(key):
    return lambda src: edit_json(src / "config.json", lambda c: c["quantization_config"].pop(key))


def set_key(key, value):
    return lambda src: edit_json(src / "config.json", lambda c: c["quantization_config"].__setitem__(key, value))


def set_shard_name(name):
    def edit(src):
        def change(index):
            index["weight_map"][f"{Q}.qweight"] = name

        edit_json(src / "model.safetensors.index.json", change)

    return edit


def to_pickle_checkpoint(src):
    for p in src.glob("*.safetensors*"):
        p.unlink()
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")


BROKEN = {
    "truncated shard": (truncate, ["model-0000", "not a valid safetensors file", "truncated or corrupt"]),
    "corrupt header": (corrupt_header, ["not a valid safetensors file"]),
    "no config.json": (lambda src: (src / "config.json").unlink(), ["config.json not found"]),
    "config without bits": (drop_key("bits"), ["lacks 'bits'"]),
    "config without sym": (drop_key("sym"), ["lacks 'sym'"]),
    "bits 3": (set_key("bits", 3), ["bits = 3 is not supported", "4- or 8-bit"]),
    "bits 8 with 4-bit tensors": (set_key("bits", 8), ["down_proj", "in_features = 192 is not a multiple of group_size = 128"]),
    "sym false with bits 8": (lambda src: (set_key("sym", False)(src), set_key("bits", 8)(src)), ["sym = false with bits = 8", "4-bit weights only"]),
    "scales fp16, bias bf16": (lambda src: rewrite_tensor(src, f"{Q}.bias", lambda t: t.bfloat16()), [f"{Q}.bias: dtype torch.bfloat16, expected torch.float16"]),
    "group size 48 in config": (set_key("group_size", 48), ["group_size = 48 is not supported", "(32, 64, 128, -1)"]),
    "already marlin": (set_key("checkpoint_format", "marlin"), ["already converted"]),
    "unknown format": (set_key("checkpoint_format", "awq"), ["checkpoint_format = 'awq' is not supported"]),
    "not gptq": (set_key("quant_method", "bitsandbytes"), ["quant_method = 'bitsandbytes'", "expected 'gptq', 'awq' or 'compressed-tensors'"]),
    "qweight int64": (lambda src: rewrite_tensor(src, f"{Q}.qweight", lambda t: t.long()), [f"{Q}.qweight: dtype torch.int64"]),
    "scales fp32": (lambda src: rewrite_tensor(src, f"{Q}.scales", lambda t: t.float()), [f"{Q}.scales: dtype torch.float32", "torch.float16 or torch.bfloat16"]),
    "scales wrong shape": (lambda src: rewrite_tensor(src, f"{Q}.scales", lambda t: t[:1].contiguous()), [f"{Q}.scales: shape [1, 384], expected [2, 384]"]),
    "missing scales": (lambda src: (rewrite_tensor(src, f"{Q}.scales", None), edit_json(src / "model.safetensors.index.json", lambda i: i["weight_map"].pop(f"{Q}.scales"))), [f"{Q}.scales is missing"]),
    "index lists absent tensor": (lambda src: edit_json(src / "model.safetensors.index.json", lambda i: i["weight_map"].__setitem__("ghost.weight", "model-00001-of-00002.safetensors")), ["not in their shard", "ghost.weight"]),
    "index escapes directory": (set_shard_name("../evil.safetensors"), ["'../evil.safetensors' is not a plain file name"]),
    "index absolute path": (set_shard_name("/tmp/evil.safetensors"), ["'/tmp/evil.safetensors' is not a plain file name"]),
    "pickle checkpoint": (to_pickle_checkpoint, ["no safetensors weights", "pytorch_model.bin", "pickle"]),
    "shards without index": (lambda src: (src / "model.safetensors.index.json").unlink(), ["several safetensors files", "no *.safetensors.index.json"]),
    "stray GPTQ tensor": (lambda src: rewrite_tensor(src, f"{Q}.qweight", None) or edit_json(src / "model.safetensors.index.json", lambda i: i["weight_map"].pop(f"{Q}.qweight")), [f"tensor {Q}.", f"has no {Q}.qweight next to it"]),
    "g_idx uneven groups": (lambda src: rewrite_tensor(src, f"{Q}.g_idx", lambda t: torch.zeros_like(t)), [f"{Q}.g_idx: group 0 has 256 input rows, expected 128"]),
    "g_idx out of range": (lambda src: rewrite_tensor(src, f"{Q}.g_idx", lambda t: t + 5), [f"{Q}.g_idx: values lie in [5, 6]"]),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_input_is_refused_cleanly(tmp_path, case):
    src, _ = make_src(tmp_path)
    breaker, needles = BROKEN[case]
    breaker(src)
    before = tree_hash(src)
    dst = tmp_path / "dst"
    with pytest.raises(ConversionError) as info:
        convert_gptq_checkpoint(src, dst, quiet=True)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert_no_output(tmp_path, dst)
    assert tree_hash(src) == before


@pytest.mark.parametrize("desc_act", [False, True])
def test_missing_g_idx(tmp_path, desc_act):
    # Without act-order g_idx is implied (k // group_size); with desc_act it is needed.
    src, layers = make_src(tmp_path, num_shards=1)
    for prefix in layers:
        rewrite_tensor(src, f"{prefix}.g_idx", None)
    edit_json(src / "config.json", lambda c: c["quantization_config"].__setitem__("desc_act", desc_act))
    dst = tmp_path / "dst"
    if desc_act:
        with pytest.raises(ConversionError, match="g_idx is missing, but desc_act = true needs it"):
            convert_gptq_checkpoint(src, dst, quiet=True)
        assert_no_output(tmp_path, dst)
    else:
        convert_gptq_checkpoint(src, dst, quiet=True, verify=True)
        assert_converted(src, dst, layers, 128, num_shards=1)


def test_asymmetric_zeros_refused_after_conversion_started(tmp_path):
    # sym=true in the config but real zero points: only the values show it, i.e. after the output
    # directory was created; it must be removed again.
    layers = make_layers()
    layers["model.layers.0.mlp.down_proj"] = random_layer(384, 256, 128, seed=9, sym=False)
    src, _ = make_src(tmp_path, layers=layers)
    before = tree_hash(src)
    dst = tmp_path / "dst"
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.mlp\.down_proj\.qzeros: the config says sym = true, but"):
        convert_gptq_checkpoint(src, dst, quiet=True)
    assert_no_output(tmp_path, dst)
    assert tree_hash(src) == before


@pytest.mark.parametrize(
    "group_size, shapes, needle",
    [
        (256, [("model.a", 256, 256, False)], "group_size = 256 is not supported"),
        (-1, [("model.a", 160, 256, False)], "in_features = 160, expected a positive multiple of 64"),
        (-1, [("model.a", 256, 200, False)], "out_features = 200, expected a positive multiple of 64"),
    ],
)
def test_unsupported_shapes(tmp_path, group_size, shapes, needle):
    layers = {p: random_layer(k, n, group_size, seed=0, bias=b) for p, k, n, b in shapes}
    src, _ = make_src(tmp_path, layers=layers, group_size=group_size)
    with pytest.raises(ConversionError, match=needle):
        convert_gptq_checkpoint(src, tmp_path / "dst", quiet=True)
    assert_no_output(tmp_path, tmp_path / "dst")


# -- load_quantized on a converted Llama ----------------------------------------------------------
def llama_gptq_checkpoint(tmp_path, act_order=True, group_size=128, *, bits=4, sym=True, dtype=torch.float16):
    """A tiny random Llama (tied embeddings), its Linear layers GPTQ-quantized by the test writer,
    written as a sharded GPTQ checkpoint; returns (src, fp32 reference model with the GPTQ weights)."""
    transformers = pytest.importorskip("transformers")
    config = tiny_llama_config(tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    layers, other = {}, {}
    rng_seed = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            rng_seed += 1
            layers[name] = quantize_gptq(
                module.weight.detach().numpy(),
                group_size,
                act_order=act_order,
                rng=np.random.default_rng(rng_seed),
                bits=bits,
                sym=sym,
                scale_dtype="bfloat16" if dtype == torch.bfloat16 else np.float16,
            )
            if not sym:
                layers[name].zeros[layers[name].zeros == 0] = 1  # storable in v1 "gptq"
    for name, t in model.state_dict().items():
        prefix = name.rsplit(".", 1)[0]
        if prefix not in layers and name != "lm_head.weight":  # tied: saved once, as the embedding
            other[name] = t.to(dtype)
    model_config = json.loads(config.to_json_string())
    src = write_gptq_checkpoint(
        tmp_path / "src",
        layers,
        other,
        group_size=group_size,
        desc_act=act_order,
        bits=bits,
        sym=sym,
        num_shards=3,
        model_config=model_config,
        extra_files={"generation_config.json": json.dumps({"max_new_tokens": 3, "do_sample": False})},
    )
    ref = copy.deepcopy(model).float()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(p.to(dtype).float())
        for name, layer in layers.items():
            ref.get_submodule(name).weight.copy_(layer.dequantize().t())
    return src, ref


def test_load_quantized_llama_matches_gptq_reference(tmp_path):
    src, ref = llama_gptq_checkpoint(tmp_path)
    dst = tmp_path / "dst"
    convert_gptq_checkpoint(src, dst, quiet=True)
    model = load_quantized(dst, device="cpu")
    assert not model.training
    marlin_layers = [n for n, m in model.named_modules() if isinstance(m, MarlinLinear)]
    assert len(marlin_layers) == 14 and all(model.get_submodule(n).perm is not None for n in marlin_layers)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again after loading
    assert model.generation_config.max_new_tokens == 3
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
        assert rel_err(logits, ref(ids).logits) < MODEL_TOL
    out = model.generate(ids[:1], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 12)


@pytest.mark.parametrize(
    "bits, sym, dtype, group_size",
    [(4, False, torch.bfloat16, 64), (8, True, torch.float16, 128), (4, True, torch.bfloat16, 32)],
)
def test_load_quantized_formats(tmp_path, bits, sym, dtype, group_size):
    src, ref = llama_gptq_checkpoint(tmp_path, group_size=group_size, bits=bits, sym=sym, dtype=dtype)
    dst = tmp_path / "dst"
    convert_gptq_checkpoint(src, dst, quiet=True)
    model = load_quantized(dst, device="cpu")
    layers = [m for m in model.modules() if isinstance(m, MarlinLinear)]
    assert len(layers) == 14
    assert all(m.bits == bits and m.zero_points == (not sym) and m.dtype == dtype for m in layers)
    assert model.model.norm.weight.dtype == dtype
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = rel_err(model(ids).logits, ref(ids).logits)
    assert err < (MODEL_TOL if dtype == torch.float16 else 5e-2)
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match=f"dtype = {other}, but the checkpoint's quantized layers compute in {dtype}"):
        load_quantized(dst, device="cpu", dtype=other)


def test_load_quantized_refuses_mismatches(tmp_path):
    src, _ = llama_gptq_checkpoint(tmp_path, act_order=False, group_size=-1)
    with pytest.raises(ConversionError, match="checkpoint_format = 'gptq', expected 'marlin'.*marlin-convert"):
        load_quantized(src, device="cpu")
    dst = tmp_path / "dst"
    convert_gptq_checkpoint(src, dst, quiet=True)
    with pytest.raises(ValueError, match="dtype = torch.float32, expected torch.float16"):
        load_quantized(dst, dtype=torch.float32)
    name = "model.layers.1.post_attention_layernorm.weight"
    rewrite_tensor(dst, name, None)
    edit_json(dst / "model.safetensors.index.json", lambda i: i["weight_map"].pop(name))
    with pytest.raises(ConversionError, match=f"not in the checkpoint.*{name}"):
        load_quantized(dst, device="cpu")
    rewrite_tensor(dst, "model.norm.weight", lambda t: t)  # keep the file valid, then add a stray tensor
    path = shard_of(dst, "model.norm.weight")
    tensors = load_file(str(path))
    tensors["model.unused.weight"] = torch.zeros(2)
    tensors[name] = torch.ones(256, dtype=torch.float16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    edit_json(dst / "model.safetensors.index.json", lambda i: i["weight_map"].update({"model.unused.weight": path.name, name: path.name}))
    with pytest.raises(ConversionError, match="does not use.*model.unused.weight"):
        load_quantized(dst, device="cpu")


# -- CUDA (run on the GPU machine) ----------------------------------------------------------------
@cuda_only
def test_convert_verify_on_cuda(tmp_path):
    src, layers = make_src(tmp_path, act_order=True)
    report = convert_gptq_checkpoint(src, tmp_path / "dst", verify=True, device="cuda", quiet=True)
    assert report.max_verify_error < 1e-3 and len(report.layers) == len(layers)
    assert cli_main([str(src), str(tmp_path / "dst2"), "--verify", "--device", "cuda", "--quiet"]) == 0


@cuda_only
def test_load_quantized_on_cuda(tmp_path):
    src, ref = llama_gptq_checkpoint(tmp_path)
    dst = tmp_path / "dst"
    convert_gptq_checkpoint(src, dst, quiet=True)
    model = load_quantized(dst, device="cuda")
    assert all(b.is_cuda for b in model.buffers())
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(ids.cuda()).logits.cpu(), ref(ids).logits) < MODEL_TOL
    out = model.generate(ids[:1].cuda(), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 12)
