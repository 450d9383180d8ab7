// Small-batch kernel instances of the other weight formats and of bf16 for 16 rows of M per
// slice (see smallm_instances.cuh).
#include "smallm_instances.cuh"

namespace marlin {
MARLIN_DEFINE_SMALLM_LAUNCH
MARLIN_INSTANTIATE_SMALLM_FORMATS(2, half)
MARLIN_INSTANTIATE_SMALLM_FORMATS(2, nv_bfloat16)
MARLIN_INSTANTIATE_SMALLM_FMT(2, nv_bfloat16, kU4, false)
}  // namespace marlin
