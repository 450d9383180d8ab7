// bf16 kernel instances of every weight format and group size for 16 rows of M per slice
// (see marlin_instances.cuh).
#include "marlin_instances.cuh"

namespace marlin {
MARLIN_DEFINE_LAUNCH
MARLIN_INSTANTIATE_FORMATS(nv_bfloat16, 1)
MARLIN_INSTANTIATE_SYM_COL(nv_bfloat16, 1)
}  // namespace marlin
