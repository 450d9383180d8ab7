// CPU reference for marlin::gemm: unpack the Marlin layout, dequantize exactly (scale * q in
// fp32), multiply with fp32 accumulation in a fixed order, round to fp16. Slow and simple on
// purpose: it is what the CUDA kernel and the Python spec are checked against.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "../format_tables.h"
#include "../gemm_checks.h"

namespace marlin {
namespace {

// B [K, N] in fp32 from the packed words and scales.
std::vector<float> dequantize_cpu(const at::Tensor& b_q, const at::Tensor& b_scales, int64_t k, int64_t n,
                                  int64_t groups) {
  std::vector<float> w(static_cast<size_t>(k * n));
  const int32_t* q = b_q.data_ptr<int32_t>();
  const at::Half* s = b_scales.data_ptr<at::Half>();
  const auto& slot_of = tile_slot_of();
  const int64_t group_rows = k / groups;
  at::parallel_for(0, k / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t kt = begin; kt < end; kt++) {
      const int32_t* row = q + kt * 2 * n;
      for (int64_t kk = 0; kk < 16; kk++) {
        const int64_t kr = kt * 16 + kk;
        const int64_t g = kr / group_rows;
        for (int64_t col = 0; col < n; col++) {
          const int64_t nt = col / 64, c = col % 64;
          const int slot = slot_of[kk * 64 + c];
          const uint32_t word = static_cast<uint32_t>(row[nt * 128 + slot / 8]);
          const int v = static_cast<int>((word >> (4 * (slot % 8))) & 0xF) - 8;
          const int64_t s_idx = groups == 1 ? col : g * n + nt * 64 + scale_position(static_cast<int>(c));
          w[kr * n + col] = static_cast<float>(s[s_idx]) * static_cast<float>(v);
        }
      }
    }
  });
  return w;
}

at::Tensor gemm_cpu(const at::Tensor& a, const at::Tensor& b_q, const at::Tensor& b_scales,
                    const std::optional<at::Tensor>& b_zeros, const std::optional<at::Tensor>& workspace,
                    std::optional<int64_t> tile_k, std::optional<int64_t> tile_n) {
  const GemmShape sh = check_gemm_args(a, b_q, b_scales, b_zeros, workspace, tile_k, tile_n);
  at::Tensor c = at::empty({sh.m, sh.n}, a.options());
  if (sh.m == 0) return c;
  const std::vector<float> w = dequantize_cpu(b_q, b_scales, sh.k, sh.n, sh.groups);
  const at::Tensor ac = a.contiguous();
  const at::Half* ap = ac.data_ptr<at::Half>();
  at::Half* cp = c.data_ptr<at::Half>();
  const int64_t n = sh.n, k = sh.k;
  constexpr int64_t kColBlock = 256;
  const int64_t col_blocks = (n + kColBlock - 1) / kColBlock;
  // One task = one row of A times one block of columns; k ascending, fp32 sums.
  at::parallel_for(0, sh.m * col_blocks, 1, [&](int64_t begin, int64_t end) {
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
      for (int64_t j = 0; j < width; j++) cp[row * n + c0 + j] = static_cast<at::Half>(acc[j]);
    }
  });
  return c;
}

}  // namespace

TORCH_LIBRARY_IMPL(marlin, CPU, m) { m.impl("gemm", &gemm_cpu); }

}  // namespace marlin
