"""Bad inputs raise an error that names the argument, its value and what was expected."""

import pytest
import torch

from conftest import random_layer


@pytest.fixture(scope="module")
def layer():
    _, _, b_q, b_s = random_layer(256, 256, 128, seed=0)
    return b_q, b_s


def a16(m=4, k=256):
    return torch.randn(m, k).half()


def call(a, b_q, b_s, **kw):
    return torch.ops.marlin.gemm(
        a, b_q, b_s, kw.get("b_zeros"), kw.get("workspace"), kw.get("tile_k"), kw.get("tile_n"), kw.get("bits", 4)
    )


def zeros_like_scales(b_s):
    return torch.full_like(b_s, 8)


CASES = [
    ("a float32", lambda b_q, b_s: (a16().float(), b_q, b_s, {}), r"a\.dtype = Float, expected torch\.float16 or torch\.bfloat16"),
    ("a bf16, scales fp16", lambda b_q, b_s: (a16().bfloat16(), b_q, b_s, {}), r"b_scales\.dtype = Half but a\.dtype = BFloat16, expected the same dtype \(no implicit cast\)"),
    ("a fp16, scales bf16", lambda b_q, b_s: (a16(), b_q, b_s.bfloat16(), {}), r"b_scales\.dtype = BFloat16 but a\.dtype = Half"),
    ("a 3-D", lambda b_q, b_s: (a16().unsqueeze(0), b_q, b_s, {}), r"a\.dim\(\) = 3, expected 2"),
    ("K mismatch", lambda b_q, b_s: (a16(k=128), b_q, b_s, {}), r"a\.size\(1\) = 128, expected K = b_q\.size\(0\) \* 16 = 256"),
    ("b_q float", lambda b_q, b_s: (a16(), b_q.float(), b_s, {}), r"b_q\.dtype = Float, expected torch\.int32"),
    ("b_q odd width", lambda b_q, b_s: (a16(), b_q[:, :-1].contiguous(), b_s, {}), r"b_q\.size\(1\) = 511, expected 2\*N for bits = 4"),
    ("b_q width not 4N for 8 bits", lambda b_q, b_s: (a16(), b_q[:, :-2].contiguous(), b_s, {"bits": 8}), r"b_q\.size\(1\) = 510, expected 4\*N for bits = 8"),
    ("bits 3", lambda b_q, b_s: (a16(), b_q, b_s, {"bits": 3}), r"bits = 3, expected 4 or 8"),
    ("K not multiple of 64", lambda b_q, b_s: (a16(k=32), b_q[:2].contiguous(), b_s[:1].contiguous(), {}), r"K = 32, expected a positive multiple of 64"),
    ("N not multiple of 64", lambda b_q, b_s: (a16(), b_q[:, :64].contiguous(), b_s[:, :32].contiguous(), {}), r"N = b_q\.size\(1\) / 2 = 32, expected a positive multiple of 64"),
    ("scales fp32", lambda b_q, b_s: (a16(), b_q, b_s.float(), {}), r"b_scales\.dtype = Float but a\.dtype = Half"),
    ("scales wrong N", lambda b_q, b_s: (a16(), b_q, b_s[:, :128].contiguous(), {}), r"b_scales\.size\(1\) = 128, expected N = 256"),
    ("scales wrong groups", lambda b_q, b_s: (a16(), b_q, torch.ones(3, 256).half(), {}), r"b_scales\.size\(0\) = 3, expected 1 \(per-column scales\) or K / group_size with group_size 32, 64 or 128 \(K = 256: 8, 4 or 2\)"),
    ("group 16", lambda b_q, b_s: (a16(), b_q, torch.ones(16, 256).half(), {}), r"b_scales\.size\(0\) = 16, expected 1"),
    ("scales 1-D", lambda b_q, b_s: (a16(), b_q, b_s[0].contiguous(), {}), r"b_scales\.dim\(\) = 1, expected 2"),
    ("b_q non-contiguous", lambda b_q, b_s: (a16(), b_q.t().contiguous().t(), b_s, {}), r"b_q must be contiguous"),
    ("scales non-contiguous", lambda b_q, b_s: (a16(), b_q, b_s.t().contiguous().t(), {}), r"b_scales must be contiguous"),
    ("zero points with 8 bits", lambda b_q, b_s: (a16(), b_q[:, :256].contiguous(), b_s[:, :64].contiguous(), {"bits": 8, "b_zeros": zeros_like_scales(b_s[:, :64])}), r"b_zeros was given with bits = 8; zero points are supported for 4-bit weights only"),
    ("zero points wrong dtype", lambda b_q, b_s: (a16(), b_q, b_s, {"b_zeros": zeros_like_scales(b_s).float()}), r"b_zeros\.dtype = Float but a\.dtype = Half"),
    ("zero points wrong shape", lambda b_q, b_s: (a16(), b_q, b_s, {"b_zeros": torch.full((1, 256), 8.0).half()}), r"b_zeros shape \[1, 256\], expected the shape of b_scales \[2, 256\]"),
    ("zero points non-contiguous", lambda b_q, b_s: (a16(), b_q, b_s, {"b_zeros": zeros_like_scales(b_s).t().contiguous().t()}), r"b_zeros must be contiguous"),
    ("workspace dtype", lambda b_q, b_s: (a16(), b_q, b_s, {"workspace": torch.zeros(8)}), r"workspace\.dtype = Float, expected torch\.int32"),
    ("unknown tile", lambda b_q, b_s: (a16(), b_q, b_s, {"tile_k": 32, "tile_n": 32}), r"\(tile_k, tile_n\) = \(32, 32\), expected \(128, 128\), \(64, 256\), \(128, 256\) or \(128, 512\)"),
    ("half a tile", lambda b_q, b_s: (a16(), b_q, b_s, {"tile_k": 128}), r"give both tile_k and tile_n"),
]


@pytest.mark.parametrize("name,make,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(layer, name, make, match):
    a, b_q, b_s, kw = make(*layer)
    with pytest.raises(RuntimeError, match=match):
        call(a, b_q, b_s, **kw)


def test_tile_that_does_not_divide_is_refused():
    _, _, b_q, b_s = random_layer(256, 384, 128, seed=1)
    with pytest.raises(RuntimeError, match=r"N = 384 do not divide into tile_k = 64, tile_n = 256"):
        call(torch.randn(2, 256).half(), b_q, b_s, tile_k=64, tile_n=256)


@pytest.mark.parametrize("bad", [-1.0, 16.0, 7.5])
def test_cpu_refuses_zero_points_outside_the_format(layer, bad):
    b_q, b_s = layer
    z = torch.full_like(b_s, 8)
    z[1, 5] = bad
    with pytest.raises(RuntimeError, match=r"b_zeros holds .* at flat index 261, expected integer zero points in \[0, 15\]"):
        call(a16(), b_q, b_s, b_zeros=z)


def test_meta_tensors_give_the_same_errors(layer):
    b_q, b_s = (t.to("meta") for t in layer)
    with pytest.raises(Exception, match=r"a\.size\(1\) = 128, expected K"):
        torch.ops.marlin.gemm(torch.empty(4, 128, dtype=torch.float16, device="meta"), b_q, b_s)
    out = torch.ops.marlin.gemm(torch.empty(4, 256, dtype=torch.float16, device="meta"), b_q, b_s)
    assert out.shape == (4, 256) and out.dtype == torch.float16
