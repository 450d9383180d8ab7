// The compiled small-batch kernel instances (smallm_kernel.cuh). Each smallm_instances_mb<MB>.cu
// defines the launches for one batch width, so that nvcc builds them in parallel.
#pragma once

#include <cuda_runtime.h>

#include "launch_attr.cuh"
#include "smallm_kernel.cuh"

namespace marlin {

// Stages of the ring: 3 for the 512-column tile at MB <= 2, so that two blocks fit one SM's
// shared memory (2 x 111 KB at most); 4 otherwise. WG (sm_90a, one block per SM) keeps only
// STAGES - 2 stages in flight where it refills early (SmallMShape::kLateRefill), so it gets 5
// (at most 206 KB), and 4 at MB = 8 (197 KB) and MB = 16 (197 KB: 32 KB of activations and 16 KB
// of weights per stage; late refill, 3 in flight). 8-bit weights (W) double a stage's weights:
// WG keeps 4 stages at MB = 4 (201 KB) and 3 from MB = 8 on (215 and 199 KB), so that a block
// still fits the 227 KB an H100 / H200 block may opt into.
template <int MB, int NW, bool WG, int W = kU4>
constexpr int kSmallMStages = !WG ? ((NW == 8 && MB <= 2) ? 3 : 4)
                              : NW == 2 && MB == 16 ? 3  // its K-warp reduction buffer takes 64 KB
                              : W == kU8 ? (MB >= 8 ? 3 : MB == 4 ? 4 : 5)
                                         : (MB >= 8 ? 4 : 5);

// ET, W, RG: element type, weight format and run-time group size (smallm_kernel.cuh); the
// defaults are the base format, fp16 symmetric INT4 (group 128 or per column). MINB: the
// kernel's minimum blocks per SM (register bound), kSmallMMinBlocksPerSm by default.
template <int MB, int NW, bool GROUPED, bool WG = false, typename ET = half, int W = kU4, int RG = 0>
using SmallMShapeOf = SmallMShape<MB, NW, kSmallMStages<MB, NW, WG, W>, GROUPED, WG, ET, W, RG>;

template <int MB, int NW, bool GROUPED, bool WG, typename ET = half, int W = kU4, int RG = 0,
          int MINB = kSmallMMinBlocksPerSm<MB, WG>>
cudaError_t launch_smallm(const KernelParams& p, int grid, int smem, cudaStream_t stream, bool pdl, int cluster);

// How many clusters of `cluster` blocks of the instance can be resident at once (0: none).
template <int MB, int NW, bool GROUPED, bool WG, typename ET = half, int W = kU4, int RG = 0,
          int MINB = kSmallMMinBlocksPerSm<MB, WG>>
int smallm_max_clusters(int cluster, int smem);

// One shared-memory opt-in and occupancy cache per instance.
template <int MB, int NW, bool GROUPED, bool WG, typename ET, int W, int RG, int MINB>
SmemAttrCache& smallm_cache() {
  static SmemAttrCache cache;
  return cache;
}

#define MARLIN_DEFINE_SMALLM_LAUNCH                                                                                 \
  template <int MB, int NW, bool GROUPED, bool WG, typename ET, int W, int RG, int MINB>                           \
  cudaError_t launch_smallm(const KernelParams& p, int grid, int smem, cudaStream_t stream, bool pdl,               \
                            int cluster) {                                                                          \
    return launch_kernel(marlin_smallm_kernel<MB, NW, kSmallMStages<MB, NW, WG, W>, GROUPED, WG, ET, W, RG, MINB>,     \
                         smallm_cache<MB, NW, GROUPED, WG, ET, W, RG, MINB>(), p, grid, kThreads, smem, stream, pdl, \
                         cluster);                                                                                  \
  }                                                                                                                 \
  template <int MB, int NW, bool GROUPED, bool WG, typename ET, int W, int RG, int MINB>                           \
  int smallm_max_clusters(int cluster, int smem) {                                                                  \
    return smallm_cache<MB, NW, GROUPED, WG, ET, W, RG, MINB>().max_clusters(                                       \
        marlin_smallm_kernel<MB, NW, kSmallMStages<MB, NW, WG, W>, GROUPED, WG, ET, W, RG, MINB>, cluster, kThreads, \
        smem);                                                                                                      \
  }

#define MARLIN_INSTANTIATE_SMALLM_ONE(MB, NW, G, WG)                                                        \
  template cudaError_t launch_smallm<MB, NW, G, WG>(const KernelParams&, int, int, cudaStream_t, bool, int); \
  template int smallm_max_clusters<MB, NW, G, WG>(int, int);

// One instance of another format (256-column tile), mma.sync (WG false) or wgmma: G grouped (then
// RG, the group size at run time) or per column.
#define MARLIN_INSTANTIATE_SMALLM_FMT_WG(MB, ET, W, G, WG)                                           \
  template cudaError_t launch_smallm<MB, 4, G, WG, ET, W, G>(const KernelParams&, int, int, cudaStream_t, \
                                                             bool, int);                              \
  template int smallm_max_clusters<MB, 4, G, WG, ET, W, G>(int, int);
#define MARLIN_INSTANTIATE_SMALLM_FMT(MB, ET, W, G) MARLIN_INSTANTIATE_SMALLM_FMT_WG(MB, ET, W, G, false)

// The small-batch format table (marlin_gemm.cu's find_smallm_format follows it): for one MB,
// element type and kernel variant, symmetric INT4 grouped (and per column in bf16), INT4 with
// zero points grouped, 8-bit grouped and per column.
#define MARLIN_INSTANTIATE_SMALLM_FORMATS_WG(MB, ET, WG)    \
  MARLIN_INSTANTIATE_SMALLM_FMT_WG(MB, ET, kU4, true, WG)   \
  MARLIN_INSTANTIATE_SMALLM_FMT_WG(MB, ET, kU4Zp, true, WG) \
  MARLIN_INSTANTIATE_SMALLM_FMT_WG(MB, ET, kU8, true, WG)   \
  MARLIN_INSTANTIATE_SMALLM_FMT_WG(MB, ET, kU8, false, WG)
#define MARLIN_INSTANTIATE_SMALLM_FORMATS(MB, ET) MARLIN_INSTANTIATE_SMALLM_FORMATS_WG(MB, ET, false)

// A wgmma instance of another format on the 128-column tile (NW 2), group scales, RG 0 (fixed
// group of 128, below) or 1 (run-time group): for narrow_tile_where_it_pays at 17-64 rows
// (fixed_g128_instance's zero points, bf16 symmetric INT4 in groups of 128 on the run-time-group
// instance).
#define MARLIN_INSTANTIATE_SMALLM_FMT_NARROW(MB, ET, W, RG)                                                 \
  template cudaError_t launch_smallm<MB, 2, true, true, ET, W, RG>(const KernelParams&, int, int, cudaStream_t, \
                                                                   bool, int);                               \
  template int smallm_max_clusters<MB, 2, true, true, ET, W, RG>(int, int);

// The same at 16 rows (MB 2) held to 128 registers, two blocks per SM: the planner's 16-row rule
// (rows_16_narrow_two in marlin_gemm.cu), as for fp16 group 128.
#define MARLIN_INSTANTIATE_SMALLM_FMT_NARROW_TWO(ET, W, RG)                                                   \
  template cudaError_t launch_smallm<2, 2, true, true, ET, W, RG, 2>(const KernelParams&, int, int, cudaStream_t, \
                                                                     bool, int);                               \
  template int smallm_max_clusters<2, 2, true, true, ET, W, RG, 2>(int, int);

// A wgmma instance of another format with the group size fixed at 128 rows (RG 0: one scale row
// per stage, read once per stage, the zero points' dequantization constants made once per stage),
// for the planner's fixed_g128_instance: zero points (fp16, bf16) at every wgmma slice.
#define MARLIN_INSTANTIATE_SMALLM_FMT_G128(MB, ET, W)                                                     \
  template cudaError_t launch_smallm<MB, 4, true, true, ET, W, 0>(const KernelParams&, int, int, cudaStream_t, \
                                                                  bool, int);                               \
  template int smallm_max_clusters<MB, 4, true, true, ET, W, 0>(int, int);

// Both tile widths x (group 128, per column) for one MB, with mma.sync (WG false) or wgmma.
#define MARLIN_INSTANTIATE_SMALLM(MB, WG)        \
  MARLIN_INSTANTIATE_SMALLM_ONE(MB, 4, true, WG)  \
  MARLIN_INSTANTIATE_SMALLM_ONE(MB, 4, false, WG) \
  MARLIN_INSTANTIATE_SMALLM_ONE(MB, 8, true, WG)  \
  MARLIN_INSTANTIATE_SMALLM_ONE(MB, 8, false, WG)

}  // namespace marlin
