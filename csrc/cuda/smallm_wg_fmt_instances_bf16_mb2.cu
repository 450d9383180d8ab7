// Small-batch wgmma (sm_90a) instances of the other weight formats in bf16 for 16 rows of M per
// slice (see smallm_instances.cuh). Built for every target; only the sm_90a code can run them.
#include "smallm_instances.cuh"

namespace marlin {
MARLIN_DEFINE_SMALLM_LAUNCH
MARLIN_INSTANTIATE_SMALLM_FORMATS_WG(2, nv_bfloat16, true)
MARLIN_INSTANTIATE_SMALLM_FMT_G128(2, nv_bfloat16, kU4Zp)
MARLIN_INSTANTIATE_SMALLM_FMT_WG(2, nv_bfloat16, kU4, false, true)
MARLIN_INSTANTIATE_SMALLM_FMT_NARROW_TWO(nv_bfloat16, kU4Zp, 0)
MARLIN_INSTANTIATE_SMALLM_FMT_NARROW_TWO(nv_bfloat16, kU4, 1)
}  // namespace marlin
