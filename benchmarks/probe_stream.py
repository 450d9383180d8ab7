"""Diagnostic: how fast one kernel streams a layer's int4 weight bytes in the small-batch kernel's
access pattern (stages of 8 rows of b_q x 2 KB, one 256-column tile; each block a contiguous range
of stages, tile by tile), by how the bytes reach shared memory, beside marlin.gemm at M = 1:

  cpasync  16-byte cp.async per thread into a ring of STAGES, one __syncthreads per stage (the
           small-batch kernel's scheme)
  bulk     one thread issues 8 cp.async.bulk copies of 2 KB per stage onto an mbarrier; one
           __syncthreads per stage
  ws       a producer warp issues the bulk copies; 8 consumer warps release each slot on an "empty"
           mbarrier (no block-wide barrier)

Each consumer thread reads its 64 bytes of every stage from shared memory and runs C rounds of 4
independent IMADs per 16 bytes on them (C = 0, 4, 8, 16: about the small-batch kernel's issue load
per stage at 1-8 rows lies between 8 and 16). Blocks per SM 1 or 2 (grid = SMs x that).
Timed as bench_gemm times kernels (CUDA graph of calls over copies rotated past 4 x L2, median).

    python -m benchmarks.probe_stream OUT.json            (the C sweep)
    python -m benchmarks.probe_stream OUT.json --stages   (ring depth 4-12 and blocks per SM, C = 0)

Results and what they say: benchmarks/NOTES.md (twenty-ninth). Needs nvcc (the kernels are built
with torch.utils.cpp_extension.load_inline for sm_90a)."""

import json
import sys

import torch

SRC = r'''
#include <cuda_runtime.h>
#include <cstdint>
#include <set>
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
__device__ __forceinline__ uint32_t sa(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void cp16(void* d, const void* s) {
  asm volatile("{\n .reg .b64 p;\n createpolicy.fractional.L2::evict_first.b64 p, 1.0;\n"
               " cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, p;\n}\n" :: "r"(sa(d)), "l"(s));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void waitg() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }
__device__ __forceinline__ void mb_init(uint64_t* b, int c) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(sa(b)), "r"(c) : "memory"); }
__device__ __forceinline__ void mb_arrive(uint64_t* b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(sa(b)) : "memory"); }
__device__ __forceinline__ void mb_expect(uint64_t* b, int n) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(sa(b)), "r"(n) : "memory"); }
__device__ __forceinline__ void mb_wait(uint64_t* b, int par) {
  asm volatile("{\n .reg .pred d;\n W_%=:\n mbarrier.try_wait.parity.shared::cta.b64 d, [%0], %1;\n @!d bra W_%=;\n}\n" :: "r"(sa(b)), "r"(par) : "memory");
}
__device__ __forceinline__ void bulk(void* d, const void* s, int n, uint64_t* b) {
  asm volatile("{\n .reg .b64 p;\n createpolicy.fractional.L2::evict_first.b64 p, 1.0;\n"
               " cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], p;\n}\n"
               :: "r"(sa(d)), "l"(s), "r"(n), "r"(sa(b)) : "memory");
}
// C rounds of 4 independent IMADs per 16 bytes: about the dequantization and mma issue of a stage
template <int C> __device__ __forceinline__ int work(int4 v) {
  int a0 = v.x, a1 = v.y, a2 = v.z, a3 = v.w;
#pragma unroll
  for (int c = 0; c < C; c++) { a0 = a0 * v.y + v.x; a1 = a1 * v.z + v.w; a2 = a2 * v.w + v.y; a3 = a3 * v.x + v.z; }
  return a0 ^ a1 ^ a2 ^ a3;
}
constexpr int kStageInt4 = 1024;  // 16 KB: 8 rows x 2 KB
struct Geo { const int4* base; long long row_int4; int kblocks; long long total; };
__device__ __forceinline__ const int4* seg(const Geo& g, long long st, int r) {
  const long long tile = st / g.kblocks; const int kb = st % g.kblocks;
  return g.base + (kb * 8 + r) * g.row_int4 + tile * 128;
}
template <int STAGES, int C>
__global__ void __launch_bounds__(256) k_cpasync(Geo g, int* out) {
  extern __shared__ int4 sm[];
  const int tid = threadIdx.x;
  const long long s0 = g.total * blockIdx.x / gridDim.x, s1 = g.total * (blockIdx.x + 1) / gridDim.x;
  const int n = s1 - s0;
  int acc = 0;
  auto fetch = [&](int i) {
    if (i < n) {
      int4* d = sm + (i % STAGES) * kStageInt4;
#pragma unroll
      for (int l = 0; l < 4; l++) { const int idx = tid + l * 256; cp16(d + idx, seg(g, s0 + i, idx >> 7) + (idx & 127)); }
    }
    commit();
  };
  for (int i = 0; i < STAGES - 1; i++) fetch(i);
  for (int i = 0; i < n; i++) {
    waitg<STAGES - 2>();
    __syncthreads();
    fetch(i + STAGES - 1);
    const int4* d = sm + (i % STAGES) * kStageInt4;
#pragma unroll
    for (int l = 0; l < 4; l++) { int4 v = d[tid + l * 256]; acc ^= work<C>(v); }
  }
  out[blockIdx.x * 256 + tid] = acc;
}
template <int STAGES, int C>
__global__ void __launch_bounds__(256) k_bulk(Geo g, int* out) {
  extern __shared__ int4 sm[];
  __shared__ uint64_t full[STAGES];
  const int tid = threadIdx.x;
  const long long s0 = g.total * blockIdx.x / gridDim.x, s1 = g.total * (blockIdx.x + 1) / gridDim.x;
  const int n = s1 - s0;
  if (tid == 0) { for (int s = 0; s < STAGES; s++) mb_init(&full[s], 1); asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
  __syncthreads();
  auto fetch = [&](int i) {
    if (tid == 0 && i < n) {
      uint64_t* b = &full[i % STAGES];
      mb_expect(b, 16384);
      int4* d = sm + (i % STAGES) * kStageInt4;
#pragma unroll
      for (int r = 0; r < 8; r++) bulk(d + r * 128, seg(g, s0 + i, r), 2048, b);
    }
  };
  for (int i = 0; i < STAGES - 1; i++) fetch(i);
  int acc = 0;
  for (int i = 0; i < n; i++) {
    mb_wait(&full[i % STAGES], (i / STAGES) & 1);
    __syncthreads();  // every thread is done with slot (i - 1) % STAGES
    fetch(i + STAGES - 1);
    const int4* d = sm + (i % STAGES) * kStageInt4;
#pragma unroll
    for (int l = 0; l < 4; l++) { int4 v = d[tid + l * 256]; acc ^= work<C>(v); }
  }
  out[blockIdx.x * 256 + tid] = acc;
}
// warp 8 produces, warps 0-7 consume; a slot is refilled once all 8 consumer warps released it
template <int STAGES, int C>
__global__ void __launch_bounds__(288) k_ws(Geo g, int* out) {
  extern __shared__ int4 sm[];
  __shared__ uint64_t full[STAGES], empty[STAGES];
  const int tid = threadIdx.x;
  const long long s0 = g.total * blockIdx.x / gridDim.x, s1 = g.total * (blockIdx.x + 1) / gridDim.x;
  const int n = s1 - s0;
  if (tid == 0) {
    for (int s = 0; s < STAGES; s++) { mb_init(&full[s], 1); mb_init(&empty[s], 8); }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (tid >= 256) {
    if (tid == 256) {
      for (int i = 0; i < n; i++) {
        const int slot = i % STAGES;
        if (i >= STAGES) mb_wait(&empty[slot], ((i / STAGES) - 1) & 1);
        uint64_t* b = &full[slot];
        mb_expect(b, 16384);
        int4* d = sm + slot * kStageInt4;
#pragma unroll
        for (int r = 0; r < 8; r++) bulk(d + r * 128, seg(g, s0 + i, r), 2048, b);
      }
    }
    return;
  }
  int acc = 0;
  for (int i = 0; i < n; i++) {
    const int slot = i % STAGES;
    mb_wait(&full[slot], (i / STAGES) & 1);
    const int4* d = sm + slot * kStageInt4;
#pragma unroll
    for (int l = 0; l < 4; l++) { int4 v = d[tid + l * 256]; acc ^= work<C>(v); }
    __syncwarp();
    if ((tid & 31) == 0) mb_arrive(&empty[slot]);
  }
  out[blockIdx.x * 256 + tid] = acc;
}
template <typename K> void launch(K k, int threads, int stages, torch::Tensor w, int64_t kdim, int64_t ncols, int64_t grid, torch::Tensor out) {
  Geo g{reinterpret_cast<const int4*>(w.data_ptr<int>()), ncols * 8 / 16, (int)(kdim / 128), (ncols / 256) * (kdim / 128)};
  const int smem = stages * kStageInt4 * 16;
  static std::set<const void*> done;
  if (!done.count((const void*)k)) { cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem); done.insert((const void*)k); }
  k<<<grid, threads, smem, c10::cuda::getCurrentCUDAStream()>>>(g, out.data_ptr<int>());
}
void run(std::string kind, int64_t stages, int64_t c, torch::Tensor w, int64_t kdim, int64_t ncols, int64_t grid, torch::Tensor out) {
#define CASE(S, CC) \
  if (stages == S && c == CC) { if (kind == "cpasync") return launch(k_cpasync<S, CC>, 256, S, w, kdim, ncols, grid, out); \
                     if (kind == "bulk") return launch(k_bulk<S, CC>, 256, S, w, kdim, ncols, grid, out); \
                     if (kind == "ws") return launch(k_ws<S, CC>, 288, S, w, kdim, ncols, grid, out); }
  CASE(4, 0) CASE(4, 4) CASE(4, 8) CASE(4, 16) CASE(6, 0) CASE(8, 0) CASE(8, 4) CASE(8, 8) CASE(8, 16) CASE(12, 0)
  TORCH_CHECK(false, "bad kind/stages");
}
'''


def build():
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        "marlin_probe_stream",
        cpp_sources="void run(std::string kind, int64_t stages, int64_t c, torch::Tensor w, int64_t kdim, int64_t ncols, "
        "int64_t grid, torch::Tensor out);",
        cuda_sources=SRC, functions=["run"], extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"])


def configs(stage_sweep: bool):
    """(kind, stages, blocks per SM, C) to time."""
    if stage_sweep:
        return [(kind, st, bps, 0) for kind in ("cpasync", "bulk", "ws") for st in (4, 6, 8, 12) for bps in (1, 2, 3)
                if st * 16 * bps <= 220]
    return [(kind, st, bps, c) for kind, st, bps in (("cpasync", 4, 1), ("cpasync", 4, 2), ("ws", 8, 1), ("ws", 4, 1))
            for c in (0, 4, 8, 16)]


def main(argv=None) -> int:
    from benchmarks.gemm_prep import prepare
    from benchmarks.shapes import BENCH_SHAPES
    from benchmarks.timing import graph_median_us

    argv = sys.argv[1:] if argv is None else argv
    out_path, stage_sweep = argv[0], "--stages" in argv
    mod = build()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2, sms = props.L2_cache_size, props.multi_processor_count
    res = []
    for name, (k, n) in BENCH_SHAPES.items():  # the eight Llama layers of the full run
        kk = k // 128 * 128
        nbytes = kk * n // 2
        copies = max(2, -(-4 * l2 // nbytes))
        ws = [torch.randint(-2**31, 2**31, (kk // 16, 2 * n), dtype=torch.int32, device=dev) for _ in range(copies)]
        out = torch.empty(sms * 4 * 288, dtype=torch.int32, device=dev)
        reps = copies * max(1, 20 // copies)

        def rot(f):
            c = [0]

            def g():
                i = c[0] % copies
                c[0] += 1
                f(i)
            return g

        row = {"shape": name, "K": k, "N": n, "MB": nbytes / 1e6}
        prep = prepare("marlin_g128", k, n, dev, l2)
        fm = prep.make_fn(torch.randn(1, k, dtype=torch.float16, device=dev))
        row["marlin_us"] = graph_median_us(rot(fm), reps)
        dst = torch.empty_like(ws[0])
        row["copy_us"] = graph_median_us(rot(lambda i: dst.copy_(ws[i])), reps)
        for kind, st, bps, c in configs(stage_sweep):
            row[f"{kind}_s{st}_b{bps}_c{c}"] = graph_median_us(
                rot(lambda i: mod.run(kind, st, c, ws[i], kk, n, sms * bps, out)), reps)
        timed = {key: v for key, v in row.items() if key.startswith(("cpasync", "bulk", "ws"))}
        best = min(timed, key=timed.get)
        print(f"{name} {nbytes / 1e6:.1f} MB: marlin {row['marlin_us']:.1f} us ({nbytes / row['marlin_us'] / 1e3:.0f} GB/s), "
              f"best stream {best} {timed[best]:.1f} us ({nbytes / timed[best] / 1e3:.0f} GB/s)", flush=True)
        print("   " + " ".join(f"{key}={v:.1f}" for key, v in timed.items()), flush=True)
        res.append(row)
        del ws, prep
        torch.cuda.empty_cache()
    meta = {"gpu": props.name, "torch": torch.__version__, "sweep": "stages" if stage_sweep else "work"}
    with open(out_path, "w") as fh:
        json.dump({"meta": meta, "points": res}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
