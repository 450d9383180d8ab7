// Argument checks shared by the CPU and CUDA implementations of marlin::gemm, so that both
// accept exactly the same formats and shapes. marlin/ops.py repeats them for the fake (meta) kernel.
// The formats themselves are specified by marlin/packing.py and docs/FORMAT.md.
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

// What torch.ops.marlin.gemm accepts (see README "Supported shapes" and docs/FORMAT.md).
constexpr int64_t kTileK = 16;       // rows of K per packed row of b_q
constexpr int64_t kKMultiple = 64;   // K must be a multiple of this (and of the group size)
constexpr int64_t kNMultiple = 64;   // N must be a multiple of this (the packed tile width)
constexpr int64_t kGroupSizes[] = {32, 64, 128};  // besides per column (one scale row)

// Packed int32 words per column for every 16 rows of K: 16 * bits / 32.
constexpr int64_t words_per_column(int64_t bits) { return bits / 2; }

struct GemmShape {
  int64_t m, k, n;
  int64_t groups;      // rows of b_scales (1: per column)
  int64_t group_size;  // K / groups, or -1 for per column
  int64_t bits;        // 4 or 8
  bool has_zeros;      // b_zeros given (4-bit only): w = (u - z) * s instead of (u - 2^(bits-1)) * s
  at::ScalarType dtype;  // of a, b_scales, b_zeros and the output: Half or BFloat16
};

inline GemmShape check_gemm_args(const at::Tensor& a, const at::Tensor& b_q, const at::Tensor& b_scales,
                                 const std::optional<at::Tensor>& b_zeros,
                                 const std::optional<at::Tensor>& workspace, std::optional<int64_t> tile_k,
                                 std::optional<int64_t> tile_n, int64_t bits) {
  TORCH_CHECK(a.dim() == 2, "marlin.gemm: a.dim() = ", num(a.dim()), ", expected 2 (a is [M, K])");
  TORCH_CHECK(a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16, "marlin.gemm: a.dtype = ",
              dtype_str(a), ", expected torch.float16 or torch.bfloat16");
  TORCH_CHECK(bits == 4 || bits == 8, "marlin.gemm: bits = ", num(bits), ", expected 4 or 8");
  const int64_t wpc = words_per_column(bits);
  const std::string bq_shape = bits == 4 ? "[K/16, 2*N]" : "[K/16, 4*N]";
  TORCH_CHECK(b_q.dim() == 2, "marlin.gemm: b_q.dim() = ", num(b_q.dim()), ", expected 2 (b_q is int32 ", bq_shape,
              " for bits = ", num(bits), ")");
  TORCH_CHECK(b_q.scalar_type() == at::kInt, "marlin.gemm: b_q.dtype = ", dtype_str(b_q), ", expected torch.int32");
  TORCH_CHECK(b_scales.dim() == 2, "marlin.gemm: b_scales.dim() = ", num(b_scales.dim()), ", expected 2 ([groups, N])");
  // No implicit casts: the scales are part of the weight format, and their dtype is the compute dtype.
  TORCH_CHECK(b_scales.scalar_type() == a.scalar_type(), "marlin.gemm: b_scales.dtype = ", dtype_str(b_scales),
              " but a.dtype = ", dtype_str(a), ", expected the same dtype (no implicit cast)");

  TORCH_CHECK(b_q.device() == a.device(), "marlin.gemm: b_q is on ", device_str(b_q), " but a is on ", device_str(a),
              "; all tensors must be on one device");
  TORCH_CHECK(b_scales.device() == a.device(), "marlin.gemm: b_scales is on ", device_str(b_scales), " but a is on ",
              device_str(a), "; all tensors must be on one device");
  TORCH_CHECK(b_q.is_contiguous(), "marlin.gemm: b_q must be contiguous (strides ", dims(b_q.strides()), ")");
  TORCH_CHECK(b_scales.is_contiguous(), "marlin.gemm: b_scales must be contiguous (strides ", dims(b_scales.strides()), ")");

  TORCH_CHECK(b_q.size(1) % wpc == 0, "marlin.gemm: b_q.size(1) = ", num(b_q.size(1)), ", expected ", num(wpc),
              "*N for bits = ", num(bits));
  const int64_t k = b_q.size(0) * kTileK;
  const int64_t n = b_q.size(1) / wpc;
  const int64_t m = a.size(0);
  TORCH_CHECK(a.size(1) == k, "marlin.gemm: a.size(1) = ", num(a.size(1)), ", expected K = b_q.size(0) * 16 = ", num(k));
  TORCH_CHECK(k > 0 && k % kKMultiple == 0, "marlin.gemm: K = ", num(k), ", expected a positive multiple of ", num(kKMultiple));
  TORCH_CHECK(n > 0 && n % kNMultiple == 0, "marlin.gemm: N = b_q.size(1) / ", num(wpc), " = ", num(n),
              ", expected a positive multiple of ", num(kNMultiple));
  TORCH_CHECK(b_scales.size(1) == n, "marlin.gemm: b_scales.size(1) = ", num(b_scales.size(1)), ", expected N = ", num(n));

  // The group size is not passed: it is K / (rows of b_scales); one row means per column.
  const int64_t groups = b_scales.size(0);
  int64_t group_size = -1;
  if (groups != 1) {
    bool known = false;
    for (int64_t g : kGroupSizes) known = known || (groups > 0 && groups * g == k);
    TORCH_CHECK(known, "marlin.gemm: b_scales.size(0) = ", num(groups),
                ", expected 1 (per-column scales) or K / group_size with group_size 32, 64 or 128 (K = ", num(k),
                ": ", num(k / 32), ", ", num(k / 64), k % 128 == 0 ? " or " + num(k / 128) : std::string(), ")");
    group_size = k / groups;
  }

  const bool has_zeros = b_zeros.has_value();
  if (has_zeros) {
    const at::Tensor& z = *b_zeros;
    TORCH_CHECK(bits == 4, "marlin.gemm: b_zeros was given with bits = ", num(bits),
                "; zero points are supported for 4-bit weights only (8-bit weights are symmetric: pass None)");
    TORCH_CHECK(z.scalar_type() == a.scalar_type(), "marlin.gemm: b_zeros.dtype = ", dtype_str(z), " but a.dtype = ",
                dtype_str(a), ", expected the same dtype (zero points are stored like the scales)");
    TORCH_CHECK(z.dim() == 2 && z.size(0) == groups && z.size(1) == n, "marlin.gemm: b_zeros shape ", dims(z.sizes()),
                ", expected the shape of b_scales ", dims(b_scales.sizes()));
    TORCH_CHECK(z.device() == a.device(), "marlin.gemm: b_zeros is on ", device_str(z), " but a is on ", device_str(a),
                "; all tensors must be on one device");
    TORCH_CHECK(z.is_contiguous(), "marlin.gemm: b_zeros must be contiguous (strides ", dims(z.strides()), ")");
  }

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
  return GemmShape{m, k, n, groups, group_size, bits, has_zeros, a.scalar_type()};
}

}  // namespace marlin
