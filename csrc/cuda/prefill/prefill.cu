// The prefill kernel's instances (fp16 / bf16; 4-bit in groups, per column or in groups with zero
// points; 8-bit in groups or per column), their tensor maps and their launch.
#include "prefill.h"

#include <algorithm>

#include "prefill_launch.cuh"

namespace marlin {

static_assert(PrefillShape<>::kTileN == kPrefillTileN && PrefillShape<>::kTileM == kPrefillTileM &&
                  PrefillShape<>::kTileK == kPrefillTileK,
              "prefill.h and prefill_kernel.cuh disagree on the tile");

int prefill_smem_bytes(int bits) { return bits == 8 ? PrefillShape<8>::kSmemBytes : PrefillShape<4>::kSmemBytes; }

constexpr long long kPrefillMinRows = 256;

bool prefill_pays(long long m, long long n, int sms, double min_fill, int tail_parts) {
  const long long tiles = (m + kPrefillTileM - 1) / kPrefillTileM * (n / kPrefillTileN);
  const double rounds = static_cast<double>(tiles / sms) + (tiles % sms != 0 ? 1.0 / std::max(1, tail_parts) : 0.0);
  return m >= kPrefillMinRows && static_cast<double>(tiles) >= min_fill * rounds * sms;
}

PrefillSplit prefill_split(long long tiles, int k_tiles, int sms, int forced_parts) {
  PrefillSplit split;
  if (forced_parts > 0) {
    split.parts = std::max(1, std::min(forced_parts, k_tiles));
    return split;
  }
  const long long left = tiles % sms;  // tiles of the last round (all of them below one round)
  if (left == 0 || 2 * left > sms) return split;
  const long long parts = std::min<long long>({kPrefillMaxParts, sms / left, k_tiles / kPrefillMinPartStages});
  if (parts < 2) return split;
  split.first = tiles - left;
  split.parts = static_cast<int>(parts);
  return split;
}

template <bool BF16, int W, bool GROUPED>
cudaError_t launch_prefill(const KernelParams& p, int grid, int smem, cudaStream_t stream, bool pdl, int /*cluster*/) {
  return launch_prefill_kernel<BF16, W, GROUPED, false>(p, nullptr, grid, smem, stream, pdl);
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
