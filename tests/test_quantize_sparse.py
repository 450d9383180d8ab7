"""marlin-quantize --sparsity 2:4: joint 2:4 pruning and GPTQ (SparseGPT) on the CPU.

The core on a small random layer with correlated, outlier-heavy inputs (test_quantize_gptq's
data): pruning and quantizing from the same Hessian, with error feedback, must cut the layer-output
error of magnitude pruning + round to nearest (MarlinLinear24.from_linear's recipe) by at least
20% (it does by about 30%): without the feedback, or with a saliency that ignores the Hessian, the
joint result *is* magnitude pruning + RTN or close to it; the same with zero points, where a
pruned weight is u = z. End to end on the tiny random Llama: every written layer is exactly 2:4,
loads into MarlinLinear24 (load_quantized and from_pretrained) with the quantizer's weights bit for
bit (and its zero points, with --asym), and runs (CPU reference op) and generates.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from marlin import packing, sparse
from marlin.quantize import gptq_quantize, rtn_quantize

from test_quantize_gptq import calib_inputs, hessian_of, out_err

MODEL_TOL = 1e-2


def groups_nnz(q: torch.Tensor) -> torch.Tensor:
    """Non-zeros in every group of 4 rows of each column of q [K, N]."""
    k, n = q.shape
    return (q != 0).reshape(k // 4, 4, n).sum(dim=1)


@pytest.mark.parametrize("group_size", [128, 64, 32, -1])
@pytest.mark.parametrize("clip", [False, True])
def test_joint_prune_quant_beats_magnitude_then_rtn(group_size, clip):
    x = calib_inputs(2048, 256, seed=0)
    h = hessian_of(x)
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(1))
    joint = gptq_quantize(w, h, group_size, sparsity="2:4", clip=clip)
    base = rtn_quantize(w, group_size, sparsity="2:4")
    e_joint, e_base = out_err(x, w, joint.dequantized()), out_err(x, w, base.dequantized())
    assert e_joint < 0.8 * e_base, (e_joint, e_base)
    assert abs(joint.error - e_joint) < 1e-4  # the reported error is the real one
    # exactly 2:4: the mask keeps 2 of every 4, and q (and the weight) is zero elsewhere
    assert joint.keep.shape == (256, 128) and bool((groups_nnz(joint.keep) == 2).all())
    assert bool((joint.q[~joint.keep] == 0).all()) and bool((groups_nnz(joint.q) <= 2).all())
    assert sparse.violations_2_4(joint.dequantized().t()).numel() == 0
    assert int(joint.q.min()) >= -8 and int(joint.q.max()) <= 7 and joint.perm is None
    # the pruned share of the norm is reported against the original weight
    expect = float((w * (~joint.keep).t()).norm() / w.norm())
    assert joint.pruned_fraction == pytest.approx(expect, rel=1e-6) and 0.2 < expect < 0.8


@pytest.mark.parametrize("group_size", [128, 64, 32, -1])
@pytest.mark.parametrize("refit", [0, 2])
def test_joint_prune_quant_with_zero_points(group_size, refit):
    """sym=False: the same joint pruning with 4-bit zero points. A pruned weight's code is its
    group's zero point (u = z, weight exactly 0; the refit moves the codes with the zero points
    it picks), the kept ones are u in 0..15; the result beats magnitude pruning + RTN with zero
    points as the symmetric one does, and on weights off centre it beats the symmetric joint result."""
    x = calib_inputs(2048, 256, seed=0)
    h = hessian_of(x)
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(1)) + 0.5  # off centre
    joint = gptq_quantize(w, h, group_size, sparsity="2:4", sym=False, refit=refit, clip=True)
    base = rtn_quantize(w, group_size, sparsity="2:4", sym=False)
    sym = gptq_quantize(w, h, group_size, sparsity="2:4", refit=refit, clip=True)
    e_joint, e_base = out_err(x, w, joint.dequantized()), out_err(x, w, base.dequantized())
    assert e_joint < 0.8 * e_base, (e_joint, e_base)
    assert e_joint < out_err(x, w, sym.dequantized())
    assert abs(joint.error - e_joint) < 1e-4
    rows = 256 // joint.scales.shape[0]
    z = joint.zeros.float().repeat_interleave(rows, dim=0)  # [K, N]
    assert bool((groups_nnz(joint.keep) == 2).all()) and bool((joint.q.float()[~joint.keep] == z[~joint.keep]).all())
    assert bool((groups_nnz(joint.q.float() - z) <= 2).all())
    assert sparse.violations_2_4(joint.dequantized().t()).numel() == 0
    assert int(joint.q.min()) >= 0 and int(joint.q.max()) <= 15 and torch.equal(joint.zeros, joint.zeros.round())
    base_z = base.zeros.float().repeat_interleave(rows, dim=0)
    assert bool((base.q.float()[~base.keep] == base_z[~base.keep]).all())  # RTN too: pruned zeros quantize to z


def test_saliency_uses_the_hessian():
    """Input 0 is 100x larger than the others: its weights must survive the pruning although they
    are the smallest of their group by magnitude (magnitude pruning drops them all)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 128, generator=gen)
    x[:, 0] *= 100
    h = hessian_of(x)
    w = torch.randn(64, 128, generator=gen)
    w[:, 1:4] = torch.sign(w[:, 1:4]) * (w[:, 1:4].abs() + 0.1)
    w[:, 0] = 0.05 * torch.sign(torch.randn(64, generator=gen))  # the smallest of its group of 4
    joint = gptq_quantize(w, h, 128, sparsity="2:4")
    base = rtn_quantize(w, 128, sparsity="2:4")
    assert not base.keep[0].any()  # magnitude pruning drops input 0 everywhere
    assert joint.keep[0].all()


def test_rtn_2_4_is_marlin_linear24_from_linear():
    """The baseline in the report is exactly what MarlinLinear24.from_linear computes."""
    from marlin.sparse_nn import MarlinLinear24

    lin = torch.nn.Linear(256, 128, bias=False).half()
    res = rtn_quantize(lin.weight.detach().float(), 128, sparsity="2:4")
    layer = MarlinLinear24.from_linear(lin, 128)
    assert torch.equal(layer.dequantized_weight(), res.dequantized())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(act_order=True), "act_order"),
        (dict(bits=8), r"bits = 8: the 2:4 format holds 4-bit weights only \(symmetric or with zero points\)"),
        (dict(sparsity="1:2"), "expected None"),
    ],
)
def test_bad_sparse_arguments(kwargs, match):
    args = dict(sparsity="2:4")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        gptq_quantize(torch.randn(128, 256), torch.eye(256), 128, **args)


# -- end to end ------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

import marlin  # noqa: E402
from marlin.quantize.pipeline import quantize_checkpoint  # noqa: E402
from marlin.quantize.runner import QuantizeConfig, quantize_model  # noqa: E402
from marlin.quantize.writer import REPORT_FILE, write_checkpoint  # noqa: E402
from marlin.sparse_nn import MarlinLinear24  # noqa: E402

from quantize_fixtures import make_tiny, model_and_samples, output_errors  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("quantize24"))


@pytest.mark.parametrize("group_size,sym", [(128, True), (32, True), (-1, True), (64, False), (-1, False)])
def test_sparse_checkpoint_is_2_4_and_loads_exactly(tiny, tmp_path, group_size, sym):
    _, src, calib = tiny
    model, tokenizer, samples = model_and_samples(src, calib)
    config = QuantizeConfig(group_size=group_size, sparsity="2:4", sym=sym)
    fp_model = copy.deepcopy(model)
    results, reports = quantize_model(model, samples, config, progress=False)
    assert len(results) == 14 and all(r.status == "quantized" for r in reports)
    for r in reports:  # joint pruning beats magnitude pruning + RTN, layer by layer
        assert r.error < r.rtn_error and 0 < r.pruned_fraction < 1

    out = tmp_path / "out"
    settings = {"group_size": group_size, "sparsity": "2:4", "sym": sym}
    write_checkpoint(model, results, reports, out, settings=settings, tokenizer=tokenizer)
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    loaded = marlin.load_quantized(out, device="cpu")
    for name, res in results.items():
        assert (f"{name}.b_zeros" in tensors) == (not sym), name
        parts = sparse.unpack_2_4_parts(
            tensors[f"{name}.b_q"], tensors[f"{name}.b_meta"], tensors[f"{name}.b_scales"], tensors.get(f"{name}.b_zeros")
        )
        if not sym:  # the quantizer's codes and zero points, bit for bit
            assert torch.equal(parts[0], res.q) and torch.equal(parts[2], res.zeros), name
        assert bool((groups_nnz(packing.dequantize(*parts)) <= 2).all()), name  # every written layer is exactly 2:4
        layer = loaded.get_submodule(name)
        assert isinstance(layer, MarlinLinear24) and layer.group_size == group_size and layer.zero_points == (not sym)
        assert torch.equal(layer.dequantized_weight(), res.dequantized())

    err, moved = output_errors(model, loaded, fp_model, samples[0])
    assert err < MODEL_TOL, f"loaded 2:4 checkpoint vs the quantizer's model: {err:.2e}"
    assert moved > 3 * err
    gen = loaded.generate(samples[0][:, :8], max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 12)


def test_sparse_cli_and_from_pretrained(tiny, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from marlin.quantize import cli

    _, src, calib = tiny
    out = tmp_path / "q24"
    argv = [str(src), str(out), "--calib", str(calib), "--nsamples", "6", "--seqlen-range", "16:64", "--sparsity", "2:4"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "14 layers quantized" in printed and "2:4 pruning removed on average" in printed
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["settings"]["sparsity"] == "2:4"
    assert all(0 < r["pruned_fraction"] < 1 for r in report["layers"])
    assert "| pruned |" in (out / "quantize_report.md").read_text()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "marlin" and qc["sparsity"] == "2:4"
    assert qc["sym"] is True  # the default with --sparsity 2:4 (zero points with --asym)

    model = AutoModelForCausalLM.from_pretrained(out)
    loaded = marlin.load_quantized(out, device="cpu")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, MarlinLinear24)}
    assert len(layers) == 14
    x = torch.tensor([[0, 5, 9, 17, 33, 60, 71, 80]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)
    assert cli.eval_main([str(out), "--text", str(calib), "--context", "64", "--max-tokens", "200", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ppl"] > 1


def test_sparse_cli_with_zero_points(tiny, tmp_path, capsys):
    """marlin-quantize --sparsity 2:4 --asym: 2:4 layers with zero points (b_zeros), which
    load_quantized and from_pretrained build as MarlinLinear24 with zero points, with the same
    logits."""
    from transformers import AutoModelForCausalLM

    from marlin.quantize import cli

    _, src, calib = tiny
    out = tmp_path / "q24zp"
    argv = [str(src), str(out), "--calib", str(calib), "--nsamples", "4", "--seqlen-range", "16:48", "--sparsity", "2:4",
            "--asym", "--group-size", "64"]
    assert cli.main(argv) == 0
    assert "14 layers quantized" in capsys.readouterr().out
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["sparsity"] == "2:4" and qc["sym"] is False
    model = AutoModelForCausalLM.from_pretrained(out)
    loaded = marlin.load_quantized(out, device="cpu")
    for m in (model, loaded):
        layers = [mod for mod in m.modules() if isinstance(mod, MarlinLinear24)]
        assert len(layers) == 14 and all(mod.zero_points and mod.group_size == 64 for mod in layers)
    x = torch.tensor([[0, 5, 9, 17, 33, 60, 71, 80]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)


def test_a_bf16_2_4_checkpoint_loads_as_bf16_layers(tiny, tmp_path):
    """The same 2:4 checkpoint with every floating tensor in bf16 (the scales included) loads, with
    load_quantized and from_pretrained, as bf16 MarlinLinear24 layers whose weights are the bf16
    scales times the same codes; the model then runs in bf16 close to the fp16 one."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    _, src, calib = tiny
    model, tokenizer, samples = model_and_samples(src, calib)
    results, reports = quantize_model(model, samples, QuantizeConfig(group_size=128, sparsity="2:4"), progress=False)
    out = tmp_path / "out"
    write_checkpoint(model, results, reports, out, settings={"group_size": 128, "sparsity": "2:4"}, tokenizer=tokenizer)
    fp16 = marlin.load_quantized(out, device="cpu")
    tensors = load_file(str(out / "model.safetensors"))
    save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))

    for loaded in (marlin.load_quantized(out, device="cpu"), AutoModelForCausalLM.from_pretrained(out)):
        layers = {n: m for n, m in loaded.named_modules() if isinstance(m, MarlinLinear24)}
        assert len(layers) == 14 and all(m.dtype == m.b_scales.dtype == torch.bfloat16 for m in layers.values())
        for name, layer in layers.items():
            q, _ = sparse.unpack_2_4_parts(layer.b_q, layer.b_meta, layer.b_scales)
            q16, s16 = sparse.unpack_2_4_parts(*(fp16.get_submodule(name).get_buffer(b) for b in ("b_q", "b_meta", "b_scales")))
            assert torch.equal(q, q16)
            assert torch.equal(layer.dequantized_weight(), packing.dequantize(q16, s16.bfloat16()).t())
        x = samples[0][:, :16]
        with torch.no_grad():
            ref, got = fp16(x).logits.double(), loaded(x).logits.double()
        assert float((got - ref).norm() / ref.norm()) < 0.05


def test_sparse_options_fail_before_loading(tiny, tmp_path):
    _, src, calib = tiny
    for kwargs, match in (
        (dict(act_order=True), "act_order"),
        (dict(group_size=16), r"group_size = 16: the 2:4 kernel takes group size 128, 64, 32 or -1"),
        (dict(bits=8), "4-bit weights only"),
    ):
        with pytest.raises(ValueError, match=match):
            quantize_checkpoint(src, tmp_path / "o", calib=calib, sparsity="2:4", **kwargs)
    assert not any(tmp_path.iterdir())


def test_resume_store_round_trips_2_4_and_zero_point_results(tmp_path):
    from marlin.quantize.runner import BlockOutcome, LayerReport
    from marlin.quantize.writer import ResumeStore

    w = torch.randn(128, 256)
    h = hessian_of(calib_inputs(512, 256, seed=4))
    sparse_res = gptq_quantize(w, h, 128, sparsity="2:4")
    for i, (manifest, res) in enumerate((
        ({"group_size": 128, "sparsity": "2:4", "bits": 4}, sparse_res),
        ({"group_size": 128, "sparsity": None, "bits": 4}, gptq_quantize(w, h, 128, sym=False)),
        ({"group_size": 128, "sparsity": "2:4", "bits": 4, "sym": False}, gptq_quantize(w, h, 128, sparsity="2:4", sym=False)),
    )):
        store = ResumeStore(tmp_path / f"out{i}", manifest)
        store.start()
        row = LayerReport("m.l", 256, 128, "quantized", error=res.error, rtn_error=0.5, pruned_fraction=res.pruned_fraction)
        store.save_block(BlockOutcome(0, {"m.l": res}, [row]))
        back = store.load()[0]
        got = back.results["m.l"]
        assert torch.equal(got.dequantized(), res.dequantized()) and got.sparsity == res.sparsity
        assert back.reports[0].pruned_fraction == res.pruned_fraction
        assert (got.zeros is None) == (res.zeros is None)
        store.remove()
