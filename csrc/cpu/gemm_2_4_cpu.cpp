// CPU reference for marlin::gemm_2_4 (2:4-sparse INT4 weights, marlin/sparse.py): expand the
// compressed values to the dense B [K, N] at the positions b_meta names, dequantize exactly
// (scale * (u - z) in fp32, z the zero point from b_zeros or 8), multiply with fp32 accumulation
// in a fixed order (k ascending over the dense rows, pruned zeros included), round to the
// activations' dtype (fp16 or bf16, the scales' and zero points' too). Pruned positions are exact
// zeros whatever the zero point. Slow and simple: the CUDA kernel and the Python spec are checked
// against it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <vector>

#include "../format_tables.h"
#include "../gemm_2_4_checks.h"
#include "../sparse_format.h"
#include "cpu_reference.h"

namespace marlin {
namespace {

// Dense dequantized B [K, N] in fp32 from the packed values, metadata, scales and (optional) zero
// points. A metadata nibble that is not two distinct positions (the lower first) is an error: the
// tensor cores' result would be undefined there. scalar_t: the scales' (and zero points') dtype.
template <typename scalar_t>
std::vector<float> dequantize_2_4_cpu(const at::Tensor& b_q, const at::Tensor& b_meta, const at::Tensor& b_scales,
                                      const std::optional<at::Tensor>& b_zeros, int64_t k, int64_t n, int64_t groups) {
  std::vector<float> w(static_cast<size_t>(k * n), 0.f);
  const int32_t* q = b_q.data_ptr<int32_t>();
  const int32_t* meta = b_meta.data_ptr<int32_t>();
  const scalar_t* s = b_scales.data_ptr<scalar_t>();
  const scalar_t* z = b_zeros.has_value() ? b_zeros->data_ptr<scalar_t>() : nullptr;
  if (z != nullptr) {
    // As for the dense op: integer zero points 0..15 (docs/FORMAT.md); anything else would make the
    // products inexact and means the tensor was not packed by marlin.sparse.
    for (int64_t i = 0; i < groups * n; i++) {
      const float zv = static_cast<float>(z[i]);
      TORCH_CHECK(zv >= 0.f && zv <= 15.f && std::floor(zv) == zv, "marlin.gemm_2_4: b_zeros holds ", std::to_string(zv),
                  " at flat index ", num(i), ", expected integer zero points in [0, 15]");
    }
  }
  const auto& slot_of = tile_slot_of(4);
  const auto& meta_slot = meta_slot_of();
  const int64_t group_rows = k / groups;
  const int64_t strips = k / kStrip24;
  std::vector<int64_t> bad(static_cast<size_t>(strips), -1);  // first bad (row, column) per strip, or -1
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    for (int64_t st = begin; st < end; st++) {
      const int32_t* row = q + st * 2 * n;
      const int32_t* mrow = meta + st * n;
      for (int64_t cr = 0; cr < 16; cr++) {  // compressed row 16 st + cr: group 8 st + cr / 2
        const int64_t go = cr / 2;
        for (int64_t col = 0; col < n; col++) {
          const int64_t nt = col / 64, c = col % 64;
          const int ms = meta_slot[go * 64 + c];
          const uint32_t mword = static_cast<uint32_t>(mrow[nt * 64 + ms / 8]);
          const int nib = static_cast<int>((mword >> (4 * (ms % 8))) & 0xF);
          const int i0 = nib & 3, i1 = nib >> 2;
          if (i0 >= i1) {
            if (bad[st] < 0) bad[st] = (8 * st + go) * 4 * n + col;
            continue;
          }
          const int slot = slot_of[cr * 64 + c];
          const uint32_t word = static_cast<uint32_t>(row[nt * 128 + slot / 8]);
          const float u = static_cast<float>((word >> (4 * (slot % 8))) & 0xF);
          const int64_t kr = 4 * (8 * st + go) + (cr % 2 == 0 ? i0 : i1);
          const int64_t g = kr / group_rows;
          const int64_t s_idx = cpu_reference::scale_index(g, col, n, groups);
          const float zero = z != nullptr ? static_cast<float>(z[s_idx]) : 8.f;  // same index as the scale
          w[kr * n + col] = static_cast<float>(s[s_idx]) * (u - zero);
        }
      }
    }
  });
  for (int64_t st = 0; st < strips; st++) {
    TORCH_CHECK(bad[st] < 0, "marlin.gemm_2_4: b_meta names the same or a decreasing pair of positions for rows ",
                num(bad[st] / n), "..", num(bad[st] / n + 3), " of column ", num(bad[st] % n),
                "; expected two distinct positions, the lower first (b_meta from marlin.sparse.quantize_and_pack_2_4)");
  }
  return w;
}

at::Tensor gemm_2_4_cpu(const at::Tensor& a, const at::Tensor& b_q, const at::Tensor& b_meta, const at::Tensor& b_scales,
                        const std::optional<at::Tensor>& workspace, const std::optional<at::Tensor>& b_zeros) {
  const Gemm24Shape sh = check_gemm_2_4_args(a, b_q, b_meta, b_scales, workspace, b_zeros);
  at::Tensor c = at::empty({sh.m, sh.n}, a.options());
  if (sh.m == 0) return c;
  if (a.scalar_type() == at::kBFloat16) {
    const std::vector<float> w = dequantize_2_4_cpu<at::BFloat16>(b_q, b_meta, b_scales, b_zeros, sh.k, sh.n, sh.groups);
    cpu_reference::matmul_fp32<at::BFloat16>(a, w, sh.m, sh.k, sh.n, c);
  } else {
    const std::vector<float> w = dequantize_2_4_cpu<at::Half>(b_q, b_meta, b_scales, b_zeros, sh.k, sh.n, sh.groups);
    cpu_reference::matmul_fp32<at::Half>(a, w, sh.m, sh.k, sh.n, c);
  }
  return c;
}

}  // namespace

TORCH_LIBRARY_IMPL(marlin, CPU, m) { m.impl("gemm_2_4", &gemm_2_4_cpu); }

}  // namespace marlin
