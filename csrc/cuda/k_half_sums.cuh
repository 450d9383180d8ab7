// Two warps (or warpgroups) that computed the same outputs over the two halves of K: the upper
// half's fp32 sums go through shared memory into the lower half's. Used by the small-batch kernel
// (its two K warps per column, smallm_kernel.cuh) and the 2:4 kernel's two K warpgroups
// (sparse/marlin_24_kernel.cuh).
#pragma once

namespace marlin {

// tot[j][b][0..3] of this thread; `red` is the thread's own slot (its region of the buffer plus
// its lane), whose entries lie 32 float4 apart (one float4 per (j, b) for each of the 32 lanes
// of a warp). Every thread of the block calls it (one barrier); afterwards only the lower half
// (upper == false) holds the sums.
template <int J, int MB>
__device__ __forceinline__ void add_upper_k_half(float4* red, float (&tot)[J][MB][4], bool upper) {
  if (upper) {
#pragma unroll
    for (int j = 0; j < J; j++)
#pragma unroll
      for (int b = 0; b < MB; b++) red[(j * MB + b) * 32] = make_float4(tot[j][b][0], tot[j][b][1], tot[j][b][2], tot[j][b][3]);
  }
  __syncthreads();
  if (!upper) {
#pragma unroll
    for (int j = 0; j < J; j++)
#pragma unroll
      for (int b = 0; b < MB; b++) {
        const float4 v = red[(j * MB + b) * 32];
        tot[j][b][0] += v.x;
        tot[j][b][1] += v.y;
        tot[j][b][2] += v.z;
        tot[j][b][3] += v.w;
      }
  }
}

}  // namespace marlin
