// Kernel instances for 16 rows of M per slice (see marlin_instances.cuh).
#include "marlin_instances.cuh"

namespace marlin {
MARLIN_DEFINE_LAUNCH
MARLIN_INSTANTIATE_TM(1)
}  // namespace marlin
