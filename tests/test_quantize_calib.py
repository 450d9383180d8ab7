"""Calibration sampling and perplexity windows (marlin.quantize.calib, marlin.quantize.evaluate)."""

from __future__ import annotations

import math

import pytest
import torch

from marlin.quantize.calib import CalibrationSpec, draw_samples, parse_seqlen_range, read_texts


def test_variable_length_samples_are_windows_of_the_text_and_reproducible():
    ids = torch.arange(10_000)
    spec = CalibrationSpec(nsamples=50, min_len=20, max_len=300, seed=3)
    a, b = draw_samples(ids, spec), draw_samples(ids, spec)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    lengths = [s.shape[1] for s in a]
    assert min(lengths) >= 20 and max(lengths) <= 300 and len(set(lengths)) > 10
    for s in a:  # contiguous windows: consecutive ids, no padding
        assert s.shape[0] == 1 and torch.equal(s[0], torch.arange(int(s[0, 0]), int(s[0, 0]) + s.shape[1]))
    other = draw_samples(ids, CalibrationSpec(nsamples=50, min_len=20, max_len=300, seed=4))
    assert any(not torch.equal(x, y) for x, y in zip(a, other))


def test_fixed_length_samples():
    spec = CalibrationSpec(nsamples=5, min_len=64, max_len=64)
    assert spec.fixed
    assert {s.shape[1] for s in draw_samples(torch.arange(1000), spec)} == {64}


def test_parse_seqlen_range():
    assert parse_seqlen_range("32:512") == (32, 512)
    assert parse_seqlen_range("256") == (256, 256)
    for bad in ("512:32", "a:b", "0:4", "1:2:3"):
        with pytest.raises(ValueError, match="sequence length range"):
            parse_seqlen_range(bad)


def test_bad_specs_and_texts(tmp_path):
    with pytest.raises(ValueError, match="nsamples"):
        CalibrationSpec(nsamples=0)
    with pytest.raises(ValueError, match="fewer than the longest sample"):
        draw_samples(torch.arange(100), CalibrationSpec(nsamples=1, min_len=10, max_len=100))
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="has no"):
        read_texts(tmp_path / "d")
    (tmp_path / "d" / "b.txt").write_text("second")
    (tmp_path / "d" / "a.txt").write_text("first")
    (tmp_path / "d" / "c.bin").write_text("ignored")
    assert read_texts(tmp_path / "d") == "first\n\nsecond"


def test_perplexity_matches_the_model_loss():
    transformers = pytest.importorskip("transformers")
    from marlin.quantize.evaluate import perplexity

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 100, (300,))
    with torch.no_grad():
        loss = float(model(ids[None], labels=ids[None]).loss)
    one = perplexity(model, ids, context=300)
    assert one["tokens"] == 299 and one["ppl"] == pytest.approx(math.exp(loss), rel=1e-5)
    disjoint = perplexity(model, ids, context=64)  # each window's first token has no context: not scored
    assert disjoint["windows"] == 5 and disjoint["tokens"] == 299 - 4
    sliding = perplexity(model, ids, context=64, stride=16)
    assert sliding["tokens"] == 299
    with pytest.raises(ValueError, match="stride"):
        perplexity(model, ids, context=64, stride=65)
