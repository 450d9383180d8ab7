// The prefill kernel's two instances (group 128, per column), their tensor maps and their launch.
#include "prefill.h"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include "../launch_attr.cuh"
#include "prefill_kernel.cuh"

namespace marlin {

static_assert(PrefillShape::kTileN == kPrefillTileN && PrefillShape::kTileM == kPrefillTileM &&
                  PrefillShape::kTileK == kPrefillTileK,
              "prefill.h and prefill_kernel.cuh disagree on the tile");

int prefill_smem_bytes() { return PrefillShape::kSmemBytes; }

namespace {

// The driver's tensor-map encoder, found once through the runtime (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A row-major 2-D tensor [rows, cols] of `type`, rows `row_bytes` apart, read in boxes of
// box_cols x box_rows.
bool encode_2d(CUtensorMap* map, CUtensorMapDataType type, const void* base, long long cols, long long rows,
               long long row_bytes, int box_cols, int box_rows, CUtensorMapSwizzle swizzle) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  return encode(map, type, 2, const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

template <bool GROUPED>
cudaError_t launch_prefill(const KernelParams& p, int grid, int smem, cudaStream_t stream, bool pdl, int /*cluster*/) {
  using S = PrefillShape;
  static SmemAttrCache cache;  // one shared-memory opt-in per instance and device
  PrefillParams pp{};
  pp.p = p;
  // Rows of a past m read as zeros (the box's out-of-bounds fill); the weights and scales are read
  // in whole boxes (the planner checked that the tile divides N and K).
  const bool ok =
      encode_2d(&pp.act, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, p.a, p.k, p.m, p.lda_int4 * 16, S::kTileK, S::kTileM,
                CU_TENSOR_MAP_SWIZZLE_128B) &&
      encode_2d(&pp.wq, CU_TENSOR_MAP_DATA_TYPE_INT32, p.b, 2LL * p.n, p.k / 16, 8LL * p.n, 2 * S::kTileN, 4,
                CU_TENSOR_MAP_SWIZZLE_NONE) &&
      (!GROUPED || encode_2d(&pp.sc, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, p.s, p.n, p.k / 128, 2LL * p.n, S::kTileN, 1,
                             CU_TENSOR_MAP_SWIZZLE_NONE));
  if (!ok) return cudaErrorInvalidValue;  // reported by the caller as a failed launch, with the shape
  return launch_kernel(marlin_prefill_kernel<GROUPED>, cache, pp, grid, S::kThreads, smem, stream, pdl, 1);
}

template cudaError_t launch_prefill<true>(const KernelParams&, int, int, cudaStream_t, bool, int);
template cudaError_t launch_prefill<false>(const KernelParams&, int, int, cudaStream_t, bool, int);

}  // namespace marlin
