// The compiled kernel instances. Each marlin_instances_m<TM>.cu defines the launches for one
// number of 16-row M blocks, so that nvcc builds them in parallel; marlin_gemm.cu dispatches.
#pragma once

#include <cuda_runtime.h>

#include "launch_attr.cuh"
#include "marlin_kernel.cuh"

namespace marlin {

constexpr int kStages = 4;
constexpr int kGroupBlocks128 = 128 / 16;

template <int TM, int TK, int TN, int G>
cudaError_t launch_instance(const KernelParams& p, int grid, int smem, cudaStream_t stream, bool pdl, int cluster);

#define MARLIN_DEFINE_LAUNCH                                                                                 \
  template <int TM, int TK, int TN, int G>                                                                   \
  cudaError_t launch_instance(const KernelParams& p, int grid, int smem, cudaStream_t stream, bool pdl,       \
                              int cluster) {                                                                 \
    static SmemAttrCache cache;                                                                              \
    return launch_kernel(marlin_gemm_kernel<TM, TK, TN, kStages, G>, cache, p, grid, kThreads, smem, stream, pdl, \
                         cluster);                                                                           \
  }

// Both tiles x (group 128, per column) for one TM.
#define MARLIN_INSTANTIATE_TM(TM)                                                                             \
  template cudaError_t launch_instance<TM, 8, 8, kGroupBlocks128>(const KernelParams&, int, int, cudaStream_t, bool, int); \
  template cudaError_t launch_instance<TM, 8, 8, -1>(const KernelParams&, int, int, cudaStream_t, bool, int);              \
  template cudaError_t launch_instance<TM, 4, 16, kGroupBlocks128>(const KernelParams&, int, int, cudaStream_t, bool, int); \
  template cudaError_t launch_instance<TM, 4, 16, -1>(const KernelParams&, int, int, cudaStream_t, bool, int);

}  // namespace marlin
