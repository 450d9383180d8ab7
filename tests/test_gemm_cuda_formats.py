"""The CUDA kernels on every weight format besides fp16 symmetric INT4 (test_gemm_cuda.py): bf16
activations, 4-bit zero points, groups of 32 and 64, 8-bit weights, against a float64 reference of
A @ dequant(B) built by marlin.packing (the executable spec), on NaN-poisoned outputs. Both
kernels: the planner runs these formats on the small-batch kernel (mma.sync, 256-column tile) at
M <= 8, and M <= 16 on deep layers, and on the tiled kernel elsewhere; the instance tests force
each.

The bound is the one of test_gemm_cuda.py: the kernel's normwise relative error within 1.5x of
torch.matmul's own error in the same dtype on the (rounded) dequantized weights. A wrong zero
point, scale row, group size, byte order or a missing tile gives an error near 1.

Skipped without a GPU (CI compiles the kernels but cannot run them).
"""

import itertools

import pytest
import torch

import marlin
from marlin import packing
from conftest import rel_err, requires_cuda

pytestmark = [requires_cuda, pytest.mark.gpu]

ALLOWED = 1.5  # x torch.matmul's error in the activation dtype

# (dtype, bits, sym, group_size): every format the kernels take besides fp16 sym 4-bit g128 / gcol,
# plus those two in bf16
FORMATS = [
    (torch.float16, 4, True, 64),
    (torch.float16, 4, True, 32),
    (torch.float16, 4, False, 128),
    (torch.float16, 4, False, 64),
    (torch.float16, 4, False, 32),
    (torch.float16, 4, False, -1),
    (torch.float16, 8, True, 128),
    (torch.float16, 8, True, 64),
    (torch.float16, 8, True, -1),
    (torch.bfloat16, 4, True, 128),
    (torch.bfloat16, 4, True, 64),
    (torch.bfloat16, 4, True, 32),
    (torch.bfloat16, 4, True, -1),
    (torch.bfloat16, 4, False, 128),
    (torch.bfloat16, 4, False, 32),
    (torch.bfloat16, 4, False, -1),
    (torch.bfloat16, 8, True, 128),
    (torch.bfloat16, 8, True, 32),
    (torch.bfloat16, 8, True, -1),
]


def fmt_id(f):
    dtype, bits, sym, g = f
    return f"{'bf16' if dtype == torch.bfloat16 else 'fp16'}-u{bits}{'' if sym else '-zero'}-g{g if g > 0 else 'col'}"


FORMAT_IDS = [fmt_id(f) for f in FORMATS]

# (K, N): one tile, odd multiples of the 128 x 128 and 64 x 256 tiles, a 7B and a 70B-wide layer
SHAPES = {
    "128x128": (128, 128),
    "256x384": (256, 384),
    "1152x640": (1152, 640),
    "640x1536": (640, 1536),
    "4096x4096": (4096, 4096),
    "8192x1024": (8192, 1024),
    "16384x768": (16384, 768),
}
M_VALUES = [1, 7, 16, 17, 33, 48, 64, 65, 200, 1000]


class Layer:
    """A random quantized layer on the GPU in one format, and its exact fp32 weights."""

    def __init__(self, k, n, fmt, seed):
        dtype, bits, sym, group = fmt
        gen = torch.Generator(device="cuda")
        gen.manual_seed(seed)
        w = torch.randn(k, n, device="cuda", generator=gen)
        if sym:
            q, s = packing.quantize(w, group, bits=bits, sym=True, dtype=dtype)
            z = None
            self.b_q, self.b_s = packing.pack(q, s, bits=bits)
            self.b_z = None
        else:
            q, s, z = packing.quantize(w, group, bits=bits, sym=False, dtype=dtype)
            self.b_q, self.b_s, self.b_z = packing.pack(q, s, z, bits=bits)
        self.w_exact = packing.dequantize(q, s, z)  # fp32, exact
        self.w_rounded = self.w_exact.to(dtype)
        self.k, self.n, self.dtype, self.bits = k, n, dtype, bits


_layers = {}


def get_layer(k, n, fmt):
    key = (k, n, fmt)
    if key not in _layers:
        _layers.clear()  # one layer at a time on the GPU
        torch.cuda.empty_cache()
        _layers[key] = Layer(k, n, fmt, seed=hash((k, n, fmt_id(fmt))) % 2**31)
    return _layers[key]


def poison_allocator(numel, dtype):
    """The allocator's next block of `numel` elements NaN-filled, so that unwritten outputs show."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    t = torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
    ptr = t.data_ptr()
    del t
    return ptr


def run(layer, a, **kw):
    return marlin.gemm(a, layer.b_q, layer.b_s, b_zeros=layer.b_z, bits=layer.bits, **kw)


def check(layer, m, **kw):
    a = torch.randn(m, layer.k, device="cuda", dtype=layer.dtype)
    ptr = poison_allocator(m * layer.n, layer.dtype)
    c = run(layer, a, **kw)
    assert c.dtype == layer.dtype and c.shape == (m, layer.n)
    assert c.data_ptr() == ptr, "output did not land in the poisoned block; the NaN check would be void"
    ref = a.double() @ layer.w_exact.double()
    base = rel_err(a @ layer.w_rounded, ref)
    err = rel_err(c, ref)
    assert err <= ALLOWED * base + 1e-7, f"M={m} K={layer.k} N={layer.n}: error {err:.3g} vs torch.matmul {base:.3g}"
    return c


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_formats(fmt, shape):
    layer = get_layer(*SHAPES[shape], fmt)
    for m in M_VALUES:
        check(layer, m)


# K and N multiples of 64 only (SmolLM2-135M has widths 576 and 192; tensor-parallel shards): the
# tiled kernel with a partial last column of tiles, and the 64 x 256 tile where K % 128 != 0. Every
# format, the fp16 base ones too, whose group size divides K.
ODD_SHAPES = {"576x192": (576, 192), "192x576": (192, 576), "320x1344": (320, 1344), "1024x1600": (1024, 1600)}
BASE_FORMATS = [(torch.float16, 4, True, 128), (torch.float16, 4, True, -1)]
ODD_CASES = [
    (f, s) for f in FORMATS + BASE_FORMATS for s in ODD_SHAPES if f[3] == -1 or ODD_SHAPES[s][0] % f[3] == 0
]


@pytest.mark.parametrize("fmt,shape", ODD_CASES, ids=[f"{fmt_id(f)}-{s}" for f, s in ODD_CASES])
def test_k_and_n_multiples_of_64(fmt, shape):
    layer = get_layer(*ODD_SHAPES[shape], fmt)
    for m in (1, 8, 16, 33, 100):
        check(layer, m)


# Every tiled instance of every format: both tiles x 16-row blocks (1, 2, 4; 3 runs as 4).
@pytest.mark.parametrize("m_blocks,tile", list(itertools.product([1, 2, 3, 4], [(128, 128), (64, 256)])))
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_every_tiled_instance(fmt, m_blocks, tile):
    layer = get_layer(1024, 640 if tile[1] == 128 else 768, fmt)
    for m in (16 * m_blocks - 1, 16 * m_blocks):
        check(layer, m, tile_k=tile[0], tile_n=tile[1])


@pytest.mark.parametrize("fmt", FORMATS[:3], ids=FORMAT_IDS[:3])
def test_repeated_calls_are_bit_identical(fmt):
    layer = get_layer(4096, 4096, fmt)
    a = torch.randn(33, 4096, device="cuda", dtype=layer.dtype)
    ws = marlin.make_workspace()
    outs = [run(layer, a, workspace=ws) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert int(ws.abs().sum()) == 0


def test_bf16_large_values_do_not_overflow():
    """bf16 keeps fp32's range: activations and scales far beyond fp16's 65504 still give the
    right product (fp32 accumulation, bf16 rounding only at the end)."""
    layer = get_layer(1152, 640, (torch.bfloat16, 4, True, 128))
    a = torch.randn(16, 1152, device="cuda", dtype=torch.bfloat16) * 1e6
    c = run(layer, a)
    ref = a.double() @ layer.w_exact.double()
    assert torch.isfinite(c).all()
    assert rel_err(c, ref) <= ALLOWED * rel_err(a @ layer.w_rounded, ref) + 1e-7


def test_zero_points_matter():
    """The same packed weights with two different zero-point tensors give different results, each
    matching its own reference: the kernel reads b_zeros (not the symmetric 8)."""
    layer = get_layer(1152, 640, (torch.float16, 4, False, 128))
    a = torch.randn(5, 1152, device="cuda", dtype=torch.float16)
    c1 = run(layer, a)
    shifted = (layer.b_z.float() + 1).clamp(max=15).to(layer.b_z.dtype)
    c2 = marlin.gemm(a, layer.b_q, layer.b_s, b_zeros=shifted, bits=4)
    assert rel_err(c1, c2.float()) > 1e-2


# Every small-batch instance of the other formats: slices of 8 and 16 rows (larger M runs as several
# 16-row slices), 256 columns; per-column zero points run on the tiled kernel only.
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_every_small_batch_instance(fmt):
    layer = get_layer(1152, 1536, fmt)
    if not fmt[2] and fmt[3] == -1:
        a = torch.randn(4, 1152, device="cuda", dtype=fmt[0])
        with pytest.raises(RuntimeError, match="per-column zero points not at all"):
            run(layer, a, tile_k=128, tile_n=256)
        return
    for m in (1, 5, 8, 9, 16, 40):
        check(layer, m, tile_k=128, tile_n=256)


def test_small_batch_512_tile_refuses_new_formats_clearly():
    """The 512-column small-batch tile runs fp16 symmetric INT4 only: forcing it on another format
    is an error that says so (the default plan never picks it there)."""
    layer = get_layer(1152, 1536, (torch.bfloat16, 4, True, 128))
    a = torch.randn(4, 1152, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="tile_n=256 only"):
        run(layer, a, tile_k=128, tile_n=512)


def test_default_plans_use_both_kernels():
    """MARLIN_LOG_PLAN=1 in a subprocess: the format tests above ran on the small-batch and on
    the tiled kernel."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MARLIN_LOG_PLAN="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-s", "-p", "no:cacheprovider", "-k",
           "test_formats and (4096x4096 or 16384x768) and (bf16-u4-g128 or fp16-u4-zero-g32 or fp16-u8-g128)"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    kernels = set(re.findall(r"^marlin\.gemm plan: .* kernel=(\w+)", r.stderr, re.M))
    assert kernels == {"small_m", "tiled"}, kernels
