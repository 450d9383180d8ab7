// The prefill kernel's launch (host): its tensor maps and the launch, for the dense instances
// (prefill.cu) and the 2:4 ones (prefill_24.cu) alike.
#pragma once

#include <algorithm>
#include <type_traits>

#include "../launch_attr.cuh"
#include "prefill_kernel.cuh"
#include "prefill_tma.h"

namespace marlin {

// b_meta: the 2:4 metadata (SPARSE only, else unused). TILE_M: activation rows per tile (256 or 128).
template <bool BF16, int W, bool GROUPED, bool SPARSE, int TILE_M = 256>
cudaError_t launch_prefill_kernel(const KernelParams& p, const void* b_meta, int grid, int smem, cudaStream_t stream,
                                  bool pdl) {
  using S = PrefillShape<W == kU8 ? 8 : 4, SPARSE, TILE_M>;
  using T = std::conditional_t<BF16, nv_bfloat16, half>;
  static SmemAttrCache cache;  // one shared-memory opt-in per instance and device
  const CUtensorMapDataType type = BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  PrefillParams pp{};
  pp.p = p;
  // Rows of a past m read as zeros (the box's out-of-bounds fill); the weights, scales and zero
  // points are read in whole boxes (the planner checked that the tile divides N and K, and the
  // format that the group divides K). A stage of 64 rows of K needs one group row (groups of 64
  // or 128) or two (groups of 32).
  const int group_log2 = p.group_shift + 4;
  const int groups = p.k >> group_log2, group_box = std::max(1, S::kTileK >> group_log2);
  bool ok = encode_2d(&pp.act, type, p.a, p.k, p.m, p.lda_int4 * 16, S::kTileK, S::kTileM, CU_TENSOR_MAP_SWIZZLE_128B);
  if constexpr (SPARSE) {
    // b_q int32 [k / 32, 2 n] (a 32-row strip per row, 128 words per 64-column chunk), boxes of 2
    // strips x 256 words (the block's two chunks); b_meta int32 [k / 32, n] (64 words per chunk),
    // boxes of 2 strips x 128 words
    ok = ok &&
         encode_2d(&pp.wq, CU_TENSOR_MAP_DATA_TYPE_INT32, p.b, 2LL * p.n, p.k / 32, 8LL * p.n, 256, 2,
                   CU_TENSOR_MAP_SWIZZLE_NONE) &&
         encode_2d(&pp.meta, CU_TENSOR_MAP_DATA_TYPE_INT32, b_meta, p.n, p.k / 32, 4LL * p.n, 128, 2,
                   CU_TENSOR_MAP_SWIZZLE_NONE);
  } else {
    // b_q: int32 [k / 16, n / 64 tiles x kTileWords], boxes of 4 k16 rows x 256 words (two 4-bit
    // tiles or one 8-bit tile)
    const long long row_words = p.n / 64 * S::kTileWords;
    ok = ok && encode_2d(&pp.wq, CU_TENSOR_MAP_DATA_TYPE_INT32, p.b, row_words, p.k / 16, 4 * row_words, 256, 4,
                         CU_TENSOR_MAP_SWIZZLE_NONE);
  }
  ok = ok &&
       (!GROUPED ||
        encode_2d(&pp.sc, type, p.s, p.n, groups, 2LL * p.n, S::kTileN, group_box, CU_TENSOR_MAP_SWIZZLE_NONE)) &&
       (W != kU4Zp || encode_2d(&pp.zp, type, p.z, p.n, groups, 2LL * p.n, S::kTileN, group_box, CU_TENSOR_MAP_SWIZZLE_NONE));
  if (!ok) return cudaErrorInvalidValue;  // reported by the caller as a failed launch, with the shape
  return launch_kernel(marlin_prefill_kernel<T, W, GROUPED, SPARSE, TILE_M>, cache, pp, grid, S::kThreads, smem, stream, pdl, 1);
}

// The dense launch entry point of prefill.h, and its ten formats' instances for one tile height.
template <bool BF16, int W, bool GROUPED, int TILE_M>
cudaError_t launch_prefill(const KernelParams& p, int grid, int smem, cudaStream_t stream, bool pdl, int /*cluster*/) {
  return launch_prefill_kernel<BF16, W, GROUPED, false, TILE_M>(p, nullptr, grid, smem, stream, pdl);
}

#define MARLIN_PREFILL_INSTANCE(BF16, W, GROUPED, TILE_M) \
  template cudaError_t launch_prefill<BF16, W, GROUPED, TILE_M>(const KernelParams&, int, int, cudaStream_t, bool, int);
#define MARLIN_PREFILL_INSTANCES(TILE_M)               \
  MARLIN_PREFILL_INSTANCE(false, kU4, true, TILE_M)    \
  MARLIN_PREFILL_INSTANCE(false, kU4, false, TILE_M)   \
  MARLIN_PREFILL_INSTANCE(false, kU4Zp, true, TILE_M)  \
  MARLIN_PREFILL_INSTANCE(false, kU8, true, TILE_M)    \
  MARLIN_PREFILL_INSTANCE(false, kU8, false, TILE_M)   \
  MARLIN_PREFILL_INSTANCE(true, kU4, true, TILE_M)     \
  MARLIN_PREFILL_INSTANCE(true, kU4, false, TILE_M)    \
  MARLIN_PREFILL_INSTANCE(true, kU4Zp, true, TILE_M)   \
  MARLIN_PREFILL_INSTANCE(true, kU8, true, TILE_M)     \
  MARLIN_PREFILL_INSTANCE(true, kU8, false, TILE_M)

// The 2:4 launch entry point of prefill.h, and its six formats' instances for one tile height.
template <bool BF16, int W, bool GROUPED, int TILE_M>
cudaError_t launch_prefill_24(const KernelParams& p, const void* b_meta, int grid, int smem, cudaStream_t stream, bool pdl) {
  return launch_prefill_kernel<BF16, W, GROUPED, true, TILE_M>(p, b_meta, grid, smem, stream, pdl);
}

#define MARLIN_PREFILL_24_INSTANCE(BF16, W, GROUPED, TILE_M) \
  template cudaError_t launch_prefill_24<BF16, W, GROUPED, TILE_M>(const KernelParams&, const void*, int, int, cudaStream_t, bool);
#define MARLIN_PREFILL_24_INSTANCES(TILE_M)              \
  MARLIN_PREFILL_24_INSTANCE(false, kU4, true, TILE_M)   \
  MARLIN_PREFILL_24_INSTANCE(false, kU4, false, TILE_M)  \
  MARLIN_PREFILL_24_INSTANCE(false, kU4Zp, true, TILE_M) \
  MARLIN_PREFILL_24_INSTANCE(true, kU4, true, TILE_M)    \
  MARLIN_PREFILL_24_INSTANCE(true, kU4, false, TILE_M)   \
  MARLIN_PREFILL_24_INSTANCE(true, kU4Zp, true, TILE_M)

}  // namespace marlin
