// Kernel instances for 64 rows of M per slice (see marlin_instances.cuh).
#include "marlin_instances.cuh"

namespace marlin {
MARLIN_DEFINE_LAUNCH
MARLIN_INSTANTIATE_TM(4)
}  // namespace marlin
