"""Run by tests/test_direct_calls.py in a fresh process (MARLIN_LOG_PLAN=1): gemm calls without a
workspace, (1) the process's first call captured in a CUDA graph, (2) two streams at once,
(3) a second device. Prints one line per check; exits non-zero on a wrong result."""

import sys

import torch

from marlin import packing

# K = 4096, N = 256 at M = 33: the tiled kernel with one k-tile per block (MARLIN_SMALL_LAYER_CLUSTERS=0,
# set by the test, keeps this small layer off the small-batch kernel on H100/H200), so every column
# is split over 64 blocks and reduced through the lock counters (the log must say global_reduction=1).
K, N, M = 4096, 256, 33


def layer(device, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, s = packing.quantize(torch.randn(K, N, generator=gen), 128)
    b_q, b_s = packing.pack(q, s)
    return b_q.to(device), b_s.to(device), packing.dequantize(q, s).to(device)


def check(name, out, a, w):
    ref = a.float() @ w
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    ok = bool(torch.isfinite(out).all()) and err < 3e-3
    print(f"{name}: rel err {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    if not ok:
        sys.exit(1)


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", 0)
    b_q, b_s, w = layer(dev, 0)
    gemm = torch.ops.marlin.gemm

    # (1) first call of the process, inside a capture: the stream's lock slot is taken under capture
    a = torch.randn(M, K, device=dev, dtype=torch.float16)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            out = gemm(a, b_q, b_s, None, None)
    for i in range(3):
        a.copy_(torch.randn(M, K, device=dev, dtype=torch.float16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(f"graph replay {i}", out, a, w)
    # eager calls on the capturing stream afterwards reuse the same slot: still zeroed
    with torch.cuda.stream(stream):
        check("eager after capture", gemm(a, b_q, b_s, None, None), a, w)

    # (2) two streams, many calls each, interleaved; each stream has its own lock slot
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    inputs = [[torch.randn(M, K, device=dev, dtype=torch.float16) for _ in range(40)] for _ in streams]
    outs = [[None] * 40 for _ in streams]
    torch.cuda.synchronize()
    for i in range(40):
        for s, st in enumerate(streams):
            with torch.cuda.stream(st):
                outs[s][i] = gemm(inputs[s][i], b_q, b_s, None, None)
    torch.cuda.synchronize()
    for s in range(2):
        for i in range(40):
            check(f"stream {s} call {i}", outs[s][i], inputs[s][i], w)

    # (3) another device, if there is one
    if torch.cuda.device_count() > 1:
        dev1 = torch.device("cuda", 1)
        b_q1, b_s1, w1 = layer(dev1, 1)
        a1 = torch.randn(M, K, device=dev1, dtype=torch.float16)
        check("device 1", gemm(a1, b_q1, b_s1, None, None), a1, w1)
    else:
        print("device 1: not present", flush=True)


if __name__ == "__main__":
    main()
