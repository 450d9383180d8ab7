// Every schema of the marlin namespace, in one place. Implementations register themselves in
// their own files (cpu/gemm_cpu.cpp, cuda/gemm_cuda.cpp); fake kernels live in marlin/ops.py.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(marlin, m) {
  // C[M, N] (fp16) = a[M, K] (fp16) @ dequant(b_q, b_scales).
  //   b_q       int32 [K/16, 2N]: INT4 weights in the Marlin layout (marlin/packing.py).
  //   b_scales  fp16 [K/128, N] (group size 128, permuted) or [1, N] (per column, natural order).
  //   b_zeros   reserved for zero points (asymmetric formats); must be None today.
  //   workspace int32, all zero, at least marlin.ops.workspace_size(device) elements, or None
  //             (then one is allocated per call). Read and written by the kernel as locks, and
  //             left all zero again on return, hence declared immutable. One workspace must not
  //             be used by two calls that can run at the same time (two streams).
  //   tile_k, tile_n  force a tile configuration, (128, 128) or (64, 256); None picks from the
  //             table. For tuning and tests; the CPU implementation checks and ignores them.
  m.def(
      "gemm(Tensor a, Tensor b_q, Tensor b_scales, Tensor? b_zeros=None, Tensor? workspace=None, "
      "int? tile_k=None, int? tile_n=None) -> Tensor");
}

// 2:4-sparse INT4 weights (Sparse-MARLIN; layout in marlin/sparse.py). A separate block so that
// the dense schema above can change on its own.
TORCH_LIBRARY_FRAGMENT(marlin, m) {
  // C[M, N] (fp16) = a[M, K] (fp16) @ dequant(b_q, b_meta, b_scales), fp32 accumulation.
  //   b_q       int32 [K/32, 2N]: the kept INT4 values, two per 4 rows of K, in the dense tile order.
  //   b_meta    int32 [K/32, N]: their 2-bit positions, in the order mma.sp reads them.
  //   b_scales  fp16 [K/128, N] (group 128 along the original K, permuted) or [1, N] (per column).
  //   workspace as for gemm: int32, all zero, at least marlin.ops.workspace_size(device), or None.
  m.def("gemm_2_4(Tensor a, Tensor b_q, Tensor b_meta, Tensor b_scales, Tensor? workspace=None) -> Tensor");
}

// `import marlin._C` loads this library, which runs the registrations above. No pybind11.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "marlin custom ops (torch.ops.marlin)", -1,
                                          nullptr};
  return PyModule_Create(&module_def);
}
