// Development probe: where the GPU places thread-block clusters. Records the SM of every block
// for clusters of 1-8 blocks, 16-48 clusters and three per-block shared-memory sizes, and the
// clusters resident at one block per SM (cudaOccupancyMaxActiveClusters); prints the busiest SM
// of each launch and the SM groups that clusters link (the GPCs, or parts of them). The 2:4
// planner's placement rule (csrc/cuda/sparse/marlin_24.cu, spread_clusters) comes from it.
//
//   nvcc -arch=sm_90a -O2 -o /tmp/cluster_placement benchmarks/cluster_placement.cu && /tmp/cluster_placement
//
// (sm_90 and newer; benchmarks/NOTES.md, 2026-11-29 seventeenth, has the H200's output.)
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <map>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

// Each block writes the SM it runs on, after spinning long enough that every resident block of
// the launch overlaps with every other (so the placement is the one of a single wave).
__global__ void record_sm(int* out, long long spin) {
  extern __shared__ int sm[];
  unsigned smid; asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  long long t0 = clock64(); while (clock64() - t0 < spin) {}
  if (threadIdx.x == 0) { sm[0] = smid; out[blockIdx.x] = sm[0]; }
}

// union-find over SM ids: SMs that ran blocks of one cluster share a GPC
int parent[1024];
int find(int x) { return parent[x] == x ? x : parent[x] = find(parent[x]); }

// Launches nclusters clusters of C blocks with smem bytes each; the SM of every block, and in
// *maxact the clusters of this configuration that can be resident at once.
std::vector<int> run(int C, int nclusters, int smem, int* d, long long spin, int* maxact) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(C * nclusters); cfg.blockDim = dim3(128); cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeClusterDimension; at[0].val.clusterDim.x = C; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
  cfg.attrs = at; cfg.numAttrs = 1;
  CK(cudaOccupancyMaxActiveClusters(maxact, record_sm, &cfg));
  CK(cudaLaunchKernelEx(&cfg, record_sm, d, spin));
  CK(cudaDeviceSynchronize());
  std::vector<int> h(C * nclusters);
  CK(cudaMemcpy(h.data(), d, h.size() * 4, cudaMemcpyDeviceToHost));
  return h;
}

int main() {
  cudaDeviceProp p; CK(cudaGetDeviceProperties(&p, 0));
  int sms = p.multiProcessorCount;
  CK(cudaFuncSetAttribute(record_sm, cudaFuncAttributeMaxDynamicSharedMemorySize, p.sharedMemPerBlockOptin));
  CK(cudaFuncSetAttribute(record_sm, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  int* d; CK(cudaMalloc(&d, 4096 * 4));
  for (int i = 0; i < 1024; i++) parent[i] = i;
  int one = p.sharedMemPerBlockOptin - 1024;  // one block per SM
  // SM groups: clusters of 16 down to 2 blocks at one block per SM, as many as are resident at once
  for (int C : {16, 12, 8, 6, 4, 3, 2}) {
    int act = 0;
    auto h = run(C, 1, one, d, 1000, &act);
    int n = act;
    h = run(C, n, one, d, 200000, &act);
    for (int c = 0; c < n; c++) for (int j = 1; j < C; j++) parent[find(h[c * C + j])] = find(h[c * C]);
    printf("C=%d max active clusters at 1 block/SM: %d\n", C, act);
  }
  std::map<int, std::vector<int>> g;
  for (int s = 0; s < sms; s++) g[find(s)].push_back(s);
  printf("GPCs (SMs linked by a cluster): %zu:", g.size());
  for (auto& kv : g) printf(" %zu", kv.second.size());
  printf("\n");
  std::map<int, int> gpc_of; int gi = 0;
  for (auto& kv : g) { for (int s : kv.second) gpc_of[s] = gi; gi++; }
  // placement: cluster sizes, counts and shared memory as the 2:4 planner's plans (58 / 66 KB: 3
  // blocks per SM, 100 KB: 2); beyond maxact clusters a second wave runs and max_per_SM counts both
  for (int smem : {58 * 1024, 66 * 1024, 100 * 1024}) {
    for (int C : {1, 2, 3, 4, 5, 6, 7, 8}) {
      for (int n : {16, 20, 24, 32, 40, 48}) {
        int act = 0;
        auto h = run(C, n, smem, d, 400000, &act);  // ~0.2 ms spin: all resident blocks overlap
        std::map<int, int> per_sm; std::map<int, int> per_gpc;
        for (int s : h) per_sm[s]++, per_gpc[gpc_of[s]]++;
        int mx = 0; for (auto& kv : per_sm) mx = std::max(mx, kv.second);
        int mg = 0; for (auto& kv : per_gpc) mg = std::max(mg, kv.second);
        printf("smem=%dK C=%d clusters=%d blocks=%d maxact=%d SMs_used=%zu max_per_SM=%d max_per_GPC=%d\n",
               smem / 1024, C, n, C * n, act, per_sm.size(), mx, mg);
      }
    }
  }
  return 0;
}
