"""marlin-quantize end to end on a tiny random Llama (CPU): checkpoint, report, resume, errors.

The written checkpoint must load with marlin.load_quantized and hold exactly the weights the
quantizer computed (bit for bit after dequantization); its outputs through MarlinLinear (fp16,
CPU reference op) must match the quantizer's own fake-quantized float32 model within fp16
rounding (1e-2 normwise over a whole model, as in test_nn.py), far below what a wrong scale, row
order or permutation would give.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import marlin  # noqa: E402
from marlin.nn import MarlinLinear  # noqa: E402
from marlin.quantize import cli  # noqa: E402
from marlin.quantize.pipeline import quantize_checkpoint  # noqa: E402
from marlin.quantize.runner import QuantizeConfig, UnsupportedModelError, find_blocks, quantize_model  # noqa: E402
from marlin.quantize.source import resolve_source  # noqa: E402
from marlin.quantize.writer import REPORT_FILE, ResumeStore, write_checkpoint  # noqa: E402

from quantize_fixtures import make_model_dir, make_text, make_tiny, marlin_layer_weight, model_and_samples, output_errors  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_TOL = 1e-2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("quantize"))


@pytest.mark.parametrize("group_size, act_order", [(128, False), (128, True), (-1, True)])
def test_checkpoint_holds_exactly_the_quantized_weights(tiny, tmp_path, group_size, act_order):
    _, src, calib = tiny
    model, tokenizer, samples = model_and_samples(src, calib)
    config = QuantizeConfig(group_size=group_size, act_order=act_order)
    fp_model = copy.deepcopy(model)
    results, reports = quantize_model(model, samples, config, progress=False)
    assert len(results) == 14 and all(r.status == "quantized" for r in reports)
    # GPTQ beats round to nearest on the calibration data, layer by layer
    assert all(r.error < r.rtn_error for r in reports)
    if act_order and group_size != -1:
        assert any(res.perm is not None for res in results.values())

    out = tmp_path / "out"
    write_checkpoint(model, results, reports, out, settings={"group_size": group_size, "act_order": act_order}, tokenizer=tokenizer)
    loaded = marlin.load_quantized(out, device="cpu")
    for name, res in results.items():
        layer = loaded.get_submodule(name)
        assert isinstance(layer, MarlinLinear)
        assert torch.equal(marlin_layer_weight(layer), res.dequantized())
        assert (layer.perm is not None) == (res.perm is not None)

    err, moved = output_errors(model, loaded, fp_model, samples[0])
    assert err < MODEL_TOL, f"loaded checkpoint vs the quantizer's model: {err:.2e}"
    assert moved > 3 * err  # the check above can tell quantized from not


def test_cli_writes_report_and_eval_runs(tiny, tmp_path, capsys):
    _, src, calib = tiny
    out = tmp_path / "q"
    argv = [str(src), str(out), "--calib", str(calib), "--nsamples", "6", "--seqlen-range", "16:64", "--group-size", "128"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "14 layers quantized" in printed and "peak host memory" in printed
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["settings"]["seqlen_range"] == [16, 64] and len(report["layers"]) == 14
    # the defaults: zero points for dense 4-bit, the compensated objective ("auto" with groups), true-sequential, fp target
    settings = report["settings"]
    assert settings["sym"] is False and settings["clip_objective"] == "compensated"
    assert settings["true_sequential"] is True and settings["fp_target"] is True
    assert (out / "quantize_report.md").is_file() and (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["checkpoint_format"] == "marlin"
    assert config["quantization_config"]["sym"] is False
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no staging or resume leftovers

    assert cli.eval_main([str(out), "--text", str(calib), "--context", "64", "--max-tokens", "300", "--json"]) == 0
    q = json.loads(capsys.readouterr().out)
    assert cli.eval_main([str(src), "--text", str(calib), "--context", "64", "--max-tokens", "300", "--json"]) == 0
    f = json.loads(capsys.readouterr().out)
    assert q["kind"] == "marlin" and f["kind"].startswith("full precision")
    assert q["tokens"] == f["tokens"] and q["ppl"] > 1 and f["ppl"] > 1


def test_resume_after_interruption_gives_the_same_checkpoint(tiny, tmp_path, monkeypatch):
    _, src, calib = tiny
    kwargs = dict(calib=calib, nsamples=6, seqlen_range=(16, 64), progress=False)
    quantize_checkpoint(src, tmp_path / "ref", **kwargs)

    saved = []
    original = ResumeStore.save_block

    def save_then_stop(self, outcome):
        original(self, outcome)
        saved.append(outcome.index)
        raise KeyboardInterrupt  # interrupted right after block 0 was saved

    monkeypatch.setattr(ResumeStore, "save_block", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(src, tmp_path / "out", **kwargs)
    monkeypatch.setattr(ResumeStore, "save_block", original)
    assert saved == [0] and not (tmp_path / "out").exists()
    assert (tmp_path / ".out.quantize-resume" / "block-0000.safetensors").is_file()

    with pytest.raises(ValueError, match="other settings"):  # a different run may not reuse it
        quantize_checkpoint(src, tmp_path / "out", **dict(kwargs, seed=1))
    summary = quantize_checkpoint(src, tmp_path / "out", **kwargs)
    assert summary.resumed_blocks == 1
    assert not (tmp_path / ".out.quantize-resume").exists()
    from safetensors.torch import load_file

    ref, got = load_file(str(tmp_path / "ref" / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    rows = json.loads((tmp_path / "out" / REPORT_FILE).read_text())["layers"]
    assert [r["name"] for r in rows] == [r["name"] for r in json.loads((tmp_path / "ref" / REPORT_FILE).read_text())["layers"]]


def test_layers_the_kernel_refuses_stay_full_precision(tmp_path):
    src = make_model_dir(tmp_path / "odd", intermediate_size=328)  # no multiple of 64 or 128
    calib = tmp_path / "calib.txt"
    calib.write_text(make_text(3000, seed=3))
    out = tmp_path / "out"
    summary = quantize_checkpoint(src, out, calib=calib, nsamples=4, seqlen_range=(16, 48), progress=False)
    kept = dict(summary.kept)
    assert len(kept) == 6 and all("mlp" in name for name in kept)  # gate, up, down of both blocks
    assert all("328" in why and "multiple of" in why for why in kept.values())
    report = {r["name"]: r for r in json.loads((out / REPORT_FILE).read_text())["layers"]}
    assert report["model.layers.0.mlp.down_proj"]["status"] == "kept"
    loaded = marlin.load_quantized(out, device="cpu")
    assert type(loaded.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, MarlinLinear)


@pytest.mark.parametrize(
    "setup, match",
    [
        ("missing", "does not exist"),
        ("empty", "no config.json and no .gguf"),
        ("pickle", "only pickle weights"),
        ("config_only", "no \\*.safetensors"),
        ("not_gguf", "not a .gguf"),
    ],
)
def test_bad_model_paths(tmp_path, setup, match):
    path = tmp_path / "m"
    if setup != "missing":
        path.mkdir()
    if setup == "pickle":
        (path / "pytorch_model.bin").write_bytes(b"\x80")
    if setup == "config_only":
        (path / "config.json").write_text("{}")
    if setup == "not_gguf":
        path = tmp_path / "weights.bin"
        path.write_bytes(b"")
    with pytest.raises(ValueError, match=match):
        resolve_source(path)


def test_bad_options_fail_before_loading(tiny, tmp_path):
    _, src, calib = tiny
    with pytest.raises(ValueError, match="expected '2:4'"):
        quantize_checkpoint(src, tmp_path / "o", calib=calib, sparsity="1:2")
    with pytest.raises(ValueError, match="neither a file nor a directory"):
        quantize_checkpoint(src, tmp_path / "o", calib=tmp_path / "nope.txt")
    with pytest.raises(ValueError, match="device = 'tpu'"):
        quantize_checkpoint(src, tmp_path / "o", calib=calib, device="tpu")
    (tmp_path / "exists").mkdir()
    with pytest.raises(ValueError, match="exists"):
        quantize_checkpoint(src, tmp_path / "exists", calib=calib)
    with pytest.raises(ValueError, match="fewer than the longest sample"):
        quantize_checkpoint(src, tmp_path / "o", calib=calib, seqlen_range=(16, 100000))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]


def test_cli_usage_errors(tiny, tmp_path, capsys):
    _, src, calib = tiny
    with pytest.raises(SystemExit):
        cli.main([str(src), str(tmp_path / "o"), "--calib", str(calib), "--group-size", "48"])
    assert "group size 48" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([str(src), str(tmp_path / "o"), "--calib", str(calib), "--seqlen-range", "64:16"])
    assert cli.main([str(tmp_path / "missing"), str(tmp_path / "o"), "--calib", str(calib)]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_unsupported_architecture():
    with pytest.raises(UnsupportedModelError, match="no decoder blocks"):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_console_scripts_are_declared():
    text = (REPO / "pyproject.toml").read_text()
    assert 'marlin-quantize = "marlin.quantize.cli:main"' in text
    assert 'marlin-eval = "marlin.quantize.cli:eval_main"' in text


def test_module_entry_point_runs(tiny, tmp_path):
    """python -m marlin.quantize.cli --help works from the checkout (the script entry)."""
    proc = subprocess.run(
        [sys.executable, "-m", "marlin.quantize.cli", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "--seqlen-range" in proc.stdout
