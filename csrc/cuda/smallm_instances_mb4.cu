// Small-batch kernel instances for 32 rows of M per slice (see smallm_instances.cuh).
#include "smallm_instances.cuh"

namespace marlin {
MARLIN_DEFINE_SMALLM_LAUNCH
MARLIN_INSTANTIATE_SMALLM(4, false)
}  // namespace marlin
