"""marlin-quantize with --device cuda (skipped without a GPU): the same pipeline, block and
Hessians on the GPU, and the checkpoint run through the CUDA kernel, in every format the
quantizer writes (4-bit symmetric and with zero points, 8-bit, 2:4-sparse).

Bounds: the CUDA run's GPTQ is not bit-identical to the CPU run (different float summation
orders change a few roundings), so the check is on outputs: the loaded checkpoint on the GPU
(fp16, the Marlin kernel) against the quantizer's own fake-quantized model in float32, within
the 1e-2 whole-model bound of test_nn.py; and the two runs' mean layer errors agree within 10%.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import marlin  # noqa: E402
from marlin.nn import MarlinLinear  # noqa: E402
from marlin.quantize.pipeline import quantize_checkpoint  # noqa: E402
from marlin.quantize.runner import QuantizeConfig, quantize_model  # noqa: E402
from marlin.quantize.writer import write_checkpoint  # noqa: E402
from marlin.sparse_nn import MarlinLinear24  # noqa: E402

from quantize_fixtures import make_tiny, model_and_samples  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    "group_size, act_order, fmt",
    [
        (64, False, {}),
        (128, True, {}),
        (-1, False, {}),
        (64, True, {"sym": False}),  # zero points
        (128, False, {"bits": 8}),
        (128, False, {"sparsity": "2:4"}),  # MarlinLinear24 through the 2:4 kernel
    ],
)
def test_quantize_on_cuda_and_run_through_the_kernel(tmp_path, group_size, act_order, fmt):
    _, src, calib = make_tiny(tmp_path)
    model, tokenizer, samples = model_and_samples(src, calib)
    config = QuantizeConfig(group_size=group_size, act_order=act_order, **fmt)

    cpu_model = copy.deepcopy(model)
    results, reports = quantize_model(model, samples, config, device="cuda", progress=False)
    _, cpu_reports = quantize_model(cpu_model, samples, config, device="cpu", progress=False)
    gpu_err = sum(r.error for r in reports) / len(reports)
    cpu_err = sum(r.error for r in cpu_reports) / len(cpu_reports)
    assert gpu_err == pytest.approx(cpu_err, rel=0.1)
    assert all(r.error < r.rtn_error for r in reports)
    assert next(model.parameters()).device.type == "cpu"  # the model goes back where it was

    out = tmp_path / "out"
    write_checkpoint(model, results, reports, out, settings={"group_size": group_size, **fmt}, tokenizer=tokenizer)
    loaded = marlin.load_quantized(out, device="cuda")
    layer_type = MarlinLinear24 if fmt.get("sparsity") else MarlinLinear
    assert sum(isinstance(m, layer_type) for m in loaded.modules()) == 14
    x = samples[0]
    with torch.no_grad():
        fake = model(x).logits.double()
        real = loaded(x.cuda()).logits.double().cpu()
    err = float((real - fake).norm() / fake.norm())
    assert err < 1e-2, f"checkpoint through the CUDA kernel vs the quantizer's model: {err:.2e}"


def test_cli_pipeline_on_cuda(tmp_path):
    _, src, calib = make_tiny(tmp_path)
    summary = quantize_checkpoint(
        src, tmp_path / "out", calib=calib, nsamples=8, seqlen_range=(16, 64), group_size=64, device="cuda", progress=False
    )
    assert summary.quantized == 14 and summary.peak_device_mb is not None
    from marlin.quantize.evaluate import evaluate_path

    q = evaluate_path(tmp_path / "out", calib, context=64, max_tokens=400, device="cuda", progress=False)
    f = evaluate_path(src, calib, context=64, max_tokens=400, device="cuda", progress=False)
    assert q["kind"] == "marlin" and q["tokens"] == f["tokens"]
    assert abs(q["ppl"] / f["ppl"] - 1) < 0.2  # a random model: quantization moves it a little, not a lot


def test_rotated_quantize_on_cuda_runs_through_the_kernel(tmp_path):
    """--rotate with --device cuda: the down_proj layers of the checkpoint carry their
    input_rotation, and on the GPU (CUDA kernel, the rotation applied before it) the model keeps
    the fp16 model's perplexity within 20% (a random model: quantization moves it a little) and
    its logits near the original's; the same layers without their rotation move the logits at
    least twice as far (the test would catch a rotation dropped or applied twice)."""
    _, src, calib = make_tiny(tmp_path)
    summary = quantize_checkpoint(
        src, tmp_path / "out", calib=calib, nsamples=8, seqlen_range=(16, 64), group_size=-1, act_order=True,
        sym=False, rotate=True, device="cuda", progress=False,
    )
    assert summary.quantized == 14
    from marlin.quantize.evaluate import evaluate_path

    q = evaluate_path(tmp_path / "out", calib, context=64, max_tokens=400, device="cuda", progress=False)
    f = evaluate_path(src, calib, context=64, max_tokens=400, device="cuda", progress=False)
    assert abs(q["ppl"] / f["ppl"] - 1) < 0.2

    loaded = marlin.load_quantized(tmp_path / "out", device="cuda")
    downs = [m for n, m in loaded.named_modules() if n.endswith("down_proj")]
    assert downs and all(isinstance(m, MarlinLinear) and m.input_rotation is not None for m in downs)
    model, _, samples = model_and_samples(src, calib)
    x = samples[0]
    with torch.no_grad():
        want = model(x).logits.double()
        on = loaded(x.cuda()).logits.double().cpu()
        for m in downs:
            m.input_rotation = None  # the weights stay rotated
        off = loaded(x.cuda()).logits.double().cpu()
    err_on = float((on - want).norm() / want.norm())
    err_off = float((off - want).norm() / want.norm())
    assert err_off > 2 * err_on, f"rotation on {err_on:.2e}, off {err_off:.2e}"
