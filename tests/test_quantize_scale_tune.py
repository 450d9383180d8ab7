"""Tuning a quantized block's scales against the full-precision block (marlin.quantize.scale_tune),
on the tiny random Llama and random layers (CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from marlin.quantize import gptq_quantize, runner  # noqa: E402
from marlin.quantize.hessian import HessianAccumulator  # noqa: E402
from marlin.quantize.runner import QuantizeConfig, find_blocks, quantize_model  # noqa: E402
from marlin.quantize.scale_tune import ScaleTuning, _unit_weight, tune_block_scales  # noqa: E402

from quantize_fixtures import make_tiny, model_and_samples  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("scale_tune"))


@pytest.mark.parametrize("group_size, act_order", [(-1, True), (32, True), (32, False)])
def test_unit_weight_times_the_scales_is_the_dequantized_weight(group_size, act_order):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 128, generator=gen)
    x = torch.randn(400, 128, generator=gen) * torch.linspace(0.2, 3, 128)
    acc = HessianAccumulator(128)
    acc.add(x)
    res = gptq_quantize(w, acc.h, group_size, act_order=act_order, sym=False, clip=True)
    unit, group = _unit_weight(res)
    scales = res.scales.float().t()  # [N, groups]
    assert torch.equal(unit * scales[:, group], res.dequantized())


def _quantized_block0(tiny, tune_steps: int):
    _, src, calib = tiny
    model, _, samples = model_and_samples(src, calib, nsamples=8)
    reference = copy.deepcopy(model)
    # lr 1e-2 overshoots on this model (the guard then keeps GPTQ's scales); 3e-3 finds a lower error
    config = QuantizeConfig(group_size=-1, act_order=True, sym=False, tune_steps=tune_steps, tune_batch=4, tune_lr=3e-3)
    results, _ = quantize_model(model, samples, config, progress=False)
    return model, reference, samples, results


def test_tuning_moves_only_the_scales_and_lowers_the_block_error(tiny):
    _, src, calib = tiny
    model, _, samples = model_and_samples(src, calib, nsamples=8)
    prefix, blocks = find_blocks(model)
    calls = runner._capture_block_inputs(model, prefix, blocks, samples, torch.device("cpu"))
    hidden = [args[0] for args, _ in calls]
    block = blocks[0]
    fp_block = copy.deepcopy(block)
    with torch.no_grad():
        targets = runner._run_block(fp_block, hidden, calls)
        # a plain GPTQ of every Linear of the block, as the tuning would find it
        results, local = {}, {}
        for name, layer in block.named_modules():
            if isinstance(layer, torch.nn.Linear):
                acc = HessianAccumulator(layer.in_features)
                handle = layer.register_forward_pre_hook(lambda _m, inp, acc=acc: acc.add(inp[0]))
                runner._run_block(block, hidden, calls)
                handle.remove()
                res = gptq_quantize(layer.weight, acc.h, -1, act_order=True, sym=False, clip=True)
                results[name], local[name] = res, name
        for name, res in results.items():
            block.get_submodule(name).weight.copy_(res.dequantized())
    weights_before = {n: p.clone() for n, p in block.named_parameters()}
    scales, before, after = tune_block_scales(block, results, local, hidden, calls, targets, ScaleTuning(steps=6, batch=4))
    assert after < before  # the guard keeps only a lower error, and here the steps find one
    assert all(s.dtype == torch.float16 and s.shape == results[n].scales.shape for n, s in scales.items())
    assert any(not torch.equal(s, results[n].scales) for n, s in scales.items())
    assert all(torch.equal(p, weights_before[n]) for n, p in block.named_parameters())  # block left as it was
    # no steps: the scales as they were, nothing computed
    same, b0, a0 = tune_block_scales(block, results, local, hidden, calls, targets, ScaleTuning(steps=0))
    assert all(torch.equal(same[n], results[n].scales) for n in results)


def test_quantize_model_with_tuning_keeps_the_codes_of_block_0(tiny):
    """Block 0 sees the same inputs with and without tuning: the same codes and zero points,
    other scales; the layers hold the weights of the tuned scales."""
    model, _, _, tuned = _quantized_block0(tiny, tune_steps=8)
    _, _, _, plain = _quantized_block0(tiny, tune_steps=0)
    block0 = [n for n in plain if n.startswith("model.layers.0.")]
    assert block0
    for name in block0:
        assert torch.equal(tuned[name].q, plain[name].q)
        assert torch.equal(tuned[name].zeros, plain[name].zeros)
        assert torch.equal(model.get_submodule(name).weight, tuned[name].dequantized())
    assert any(not torch.equal(tuned[n].scales, plain[n].scales) for n in block0)


def test_bad_tuning_settings_are_value_errors():
    with pytest.raises(ValueError, match="steps"):
        ScaleTuning(steps=-1)
    with pytest.raises(ValueError, match="batch"):
        ScaleTuning(steps=2, batch=0)
    with pytest.raises(ValueError, match="learning rate"):
        ScaleTuning(steps=2, lr=0.0)
    with pytest.raises(ValueError, match="fp_target"):
        QuantizeConfig(tune_steps=4, fp_target=False)
    with pytest.raises(ValueError, match="one of each per sample"):
        tune_block_scales(torch.nn.Linear(2, 2), {}, {}, [torch.zeros(1)], [], [], ScaleTuning(steps=1))
