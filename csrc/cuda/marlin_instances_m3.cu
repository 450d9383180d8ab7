// fp16 symmetric INT4 kernel instances (group 128, per column) for 48 rows of M per slice
// (see marlin_instances.cuh).
#include "marlin_instances.cuh"

namespace marlin {
MARLIN_DEFINE_LAUNCH
MARLIN_INSTANTIATE_FP16_BASE(3)
}  // namespace marlin
