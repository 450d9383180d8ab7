// The prefill kernel's instances (fp16 / bf16; 4-bit in groups, per column or in groups with zero
// points; 8-bit in groups or per column), their tensor maps and their launch.
#include "prefill.h"

#include <algorithm>
#include <type_traits>

#include "../launch_attr.cuh"
#include "prefill_kernel.cuh"
#include "prefill_tma.h"

namespace marlin {

static_assert(PrefillShape<>::kTileN == kPrefillTileN && PrefillShape<>::kTileM == kPrefillTileM &&
                  PrefillShape<>::kTileK == kPrefillTileK,
              "prefill.h and prefill_kernel.cuh disagree on the tile");

int prefill_smem_bytes(int bits) { return bits == 8 ? PrefillShape<8>::kSmemBytes : PrefillShape<4>::kSmemBytes; }

constexpr long long kPrefillMinRows = 256;

bool prefill_pays(long long m, long long n, int sms, double min_fill) {
  const long long tiles = (m + kPrefillTileM - 1) / kPrefillTileM * (n / kPrefillTileN);
  const long long rounds = (tiles + sms - 1) / sms;
  return m >= kPrefillMinRows && static_cast<double>(tiles) >= min_fill * static_cast<double>(rounds * sms);
}

template <bool BF16, int W, bool GROUPED>
cudaError_t launch_prefill(const KernelParams& p, int grid, int smem, cudaStream_t stream, bool pdl, int /*cluster*/) {
  using S = PrefillShape<W == kU8 ? 8 : 4>;
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
  // b_q: int32 [k / 16, n / 64 tiles x kTileWords], boxes of 4 k16 rows x 256 words (two 4-bit
  // tiles or one 8-bit tile)
  const long long row_words = p.n / 64 * S::kTileWords;
  const bool ok =
      encode_2d(&pp.act, type, p.a, p.k, p.m, p.lda_int4 * 16, S::kTileK, S::kTileM, CU_TENSOR_MAP_SWIZZLE_128B) &&
      encode_2d(&pp.wq, CU_TENSOR_MAP_DATA_TYPE_INT32, p.b, row_words, p.k / 16, 4 * row_words, 256, 4,
                CU_TENSOR_MAP_SWIZZLE_NONE) &&
      (!GROUPED ||
       encode_2d(&pp.sc, type, p.s, p.n, groups, 2LL * p.n, S::kTileN, group_box, CU_TENSOR_MAP_SWIZZLE_NONE)) &&
      (W != kU4Zp || encode_2d(&pp.zp, type, p.z, p.n, groups, 2LL * p.n, S::kTileN, group_box, CU_TENSOR_MAP_SWIZZLE_NONE));
  if (!ok) return cudaErrorInvalidValue;  // reported by the caller as a failed launch, with the shape
  return launch_kernel(marlin_prefill_kernel<T, W, GROUPED>, cache, pp, grid, S::kThreads, smem, stream, pdl, 1);
}

#define MARLIN_PREFILL_INSTANCE(BF16, W, GROUPED) \
  template cudaError_t launch_prefill<BF16, W, GROUPED>(const KernelParams&, int, int, cudaStream_t, bool, int);
MARLIN_PREFILL_INSTANCE(false, kU4, true)
MARLIN_PREFILL_INSTANCE(false, kU4, false)
MARLIN_PREFILL_INSTANCE(false, kU4Zp, true)
MARLIN_PREFILL_INSTANCE(false, kU8, true)
MARLIN_PREFILL_INSTANCE(false, kU8, false)
MARLIN_PREFILL_INSTANCE(true, kU4, true)
MARLIN_PREFILL_INSTANCE(true, kU4, false)
MARLIN_PREFILL_INSTANCE(true, kU4Zp, true)
MARLIN_PREFILL_INSTANCE(true, kU8, true)
MARLIN_PREFILL_INSTANCE(true, kU8, false)
#undef MARLIN_PREFILL_INSTANCE

}  // namespace marlin
