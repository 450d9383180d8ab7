// Argument checks shared by the CPU and CUDA implementations of marlin::gemm, so that both
// accept exactly the same inputs. marlin/ops.py repeats them for the fake (meta) kernel.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

namespace marlin {

// Error-message pieces, formatted as strings before they reach TORCH_CHECK. On the GPU image
// (g++ 13, torch 2.11) `ostream << int64_t` inside this extension crashed with SIGSEGV in a
// libstdc++ locale facet, so a bad input would kill the process instead of raising. Strings
// stream safely there; numbers, dtypes, devices and shapes are converted here first.
inline std::string num(int64_t v) { return std::to_string(v); }
inline std::string dtype_str(const at::Tensor& t) { return c10::toString(t.scalar_type()); }
inline std::string device_str(const at::Tensor& t) { return t.device().str(); }
inline std::string dims(c10::IntArrayRef d) {
  std::string out = "[";
  for (size_t i = 0; i < d.size(); i++) out += (i ? ", " : "") + std::to_string(d[i]);
  return out + "]";
}

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
  TORCH_CHECK(a.dim() == 2, "marlin.gemm: a.dim() = ", num(a.dim()), ", expected 2 (a is [M, K])");
  TORCH_CHECK(a.scalar_type() == at::kHalf, "marlin.gemm: a.dtype = ", dtype_str(a), ", expected torch.float16");
  TORCH_CHECK(b_q.dim() == 2, "marlin.gemm: b_q.dim() = ", num(b_q.dim()), ", expected 2 (b_q is int32 [K/16, 2*N])");
  TORCH_CHECK(b_q.scalar_type() == at::kInt, "marlin.gemm: b_q.dtype = ", dtype_str(b_q), ", expected torch.int32");
  TORCH_CHECK(b_scales.dim() == 2, "marlin.gemm: b_scales.dim() = ", num(b_scales.dim()), ", expected 2 ([groups, N])");
  TORCH_CHECK(b_scales.scalar_type() == at::kHalf, "marlin.gemm: b_scales.dtype = ", dtype_str(b_scales),
              ", expected torch.float16");
  TORCH_CHECK(!b_zeros.has_value(), "marlin.gemm: b_zeros was given, but zero points are not supported yet "
              "(only symmetric INT4 weights); pass None");

  TORCH_CHECK(b_q.device() == a.device(), "marlin.gemm: b_q is on ", device_str(b_q), " but a is on ", device_str(a),
              "; all tensors must be on one device");
  TORCH_CHECK(b_scales.device() == a.device(), "marlin.gemm: b_scales is on ", device_str(b_scales), " but a is on ",
              device_str(a), "; all tensors must be on one device");
  TORCH_CHECK(b_q.is_contiguous(), "marlin.gemm: b_q must be contiguous (strides ", dims(b_q.strides()), ")");
  TORCH_CHECK(b_scales.is_contiguous(), "marlin.gemm: b_scales must be contiguous (strides ", dims(b_scales.strides()), ")");

  TORCH_CHECK(b_q.size(1) % 2 == 0, "marlin.gemm: b_q.size(1) = ", num(b_q.size(1)), ", expected 2*N (an even number)");
  const int64_t k = b_q.size(0) * kTileK;
  const int64_t n = b_q.size(1) / 2;
  const int64_t m = a.size(0);
  TORCH_CHECK(a.size(1) == k, "marlin.gemm: a.size(1) = ", num(a.size(1)), ", expected K = b_q.size(0) * 16 = ", num(k));
  TORCH_CHECK(k > 0 && k % kKMultiple == 0, "marlin.gemm: K = ", num(k), ", expected a positive multiple of ", num(kKMultiple));
  TORCH_CHECK(n > 0 && n % kNMultiple == 0, "marlin.gemm: N = b_q.size(1) / 2 = ", num(n),
              ", expected a positive multiple of ", num(kNMultiple));
  TORCH_CHECK(b_scales.size(1) == n, "marlin.gemm: b_scales.size(1) = ", num(b_scales.size(1)), ", expected N = ", num(n));
  const int64_t groups = b_scales.size(0);
  TORCH_CHECK(groups == 1 || groups == k / kGroupSize, "marlin.gemm: b_scales.size(0) = ", num(groups),
              ", expected 1 (per-column scales) or K / ", num(kGroupSize), " = ", num(k / kGroupSize),
              " (group size ", num(kGroupSize), ")");

  if (workspace.has_value()) {
    const at::Tensor& w = *workspace;
    TORCH_CHECK(w.scalar_type() == at::kInt, "marlin.gemm: workspace.dtype = ", dtype_str(w),
                ", expected torch.int32");
    TORCH_CHECK(w.device() == a.device(), "marlin.gemm: workspace is on ", device_str(w), " but a is on ", device_str(a));
    TORCH_CHECK(w.is_contiguous(), "marlin.gemm: workspace must be contiguous");
  }
  TORCH_CHECK(tile_k.has_value() == tile_n.has_value(), "marlin.gemm: give both tile_k and tile_n, or neither");
  if (tile_k.has_value()) {
    const bool known = (*tile_k == 128 && (*tile_n == 128 || *tile_n == 256 || *tile_n == 512)) ||
                       (*tile_k == 64 && *tile_n == 256);
    TORCH_CHECK(known, "marlin.gemm: (tile_k, tile_n) = (", num(*tile_k), ", ", num(*tile_n),
                "), expected (128, 128), (64, 256), (128, 256) or (128, 512)");
    TORCH_CHECK(k % *tile_k == 0 && n % *tile_n == 0, "marlin.gemm: K = ", num(k), ", N = ", num(n),
                " do not divide into tile_k = ", num(*tile_k), ", tile_n = ", num(*tile_n));
  }
  return GemmShape{m, k, n, groups};
}

}  // namespace marlin
