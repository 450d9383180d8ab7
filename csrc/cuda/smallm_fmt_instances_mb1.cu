// Small-batch kernel instances of the other weight formats and of bf16 for 8 rows of M per
// slice (see smallm_instances.cuh).
#include "smallm_instances.cuh"

namespace marlin {
MARLIN_DEFINE_SMALLM_LAUNCH
MARLIN_INSTANTIATE_SMALLM_FORMATS(1, half)
MARLIN_INSTANTIATE_SMALLM_FORMATS(1, nv_bfloat16)
MARLIN_INSTANTIATE_SMALLM_FMT(1, nv_bfloat16, kU4, false)
// fp16 zero points in groups of 128: the raw group-sum path (SmallMShape::kZpSums)
template cudaError_t launch_smallm<1, 4, true, false, half, kU4Zp, false>(const KernelParams&, int, int, cudaStream_t,
                                                                         bool, int);
template int smallm_max_clusters<1, 4, true, false, half, kU4Zp, false>(int, int);
}  // namespace marlin
