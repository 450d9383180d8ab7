// The compiled kernel instances. Each marlin_instances_*.cu defines the launches for one number
// of 16-row M blocks and one element type, so that nvcc builds them in parallel;
// marlin_gemm.cu dispatches.
#pragma once

#include <cuda_runtime.h>

#include "launch_attr.cuh"
#include "marlin_kernel.cuh"

namespace marlin {

constexpr int kStages = 4;
constexpr int kGroupBlocks128 = 128 / 16;
constexpr int kGroupBlocksRuntime = 0;  // group size from KernelParams::group_shift
constexpr int kPerColumn = -1;

// PN: the instance takes a partial last tile of N (marlin_kernel.cuh, PARTIAL_N)
template <typename T, int W, int TM, int TK, int TN, int G, bool PN>
cudaError_t launch_instance(const KernelParams& p, int grid, int smem, cudaStream_t stream, bool pdl, int cluster);

#define MARLIN_DEFINE_LAUNCH                                                                                   \
  template <typename T, int W, int TM, int TK, int TN, int G, bool PN>                                         \
  cudaError_t launch_instance(const KernelParams& p, int grid, int smem, cudaStream_t stream, bool pdl,         \
                              int cluster) {                                                                   \
    static SmemAttrCache cache;                                                                                \
    return launch_kernel(marlin_gemm_kernel<T, W, TM, TK, TN, kStages, G, PN>, cache, p, grid, kThreads, smem,   \
                         stream, pdl, cluster);                                                                \
  }

#define MARLIN_INSTANTIATE_ONE_PN(T, W, TM, G, PN)                                                                 \
  template cudaError_t launch_instance<T, W, TM, 8, 8, G, PN>(const KernelParams&, int, int, cudaStream_t, bool, int); \
  template cudaError_t launch_instance<T, W, TM, 4, 16, G, PN>(const KernelParams&, int, int, cudaStream_t, bool, int);
#define MARLIN_INSTANTIATE_ONE(T, W, TM, G) MARLIN_INSTANTIATE_ONE_PN(T, W, TM, G, true)

// The format table (marlin_gemm.cu's find_instance follows it): fp16 symmetric INT4 in groups
// of 128 and per column has its own instances (the original format, unchanged code); every
// other format and group size takes its group size at run time (kGroupBlocksRuntime) or is per
// column.
#define MARLIN_INSTANTIATE_FP16_BASE(TM)                           \
  MARLIN_INSTANTIATE_ONE_PN(half, kU4, TM, kGroupBlocks128, false) \
  MARLIN_INSTANTIATE_ONE_PN(half, kU4, TM, kPerColumn, false)

// Every other format of T: symmetric INT4 (unless T is fp16 and the group size 128), INT4 with
// zero points, 8-bit; each with run-time group size and per column. Only for TM = 1, 2, 4 (the
// planner runs 33-48 rows as a slice of 64).
#define MARLIN_INSTANTIATE_FORMATS(T, TM)                   \
  MARLIN_INSTANTIATE_ONE(T, kU4, TM, kGroupBlocksRuntime)   \
  MARLIN_INSTANTIATE_ONE(T, kU4Zp, TM, kGroupBlocksRuntime) \
  MARLIN_INSTANTIATE_ONE(T, kU4Zp, TM, kPerColumn)          \
  MARLIN_INSTANTIATE_ONE(T, kU8, TM, kGroupBlocksRuntime)   \
  MARLIN_INSTANTIATE_ONE(T, kU8, TM, kPerColumn)

// per column symmetric INT4 with partial N tiles: every bf16 call, fp16 calls whose N the tile does not divide
#define MARLIN_INSTANTIATE_SYM_COL(T, TM) MARLIN_INSTANTIATE_ONE(T, kU4, TM, kPerColumn)

}  // namespace marlin
