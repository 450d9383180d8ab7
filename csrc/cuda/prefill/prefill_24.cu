// The prefill kernel's 2:4 instances with 256-row tiles (fp16 / bf16; 4-bit in groups, per
// column, or in groups with zero points): the dense kernel's template with SPARSE
// (prefill_kernel.cuh), launched by the 2:4 planner (sparse/marlin_24.cu) where prefill_pays.
// The 128-row ones are in prefill_24_m128.cu (a second object, built in parallel).
#include "prefill.h"
#include "prefill_launch.cuh"

namespace marlin {

int prefill_24_smem_bytes(int tile_m) {
  return tile_m == 128 ? PrefillShape<4, true, 128>::kSmemBytes : PrefillShape<4, true>::kSmemBytes;
}

MARLIN_PREFILL_24_INSTANCES(256)

}  // namespace marlin
