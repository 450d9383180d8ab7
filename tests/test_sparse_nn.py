"""MarlinLinear24 and replace_linear(sparsity="2:4"): accuracy against the dequantized 2:4 weight,
state_dict round trip and refusals, the pruned-norm report, torch.compile; CUDA when present.

Tolerances as in test_nn.py: one layer vs fp64 x @ B' (B' the exact dequantized weight) within
1e-3 (one fp16 rounding of the output, one of the bias add); a model within 1e-2."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import marlin
from marlin import MarlinLinear, sparse
from marlin.sparse_nn import MarlinLinear24, SparseReplaceReport, replace_linear_2_4
from conftest import requires_cuda_2_4, tiny_llama_config

LAYER_TOL = 1e-3
MODEL_TOL = 1e-2


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def reference(layer: MarlinLinear24, x):
    y = x.cpu().double() @ layer.dequantized_weight().cpu().double().t()
    return y + layer.bias.cpu().double() if layer.bias is not None else y


@pytest.mark.parametrize("group_size", [128, 64, 32, -1])
@pytest.mark.parametrize("bias", [True, False])
def test_from_linear_prunes_quantizes_and_computes(group_size, bias):
    torch.manual_seed(1)
    lin = nn.Linear(256, 384, bias=bias).half()
    layer = MarlinLinear.from_linear(lin, group_size, sparsity="2:4")
    assert isinstance(layer, MarlinLinear24) and layer.group_size == group_size
    w = layer.dequantized_weight()  # [N, K]
    assert sparse.violations_2_4(w.t()).numel() == 0
    # the kept weights are the two largest of every 4 (quantized), the others exactly zero
    kept = sparse.mask_2_4(lin.weight.detach().t().float()).t()
    assert bool((w[~kept] == 0).all())
    # half the weights, uniform init: the two smallest of four carry ~20% of the energy (sqrt: ~45%)
    assert 0.35 < layer.pruned_fraction < 0.55
    x = torch.randn(2, 3, 256).half()
    y = layer(x)
    assert y.shape == (2, 3, 384) and y.dtype == torch.float16
    assert rel_err(y.reshape(6, 384), reference(layer, x.reshape(6, 256))) < LAYER_TOL
    # and it is a 2:4 approximation of the dense layer, not the dense layer
    dense = lin(x).detach().double()
    assert 0.1 < rel_err(y, dense) < 0.6


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "zp"])
@pytest.mark.parametrize("group_size", [128, 64, 32, -1])
@pytest.mark.parametrize("out_features", [192, 320])
def test_out_features_in_whole_64_column_tiles(out_features, group_size, sym, tmp_path):
    """out_features % 128 == 64 (a tensor-parallel shard's width): from_linear, the forward on
    the CPU op against fp64, and the state_dict round trip into a layer built from the shape."""
    torch.manual_seed(out_features + group_size)
    lin = nn.Linear(256, out_features).half()
    layer = MarlinLinear24.from_linear(lin, group_size, sym=sym)
    groups = 1 if group_size == -1 else 256 // group_size
    assert layer.b_q.shape == (256 // 32, 2 * out_features) and layer.b_meta.shape == (256 // 32, out_features)
    assert layer.b_scales.shape == (groups, out_features) and layer.zero_points == (not sym)
    w = layer.dequantized_weight()
    assert w.shape == (out_features, 256) and sparse.violations_2_4(w.t()).numel() == 0
    x = torch.randn(2, 3, 256).half()
    y = layer(x)
    assert y.shape == (2, 3, out_features) and y.dtype == torch.float16
    ref = reference(layer, x.reshape(6, 256))
    assert rel_err(y.reshape(6, out_features), ref) < LAYER_TOL
    assert rel_err(y.reshape(6, out_features)[:, torch.randperm(out_features)], ref) > 0.5
    path = tmp_path / "l.pt"
    torch.save(layer.state_dict(), path)
    fresh = MarlinLinear24(256, out_features, group_size=group_size, zero_points=not sym)
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(fresh(x), y) and torch.equal(fresh.dequantized_weight(), w)


def test_prune_false_takes_only_2_4_weights():
    lin = nn.Linear(128, 128).half()
    with pytest.raises(ValueError, match=r"not 2:4 sparse along K"):
        MarlinLinear24.from_linear(lin, prune=False)
    with torch.no_grad():
        lin.weight.copy_(sparse.prune_2_4(lin.weight.t()).t())
    layer = MarlinLinear24.from_linear(lin, prune=False)
    assert layer.pruned_fraction is None


def test_new_layer_computes_zero_and_bad_arguments():
    layer = MarlinLinear24(128, 256, bias=False)
    assert torch.equal(layer(torch.randn(3, 128).half()), torch.zeros(3, 256).half())
    assert "sparsity=2:4" in repr(layer)
    with pytest.raises(ValueError, match=r"in_features = 96, expected a positive multiple of 128"):
        MarlinLinear24(96, 128)
    # N: whole 64-column tiles (64 and 192 are taken, 96 and 32 are not)
    assert MarlinLinear24(128, 64).b_meta.shape == (4, 64) and MarlinLinear24(128, 192).b_q.shape == (4, 384)
    for n in (96, 32):
        with pytest.raises(ValueError, match=rf"out_features = {n}, expected a positive multiple of 64.*out_features a "
                           r"positive multiple of 64"):
            MarlinLinear24(128, n)
    with pytest.raises(ValueError, match=r"group_size = 16, expected one of \(128, 64, 32, -1\).*group_size 128, 64, 32 or -1"):
        MarlinLinear24(128, 128, group_size=16)
    for g, rows in ((128, 2), (64, 4), (32, 8), (-1, 1)):  # K = 256
        assert MarlinLinear24(256, 128, group_size=g).b_scales.shape == (rows, 128)
    with pytest.raises(ValueError, match=r"dtype = torch.float32, expected torch.float16 or torch.bfloat16"):
        MarlinLinear24(128, 128, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"input dtype is torch.float32"):
        layer(torch.randn(2, 128))
    with pytest.raises(ValueError, match=r"sparsity = '1:2'"):
        MarlinLinear.from_linear(nn.Linear(128, 128), sparsity="1:2")


@pytest.mark.parametrize("group_size", [64, 32])
def test_state_dict_round_trip_in_smaller_groups(tmp_path, group_size):
    """Groups of 64 and 32 rows: K / group_size scale rows, saved and loaded into a layer built
    with that group size; a layer built with the other one refuses them, naming both."""
    torch.manual_seed(group_size)
    layer = MarlinLinear24.from_linear(nn.Linear(256, 128).half(), group_size)
    sd = layer.state_dict()
    assert sd["b_scales"].shape == (256 // group_size, 128)
    path = tmp_path / "l.pt"
    torch.save(sd, path)
    fresh = MarlinLinear24(256, 128, group_size=group_size)
    fresh.load_state_dict(torch.load(path, weights_only=True))
    x = torch.randn(4, 256).half()
    assert torch.equal(fresh(x), layer(x))
    assert torch.equal(fresh.dequantized_weight(), layer.dequantized_weight())
    other = 96 - group_size  # 64 <-> 32
    with pytest.raises(RuntimeError, match=rf"group size {group_size}, but this layer was built with group_size={other}"):
        MarlinLinear24(256, 128, group_size=other).load_state_dict(sd)


def test_state_dict_round_trip_and_refusals(tmp_path):
    torch.manual_seed(2)
    layer = MarlinLinear24.from_linear(nn.Linear(256, 128).half())
    sd = layer.state_dict()
    assert set(sd) == {"b_q", "b_meta", "b_scales", "bias"} and sd._metadata[""]["version"] == 2
    path = tmp_path / "l.pt"
    torch.save(sd, path)
    fresh = MarlinLinear24(256, 128)
    fresh.load_state_dict(torch.load(path, weights_only=True))
    x = torch.randn(4, 256).half()
    assert torch.equal(fresh(x), layer(x))
    # a newer version, a dense MarlinLinear's state_dict, a wrong group size, a wrong dtype
    newer = copy.copy(sd)
    newer._metadata = {"": {"version": 3}}
    with pytest.raises(RuntimeError, match=r"version 3 was written by a newer marlin"):
        MarlinLinear24(256, 128).load_state_dict(newer)
    dense = marlin.MarlinLinear.from_linear(nn.Linear(256, 128).half()).state_dict()
    with pytest.raises(RuntimeError, match=r"holds a dense MarlinLinear"):
        MarlinLinear24(256, 128).load_state_dict(dense)
    with pytest.raises(RuntimeError, match=r"group size -1, but this layer was built with group_size=128"):
        MarlinLinear24(256, 128).load_state_dict(MarlinLinear24.from_linear(nn.Linear(256, 128).half(), -1).state_dict())
    bad = dict(sd)
    bad["b_meta"] = bad["b_meta"].to(torch.int64)
    with pytest.raises(RuntimeError, match=r"b_meta: dtype torch.int64, expected torch.int32"):
        MarlinLinear24(256, 128).load_state_dict(bad)


def shifted_linear(k, n, seed, dtype=torch.float16):
    """A Linear whose weights sit mostly above zero (uniform init plus an offset), where zero
    points place the 16 levels better than a symmetric range."""
    torch.manual_seed(seed)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.add_(0.04)
    return lin.to(dtype)


@pytest.mark.parametrize("group_size", [128, 64, 32, -1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_from_linear_with_zero_points(group_size, dtype):
    """sym=False: the layer stores b_zeros (b_scales' shape and dtype), computes (u - z) * s at
    the kept positions and exactly 0 at the pruned ones, and on weights off centre comes closer
    to the pruned weight than the symmetric layer."""
    lin = shifted_linear(256, 384, seed=6, dtype=dtype)
    layer = MarlinLinear.from_linear(lin, group_size, sparsity="2:4", sym=False)
    assert isinstance(layer, MarlinLinear24) and layer.zero_points and layer.group_size == group_size
    assert layer.b_zeros.shape == layer.b_scales.shape and layer.b_zeros.dtype == dtype
    assert "zero_points=True" in repr(layer)
    w = layer.dequantized_weight()
    kept = sparse.mask_2_4(lin.weight.detach().t().float()).t()
    assert bool((w[~kept] == 0).all()) and sparse.violations_2_4(w.t()).numel() == 0
    pruned = torch.where(kept, lin.weight.detach().float(), torch.zeros(()))
    sym = MarlinLinear24.from_linear(lin, group_size)
    assert not sym.zero_points and sym.b_zeros is None
    assert rel_err(w, pruned) < 0.8 * rel_err(sym.dequantized_weight(), pruned)
    x = torch.randn(2, 3, 256).to(dtype)
    y = layer(x)
    assert y.shape == (2, 3, 384) and y.dtype == dtype
    tol = LAYER_TOL if dtype == torch.float16 else 4e-3
    assert rel_err(y.reshape(6, 384), reference(layer, x.reshape(6, 256))) < tol


def test_zero_point_state_dict_round_trip_and_cross_loading(tmp_path):
    """b_zeros is a state_dict key (version 2, as in MarlinLinear); a zero-point state_dict loads
    only into a layer built with zero_points=True and a symmetric one (version 1 or 2) only into a
    symmetric layer, each refusal naming both sides."""
    layer = MarlinLinear24.from_linear(shifted_linear(256, 128, seed=7), 64, sym=False)
    sd = layer.state_dict()
    assert set(sd) == {"b_q", "b_meta", "b_scales", "b_zeros", "bias"} and sd._metadata[""]["version"] == 2
    path = tmp_path / "zp.pt"
    torch.save(sd, path)
    fresh = MarlinLinear24(256, 128, group_size=64, zero_points=True)
    assert torch.equal(fresh(torch.randn(2, 256).half()), torch.zeros(2, 128).half())  # an empty layer computes 0
    fresh.load_state_dict(torch.load(path, weights_only=True))
    x = torch.randn(4, 256).half()
    assert torch.equal(fresh(x), layer(x)) and torch.equal(fresh.dequantized_weight(), layer.dequantized_weight())
    with pytest.raises(RuntimeError, match=r"b_zeros: the checkpoint has zero points, but this layer was built with zero_points=False"):
        MarlinLinear24(256, 128, group_size=64).load_state_dict(sd)
    sym_layer = MarlinLinear24.from_linear(nn.Linear(256, 128).half(), 64)
    sym_sd = sym_layer.state_dict()
    with pytest.raises(RuntimeError, match=r"b_zeros: the checkpoint has no zero points, but this layer was built with zero_points=True"):
        MarlinLinear24(256, 128, group_size=64, zero_points=True).load_state_dict(sym_sd)
    # a version-1 state dict (symmetric, written before zero points existed) loads as it did
    v1 = copy.copy(sym_sd)
    v1._metadata = {"": {"version": 1}}
    old = MarlinLinear24(256, 128, group_size=64)
    old.load_state_dict(v1)
    assert torch.equal(old(x), sym_layer(x))
    with pytest.raises(RuntimeError, match=r"has no zero points, but this layer was built with zero_points=True"):
        MarlinLinear24(256, 128, group_size=64, zero_points=True).load_state_dict(v1)
    bad = dict(sd)
    bad["b_zeros"] = bad["b_zeros"].float()
    with pytest.raises(RuntimeError, match=r"b_zeros: dtype torch.float32, expected torch.float16"):
        MarlinLinear24(256, 128, group_size=64, zero_points=True).load_state_dict(bad)
    # a dense zero-point MarlinLinear is still not a 2:4 layer
    dense = marlin.MarlinLinear.from_linear(nn.Linear(256, 128).half(), 64, sym=False).state_dict()
    with pytest.raises(RuntimeError, match=r"holds a dense MarlinLinear"):
        MarlinLinear24(256, 128, group_size=64, zero_points=True).load_state_dict(dense)


def test_replace_linear_2_4_with_zero_points():
    torch.manual_seed(8)
    model = Block().half()
    report = marlin.replace_linear(model, sparsity="2:4", sym=False)
    assert report.replaced == ["up", "down"] and model.up.zero_points and model.down.zero_points
    assert model(torch.randn(2, 256).half()).dtype == torch.float16
    assert replace_linear_2_4(Block().half(), 32, sym=False).replaced == ["up", "down"]
    with pytest.raises(ValueError, match=r"sparsity='2:4' with bits = 8; the 2:4 format holds 4-bit weights only"):
        marlin.replace_linear(Block().half(), sparsity="2:4", bits=8)
    with pytest.raises(ValueError, match=r"sparsity='2:4' with bits = 8; the 2:4 format holds 4-bit weights only"):
        MarlinLinear.from_linear(nn.Linear(128, 128), sparsity="2:4", bits=8)


def test_bf16_layer_from_a_bf16_linear():
    """A bf16 Linear gives a bf16 2:4 layer (scales, bias, output); its input must be bf16; its
    state_dict does not load into an fp16 layer, nor an fp16 one into it."""
    torch.manual_seed(3)
    lin = nn.Linear(256, 384).bfloat16()
    layer = MarlinLinear.from_linear(lin, sparsity="2:4")
    assert isinstance(layer, MarlinLinear24) and layer.dtype == torch.bfloat16
    assert layer.b_scales.dtype == layer.bias.dtype == torch.bfloat16 and "dtype=torch.bfloat16" in repr(layer)
    x = torch.randn(5, 256).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    ref = reference(layer, x)
    assert rel_err(y, ref) < 4e-3 and rel_err(y.double() * 1.02, ref) > 1.2e-2
    with pytest.raises(TypeError, match=r"input dtype is torch.float16, expected torch.bfloat16"):
        layer(x.half())
    # explicit dtype wins over the weight's
    assert MarlinLinear24.from_linear(lin, dtype=torch.float16).b_scales.dtype == torch.float16
    with pytest.raises(RuntimeError, match=r"b_scales: dtype torch.bfloat16, expected torch.float16"):
        MarlinLinear24(256, 384).load_state_dict(layer.state_dict())
    fp16_sd = MarlinLinear24.from_linear(lin.half()).state_dict()
    with pytest.raises(RuntimeError, match=r"b_scales: dtype torch.float16, expected torch.bfloat16"):
        MarlinLinear24(256, 384, dtype=torch.bfloat16).load_state_dict(fp16_sd)
    fresh = MarlinLinear24(256, 384, dtype=torch.bfloat16)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh(x), y)
    # a bf16 model through replace_linear_2_4: bf16 layers
    model = Block().bfloat16()
    replace_linear_2_4(model)
    assert model.up.dtype == model.down.dtype == torch.bfloat16
    assert model(torch.randn(2, 256).bfloat16()).dtype == torch.bfloat16


def test_to_keeps_fp16_and_workspace():
    layer = MarlinLinear24.from_linear(nn.Linear(128, 128).half())
    ws = layer.workspace
    layer.float()
    assert layer.b_scales.dtype == torch.float16 and layer.workspace is ws


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(256, 512)
        self.odd = nn.Linear(512, 200)  # 200 outputs: not whole 64-column tiles, kept
        self.down = nn.Linear(512, 256)
        self.lm_head = nn.Linear(256, 256)

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.lm_head(self.down(h)) + self.odd(h)[..., :1]


def test_replace_linear_2_4_report_and_logging(caplog):
    torch.manual_seed(3)
    model = Block().half()
    with caplog.at_level(logging.INFO, logger="marlin.sparse_nn"):
        report = marlin.replace_linear(model, sparsity="2:4")
    assert isinstance(report, SparseReplaceReport)
    assert report.replaced == ["up", "down"]
    assert [n for n, _ in report.skipped] == ["odd", "lm_head"]
    assert "out_features = 200, expected a positive multiple of 64" in dict(report.skipped)["odd"]
    assert set(report.pruned) == {"up", "down"} and all(0.35 < f < 0.55 for f in report.pruned.values())
    text = str(report)
    assert "up: pruning removed" in text and "% of the weight norm" in text and "kept odd" in text
    assert "pruning removed" in caplog.text and "kept odd" in caplog.text
    assert isinstance(model.up, MarlinLinear24) and isinstance(model.odd, nn.Linear)
    with pytest.raises(ValueError, match=r"cannot replace odd"):
        replace_linear_2_4(Block().half(), strict=True)
    with pytest.raises(ValueError, match=r"sparsity = 'dense'"):
        marlin.replace_linear(Block(), sparsity="dense")
    # groups of 32 (and 64) rows replace the same layers; other group sizes are refused up front
    model = Block().half()
    assert replace_linear_2_4(model, 32).replaced == ["up", "down"] and model.up.group_size == 32
    with pytest.raises(ValueError, match=r"group_size = 16, expected 128, 64, 32 or -1 \(per column\)"):
        replace_linear_2_4(Block().half(), 16)


def test_torch_compile_fullgraph_aot_eager():
    torch.manual_seed(4)
    layer = MarlinLinear24.from_linear(nn.Linear(256, 256).half())
    x = torch.randn(3, 256).half()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), layer(x))


def test_replace_linear_2_4_llama_forward():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    fp32 = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    model = copy.deepcopy(fp32).half()
    report = marlin.replace_linear(model, sparsity="2:4")
    assert len(report.replaced) == 2 * 7 and len(report.pruned) == 2 * 7
    ref = copy.deepcopy(fp32).float()
    with torch.no_grad():
        for _, p in ref.named_parameters():
            p.copy_(p.half().float())
        for name, module in model.named_modules():
            if isinstance(module, MarlinLinear24):
                ref.get_submodule(name).weight.copy_(module.dequantized_weight())
    ids = torch.randint(0, 1000, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref(ids).logits) < MODEL_TOL


@requires_cuda_2_4
@pytest.mark.parametrize("out_features", [384, 320], ids=["n384", "n320"])  # 320: the 64-column tile
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "zp"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_forward_matches_cpu_op(dtype, sym, out_features):
    torch.manual_seed(5)
    layer = MarlinLinear24.from_linear(nn.Linear(512, out_features).to(dtype), sym=sym)
    assert layer.zero_points == (not sym)
    x = torch.randn(7, 512).to(dtype)
    y_cpu = layer(x)
    layer.cuda()
    assert layer.workspace.is_cuda and int(layer.workspace.abs().sum()) == 0
    y = layer(x.cuda()).cpu()
    assert y.dtype == dtype and rel_err(y, y_cpu) < (LAYER_TOL if dtype == torch.float16 else 8e-3)

