// Small-batch wgmma (sm_90a) instances for 16 rows of M per slice (see smallm_instances.cuh).
// Built for every target; only the sm_90a code can run them (elsewhere they trap, and the
// planner never picks them).
#include "smallm_instances.cuh"

namespace marlin {
MARLIN_DEFINE_SMALLM_LAUNCH
MARLIN_INSTANTIATE_SMALLM(2, true)
MARLIN_INSTANTIATE_SMALLM_ONE(2, 2, true, true)  // the 128-column tile, one block per SM (probes only)
// the same held to 128 registers, two blocks per SM: the planner's 16-row rule (GemmArgs::wg16_narrow_two)
template cudaError_t launch_smallm<2, 2, true, true, half, kU4, 0, 2>(const KernelParams&, int, int, cudaStream_t, bool,
                                                                      int);
template int smallm_max_clusters<2, 2, true, true, half, kU4, 0, 2>(int, int);
}  // namespace marlin
