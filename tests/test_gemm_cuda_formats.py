"""The CUDA kernels on every weight format besides fp16 symmetric INT4 (test_gemm_cuda.py): bf16
activations, 4-bit zero points, groups of 32 and 64, 8-bit weights, against a float64 reference of
A @ dequant(B) built by marlin.packing (the executable spec), on NaN-poisoned outputs. Both
kernels: the planner runs these formats on the small-batch kernel (256-column tile) at M <= 8,
and M <= 16 on deep layers, with mma.sync, on H100/H200 (sm_90a build) also where it runs the
fp16 base format with wgmma (M > 8), and on the tiled kernel elsewhere; the instance tests force
each, and the plan log shows which ran.

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
from conftest import poison_allocator, rel_err, requires_cuda, wgmma_device

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


# The 8-row instances built for one block per SM (the group-sum ones of bf16 and zero points) run
# only where each SM streams at least 8 stages (marlin_gemm.cu's one_block_regs_pay), which none of
# SHAPES reaches: 32 x 48 tiles of 128 x 256 (1536 stages), and one more column of 64 (a partial
# last tile).
ONE_BLOCK_SHAPES = {"4096x12288": (4096, 12288), "4096x12352": (4096, 12352)}
GROUPED_U4 = [f for f in FORMATS if f[1] == 4 and f[3] > 0]


@pytest.mark.parametrize("shape", list(ONE_BLOCK_SHAPES), ids=list(ONE_BLOCK_SHAPES))
@pytest.mark.parametrize("fmt", GROUPED_U4, ids=[fmt_id(f) for f in GROUPED_U4])
def test_one_block_group_sum_instances(fmt, shape):
    layer = get_layer(*ONE_BLOCK_SHAPES[shape], fmt)
    for m in (1, 5, 8):
        check(layer, m)


# K and N multiples of 64 only (SmolLM2-135M has widths 576 and 192; tensor-parallel shards): the
# tiled kernel with a partial last column of tiles, the 64 x 256 tile where K % 128 != 0, and (the
# other formats, 1024x1600) the small-batch kernel's partial last tile. Every format, the fp16 base
# ones too, whose group size divides K.
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


@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "zero"])
def test_bf16_large_values_do_not_overflow(m, sym):
    """bf16 keeps fp32's range: activations far beyond fp16's 65504 still give the right product
    (fp32 accumulation, bf16 rounding only at the end), on the 8-row group-sum path (1-8 rows,
    whose raw sums run up to 136x the products) as on the 16-row one."""
    layer = get_layer(1152, 640, (torch.bfloat16, 4, sym, 128))
    a = torch.randn(m, 1152, device="cuda", dtype=torch.bfloat16) * 1e30
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


# Every small-batch instance of the other formats: slices of 8 and 16 rows with mma.sync (larger M
# runs as several 16-row slices; on H100/H200 M > 8 takes the wgmma variant, see test_wgmma_formats),
# 256 columns; per-column zero points run on the tiled kernel only.
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
    # on H100/H200 the wgmma variant takes these formats above 64 rows as it does fp16 g128, and
    # the prefill kernel 4096 x 4096 at 1000 rows (128 tiles of 128 x 256 on 132 SMs)
    assert kernels == {"small_m", "tiled"} | ({"small_m_wgmma", "prefill_wgmma"} if wgmma_device() else set()), kernels


@pytest.mark.parametrize("group_sums", ["1", "0"])
def test_group_sums_plans(group_sums):
    """Zero points (fp16, bf16) and bf16 in groups of 128 at 1-8 rows run the raw group-sum
    instances (plan log group_sums=1; scale and zero point applied to each group's sums), and with
    MARLIN_GROUP_SUMS=0 the run-time-group instances that dequantize every weight: both pass
    test_formats and the partial last tile test, in a subprocess that reads the plans, so that
    neither path goes untested. Groups of 64 / 32 take it on the one-block instances only."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MARLIN_LOG_PLAN="1", MARLIN_GROUP_SUMS=group_sums)
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-s", "-p", "no:cacheprovider", "-k",
           "(test_formats or test_small_batch_partial_last_tile or test_one_block_group_sum_instances) and "
           "(fp16-u4-zero-g128 or bf16-u4-zero-g128 or bf16-u4-g128 or bf16-u4-g64 or fp16-u4-zero-g32 or fp16-u4-g64)"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    plans = re.findall(r"^marlin\.gemm plan: m=(\d+) .* kernel=(\w+) .*$", r.stderr, re.M)
    lines = [l for l in r.stderr.splitlines() if l.startswith("marlin.gemm plan:")]
    assert lines and len(plans) == len(lines)
    small = [l for l in lines if " m_blocks=1 kernel=small_m " in l]
    assert small, "no call ran the 8-row mma.sync slice"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    one_block = 0
    for line in lines:
        sums = " group_sums=1" in line
        m, n, k, groups = (int(v) for v in re.search(r" m=(\d+) n=(\d+) k=(\d+) groups=(-?\d+) ", line).groups())
        # the twins without the 128-register bound where one block per SM streams >= 8 stages;
        # groups of 64 / 32 take group sums there only
        stages = -(-m // 8) * -(-n // 256) * (k // 128)
        ob = line in small and " blocks_per_sm=1 " in line and stages >= 8 * sms
        expected = group_sums == "1" and line in small and groups > 1 and (k == 128 * groups or ob)
        assert sums == expected, line
        assert (" one_block_regs=1" in line) == (expected and ob), line
        one_block += expected and ob
    assert one_block or group_sums == "0"




# The wgmma variant of the small-batch kernel (H100/H200) on every format it runs (all but
# per-column zero points, which stay on the tiled kernel): M in each of its slice classes (16, 32,
# 64 rows, above 64 rows 64 or 128) and M not a multiple of 8, forced onto its 256-column tile;
# and the default plan on a layer large enough (190 KB of weights per SM) for the planner to pick
# it at M = 9-128. On other GPUs the same calls run with mma.sync or the tiled kernel.
# test_plans_of_the_wgmma_format_tests runs both in a subprocess and reads the plans, so that a silent
# fallback to another kernel fails.
WG_M = [9, 13, 16, 17, 27, 32, 33, 50, 64, 65, 100, 128]
WG_FORMATS = [f for f in FORMATS if f[2] or f[3] != -1]
WG_IDS = [fmt_id(f) for f in WG_FORMATS]
WG_DEFAULT_M = [12, 16, 24, 48, 64, 96, 128]


@pytest.mark.parametrize("fmt", WG_FORMATS, ids=WG_IDS)
def test_wgmma_formats(fmt):
    layer = get_layer(1152, 1536, fmt)
    for m in WG_M:
        check(layer, m, tile_k=128, tile_n=256)


@pytest.mark.parametrize("fmt", WG_FORMATS, ids=WG_IDS)
def test_wgmma_default_plan(fmt):
    layer = get_layer(4096, 12288, fmt)
    for m in WG_DEFAULT_M:
        check(layer, m)


@pytest.mark.parametrize("rows", ["64", "128"])
def test_plans_of_the_wgmma_format_tests(rows):
    """The two tests above in a subprocess with the plan log (MARLIN_LOG_PLAN=1) and the slices above
    64 rows forced to 64 or 128 rows (MARLIN_WG_SLICE): every call with M > 8 ran the wgmma variant
    with the slice the M class asks for (m_blocks = rows / 8), on every format. The prefill kernel,
    which takes the default plan's 96 and 128 rows by default, is kept off (MARLIN_PREFILL=0)."""
    import os
    import re
    import subprocess
    import sys

    if not wgmma_device():
        pytest.skip("the wgmma variant runs on compute capability 9.0 only")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MARLIN_LOG_PLAN="1", MARLIN_WG_SLICE=rows, MARLIN_PREFILL="0")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-s", "-p", "no:cacheprovider", "-k",
           "test_wgmma_formats or test_wgmma_default_plan"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and re.search(rf"\b{2 * len(WG_FORMATS)} passed", r.stdout), r.stdout[-3000:] + r.stderr[-3000:]
    plans = re.findall(r"^marlin\.gemm plan: m=(\d+) .* dtype=(\w+) bits=(\d) zeros=(\d) .* m_blocks=(\d+) kernel=(\w+) ",
                       r.stderr, re.M)
    expected_calls = len(WG_FORMATS) * (len(WG_M) + len(WG_DEFAULT_M))
    assert len(plans) == expected_calls, (len(plans), expected_calls, r.stderr[-3000:])
    formats = set()
    for m, dtype, bits, zeros, m_blocks, kernel in plans:
        m = int(m)
        want = 2 if m <= 16 else 4 if m <= 32 else 8 if m <= 64 else int(rows) // 8
        assert kernel == "small_m_wgmma" and int(m_blocks) == want, (m, dtype, bits, zeros, m_blocks, kernel)
        formats.add((dtype, bits, zeros))
    assert formats == {("bf16", "4", "0"), ("bf16", "4", "1"), ("bf16", "8", "0"), ("fp16", "4", "0"),
                       ("fp16", "4", "1"), ("fp16", "8", "0")}, formats


@pytest.mark.parametrize("fixed", ["1", "0"])
def test_fixed_g128_plans(fixed):
    """Zero points (fp16, bf16) in groups of 128 at every wgmma slice run the instances with the
    group size fixed at 128 (plan log fixed_g128=1), and with MARLIN_FMT_G128=0 the run-time-group
    ones that groups of 64 / 32 run: both pass the wgmma
    format tests and the partial-tile test (slices above 64 rows forced to 128 rows, so that
    16-, 32-, 64- and 128-row slices all run), in a subprocess that reads the plans."""
    import os
    import re
    import subprocess
    import sys

    if not wgmma_device():
        pytest.skip("the wgmma variant runs on compute capability 9.0 only")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MARLIN_LOG_PLAN="1", MARLIN_FMT_G128=fixed, MARLIN_PREFILL="0", MARLIN_WG_SLICE="128")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-s", "-p", "no:cacheprovider", "-k",
           "(test_wgmma_formats or test_wgmma_default_plan or test_small_batch_partial_last_tile) and "
           "(fp16-u4-zero-g128 or bf16-u4-zero-g128 or bf16-u4-g128)"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and re.search(r"\b15 passed", r.stdout), r.stdout[-3000:] + r.stderr[-3000:]
    lines = [l for l in r.stderr.splitlines() if l.startswith("marlin.gemm plan:")]
    fixed_seen = {2: 0, 4: 0, 8: 0, 16: 0}
    for line in lines:
        zeros, m_blocks, kernel = re.search(r" zeros=(\d) .* m_blocks=(\d+) kernel=(\w+) ", line).groups()
        m_blocks = int(m_blocks)
        expected = fixed == "1" and kernel == "small_m_wgmma" and zeros == "1"
        assert (" fixed_g128=1" in line) == expected, line
        if expected:
            fixed_seen[m_blocks] += 1
    # every wgmma slice (16, 32, 64, 128 rows) ran a fixed-group-128 instance
    assert fixed == "0" or all(fixed_seen.values()), fixed_seen


# The wgmma variant's 128-column tile for zero points (fp16, bf16) and bf16 in groups of 128 at
# 17-64 rows: the planner takes it on a layer as small as 4096 x 4096 (as for fp16 group 128), and
# N = 4160 (32 tiles of 128 columns and one chunk of 64) gives its 32-row slice a partial last tile.
NARROW_FORMATS = [(torch.float16, 4, False, 128), (torch.bfloat16, 4, False, 128), (torch.bfloat16, 4, True, 128)]
NARROW_M = [17, 24, 32, 33, 48, 64]


@pytest.mark.parametrize("n", [4096, 4160])
@pytest.mark.parametrize("fmt", NARROW_FORMATS, ids=[fmt_id(f) for f in NARROW_FORMATS])
def test_narrow_tile_formats(fmt, n):
    layer = get_layer(4096, n, fmt)
    for m in NARROW_M:
        if n % 128 == 0 or m <= 32:
            check(layer, m)


@pytest.mark.parametrize("forced", ["", "128"])
def test_plans_of_the_narrow_tile_tests(forced):
    """The test above in a subprocess with the plan log: at 17-64 rows these formats ran the wgmma
    variant's 128-column tile (the planner's rule, and MARLIN_WG_TILE_N=128); and with the tile
    forced, the wgmma format tests (every format, 16-128 rows) still pass, the formats without a
    128-column instance on the 256-column tile."""
    import os
    import re
    import subprocess
    import sys

    if not wgmma_device():
        pytest.skip("the wgmma variant runs on compute capability 9.0 only")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MARLIN_LOG_PLAN="1", MARLIN_PREFILL="0")
    tests = "test_narrow_tile_formats"
    if forced:
        env["MARLIN_WG_TILE_N"] = forced
        tests += " or test_wgmma_formats"
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-s", "-p", "no:cacheprovider", "-k", tests]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    n_tests = 2 * len(NARROW_FORMATS) + (len(WG_FORMATS) if forced else 0)
    assert r.returncode == 0 and re.search(rf"\b{n_tests} passed", r.stdout), r.stdout[-3000:] + r.stderr[-3000:]
    lines = [l for l in r.stderr.splitlines() if l.startswith("marlin.gemm plan:")]
    narrow_seen = 0
    for line in lines:
        m, n, k, groups, dtype, bits, zeros, tile_n, m_blocks, kernel = re.search(
            r" m=(\d+) n=(\d+) k=(\d+) groups=(-?\d+) dtype=(\w+) bits=(\d) zeros=(\d) .* tile_n=(\d+) m_blocks=(\d+) kernel=(\w+) ",
            line).groups()
        fmt_ok = int(k) == 128 * int(groups) and bits == "4" and (zeros == "1" or dtype == "bf16")
        if kernel == "small_m_wgmma" and (m_blocks in ("4", "8") or (m_blocks == "2" and forced)) and fmt_ok:
            # the planner's rule takes 128 columns on this small layer (forced: everywhere it can,
            # 16-row slices included, there with two blocks per SM)
            assert tile_n == "128", line
            narrow_seen += 1
        elif kernel == "small_m_wgmma":
            assert tile_n == "256", line
    assert narrow_seen, r.stderr[-3000:]


# The same formats at 9-16 rows (one 16-row slice): the 128-column tile with two blocks per SM on
# layers of at most 24 tiles of 256 columns (marlin_gemm.cu, kFmtTwoMaxTiles): 8192 x 4096, and a
# partial last tile (N = 4160 is 32 tiles of 128 columns and one chunk of 64); 8192 x 8192 (32
# tiles) keeps the 256-column tile, where fp16 group 128 takes the narrow one.
NARROW16_M = [9, 12, 16]
NARROW16_N = [4096, 4160, 8192]


@pytest.mark.parametrize("n", NARROW16_N)
@pytest.mark.parametrize("fmt", NARROW_FORMATS, ids=[fmt_id(f) for f in NARROW_FORMATS])
def test_narrow16_tile_formats(fmt, n):
    layer = get_layer(8192, n, fmt)
    for m in NARROW16_M:
        check(layer, m)


@pytest.mark.parametrize("knob", ["1", "0"])
def test_plans_of_the_narrow16_tile_test(knob):
    """The test above in a subprocess with the plan log: every call ran the wgmma variant's
    16-row slice, on the 128-column tile with two blocks per SM where N <= 6144, else (and with
    MARLIN_WG16_NARROW_TWO=0 everywhere) on the 256-column tile."""
    import os
    import re
    import subprocess
    import sys

    if not wgmma_device():
        pytest.skip("the wgmma variant runs on compute capability 9.0 only")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MARLIN_LOG_PLAN="1", MARLIN_PREFILL="0", MARLIN_WG16_NARROW_TWO=knob)
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-s", "-p", "no:cacheprovider", "-k",
           "test_narrow16_tile_formats"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    n_tests = len(NARROW16_N) * len(NARROW_FORMATS)
    assert r.returncode == 0 and re.search(rf"\b{n_tests} passed", r.stdout), r.stdout[-3000:] + r.stderr[-3000:]
    lines = [l for l in r.stderr.splitlines() if l.startswith("marlin.gemm plan:")]
    assert len(lines) == n_tests * len(NARROW16_M), (len(lines), r.stderr[-3000:])
    narrow_seen = 0
    for line in lines:
        assert " kernel=small_m_wgmma " in line and " m_blocks=2 " in line, line
        n = int(re.search(r" n=(\d+) ", line).group(1))
        if knob == "1" and n <= 6144:
            assert " tile_n=128 " in line and " blocks_per_sm=2 " in line, line
            narrow_seen += 1
        else:
            assert " tile_n=256 " in line, line
    assert narrow_seen == (2 * len(NARROW_FORMATS) * len(NARROW16_M) if knob == "1" else 0)


# The small-batch instances of the other formats with 8-row mma.sync slices and 16- or 32-row wgmma
# slices take N a multiple of 64: a partial last tile of 1, 2 or 3 chunks of 64 columns (N = 5504 is
# Llama-2-7B's MLP width 11008 split over 2 GPUs). A forced tile must divide N (the op's contract),
# so the planner's own choice runs them, on a layer large enough (169-173 KB of weights per SM on
# 132 SMs) for the wgmma variant at 9-32 rows; test_plans_of_the_partial_tile_test reads the plans.
PARTIAL_N = [5440, 5504, 5568]  # 21 tiles of 256 columns + 1, 2, 3 chunks
PARTIAL_M = [1, 5, 8, 13, 16, 27, 32, 40]


@pytest.mark.parametrize("n", PARTIAL_N)
@pytest.mark.parametrize("fmt", WG_FORMATS, ids=WG_IDS)
def test_small_batch_partial_last_tile(fmt, n):
    layer = get_layer(8192, n, fmt)
    for m in PARTIAL_M:
        check(layer, m)


def test_plans_of_the_partial_tile_test():
    """The test above in a subprocess with the plan log: M <= 8 ran the small-batch kernel (8-row
    mma.sync slices; 8-bit weights its wgmma variant on H100/H200), M = 9-32 its wgmma variant on H100/H200 (the tiled kernel elsewhere), M = 40 the
    tiled kernel (64-row slices need whole tiles)."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, MARLIN_LOG_PLAN="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-s", "-p", "no:cacheprovider", "-k",
           "test_small_batch_partial_last_tile"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    n_tests = len(WG_FORMATS) * len(PARTIAL_N)
    assert r.returncode == 0 and re.search(rf"\b{n_tests} passed", r.stdout), r.stdout[-3000:] + r.stderr[-3000:]
    plans = re.findall(r"^marlin\.gemm plan: m=(\d+) n=(\d+) .* bits=(\d) .* m_blocks=(\d+) kernel=(\w+) ", r.stderr, re.M)
    assert len(plans) == n_tests * len(PARTIAL_M), (len(plans), r.stderr[-3000:])
    wg = wgmma_device()
    for m, n, bits, m_blocks, kernel in plans:
        m = int(m)
        # 8-bit weights take the wgmma variant from one row on (the planner's rule)
        want = "small_m_wgmma" if wg and (m <= 32 and (m > 8 or bits == "8")) else "small_m" if m <= 8 else "tiled"
        assert kernel == want and int(n) in PARTIAL_N, (m, n, bits, m_blocks, kernel)


def test_small_batch_partial_tile_refused_for_base_format():
    """fp16 symmetric INT4 runs the small-batch kernel with N a multiple of its tile only; forcing a
    tile that does not divide N is a clear error, and the default plan takes the tiled kernel."""
    layer = get_layer(1152, 1088, (torch.float16, 4, True, 128))
    a = torch.randn(4, 1152, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="do not divide into tile_k = 128, tile_n = 256"):
        run(layer, a, tile_k=128, tile_n=256)
    check(layer, 4)
