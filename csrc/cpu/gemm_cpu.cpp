// CPU reference for marlin::gemm: unpack the Marlin layout, dequantize exactly, multiply with
// fp32 accumulation in a fixed order, round once to the activation dtype. Slow and simple on
// purpose: it is what the CUDA kernel and the Python spec (marlin/packing.py) are checked against.
//
// Every format of the op: fp16 or bf16 activations (scales and output in the same dtype), 4-bit
// weights symmetric (w = (u - 8) * s) or with zero points (w = (u - z) * s), 8-bit symmetric
// weights (w = (u - 128) * s), groups of 32/64/128 rows or per column. (u - z) is a small integer
// and s has at most 11 significant bits, so each dequantized weight is exact in fp32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../format_tables.h"
#include "../gemm_checks.h"
#include "cpu_reference.h"

namespace marlin {
namespace {

// B [K, N] in fp32 from the packed words, scales and (optional) zero points.
template <typename scalar_t>
std::vector<float> dequantize_cpu(const at::Tensor& b_q, const at::Tensor& b_scales,
                                  const std::optional<at::Tensor>& b_zeros, const GemmShape& sh) {
  const int64_t k = sh.k, n = sh.n, groups = sh.groups;
  std::vector<float> w(static_cast<size_t>(k * n));
  const int32_t* q = b_q.data_ptr<int32_t>();
  const scalar_t* s = b_scales.data_ptr<scalar_t>();
  const scalar_t* z = sh.has_zeros ? b_zeros->data_ptr<scalar_t>() : nullptr;
  if (z != nullptr) {
    // The op's zero points are integers 0..15 (docs/FORMAT.md); anything else would make the
    // products inexact and means the tensor was not packed by marlin.packing.
    for (int64_t i = 0; i < groups * n; i++) {
      const float zv = static_cast<float>(z[i]);
      TORCH_CHECK(zv >= 0.f && zv <= 15.f && std::floor(zv) == zv, "marlin.gemm: b_zeros holds ", std::to_string(zv),
                  " at flat index ", num(i), ", expected integer zero points in [0, 15]");
    }
  }
  const auto& slot_of = tile_slot_of(static_cast<int>(sh.bits));
  const int64_t per_word = 32 / sh.bits;                  // values in one int32 word
  const int64_t tile_words = 1024 / per_word;              // int32 words in one 16 x 64 tile
  const int64_t row_words = words_per_column(sh.bits) * n;  // words of one packed row (16 rows of K)
  const uint32_t mask = (1u << sh.bits) - 1;
  const float bias = static_cast<float>(1 << (sh.bits - 1));  // implicit zero point of symmetric formats
  const int64_t group_rows = k / groups;
  at::parallel_for(0, k / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t kt = begin; kt < end; kt++) {
      const int32_t* row = q + kt * row_words;
      for (int64_t kk = 0; kk < 16; kk++) {
        const int64_t kr = kt * 16 + kk;
        const int64_t g = kr / group_rows;
        for (int64_t col = 0; col < n; col++) {
          const int slot = slot_of[kk * 64 + col % 64];
          const uint32_t word = static_cast<uint32_t>(row[(col / 64) * tile_words + slot / per_word]);
          const uint32_t u = (word >> (sh.bits * (slot % per_word))) & mask;
          const int64_t si = cpu_reference::scale_index(g, col, n, groups);
          const float zero = z != nullptr ? static_cast<float>(z[si]) : bias;
          w[kr * n + col] = static_cast<float>(s[si]) * (static_cast<float>(u) - zero);
        }
      }
    }
  });
  return w;
}

at::Tensor gemm_cpu(const at::Tensor& a, const at::Tensor& b_q, const at::Tensor& b_scales,
                    const std::optional<at::Tensor>& b_zeros, const std::optional<at::Tensor>& workspace,
                    std::optional<int64_t> tile_k, std::optional<int64_t> tile_n, int64_t bits) {
  const GemmShape sh = check_gemm_args(a, b_q, b_scales, b_zeros, workspace, tile_k, tile_n, bits);
  at::Tensor c = at::empty({sh.m, sh.n}, a.options());
  if (sh.m == 0) return c;
  if (sh.dtype == at::kHalf) {
    cpu_reference::matmul_fp32<at::Half>(a, dequantize_cpu<at::Half>(b_q, b_scales, b_zeros, sh), sh.m, sh.k, sh.n, c);
  } else {
    cpu_reference::matmul_fp32<at::BFloat16>(a, dequantize_cpu<at::BFloat16>(b_q, b_scales, b_zeros, sh), sh.m, sh.k,
                                             sh.n, c);
  }
  return c;
}

}  // namespace

TORCH_LIBRARY_IMPL(marlin, CPU, m) { m.impl("gemm", &gemm_cpu); }

}  // namespace marlin
