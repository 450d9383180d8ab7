// What the 2:4 kernel takes (Params) and how the planner reaches its compiled instances
// (Instance), without the kernel's device code: marlin_24.cu plans and launches through these,
// marlin_24_instances_{f16,bf16}{,_fine}.cu define find<half or nv_bfloat16, FINE>.
#pragma once

#include <cuda_runtime.h>

namespace marlin {
namespace sparse24 {

constexpr int kStrips = 4;     // 32-row strips per stage: 128 rows of K, one to four scale groups
constexpr int kStageK = 32 * kStrips;
constexpr int kMaxClusterParts = 8;  // the portable cluster size

struct Params {
  const int4* a;       // [M, K] of the element type, rows lda_int4 apart (16-byte units)
  const int4* b_q;     // [K/32, 2N] int32
  const int4* b_meta;  // [K/32, N] int32
  const int4* s;       // [groups, N] of the element type
  const int4* z;       // zero points (integers 0..15) in s's shape, type and layout; nullptr: 8
  void* c;             // [M, N] of the element type (fp16 or bf16, as a and s)
  float* partial;      // [parts, M, N] fp32 (parts > 1 without cluster_reduce)
  int* locks;          // one zeroed arrival counter per column tile and slice (as partial)
  int m, n, k;
  long long lda_int4;
  int groups;          // 1: per column, else K / group size (128, 64 or 32)
  int strip_shift;     // log2 of the strips per scale group: 2 (group 128, and per column), 1 (group 64), 0 (group 32)
  int parts;           // K parts per column tile
  bool cluster_reduce; // the parts of a tile are one cluster (sm_90+, parts <= kMaxClusterParts)
};

// Stages of the cp.async ring: 4, and 3 as a second instance at 8-16 rows on the 256-column
// tile (less shared memory: 4 blocks per SM instead of 3; plan_24 takes it for its three-part rule
// at 1-8 rows, MARLIN_2_4_STAGES=3 wherever it exists).
constexpr int kStages = 4;

// One compiled instance: its launch, shared memory, threads, and (once per device) its resident
// blocks per SM and resident clusters.
struct Instance {
  int smem;             // dynamic shared memory for one scale row per stage (group 128, per column)
  int scale_row_bytes;  // fine plans add kStrips scale rows of this size per stage (and as many zero rows)
  int threads;
  int (*blocks_per_sm)(int smem);
  int (*max_clusters)(int cluster, int smem);
  cudaError_t (*launch)(const Params& p, int grid, int smem, cudaStream_t stream, bool pdl, int cluster);
};

// The instance for a plan's (mb, nw, ms, stages, wg, kw), of element type half or nv_bfloat16,
// the plain or the FINE kernel (marlin_24_instances.cuh lists them).
template <typename ET, bool FINE>
Instance find(int mb, int nw, int ms, int stages, int wg, int kw);

// find<nv_bfloat16 or half, fine> (defined in marlin_24_instances_bf16.cu).
Instance find_instance(bool bf16, bool fine, int mb, int nw, int ms, int stages, int wg, int kw);

}  // namespace sparse24
}  // namespace marlin
