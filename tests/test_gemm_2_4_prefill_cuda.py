"""torch.ops.marlin.gemm_2_4 on the prefill kernel's 2:4 instances (csrc/cuda/prefill, SPARSE;
H100/H200 with an sm_90a build) against the float64 product A @ dequant(B): MARLIN_PREFILL=1 sends
every call with more than 64 rows there (read per call by the 2:4 op); each call's plan line
(MARLIN_LOG_PLAN=1) must name kernel=prefill_wgmma, so that a build or device without it fails
here instead of testing another kernel. M: partial and whole 256-row tiles, many tiles with a
partial last one, more tiles than SMs (blocks take several, the ring running across them);
every group size, zero points in groups, bf16; NaN-poisoned outputs; repeats bit-identical; a
CUDA graph; and the default rule. Bound as test_gemm_2_4_wgmma_cuda.py: within 1.5x of
torch.matmul's own error on the rounded dequantized weights (the weights are scaled in the
element type, as there)."""

import os
import re
import subprocess
import sys

import pytest
import torch

import marlin
import prefill_rule
from conftest import poison_allocator, rel_err, requires_cuda_2_4, wgmma_device
from gemm_2_4_helpers import assert_graph_replays, get_layer, plan_lines




pytestmark = [
    requires_cuda_2_4,
    pytest.mark.gpu,
    pytest.mark.skipif(not wgmma_device(), reason="needs a CUDA GPU of compute capability 9.0 and an sm_90a build"),
]

# (K, N): one 128-column tile, two 64-row stages; 3 column tiles, 18 stages (the 5-stage ring wraps
# mid-tile); the 7B qkv layer (96 column tiles: at 4097 rows 1632 tiles, 12-13 per block). (The
# 2:4 op takes K in multiples of 128.)
SHAPES = {"128x128": (128, 128), "1152x384": (1152, 384), "4096x12288": (4096, 12288)}
M_VALUES = [65, 255, 256, 257, 1000, 4097]
GROUPS = [128, 64, 32, -1]
ALLOWED = 1.5


@pytest.fixture
def prefill_on(monkeypatch):
    monkeypatch.setenv("MARLIN_PREFILL", "1")
    monkeypatch.setenv("MARLIN_LOG_PLAN", "1")
    return monkeypatch



def _check(layer, m, capfd):
    a = torch.randn(m, layer.k, device="cuda", dtype=layer.dtype)
    ptr = poison_allocator(m * layer.n)
    plan_lines(capfd)
    c = marlin.gemm_2_4(a, layer.b_q, layer.b_meta, layer.b_s, b_zeros=layer.b_z)
    torch.cuda.synchronize()
    lines = plan_lines(capfd)
    assert len(lines) == 1 and " kernel=prefill_wgmma " in lines[0], lines
    assert c.data_ptr() == ptr, "output did not land in the poisoned block; the NaN check would be void"
    ref = a.double() @ layer.w64
    base = rel_err(a @ layer.w_fp16, ref)
    err = rel_err(c, ref)
    assert err <= ALLOWED * base + 1e-7, f"M={m} K={layer.k} N={layer.n}: error {err:.3g} vs matmul {base:.3g} ({lines[0]})"
    assert torch.equal(c, marlin.gemm_2_4(a, layer.b_q, layer.b_meta, layer.b_s, b_zeros=layer.b_z)), "repeat differs"
    return lines[0]


def _shape_group_m(m_values, large_layer_ms):
    """(name, K, N, group, M) of every shape and group size that divides K; the large layer only at
    `large_layer_ms`."""
    for name, (k, n) in SHAPES.items():
        for g in GROUPS:
            if g > 0 and k % g:
                continue
            for m in m_values:
                if name != "4096x12288" or m in large_layer_ms:
                    yield name, k, n, g, m


def _cases():
    for name, k, n, g, m in _shape_group_m(M_VALUES, (257, 4097)):
        yield pytest.param(k, n, g, m, id=f"{name}-g{g}-m{m}")


@pytest.mark.parametrize("k,n,g,m", list(_cases()))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_prefill_2_4(k, n, g, m, dtype, prefill_on, capfd):
    _check(get_layer(k, n, g, dtype=dtype), m, capfd)


# zero points in groups (one group over all of K is per column, whose zero points the tiled 2:4
# kernel keeps)
@pytest.mark.parametrize("k,n,g,m", [c for c in _cases() if 0 < c.values[2] < c.values[0]])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_prefill_2_4_zero_points(k, n, g, m, dtype, prefill_on, capfd):
    _check(get_layer(k, n, g, dtype=dtype, zp=True), m, capfd)


def test_prefill_2_4_graph(prefill_on):
    layer = get_layer(1152, 384, 128)
    a = torch.randn(1000, 1152, device="cuda", dtype=torch.float16)
    want = marlin.gemm_2_4(a, layer.b_q, layer.b_meta, layer.b_s)
    assert_graph_replays(lambda: marlin.gemm_2_4(a, layer.b_q, layer.b_meta, layer.b_s), want)


def _split_of(line):
    m = re.search(r" parts=(-?\d+) split_first=(\d+)", line)
    return int(m[1]), int(m[2])


def _tile_m_of(line):
    return int(re.search(r" tile_m=(\d+) ", line)[1])


@pytest.mark.parametrize(
    "m,k,n,env,want,tile_m",
    [
        # the default tile height and split of a last round of few tiles (prefill.cu's
        # prefill_pick_tile_m and tail split, on 132 SMs): 7B o at 256 rows on 64 tiles of 128 rows
        # in 2 parts; 96 128-row tiles of an 11008-deep layer stream-K (-1); 266 128-row tiles with
        # 2 left in 2
        pytest.param(256, 4096, 4096, {}, (2, 0), 128, id="7Bo-256rows"),
        pytest.param(257, 11008, 4096, {}, (-1, 0), 128, id="96tiles-deep-streamk"),
        pytest.param(1793, 2048, 2432, {}, (2, 264), 128, id="tail2"),
        # MARLIN_PREFILL_ROWS=256 (forced height): 32 tiles in 4 parts
        pytest.param(256, 4096, 4096, {"MARLIN_PREFILL_ROWS": "256"}, (4, 0), 256, id="32tiles-rows256"),
        # MARLIN_PREFILL_SPLIT=3: every tile in 3 parts (3 column tiles of 18 stages)
        pytest.param(1000, 1152, 384, {"MARLIN_PREFILL": "1", "MARLIN_PREFILL_SPLIT": "3"}, (3, 0), None, id="forced3"),
        # MARLIN_PREFILL_SPLIT=-1: stream-K over every tile (12 tiles of 18 stages on 132 SMs)
        pytest.param(1000, 1152, 384, {"MARLIN_PREFILL": "1", "MARLIN_PREFILL_SPLIT": "-1"}, (-1, 0), None, id="forced-streamk"),
    ],
)
def test_prefill_2_4_split(m, k, n, env, want, tile_m, monkeypatch, capfd):
    """The 2:4 instances with K in parts: bounds, NaN-poisoned output, bit-identical repeats (the
    parts are added in part order), and the plan's parts and tile height."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if sms != 132 and "MARLIN_PREFILL_SPLIT" not in env:
        pytest.skip("the expected splits are those of a 132-SM H100 / H200")
    if tile_m is not None:  # the pinned cases agree with the rule's restatement (prefill_rule.py)
        assert prefill_rule.tile_m(m, k, n, sms, sparse24=True) == tile_m or "MARLIN_PREFILL_ROWS" in env
        assert prefill_rule.split(m, k, n, sms, tile_m) == want
    for key in ("MARLIN_PREFILL", "MARLIN_PREFILL_SPLIT", "MARLIN_PREFILL_ROWS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MARLIN_LOG_PLAN", "1")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    line = _check(get_layer(k, n, 128), m, capfd)
    assert _split_of(line) == want and (tile_m is None or _tile_m_of(line) == tile_m), line


# MARLIN_PREFILL_ROWS=128: every call on the 128-row tiles (the wgmma N = 128, an 8-stage ring;
# by default below 256 rows and where prefill_pick_tile_m rates them faster); M below, at and past
# one tile, a partial tile after whole ones, many tiles
M_ROWS128 = [65, 127, 128, 129, 255, 1000]


@pytest.fixture
def rows128(prefill_on):
    prefill_on.setenv("MARLIN_PREFILL_ROWS", "128")
    return prefill_on


def _cases128():
    for name, k, n, g, m in _shape_group_m(M_ROWS128, (129,)):
        for zp in (False, True):
            if zp and not 0 < g < k:  # zero points in groups only (as above)
                continue
            yield pytest.param(k, n, g, m, zp, id=f"{name}-g{g}-m{m}" + ("-zp" if zp else ""))


@pytest.mark.parametrize("k,n,g,m,zp", list(_cases128()))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_prefill_2_4_rows128(k, n, g, m, zp, dtype, rows128, capfd):
    line = _check(get_layer(k, n, g, dtype=dtype, zp=zp), m, capfd)
    assert " tile_m=128 " in line, line


@pytest.mark.parametrize(
    "m,k,n,env,want",
    [
        # 128-row tiles: 32 tiles in 4 parts (7B o at 128 rows), 32 tiles of an 11008-deep layer
        # in 4, 15 x 19 = 285 tiles with 21 left in 2 (K of 32 stages), forced 3 parts
        pytest.param(128, 4096, 4096, {}, (4, 0), id="32tiles"),
        pytest.param(100, 11008, 4096, {}, (4, 0), id="32tiles-deep"),
        pytest.param(1793, 2048, 2432, {}, (2, 264), id="tail21"),
        pytest.param(1000, 1152, 384, {"MARLIN_PREFILL_SPLIT": "3"}, (3, 0), id="forced3"),
        pytest.param(1000, 1152, 384, {"MARLIN_PREFILL_SPLIT": "-1"}, (-1, 0), id="forced-streamk"),
        pytest.param(4097, 1152, 2048, {"MARLIN_PREFILL_SPLIT": "-1"}, (-1, 0), id="streamk-more-tiles-than-sms"),
    ],
)
def test_prefill_2_4_rows128_split(m, k, n, env, want, monkeypatch, capfd):
    """The 128-row tiles with K in parts: bounds, NaN-poisoned output, bit-identical repeats and
    the plan's parts (the partials are half a 256-row tile's)."""
    if torch.cuda.get_device_properties(0).multi_processor_count != 132 and not env:
        pytest.skip("the expected splits are those of a 132-SM H100 / H200")
    monkeypatch.delenv("MARLIN_PREFILL_SPLIT", raising=False)
    for key, value in {"MARLIN_PREFILL": "1", "MARLIN_PREFILL_ROWS": "128", "MARLIN_LOG_PLAN": "1", **env}.items():
        monkeypatch.setenv(key, value)
    line = _check(get_layer(k, n, 128), m, capfd)
    assert " tile_m=128 " in line and _split_of(line) == want, line


def test_prefill_2_4_rows128_graph(rows128):
    layer = get_layer(1152, 384, 64, zp=True)
    a = torch.randn(200, 1152, device="cuda", dtype=torch.float16)
    want = marlin.gemm_2_4(a, layer.b_q, layer.b_meta, layer.b_s, b_zeros=layer.b_z)
    assert_graph_replays(lambda: marlin.gemm_2_4(a, layer.b_q, layer.b_meta, layer.b_s, b_zeros=layer.b_z), want)


def test_tile_height_rule_knob_and_bad_value(monkeypatch, capfd):
    """By default the rule takes 65-255 rows on 128-row tiles where they fill the SMs (4096 x 12288
    at 128 rows: 96 tiles), not 64 rows, and 256-row tiles at 1024 rows; MARLIN_PREFILL_ROWS=256
    keeps 128 rows off the kernel (its 256-row tiles start at 256 rows) and =128 takes 1024 rows
    on 128-row tiles; another value is refused."""
    for key in ("MARLIN_PREFILL", "MARLIN_PREFILL_SPLIT", "MARLIN_PREFILL_ROWS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MARLIN_LOG_PLAN", "1")
    layer = get_layer(4096, 12288, 128)
    fills = torch.cuda.get_device_properties(0).multi_processor_count < 96 / 0.5  # 96 tiles fill half the SMs
    for rows, want in (("", ["-", "128" if fills else "-", "256"]), ("256", ["-", "-", "256"]), ("128", ["-", "128" if fills else "-", "128"])):
        if rows:
            monkeypatch.setenv("MARLIN_PREFILL_ROWS", rows)
        plan_lines(capfd)
        for m in (64, 128, 1024):
            marlin.gemm_2_4(torch.randn(m, 4096, device="cuda", dtype=torch.float16), layer.b_q, layer.b_meta, layer.b_s)
        torch.cuda.synchronize()
        lines = plan_lines(capfd)
        got = [str(_tile_m_of(l)) if " kernel=prefill_wgmma " in l else "-" for l in lines]
        assert got == want, (rows, lines)
    monkeypatch.setenv("MARLIN_PREFILL_ROWS", "100")
    with pytest.raises(RuntimeError, match="MARLIN_PREFILL_ROWS = 100, expected 128 or 256"):
        marlin.gemm_2_4(torch.randn(128, 4096, device="cuda", dtype=torch.float16), layer.b_q, layer.b_meta, layer.b_s)


def test_default_rule_2_4():
    """By default the 2:4 op takes the prefill kernel where its tiles fill the SMs, down to a fill
    of 0.5 (4096 x 12288: 96 column tiles, at 128 rows 96 tiles of 128 rows, at 1024 rows 384 of
    256; 8192 x 10240 at 256 rows: 160 tiles of 128 rows, split), never with MARLIN_PREFILL=0, and
    per column zero points never."""
    script = (
        "import torch, marlin\n"
        "from marlin import sparse\n"
        "w = sparse.prune_2_4(torch.randn(4096, 12288, device='cuda'))\n"
        "b_q, b_meta, b_s = sparse.quantize_and_pack_2_4(w, 128)[:3]\n"
        "for m in (128, 1024):\n"
        "    marlin.gemm_2_4(torch.randn(m, 4096, device='cuda', dtype=torch.float16), b_q, b_meta, b_s)\n"
        "b_q, b_meta, b_s, b_z = sparse.quantize_and_pack_2_4(w, -1, sym=False)\n"
        "marlin.gemm_2_4(torch.randn(1024, 4096, device='cuda', dtype=torch.float16), b_q, b_meta, b_s, b_zeros=b_z)\n"
        "w = sparse.prune_2_4(torch.randn(8192, 10240, device='cuda'))\n"
        "b_q, b_meta, b_s = sparse.quantize_and_pack_2_4(w, 128)[:3]\n"
        "marlin.gemm_2_4(torch.randn(256, 8192, device='cuda', dtype=torch.float16), b_q, b_meta, b_s)\n"
        "torch.cuda.synchronize()\n"
    )
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    calls = [(128, 4096, 12288), (1024, 4096, 12288), (256, 8192, 10240)]  # the per column zero points' call never
    want = [f"{m}/{prefill_rule.tile_m(m, k, n, sms, sparse24=True)}" for m, k, n in calls if prefill_rule.pays(m, k, n, sms, 0.5, sparse24=True)]
    if sms == 132:
        assert want == ["128/128", "1024/256", "256/128"], want
    for knob, expect in (("-1", want), ("0", [])):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MARLIN_")}
        env.update(MARLIN_LOG_PLAN="1", MARLIN_PREFILL=knob)
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        lines = [l for l in r.stderr.splitlines() if l.startswith("marlin.gemm_2_4 plan:")]
        got = [l.split()[2].split("=")[1] + f"/{_tile_m_of(l)}" for l in lines if " kernel=prefill_wgmma " in l]
        assert len(lines) == 4 and got == expect, (knob, lines)
