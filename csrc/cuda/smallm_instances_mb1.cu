// Small-batch kernel instances for 8 rows of M per slice (see smallm_instances.cuh).
#include "smallm_instances.cuh"

namespace marlin {
MARLIN_DEFINE_SMALLM_LAUNCH
MARLIN_INSTANTIATE_SMALLM(1, false)
// the 256-column tile for one block per SM (no 128-register bound; smallm_kernel.cuh's MINB), group
// 128 and per column
template cudaError_t launch_smallm<1, 4, true, false, half, kU4, 0, 1>(const KernelParams&, int, int, cudaStream_t,
                                                                          bool, int);
template int smallm_max_clusters<1, 4, true, false, half, kU4, 0, 1>(int, int);
template cudaError_t launch_smallm<1, 4, false, false, half, kU4, 0, 1>(const KernelParams&, int, int, cudaStream_t,
                                                                           bool, int);
template int smallm_max_clusters<1, 4, false, false, half, kU4, 0, 1>(int, int);
}  // namespace marlin
