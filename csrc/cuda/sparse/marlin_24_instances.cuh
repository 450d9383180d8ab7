// The compiled instances of the 2:4-sparse kernel (marlin_24_kernel.cuh) and their host-side
// handles: launch, shared memory, threads, resident blocks and clusters. find<ET, FINE> is
// defined in marlin_24_instances_{f16,bf16}{,_fine}.cu (one element type and kernel kind each, so
// that the four compile in parallel); marlin_24.cu plans with the handles.
#pragma once

#include <algorithm>
#include <atomic>

#include "../launch_attr.cuh"
#include "marlin_24.h"
#include "marlin_24_kernel.cuh"

namespace marlin {
namespace sparse24 {

template <int MB, int NW, int MS, int ST, int WG, int KW, typename ET, bool FINE>
SmemAttrCache& cache() {
  static SmemAttrCache c;
  return c;
}

// Resident blocks per SM (registers and shared memory), at least 1; 0 if the queries failed.
// Remembered per device for the last smem asked (groups of 64 or 32 ask with more than the
// instance's own; the occupancy query takes host time).
template <int MB, int NW, int MS, int ST, int WG, int KW, typename ET, bool FINE>
int blocks_per_sm(int smem) {
  constexpr int kMaxDevices = 64;
  static std::atomic<long long> known[kMaxDevices];  // smem << 32 | blocks; 0: not yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const long long key = static_cast<long long>(smem) << 32;
  if (device >= 0 && device < kMaxDevices) {
    const long long k = known[device].load();
    if (k != 0 && (k & ~0xFFFFFFFFLL) == key) return static_cast<int>(k & 0xFFFFFFFF);
  }
  auto kernel = marlin_24_kernel<MB, NW, MS, ST, WG, KW, ET, FINE>;
  int blocks = 0;
  if (cache<MB, NW, MS, ST, WG, KW, ET, FINE>().ensure(reinterpret_cast<const void*>(kernel), smem) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, Shape<MB, NW, MS, WG != 0, KW>::kThreads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  blocks = std::max(blocks, 1);
  if (device >= 0 && device < kMaxDevices) known[device].store(key | blocks);
  return blocks;
}

template <int MB, int NW, int MS, int ST, int WG, int KW, typename ET, bool FINE>
int max_clusters(int cluster, int smem) {
  return cache<MB, NW, MS, ST, WG, KW, ET, FINE>().max_clusters(marlin_24_kernel<MB, NW, MS, ST, WG, KW, ET, FINE>, cluster,
                                                      Shape<MB, NW, MS, WG != 0, KW>::kThreads, smem);
}

template <int MB, int NW, int MS, int ST, int WG, int KW, typename ET, bool FINE>
cudaError_t launch(const Params& p, int grid, int smem, cudaStream_t stream, bool pdl, int cluster) {
  return launch_kernel(marlin_24_kernel<MB, NW, MS, ST, WG, KW, ET, FINE>, cache<MB, NW, MS, ST, WG, KW, ET, FINE>(), p, grid,
                       Shape<MB, NW, MS, WG != 0, KW>::kThreads, smem, stream, pdl, cluster);
}

template <typename ET, bool FINE, int MB, int NW, int MS, int ST = kStages, int WG = 0, int KW = 1>
Instance make() {
  using S = Shape<MB, NW, MS, WG != 0, KW>;
  return Instance{S::template smem_bytes<ST>(), S::kSStage * 16, S::kThreads, &blocks_per_sm<MB, NW, MS, ST, WG, KW, ET, FINE>,
                  &max_clusters<MB, NW, MS, ST, WG, KW, ET, FINE>, &launch<MB, NW, MS, ST, WG, KW, ET, FINE>};
}

// The compiled instances: MB 1, 2, 4 x NW 2, 4; at MB 4 also two warp slices (64-row block
// slices), and four on the 128-column tile (128 rows, 8 warps; four would exceed the registers
// of an SM on the 256-column tile); 3 stages at MB 1, 2 on the 256-column tile; MB 1, 2, 4 on a
// 64-column tile (NW = 1, one warp per block) for N % 128 == 64 (tensor-parallel shards). WG (sm_90a
// builds; trap stubs elsewhere): the 256-column tile, warp slices of 16, 32, 64 rows, and two
// 64-row warp slices (128-row block slices); wg = 1: early refill, 4 stages; wg = 2: late
// refill, 4 stages, but 3 for one 64-row warp slice (88 KB: 2 blocks per SM instead of 1);
// kw = 2 (late refill, one warp slice): two K warpgroups, 4 stages (one block per SM at 64 rows
// by registers, so the fourth stage costs no occupancy there; ptxas keeps 8 bytes of that
// instance in local memory, stored before the main loop and read in the epilogue, none inside).
// Each instance exists for fp16 and bf16, as the plain and the FINE kernel (find<half, false> ..
// find<nv_bfloat16, true>: one file each, so that the four compile in parallel). bf16's
// dequantization takes more registers: on sm_80-sm_89 its 32-row mma.sync instances (MB = 4; 254-255 registers in
// fp16) keep 32-48 bytes in local memory (CUDA 13.0 ptxas); on sm_90a none do.
template <typename ET, bool FINE>
Instance find(int mb, int nw, int ms, int stages, int wg, int kw) {
  if (kw == 2) {
    if (mb == 2) return make<ET, FINE, 2, 4, 1, kStages, 2, 2>();
    if (mb == 4) return make<ET, FINE, 4, 4, 1, kStages, 2, 2>();
    return make<ET, FINE, 8, 4, 1, kStages, 2, 2>();
  }
  if (wg == 1) {
    if (mb == 2) return make<ET, FINE, 2, 4, 1, kStages, 1>();
    if (mb == 4) return make<ET, FINE, 4, 4, 1, kStages, 1>();
    if (ms == 2) return make<ET, FINE, 8, 4, 2, kStages, 1>();
    return make<ET, FINE, 8, 4, 1, kStages, 1>();
  }
  if (wg == 2) {
    if (mb == 2 && stages == 3) return make<ET, FINE, 2, 4, 1, 3, 2>();
    if (mb == 2) return make<ET, FINE, 2, 4, 1, kStages, 2>();
    if (mb == 4) return make<ET, FINE, 4, 4, 1, kStages, 2>();
    if (ms == 2) return make<ET, FINE, 8, 4, 2, kStages, 2>();
    return make<ET, FINE, 8, 4, 1, 3, 2>();
  }
  if (stages == 3 && nw == 4 && ms == 1 && mb <= 2) return mb == 1 ? make<ET, FINE, 1, 4, 1, 3>() : make<ET, FINE, 2, 4, 1, 3>();
#define MARLIN_24_TRY(MB, NW, MS) \
  if (mb == MB && nw == NW && ms == MS) return make<ET, FINE, MB, NW, MS>();
  MARLIN_24_TRY(1, 4, 1)
  MARLIN_24_TRY(2, 4, 1)
  MARLIN_24_TRY(4, 4, 1)
  MARLIN_24_TRY(4, 4, 2)
  MARLIN_24_TRY(1, 2, 1)
  MARLIN_24_TRY(2, 2, 1)
  MARLIN_24_TRY(4, 2, 1)
  MARLIN_24_TRY(4, 2, 2)
  MARLIN_24_TRY(4, 2, 4)
  MARLIN_24_TRY(1, 1, 1)
  MARLIN_24_TRY(2, 1, 1)
  MARLIN_24_TRY(4, 1, 1)
#undef MARLIN_24_TRY
  return make<ET, FINE, 4, 2, 1>();  // not reached: plan_24 asks only for the ones above
}

}  // namespace sparse24
}  // namespace marlin
