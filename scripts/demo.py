"""Quantize one Llama-sized linear layer, run it through marlin, and report error and speed.

    python scripts/demo.py [--in-features 4096] [--out-features 4096] [--batch 16] [--group-size 128]
"""

import argparse
import time

import torch

import marlin


def time_cuda(fn, iters=200):
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--in-features", type=int, default=4096)
    p.add_argument("--out-features", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--group-size", type=int, default=128, choices=[128, -1])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)

    linear = torch.nn.Linear(args.in_features, args.out_features, bias=False, dtype=torch.float16, device=dev)
    x = torch.randn(args.batch, args.in_features, dtype=torch.float16, device=dev)
    t0 = time.perf_counter()
    b_q, b_s = marlin.packing.quantize_and_pack(linear.weight.t().float(), args.group_size)
    b_q, b_s = b_q.to(dev), b_s.to(dev)
    print(f"quantized a {args.in_features}x{args.out_features} layer (group size {args.group_size}) "
          f"in {time.perf_counter() - t0:.2f} s: {linear.weight.numel() * 2 / 2**20:.1f} MiB fp16 -> "
          f"{(b_q.numel() * 4 + b_s.numel() * 2) / 2**20:.1f} MiB")

    y_ref = (x.double() @ linear.weight.double().t())
    y = marlin.gemm(x, b_q, b_s)
    y_fp16 = linear(x)
    err = ((y.double() - y_ref).norm() / y_ref.norm()).item()
    err16 = ((y_fp16.double() - y_ref).norm() / y_ref.norm()).item()
    print(f"device {dev}: relative error vs the FP16 layer (exact): marlin {err:.4f} "
          f"(INT4 quantization error; fp16 matmul alone: {err16:.1e})")

    if dev.type == "cuda":
        ws = marlin.make_workspace(dev)
        t_m = time_cuda(lambda: marlin.gemm(x, b_q, b_s, ws))
        t_f = time_cuda(lambda: linear(x))
        print(f"{torch.cuda.get_device_name(dev)}: marlin {t_m:.1f} us, fp16 {t_f:.1f} us, "
              f"speedup {t_f / t_m:.2f}x (weights hot in L2 for this small demo; see benchmarks/ for the method)")
    else:
        print("no GPU: speed is not measured on the CPU (the CPU op is a reference implementation)")


if __name__ == "__main__":
    main()
