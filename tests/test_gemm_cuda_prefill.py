"""The prefill kernel (csrc/cuda/prefill; H100/H200 with an sm_90a build): batches above 64 rows,
fp16 group 128 and per column, against the fp32 reference with test_gemm_cuda.py's bound and
NaN-poisoned outputs; and the other formats it runs (bf16, groups of 32 and 64, zero points in
groups, 8-bit) against the float64 reference of test_gemm_cuda_formats.py. By default the planner sends a call there only when its 128 x 256 tiles fill
the device; MARLIN_PREFILL=1 (read once per process, hence the subprocesses) sends every call it
can run there, and the plan log shows that it did."""

import re

import pytest
import torch

import marlin
import prefill_rule
from marlin import packing
from conftest import requires_cuda, wgmma_device
from test_gemm_cuda import _pytest_subprocess, check, get_layer
import test_gemm_cuda_formats as formats

pytestmark = [requires_cuda, pytest.mark.gpu]

# (K, N): one 128-column tile; K = 64 x odd (per column only); the 7B and a deep layer; an odd
# number of 64-row stages with more tiles than SMs (a block's tiles cross the ring mid-way)
SHAPES = {"1024x128": (1024, 128), "192x384": (192, 384), "1024x640": (1024, 640), "4096x4096": (4096, 4096),
          "11008x4096": (11008, 4096), "576x2048": (576, 2048)}
# M: a row past the wgmma variant's 64, a partial and a whole 256-row tile, one row past it, many
# tiles with a partial last one
M_VALUES = [65, 255, 256, 257, 1000, 4097]
GROUPS = [128, -1]


def _cases():
    for (name, (k, n)), g, m in [(s, g, m) for s in SHAPES.items() for g in GROUPS for m in M_VALUES]:
        if g == 128 and k % 128:
            continue  # group 128 needs K a multiple of 128
        yield pytest.param(m, k, n, g, id=f"{name}-g{g}-m{m}")


@pytest.mark.parametrize("m,k,n,g", list(_cases()))
def test_prefill_shapes(m, k, n, g):
    c, a = check(get_layer(k, n, g), m)
    layer = get_layer(k, n, g)
    assert torch.equal(c, marlin.gemm(a, layer.b_q, layer.b_s)), "repeated call differs"


# every format of test_gemm_cuda_formats.FORMATS that the prefill kernel runs: all but per-column
# zero points (the tiled kernel's)
PREFILL_FORMATS = [f for f in formats.FORMATS if f[2] or f[3] > 0]
FORMAT_SHAPES = {"1024x128": (1024, 128), "192x384": (192, 384), "4096x4096": (4096, 4096)}


def _format_cases():
    for fmt in PREFILL_FORMATS:
        for (name, (k, n)), m in [(s, m) for s in FORMAT_SHAPES.items() for m in (65, 257, 1000, 4097)]:
            if fmt[3] > 0 and k % fmt[3]:
                continue
            yield pytest.param(fmt, m, k, n, id=f"{formats.fmt_id(fmt)}-{name}-m{m}")


@pytest.mark.parametrize("fmt,m,k,n", list(_format_cases()))
def test_prefill_formats(fmt, m, k, n):
    layer = formats.get_layer(k, n, fmt)
    formats.check(layer, m)
    a = torch.randn(m, k, device="cuda", dtype=layer.dtype)
    assert torch.equal(formats.run(layer, a), formats.run(layer, a)), "repeated call differs"


def test_prefill_in_cuda_graph():
    layer = get_layer(4096, 4096, 128)
    a = torch.randn(1000, 4096, device="cuda", dtype=torch.float16)
    want = marlin.gemm(a, layer.b_q, layer.b_s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c = marlin.gemm(a, layer.b_q, layer.b_s)
    c.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(c, want)


def test_small_workspace_is_enough():
    """The prefill kernel touches no lock counters: a one-element workspace is accepted (a shape the
    planner sends there by default, 1536 tiles on 4096 x 12288)."""
    layer = get_layer(4096, 12288, 128)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    c = marlin.gemm(a, layer.b_q, layer.b_s, torch.zeros(1, dtype=torch.int32, device="cuda"))
    assert torch.equal(c, marlin.gemm(a, layer.b_q, layer.b_s))


def _prefill_plans(log):
    return re.findall(r"^marlin\.gemm plan: m=(\d+) n=(\d+) k=(\d+) .* kernel=prefill_wgmma ", log, re.M)


def test_forced_prefill_runs_every_case():
    """MARLIN_PREFILL=1: every case above (and the graph and workspace tests) on the prefill kernel."""
    if not wgmma_device():
        pytest.skip("the prefill kernel runs on compute capability 9.0 with an sm_90a build only")
    path = "tests/test_gemm_cuda_prefill.py"
    _, log = _pytest_subprocess({"MARLIN_PREFILL": "1", "MARLIN_LOG_PLAN": "1"}, "not forced and not default", path)
    plans = _prefill_plans(log)
    other = re.findall(r"^marlin\.gemm plan: m=(\d+) .* kernel=(?!prefill_wgmma)", log, re.M)
    assert len(plans) > 50 and not [m for m in other if int(m) > 64], (len(plans), other[:5], log[-2000:])


def test_split_k_runs_every_case():
    """MARLIN_PREFILL=1 MARLIN_PREFILL_SPLIT=3 (a probe knob): the shape, format and graph cases
    above with K in three parts (two where K has two 64-row stages), the parts' fp32 partials added
    by each tile's last unit; layers with more tiles than the lock counters (2 per SM) stay whole.
    Every case passes its bound and repeats bit for bit (the sum is in part order whichever unit
    arrives last)."""
    if not wgmma_device():
        pytest.skip("the prefill kernel runs on compute capability 9.0 with an sm_90a build only")
    path = "tests/test_gemm_cuda_prefill.py"
    env = {"MARLIN_PREFILL": "1", "MARLIN_PREFILL_SPLIT": "3", "MARLIN_LOG_PLAN": "1"}
    _, log = _pytest_subprocess(env, "test_prefill_shapes or test_prefill_formats or graph", path)
    lines = [l for l in log.splitlines() if l.startswith("marlin.gemm plan:") and " kernel=prefill_wgmma " in l]
    parts = [int(re.search(r" split_parts=(\d+)", l)[1]) for l in lines]
    assert parts.count(3) > 50 and set(parts) <= {1, 2, 3}, (len(parts), sorted(set(parts)), log[-2000:])


def test_stream_k_runs_every_case():
    """MARLIN_PREFILL=1 MARLIN_PREFILL_SPLIT=-1 (a probe knob): the shape, format and graph cases
    above with every tile's stages as one stream-K range over one block per SM, on both tile
    heights: a block's share covers pieces of one or two tiles, or whole tiles and a piece of the
    next where there are more tiles than SMs (576 x 2048 at 4097 rows: 272 tiles); cut tiles are
    summed by their last piece. Calls with fewer stages than SMs stay whole. Every case passes
    its bound and repeats bit for bit (the pieces are added in order whichever arrives last)."""
    if not wgmma_device():
        pytest.skip("the prefill kernel runs on compute capability 9.0 with an sm_90a build only")
    path = "tests/test_gemm_cuda_prefill.py"
    for rows in ("256", "128"):
        env = {"MARLIN_PREFILL": "1", "MARLIN_PREFILL_SPLIT": "-1", "MARLIN_PREFILL_ROWS": rows, "MARLIN_LOG_PLAN": "1"}
        _, log = _pytest_subprocess(env, "test_prefill_shapes or test_prefill_formats or graph", path)
        lines = [l for l in log.splitlines() if l.startswith("marlin.gemm plan:") and " kernel=prefill_wgmma " in l]
        parts = [int(re.search(r" split_parts=(-?\d+)", l)[1]) for l in lines]
        assert parts.count(-1) > 50 and set(parts) <= {-1, 1}, (rows, len(parts), sorted(set(parts)), log[-2000:])


def test_forced_rows128_runs_every_case():
    """MARLIN_PREFILL=1 MARLIN_PREFILL_ROWS=128 (the height forced): the shape, format and graph
    cases above on the prefill kernel's 128-row tiles (m_blocks=8 in the plan: the wgmma N = 128),
    whole and with K in three parts; every case passes its bound and repeats bit for bit."""
    if not wgmma_device():
        pytest.skip("the prefill kernel runs on compute capability 9.0 with an sm_90a build only")
    path = "tests/test_gemm_cuda_prefill.py"
    for extra in ({}, {"MARLIN_PREFILL_SPLIT": "3"}):
        env = {"MARLIN_PREFILL": "1", "MARLIN_PREFILL_ROWS": "128", "MARLIN_LOG_PLAN": "1", **extra}
        _, log = _pytest_subprocess(env, "test_prefill_shapes or test_prefill_formats or graph", path)
        lines = [l for l in log.splitlines() if l.startswith("marlin.gemm plan:") and " kernel=prefill_wgmma " in l]
        assert len(lines) > 50 and all(" m_blocks=8 kernel=prefill_wgmma " in l for l in lines), (len(lines), lines[:3])
        if extra:
            parts = [int(re.search(r" split_parts=(\d+)", l)[1]) for l in lines]
            assert parts.count(3) > 50 and set(parts) <= {1, 2, 3}, sorted(set(parts))


def test_default_split_plans():
    """By default the last round's few tiles are split in K (1, 2 or 4 parts here, on the whole
    grid or only its tail), and a single round more than half full runs stream-K (70B qkv at 128
    rows), on the tile height the rule picks; each case passes its bound and
    repeats bit for bit, leaves its workspace's arrival counters at zero (the K split's last part
    zeroes the counter itself when it finds every other part in), and the plan log shows the
    height and split the rules ask for (prefill_rule.py restates them)."""
    if not wgmma_device():
        pytest.skip("the prefill kernel runs on compute capability 9.0 with an sm_90a build only")
    import os
    import subprocess
    import sys

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # (M, K, N, group) on 132 SMs: 7B o at 256 rows (64 tiles of 128 rows, 2 parts), a deep layer
    # at 257 rows (96 128-row tiles of 172 stages, stream-K; 256-row tiles would be 64 in 2 parts), 4 rounds and a tail of 16 (4097 x 4096 x 4096: 4 parts), 152
    # 256-row tiles with a tail of 20 in 2 parts (1793 x 2432), 128 tiles in one round (1000 x 4096 x 4096);
    # 7B qkv at 256 rows: 96 256-row tiles with group scales, 192 128-row ones (2 parts for the
    # last 60) per column, whose model rates the 128-row stage cheaper; 70B qkv at 128 rows: 80
    # 128-row tiles of 128 stages, stream-K (~78 stages per SM)
    cases = [(256, 4096, 4096, 128), (257, 11008, 4096, 128), (4097, 4096, 4096, 128), (1793, 2048, 2432, 128),
             (1000, 4096, 4096, 128), (256, 4096, 12288, 128), (256, 4096, 12288, -1), (128, 8192, 10240, 128)]
    if sms == 132:
        assert [prefill_rule.tile_m(m, k, n, sms, g == -1) for m, k, n, g in cases] == [128, 128, 256, 256, 256, 256, 128, 128]
        assert prefill_rule.split(128, 8192, 10240, sms, 128) == (prefill_rule.STREAM_K, 0)
    script = (
        "import sys, torch, marlin\n"
        "sys.path.insert(0, 'tests')\n"
        "from test_gemm_cuda import check, get_layer\n"
        "ws = marlin.make_workspace()\n"
        f"for m, k, n, g in {cases!r}:\n"
        "    c, a = check(get_layer(k, n, g), m, workspace=ws)\n"
        "    assert not ws.any().item(), ('counters left set', m, k, n, g, ws.nonzero().flatten().tolist()[:8])\n"
        "    layer = get_layer(k, n, g)\n"
        "    assert torch.equal(c, marlin.gemm(a, layer.b_q, layer.b_s)), (m, k, n, g)\n"
        "torch.cuda.synchronize()\n"
    )
    env = dict(os.environ, MARLIN_LOG_PLAN="1")
    env.pop("MARLIN_PREFILL", None), env.pop("MARLIN_PREFILL_SPLIT", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {}
    for line in r.stderr.splitlines():
        if line.startswith("marlin.gemm plan:") and " kernel=prefill_wgmma " in line:
            mm = re.search(r"m=(\d+) n=(\d+) k=(\d+) groups=(\d+) .* m_blocks=(\d+) .* split_parts=(-?\d+) split_first=(\d+)",
                           line)
            m, n, k, groups = (int(x) for x in mm.groups()[:4])
            got[(m, n, k, groups == 1)] = (16 * int(mm[5]), int(mm[6]), int(mm[7]))
    for m, k, n, g in cases:
        tile_m = prefill_rule.tile_m(m, k, n, sms, g == -1)
        assert got.get((m, n, k, g == -1)) == (tile_m, *prefill_rule.split(m, k, n, sms, tile_m)), (m, k, n, g, got)
    assert {p for _, p, _ in got.values()} >= {2, 4} | ({-1} if sms == 132 else set()), got


def test_split_fast_sum_is_bit_identical(tmp_path):
    """The K split's last part, when it finds every other part in, adds their partials to its own
    accumulators instead of storing its partial and arriving (MARLIN_PREFILL_FAST_SUM=0 turns that
    off): the same stage split gives the same output bit for bit either way, for the default
    plans with 2 and 4 parts and a forced 3-part split (both tile heights), at the default lead
    and at a lead of 40 stages, where the last part finds the others in on nearly every tile (at
    the default lead it takes the shortcut on most tiles, not all: both paths run)."""
    if not wgmma_device():
        pytest.skip("the prefill kernel runs on compute capability 9.0 with an sm_90a build only")
    import os
    import subprocess
    import sys

    cases = [(256, 4096, 4096, 128), (4097, 4096, 4096, 128), (128, 4096, 4096, -1), (300, 11008, 4096, 128)]
    script = (
        "import sys, torch, marlin\n"
        "sys.path.insert(0, 'tests')\n"
        "from test_gemm_cuda import check, get_layer\n"
        "out = []\n"
        f"for m, k, n, g in {cases!r}:\n"
        "    torch.manual_seed(m + k + n)\n"
        "    out.append(check(get_layer(k, n, g), m)[0].cpu())\n"
        "torch.save(out, sys.argv[1])\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = {}
    settings = [(split, lead) for split in ("", "3") for lead in ("", "40")]
    for split, lead in settings:
        for fast in ("1", "0"):
            env = dict(os.environ, MARLIN_PREFILL="1", MARLIN_PREFILL_FAST_SUM=fast)
            env.pop("MARLIN_PREFILL_SPLIT", None)
            env.pop("MARLIN_PREFILL_LEAD", None)
            if split:
                env["MARLIN_PREFILL_SPLIT"] = split
            if lead:
                env["MARLIN_PREFILL_LEAD"] = lead
            path = tmp_path / f"c{split}_l{lead}_{fast}.pt"
            r = subprocess.run([sys.executable, "-c", script, str(path)], env=env, cwd=root, capture_output=True, text=True,
                               timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
            results[(split, lead, fast)] = torch.load(path)
    for split, lead in settings:
        for case, x, y in zip(cases, results[(split, lead, "1")], results[(split, lead, "0")]):
            assert torch.equal(x, y), (split, lead, case)


def test_default_rule():
    """By default: the prefill kernel where its tiles fill the device, else the other kernels; and
    never with MARLIN_PREFILL=0."""
    if not wgmma_device():
        pytest.skip("the prefill kernel runs on compute capability 9.0 with an sm_90a build only")
    import os
    import subprocess
    import sys

    script = (
        "import torch, marlin\n"
        "from marlin import packing\n"
        "q, s = packing.quantize(torch.randn(4096, 12288, device='cuda'), 128)\n"
        "b_q, b_s = packing.pack(q, s)\n"
        "for m in (128, 4096):\n"
        "    marlin.gemm(torch.randn(m, 4096, device='cuda', dtype=torch.float16), b_q, b_s)\n"
        "q, s, z = packing.quantize(torch.randn(4096, 12288, device='cuda'), 64, sym=False, dtype=torch.bfloat16)\n"
        "b_q, b_s, b_z = packing.pack(q, s, z)\n"
        "for m in (128, 2048):\n"
        "    marlin.gemm(torch.randn(m, 4096, device='cuda', dtype=torch.bfloat16), b_q, b_s, b_zeros=b_z)\n"
        "torch.cuda.synchronize()\n"
    )
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # 4096 x 12288: 96 column tiles, at 128 rows on 128-row tiles (fill 0.73 of 132 SMs), at
    # 2048 / 4096 rows times 8 / 16 row tiles of 256
    want = [str(m) for m in (128, 4096, 128, 2048) if prefill_rule.pays(m, 4096, 12288, sms, 0.6)]
    if sms == 132:
        assert want == ["128", "4096", "128", "2048"], want
    for knob, expect in (("-1", want), ("0", [])):
        env = dict(os.environ, MARLIN_LOG_PLAN="1", MARLIN_PREFILL=knob)
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert [m for m, _, _ in _prefill_plans(r.stderr)] == expect, (knob, r.stderr[-2000:])
