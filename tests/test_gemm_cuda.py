"""The CUDA kernel against an fp32 reference of A @ dequant(B), on every shape class.

Skipped without a GPU; CI compiles the kernel but cannot run it. Run on the GPU machine with
`bash scripts/test.sh` (see README).

The accuracy bound: the kernel's normwise relative error must be within 1.5x of fp16
torch.matmul's own error on the same (fp16-rounded) dequantized weights, both measured against
fp32 A @ (scale * q) computed exactly. A wrong permutation, a wrong scale or a missing tile
gives an error near 1, far outside it.
"""

import itertools
import re

import pytest
import torch

import marlin
from marlin import packing
from conftest import fp32_matmul, poison_allocator, rel_err, requires_cuda, wgmma_device

pytestmark = [requires_cuda, pytest.mark.gpu]

M_VALUES = [1, 2, 3, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 1000, 4096]
LLAMA_SHAPES = {
    "7B_qkv": (4096, 12288),
    "7B_o": (4096, 4096),
    "7B_gateup": (4096, 22016),
    "7B_down": (11008, 4096),
    "70B_qkv": (8192, 10240),
    "70B_o": (8192, 8192),
    "70B_gateup": (8192, 57344),
    "70B_down": (28672, 8192),
}
# small and odd multiples of the 128 x 128 tile, incl. N that only the 128-wide tile divides
# (those go to the tiled kernel at every M), N = 5 x 256 and 3 x 512 (small-batch kernel at
# M <= 32, at every M with wgmma), and a wide, shallow layer where one block's stripe covers several whole columns
# plus parts of two more.
SMALL_SHAPES = {
    "128x128": (128, 128),
    "256x384": (256, 384),
    "1152x640": (1152, 640),
    "384x1280": (384, 1280),
    "640x1536": (640, 1536),
    "384x102400": (384, 102400),
}
GROUPS = [128, -1]
ALLOWED = 1.5  # x fp16 matmul's error


class Layer:
    """A quantized layer on the GPU plus what the reference needs."""

    def __init__(self, k, n, group_size, seed):
        gen = torch.Generator(device="cuda")
        gen.manual_seed(seed)
        w = torch.randn(k, n, device="cuda", generator=gen)
        q, s = packing.quantize(w, group_size)
        self.b_q, self.b_s = packing.pack(q, s)
        self.w_exact = packing.dequantize(q, s)  # fp32, exact
        self.w_fp16 = self.w_exact.half()
        self.k, self.n = k, n


_layers = {}


def get_layer(k, n, g):
    key = (k, n, g)
    if key not in _layers:
        _layers.clear()  # keep GPU memory bounded: one layer at a time
        torch.cuda.empty_cache()
        _layers[key] = Layer(k, n, g, seed=hash(key) % 2**31)
    return _layers[key]


def check(layer, m, **kw):
    a = torch.randn(m, layer.k, device="cuda", dtype=torch.float16)
    ptr = poison_allocator(m * layer.n)
    c = marlin.gemm(a, layer.b_q, layer.b_s, **kw)
    assert c.data_ptr() == ptr, "output did not land in the poisoned block; the NaN check would be void"
    ref = fp32_matmul(a, layer.w_exact)
    base = rel_err(a @ layer.w_fp16, ref)
    err = rel_err(c, ref)
    assert err <= ALLOWED * base + 1e-7, f"M={m} K={layer.k} N={layer.n}: error {err:.3g} vs fp16 matmul {base:.3g}"
    return c, a


@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("shape", list(SMALL_SHAPES), ids=list(SMALL_SHAPES))
@pytest.mark.parametrize("m", M_VALUES)
def test_small_shapes(m, shape, g):
    check(get_layer(*SMALL_SHAPES[shape], g), m)


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("shape", list(LLAMA_SHAPES), ids=list(LLAMA_SHAPES))
@pytest.mark.parametrize("g", GROUPS)
def test_llama_shapes(g, shape, m):
    check(get_layer(*LLAMA_SHAPES[shape], g), m)


# Every compiled kernel instance runs at least once (a miscompiled instance, such as the
# published kernel's dropped cache-policy register, dies with "illegal instruction" here).
INSTANCES = list(itertools.product([1, 2, 3, 4], [(128, 128), (64, 256)], GROUPS))
# the small-batch kernel: slices of 8, 16, 32 rows (mma.sync) or 16, 32, 64, 128 rows (wgmma, on
# H100/H200 when built for sm_90a) x tiles 128x256, 128x512 (128-row slices: 256 only)
SMALL_M_SLICES = {1: (1, 5, 8), 2: (9, 16), 4: (17, 31, 32), 8: (33, 64), 16: (65, 128, 130, 300)}
SMALL_M_INSTANCES = list(itertools.product(SMALL_M_SLICES, [(128, 256), (128, 512)], GROUPS))


@pytest.mark.parametrize("m_blocks,tile,g", INSTANCES)
def test_every_kernel_instance(m_blocks, tile, g):
    layer = get_layer(1024, 640 if tile[1] == 128 else 768, g)
    for m in (16 * m_blocks - 1, 16 * m_blocks):
        check(layer, m, tile_k=tile[0], tile_n=tile[1])


@pytest.mark.parametrize("mb,tile,g", SMALL_M_INSTANCES)
def test_every_small_batch_instance(mb, tile, g):
    layer = get_layer(1152, 1536 if tile[1] == 256 else 2048, g)
    # the planner picks the slice from M; forced tiles run larger M as several slices (of 32
    # rows with mma.sync; with wgmma of 64 rows on this small layer, 128 rows where forced by
    # test_wgmma_slices_above_64_rows; the 512-column tile always 64)
    for m in SMALL_M_SLICES[mb]:
        check(layer, m, tile_k=tile[0], tile_n=tile[1])


def test_mma_sync_small_batch_instances_with_wgmma_off():
    """On a wgmma device the mma.sync slices of 16 and 32 rows run only with MARLIN_WGMMA=0 (the
    knob is read once per process): the instance test above again, in a subprocess with it set."""
    _pytest_subprocess({"MARLIN_WGMMA": "0"}, "test_every_small_batch_instance")


@pytest.mark.parametrize("knob", ["1", "0"])
def test_one_block_instances(knob):
    """The 8-row, 256-column mma.sync instances come in two register bounds: where the plan keeps
    one block per SM and the tiles make at least 8 stages per SM, the twin built without the
    128-register bound runs (plan log one_block_regs=1), elsewhere the bounded one;
    MARLIN_ONE_BLOCK_REGS=0 runs the bounded one everywhere. The shape and instance tests pass
    either way."""
    select = "test_llama_shapes or test_small_shapes or test_every_small_batch_instance"
    _, log = _pytest_subprocess({"MARLIN_ONE_BLOCK_REGS": knob, "MARLIN_LOG_PLAN": "1"}, select)
    lines = [l for l in log.splitlines() if l.startswith("marlin.gemm plan:") and " m_blocks=1 kernel=small_m " in l]
    eight_rows = [l for l in lines if " tile_n=256 " in l]
    assert eight_rows, log[-2000:]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    expected = []
    for line in lines:
        m, n, k = (int(v) for v in re.search(r" m=(\d+) n=(\d+) k=(\d+) ", line).groups())
        stages = -(-m // 8) * -(-n // 256) * (k // 128)
        expected.append(knob == "1" and line in eight_rows and " blocks_per_sm=1 " in line and stages >= 8 * sms)
        assert (" one_block_regs=1" in line) == expected[-1], line
    if knob == "1":
        assert any(expected) and not all(expected)


def test_eight_row_slice_two_block_line():
    """At 1-8 rows (the mma.sync 8-row slice) the planner keeps one block per SM, on the instance
    without the 128-register bound, unless one block would stream at least 2 MB of weights (128
    stages of 128 x 256; marlin_gemm.cu two_blocks_pay): 8192 x 28672 (117 MB) runs one block per SM
    on an H100 / H200, 8192 x 67584 (277 MB) two. (Both plans' results are checked on layers of
    these sizes by test_llama_shapes: 70B gate_up takes one block, and the forced-plan tests.)"""
    code = (
        "import torch, marlin\n"
        "for k, n in ((8192, 28672), (8192, 67584)):\n"
        "    b_q = torch.randint(-2**31, 2**31 - 1, (k // 16, 2 * n), dtype=torch.int32, device='cuda')\n"
        "    b_s = torch.full((k // 128, n), 0.01, dtype=torch.float16, device='cuda')\n"
        "    for m in (1, 8):\n"
        "        marlin.gemm(torch.randn(m, k, dtype=torch.float16, device='cuda'), b_q, b_s)\n"
        "    torch.cuda.synchronize()\n"
        "    del b_q, b_s\n"
    )
    _, log = _snippet_subprocess(code, own_knobs_only=True)
    lines = [l for l in log.splitlines() if l.startswith("marlin.gemm plan:")]
    assert len(lines) == 4, log[-3000:]
    props = torch.cuda.get_device_properties(0)
    hopper = (props.major, props.minor) == (9, 0)
    two_seen = one_seen = False
    for line in lines:
        assert " m_blocks=1 kernel=small_m " in line and " tile_n=256 " in line, line
        n, k = (int(v) for v in re.search(r" n=(\d+) k=(\d+) ", line).groups())
        over = (n // 256) * (k // 128) * (128 * 256 // 2) >= (2 << 20) * props.multi_processor_count
        if over:
            two_seen = True
            if hopper:  # (elsewhere shared memory may hold one block of this tile only)
                assert " blocks_per_sm=2 " in line and " one_block_regs=1" not in line, line
        else:
            one_seen = True
            assert " blocks_per_sm=1 " in line and " one_block_regs=1" in line, line
    assert two_seen and one_seen


def test_repeated_calls_are_bit_identical():
    layer = get_layer(4096, 4096, 128)
    a = torch.randn(33, 4096, device="cuda", dtype=torch.float16)
    ws = marlin.make_workspace()
    outs = [marlin.gemm(a, layer.b_q, layer.b_s, ws) for _ in range(5)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert int(ws.abs().sum()) == 0, "the kernel must leave the lock workspace zeroed"


def test_cuda_graph_capture_and_replay():
    layer = get_layer(4096, 4096, 128)
    ws = marlin.make_workspace()
    static_a = torch.randn(16, 4096, device="cuda", dtype=torch.float16)
    marlin.gemm(static_a, layer.b_q, layer.b_s, ws)  # warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_c = marlin.gemm(static_a, layer.b_q, layer.b_s, ws)
    for _ in range(3):
        static_a.copy_(torch.randn_like(static_a))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_c, marlin.gemm(static_a, layer.b_q, layer.b_s))


def _chain(layers, a):
    """gemm -> gemm -> (elementwise) -> gemm: each call reads what the one before it wrote."""
    c1 = marlin.gemm(a, layers[0].b_q, layers[0].b_s)
    c2 = marlin.gemm(c1, layers[1].b_q, layers[1].b_s)
    return marlin.gemm(c2 * 0.5, layers[2].b_q, layers[2].b_s)


@pytest.mark.parametrize("m", [1, 16, 64, 200])
def test_chained_calls_read_the_previous_output(m):
    """With programmatic dependent launch (sm_90+) a call may start before the previous kernel has
    finished; it must still read that kernel's output. Back-to-back calls, eager and replayed from
    a CUDA graph, against the same calls with a host synchronisation after each."""
    layers = [get_layer(4096, 4096, 128), get_layer(4096, 4096, -1), get_layer(4096, 1024, 128)]
    a = torch.randn(m, 4096, device="cuda", dtype=torch.float16) * 0.01
    expected = a
    for i, layer in enumerate(layers):
        if i == 2:
            expected = expected * 0.5
        expected = marlin.gemm(expected, layer.b_q, layer.b_s)
        torch.cuda.synchronize()
    for _ in range(5):
        assert torch.equal(_chain(layers, a), expected)
    static_a = a.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_c = _chain(layers, static_a)
    for _ in range(5):
        static_c.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_c, expected)


def test_plain_launches_without_pdl():
    """MARLIN_PDL=0 (plain launches instead of programmatic dependent launch on sm_90+) is read
    once per process: the instance, chained-call and graph tests again in a subprocess."""
    _pytest_subprocess({"MARLIN_PDL": "0"}, "test_every_small_batch_instance or test_chained_calls or test_cuda_graph")


def _pytest_subprocess(env_vars, select, path="tests/test_gemm_cuda.py"):
    """The tests of `path` (default: this file) selected by `select` (-k), in a subprocess with
    `env_vars` set (the kernels' knobs are read once per process). Returns (stdout, stderr); stderr
    carries the C++ side's output (pytest -s)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, **env_vars)
    cmd = [sys.executable, "-m", "pytest", path, "-q", "-s", "-p", "no:cacheprovider", "-k", select]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout, r.stderr


def _snippet_subprocess(code, env_vars=None, args=(), own_knobs_only=False):
    """Runs the Python `code` (with `args` as sys.argv[1:]) in a fresh process with the plan log on
    and `env_vars` set (the kernels' knobs are read once per process; own_knobs_only drops the
    caller's other MARLIN_* settings, for tests of the default plans). Asserts it exited 0;
    returns (stdout, stderr), the plan lines being in stderr."""
    import os
    import subprocess
    import sys

    env = {key: v for key, v in os.environ.items() if not (own_knobs_only and key.startswith("MARLIN_"))}
    env.update(MARLIN_LOG_PLAN="1", **(env_vars or {}))
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout, r.stderr


def _plans(log):
    """(split_parts, clusters) of every plan line that MARLIN_LOG_PLAN=1 printed."""
    found = re.findall(r"^marlin\.gemm plan: .* split_parts=(\d+) clusters=(\d)", log, re.M)
    return [(int(parts), clusters == "1") for parts, clusters in found]


@pytest.mark.parametrize("mode", ["0", "2", "3"])
def test_split_column_partitions(mode):
    """The small-batch kernel splits columns over blocks as stream-K stripes (MARLIN_SPLIT=0) or
    as equal parts (by default where that costs little, with 2 and 3 wherever possible), reduced
    through global memory or, on sm_90+ where all clusters fit at once, in thread-block clusters
    (never with 3). The shape, instance, repeat and graph tests again with each forced; the plan
    log shows which ran."""
    select = "test_llama_shapes or test_small_shapes or test_every_small_batch_instance or test_repeated or test_cuda_graph"
    _, log = _pytest_subprocess({"MARLIN_SPLIT": mode, "MARLIN_LOG_PLAN": "1"}, select)
    plans = _plans(log)
    assert len(plans) > 100, log[-2000:]
    split = sum(parts > 1 for parts, _ in plans)
    clustered = sum(clusters for _, clusters in plans)
    if mode == "0":
        assert split == 0 and clustered == 0
    else:
        assert split > 50
        if mode == "3" or torch.cuda.get_device_capability()[0] < 9:
            assert clustered == 0
        else:
            assert clustered > 0


@pytest.mark.parametrize("rows", ["64", "128"])
def test_wgmma_slices_above_64_rows(rows):
    """Above 64 rows the wgmma variant (H100/H200) runs slices of 64 or 128 rows (the planner
    picks per shape); the shape and instance tests with each forced (MARLIN_WG_SLICE), the plan
    log shows which ran."""
    if not wgmma_device():
        pytest.skip("the wgmma variant runs on compute capability 9.0 only")
    select = "test_small_shapes or test_every_small_batch_instance or test_llama_shapes"
    _, log = _pytest_subprocess({"MARLIN_WG_SLICE": rows, "MARLIN_LOG_PLAN": "1"}, select)
    found = re.findall(r"^marlin\.gemm plan: m=(\d+) .* tile_k=128 tile_n=(\d+) m_blocks=(\d+) kernel=small_m_wgmma ", log, re.M)
    large = [(int(tile), int(mb)) for m, tile, mb in found if int(m) > 64]
    assert len(large) > 20, log[-2000:]
    want = {128: 16 if rows == "128" else 8, 256: 16 if rows == "128" else 8, 512: 8}
    assert all(mb == want[tile] for tile, mb in large), sorted(set(large))


def test_default_wgmma_slices_follow_the_columns():
    """At M = 128 on an H100/H200 (132 SMs), 128-row slices where parts^2 * 6 <= k-tiles: 70B o
    (32 columns of 128 rows x 256: 4 parts of 64 k-tiles) keeps 64-row slices; 70B qkv (40
    columns: 3 parts of 64), 7B qkv (48: 2 of 32) and 70B down (32: 4 of 224) take 128 rows. 7B down
    (16 columns: 8 parts of 86) takes 128 rows too, because its 64-row columns end through global
    memory while its 128-row ones reduce in clusters. (By default the prefill kernel's 128-row
    tiles take these layers at 128 rows; MARLIN_PREFILL=0 keeps it off, so that this is the wgmma
    variant's rule.)"""
    if not wgmma_device() or torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the rule's example needs a 132-SM compute capability 9.0 device")
    _, log = _pytest_subprocess(
        {"MARLIN_LOG_PLAN": "1", "MARLIN_PREFILL": "0"},
        "test_llama_shapes and (70B_o or 70B_qkv or 7B_qkv or 70B_down or 7B_down)",
    )
    found = set(re.findall(r"^marlin\.gemm plan: m=128 n=(\d+) k=(\d+) .* m_blocks=(\d+) ", log, re.M))
    # (N, K, m_blocks) of both scale modes
    expected = {("8192", "8192", "8"), ("10240", "8192", "16"), ("12288", "4096", "16"), ("8192", "28672", "16"),
                ("4096", "11008", "16")}
    assert found == expected, found




def test_default_plan_splits_columns_in_equal_parts():
    """By default 7B down at M = 1 (16 columns of 86 tiles) runs as equal parts on an H100/H200
    (132 SMs), not as stream-K stripes of 11 tiles that end columns mid-stripe: 16 x 8 parts, or
    fewer parts per column reduced in clusters where 16 clusters of 8 do not fit the GPCs."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if sms < 32:
        pytest.skip("fewer than 2 blocks per column")
    _, log = _pytest_subprocess({"MARLIN_LOG_PLAN": "1"}, "test_llama_shapes and 7B_down and 128")
    lines = [ln for ln in log.splitlines() if ln.startswith("marlin.gemm plan: m=1 n=4096 k=11008 groups=86 ")]
    assert lines, log[-2000:]
    planned = min(8, sms // 16)
    for parts, clusters in _plans("\n".join(lines)):
        assert parts == planned or (clusters and 2 <= parts < planned), lines


_FIRST_CALLS_IN_CAPTURE = r"""
import torch, marlin
from marlin import packing

torch.manual_seed(0)
# (M, K, N): the small-batch kernel reduced in clusters, the tiled kernel, the wgmma variant at 16
# rows, the prefill kernel on 128- and 256-row tiles (H100/H200; its tensor maps are made per call); each
# plan's kernel instance is first used inside the capture
for m, k, n in [(1, 4096, 12288), (16, 4096, 4096), (16, 8192, 10240), (200, 4096, 12288), (1000, 4096, 12288)]:
    q, s = packing.quantize(torch.randn(k, n, device="cuda"), 128)
    b_q, b_s = packing.pack(q, s)
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # no warm-up call before it
        c = marlin.gemm(a, b_q, b_s)
    c.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = a.double() @ packing.dequantize(q, s).double()
    err = ((c.double() - ref).norm() / ref.norm()).item()
    assert err < 2e-3, (m, k, n, err)
    assert torch.equal(c, marlin.gemm(a, b_q, b_s)), (m, k, n)
    print("ok", m, k, n, f"{err:.2e}")
"""


def test_first_calls_of_a_process_inside_graph_capture():
    """A process's first call of a kernel instance (function attributes, occupancy and cluster
    queries) may come while a CUDA graph is being captured, as under torch.compile's
    reduce-overhead mode: in a fresh process, each plan kind captured without a warm-up call,
    then replayed onto poisoned output and compared with the fp64 reference and an eager call."""
    out, log = _snippet_subprocess(_FIRST_CALLS_IN_CAPTURE)
    assert out.count("ok ") == 5, out[-3000:] + log[-3000:]
    kernels = set(re.findall(r"^marlin\.gemm plan: .* kernel=(\w+)", log, re.M))
    assert {"small_m", "tiled"} <= kernels, log[-3000:]
    if torch.cuda.get_device_capability() == (9, 0):
        assert {"small_m_wgmma", "prefill_wgmma"} <= kernels and any(c for _, c in _plans(log)), log[-3000:]


def test_two_streams_at_once():
    layers = [get_layer(8192, 8192, 128)]
    b_q, b_s = layers[0].b_q, layers[0].b_s
    inputs = [torch.randn(m, 8192, device="cuda", dtype=torch.float16) for m in (1, 16, 64, 100)]
    expected = [marlin.gemm(a, b_q, b_s) for a in inputs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(2)]
    results = [[], []]
    for rep in range(10):
        for i, a in enumerate(inputs):
            s = streams[i % 2]
            with torch.cuda.stream(s):
                results[i % 2].append((i, marlin.gemm(a, b_q, b_s)))  # each call its own locks
    torch.cuda.synchronize()
    for lst in results:
        for i, c in lst:
            assert torch.equal(c, expected[i])


def test_torch_compile_fullgraph():
    layer = get_layer(4096, 4096, 128)

    def f(x):
        return torch.nn.functional.silu(marlin.gemm(x, layer.b_q, layer.b_s)) * 2

    compiled = torch.compile(f, fullgraph=True)
    x = torch.randn(24, 4096, device="cuda", dtype=torch.float16)
    torch.testing.assert_close(compiled(x), f(x), rtol=2e-3, atol=2e-3)
    cg = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        x = torch.randn(24, 4096, device="cuda", dtype=torch.float16)
        torch.testing.assert_close(cg(x), f(x), rtol=2e-3, atol=2e-3)


def test_strided_activations_and_views():
    layer = get_layer(1024, 640, 128)
    big = torch.randn(40, 2048, device="cuda", dtype=torch.float16)
    for a in (big[:, :1024], big[:, 1:1025], big[::2, :1024], big[:, ::2]):
        c = marlin.gemm(a, layer.b_q, layer.b_s)
        assert torch.equal(c, marlin.gemm(a.contiguous(), layer.b_q, layer.b_s))


def test_matches_cpu_reference_op():
    layer = get_layer(1152, 640, 128)
    a = torch.randn(37, 1152, device="cuda", dtype=torch.float16)
    c_gpu = marlin.gemm(a, layer.b_q, layer.b_s).cpu()
    c_cpu = marlin.gemm(a.cpu(), layer.b_q.cpu(), layer.b_s.cpu())
    assert rel_err(c_gpu, c_cpu.float()) < 1e-3


def test_device_mismatch_is_an_error():
    layer = get_layer(256, 384, 128)
    a = torch.randn(4, 256, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="b_q is on cuda:0 but a is on cpu"):
        torch.ops.marlin.gemm(a, layer.b_q, layer.b_s)
    with pytest.raises(RuntimeError, match="b_scales is on cpu but a is on cuda:0"):
        torch.ops.marlin.gemm(a.cuda(), layer.b_q, layer.b_s.cpu())


def test_workspace_too_small_is_an_error():
    layer = get_layer(4096, 4096, 128)
    a = torch.randn(4, 4096, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="workspace.numel\\(\\) = 1, expected at least"):
        marlin.gemm(a, layer.b_q, layer.b_s, torch.zeros(1, dtype=torch.int32, device="cuda"))


_DEFAULT_AND_FORCED = r"""
import json, sys
import torch, marlin
from marlin import packing

torch.manual_seed(0)
shapes, ms, dev = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
# each (K, N) at each M: the default call, then the same call forced onto the small-batch
# kernel's 256-column tile; each checked against the fp64 reference
for k, n in shapes:
    q, s = packing.quantize(torch.randn(k, n, device=dev), 128)
    b_q, b_s = packing.pack(q, s)
    ref_w = packing.dequantize(q, s).double()
    for m in ms:
        a = torch.randn(m, k, device=dev, dtype=torch.float16)
        ref = a.double() @ ref_w
        for tiles in ({}, {"tile_k": 128, "tile_n": 256}):
            c = marlin.gemm(a, b_q, b_s, **tiles)
            err = ((c.double() - ref).norm() / ref.norm()).item()
            assert err < 2e-3, (m, k, n, tiles, err)
print("done")
"""


def _default_and_forced_plans(shapes, ms, env_vars, device="cuda"):
    """Runs _DEFAULT_AND_FORCED in a subprocess with env_vars and the plan log (the knobs are read
    once per process); returns the plan lines of the default calls and of the forced ones."""
    import json

    out, log = _snippet_subprocess(_DEFAULT_AND_FORCED, env_vars, (json.dumps(shapes), json.dumps(ms), device))
    assert "done" in out, out[-3000:] + log[-3000:]
    lines = [l for l in log.splitlines() if l.startswith("marlin.gemm plan:")]
    if device == "cuda":
        assert len(lines) == len(shapes) * len(ms) * 2, len(lines)
    return lines[0::2], lines[1::2]


def test_small_layers_take_the_small_batch_kernel_where_its_columns_reduce_in_clusters():
    """Layers under 80 KB of weights per SM at 9-64 rows (wgmma devices): the default plan is the
    small-batch kernel exactly where that kernel's own plan ends no column through global memory
    (clusters, or no split), else the tiled kernel; MARLIN_SMALL_LAYER_CLUSTERS=0 keeps them all
    on the tiled kernel. Read from the plan log of a subprocess that also forces each call onto
    the small-batch tile (its 256 columns: MARLIN_WG_TILE_N=256 keeps the default on them too; the
    128-column tile has its own test)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the rule is for the wgmma variant (compute capability 9.0)")
    # layers under 80 KB of weights per SM at 9-64 rows
    shapes = [(3072, 3072), (4096, 1024), (4096, 4096), (8960, 1536), (1536, 8960), (2048, 4096)]
    for knob in ("1", "0"):
        defaults, forced_plans = _default_and_forced_plans(
            shapes, [9, 16, 40, 64], {"MARLIN_SMALL_LAYER_CLUSTERS": knob, "MARLIN_WG_TILE_N": "256"}
        )
        kinds = set()
        for default, forced in zip(defaults, forced_plans):
            assert " kernel=small_m_wgmma " in forced, forced
            clean = " global_reduction=0" in forced
            small = " kernel=small_m_wgmma " in default
            assert small == (clean and knob == "1"), (default, forced)
            assert small or " kernel=tiled " in default, default
            kinds.add(small)
        # both outcomes occur on these shapes (3072 x 3072 reduces in clusters; 8960 x 1536 does not
        # split its columns in parts), so neither branch of the rule goes untested
        assert kinds == ({True, False} if knob == "1" else {False}), kinds


def test_512_column_tile_from_the_streaming_line():
    """fp16 group 128 at 9-16 rows on an H100/H200: the 512-column wgmma tile exactly where each SM
    streams at least the plan's wg512_bytes_per_sm of weights, 30.9 us at the device's peak DRAM
    bandwidth (memory clock x bus width, printed as dram_gbps) and never less than 768 KiB, else the
    256-column one. The shapes straddle both GPUs' lines (H100 SXM 768 KiB, H200 about 1.1 MiB per
    SM on 132 SMs); every call is checked against fp64."""
    if not wgmma_device():
        pytest.skip("the wgmma variant runs on compute capability 9.0 only")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(8192, 16384), (8192, 24576), (28672, 8192), (16384, 16384), (8192, 40960), (8192, 57344)]
    # the 16-row rule's 128-column tile kept off: it replaces the 256-column one (its own test)
    default, _ = _default_and_forced_plans(shapes, [9, 16], {"MARLIN_PREFILL": "0", "MARLIN_WG16_NARROW_TWO": "0"})
    tiles = set()
    for d in default:
        m, n, k = (int(re.search(key + r"=(\d+) ", d)[1]) for key in ("m", "n", "k"))
        gbps = int(re.search(r" dram_gbps=(\d+)", d)[1])
        line = int(re.search(r" wg512_bytes_per_sm=(\d+)", d)[1])
        assert gbps > 1000, d  # H100 / H200 drivers report the memory clock and bus width
        # dram_gbps is printed truncated to whole GB/s: the line may lie up to 1 GB/s of streaming above
        expected = max(768 << 10, 30.9e-6 * gbps * 1e9 / sms)
        assert expected - 1 <= line <= max(768 << 10, 30.9e-6 * (gbps + 1) * 1e9 / sms) + 1, (expected, d)
        want = 512 if k * n // 2 // sms >= line else 256
        assert " kernel=small_m_wgmma " in d and f" tile_n={want} " in d, (want, d)
        tiles.add(want)
    assert tiles == {256, 512}, tiles  # the shapes straddle the line


def _narrow_wgmma(plan):
    """The plan line names the wgmma variant on its 128-column tile (the tiled kernel's own tile is
    128 columns wide too, so tile_n alone does not say it)."""
    return " tile_n=128 " in plan and " kernel=small_m_wgmma " in plan


def test_small_layers_take_the_128_column_tile():
    """fp16 group 128 at 17-128 rows on an H100/H200: the 128-column tile of the wgmma variant where
    the layer is small (under 80 KB of weights per SM) or the 256-column plan ends columns through
    global memory, and only where the 128-column plan then ends none there; never deeper than
    K = 16384, nor at 16 rows or fewer by this rule (MARLIN_WG16_NARROW_TWO=0 keeps the 16-row one
    off, which has its own test); MARLIN_WG_TILE_N=256 keeps the 256-column tile. Every call checked
    against fp64 (also with the 128-column tile forced wherever it can run, in 64- and 128-row
    slices)."""
    if not wgmma_device():
        pytest.skip("the wgmma variant runs on compute capability 9.0 only")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(4096, 4096), (2048, 4096), (11008, 4096), (4096, 12288), (28672, 8192)]
    ms = [13, 16, 32, 64, 100, 128]
    # the prefill kernel kept off (MARLIN_PREFILL=0): it takes some of these layers above 64 rows,
    # and this is the wgmma variant's rule
    default, _ = _default_and_forced_plans(shapes, ms, {"MARLIN_PREFILL": "0", "MARLIN_WG16_NARROW_TWO": "0"})
    wide, _ = _default_and_forced_plans(shapes, ms, {"MARLIN_WG_TILE_N": "256", "MARLIN_PREFILL": "0"})
    narrow_seen = 0
    for d, w in zip(default, wide):
        m, n, k = (int(re.search(key + r"=(\d+) ", d)[1]) for key in ("m", "n", "k"))
        narrow = _narrow_wgmma(d)
        assert not _narrow_wgmma(w), w
        if narrow:
            assert m > 16 and " kernel=small_m_wgmma " in d and " global_reduction=0" in d, d
        if m <= 16 or k > 16384 or (k * n // 2 // sms >= 80 * 1024 and " global_reduction=0" in w):
            assert d == w, (d, w)
        narrow_seen += narrow
    if sms == 132:  # 4096 x 4096 and 2048 x 4096 at 32-128 rows (H100 probe: 10-21% faster)
        assert narrow_seen >= 8, narrow_seen
    for slice_rows in ("0", "128"):
        forced, _ = _default_and_forced_plans(
            shapes, ms, {"MARLIN_WG_TILE_N": "128", "MARLIN_WG_SLICE": slice_rows, "MARLIN_PREFILL": "0"})
        assert sum(_narrow_wgmma(f) for f in forced) >= 16, forced
        if slice_rows == "128":
            assert any(" tile_n=128 m_blocks=16 " in f for f in forced), forced


def test_16_rows_take_the_128_column_tile_with_two_blocks_per_sm():
    """fp16 group 128 at 9-16 rows on an H100/H200: where the 256-column wgmma plan would run, the
    128-column tile with two blocks per SM (what MARLIN_WG_TILE_N=128 forces there), unless that
    plan ends columns through global memory where the 256-column one does not; the 512-column tile,
    the tiled kernel's small layers and 8 rows stay as they were; MARLIN_WG16_NARROW_TWO=0 turns the
    rule off. Every call checked against fp64."""
    if not wgmma_device():
        pytest.skip("the wgmma variant runs on compute capability 9.0 only")
    # 7B qkv / down / gate_up, 70B o / qkv / down, a small layer (tiled kernel or clusters), a layer
    # on the 512-column tile
    shapes = [(4096, 12288), (11008, 4096), (4096, 22016), (8192, 8192), (8192, 10240), (28672, 8192),
              (3072, 3072), (8192, 57344)]
    ms = [8, 9, 12, 16]
    on, _ = _default_and_forced_plans(shapes, ms, {"MARLIN_PREFILL": "0"})
    off, _ = _default_and_forced_plans(shapes, ms, {"MARLIN_PREFILL": "0", "MARLIN_WG16_NARROW_TWO": "0"})
    forced, _ = _default_and_forced_plans(shapes, ms, {"MARLIN_PREFILL": "0", "MARLIN_WG_TILE_N": "128"})
    taken = 0
    for d, o, f in zip(on, off, forced):
        m = int(re.search(r"m=(\d+) ", d)[1])
        if _narrow_wgmma(f):  # 9-16 rows where the 128-column tile plans (only those with it forced)
            assert m > 8 and " blocks_per_sm=2 " in f, f
        # the rule's plan where it plans and ends no column through global memory that the rule-less
        # plan (256 columns, or a small layer's tiled kernel) reduces in clusters or does not split
        takes = _narrow_wgmma(f) and (" global_reduction=0" in f or " global_reduction=0" not in o)
        assert d == (f if takes else o), (d, o, f)
        taken += takes
    assert taken >= 10, taken


def test_split_parts_fall_back_to_what_fits_as_clusters():
    """Where a column's planned split parts do not all fit as resident clusters, the planner takes
    fewer parts that do above 16 rows per slice (at 8 rows only where the parts grow little;
    never at 16 rows). MARLIN_CLUSTER_FIT=0 keeps the planned parts, reduced through global
    memory. Read from the plan log of a subprocess whose calls are checked against the fp64
    reference with the knob on and off."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need compute capability 9.0+")
    # 16-20 columns of the small-batch kernel's 256-column tile, planned in 6-8 parts each: more
    # than the GPCs hold as clusters
    shapes, ms = [(4096, 4096), (1024, 4096), (4096, 5120)], [1, 8, 16, 40, 64, 128]
    plans = {knob: _default_and_forced_plans(shapes, ms, {"MARLIN_CLUSTER_FIT": knob})[1] for knob in ("1", "0")}
    fell_back = 0
    for on, off in zip(plans["1"], plans["0"]):
        rows = 8 * int(re.search(r"m_blocks=(\d+) kernel=", on)[1])
        p_on, c_on = _plans(on)[0]
        p_off, c_off = _plans(off)[0]
        if c_off or p_off < 2:  # the planned parts fit (or none): nothing to fall back from
            assert (p_on, c_on) == (p_off, c_off), (on, off)
        elif rows == 16 or (p_on, c_on) == (p_off, c_off):
            # 16-row slices keep the planned parts; elsewhere fewer parts may stream too much more
            # than stream-K stripes would (4096 x 5120 at 128 rows: 40 columns, 2 parts too long)
            assert (p_on, c_on) == (p_off, c_off), (on, off)
        else:
            assert c_on and 2 <= p_on < p_off and " global_reduction=0" in on, (on, off)
            fell_back += rows > 16
    # on an H100 / H200 (132 SMs) 16 columns of 8 parts do not fit: the rule is exercised
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert fell_back >= 6, fell_back
