// fp16 kernel instances of the other weight formats and group sizes for 32 rows of M per
// slice (see marlin_instances.cuh).
#include "marlin_instances.cuh"

namespace marlin {
MARLIN_DEFINE_LAUNCH
MARLIN_INSTANTIATE_FORMATS(half, 2)
MARLIN_INSTANTIATE_SYM_COL(half, 2)
}  // namespace marlin
