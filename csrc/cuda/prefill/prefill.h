// The prefill kernel's launch entry points (prefill_kernel.cuh), for the planner (marlin_gemm.cu).
#pragma once

#include <cuda_runtime.h>

namespace marlin {

struct KernelParams;

// What the planner needs of the kernel: its tile and shared memory (prefill_kernel.cuh's PrefillShape).
constexpr int kPrefillTileN = 128;
constexpr int kPrefillTileM = 256;
constexpr int kPrefillTileK = 64;
int prefill_smem_bytes(int bits);  // bits of the packed weights: 4 or 8

// BF16: bf16 activations, scales and output (else fp16). W: the weight type (dequant.cuh's WType:
// kU4, kU4Zp with zero points per group, GROUPED only, or kU8). GROUPED: scales in groups of 32, 64
// or 128 along K (p.group_shift); else per column. cluster is ignored (1).
template <bool BF16, int W, bool GROUPED>
cudaError_t launch_prefill(const KernelParams& p, int grid, int smem, cudaStream_t stream, bool pdl, int cluster);

}  // namespace marlin
