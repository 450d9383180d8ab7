// Argument checks shared by the CPU and CUDA implementations of marlin::gemm, so that both
// accept exactly the same inputs. marlin/ops.py repeats them for the fake (meta) kernel.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

namespace marlin {

// What torch.ops.marlin.gemm accepts today (see README "Supported shapes").
constexpr int64_t kTileK = 16;       // rows of K per packed row of b_q
constexpr int64_t kKMultiple = 128;  // K must be a multiple of this
constexpr int64_t kNMultiple = 128;  // N must be a multiple of this
constexpr int64_t kGroupSize = 128;  // the one group size besides per-column

struct GemmShape {
  int64_t m, k, n, groups;
};

inline GemmShape check_gemm_args(const at::Tensor& a, const at::Tensor& b_q, const at::Tensor& b_scales,
                                 const std::optional<at::Tensor>& b_zeros,
                                 const std::optional<at::Tensor>& workspace,
                                 std::optional<int64_t> tile_k, std::optional<int64_t> tile_n) {
  TORCH_CHECK(a.dim() == 2, "marlin.gemm: a.dim() = ", a.dim(), ", expected 2 (a is [M, K])");
  TORCH_CHECK(a.scalar_type() == at::kHalf, "marlin.gemm: a.dtype = ", a.scalar_type(), ", expected torch.float16");
  TORCH_CHECK(b_q.dim() == 2, "marlin.gemm: b_q.dim() = ", b_q.dim(), ", expected 2 (b_q is int32 [K/16, 2*N])");
  TORCH_CHECK(b_q.scalar_type() == at::kInt, "marlin.gemm: b_q.dtype = ", b_q.scalar_type(), ", expected torch.int32");
  TORCH_CHECK(b_scales.dim() == 2, "marlin.gemm: b_scales.dim() = ", b_scales.dim(), ", expected 2 ([groups, N])");
  TORCH_CHECK(b_scales.scalar_type() == at::kHalf, "marlin.gemm: b_scales.dtype = ", b_scales.scalar_type(),
              ", expected torch.float16");
  TORCH_CHECK(!b_zeros.has_value(), "marlin.gemm: b_zeros was given, but zero points are not supported yet "
              "(only symmetric INT4 weights); pass None");

  TORCH_CHECK(b_q.device() == a.device(), "marlin.gemm: b_q is on ", b_q.device(), " but a is on ", a.device(),
              "; all tensors must be on one device");
  TORCH_CHECK(b_scales.device() == a.device(), "marlin.gemm: b_scales is on ", b_scales.device(), " but a is on ",
              a.device(), "; all tensors must be on one device");
  TORCH_CHECK(b_q.is_contiguous(), "marlin.gemm: b_q must be contiguous (strides ", b_q.strides(), ")");
  TORCH_CHECK(b_scales.is_contiguous(), "marlin.gemm: b_scales must be contiguous (strides ", b_scales.strides(), ")");

  TORCH_CHECK(b_q.size(1) % 2 == 0, "marlin.gemm: b_q.size(1) = ", b_q.size(1), ", expected 2*N (an even number)");
  const int64_t k = b_q.size(0) * kTileK;
  const int64_t n = b_q.size(1) / 2;
  const int64_t m = a.size(0);
  TORCH_CHECK(a.size(1) == k, "marlin.gemm: a.size(1) = ", a.size(1), ", expected K = b_q.size(0) * 16 = ", k);
  TORCH_CHECK(k > 0 && k % kKMultiple == 0, "marlin.gemm: K = ", k, ", expected a positive multiple of ", kKMultiple);
  TORCH_CHECK(n > 0 && n % kNMultiple == 0, "marlin.gemm: N = b_q.size(1) / 2 = ", n,
              ", expected a positive multiple of ", kNMultiple);
  TORCH_CHECK(b_scales.size(1) == n, "marlin.gemm: b_scales.size(1) = ", b_scales.size(1), ", expected N = ", n);
  const int64_t groups = b_scales.size(0);
  TORCH_CHECK(groups == 1 || groups == k / kGroupSize, "marlin.gemm: b_scales.size(0) = ", groups,
              ", expected 1 (per-column scales) or K / ", kGroupSize, " = ", k / kGroupSize, " (group size ",
              kGroupSize, ")");

  if (workspace.has_value()) {
    const at::Tensor& w = *workspace;
    TORCH_CHECK(w.scalar_type() == at::kInt, "marlin.gemm: workspace.dtype = ", w.scalar_type(),
                ", expected torch.int32");
    TORCH_CHECK(w.device() == a.device(), "marlin.gemm: workspace is on ", w.device(), " but a is on ", a.device());
    TORCH_CHECK(w.is_contiguous(), "marlin.gemm: workspace must be contiguous");
  }
  TORCH_CHECK(tile_k.has_value() == tile_n.has_value(), "marlin.gemm: give both tile_k and tile_n, or neither");
  if (tile_k.has_value()) {
    const bool known = (*tile_k == 128 && *tile_n == 128) || (*tile_k == 64 && *tile_n == 256);
    TORCH_CHECK(known, "marlin.gemm: (tile_k, tile_n) = (", *tile_k, ", ", *tile_n,
                "), expected (128, 128) or (64, 256)");
    TORCH_CHECK(k % *tile_k == 0 && n % *tile_n == 0, "marlin.gemm: K = ", k, ", N = ", n,
                " do not divide into tile_k = ", *tile_k, ", tile_n = ", *tile_n);
  }
  return GemmShape{m, k, n, groups};
}

}  // namespace marlin
