// The prefill kernel's 2:4 instances (fp16 / bf16; 4-bit in groups, per column, or in groups
// with zero points): the dense kernel's template with SPARSE (prefill_kernel.cuh), launched by the
// 2:4 planner (sparse/marlin_24.cu) from 256 rows where prefill_pays.
#include "prefill.h"
#include "prefill_launch.cuh"

namespace marlin {

int prefill_24_smem_bytes() { return PrefillShape<4, true>::kSmemBytes; }

template <bool BF16, int W, bool GROUPED>
cudaError_t launch_prefill_24(const KernelParams& p, const void* b_meta, int grid, int smem, cudaStream_t stream, bool pdl) {
  return launch_prefill_kernel<BF16, W, GROUPED, true>(p, b_meta, grid, smem, stream, pdl);
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
