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
    return torch.ops.marlin.gemm(a, b_q, b_s, kw.get("b_zeros"), kw.get("workspace"), kw.get("tile_k"), kw.get("tile_n"))


CASES = [
    ("a float32", lambda b_q, b_s: (a16().float(), b_q, b_s, {}), r"a\.dtype = Float, expected torch\.float16"),
    ("a bf16", lambda b_q, b_s: (a16().bfloat16(), b_q, b_s, {}), r"a\.dtype = BFloat16"),
    ("a 3-D", lambda b_q, b_s: (a16().unsqueeze(0), b_q, b_s, {}), r"a\.dim\(\) = 3, expected 2"),
    ("K mismatch", lambda b_q, b_s: (a16(k=128), b_q, b_s, {}), r"a\.size\(1\) = 128, expected K = b_q\.size\(0\) \* 16 = 256"),
    ("b_q float", lambda b_q, b_s: (a16(), b_q.float(), b_s, {}), r"b_q\.dtype = Float, expected torch\.int32"),
    ("b_q odd width", lambda b_q, b_s: (a16(), b_q[:, :-1].contiguous(), b_s, {}), r"b_q\.size\(1\) = 511, expected 2\*N"),
    ("K not multiple of 128", lambda b_q, b_s: (a16(k=64), b_q[:4].contiguous(), b_s, {}), r"K = 64, expected a positive multiple of 128"),
    ("N not multiple of 128", lambda b_q, b_s: (a16(), b_q[:, :128].contiguous(), b_s[:, :64].contiguous(), {}), r"N = b_q\.size\(1\) / 2 = 64, expected a positive multiple of 128"),
    ("scales fp32", lambda b_q, b_s: (a16(), b_q, b_s.float(), {}), r"b_scales\.dtype = Float, expected torch\.float16"),
    ("scales wrong N", lambda b_q, b_s: (a16(), b_q, b_s[:, :128].contiguous(), {}), r"b_scales\.size\(1\) = 128, expected N = 256"),
    ("scales wrong groups", lambda b_q, b_s: (a16(), b_q, torch.ones(3, 256).half(), {}), r"b_scales\.size\(0\) = 3, expected 1 \(per-column scales\) or K / 128 = 2"),
    ("scales 1-D", lambda b_q, b_s: (a16(), b_q, b_s[0].contiguous(), {}), r"b_scales\.dim\(\) = 1, expected 2"),
    ("b_q non-contiguous", lambda b_q, b_s: (a16(), b_q.t().contiguous().t(), b_s, {}), r"b_q must be contiguous"),
    ("scales non-contiguous", lambda b_q, b_s: (a16(), b_q, b_s.t().contiguous().t(), {}), r"b_scales must be contiguous"),
    ("zero points", lambda b_q, b_s: (a16(), b_q, b_s, {"b_zeros": torch.zeros(2, 256).half()}), r"zero points are not supported"),
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


def test_meta_tensors_give_the_same_errors(layer):
    b_q, b_s = (t.to("meta") for t in layer)
    with pytest.raises(Exception, match=r"a\.size\(1\) = 128, expected K"):
        torch.ops.marlin.gemm(torch.empty(4, 128, dtype=torch.float16, device="meta"), b_q, b_s)
    out = torch.ops.marlin.gemm(torch.empty(4, 256, dtype=torch.float16, device="meta"), b_q, b_s)
    assert out.shape == (4, 256) and out.dtype == torch.float16
