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
// of weights per stage; late refill, 3 in flight).
template <int MB, int NW, bool WG>
constexpr int kSmallMStages = WG ? (MB >= 8 ? 4 : 5) : (NW == 8 && MB <= 2) ? 3 : 4;

template <int MB, int NW, bool GROUPED, bool WG = false>
using SmallMShapeOf = SmallMShape<MB, NW, kSmallMStages<MB, NW, WG>, GROUPED, WG>;

template <int MB, int NW, bool GROUPED, bool WG>
cudaError_t launch_smallm(const KernelParams& p, int grid, int smem, cudaStream_t stream, bool pdl, int cluster);

// How many clusters of `cluster` blocks of the instance can be resident at once (0: none).
template <int MB, int NW, bool GROUPED, bool WG>
int smallm_max_clusters(int cluster, int smem);

// One shared-memory opt-in and occupancy cache per instance.
template <int MB, int NW, bool GROUPED, bool WG>
SmemAttrCache& smallm_cache() {
  static SmemAttrCache cache;
  return cache;
}

#define MARLIN_DEFINE_SMALLM_LAUNCH                                                                            \
  template <int MB, int NW, bool GROUPED, bool WG>                                                             \
  cudaError_t launch_smallm(const KernelParams& p, int grid, int smem, cudaStream_t stream, bool pdl,          \
                            int cluster) {                                                                     \
    return launch_kernel(marlin_smallm_kernel<MB, NW, kSmallMStages<MB, NW, WG>, GROUPED, WG>,                 \
                         smallm_cache<MB, NW, GROUPED, WG>(), p, grid, kThreads, smem, stream, pdl, cluster);  \
  }                                                                                                            \
  template <int MB, int NW, bool GROUPED, bool WG>                                                             \
  int smallm_max_clusters(int cluster, int smem) {                                                             \
    return smallm_cache<MB, NW, GROUPED, WG>().max_clusters(                                                   \
        marlin_smallm_kernel<MB, NW, kSmallMStages<MB, NW, WG>, GROUPED, WG>, cluster, kThreads, smem);        \
  }

#define MARLIN_INSTANTIATE_SMALLM_ONE(MB, NW, G, WG)                                                        \
  template cudaError_t launch_smallm<MB, NW, G, WG>(const KernelParams&, int, int, cudaStream_t, bool, int); \
  template int smallm_max_clusters<MB, NW, G, WG>(int, int);

// Both tile widths x (group 128, per column) for one MB, with mma.sync (WG false) or wgmma.
#define MARLIN_INSTANTIATE_SMALLM(MB, WG)        \
  MARLIN_INSTANTIATE_SMALLM_ONE(MB, 4, true, WG)  \
  MARLIN_INSTANTIATE_SMALLM_ONE(MB, 4, false, WG) \
  MARLIN_INSTANTIATE_SMALLM_ONE(MB, 8, true, WG)  \
  MARLIN_INSTANTIATE_SMALLM_ONE(MB, 8, false, WG)

}  // namespace marlin
