"""marlin-convert on compressed-tensors "pack-quantized" checkpoints written by the compressed-tensors
library's own quantization and packing code (skipped where the library is not installed)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import marlin
from marlin import packing
from marlin.convert import ConversionError, convert_gptq_checkpoint
from marlin.nn import MarlinLinear

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

LAYERS = [("model.layers.0.mlp.up_proj", 256, 384, True), ("model.layers.0.mlp.down_proj", 384, 192, False)]


def ct_layer(k, n, bits, sym, group_size, dtype, seed):
    """One Linear [N, K] quantized and packed by compressed-tensors; returns (tensors, B [K, N] exact)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05 + (0 if sym else 0.02)).to(dtype)
    return ct_pack(w, bits, sym, group_size, dtype)


def ct_pack(w, bits, sym, group_size, dtype):
    """The weight w [N, K] quantized and packed by compressed-tensors (scales in ``dtype``); returns
    (tensors, B [K, N] exact)."""
    n, k = w.shape
    strategy = "channel" if group_size == -1 else "group"
    args = QuantizationArgs(
        num_bits=bits, type="int", symmetric=sym, strategy=strategy, group_size=None if group_size == -1 else group_size
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    gs = k if group_size == -1 else group_size
    blocks = w.float().reshape(n, k // gs, gs)
    scale, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args)
    scale = scale.to(dtype)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp.to(torch.int8)}
    packed = dict(PackedQuantizationCompressor.compress(state, scheme))
    # the exact weight, from the library's own decompression path's integers
    from compressed_tensors.compressors.pack_quantized import unpack_from_int32

    q = unpack_from_int32(packed["weight_packed"], bits, torch.Size([n, k])).float()
    z = zp.float() if not sym else torch.zeros_like(scale, dtype=torch.float32)
    rows = k // scale.shape[1]
    b = (scale.float().repeat_interleave(rows, 1) * (q - z.round().repeat_interleave(rows, 1))).t().contiguous()
    return packed, b


def write(tmp_path, bits, sym, group_size, dtype):
    tensors, refs = {}, {}
    for i, (prefix, k, n, bias) in enumerate(LAYERS):
        packed, b = ct_layer(k, n, bits, sym, group_size, dtype, seed=i)
        tensors.update({f"{prefix}.{s}": t.contiguous() for s, t in packed.items()})
        if bias:
            tensors[f"{prefix}.bias"] = torch.randn(n).to(dtype)
        refs[prefix] = b
    tensors["lm_head.weight"] = torch.randn(64, 256).to(dtype)  # in "ignore": stays a plain tensor
    src = tmp_path / "src"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "channel" if group_size == -1 else "group"}
    if group_size != -1:
        weights["group_size"] = group_size
    config = {
        "model_type": "llama",
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head"],
        },
    }
    (src / "config.json").write_text(json.dumps(config))
    return src, tensors, refs


@pytest.mark.parametrize(
    "bits,sym,group_size,dtype",
    [
        (4, True, 128, torch.float16),
        (4, False, 128, torch.float16),
        (4, False, 64, torch.bfloat16),
        (4, True, -1, torch.bfloat16),
        (4, False, -1, torch.float16),
        (8, True, 128, torch.float16),
        (8, True, -1, torch.bfloat16),
    ],
)
def test_convert_pack_quantized(tmp_path, bits, sym, group_size, dtype):
    src, tensors, refs = write(tmp_path, bits, sym, group_size, dtype)
    dst = tmp_path / "dst"
    report = convert_gptq_checkpoint(src, dst, verify=True, quiet=True)
    assert sorted(report.layers) == sorted(refs)
    out = load_file(str(dst / "model.safetensors"))
    assert torch.equal(out["lm_head.weight"], tensors["lm_head.weight"])
    for prefix, k, n, bias in LAYERS:
        zeros = out.get(f"{prefix}.b_zeros")
        assert (zeros is None) == sym
        parts = packing.unpack(out[f"{prefix}.b_q"], out[f"{prefix}.b_scales"], zeros, bits=bits)
        assert torch.equal(packing.dequantize(*parts), refs[prefix])  # exact
        state = {key[len(prefix) + 1 :]: t for key, t in out.items() if key.startswith(prefix + ".")}
        module = MarlinLinear(k, n, bias=bias, group_size=group_size, dtype=dtype, bits=bits, zero_points=not sym)
        module.load_state_dict(state)
        x = torch.randn(3, k).to(dtype)
        ref = x.float() @ refs[prefix] + (tensors[f"{prefix}.bias"].float() if bias else 0)
        err = float((module(x).double() - ref.double()).norm() / ref.double().norm())
        assert err < (1e-3 if dtype == torch.float16 else 8e-3)
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "marlin" and qc["bits"] == bits and qc["sym"] == sym


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda q: q.update(format="naive-quantized"), "format = 'naive-quantized' is not supported"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=2), "num_bits = 2 is not supported"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"), "strategy = 'tensor' is not supported"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=16), "group_size = 16 is not supported"),
        (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "quantized input activations"),
    ],
)
def test_pack_quantized_config_errors(tmp_path, edit, needle):
    src, _, _ = write(tmp_path, 4, True, 128, torch.float16)
    config = json.loads((src / "config.json").read_text())
    edit(config["quantization_config"])
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=needle):
        convert_gptq_checkpoint(src, tmp_path / "dst", quiet=True)
    assert not (tmp_path / "dst").exists()


def test_pack_quantized_tensor_errors(tmp_path):
    src, tensors, _ = write(tmp_path, 4, False, 128, torch.float16)
    broken = dict(tensors)
    del broken["model.layers.0.mlp.up_proj.weight_zero_point"]
    save_file(broken, str(src / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"up_proj\.weight_zero_point is missing"):
        convert_gptq_checkpoint(src, tmp_path / "dst", quiet=True)
    broken = dict(tensors)
    broken["model.layers.0.mlp.up_proj.weight_shape"] = torch.tensor([384, 128])
    save_file(broken, str(src / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"weight_shape \[384, 128\] does not match"):
        convert_gptq_checkpoint(src, tmp_path / "dst", quiet=True)
    assert not (tmp_path / "dst").exists()


SPARSE_LAYERS = [  # (prefix, K, N, pruned 2:4): the pruned ones convert 2:4-sparse, the other stays dense
    ("model.layers.0.mlp.up_proj", 256, 384, True),
    ("model.layers.0.mlp.down_proj", 384, 192, True),  # N = 192: whole 64-column tiles (N % 128 == 64)
    ("model.layers.0.self_attn.o_proj", 256, 256, False),  # not pruned
]


def write_2_4(tmp_path, group_size=128, dtype=torch.float16, sparsity_format="dense", sym=True, layers=SPARSE_LAYERS):
    """A checkpoint as llm-compressor writes a 2:4-pruned W4A16 model: pack-quantized, the pruned
    weights stored as zeros (asymmetric: as q = zp), sparsity_config 2:4 "dense"."""
    from marlin import sparse

    tensors, refs = {}, {}
    for i, (prefix, k, n, pruned) in enumerate(layers):
        g = torch.Generator().manual_seed(10 + i)
        w = torch.randn(n, k, generator=g) * 0.05 + (0 if sym else 0.03)  # asymmetric: off centre
        if pruned:
            w = sparse.prune_2_4(w.t()).t().contiguous()
        packed, refs[prefix] = ct_pack(w.to(dtype), 4, sym, group_size, dtype)
        tensors.update({f"{prefix}.{s}": t.contiguous() for s, t in packed.items()})
    src = tmp_path / "src"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "channel" if group_size == -1 else "group"}
    if group_size != -1:
        weights["group_size"] = group_size
    qc = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head"],
        "sparsity_config": {"format": sparsity_format, "sparsity_structure": "2:4", "targets": ["Linear"],
                            "ignore": ["lm_head"], "global_sparsity": 0.3},
    }
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    return src, refs


@pytest.mark.parametrize("group_size", [128, 64, 32, -1])
def test_convert_2_4_sparse_pack_quantized(tmp_path, group_size):
    """The 2:4-pruned layers become MarlinLinear24 layers, exactly, in every group size the 2:4
    kernel takes (N = 192 too: whole 64-column tiles); the unpruned one stays dense with its
    reason in the report; --verify runs both ops."""
    from marlin import sparse
    from marlin.sparse_nn import MarlinLinear24

    src, refs = write_2_4(tmp_path, group_size)
    dst = tmp_path / "dst"
    report = convert_gptq_checkpoint(src, dst, verify=True, quiet=True)
    up, down, o = (p for p, *_ in SPARSE_LAYERS)
    assert sorted(report.sparse_layers) == sorted([up, down])
    why = dict(report.kept_dense)
    assert "not 2:4 sparse" in why[o] and len(why) == 1
    assert "2:4-sparse layers: 2; dense: 1" in report.summary()
    out = load_file(str(dst / "model.safetensors"))
    for prefix, k, n, _ in SPARSE_LAYERS[:2]:
        assert out[f"{prefix}.b_scales"].shape == (packing.num_groups(k, group_size), n)
        assert torch.equal(sparse.unpack_2_4(out[f"{prefix}.b_q"], out[f"{prefix}.b_meta"], out[f"{prefix}.b_scales"]), refs[prefix])
        layer = MarlinLinear24(k, n, bias=False, group_size=group_size)
        layer.load_state_dict({s: out[f"{prefix}.{s}"] for s in ("b_q", "b_meta", "b_scales")})
        x = torch.randn(3, k).half()
        ref = x.double() @ refs[prefix].double()
        assert float((layer(x).double() - ref).norm() / ref.norm()) < 1e-3, prefix
    assert f"{o}.b_meta" not in out
    assert torch.equal(packing.dequantize(*packing.unpack(out[f"{o}.b_q"], out[f"{o}.b_scales"])), refs[o])
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "marlin" and qc["sparsity"] == "2:4"


@pytest.mark.parametrize("group_size,dtype", [(128, torch.float16), (64, torch.bfloat16), (32, torch.float16), (-1, torch.float16)])
def test_convert_asymmetric_2_4_sparse_pack_quantized(tmp_path, group_size, dtype):
    """An asymmetric 2:4 checkpoint (weight_zero_point; a pruned weight stored as q = zp): the pruned
    layer becomes a MarlinLinear24 layer with b_zeros (Marlin's z = zp + 8, as for the dense path),
    exactly; --verify runs gemm_2_4 with the zero points; the others stay dense with zero points."""
    from marlin import sparse
    from marlin.sparse_nn import MarlinLinear24

    src, refs = write_2_4(tmp_path, group_size, dtype, sym=False)
    tensors = load_file(str(src / "model.safetensors"))
    up, down, o = (p for p, *_ in SPARSE_LAYERS)
    zp = tensors[f"{up}.weight_zero_point"]
    assert zp.abs().sum() > 0  # real zero points, not all 0 (the symmetric case)
    report = convert_gptq_checkpoint(src, tmp_path / "dst", verify=True, quiet=True)
    assert sorted(report.sparse_layers) == sorted([up, down]) and report.max_verify_error < (1e-3 if dtype == torch.float16 else 8e-3)
    why = dict(report.kept_dense)
    assert "not 2:4 sparse" in why[o] and len(why) == 1
    out = load_file(str(tmp_path / "dst" / "model.safetensors"))
    for prefix, k, n, _ in SPARSE_LAYERS[:2]:  # N = 384 and 192
        b_q, b_meta, b_s, b_z = (out[f"{prefix}.{s}"] for s in ("b_q", "b_meta", "b_scales", "b_zeros"))
        assert b_z.shape == b_s.shape == (packing.num_groups(k, group_size), n) and b_z.dtype == dtype
        assert torch.equal(sparse.unpack_2_4(b_q, b_meta, b_s, b_z), refs[prefix])  # exact, pruned weights 0
        assert not torch.equal(sparse.unpack_2_4(b_q, b_meta, b_s), refs[prefix])  # the zero points matter
        layer = MarlinLinear24(k, n, bias=False, group_size=group_size, dtype=dtype, zero_points=True)
        layer.load_state_dict({s: out[f"{prefix}.{s}"] for s in ("b_q", "b_meta", "b_scales", "b_zeros")})
        x = torch.randn(3, k).to(dtype)
        ref = x.double() @ refs[prefix].double()
        assert float((layer(x).double() - ref).norm() / ref.norm()) < (1e-3 if dtype == torch.float16 else 8e-3), prefix
    assert f"{o}.b_meta" not in out
    parts = packing.unpack(out[f"{o}.b_q"], out[f"{o}.b_scales"], out[f"{o}.b_zeros"])
    assert torch.equal(packing.dequantize(*parts), refs[o])
    qc = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    assert qc["sparsity"] == "2:4" and qc["sym"] is False


def test_convert_2_4_sparse_limits(tmp_path):
    # bf16 scales: the 2:4 kernel's dtypes decide; every layer dense, with the reason
    from marlin import sparse

    src, _ = write_2_4(tmp_path, 128, torch.bfloat16)
    report = convert_gptq_checkpoint(src, tmp_path / "dst", quiet=True)
    if torch.bfloat16 not in sparse.DTYPES_2_4:
        assert report.sparse_layers == [] and "torch.bfloat16 scales" in dict(report.kept_dense)[SPARSE_LAYERS[0][0]]
    else:  # bf16 2:4 layers: the same layer as with fp16 scales, checked by --verify on the CPU op
        assert sorted(report.sparse_layers) == sorted(p for p, _, _, pruned in SPARSE_LAYERS if pruned)
        assert convert_gptq_checkpoint(src, tmp_path / "dst2", verify=True, quiet=True).max_verify_error < 8e-3
    # a sparsity_config of another structure: the layers convert as they are, all dense, no reasons
    unstructured = tmp_path / "unstructured"
    unstructured.mkdir()
    src, refs = write_2_4(unstructured, 128)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["sparsity_config"]["sparsity_structure"] = "unstructured"
    (src / "config.json").write_text(json.dumps(config))
    report = convert_gptq_checkpoint(src, unstructured / "dst", quiet=True)
    assert report.sparse_layers == [] and report.kept_dense == [] and sorted(report.layers) == sorted(refs)
    assert "sparsity" not in json.loads((unstructured / "dst" / "config.json").read_text())["quantization_config"]
    # compressed sparse storage is refused before anything is written
    other = tmp_path / "other"
    other.mkdir()
    src, _ = write_2_4(other, 128, sparsity_format="sparse-24-bitmask")
    with pytest.raises(ConversionError, match=r"sparsity_config: format = 'sparse-24-bitmask' is not supported"):
        convert_gptq_checkpoint(src, other / "dst", quiet=True)
    assert not (other / "dst").exists()


@pytest.mark.parametrize("group_size", [64, -1])
def test_convert_2_4_shapes_the_2_4_kernel_refuses(tmp_path, group_size):
    """Pruned 2:4 but K = 192 (a multiple of 64, not of 128): the layer stays dense, with the 2:4
    kernel's reason in the report, next to a pruned N = 320 layer that converts 2:4 (N % 128 ==
    64). A pruned layer with N % 64 != 0 is not a case of "stays dense": no Marlin format takes
    it, so the conversion is refused before anything is written, naming N."""
    from marlin import sparse

    layers = [("model.layers.0.mlp.up_proj", 256, 320, True), ("model.layers.0.mlp.down_proj", 192, 256, True)]
    src, refs = write_2_4(tmp_path, group_size, layers=layers)
    report = convert_gptq_checkpoint(src, tmp_path / "dst", verify=True, quiet=True)
    up, down = (p for p, *_ in layers)
    assert report.sparse_layers == [up]
    why = dict(report.kept_dense)
    assert list(why) == [down]
    assert "the 2:4 kernel does not take it: in_features = 192, expected a positive multiple of 128" in why[down]
    out = load_file(str(tmp_path / "dst" / "model.safetensors"))
    assert torch.equal(sparse.unpack_2_4(out[f"{up}.b_q"], out[f"{up}.b_meta"], out[f"{up}.b_scales"]), refs[up])
    assert f"{down}.b_meta" not in out
    assert torch.equal(packing.dequantize(*packing.unpack(out[f"{down}.b_q"], out[f"{down}.b_scales"])), refs[down])
    odd = tmp_path / "odd"
    odd.mkdir()
    src, _ = write_2_4(odd, group_size, layers=[("model.layers.0.mlp.up_proj", 256, 96, True)])
    with pytest.raises(ConversionError, match=r"N = out_features = 96\) cannot be converted: out_features = 96, expected a positive multiple of 64"):
        convert_gptq_checkpoint(src, odd / "dst", quiet=True)
    assert not (odd / "dst").exists()


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_2_4_llama_converts_and_loads(tmp_path, sym):
    """A tiny Llama pruned 2:4 and saved as llm-compressor does (pack-quantized, channel, sparse 2:4
    dense; symmetric or with zero points): marlin-convert makes every Linear a 2:4 layer; load_quantized
    and from_pretrained give the same logits, close to the model with the checkpoint's dequantized
    weights."""
    transformers = pytest.importorskip("transformers")
    from marlin import sparse
    from marlin.sparse_nn import MarlinLinear24

    from conftest import rel_err, tiny_llama_config

    config = tiny_llama_config()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    tensors = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                w = sparse.prune_2_4(module.weight.t()).t().contiguous()
                packed, b = ct_pack(w.half(), 4, sym, -1, torch.float16)
                tensors.update({f"{name}.{s}": t.contiguous() for s, t in packed.items()})
                module.weight.copy_(b.t())  # the reference: the checkpoint's weights
    for name, t in model.state_dict().items():
        if name.rsplit(".", 1)[0] + ".weight_packed" not in tensors:
            tensors[name] = t.half().contiguous()
    src = tmp_path / "src"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    qc = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": sym,
                                                                          "strategy": "channel"}}},
        "ignore": ["lm_head"],
        "sparsity_config": {"format": "dense", "sparsity_structure": "2:4", "targets": ["Linear"], "ignore": ["lm_head"]},
    }
    (src / "config.json").write_text(json.dumps(dict(json.loads(config.to_json_string()), quantization_config=qc)))

    dst = tmp_path / "dst"
    report = convert_gptq_checkpoint(src, dst, verify=True, quiet=True)
    assert len(report.sparse_layers) == 14 and report.kept_dense == []
    x = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    loaded = marlin.load_quantized(dst, device="cpu")
    via_hf = transformers.AutoModelForCausalLM.from_pretrained(dst)
    for m in (loaded, via_hf):
        layers = [mod for mod in m.modules() if isinstance(mod, MarlinLinear24)]
        assert len(layers) == 14 and all(mod.zero_points == (not sym) for mod in layers)
    with torch.no_grad():
        logits = loaded(x).logits
        assert torch.equal(logits, via_hf(x).logits)
        assert rel_err(logits, model(x).logits) < 5e-3
    if not sym:  # a 2:4 layer's zero points must have its scales' shape and dtype
        out = load_file(str(dst / "model.safetensors"))
        name = next(k for k in out if k.endswith(".b_zeros"))
        out[name] = out[name][:, :64].contiguous()
        save_file(out, str(dst / "model.safetensors"))
        with pytest.raises(ConversionError, match=rf"{name}: dtype torch.float16 shape \[1, 64\], expected the dtype and shape"):
            marlin.load_quantized(dst, device="cpu")
