// Opting a kernel in to more than 48 KB of dynamic shared memory, once per device.
// cudaFuncSetAttribute on every launch cost host time on every call (and inside CUDA-graph
// capture it is just overhead); the attribute is per kernel and device, so remember it.
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

}  // namespace marlin
