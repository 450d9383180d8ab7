// Small-batch wgmma (sm_90a) instances of the other weight formats in fp16 for 16 rows of M per
// slice (see smallm_instances.cuh). Built for every target; only the sm_90a code can run them.
#include "smallm_instances.cuh"

namespace marlin {
MARLIN_DEFINE_SMALLM_LAUNCH
MARLIN_INSTANTIATE_SMALLM_FORMATS_WG(2, half, true)
MARLIN_INSTANTIATE_SMALLM_FMT_G128(2, half, kU4Zp)
MARLIN_INSTANTIATE_SMALLM_FMT_NARROW_TWO(half, kU4Zp, 0)
}  // namespace marlin
