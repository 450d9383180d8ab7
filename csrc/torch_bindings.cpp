// Every schema of the marlin namespace, in one place. Implementations register themselves in
// their own files (cpu/gemm_cpu.cpp, cuda/gemm_cuda.cpp); fake kernels live in marlin/ops.py.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(marlin, m) {
  // C[M, N] = a[M, K] @ dequant(b_q, b_scales, b_zeros), in a's dtype, fp32 accumulation.
  //   a         float16 or bfloat16 [M, K]; b_scales and b_zeros have the same dtype (no implicit cast).
  //   b_q       int32 [K/16, 2N] (bits = 4) or [K/16, 4N] (bits = 8): weights in the Marlin layout
  //             (marlin/packing.py is the executable spec, docs/FORMAT.md the prose).
  //   b_scales  [groups, N]: groups = K / group_size (group size 32, 64 or 128; permuted layout) or
  //             1 (per column, natural order). The group size is inferred from the row count.
  //   b_zeros   None (symmetric: w = (u - 2^(bits-1)) * s) or, for bits = 4 only, the integer zero
  //             points z in [0, 15] with b_scales' shape, dtype and layout: w = (u - z) * s.
  //   workspace int32, all zero, at least marlin.ops.workspace_size(device) elements, or None
  //             (then the stream's own lock slot is used). Read and written by the kernel as locks,
  //             and left all zero again on return, hence declared immutable. One workspace must not
  //             be used by two calls that can run at the same time (two streams).
  //   tile_k, tile_n  force a tile configuration, (128, 128) or (64, 256); None picks from the
  //             table. For tuning and tests; the CPU implementation checks and ignores them.
  //   bits      4 or 8: the weight width.
  // Shapes: K and N positive multiples of 64, K a multiple of the group size.
  m.def(
      "gemm(Tensor a, Tensor b_q, Tensor b_scales, Tensor? b_zeros=None, Tensor? workspace=None, "
      "int? tile_k=None, int? tile_n=None, int bits=4) -> Tensor");
}

// 2:4-sparse INT4 weights (Sparse-MARLIN; layout in marlin/sparse.py). A separate block so that
// the dense schema above can change on its own.
TORCH_LIBRARY_FRAGMENT(marlin, m) {
  // C[M, N] = a[M, K] @ dequant(b_q, b_meta, b_scales, b_zeros), fp32 accumulation; a, b_scales,
  // b_zeros and C all float16 or all bfloat16.
  //   b_q       int32 [K/32, 2N]: the kept INT4 values, two per 4 rows of K, in the dense tile order.
  //   b_meta    int32 [K/32, N]: their 2-bit positions, in the order mma.sp reads them.
  //   b_scales  [K/group_size, N] (group_size 128, 64 or 32 along the original K, permuted) or
  //             [1, N] (per column, natural order). The group size is inferred from the row count.
  //   workspace as for gemm: int32, all zero, at least marlin.ops.workspace_size(device), or None.
  //   b_zeros   None (symmetric: a kept value is (u - 8) * s) or the integer zero points z in
  //             [0, 15] with b_scales' shape, dtype and layout, as for gemm: (u - z) * s. Pruned
  //             positions are exact zeros either way (not stored). Last, so that positional calls
  //             that pass a workspace keep their meaning.
  m.def(
      "gemm_2_4(Tensor a, Tensor b_q, Tensor b_meta, Tensor b_scales, Tensor? workspace=None, "
      "Tensor? b_zeros=None) -> Tensor");
}

// `import marlin._C` loads this library, which runs the registrations above. No pybind11.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "marlin custom ops (torch.ops.marlin)", -1,
                                          nullptr};
  return PyModule_Create(&module_def);
}
