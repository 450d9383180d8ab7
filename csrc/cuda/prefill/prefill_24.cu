// The prefill kernel's 2:4 instances (fp16 / bf16; 4-bit in groups, per column, or in groups
// with zero points): the dense kernel's template with SPARSE (prefill_kernel.cuh), launched by the
// 2:4 planner (sparse/marlin_24.cu) from 256 rows where prefill_pays.
#include <algorithm>
#include <type_traits>

#include "../launch_attr.cuh"
#include "prefill.h"
#include "prefill_kernel.cuh"
#include "prefill_tma.h"

namespace marlin {

int prefill_24_smem_bytes() { return PrefillShape<4, true>::kSmemBytes; }

template <bool BF16, int W, bool GROUPED>
cudaError_t launch_prefill_24(const KernelParams& p, const void* b_meta, int grid, int smem, cudaStream_t stream, bool pdl) {
  using S = PrefillShape<4, true>;
  using T = std::conditional_t<BF16, nv_bfloat16, half>;
  static SmemAttrCache cache;  // one shared-memory opt-in per instance and device
  const CUtensorMapDataType type = BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  PrefillParams pp{};
  pp.p = p;
  // as the dense instances (prefill.cu); the weights: b_q int32 [k / 32, 2 n] (a 32-row strip per
  // row, 128 words per 64-column chunk), boxes of 2 strips x 256 words (the block's two chunks);
  // b_meta int32 [k / 32, n] (64 words per chunk), boxes of 2 strips x 128 words
  const int group_log2 = p.group_shift + 4;
  const int groups = p.k >> group_log2, group_box = std::max(1, S::kTileK >> group_log2);
  const bool ok =
      encode_2d(&pp.act, type, p.a, p.k, p.m, p.lda_int4 * 16, S::kTileK, S::kTileM, CU_TENSOR_MAP_SWIZZLE_128B) &&
      encode_2d(&pp.wq, CU_TENSOR_MAP_DATA_TYPE_INT32, p.b, 2LL * p.n, p.k / 32, 8LL * p.n, 256, 2,
                CU_TENSOR_MAP_SWIZZLE_NONE) &&
      encode_2d(&pp.meta, CU_TENSOR_MAP_DATA_TYPE_INT32, b_meta, p.n, p.k / 32, 4LL * p.n, 128, 2,
                CU_TENSOR_MAP_SWIZZLE_NONE) &&
      (!GROUPED ||
       encode_2d(&pp.sc, type, p.s, p.n, groups, 2LL * p.n, S::kTileN, group_box, CU_TENSOR_MAP_SWIZZLE_NONE)) &&
      (W != kU4Zp || encode_2d(&pp.zp, type, p.z, p.n, groups, 2LL * p.n, S::kTileN, group_box, CU_TENSOR_MAP_SWIZZLE_NONE));
  if (!ok) return cudaErrorInvalidValue;  // reported by the caller as a failed launch, with the shape
  return launch_kernel(marlin_prefill_kernel<T, W, GROUPED, true>, cache, pp, grid, S::kThreads, smem, stream, pdl, 1);
}

#define MARLIN_PREFILL_24_INSTANCE(BF16, W, GROUPED) \
  template cudaError_t launch_prefill_24<BF16, W, GROUPED>(const KernelParams&, const void*, int, int, cudaStream_t, bool);
MARLIN_PREFILL_24_INSTANCE(false, kU4, true)
MARLIN_PREFILL_24_INSTANCE(false, kU4, false)
MARLIN_PREFILL_24_INSTANCE(false, kU4Zp, true)
MARLIN_PREFILL_24_INSTANCE(true, kU4, true)
MARLIN_PREFILL_24_INSTANCE(true, kU4, false)
MARLIN_PREFILL_24_INSTANCE(true, kU4Zp, true)
#undef MARLIN_PREFILL_24_INSTANCE

}  // namespace marlin
