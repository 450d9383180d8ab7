// How every kernel instance is launched: the shared-memory opt-in (once per kernel and device)
// and the optional programmatic-dependent-launch attribute.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace marlin {

class SmemAttrCache {
 public:
  cudaError_t ensure(const void* kernel, int smem) {
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    if (dev < 0 || dev >= kMaxDevices) return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (done_[dev].load(std::memory_order_acquire) >= smem) return cudaSuccess;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err == cudaSuccess) done_[dev].store(smem, std::memory_order_release);
    return err;
  }

 private:
  static constexpr int kMaxDevices = 64;
  std::atomic<int> done_[kMaxDevices] = {};
};

// Launches kernel<<<grid, threads, smem, stream>>>(params) after opting it in to `smem` bytes of
// dynamic shared memory. cudaFuncSetAttribute on every launch cost host time on every call (and
// inside CUDA-graph capture it is just overhead); the attribute is per kernel and device, so
// `cache` (one per instance) remembers it. pdl: allow the kernel to start while the previous one
// in the stream finishes (sm_90+; the kernels call grid_dependency_wait() before reading
// anything that kernel may write, see ptx.cuh).
template <typename Params>
cudaError_t launch_kernel(void (*kernel)(Params), SmemAttrCache& cache, const Params& params, int grid, int threads,
                          int smem, cudaStream_t stream, bool pdl) {
  cudaError_t err = cache.ensure(reinterpret_cast<const void*>(kernel), smem);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = pdl ? 1 : 0;
  err = cudaLaunchKernelEx(&config, kernel, params);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace marlin
