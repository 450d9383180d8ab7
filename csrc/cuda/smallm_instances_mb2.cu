// Small-batch kernel instances for 16 rows of M per slice (see smallm_instances.cuh).
#include "smallm_instances.cuh"

namespace marlin {
MARLIN_DEFINE_SMALLM_LAUNCH
MARLIN_INSTANTIATE_SMALLM(2, false)
}  // namespace marlin
