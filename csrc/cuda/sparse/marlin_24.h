// Host-side interface of the 2:4-sparse kernel (marlin_24.cu), free of torch headers so that
// the kernel file compiles with plain nvcc. gemm_2_4_cuda.cpp checks the arguments, allocates
// the output and the fp32 partials, and calls plan_24 and launch_24.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace marlin {
namespace sparse24 {

struct Args24 {
  const void* a;       // [M, K], rows lda elements apart (16-byte aligned); fp16, or bf16 with `bf16`
  const void* b_q;     // int32 [K/32, 2N]
  const void* b_meta;  // int32 [K/32, N]
  const void* s;       // [groups, N], a's dtype
  const void* z = nullptr;  // zero points, b_scales' shape, dtype and layout; nullptr: symmetric (8)
  void* c;             // [M, N], a's dtype
  float* partial;      // fp32 [parts, M, N] when plan.parts > 1
  int* locks;          // plan.locks zeroed int32 arrival counters when plan.parts > 1 (left zeroed)
  int m, n, k;
  long long lda;
  bool bf16 = false;  // a, s and c are bfloat16 (else float16)
  int groups;  // 1: per column, else K / group size (128, 64 or 32; gemm_2_4_checks.h)
  int sms;
  int max_smem;  // opt-in shared memory per block
  bool pdl;       // launch with programmatic dependent launch (sm_90+; measured slower here, off by default)
  bool clusters;  // thread-block clusters can be launched (sm_90+)
  // the sparse wgmma instances may run: an sm_90a build on a compute capability 9.0 device, and
  // not MARLIN_2_4_WGMMA=0 (gemm_2_4_cuda.cpp); wgmma_force (MARLIN_2_4_WGMMA=1): wherever they
  // can, not only where plan_24's rule picks them
  bool wgmma = false;
  bool wgmma_force = false;
  bool wg_late = true;  // their late-refill variant (MARLIN_2_4_WG_LATE=0: early refill, for measurement)
  // tuning and diagnosis (gemm_2_4_cuda.cpp reads them from the environment): legacy = the first
  // kernel's plan (8-32-row slices, K parts by fill alone, added through global memory);
  // force_parts > 0: that many K parts (at most 16 and k-tiles / 2); force_tile_n > 0: tiles of
  // that many columns (128 or 256); force_ms > 0: that many warp slices of 32 rows per block
  // where M > 16 (1, 2, or 4 on the 128-column tile); cluster_mode: 0 never clusters, 1 wherever
  // they fit, -1 the planner's rule.
  bool legacy = false;
  int force_parts = 0;
  int force_tile_n = 0;
  int force_ms = 0;
  int force_stages = 0;  // 3: the 3-stage instances where they exist (1-16 rows, 256-column tile: mma.sync, sparse wgmma's 16-row slice)
  int force_kw = 0;      // 1 or 2: one or two K warpgroups per block on the late-refill wgmma instances (one warp slice); 0 the planner's rule
  bool wave8 = true;     // plan_24's three-part rule at 1-8 rows on many column tiles (MARLIN_2_4_WAVE8=0: the fill rule, for measurement)
  int cluster_mode = -1;
  // the prefill kernel's 2:4 instances (MARLIN_PREFILL, as for gemm): -1 its rule, 0 never, 1
  // wherever it can run (above 64 rows; for tests)
  int prefill = -1;
  int prefill_split = 0;  // MARLIN_PREFILL_SPLIT, as for gemm: > 0 every prefill tile in that many K parts, -1 stream-K
  int prefill_lead = -1;         // MARLIN_PREFILL_LEAD, as for gemm (GemmArgs::prefill_lead)
  bool prefill_fast_sum = true;  // MARLIN_PREFILL_FAST_SUM, as for gemm
  // MARLIN_PREFILL_ROWS, as for gemm: 128 or 256 forces the prefill kernel's tile height; 0 its
  // rule (prefill.h's prefill_pick_tile_m)
  int prefill_rows = 0;
};

struct Plan24 {
  int mb;      // n8 tiles per warp slice (8 mb rows)
  int nw;      // 64-column chunks per tile: 4, or 2 where N % 256 != 0
  int ms;      // warp slices per block slice (block slice = 8 mb ms rows; warps = nw ms)
  int wg;      // the sparse wgmma instances (sm_90a; nw = 4, mb 2, 4 or 8, ms 1 or 2): 1 early, 2 late refill; 0 mma.sync
  int kw;      // warpgroups along K per block (wg = 2, ms = 1: 1 or 2, plan_24's rule or MARLIN_2_4_KW; else 1)
  int stages;  // of the cp.async ring
  bool fine;   // the FINE kernel: groups of 64 or 32 rows, or zero points (scale rows per strip)
  int strip_shift;  // log2 of the 32-row strips per scale group (2: group 128 or per column)
  int parts;   // K parts per column tile (> 1: reduced in a cluster or through fp32 partials)
  bool cluster_reduce;  // the parts of a tile form one thread-block cluster
  int slices;  // block slices
  int grid;    // blocks: slices x column tiles x parts
  int smem;    // dynamic shared memory bytes (the instance's, plus fine plans' per-strip rows)
  long long partial_floats;  // parts * M * N when reduced through global memory, else 0
  int locks;                 // arrival counters needed (column tiles x slices) then, else 0
  // the prefill kernel (prefill/prefill_kernel.cuh, sm_90a) instead: grid persistent blocks,
  // smem bytes, and where a last round of few tiles runs in K parts (prefill_schedule) `parts`,
  // partial_floats and locks as above, for the tiles from split_first on
  bool prefill = false;
  int split_first = 0;
  int split_stages = 0;  // stages of each K-split part but the last (PrefillSchedule::split_stages)
  int tile_m = 256;  // the prefill kernel's activation rows per tile: 256 or 128
};

// Picks the slice size and the K split; an empty string, or why the shape cannot run.
std::string plan_24(const Args24& args, Plan24* plan);

// The plan in words (MARLIN_LOG_PLAN=1 prints it per call).
std::string describe_24(const Args24& args, const Plan24& plan);

// Launches the kernel on `stream`; returns the launch error, if any.
cudaError_t launch_24(const Args24& args, const Plan24& plan, cudaStream_t stream);

}  // namespace sparse24
}  // namespace marlin
