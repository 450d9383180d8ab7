"""torch.ops.marlin.gemm_2_4's CUDA kernel against fp32 A @ dequant(B) (B 2:4-sparse, symmetric
or with zero points), on the shape classes and M classes of the dense suite, with NaN-poisoned
outputs; repeats, graphs, two streams, torch.compile; and that the bound would catch a wrong
metadata order or a wrong zero point.

Skipped without a GPU (or without the kernel in the build). Bound as in test_gemm_cuda.py: within
1.5x of fp16 torch.matmul's own error on the fp16-rounded dequantized weights, both against the
exact fp32 product (the kernel's group scales act on fp32 sums, so it is usually more accurate).
"""

import os
import subprocess
import sys

import pytest
import torch

import marlin
from marlin import sparse
from conftest import fp32_matmul, poison_allocator, rel_err, requires_cuda_2_4
from gemm_2_4_helpers import assert_graph_replays, assert_repeats_bit_identical, get_layer, plan_lines, random_words_2_4

pytestmark = [requires_cuda_2_4, pytest.mark.gpu]

M_VALUES = [1, 3, 8, 9, 16, 17, 32, 33, 65, 1000]  # 8/16/32-row slices, partial slices, many slices
SHAPES = {
    "7B_qkv": (4096, 12288),
    "70B_o": (8192, 8192),
    "128x128": (128, 128),  # one stage: no K split
    "256x384": (256, 384),  # N % 256 != 0: the 128-column tile
    "1152x640": (1152, 640),
    "384x1280": (384, 1280),
    # N % 128 == 64 (tensor-parallel shards of 128-multiple widths): the 64-column tile
    "256x192": (256, 192),
    "1152x320": (1152, 320),  # and K parts
}
GROUPS = [128, 64, 32, -1]
ALLOWED = 1.5


def check(layer, m, b_meta=None, b_zeros="layer"):
    """(error, fp16 matmul's error, C, A) against the exact fp32 product; the layer's zero points
    (if any) unless b_zeros is given."""
    a = torch.randn(m, layer.k, device="cuda", dtype=layer.dtype)
    ptr = poison_allocator(m * layer.n)
    b_z = layer.b_z if isinstance(b_zeros, str) else b_zeros
    c = marlin.gemm_2_4(a, layer.b_q, layer.b_meta if b_meta is None else b_meta, layer.b_s, b_zeros=b_z)
    assert c.data_ptr() == ptr, "output did not land in the poisoned block; the NaN check would be void"
    ref = fp32_matmul(a, layer.w_exact)
    base = rel_err(a @ layer.w_fp16, ref)
    err = rel_err(c, ref)
    return err, base, c, a


@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("m", M_VALUES)
def test_shapes(m, shape, g):
    err, base, _, _ = check(get_layer(*SHAPES[shape], g), m)
    assert err <= ALLOWED * base + 1e-7, f"M={m} {shape} g={g}: error {err:.3g} vs fp16 matmul {base:.3g}"


@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("mma_sync", [False, True], ids=["planned", "mma_sync"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("g", [64, 32])
@pytest.mark.parametrize("m", [1, 16, 33, 100])
def test_each_group_of_rows_takes_its_own_scales(m, g, dtype, mma_sync, zp, monkeypatch):
    """Groups of 64 and 32 take a scale row per strip of a stage: weights that grow 1.5x from one
    32-row block of K to the next (cycling every 8 blocks) give neighbouring groups scales 1.5x
    apart, so a strip that read another group's row (or the stage's first, as group 128 does)
    would be far outside the bound (tests/test_gemm_2_4_cpu.py measures how far on the spec).
    With zero points (zp) the weights also sit above zero in one group and below in the next,
    so neighbouring groups' zero points lie near 0 and near 15: the zero-point row must follow
    the scale row. Planned: the mma.sync loop at 1-16 rows, the sparse wgmma above (sm_90a);
    mma_sync keeps the mma.sync loop at every M."""
    if mma_sync:
        monkeypatch.setenv("MARLIN_2_4_WGMMA", "0")
    k, n = 1024, 512
    gen = torch.Generator().manual_seed(1000 * g + m)
    growth = 1.5 ** ((torch.arange(k) // 32) % 8).double()
    w = torch.randn(k, n, generator=gen, dtype=torch.float64)
    if zp:
        w += 2.0 * (1 - 2 * ((torch.arange(k) // g) % 2)).double()[:, None]  # +2 and -2 by turns, per group
    w = sparse.prune_2_4((w * growth[:, None]).float())
    packed = [t.cuda() for t in sparse.quantize_and_pack_2_4(w, g, dtype=dtype, sym=not zp)]
    b_q, b_meta, b_s = packed[:3]
    b_z = packed[3] if zp else None
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    ref = a.double() @ sparse.unpack_2_4(b_q, b_meta, b_s, b_z).double()
    err = rel_err(marlin.gemm_2_4(a, b_q, b_meta, b_s, b_zeros=b_z), ref)
    assert err < (2e-3 if dtype == torch.float16 else 1e-2), f"M={m} g={g} {dtype} zp={zp}: error {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("shape", ["7B_qkv", "128x128", "256x384", "1152x640", "256x192", "1152x320"])
@pytest.mark.parametrize("m", M_VALUES)
def test_zero_points(m, shape, g, dtype):
    """b_zeros (w = (u - z) * s at the kept positions, 0 at the pruned ones), zero points spread
    over 0..15 (gemm_2_4_helpers.Layer24): within 1.5x of torch.matmul's own error on the rounded
    dequantized weights, in every M class, group size and dtype."""
    layer = get_layer(*SHAPES[shape], g, dtype=dtype, zp=True)
    err, base, c, _ = check(layer, m)
    assert c.dtype == dtype
    assert err <= ALLOWED * base + 1e-7, f"M={m} {shape} g={g} {dtype} zp: error {err:.3g} vs matmul {base:.3g}"


@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("shape", ["7B_qkv", "128x128", "256x384", "1152x640", "256x192", "1152x320"])
@pytest.mark.parametrize("m", M_VALUES)
def test_shapes_bf16(m, shape, g):
    """bf16 activations, scales and output (the same kernels, bf16 instructions): within 1.5x of
    bf16 torch.matmul's own error on the bf16-rounded dequantized weights."""
    layer = get_layer(*SHAPES[shape], g, dtype=torch.bfloat16)
    err, base, c, _ = check(layer, m)
    assert c.dtype == torch.bfloat16
    assert err <= ALLOWED * base + 1e-7, f"M={m} {shape} g={g}: error {err:.3g} vs bf16 matmul {base:.3g}"


# Every partition the planner can choose, forced (the knobs are read per call,
# csrc/cuda/sparse/gemm_2_4_cuda.cpp): K parts in clusters or through global memory, the three
# tile widths (the 64-column tile, which N % 128 == 64 takes, forced on N = 1024 with the
# mma.sync kernel, since a forced width does not apply to the sparse wgmma), 32-, 64- and 128-row
# block slices (M > 16), the 3-stage instances, and the first kernel's plan. On sm_90a builds on
# an H100/H200, M > 8 on the 256-column tile runs the sparse wgmma by default; "mma_sync" keeps
# the mma.sync kernel there.
PLANS = {
    "legacy": {"MARLIN_2_4_PLAN": "legacy"},
    "global_3": {"MARLIN_2_4_CLUSTERS": "0", "MARLIN_2_4_PARTS": "3"},
    "global_16": {"MARLIN_2_4_CLUSTERS": "0", "MARLIN_2_4_PARTS": "16"},
    "parts_8_clusters": {"MARLIN_2_4_PARTS": "8", "MARLIN_2_4_CLUSTERS": "1"},  # clusters on sm_90+
    "parts_5_tile_128": {"MARLIN_2_4_PARTS": "5", "MARLIN_2_4_TILE_N": "128"},
    "parts_5_tile_64": {"MARLIN_2_4_PARTS": "5", "MARLIN_2_4_TILE_N": "64", "MARLIN_2_4_WGMMA": "0"},
    "global_3_tile_64": {"MARLIN_2_4_CLUSTERS": "0", "MARLIN_2_4_PARTS": "3", "MARLIN_2_4_TILE_N": "64", "MARLIN_2_4_WGMMA": "0"},
    "one_part_tile_256": {"MARLIN_2_4_PARTS": "1", "MARLIN_2_4_TILE_N": "256"},
    "pdl": {"MARLIN_2_4_PDL": "1"},
    "warp_slices_1": {"MARLIN_2_4_WARP_SLICES": "1"},
    "warp_slices_4": {"MARLIN_2_4_WARP_SLICES": "4"},  # 128-row block slices, 128-column tile
    "stages_3": {"MARLIN_2_4_STAGES": "3", "MARLIN_2_4_CLUSTERS": "1", "MARLIN_2_4_WGMMA": "0"},  # 3-stage instances at M <= 16
    # the mma.sync kernel where the sparse wgmma would run (sm_90a; test_gemm_2_4_wgmma_cuda.py)
    "mma_sync": {"MARLIN_2_4_WGMMA": "0"},
    "mma_sync_parts_8_clusters": {"MARLIN_2_4_WGMMA": "0", "MARLIN_2_4_PARTS": "8", "MARLIN_2_4_CLUSTERS": "1"},
}


@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("m", [1, 12, 31, 40, 64, 130])
def test_forced_plans(m, plan, g, monkeypatch):
    for key, value in PLANS[plan].items():
        monkeypatch.setenv(key, value)
    err, base, _, _ = check(get_layer(4096, 1024, g), m)
    assert err <= ALLOWED * base + 1e-7, f"M={m} plan {plan} g={g}: error {err:.3g} vs fp16 matmul {base:.3g}"


@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("m", [1, 31, 40, 130])
def test_forced_plans_zero_points(m, plan, g, monkeypatch):
    """Every forced partition with zero points: the K parts' sums and the epilogue see (u - z) * s."""
    for key, value in PLANS[plan].items():
        monkeypatch.setenv(key, value)
    err, base, _, _ = check(get_layer(4096, 1024, g, zp=True), m)
    assert err <= ALLOWED * base + 1e-7, f"M={m} plan {plan} g={g} zp: error {err:.3g} vs fp16 matmul {base:.3g}"


def checked_plan(layer, m, capfd, what):
    """The planner's plan line for `m` rows (MARLIN_LOG_PLAN=1 set by the caller), after checking
    that plan's output against the float64 reference."""
    plan_lines(capfd)
    err, base, _, _ = check(layer, m)
    torch.cuda.synchronize()
    lines = plan_lines(capfd)
    assert len(lines) == 1, lines
    assert err <= ALLOWED * base + 1e-7, f"M={m} {what}: error {err:.3g} vs fp16 matmul {base:.3g} ({lines[0]})"
    return lines[0]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of compute capability 9.0 or newer (thread-block clusters)")
@pytest.mark.parametrize("shape", [(4096, 4096), (11008, 4096), (8192, 8192)], ids=["4096x4096", "11008x4096", "8192x8192"])
def test_nine_to_fifteen_rows_take_the_sixteen_row_plan_where_parts_are_short(shape, monkeypatch, capfd):
    """9-15 rows run in the 16-row slice, each correct. Where K is short (4096: at most 8 stages
    of 128 rows a part) they take the 16-row plan, parts in clusters (through global memory they
    ran 1.2-1.4x slower on the H200): on the mma.sync kernel (N < 8192) by the placement rule, on
    the sparse wgmma (N >= 8192 on sm_90a) by the short-part rule. 11008 x 4096 (long K) is left
    to the placement rule, which weighs clusters against the global reduction per row count."""
    monkeypatch.setenv("MARLIN_LOG_PLAN", "1")
    layer = get_layer(*shape, 128)
    plans = {}
    for m in (16, 9, 12, 15):
        line = checked_plan(layer, m, capfd, f"{shape} g=128")
        assert " slice_rows=16 " in line, line
        plans[m] = line.replace(f"m={m} ", "")
    if shape[0] == 4096:
        assert " cluster=1 " in plans[16] and all(plans[m] == plans[16] for m in (9, 12, 15)), plans


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of compute capability 9.0 or newer (thread-block clusters)")
@pytest.mark.parametrize("g", [128, 64])
@pytest.mark.parametrize("shape", [(4096, 4096), (5120, 5120), (11008, 4096), (5120, 15360)],
                         ids=["4096x4096", "5120x5120", "11008x4096", "5120x15360"])
def test_placement_rule_rows(shape, g, monkeypatch, capfd):
    """On few column tiles the planner weighs K parts in clusters against the global reduction
    at every row count: group 128 from 4 rows on by where the blocks land, at 1-3 rows (and the
    FINE kernels, group 64, at 1-16) by a cost in microseconds over the plans of one wave.
    5120 x 15360 (60 tiles, 40 stages) is where the fill rule before it took 13 parts in two waves
    at 1 row (780 blocks, 1.3x slower than 4 parts in clusters on the H200). Every plan it picks
    (cluster sizes 2-8, FINE kernels in clusters at 1-8 rows among them) is checked against the
    float64 reference."""
    monkeypatch.setenv("MARLIN_LOG_PLAN", "1")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    layer = get_layer(*shape, g)
    for m in (1, 3, 4, 6, 8, 10, 16):
        line = checked_plan(layer, m, capfd, f"{shape} g={g}")
        grid = int(line.split(" grid=")[1].split()[0])
        if m < 4 and g == 128:  # one wave: these 8-row instances run 3 blocks per SM on the H100 and H200
            assert grid <= 3 * sms, line


@pytest.mark.parametrize("m", [1, 8])
def test_long_k_runs_three_blocks_per_sm(m, monkeypatch, capfd):
    """At 1-8 rows on a long K (every part at least 128 stages of 128 rows) the planner takes more
    K parts on balance() ties, up to 3 blocks per SM: one 256-column tile per SM and K = 3 x 128 x
    128 run 3 parts (a long-K layer at 1 part per SM streamed 1.27x slower on the H200). Random
    words and valid metadata (a layer this size is too slow to prune and pack here); the output is
    checked on sampled tiles against unpack_2_4 (the spec) and against the forced 1-part plan."""
    from benchmarks.gemm_prep import check_marlin_24

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k, n = 3 * 128 * 128, 256 * sms
    b_q, b_meta, b_s = random_words_2_4(k, n, 128, seed=7)
    monkeypatch.setenv("MARLIN_LOG_PLAN", "1")
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    plan_lines(capfd)
    c = marlin.gemm_2_4(a, b_q, b_meta, b_s)
    torch.cuda.synchronize()
    lines = plan_lines(capfd)
    assert len(lines) == 1 and " parts=3 " in lines[0] and f" grid={3 * sms} " in lines[0], lines
    monkeypatch.setenv("MARLIN_2_4_PARTS", "1")
    one = marlin.gemm_2_4(a, b_q, b_meta, b_s)
    assert " parts=1 " in plan_lines(capfd)[0]
    assert rel_err(c, one) < 1e-3
    monkeypatch.delenv("MARLIN_2_4_PARTS")
    check_marlin_24(b_q, b_meta, b_s, k, n, torch.device("cuda"), ms=(m,))  # the 3-part plan; raises if wrong


@pytest.mark.parametrize("g", [128, -1])
def test_many_column_tiles_take_three_parts_on_three_stages(g, monkeypatch, capfd):
    """At 1-8 rows on more than sms / 2 column tiles of 256 (K up to 128 stages of 128 rows; group
    128 or per column) the planner runs three K parts through global memory on the 3-stage
    instance (13B gate_up on the H200: 0.83-0.88x the time of the fill rule's 7-11 parts). Each
    plan is checked on every tile against the fill rule's plan (MARLIN_2_4_WAVE8=0, which must
    differ) and on sampled tiles against unpack_2_4 (the spec). Random words and valid metadata."""
    from benchmarks.gemm_prep import check_marlin_24

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k, n = 4096, 256 * (sms // 2 + 3)
    b_q, b_meta, b_s = random_words_2_4(k, n, 128, seed=11)
    if g == -1:
        b_s = b_s[:1].contiguous()
    monkeypatch.setenv("MARLIN_LOG_PLAN", "1")
    for m in (1, 5, 8):
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        plan_lines(capfd)
        c = marlin.gemm_2_4(a, b_q, b_meta, b_s)
        torch.cuda.synchronize()
        lines = plan_lines(capfd)
        assert len(lines) == 1, lines
        assert all(f" {f} " in lines[0] for f in ("slice_rows=8", "stages=3", "tile_n=256", "parts=3", "cluster=0")), lines
        monkeypatch.setenv("MARLIN_2_4_WAVE8", "0")
        fill = marlin.gemm_2_4(a, b_q, b_meta, b_s)
        torch.cuda.synchronize()
        fill_line = plan_lines(capfd)[0]
        monkeypatch.delenv("MARLIN_2_4_WAVE8")
        assert " parts=3 " not in fill_line or " stages=4 " in fill_line, fill_line
        assert torch.isfinite(c).all() and rel_err(c, fill) < 1e-3, (lines[0], fill_line)
    check_marlin_24(b_q, b_meta, b_s, k, n, torch.device("cuda"), ms=(1, 5, 8))  # the rule's plans; raises if wrong


def test_the_bound_catches_a_wrong_metadata_order():
    layer = get_layer(1024, 512, 128)
    swapped = layer.b_meta.view(-1, 2, 16, 2, 2).flip(3).reshape(layer.b_meta.shape).contiguous()
    err, base, _, _ = check(layer, 8, b_meta=swapped)
    assert err > 100 * base


@pytest.mark.parametrize("g", [128, -1])
def test_the_bound_catches_a_wrong_zero_point(g):
    """The zero-point layer read as symmetric (z = 8) is far outside the bound (another group's
    zero points: test_each_group_of_rows_takes_its_own_scales)."""
    layer = get_layer(1024, 512, g, zp=True)
    err, base, _, _ = check(layer, 8, b_zeros=None)
    assert err > 100 * base


@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
def test_repeats_are_bit_identical_and_match_the_cpu_op(zp):
    layer = get_layer(4096, 4096, 128, zp=zp)
    for m in (1, 16, 100):
        assert_repeats_bit_identical(layer, m)


def test_strided_activations_and_m_zero():
    layer = get_layer(1152, 640, -1)
    big = torch.randn(5, 2 * 1152, device="cuda", dtype=torch.float16)
    a = big[:, ::2]
    assert torch.equal(
        marlin.gemm_2_4(a, layer.b_q, layer.b_meta, layer.b_s),
        marlin.gemm_2_4(a.contiguous(), layer.b_q, layer.b_meta, layer.b_s),
    )
    out = marlin.gemm_2_4(big[:0, :1152], layer.b_q, layer.b_meta, layer.b_s)
    assert out.shape == (0, 640)


def test_cuda_graph_and_two_streams():
    layer = get_layer(4096, 4096, 128)
    a = torch.randn(8, 4096, device="cuda", dtype=torch.float16)
    expected = marlin.gemm_2_4(a, layer.b_q, layer.b_meta, layer.b_s)
    static_a = a.clone()
    assert_graph_replays(lambda: marlin.gemm_2_4(static_a, layer.b_q, layer.b_meta, layer.b_s), expected)
    zl = get_layer(4096, 4096, 64, zp=True)  # and with zero points
    expected_zp = marlin.gemm_2_4(a, zl.b_q, zl.b_meta, zl.b_s, b_zeros=zl.b_z)
    assert_graph_replays(lambda: marlin.gemm_2_4(static_a, zl.b_q, zl.b_meta, zl.b_s, b_zeros=zl.b_z), expected_zp)
    # two streams at once, no shared workspace
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a2 = torch.randn(3, 4096, device="cuda", dtype=torch.float16)
    exp2 = marlin.gemm_2_4(a2, layer.b_q, layer.b_meta, layer.b_s)
    torch.cuda.synchronize()
    outs = []
    for _ in range(10):
        with torch.cuda.stream(s1):
            o1 = marlin.gemm_2_4(a, layer.b_q, layer.b_meta, layer.b_s)
        with torch.cuda.stream(s2):
            o2 = marlin.gemm_2_4(a2, layer.b_q, layer.b_meta, layer.b_s)
        outs.append((o1, o2))
    torch.cuda.synchronize()
    for o1, o2 in outs:
        assert torch.equal(o1, expected) and torch.equal(o2, exp2)


def test_torch_compile_fullgraph():
    layer = get_layer(1152, 640, 128)

    def f(x):
        return torch.relu(marlin.gemm_2_4(x * 2, layer.b_q, layer.b_meta, layer.b_s)) + 1

    x = torch.randn(5, 1152, device="cuda", dtype=torch.float16)
    compiled = torch.compile(f, fullgraph=True)
    assert rel_err(compiled(x), f(x)) < 1e-3


def test_every_block_and_half_of_the_tile():
    """Diagnostic for the fragment and metadata layout: the error by 16-column block j of each
    64-column chunk (j = 0, 1: metadata from lanes c = 0, 1 with selector 0; j = 2, 3: lanes
    c = 2, 3 with selector 1), by row half of the fragment (column % 16 < 8: low 16 bits of the
    metadata word) and by which 16 rows of each 32-row strip carry the only non-zeros (the first
    or second lane of the metadata pair)."""
    k, n, m = 256, 256, 8
    report = {}
    for strip_half in (0, 1):
        gen = torch.Generator(device="cuda").manual_seed(11 + strip_half)
        w = sparse.prune_2_4(torch.randn(k, n, device="cuda", generator=gen))
        rows = (torch.arange(k, device="cuda") % 32) // 16 == strip_half
        w = w * rows[:, None]
        b_q, b_meta, b_s = sparse.quantize_and_pack_2_4(w, -1)
        w_exact = sparse.unpack_2_4(b_q, b_meta, b_s)
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        c = marlin.gemm_2_4(a, b_q, b_meta, b_s).float()
        ref = fp32_matmul(a, w_exact)
        col = torch.arange(n, device="cuda")
        for j in range(4):
            for half in (0, 1):
                sel = ((col % 64) // 16 == j) & ((col % 16) // 8 == half)
                report[(strip_half, j, half)] = rel_err(c[:, sel], ref[:, sel])
    bad = {key: round(v, 4) for key, v in report.items() if not v < 2e-3}
    assert not bad, f"(rows 16-31 of the strip?, block j, column half): error {bad}"


def test_the_off_switch():
    """MARLIN_2_4_CUDA=0 (read once per process) turns the CUDA kernel off with a clear error."""
    code = (
        "import torch, marlin\n"
        "a = torch.zeros(1, 128, dtype=torch.float16, device='cuda')\n"
        "b_q = torch.zeros(4, 256, dtype=torch.int32, device='cuda')\n"
        "b_meta = torch.zeros(4, 128, dtype=torch.int32, device='cuda')\n"
        "s = torch.ones(1, 128, dtype=torch.float16, device='cuda')\n"
        "try:\n"
        "    marlin.gemm_2_4(a, b_q, b_meta, s)\n"
        "except NotImplementedError as e:\n"
        "    print('OFF:', e)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo, wherever marlin is imported from
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "MARLIN_2_4_CUDA": "0", "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert "OFF:" in out.stdout and "MARLIN_2_4_CUDA=0" in out.stdout, out.stdout + out.stderr
