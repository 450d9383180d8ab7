"""Gradients through the ops and the layers: with respect to the activations, against float64
G @ W^T where W is the dequantized weight from the quantizer's own outputs (not the backward's
unpacking); the weights, scales and zero points refused as things to differentiate. CPU, and the
CUDA kernels where there is a GPU (the backward is the same Python either way)."""

import pytest
import torch

import marlin
from marlin import packing, sparse
from conftest import random_layer, requires_cuda

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
# (M, K, N, group, bits, sym, dtype): K != N so that a transposed weight cannot pass; every format
FORMATS = [
    (5, 256, 128, 128, 4, True, torch.float16),
    (3, 128, 192, -1, 4, True, torch.bfloat16),
    (4, 192, 128, 64, 4, False, torch.float16),
    (2, 128, 256, 32, 4, False, torch.bfloat16),
    (6, 256, 128, 128, 8, True, torch.float16),
    (1, 128, 64, -1, 8, True, torch.bfloat16),
]


def _check_grad(got: torch.Tensor, g: torch.Tensor, w: torch.Tensor, dtype: torch.dtype):
    """got against float64 G @ W^T: relative Frobenius error within the dtype's rounding of a
    float32 product (bf16 keeps 8 bits, fp16 11), far below what a wrong scale, zero point,
    permutation or a missing row would give (order 1)."""
    ref = g.double() @ w.double().t()
    assert got.dtype == dtype and got.shape == ref.shape
    assert torch.isfinite(got).all()
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err < (8e-3 if dtype == torch.bfloat16 else 1e-3), err


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,k,n,g,bits,sym,dtype", FORMATS)
def test_gemm_grad_a(m, k, n, g, bits, sym, dtype, device):
    layer = random_layer(k, n, g, device, seed=m * 7 + k, bits=bits, sym=sym, dtype=dtype)
    w = packing.dequantize(layer[0], layer[1], None if sym else layer[4])  # the quantizer's W [K, N]
    b_z = None if sym else layer[5]
    a = torch.randn(m, k, device=device).to(dtype).requires_grad_()
    c = marlin.gemm(a, layer[2], layer[3], b_zeros=b_z, bits=bits)
    grad_out = torch.randn_like(c)
    (c * grad_out).sum().backward()
    _check_grad(a.grad, grad_out, w, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sym,dtype,g", [(True, torch.float16, 128), (False, torch.bfloat16, 64)])
def test_gemm_2_4_grad_a(sym, dtype, g, device):
    k, n, m = 256, 128, 5
    gen = torch.Generator().manual_seed(3)
    w_dense = sparse.prune_2_4(torch.randn(k, n, generator=gen))
    packed = sparse.quantize_and_pack_2_4(w_dense, g, dtype=dtype, sym=sym)
    # W from the quantizer itself, masked to the kept positions (what the format stores)
    parts = packing.quantize(w_dense, g, sym=sym, dtype=dtype)
    w = packing.dequantize(*parts) * (w_dense != 0)
    a = torch.randn(m, k).to(dtype).to(device).requires_grad_()
    args = [t.to(device) for t in packed]
    c = marlin.gemm_2_4(a, args[0], args[1], args[2], b_zeros=None if sym else args[3])
    grad_out = torch.randn_like(c)
    (c * grad_out).sum().backward()
    _check_grad(a.grad.cpu(), grad_out.cpu(), w, dtype)


def test_layer_grad_reaches_input_through_act_order_and_bias():
    """A GPTQ act-order layer (MarlinLinear with its input permutation) with a bias, behind a
    trainable adapter: x's gradient is G @ W^T in the input's natural order, and the adapter's
    weight gets its gradient through the quantized layer (what training on top of a quantized
    model needs). W from the GPTQ writer's own dequantization."""
    from gptq_writer import random_layer as gptq_layer

    k, n = 256, 384
    ref = gptq_layer(k, n, 64, seed=5, act_order=True, bias=True)
    t = ref.tensors("gptq")
    layer = marlin.MarlinLinear.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], t["bias"], group_size=64)
    assert layer.perm is not None
    w = ref.dequantize()  # [K, N] float32, natural input order
    torch.manual_seed(0)
    adapter = torch.nn.Linear(k, k, bias=False).half()
    x = torch.randn(3, k, dtype=torch.float16, requires_grad=True)
    h = adapter(x)
    h.retain_grad()
    y = layer(h)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    _check_grad(h.grad, grad_out, w, torch.float16)
    expect = (grad_out.double() @ w.double().t()).t() @ x.detach().double()  # dL/d(adapter.weight)
    got = adapter.weight.grad.double()
    assert ((got - expect).norm() / expect.norm()).item() < 2e-3
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_weight_gradients_are_refused():
    _, _, b_q, b_s = random_layer(128, 128, 128, seed=1)
    a = torch.randn(2, 128).half().requires_grad_()
    with pytest.raises(ValueError, match=r"marlin.gemm: b_scales.requires_grad is True.*with respect to `a` only"):
        marlin.gemm(a, b_q, b_s.clone().requires_grad_())
    packed = sparse.quantize_and_pack_2_4(sparse.prune_2_4(torch.randn(128, 128)), 128, sym=False)
    with pytest.raises(ValueError, match=r"marlin.gemm_2_4: b_zeros.requires_grad is True"):
        marlin.gemm_2_4(a, packed[0], packed[1], packed[2], b_zeros=packed[3].clone().requires_grad_())
    # without grad mode nothing is refused (inference on tensors that happen to require grad)
    with torch.no_grad():
        marlin.gemm(a, b_q, b_s.clone().requires_grad_())


def test_backward_under_compile_and_opcheck():
    """torch.compile(fullgraph=True) traces the backward too (the dequantization is an opaque op
    with a fake kernel), with the eager gradient; the dequantization ops pass opcheck."""
    _, _, b_q, b_s, _, b_z = random_layer(256, 128, 64, seed=9, sym=False, dtype=torch.bfloat16)

    def f(x):
        return torch.relu(marlin.gemm(x * 2, b_q, b_s, b_zeros=b_z)).sum()

    x = torch.randn(3, 256).bfloat16().requires_grad_()
    f(x).backward()
    eager = x.grad.clone()
    x.grad = None
    torch.compile(f, fullgraph=True, backend="aot_eager")(x).backward()
    assert torch.equal(x.grad, eager)
    torch.library.opcheck(torch.ops.marlin.dequantize_weight.default, (b_q, b_s, b_z, 4))
    packed = sparse.quantize_and_pack_2_4(sparse.prune_2_4(torch.randn(128, 128)), 128)
    torch.library.opcheck(torch.ops.marlin.dequantize_weight_2_4.default, (*packed, None))
