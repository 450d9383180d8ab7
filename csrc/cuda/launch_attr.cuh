// How every kernel instance is launched: the shared-memory opt-in (once per kernel and device),
// the optional programmatic-dependent-launch attribute and thread-block clusters.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace marlin {

// The configuration that launch_kernel launches with and SmemAttrCache::max_clusters asks the
// occupancy of: `attr` receives the optional attributes, programmatic dependent launch (pdl) and
// clusters of `cluster` blocks along x (cluster > 1).
inline cudaLaunchConfig_t launch_config(cudaLaunchAttribute (&attr)[2], int grid, int threads, int smem,
                                        cudaStream_t stream, bool pdl, int cluster) {
  int n_attr = 0;
  if (pdl) {
    attr[n_attr].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n_attr].val.programmaticStreamSerializationAllowed = 1;
    n_attr++;
  }
  if (cluster > 1) {
    attr[n_attr].id = cudaLaunchAttributeClusterDimension;
    attr[n_attr].val.clusterDim.x = cluster;
    attr[n_attr].val.clusterDim.y = 1;
    attr[n_attr].val.clusterDim.z = 1;
    n_attr++;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = n_attr;
  return config;
}

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

  // How many clusters of `cluster` blocks (2..kMaxCluster) with `smem` bytes each can be resident
  // at once; remembered per device and cluster size, for the last smem asked (the occupancy query
  // takes host time; the planner asks with one of two sizes per instance). 0 if none or unknown.
  template <typename Params>
  int max_clusters(void (*kernel)(Params), int cluster, int threads, int smem) {
    int dev = 0;
    if (cluster < 2 || cluster > kMaxCluster || cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return 0;
    const long long key = static_cast<long long>(smem) << 32;
    const long long known = clusters_[dev][cluster].load(std::memory_order_acquire);
    if (known != 0 && (known & ~0xFFFFFFFFLL) == key) return static_cast<int>(known & 0xFFFFFFFF) - 1;
    if (ensure(reinterpret_cast<const void*>(kernel), smem) != cudaSuccess) return 0;
    cudaLaunchAttribute attr[2];
    const cudaLaunchConfig_t config = launch_config(attr, cluster, threads, smem, nullptr, false, cluster);
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &config) != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky; leave no error for the next launch check
      n = 0;
    }
    clusters_[dev][cluster].store(key | (n + 1), std::memory_order_release);
    return n;
  }

  static constexpr int kMaxCluster = 8;  // the portable cluster size limit

 private:
  static constexpr int kMaxDevices = 64;
  std::atomic<int> done_[kMaxDevices] = {};
  std::atomic<long long> clusters_[kMaxDevices][kMaxCluster + 1] = {};  // smem << 32 | (count + 1)
};

// Launches kernel<<<grid, threads, smem, stream>>>(params) after opting it in to `smem` bytes of
// dynamic shared memory. cudaFuncSetAttribute on every launch cost host time on every call (and
// inside CUDA-graph capture it is just overhead); the attribute is per kernel and device, so
// `cache` (one per instance) remembers it. pdl: allow the kernel to start while the previous one
// in the stream finishes (sm_90+; the kernels call grid_dependency_wait() before reading
// anything that kernel may write, see ptx.cuh). cluster > 1: blocks in clusters of that many
// along x (sm_90+; grid a multiple of it).
template <typename Params>
cudaError_t launch_kernel(void (*kernel)(Params), SmemAttrCache& cache, const Params& params, int grid, int threads,
                          int smem, cudaStream_t stream, bool pdl, int cluster) {
  cudaError_t err = cache.ensure(reinterpret_cast<const void*>(kernel), smem);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t config = launch_config(attr, grid, threads, smem, stream, pdl, cluster);
  err = cudaLaunchKernelEx(&config, kernel, params);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace marlin
