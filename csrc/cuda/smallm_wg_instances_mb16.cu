// Small-batch wgmma (sm_90a) instances for 128 rows of M per slice, the 256-column tile only
// (see smallm_instances.cuh). Built for every target; only the sm_90a code can run them
// (elsewhere they trap, and the planner never picks them).
#include "smallm_instances.cuh"

namespace marlin {
MARLIN_DEFINE_SMALLM_LAUNCH
MARLIN_INSTANTIATE_SMALLM_ONE(16, 4, true, true)
MARLIN_INSTANTIATE_SMALLM_ONE(16, 4, false, true)
MARLIN_INSTANTIATE_SMALLM_ONE(16, 2, true, true)  // the 128-column tile (fp16 group 128)
}  // namespace marlin
