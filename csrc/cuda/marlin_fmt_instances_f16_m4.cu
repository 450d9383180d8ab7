// fp16 kernel instances of the other weight formats and group sizes for 64 rows of M per
// slice (see marlin_instances.cuh).
#include "marlin_instances.cuh"

namespace marlin {
MARLIN_DEFINE_LAUNCH
MARLIN_INSTANTIATE_FORMATS(half, 4)
MARLIN_INSTANTIATE_SYM_COL(half, 4)
}  // namespace marlin
