// Argument checks shared by the CPU and CUDA implementations of marlin::gemm_2_4 (2:4-sparse
// INT4 weights), so that both accept exactly the same inputs. marlin/ops.py repeats them for the
// fake (meta) kernel. Layout: marlin/sparse.py.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "gemm_checks.h"  // num, dtype_str, device_str, dims

namespace marlin {

constexpr int64_t kStrip24 = 32;        // rows of the original K per row of b_q and b_meta
constexpr int64_t kKMultiple24 = 128;   // K must be a multiple of this (one group, one stage)
// N must be a multiple of this: whole 64-column tiles, the unit of the packing (b_q, b_meta and
// the scales' permutation); the CUDA kernel runs N % 128 == 64 (e.g. a tensor-parallel shard) on
// a 64-column tile.
constexpr int64_t kNMultiple24 = 64;
// Group sizes along the original K besides per column (one scale row); each divides kKMultiple24,
// so every K the op takes has whole groups of each.
constexpr int64_t kGroupSizes24[] = {128, 64, 32};

struct Gemm24Shape {
  int64_t m, k, n, groups;
};

// b_zeros (optional): the integer zero points of the kept values, in b_scales' shape, dtype and
// layout, exactly as for the dense op (csrc/gemm_checks.h); None means symmetric (z = 8).
inline Gemm24Shape check_gemm_2_4_args(const at::Tensor& a, const at::Tensor& b_q, const at::Tensor& b_meta,
                                       const at::Tensor& b_scales, const std::optional<at::Tensor>& workspace,
                                       const std::optional<at::Tensor>& b_zeros) {
  TORCH_CHECK(a.dim() == 2, "marlin.gemm_2_4: a.dim() = ", num(a.dim()), ", expected 2 (a is [M, K])");
  TORCH_CHECK(a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16, "marlin.gemm_2_4: a.dtype = ", dtype_str(a),
              ", expected torch.float16 or torch.bfloat16");
  TORCH_CHECK(b_q.dim() == 2, "marlin.gemm_2_4: b_q.dim() = ", num(b_q.dim()), ", expected 2 (b_q is int32 [K/32, 2*N])");
  TORCH_CHECK(b_q.scalar_type() == at::kInt, "marlin.gemm_2_4: b_q.dtype = ", dtype_str(b_q), ", expected torch.int32");
  TORCH_CHECK(b_meta.dim() == 2, "marlin.gemm_2_4: b_meta.dim() = ", num(b_meta.dim()),
              ", expected 2 (b_meta is int32 [K/32, N])");
  TORCH_CHECK(b_meta.scalar_type() == at::kInt, "marlin.gemm_2_4: b_meta.dtype = ", dtype_str(b_meta),
              ", expected torch.int32");
  TORCH_CHECK(b_scales.dim() == 2, "marlin.gemm_2_4: b_scales.dim() = ", num(b_scales.dim()), ", expected 2 ([groups, N])");
  TORCH_CHECK(b_scales.scalar_type() == a.scalar_type(), "marlin.gemm_2_4: b_scales.dtype = ", dtype_str(b_scales),
              " but a.dtype = ", dtype_str(a), "; they must match");

  for (const at::Tensor* t : {&b_q, &b_meta, &b_scales}) {
    TORCH_CHECK(t->device() == a.device(), "marlin.gemm_2_4: an argument is on ", device_str(*t), " but a is on ",
                device_str(a), "; all tensors must be on one device");
  }
  TORCH_CHECK(b_q.is_contiguous(), "marlin.gemm_2_4: b_q must be contiguous (strides ", dims(b_q.strides()), ")");
  TORCH_CHECK(b_meta.is_contiguous(), "marlin.gemm_2_4: b_meta must be contiguous (strides ", dims(b_meta.strides()), ")");
  TORCH_CHECK(b_scales.is_contiguous(), "marlin.gemm_2_4: b_scales must be contiguous (strides ",
              dims(b_scales.strides()), ")");

  TORCH_CHECK(b_q.size(1) % 2 == 0, "marlin.gemm_2_4: b_q.size(1) = ", num(b_q.size(1)), ", expected 2*N (an even number)");
  const int64_t k = b_q.size(0) * kStrip24;
  const int64_t n = b_q.size(1) / 2;
  const int64_t m = a.size(0);
  TORCH_CHECK(a.size(1) == k, "marlin.gemm_2_4: a.size(1) = ", num(a.size(1)), ", expected K = b_q.size(0) * 32 = ", num(k));
  TORCH_CHECK(k > 0 && k % kKMultiple24 == 0, "marlin.gemm_2_4: K = ", num(k), ", expected a positive multiple of ",
              num(kKMultiple24));
  TORCH_CHECK(n > 0 && n % kNMultiple24 == 0, "marlin.gemm_2_4: N = b_q.size(1) / 2 = ", num(n),
              ", expected a positive multiple of ", num(kNMultiple24));
  TORCH_CHECK(b_meta.size(0) == b_q.size(0) && b_meta.size(1) == n, "marlin.gemm_2_4: b_meta shape ",
              dims(b_meta.sizes()), ", expected [K/32, N] = [", num(k / kStrip24), ", ", num(n), "]");
  TORCH_CHECK(b_scales.size(1) == n, "marlin.gemm_2_4: b_scales.size(1) = ", num(b_scales.size(1)), ", expected N = ", num(n));
  // The group size is not passed: it is K / (rows of b_scales); one row means per column.
  const int64_t groups = b_scales.size(0);
  bool known = groups == 1;
  for (int64_t g : kGroupSizes24) known = known || groups * g == k;
  TORCH_CHECK(known, "marlin.gemm_2_4: b_scales.size(0) = ", num(groups),
              ", expected 1 (per-column scales) or K / group_size with group_size 128, 64 or 32 along the original K (K = ",
              num(k), ": ", num(k / 128), ", ", num(k / 64), " or ", num(k / 32), ")");
  if (b_zeros.has_value()) {
    const at::Tensor& z = *b_zeros;
    TORCH_CHECK(z.scalar_type() == a.scalar_type(), "marlin.gemm_2_4: b_zeros.dtype = ", dtype_str(z), " but a.dtype = ",
                dtype_str(a), "; they must match (zero points are stored like the scales)");
    TORCH_CHECK(z.dim() == 2 && z.size(0) == groups && z.size(1) == n, "marlin.gemm_2_4: b_zeros shape ", dims(z.sizes()),
                ", expected the shape of b_scales ", dims(b_scales.sizes()));
    TORCH_CHECK(z.device() == a.device(), "marlin.gemm_2_4: b_zeros is on ", device_str(z), " but a is on ", device_str(a),
                "; all tensors must be on one device");
    TORCH_CHECK(z.is_contiguous(), "marlin.gemm_2_4: b_zeros must be contiguous (strides ", dims(z.strides()), ")");
  }
  if (workspace.has_value()) {
    const at::Tensor& w = *workspace;
    TORCH_CHECK(w.scalar_type() == at::kInt, "marlin.gemm_2_4: workspace.dtype = ", dtype_str(w), ", expected torch.int32");
    TORCH_CHECK(w.device() == a.device(), "marlin.gemm_2_4: workspace is on ", device_str(w), " but a is on ", device_str(a));
    TORCH_CHECK(w.is_contiguous(), "marlin.gemm_2_4: workspace must be contiguous");
  }
  return Gemm24Shape{m, k, n, groups};
}

}  // namespace marlin
