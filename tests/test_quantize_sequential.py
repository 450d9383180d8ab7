"""The order and targets inside a block (marlin.quantize.runner): true-sequential layer groups, the
early-stopping Hessian passes, the full-precision target, and the clip search's compensated
objective (marlin.quantize.gptq), on the tiny random Llama and small random layers (CPU).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from marlin.quantize import HessianAccumulator, gptq_quantize  # noqa: E402
from marlin.quantize import runner  # noqa: E402
from marlin.quantize.gptq import compensated_hessian  # noqa: E402
from marlin.quantize.runner import QuantizeConfig, find_blocks, quantize_model  # noqa: E402

from quantize_fixtures import make_tiny, model_and_samples  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("sequential"))


def _block0_inputs(model, samples):
    prefix, blocks = find_blocks(model)
    calls = runner._capture_block_inputs(model, prefix, blocks, samples, torch.device("cpu"))
    return blocks[0], [args[0] for args, _ in calls], calls


def _record_groups(monkeypatch) -> list:
    """Replace _quantize_group by a wrapper that records (layer names, H) of every call."""
    seen = []
    original = runner._quantize_group

    def recording(names, layers, h, *args, **kwargs):
        seen.append((list(names), h.clone()))
        return original(names, layers, h, *args, **kwargs)

    monkeypatch.setattr(runner, "_quantize_group", recording)
    return seen


def _hessian_of(block, hidden, calls, layer) -> torch.Tensor:
    acc = HessianAccumulator(layer.in_features)
    handle = layer.register_forward_pre_hook(lambda _m, inp: acc.add(inp[0]))
    try:
        runner._run_block(block, hidden, calls)
    finally:
        handle.remove()
    return acc.h


def test_stopped_pass_gives_the_full_pass_hessians(tiny):
    _, src, calib = tiny
    model, _, samples = model_and_samples(src, calib, nsamples=4)
    block, hidden, calls = _block0_inputs(model, samples)
    layers = {f"b.{n}": m for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    full, per_sample, order = runner._collect_hessians(block, hidden, calls, layers, "cpu")
    assert order == list(layers)  # Llama calls q, k, v, o, gate, up, down in module order
    assert set(per_sample.values()) == {1}
    o = {"b.self_attn.o_proj": layers["b.self_attn.o_proj"]}
    stopped = runner._collect_hessians(block, hidden, calls, o, "cpu", per_sample)[0]
    assert torch.equal(stopped["b.self_attn.o_proj"].h, full["b.self_attn.o_proj"].h)


@pytest.mark.parametrize("true_sequential", [True, False])
def test_each_group_sees_the_inputs_of_the_quantized_groups_before_it(tiny, monkeypatch, true_sequential):
    _, src, calib = tiny
    model, _, samples = model_and_samples(src, calib, nsamples=4)
    full = copy.deepcopy(model)
    block_fp, hidden, calls = _block0_inputs(full, samples)
    seen = _record_groups(monkeypatch)
    results, _ = quantize_model(
        model, samples, QuantizeConfig(group_size=64, true_sequential=true_sequential), progress=False
    )
    names = [names for names, _ in seen[:4]]  # block 0
    assert names == [
        ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"],
        ["model.layers.0.self_attn.o_proj"],
        ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"],
        ["model.layers.0.mlp.down_proj"],
    ]
    # The expected Hessian of each group: from block 0 with the groups before it quantized
    # (true-sequential) or from the full-precision block (all groups on the same pass).
    block = copy.deepcopy(block_fp)
    for group, (_, h) in zip(names, seen[:4]):
        expected = _hessian_of(block, hidden, calls, block.get_submodule(group[0][len("model.layers.0."):]))
        fp = _hessian_of(block_fp, hidden, calls, block_fp.get_submodule(group[0][len("model.layers.0."):]))
        assert torch.allclose(h, expected if true_sequential else fp, rtol=1e-5, atol=1e-6)
        if group[0].endswith(("o_proj", "down_proj")):  # and the difference matters, so the check can fail
            assert not torch.allclose(expected, fp, rtol=1e-3, atol=1e-4)
        for name in group:
            with torch.no_grad():
                block.get_submodule(name[len("model.layers.0."):]).weight.copy_(results[name].dequantized())


def test_fp_target_is_the_ridge_least_squares_weight():
    gen = torch.Generator().manual_seed(0)
    t, k, n = 600, 48, 20
    x_fp = torch.randn(t, k, generator=gen)
    x_q = x_fp + 0.1 * torch.randn(t, k, generator=gen)  # the quantized model's inputs drift
    w = torch.randn(n, k, generator=gen)
    acc = HessianAccumulator(k, cross=True)
    for a, b in zip(x_q.chunk(3), x_fp.chunk(3)):
        acc.add(a, b)
    damp = 0.01
    got = runner._fp_target(w, acc, damp)
    # float64: min ||X_q W'^T - X_fp W^T||^2 + lam ||W' - W||^2, lam = damp * mean(diag H) * T / 2
    xq, xf, wd = x_q.double(), x_fp.double(), w.double()
    lam = damp * float(torch.diag(2 / t * xq.t() @ xq).mean()) * t / 2
    d = torch.linalg.solve(xq.t() @ xq + lam * torch.eye(k, dtype=torch.float64), xq.t() @ (xf - xq) @ wd.t()).t()
    assert torch.allclose(got.double(), wd + d, rtol=1e-4, atol=1e-4)
    assert float((got - w).norm() / w.norm()) > 0.01  # it does move the weight
    # identical inputs: nothing to correct
    same = HessianAccumulator(k, cross=True)
    same.add(x_fp, x_fp)
    assert torch.allclose(runner._fp_target(w, same, damp), w, atol=1e-6)


def test_fp_target_brings_the_model_closer_to_full_precision(tiny):
    """On the calibration data (what it fits; 60% less logit error here), not on other text: a few
    hundred tokens of a 256-wide random model are too few to generalise from."""
    _, src, calib = tiny
    model, _, samples = model_and_samples(src, calib, nsamples=8)
    full = copy.deepcopy(model)

    def logit_error(fp_target: bool) -> float:
        net = copy.deepcopy(model)
        quantize_model(net, samples, QuantizeConfig(group_size=64, fp_target=fp_target), progress=False)
        err = ref_norm = 0.0
        with torch.no_grad():
            for ids in samples:
                ref = full(ids).logits.double()
                err += float((net(ids).logits.double() - ref).norm() ** 2)
                ref_norm += float(ref.norm() ** 2)
        return (err / ref_norm) ** 0.5

    plain, targeted = logit_error(False), logit_error(True)
    assert targeted < 0.7 * plain, (plain, targeted)


def test_compensated_hessian_is_the_schur_complement_of_the_later_columns():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(400, 40, generator=gen, dtype=torch.float64)
    h = x.t() @ x / 400 + 0.01 * torch.eye(40, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    g, rest = slice(8, 16), slice(16, 40)  # columns 0..7 are already quantized: they play no part
    schur = h[g, g] - h[g, rest] @ torch.linalg.solve(h[rest, rest], h[rest, g])
    assert torch.allclose(compensated_hessian(u, g), schur, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(schur, h[g, g], rtol=1e-2)  # it differs from the plain block


def test_compensated_clip_objective_runs_and_is_checked():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1024, 128, generator=gen)
    acc = HessianAccumulator(128)
    acc.add(x)
    w = torch.randn(32, 128, generator=gen)
    plain = gptq_quantize(w, acc.h, 64).error
    comp = gptq_quantize(w, acc.h, 64, clip=True, clip_objective="compensated").error
    assert comp < plain
    with pytest.raises(ValueError, match="clip_objective = 'other'"):
        gptq_quantize(w, acc.h, 64, clip=True, clip_objective="other")
