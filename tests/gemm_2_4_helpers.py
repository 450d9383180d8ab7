"""Shared by the 2:4 op's GPU tests (test_gemm_2_4_cuda.py, test_gemm_2_4_wgmma_cuda.py): a
random pruned and packed layer (symmetric or with zero points) with its exact dequantized weights
(one cached at a time), the repeat and CUDA-graph checks."""

import torch

import marlin
from conftest import rel_err
from marlin import sparse


class Layer24:
    """``zp``: zero points (b_z, else None). Their weights get a random offset per column, between
    -1.5 and 1.5 standard deviations, so that the zero points spread over 0..15 instead of sitting
    near the symmetric 8, where reading 8 would pass unnoticed."""

    def __init__(self, k, n, group_size, seed, dtype=torch.float16, zp=False):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        w = torch.randn(k, n, device="cuda", generator=gen)
        if zp:
            w += 3 * torch.rand(1, n, device="cuda", generator=gen) - 1.5
        w = sparse.prune_2_4(w)
        packed = sparse.quantize_and_pack_2_4(w, group_size, dtype=dtype, sym=not zp)
        self.b_q, self.b_meta, self.b_s = packed[:3]
        self.b_z = packed[3] if zp else None  # pass as b_zeros: None is the symmetric op
        self.w_exact = sparse.unpack_2_4(self.b_q, self.b_meta, self.b_s, self.b_z)  # fp32, exact
        self.dtype = dtype  # of the activations, scales and output
        self.w_fp16 = self.w_exact.to(dtype)  # the dequantized weights rounded to that dtype
        self.k, self.n = k, n
        self._w64 = None

    @property
    def w64(self) -> torch.Tensor:
        """The exact weights in float64 (for float64 references)."""
        if self._w64 is None:
            self._w64 = self.w_exact.double()
        return self._w64


def random_words_2_4(k, n, group_size, seed):
    """(b_q, b_meta, b_s) of a 2:4 layer too large to prune and pack in a test: random packed words,
    valid random metadata, fp16 scales in [0.001, 0.01] (groups of `group_size` rows). Check the op
    on it with benchmarks.gemm_prep.check_marlin_24 (sampled tiles against unpack_2_4)."""
    from benchmarks.gemm_prep import random_meta_2_4

    gen = torch.Generator(device="cuda").manual_seed(seed)
    b_q = torch.randint(-(2**31), 2**31, (k // 32, 2 * n), dtype=torch.int32, device="cuda", generator=gen)
    b_meta = random_meta_2_4(k, n, "cuda")
    b_s = torch.empty(k // group_size, n, dtype=torch.float16, device="cuda").uniform_(0.001, 0.01)
    return b_q, b_meta, b_s


_layers = {}


def get_layer(k, n, g, dtype=torch.float16, zp=False) -> Layer24:
    """The layer (K, N, group size g, element dtype, zero points or not), seeded by its shape and
    group; only the last one is kept (GPU memory)."""
    key = (k, n, g, dtype, zp)
    if key not in _layers:
        _layers.clear()
        torch.cuda.empty_cache()
        _layers[key] = Layer24(k, n, g, seed=hash((k, n, g)) % 2**31, dtype=dtype, zp=zp)
    return _layers[key]


def assert_graph_replays(call, expected: torch.Tensor) -> None:
    """call() (the op on fixed inputs) captured in a CUDA graph after a warm-up on a side stream;
    three replays into a NaN-filled output each give exactly `expected`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


def assert_repeats_bit_identical(layer: Layer24, m: int) -> None:
    """Repeated calls give the same bits, close to the CPU op's; an explicit workspace (the K parts'
    arrival counters) gives the same bits again and is left zeroed."""
    a = torch.randn(m, layer.k, device="cuda", dtype=layer.dtype)
    c = marlin.gemm_2_4(a, layer.b_q, layer.b_meta, layer.b_s, b_zeros=layer.b_z)
    for _ in range(3):
        assert torch.equal(marlin.gemm_2_4(a, layer.b_q, layer.b_meta, layer.b_s, b_zeros=layer.b_z), c)
    b_z = None if layer.b_z is None else layer.b_z.cpu()
    cpu = marlin.gemm_2_4(a.cpu(), layer.b_q.cpu(), layer.b_meta.cpu(), layer.b_s.cpu(), b_zeros=b_z)
    assert rel_err(c.cpu(), cpu) < (2e-3 if layer.dtype == torch.float16 else 8e-3)
    ws = marlin.make_workspace()
    assert torch.equal(marlin.gemm_2_4(a, layer.b_q, layer.b_meta, layer.b_s, ws, layer.b_z), c)
    assert int(ws.abs().sum()) == 0


def plan_lines(capfd) -> list[str]:
    """The 2:4 op's plan lines (MARLIN_LOG_PLAN=1) printed since capfd was last read."""
    return [line for line in capfd.readouterr().err.splitlines() if line.startswith("marlin.gemm_2_4 plan:")]


def plan_of_call(capfd, a, b_q, b_meta, b_s) -> dict:
    """The plan of one gemm_2_4 call (the caller sets MARLIN_LOG_PLAN=1): its log line's fields, name
    -> value, and the whole line under "line" (for assertion messages)."""
    plan_lines(capfd)
    marlin.gemm_2_4(a, b_q, b_meta, b_s)
    torch.cuda.synchronize()
    line = plan_lines(capfd)[0]
    plan = dict(field.split("=", 1) for field in line.split("plan:")[1].split())
    plan["line"] = line
    return plan
