// Small-batch kernel instances of the other weight formats and of bf16 for 8 rows of M per
// slice (see smallm_instances.cuh).
#include "smallm_instances.cuh"

namespace marlin {
MARLIN_DEFINE_SMALLM_LAUNCH
MARLIN_INSTANTIATE_SMALLM_FORMATS(1, half)
MARLIN_INSTANTIATE_SMALLM_FORMATS(1, nv_bfloat16)
MARLIN_INSTANTIATE_SMALLM_FMT(1, nv_bfloat16, kU4, false)
// zero points (fp16, bf16) and bf16 symmetric INT4 in groups of 128: the raw group-sum path
// (SmallMShape::kFmtSums; marlin_gemm.cu's fmt_group_sums), for two blocks per SM (128
// registers) and for one (MINB = 1)
#define MARLIN_INSTANTIATE_SMALLM_SUMS(ET, W, MINB)                                                                \
  template cudaError_t launch_smallm<1, 4, true, false, ET, W, 0, MINB>(const KernelParams&, int, int,        \
                                                                           cudaStream_t, bool, int);             \
  template int smallm_max_clusters<1, 4, true, false, ET, W, 0, MINB>(int, int);
MARLIN_INSTANTIATE_SMALLM_SUMS(half, kU4Zp, 2)
MARLIN_INSTANTIATE_SMALLM_SUMS(half, kU4Zp, 1)
MARLIN_INSTANTIATE_SMALLM_SUMS(nv_bfloat16, kU4Zp, 2)
MARLIN_INSTANTIATE_SMALLM_SUMS(nv_bfloat16, kU4Zp, 1)
MARLIN_INSTANTIATE_SMALLM_SUMS(nv_bfloat16, kU4, 2)
MARLIN_INSTANTIATE_SMALLM_SUMS(nv_bfloat16, kU4, 1)
// groups of 64 / 32 (symmetric and zero points, fp16 and bf16) on raw group sums with the group
// size at run time (SmallMShape::kRgSums), for one block per SM only
#define MARLIN_INSTANTIATE_SMALLM_RG_SUMS(ET, W)                                                                   \
  template cudaError_t launch_smallm<1, 4, true, false, ET, W, kRgSumsMode, 1>(const KernelParams&, int, int,    \
                                                                              cudaStream_t, bool, int);          \
  template int smallm_max_clusters<1, 4, true, false, ET, W, kRgSumsMode, 1>(int, int);
MARLIN_INSTANTIATE_SMALLM_RG_SUMS(half, kU4)
MARLIN_INSTANTIATE_SMALLM_RG_SUMS(half, kU4Zp)
MARLIN_INSTANTIATE_SMALLM_RG_SUMS(nv_bfloat16, kU4)
MARLIN_INSTANTIATE_SMALLM_RG_SUMS(nv_bfloat16, kU4Zp)
}  // namespace marlin
