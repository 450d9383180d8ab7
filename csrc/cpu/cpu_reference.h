// The parts the CPU references of marlin::gemm and marlin::gemm_2_4 share: where a column's scale
// sits in the permuted scale layout, and the exact product A @ B with B already dequantized to
// fp32. Both references must sum in the same fixed order so that they stay bit-for-bit
// reproducible (the CUDA kernels and the Python spec are checked against them).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../format_tables.h"

namespace marlin {
namespace cpu_reference {

// Index of the scale (and zero point) of column col in scale row g of the stored layout: per
// column (groups == 1) in natural order, grouped scales permuted within each 64-column chunk.
inline int64_t scale_index(int64_t g, int64_t col, int64_t n, int64_t groups) {
  if (groups == 1) return col;
  return g * n + (col / 64) * 64 + scale_position(static_cast<int>(col % 64));
}

// c [m, n] = a [m, k] @ w [k, n] (w row-major fp32), rounded once to scalar_t. One task is one
// row of A times one block of 256 columns; each sum runs over k ascending in fp32, so the result
// does not depend on the number of threads.
template <typename scalar_t>
void matmul_fp32(const at::Tensor& a, const std::vector<float>& w, int64_t m, int64_t k, int64_t n, at::Tensor& c) {
  const at::Tensor ac = a.contiguous();
  const scalar_t* ap = ac.data_ptr<scalar_t>();
  scalar_t* cp = c.data_ptr<scalar_t>();
  constexpr int64_t kColBlock = 256;
  const int64_t col_blocks = (n + kColBlock - 1) / kColBlock;
  at::parallel_for(0, m * col_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(kColBlock);
    for (int64_t task = begin; task < end; task++) {
      const int64_t row = task / col_blocks;
      const int64_t c0 = (task % col_blocks) * kColBlock;
      const int64_t width = std::min(kColBlock, n - c0);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t kk = 0; kk < k; kk++) {
        const float av = static_cast<float>(ap[row * k + kk]);
        const float* wr = w.data() + kk * n + c0;
        for (int64_t j = 0; j < width; j++) acc[j] += av * wr[j];
      }
      for (int64_t j = 0; j < width; j++) cp[row * n + c0 + j] = static_cast<scalar_t>(acc[j]);
    }
  });
}

}  // namespace cpu_reference
}  // namespace marlin
