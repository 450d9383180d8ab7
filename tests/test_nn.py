"""MarlinLinear and replace_linear: accuracy, state_dict, errors, torch.compile, CUDA graphs.

Tolerances (normwise relative error ||y - ref|| / ||ref||):
  * one layer vs x @ B in fp32 with the same dequantized B: the op sums in fp32 and rounds the
    output once to fp16 (<= 2^-11 ~ 4.9e-4 relative per element), the fp16 bias add rounds once
    more: 1e-3 is about two roundings;
  * a whole model vs the same model in fp32 with the dequantized weights: every activation of
    the Marlin model is rounded to fp16 (embeddings, norms, attention, MLP, residuals), a few
    dozen roundings of ~3e-4 each that partly average out: 1e-2 holds with margin, while a
    wrong layout or permutation gives errors of order 1.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from torch import nn

import marlin
from marlin import packing
from marlin.nn import MarlinLinear, ReplaceReport, replace_linear

from conftest import tiny_llama_config

from gptq_writer import random_layer

LAYER_TOL = 1e-3
MODEL_TOL = 1e-2
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def dequantized_weight(layer: MarlinLinear) -> torch.Tensor:
    """B [K, N] fp32 of a MarlinLinear, in the order of the *original* input features."""
    zeros = None if layer.b_zeros is None else layer.b_zeros.cpu()
    b = packing.dequantize(*packing.unpack(layer.b_q.cpu(), layer.b_scales.cpu(), zeros, bits=layer.bits))
    if layer.perm is not None:  # row i of B belongs to input feature perm[i]
        out = torch.empty_like(b)
        out[layer.perm.cpu().long()] = b
        b = out
    return b


def reference(layer: MarlinLinear, x: torch.Tensor) -> torch.Tensor:
    y = x.cpu().float() @ dequantized_weight(layer)
    return y + layer.bias.cpu().float() if layer.bias is not None else y


def gptq_module(act_order: bool, group_size: int = 128, bias: bool = True, fmt: str = "gptq"):
    layer = random_layer(256, 384, group_size, seed=7, act_order=act_order, bias=bias)
    t = layer.tensors(fmt)
    module = MarlinLinear.from_gptq(
        t["qweight"], t["qzeros"], t["scales"], t["g_idx"], t.get("bias"), group_size=group_size, checkpoint_format=fmt
    )
    return module, layer


# -- construction and forward -------------------------------------------------------------------
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("bias", [True, False])
def test_from_linear_accuracy(group_size, bias):
    torch.manual_seed(0)
    linear = nn.Linear(384, 256, bias=bias)
    layer = MarlinLinear.from_linear(linear, group_size=group_size)
    x = torch.randn(5, 384).half()
    y = layer(x)
    assert y.dtype == torch.float16 and y.shape == (5, 256)
    assert rel_err(y, reference(layer, x)) < LAYER_TOL
    # and the quantized weights are close to the float ones (4-bit RTN: ~10% normwise)
    assert rel_err(dequantized_weight(layer).t(), linear.weight.detach()) < 0.15


def test_leading_dims():
    torch.manual_seed(1)
    layer = MarlinLinear.from_linear(nn.Linear(256, 128))
    x = torch.randn(2, 3, 256).half()
    y = layer(x)
    assert y.shape == (2, 3, 128)
    assert torch.equal(y, layer(x.reshape(6, 256)).reshape(2, 3, 128))
    assert layer(x[0, 0]).shape == (128,)
    assert layer(torch.empty(0, 4, 256, dtype=torch.float16)).shape == (0, 4, 128)


def test_new_layer_computes_zero_and_repr():
    layer = MarlinLinear(256, 128, bias=False, group_size=-1)
    assert torch.equal(layer(torch.randn(3, 256).half()), torch.zeros(3, 128, dtype=torch.float16))
    text = repr(layer)
    assert "in_features=256" in text and "out_features=128" in text and "group_size=-1" in text
    assert "act_order=False" in text and "bias=False" in text
    assert set(layer.state_dict()) == {"b_q", "b_scales"}  # workspace is not persistent


@pytest.mark.parametrize(
    "k, n, group_size, needle",
    [
        (100, 256, 128, "in_features = 100"),
        (256, 200, 128, "out_features = 200"),
        (256, 256, 48, "group_size = 48"),
        (0, 256, 128, "in_features = 0"),
    ],
)
def test_bad_shape_raises_valueerror_saying_what_works(k, n, group_size, needle):
    with pytest.raises(ValueError) as info:
        MarlinLinear(k, n, group_size=group_size)
    msg = str(info.value)
    assert needle in msg and "multiple of 64" in msg and "(-1: per column)" in msg


def test_dtype_errors():
    with pytest.raises(ValueError, match="dtype = torch.float32, expected torch.float16 or torch.bfloat16"):
        MarlinLinear(256, 128, dtype=torch.float32)
    layer = MarlinLinear(256, 128)
    with pytest.raises(TypeError, match="input dtype is torch.float32, expected torch.float16") as info:
        layer(torch.randn(2, 256))
    # a dtype the kernels cannot compute in is not offered as the layer's (it used to say dtype=torch.float32)
    assert "build the layer with" not in str(info.value) and "compute in torch.float16 or torch.bfloat16" in str(info.value)
    with pytest.raises(TypeError, match="input dtype is torch.bfloat16, expected torch.float16") as info:
        layer(torch.randn(2, 256).bfloat16())
    assert "model.to(torch.float16), or build the layer with dtype=torch.bfloat16" in str(info.value)
    bf = MarlinLinear(256, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="input dtype is torch.float16, expected torch.bfloat16"):
        bf(torch.randn(2, 256).half())
    with pytest.raises(ValueError, match=r"bits = 3, expected one of \(4, 8\)"):
        MarlinLinear(256, 128, bits=3)
    with pytest.raises(ValueError, match="zero points exist for 4-bit weights only"):
        MarlinLinear(256, 128, bits=8, zero_points=True)
    with pytest.raises(ValueError, match=r"expected \[\.\.\., 256\]"):
        layer(torch.randn(2, 128).half())


def test_to_keeps_fp16_and_recreates_workspace():
    layer = MarlinLinear.from_linear(nn.Linear(256, 128))
    scales = layer.b_scales.clone()
    layer.to(torch.bfloat16)
    layer.float()
    assert layer.b_scales.dtype == torch.float16 and torch.equal(layer.b_scales, scales)
    assert layer.bias.dtype == torch.float16
    ws = layer.workspace
    layer.to("cpu")  # nothing changes: the same workspace (CUDA graphs may point at it)
    assert layer.workspace is ws
    meta = MarlinLinear(256, 128, device="meta")
    meta.to_empty(device="cpu")  # re-allocated uninitialized memory: the workspace must be zeroed again
    assert meta.workspace.device.type == "cpu" and int(meta.workspace.abs().sum()) == 0


# -- GPTQ tensors -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [128, -1])
def test_from_gptq_matches_gptq_formula(fmt, act_order, group_size):
    module, layer = gptq_module(act_order, group_size, fmt=fmt)
    w = layer.dequantize()  # [K, N] fp32, natural order of input features
    assert torch.equal(dequantized_weight(module), w)  # exact: same fp16 scales, same integers
    assert (module.perm is not None) == (act_order and group_size != -1)
    x = torch.randn(4, 256).half()
    ref = x.float() @ w + torch.from_numpy(layer.bias).float()
    assert rel_err(module(x), ref) < LAYER_TOL


def test_from_gptq_refuses_unsupported():
    layer = random_layer(256, 128, 128, seed=3, sym=False)
    t = layer.tensors("gptq_v2")
    with pytest.raises(ValueError, match="the config says sym = true, but"):
        MarlinLinear.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], sym=True, checkpoint_format="gptq_v2")
    with pytest.raises(ValueError, match=r"K = in_features = 32, .* expected a positive multiple of 64"):
        MarlinLinear.from_gptq(t["qweight"][:8], t["qzeros"], t["scales"], t["g_idx"], bits=8)
    with pytest.raises(ValueError, match="bits = 3"):
        MarlinLinear.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits=3)


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("group_size", [32, 64, -1])
@pytest.mark.parametrize("act_order", [False, True])
def test_from_gptq_asymmetric(fmt, group_size, act_order):
    layer = random_layer(256, 192, group_size, seed=11, sym=False, act_order=act_order)
    layer.zeros[layer.zeros == 0] = 1  # v1 cannot store a zero of 0 (see test_gptq_v1_zero_of_zero_is_refused)
    t = layer.tensors(fmt)
    module = MarlinLinear.from_gptq(
        t["qweight"], t["qzeros"], t["scales"], t["g_idx"], t["bias"], group_size=group_size, checkpoint_format=fmt
    )
    assert module.zero_points and module.bits == 4 and module.b_zeros.dtype == torch.float16
    w = layer.dequantize()
    assert torch.equal(dequantized_weight(module), w)
    x = torch.randn(5, 256).half()
    assert rel_err(module(x), x.float() @ w + torch.from_numpy(layer.bias).float()) < LAYER_TOL


def test_gptq_v1_zero_of_zero_is_refused():
    layer = random_layer(256, 128, 128, seed=12, sym=False)
    layer.zeros[0, 3] = 0
    t = layer.tensors("gptq")
    with pytest.raises(ValueError, match=r"zero point 16 at group 0, column 3 is outside \[0, 15\]"):
        MarlinLinear.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], checkpoint_format="gptq")


# -- formats: dtype, bits, zero points, groups -------------------------------------------------------
FORMATS = [(4, True), (4, False), (8, True)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,sym", FORMATS)
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_from_linear_every_format(dtype, bits, sym, group_size):
    torch.manual_seed(group_size + bits)
    linear = nn.Linear(256, 192).to(dtype)
    layer = MarlinLinear.from_linear(linear, group_size, bits=bits, sym=sym)
    assert layer.b_scales.dtype == dtype and layer.bias.dtype == dtype and layer.dtype == dtype
    assert layer.zero_points == (not sym) and layer.b_q.shape == (16, bits // 2 * 192)
    x = torch.randn(3, 5, 256).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (3, 5, 192)
    assert rel_err(y, reference(layer, x)) < (LAYER_TOL if dtype == torch.float16 else 8e-3)
    # the quantization is as good as its format: 8 bits ~16x closer to the float layer than 4 bits
    exact = x.float() @ linear.weight.detach().float().t() + linear.bias.detach().float()
    assert rel_err(y, exact) < (0.02 if bits == 8 else 0.2)


def test_from_linear_fp32_gives_fp16_and_dtype_override():
    linear = nn.Linear(128, 64)
    assert MarlinLinear.from_linear(linear).dtype == torch.float16
    assert MarlinLinear.from_linear(linear, dtype=torch.bfloat16).b_scales.dtype == torch.bfloat16


@pytest.mark.parametrize("group_size", [32, 64])
def test_act_order_with_small_groups_and_zero_points(group_size):
    """A perm with zero points and groups of 32/64: x[..., perm] @ B equals the GPTQ formula."""
    layer = random_layer(256, 128, group_size, seed=13, sym=False, act_order=True)
    t = layer.tensors("gptq_v2")
    module = MarlinLinear.from_gptq(
        t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group_size=group_size, checkpoint_format="gptq_v2"
    )
    assert module.perm is not None and module.zero_points
    x = torch.randn(4, 256).half()
    ref = x.float() @ layer.dequantize()
    assert rel_err(module(x), ref) < LAYER_TOL
    module.perm = None  # the bound catches a missing permutation
    assert rel_err(module(x), ref) > 0.3


@pytest.mark.parametrize("bits,sym,dtype", [(4, False, torch.bfloat16), (8, True, torch.float16), (4, True, torch.bfloat16)])
def test_state_dict_round_trip_formats(bits, sym, dtype):
    linear = nn.Linear(128, 192).to(dtype)
    module = MarlinLinear.from_linear(linear, 64, bits=bits, sym=sym)
    state = module.state_dict()
    assert ("b_zeros" in state) == (not sym)
    fresh = MarlinLinear(128, 192, group_size=64, dtype=dtype, bits=bits, zero_points=not sym)
    fresh.load_state_dict(state)
    x = torch.randn(2, 128).to(dtype)
    assert torch.equal(fresh(x), module(x))


def test_state_dict_format_mismatch_errors():
    state = MarlinLinear.from_linear(nn.Linear(128, 192).bfloat16(), 64, sym=False).state_dict()
    with pytest.raises(RuntimeError, match="b_scales: dtype torch.bfloat16, but this layer computes in torch.float16"):
        MarlinLinear(128, 192, group_size=64, zero_points=True).load_state_dict(state)
    with pytest.raises(RuntimeError, match="the checkpoint has zero points, but this layer was built with zero_points=False"):
        MarlinLinear(128, 192, group_size=64, dtype=torch.bfloat16).load_state_dict(state)
    state8 = MarlinLinear.from_linear(nn.Linear(128, 192).half(), 64, bits=8).state_dict()
    with pytest.raises(RuntimeError, match=r"b_q: width 768 \(8-bit weights\), but this layer was built with bits=4"):
        MarlinLinear(128, 192, group_size=64).load_state_dict(state8)
    sym_state = MarlinLinear.from_linear(nn.Linear(128, 192).half(), 64).state_dict()
    with pytest.raises(RuntimeError, match="the checkpoint has no zero points, but this layer was built with zero_points=True"):
        MarlinLinear(128, 192, group_size=64, zero_points=True).load_state_dict(sym_state)
    # a partial load that does not hold the layer (load_sharded's state of the layers it did not
    # shard itself) checks nothing of it
    parent = nn.Sequential(MarlinLinear(128, 192, group_size=64, zero_points=True), nn.Linear(4, 4))
    missing, unexpected = parent.load_state_dict({"1.weight": torch.zeros(4, 4), "1.bias": torch.zeros(4)}, strict=False)
    assert "0.b_q" in missing and not unexpected


def test_version_1_state_dict_loads():
    """A state dict written by marlin before the formats (version 1: fp16, 4-bit symmetric) loads unchanged."""
    module = MarlinLinear.from_linear(nn.Linear(256, 128).half())
    state = module.state_dict()
    state._metadata[""]["version"] = 1
    assert set(state) == {"b_q", "b_scales", "bias"}  # version 1 had exactly these keys (perm with act-order)
    old = MarlinLinear(256, 128)
    old.load_state_dict(state)
    x = torch.randn(3, 256).half()
    assert torch.equal(old(x), module(x))
    with pytest.raises(RuntimeError, match="dtype torch.float16, but this layer computes in torch.bfloat16"):
        MarlinLinear(256, 128, dtype=torch.bfloat16).load_state_dict(state)


def test_replace_linear_formats():
    model = nn.Sequential(nn.Linear(192, 576), nn.ReLU(), nn.Linear(576, 192)).bfloat16()
    x = torch.randn(2, 192).bfloat16()
    ref = model(x).float()
    report = replace_linear(model, group_size=64, bits=8, exclude=None)
    assert report.replaced == ["0", "2"]
    assert all(m.bits == 8 and m.dtype == torch.bfloat16 for m in (model[0], model[2]))
    assert rel_err(model(x), ref) < 0.03
    with pytest.raises(ValueError, match="zero points exist for 4-bit weights only"):
        replace_linear(model, bits=8, sym=False)


# -- state_dict ---------------------------------------------------------------------------------
@pytest.mark.parametrize("act_order", [False, True])
def test_state_dict_round_trip(act_order, tmp_path):
    from safetensors.torch import load_file, save_file

    module, _ = gptq_module(act_order)
    x = torch.randn(3, 256).half()
    state = module.state_dict()
    assert state._metadata[""]["version"] == MarlinLinear._version
    assert ("perm" in state) == act_order

    fresh = MarlinLinear(256, 384, bias=True)  # built without act_order: adopts the checkpoint's perm
    fresh.load_state_dict(state)
    assert torch.equal(fresh(x), module(x))

    save_file(dict(state), str(tmp_path / "layer.safetensors"))  # no metadata: treated as the current version
    again = MarlinLinear(256, 384, bias=True, act_order=act_order)
    again.load_state_dict(load_file(str(tmp_path / "layer.safetensors")))
    assert torch.equal(again(x), module(x))


def test_state_dict_errors():
    module, _ = gptq_module(act_order=True)
    state = module.state_dict()
    newer = copy.copy(state)
    newer._metadata = {"": {"version": MarlinLinear._version + 1}}
    with pytest.raises(RuntimeError, match="newer marlin"):
        MarlinLinear(256, 384).load_state_dict(newer)
    with pytest.raises(RuntimeError, match="group size -1"):
        MarlinLinear(256, 384).load_state_dict(MarlinLinear(256, 384, group_size=-1).state_dict())
    bad = dict(state, perm=torch.zeros(256, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="not a permutation"):
        MarlinLinear(256, 384).load_state_dict(bad)
    with pytest.raises(RuntimeError, match="Missing key.*perm"):
        MarlinLinear(256, 384, act_order=True).load_state_dict({k: v for k, v in state.items() if k != "perm"})


# -- torch.compile --------------------------------------------------------------------------------
class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = MarlinLinear.from_linear(nn.Linear(256, 512))
        self.down, _ = gptq_module(act_order=True)  # 256 -> 384 with a perm
        self.out = MarlinLinear.from_linear(nn.Linear(384, 128, bias=False), group_size=-1)

    def forward(self, x):
        return self.out(torch.relu(self.down(x)) + self.up(x)[..., :384])


def test_torch_compile_fullgraph_aot_eager():
    torch.manual_seed(2)
    model = TwoLayers()
    x = torch.randn(2, 5, 256).half()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), model(x))


@pytest.mark.slow
def test_torch_compile_fullgraph_inductor_cpu():
    # Inductor builds C++ on the CPU (~15 s the first time), hence "slow"; aot_eager above covers
    # the tracing itself (fake kernel, no graph breaks).
    torch.manual_seed(3)
    model = TwoLayers()
    x = torch.randn(3, 256).half()
    compiled = torch.compile(model, fullgraph=True)
    # Inductor fuses relu + add and computes them in fp32 before one rounding: not bit-identical.
    assert rel_err(compiled(x), model(x)) < LAYER_TOL


# -- replace_linear -------------------------------------------------------------------------------
class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(256, 256)
        self.odd = nn.Linear(100, 256)  # the kernel cannot take K = 100
        self.attn = nn.MultiheadAttention(256, 4)  # out_proj is a subclass of nn.Linear
        self.block = nn.ModuleDict({"mlp_up": nn.Linear(256, 512), "mlp_down": nn.Linear(512, 256)})
        self.lm_head = nn.Linear(256, 1024)


def test_replace_linear_report_and_logging(caplog):
    model = Mixed().half()
    with caplog.at_level(logging.INFO, logger="marlin.nn"):
        report = replace_linear(model)
    assert isinstance(report, ReplaceReport)
    assert sorted(report.replaced) == ["block.mlp_down", "block.mlp_up", "proj"]
    skipped = dict(report.skipped)
    assert "in_features = 100" in skipped["odd"]
    assert "subclass" in skipped["attn.out_proj"]
    assert "excluded by pattern 'lm_head'" in skipped["lm_head"]
    assert isinstance(model.proj, MarlinLinear) and isinstance(model.odd, nn.Linear)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("odd" in r.getMessage() for r in warned)
    assert not any("lm_head" in r.getMessage() for r in warned)  # an exclusion is expected: INFO only
    assert "kept odd" in str(report)


def test_replace_linear_patterns_and_strict():
    model = Mixed().half()
    report = replace_linear(model, include="block.*", exclude=None)
    assert sorted(report.replaced) == ["block.mlp_down", "block.mlp_up"]
    model = Mixed().half()
    report = replace_linear(model, exclude=("lm_head", "mlp_"), include=None)
    assert report.replaced == ["proj"]
    with pytest.raises(ValueError, match="cannot replace odd"):
        replace_linear(Mixed().half(), strict=True)
    with pytest.raises(ValueError, match=r"group_size = 48, expected one of \(32, 64, 128, -1\)"):
        replace_linear(Mixed().half(), group_size=48)


def test_replace_linear_shared_module():
    shared = nn.Linear(256, 256).half()
    model = nn.Sequential(shared, nn.ReLU(), shared)
    report = replace_linear(model)
    assert model[0] is model[2] and isinstance(model[0], MarlinLinear)
    assert sorted(report.replaced) == ["0", "2"]


def tiny_llama(tie: bool = False):
    transformers = pytest.importorskip("transformers")
    config = tiny_llama_config(tie)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def dequantized_reference(model_fp32: nn.Module, marlin_model: nn.Module) -> nn.Module:
    """model_fp32 with every weight replaced by what the Marlin model computes with, in fp32."""
    ref = copy.deepcopy(model_fp32).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(p.half().float())  # the Marlin model holds the other weights in fp16
        for name, module in marlin_model.named_modules():
            if isinstance(module, MarlinLinear):
                ref.get_submodule(name).weight.copy_(dequantized_weight(module).t())
    return ref


def assert_greedy_close(marlin_model, ref, ids, steps=4, tol=1e-2):
    """Greedy tokens of the Marlin model, each within ``tol`` (relative to the logit scale) of the
    best reference logit: identical tokens would be fragile when two logits nearly tie."""
    out = marlin_model.generate(ids, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    assert out.shape == (ids.shape[0], ids.shape[1] + steps)
    with torch.no_grad():
        logits = ref(out).logits[:, ids.shape[1] - 1 : -1]  # the reference's view of each chosen token
    chosen = logits.gather(-1, out[:, ids.shape[1] :, None]).squeeze(-1)
    best = logits.max(-1).values
    scale = logits.abs().amax(-1)
    # Where the reference's best token leads the runner-up by more than tol, this forces the same token.
    assert bool(((best - chosen) <= tol * scale).all()), (best - chosen) / scale


def test_replace_linear_llama_forward_and_generate():
    fp32 = tiny_llama()
    model = copy.deepcopy(fp32).half()
    report = replace_linear(model)
    assert len(report.replaced) == 2 * 7 and [n for n, _ in report.skipped] == ["lm_head"]
    ref = dequantized_reference(fp32, model)
    ids = torch.randint(0, 1000, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.float16
    with torch.no_grad():
        assert rel_err(logits, ref(ids).logits) < MODEL_TOL
    assert_greedy_close(model, ref, ids[:1])


# -- CUDA (run on the GPU machine) ----------------------------------------------------------------
@cuda_only
def test_cuda_forward_matches_cpu_op():
    torch.manual_seed(4)
    model = TwoLayers()
    x = torch.randn(7, 256).half()
    y_cpu = model(x)
    model.cuda()
    # .cuda() replaced the 1-element CPU workspace by a zeroed one of the kernel's size
    assert model.up.workspace.is_cuda and model.up.workspace.numel() == marlin.ops.workspace_size()
    assert int(model.up.workspace.abs().sum()) == 0
    y = model(x.cuda())
    assert rel_err(y.cpu(), y_cpu) < LAYER_TOL


@cuda_only
def test_cuda_graph_capture():
    torch.manual_seed(5)
    model = TwoLayers().cuda()
    static_x = torch.randn(4, 256, device="cuda").half()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(static_x)  # warm up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
    for seed in range(3):
        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(seed)).half()
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, model(x.cuda()))


@cuda_only
def test_cuda_torch_compile_inductor():
    torch.manual_seed(6)
    model = TwoLayers().cuda()
    x = torch.randn(3, 5, 256, device="cuda").half()
    compiled = torch.compile(model, fullgraph=True)
    assert rel_err(compiled(x), model(x)) < LAYER_TOL
    cudagraphs = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        out = cudagraphs(x)
    assert rel_err(out, model(x)) < LAYER_TOL


@cuda_only
def test_cuda_llama_matches_reference():
    fp32 = tiny_llama()
    model = copy.deepcopy(fp32).half()
    replace_linear(model)
    ref = dequantized_reference(fp32, model)
    model.cuda()
    ids = torch.randint(0, 1000, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(ids.cuda()).logits.cpu(), ref(ids).logits) < MODEL_TOL
