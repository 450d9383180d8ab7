"""marlin-quantize's other formats: 4-bit with zero points (--asym) and 8-bit symmetric (--bits 8).

Core: GPTQ beats round to nearest of the same format by at least 20% of the layer-output error on
test_quantize_gptq's data (a broken error feedback or a wrong zero point cannot); the asymmetric
clip search (both ends of the range shrunk) is never worse than the full range on its objective.
End to end on the tiny random Llama: the checkpoint loads into v2 MarlinLinear layers (b_zeros,
bits 8) that hold the quantizer's weights bit for bit and compute what its model computes.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from marlin import packing
from marlin.quantize import clip as clip_search
from marlin.quantize import gptq_quantize, rtn_quantize
from marlin.quantize.clip import WeightFormat

from test_quantize_gptq import calib_inputs, hessian_of, out_err

MODEL_TOL = 1e-2
FORMATS = [(4, False), (8, True)]


@pytest.mark.parametrize("bits, sym", FORMATS)
@pytest.mark.parametrize("group_size, act_order", [(128, False), (64, True), (-1, False)])
def test_gptq_beats_rtn_in_each_format(bits, sym, group_size, act_order):
    x = calib_inputs(2048, 256, seed=0)
    h = hessian_of(x)
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(1))
    res = gptq_quantize(w, h, group_size, act_order=act_order, bits=bits, sym=sym)
    rtn = rtn_quantize(w, group_size, bits=bits, sym=sym)
    e, e_rtn = out_err(x, w, res.dequantized()), out_err(x, w, rtn.dequantized())
    assert e < 0.8 * e_rtn, (e, e_rtn)
    fmt = WeightFormat(bits, sym)
    assert res.bits == bits and int(res.q.min()) >= fmt.qmin and int(res.q.max()) <= fmt.qmax
    if sym:
        assert res.zeros is None and int(res.q.min()) < -8  # 8 bits: the range is really used
    else:
        z = res.zeros.float()
        assert res.zeros.shape == res.scales.shape and bool(((z >= 0) & (z <= 15) & (z == z.round())).all())
        assert bool((z != 8).any())  # not a symmetric format in disguise
    # it packs into the v2 MarlinLinear format and unpacks to the same weight
    packed = packing.pack(res.q, res.scales, res.zeros, bits=bits)
    back = packing.unpack(*packed, bits=bits)
    deq = packing.dequantize(*back)
    if res.perm is not None:
        out = torch.empty_like(deq)
        out[res.perm] = deq
        deq = out
    assert torch.equal(deq.t(), res.dequantized())


def test_rtn_matches_packing_quantize_in_each_format():
    w = torch.randn(128, 256)
    for bits, sym in FORMATS:
        res = rtn_quantize(w, 64, bits=bits, sym=sym)
        ref = packing.quantize(w.t(), 64, bits=bits, sym=sym, dtype=torch.float16)
        assert torch.equal(res.q, ref[0]) and torch.equal(res.scales, ref[1])
        if not sym:
            assert torch.equal(res.zeros, ref[2])


def test_asym_clip_search_never_worse_than_full_range():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, 64, generator=gen) + 0.3  # off-centre groups: where zero points matter
    w[:, 0] = 6.0  # one outlier per row: clipping should pay
    x = calib_inputs(512, 64, seed=6)
    h = hessian_of(x)
    fmt = WeightFormat(4, False)
    scale, zero = clip_search.search_params(w, h, fmt=fmt)
    err_best = clip_search.weighted_error(w, scale, h, zero, fmt)
    full = fmt.params(w)
    err_full = clip_search.weighted_error(w, *full[:1], h, full[1], fmt)
    assert bool((err_best <= err_full + 1e-6).all()) and float(err_best.sum()) < 0.9 * float(err_full.sum())
    for factor in clip_search.DEFAULT_GRID:  # the per-row minimum over the grid
        s, z = fmt.params(w, factor)
        assert bool((err_best <= clip_search.weighted_error(w, s, h, z, fmt) + 1e-6).all())
    assert bool((zero == zero.round()).all()) and int(zero.min()) >= 0 and int(zero.max()) <= 15


def test_bad_formats():
    with pytest.raises(ValueError, match="zero points exist for 4 bits only"):
        gptq_quantize(torch.randn(64, 128), torch.eye(128), 64, bits=8, sym=False)
    with pytest.raises(ValueError, match="expected 4 or 8"):
        rtn_quantize(torch.randn(64, 128), 64, bits=3)


# -- end to end ------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

import marlin  # noqa: E402
from marlin.nn import MarlinLinear  # noqa: E402
from marlin.quantize import cli  # noqa: E402
from marlin.quantize.runner import QuantizeConfig, quantize_model  # noqa: E402
from marlin.quantize.writer import write_checkpoint  # noqa: E402

from quantize_fixtures import make_tiny, marlin_layer_weight, model_and_samples, output_errors  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("quantize_formats"))


@pytest.mark.parametrize("bits, sym, group_size, act_order", [(4, False, 64, True), (8, True, 128, False)])
def test_checkpoint_in_each_format_loads_exactly(tiny, tmp_path, bits, sym, group_size, act_order):
    _, src, calib = tiny
    model, tokenizer, samples = model_and_samples(src, calib)
    config = QuantizeConfig(group_size=group_size, act_order=act_order, bits=bits, sym=sym)
    fp_model = copy.deepcopy(model)
    results, reports = quantize_model(model, samples, config, progress=False)
    assert len(results) == 14 and all(r.error < r.rtn_error for r in reports)
    out = tmp_path / "out"
    settings = {"group_size": group_size, "act_order": act_order, "bits": bits, "sym": sym}
    write_checkpoint(model, results, reports, out, settings=settings, tokenizer=tokenizer)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["bits"], qc["sym"]) == (bits, sym)
    loaded = marlin.load_quantized(out, device="cpu")
    for name, res in results.items():
        layer = loaded.get_submodule(name)
        assert isinstance(layer, MarlinLinear) and layer.bits == bits and layer.zero_points == (not sym)
        assert torch.equal(marlin_layer_weight(layer), res.dequantized())
    err, moved = output_errors(model, loaded, fp_model, samples[0])
    assert err < MODEL_TOL, f"loaded checkpoint vs the quantizer's model: {err:.2e}"
    if bits == 4:  # 8 bits is close to full precision: the loaded-vs-fake check is the test there
        assert moved > 3 * err


def test_cli_asym_resumes_and_writes_zero_points(tiny, tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file

    from marlin.quantize.writer import ResumeStore

    _, src, calib = tiny
    base = [str(src), "--calib", str(calib), "--nsamples", "6", "--seqlen-range", "16:64", "--group-size", "64", "--asym"]
    assert cli.main([base[0], str(tmp_path / "ref"), *base[1:], "--quiet"]) == 0

    original = ResumeStore.save_block

    def save_then_stop(self, outcome):
        original(self, outcome)
        raise KeyboardInterrupt

    monkeypatch.setattr(ResumeStore, "save_block", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        cli.main([base[0], str(tmp_path / "out"), *base[1:], "--quiet"])
    monkeypatch.setattr(ResumeStore, "save_block", original)
    assert cli.main([base[0], str(tmp_path / "out"), *base[1:]]) == 0
    assert "resumed 1 finished blocks" in capsys.readouterr().out
    ref, got = load_file(str(tmp_path / "ref" / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert sum(k.endswith(".b_zeros") for k in got) == 14
    with pytest.raises(SystemExit):
        cli.main([base[0], str(tmp_path / "o"), *base[1:], "--sym"])  # --sym and --asym exclude each other
    assert cli.main([base[0], str(tmp_path / "o8"), *base[1:-1], "--bits", "8", "--asym"]) == 1
    assert "zero points exist for 4 bits only" in capsys.readouterr().err
    # without --sym/--asym, 8-bit is symmetric (zero points are the default for dense 4-bit only)
    assert cli.main([base[0], str(tmp_path / "o8"), *base[1:-1], "--bits", "8", "--quiet"]) == 0
    assert json.loads((tmp_path / "o8" / "config.json").read_text())["quantization_config"]["sym"] is True
