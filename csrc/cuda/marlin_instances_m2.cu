// fp16 symmetric INT4 kernel instances (group 128, per column) for 32 rows of M per slice
// (see marlin_instances.cuh).
#include "marlin_instances.cuh"

namespace marlin {
MARLIN_DEFINE_LAUNCH
MARLIN_INSTANTIATE_FP16_BASE(2)
}  // namespace marlin
