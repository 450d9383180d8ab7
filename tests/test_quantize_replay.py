"""The replay cache (marlin.quantize.replay) and the one-pass full-precision reference
(marlin.quantize.runner): they make quantization faster and must never change its result.
CPU only; the model tests use the tiny random Llama of quantize_fixtures.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from marlin.quantize import HessianAccumulator  # noqa: E402
from marlin.quantize.replay import ReplayCache  # noqa: E402


class _Counting(nn.Module):
    """y = x W^T + extra; counts its real calls."""

    def __init__(self, k: int = 8):
        super().__init__()
        self.lin = nn.Linear(k, k, bias=False)
        self.calls = 0

    def forward(self, x, extra=0.0):
        self.calls += 1
        return self.lin(x) + extra


class _Opaque:
    """An argument of a type the cache does not compare (it acts as 0 in a sum)."""

    def __radd__(self, other):
        return other


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _Counting()
        self.b = _Counting()

    def forward(self, x, extra=0.0):
        return self.b(self.a(x, extra))


def _net():
    torch.manual_seed(0)
    return _Two().eval()


@torch.no_grad()
def _passes(net, x, cache, n=2, **kwargs):
    outs = []
    with cache.installed(net):
        for _ in range(n):
            cache.begin(0)
            outs.append(net(x, **kwargs))
    return outs


def test_unchanged_module_is_not_run_again_and_gives_the_same_tensor():
    net, cache, x = _net(), ReplayCache(), torch.randn(3, 8)
    first, second = _passes(net, x, cache)
    assert net.a.calls == 1 and net.b.calls == 1  # the second pass reused both
    assert second is first and cache.hits == 2
    assert "forward" not in net.a.__dict__  # the patch is gone after the context


def test_changed_weight_reruns_the_module_and_what_reads_it():
    net, cache, x = _net(), ReplayCache(), torch.randn(3, 8)
    with torch.no_grad(), cache.installed(net):
        cache.begin(0)
        net(x)
        net.a.lin.weight.mul_(0.5)  # an in-place change, as the quantizer's weight.copy_
        cache.begin(0)
        got = net(x)
    assert net.a.calls == 2 and net.b.calls == 2  # b's input changed with a's weight
    fresh = copy.deepcopy(net)
    with torch.no_grad():
        assert torch.equal(got, fresh(x))


def test_equal_input_in_a_new_tensor_is_reused_but_not_a_different_one():
    net, cache = _net(), ReplayCache()
    x = torch.randn(3, 8)
    with torch.no_grad(), cache.installed(net):
        for inp in (x, x.clone(), x + 1e-7):
            cache.begin(0)
            net(inp)
    assert net.a.calls == 2  # x and its clone once; x + 1e-7 again
    zeros = torch.zeros(3, 8)
    net2, cache2 = _net(), ReplayCache()
    with torch.no_grad(), cache2.installed(net2):
        for inp in (zeros, -zeros):  # equal as numbers, not bit for bit
            cache2.begin(0)
            net2(inp)
    assert net2.a.calls == 2


def test_scalar_arguments_must_match_in_type_and_bits():
    net, cache, x = _net(), ReplayCache(), torch.randn(3, 8)
    with torch.no_grad(), cache.installed(net):
        for extra in (1.0, 1.0, 1, -0.0, 0.0):
            cache.begin(0)
            net(x, extra=extra)
    assert net.a.calls == 4  # 1.0 reused once; 1 (int), -0.0 and 0.0 differ


def test_samples_and_repeated_calls_have_their_own_entries():
    net, cache = _net(), ReplayCache()
    xs = [torch.randn(3, 8), torch.randn(3, 8)]
    with torch.no_grad(), cache.installed(net):
        outs = []
        for _ in range(2):
            for i, x in enumerate(xs):
                cache.begin(i)
                outs.append(net(x))
    assert net.a.calls == 2 and outs[2] is outs[0] and outs[3] is outs[1]
    cache.drop(0)
    with torch.no_grad(), cache.installed(net):
        cache.begin(0)
        net(xs[0])
    assert net.a.calls == 3


def test_hooked_training_and_unsupported_calls_always_run():
    net, cache, x = _net(), ReplayCache(), torch.randn(3, 8)
    seen = []
    handle = net.b.lin.register_forward_pre_hook(lambda _m, inp: seen.append(inp[0]))
    try:
        _passes(net, x, cache)
    finally:
        handle.remove()
    assert len(seen) == 2 and net.b.calls == 2 and net.a.calls == 1  # b holds a hooked layer
    net2, cache2 = _net(), ReplayCache()
    net2.a.train()
    _passes(net2, x, cache2)
    assert net2.a.calls == 2 and net2.b.calls == 1
    net3, cache3 = _net(), ReplayCache()
    _passes(net3, x, cache3, extra=_Opaque())  # an argument the cache cannot compare
    assert net3.a.calls == 2


def test_a_modified_output_is_not_handed_out_again():
    net, cache, x = _net(), ReplayCache(), torch.randn(3, 8)
    with torch.no_grad(), cache.installed(net):
        cache.begin(0)
        out = net(x)
        out.add_(1.0)  # a caller changed the recorded tensor in place
        cache.begin(0)
        again = net(x)
    assert again is not out and net.b.calls == 2


def test_budget_caps_what_is_recorded():
    x = torch.randn(3, 8)
    net, cache = _net(), ReplayCache(max_bytes=0)
    _passes(net, x, cache)
    assert net.a.calls == 2 and cache.bytes == 0
    one = 3 * 8 * 4  # one output [3, 8] float32
    net, cache = _net(), ReplayCache(max_bytes=one)
    _passes(net, x, cache)
    assert cache.bytes == one and cache.hits == 1  # only the first output recorded (a.lin's), reused once
    with pytest.raises(ValueError, match="max_bytes"):
        ReplayCache(max_bytes=-1)


# --- on the tiny Llama: the runner's passes ------------------------------------------------------

transformers = pytest.importorskip("transformers")

from marlin.quantize import runner  # noqa: E402
from marlin.quantize.runner import QuantizeConfig, find_blocks, quantize_model  # noqa: E402

from quantize_fixtures import make_tiny, model_and_samples  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("replay"))


@pytest.mark.parametrize("true_sequential", [True, False])
def test_quantized_weights_do_not_depend_on_the_cache(tiny, monkeypatch, true_sequential):
    _, src, calib = tiny
    model, _, samples = model_and_samples(src, calib, nsamples=4)
    stats = []
    original = runner.ReplayCache.clear

    def counting_clear(self):
        stats.append((self.hits, self.misses))
        return original(self)

    monkeypatch.setattr(runner.ReplayCache, "clear", counting_clear)
    config = QuantizeConfig(group_size=64, act_order=True, sym=False, true_sequential=true_sequential)
    cached = quantize_model(copy.deepcopy(model), samples, config, progress=False)[0]
    assert all(hits > 0 for hits, _ in stats)  # the cache was used in every block
    plain = quantize_model(copy.deepcopy(model), samples, config, progress=False, replay_budget_mb=0)[0]
    assert cached.keys() == plain.keys()
    for name in cached:
        for field in ("q", "scales", "zeros", "perm"):
            assert torch.equal(getattr(cached[name], field), getattr(plain[name], field)), (name, field)


def test_reference_pass_gives_the_cross_terms_of_the_full_precision_inputs(tiny):
    _, src, calib = tiny
    model, _, samples = model_and_samples(src, calib, nsamples=3)
    prefix, blocks = find_blocks(model)
    calls = runner._capture_block_inputs(model, prefix, blocks, samples, torch.device("cpu"))
    hidden = [args[0] for args, _ in calls]
    block_fp = blocks[0]
    block = copy.deepcopy(block_fp)
    with torch.no_grad():
        block.self_attn.q_proj.weight.mul_(0.9)  # the "quantized" block differs before o_proj
    names = {"b.self_attn.o_proj": "self_attn.o_proj", "b.mlp.down_proj": "mlp.down_proj"}
    outputs, ref_inputs = runner._reference_pass(block_fp, hidden, calls, names)
    assert all(torch.equal(o, e) for o, e in zip(outputs, runner._run_block(block_fp, hidden, calls)))
    layers = {n: block.get_submodule(local) for n, local in names.items()}
    accs = runner._collect_hessians(block, hidden, calls, layers, "cpu", ref_inputs=ref_inputs, cache=ReplayCache())[0]
    for name, local in names.items():
        xq, xf = [], []

        def rows(store):
            return lambda _m, inp: store.append(inp[0].reshape(-1, inp[0].shape[-1]))

        hq = block.get_submodule(local).register_forward_pre_hook(rows(xq))
        hf = block_fp.get_submodule(local).register_forward_pre_hook(rows(xf))
        try:
            runner._run_block(block, hidden, calls)
            runner._run_block(block_fp, hidden, calls)
        finally:
            hq.remove()
            hf.remove()
        xq, xf = torch.cat(xq).double(), torch.cat(xf).double()
        expected = 2 / xq.shape[0] * xq.t() @ xf
        assert torch.allclose(accs[name].cross.double(), expected, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(xq, xf, rtol=1e-3, atol=1e-4)  # the two streams differ, so the check can fail


def test_columnwise_objective_is_the_diagonal_weighting():
    from marlin.quantize.clip import weighted_error
    from marlin.quantize.gptq import gptq_quantize, resolve_clip_objective

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16, 32, generator=gen)
    d = torch.rand(32, generator=gen) + 0.1
    scale = w.abs().amax(dim=1) / 7
    assert torch.allclose(weighted_error(w, scale, d), weighted_error(w, scale, torch.diag(d)), rtol=1e-5)
    assert resolve_clip_objective("auto", -1) == "columnwise"
    assert resolve_clip_objective("auto", 64) == "compensated"
    with pytest.raises(ValueError, match="clip_objective = 'other'"):
        resolve_clip_objective("other", 64)
    # correlated inputs, per column: the objective changes the chosen scales and GPTQ's error
    x = torch.randn(2048, 32, generator=gen) @ torch.randn(32, 32, generator=gen)
    acc = HessianAccumulator(32)
    acc.add(x)
    col = gptq_quantize(w, acc.h, -1, clip=True, clip_objective="columnwise")
    comp = gptq_quantize(w, acc.h, -1, clip=True, clip_objective="compensated")
    auto = gptq_quantize(w, acc.h, -1, clip=True, clip_objective="auto")
    assert torch.equal(auto.q, col.q) and torch.equal(auto.scales, col.scales)
    assert not torch.equal(col.scales, comp.scales)
