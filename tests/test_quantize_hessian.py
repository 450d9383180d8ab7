"""Hessian accumulation (marlin.quantize.hessian): gram()'s blocked product, and InputBatch, which
adds many forward calls' inputs in one product per distinct input, against the one-call-at-a-time
HessianAccumulator.add and a float64 reference (CPU)."""

from __future__ import annotations

import pytest
import torch

from marlin.quantize import hessian
from marlin.quantize.hessian import HessianAccumulator, InputBatch, gram


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _reference(xs, refs=None):
    """H (and C) in float64 from the concatenated calls."""
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs]).double()
    h = 2 / x.shape[0] * x.t() @ x
    if refs is None:
        return h, None
    r = torch.cat([t.reshape(-1, t.shape[-1]) for t in refs]).double()
    return h, 2 / x.shape[0] * x.t() @ r


@pytest.mark.parametrize("k", [48, hessian.SYMMETRIC_MIN_K, hessian.SYMMETRIC_MIN_K + 33])
def test_gram_is_the_exactly_symmetric_product(k):
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(300, k, generator=gen) + torch.linspace(-3, 3, k)  # off-centre columns
    got = gram(x)
    assert torch.equal(got, got.t())
    assert _rel(got, x.double().t() @ x.double()) < 1e-6


def _calls(gen, k, lengths):
    return [torch.randn(1, n, k, generator=gen) * torch.linspace(0.1, 4, k) for n in lengths]


@pytest.mark.parametrize("k", [40, 600])
@pytest.mark.parametrize("max_rows", [1, 50, 10_000])
def test_batched_equals_one_call_at_a_time(k, max_rows):
    """Flushing after every call, every few calls or once at the end: the same H and cross term
    as adding each call on its own, to float rounding."""
    gen = torch.Generator().manual_seed(1)
    xs = _calls(gen, k, [7, 31, 1, 64, 20, 3])
    refs = [x + 0.2 * torch.randn(x.shape, generator=gen) for x in xs]
    one = HessianAccumulator(k, cross=True)
    for x, r in zip(xs, refs):
        one.add(x, r)
    acc = {"layer": HessianAccumulator(k, cross=True)}
    batch = InputBatch(acc, max_rows=max_rows)
    for x, r in zip(xs, refs):
        batch.record("layer", x, r)
        batch.end_call()
    batch.flush()
    h64, c64 = _reference(xs, refs)
    assert acc["layer"].tokens == one.tokens == sum(x.shape[1] for x in xs)
    assert _rel(acc["layer"].h, one.h) < 1e-6
    assert _rel(acc["layer"].cross, one.cross) < 1e-6
    assert _rel(acc["layer"].h, h64) < 1e-6 and _rel(acc["layer"].cross, c64) < 1e-6


def test_layers_reading_one_tensor_share_one_product(monkeypatch):
    """q/k/v read the same tensor: one product for the three, and the three Hessians bit-equal
    (the runner's grouping compares them with torch.equal)."""
    products = []
    original = hessian.gram
    monkeypatch.setattr(hessian, "gram", lambda x: products.append(x.shape) or original(x))
    gen = torch.Generator().manual_seed(2)
    xs = _calls(gen, 32, [5, 9, 12])
    accs = {name: HessianAccumulator(32) for name in ("q", "k", "v", "o")}
    batch = InputBatch(accs)
    for x in xs:
        for name in ("q", "k", "v"):
            batch.record(name, x)
        batch.record("o", x.clone())  # equal values, other memory: its own product
        batch.end_call()
    batch.flush()
    assert len(products) == 2
    assert torch.equal(accs["q"].h, accs["k"].h) and torch.equal(accs["q"].h, accs["v"].h)
    assert _rel(accs["o"].h, accs["q"].h) < 1e-6
    # a detached view of the same memory counts as the same input (the reference pass detaches)
    products.clear()
    a, b = HessianAccumulator(32), HessianAccumulator(32)
    pair = InputBatch({"a": a, "b": b})
    pair.record("a", xs[0])
    pair.record("b", xs[0].detach())
    pair.flush()
    assert len(products) == 1 and torch.equal(a.h, b.h)


def test_partly_shared_inputs_are_not_merged():
    """Two layers that read the same tensor in one call and different ones in another each get
    their own inputs' Hessian."""
    gen = torch.Generator().manual_seed(3)
    x1, x2, y2 = _calls(gen, 24, [10, 6, 6])
    accs = {"a": HessianAccumulator(24), "b": HessianAccumulator(24)}
    batch = InputBatch(accs)
    batch.record("a", x1)
    batch.record("b", x1)
    batch.end_call()
    batch.record("a", x2)
    batch.record("b", y2)
    batch.flush()
    assert _rel(accs["a"].h, _reference([x1, x2])[0]) < 1e-6
    assert _rel(accs["b"].h, _reference([x1, y2])[0]) < 1e-6
    assert not torch.allclose(accs["a"].h, accs["b"].h)


def test_input_changed_before_the_flush_is_refused():
    x = torch.randn(4, 16)
    batch = InputBatch({"a": HessianAccumulator(16)})
    batch.record("a", x)
    x.mul_(2)
    with pytest.raises(RuntimeError, match="changed in place"):
        batch.flush()


def test_bad_input_is_a_value_error():
    acc = HessianAccumulator(8)
    with pytest.raises(ValueError, match="max_rows"):
        InputBatch({"a": acc}, max_rows=0)
    batch = InputBatch({"a": acc, "c": HessianAccumulator(8, cross=True)})
    with pytest.raises(ValueError, match=r"expected \[\.\.\., 8\]"):
        batch.record("a", torch.randn(3, 9))
    with pytest.raises(ValueError, match="x_ref is given exactly"):
        batch.record("a", torch.randn(3, 8), torch.randn(3, 8))
    with pytest.raises(ValueError, match="x_ref is given exactly"):
        batch.record("c", torch.randn(3, 8))
    with pytest.raises(ValueError, match="same shape"):
        batch.record("c", torch.randn(3, 8), torch.randn(2, 8))
    with pytest.raises(ValueError, match="positive number of tokens"):
        acc.add_products(torch.zeros(8, 8), None, 0)
