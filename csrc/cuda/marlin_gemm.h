// Plain C++ interface between the torch host wrapper (gemm_cuda.cpp) and the CUDA kernels
// (marlin_gemm.cu). No torch headers here, so that nvcc can compile-check the kernels alone.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

namespace marlin {

// One entry of the tile table: a block computes a (16 * m_blocks) x (16 * tile_n) piece of C,
// streaming (16 * tile_k) rows of K per pipeline stage.
struct TileConfig {
  int tile_k;  // rows of K per stage: 128 or 64
  int tile_n;  // columns of N per block: 128 or 256; 256 or 512 for the small-batch kernel
};

struct GemmArgs {
  const void* a;        // fp16 or bf16 [m, k], rows lda elements apart, 16-byte aligned
  const void* b_q;      // int32 [k / 16, 2 n] (4-bit) or [k / 16, 4 n] (8-bit), Marlin layout (marlin/packing.py)
  const void* scales;   // [groups, n], a's dtype
  const void* zeros = nullptr;  // 4-bit zero points, scales' shape, dtype and layout; null: symmetric
  void* c;              // [m, n], a's dtype, contiguous
  bool bf16 = false;    // element type of a, scales, zeros, c: bf16, else fp16
  int bits = 4;         // 4 or 8
  float* partial;       // fp32 reduction slots, plan.partial_floats of them (null when unused)
  int* locks;           // int32 arrival counters, >= grid entries, all zero; left all zero on return
  int m, n, k;
  long long lda;        // row stride of a, in halves (multiple of 8)
  int groups;           // rows of scales: 1 (per column) or k / group size (32, 64, 128)
  int sms;              // multiprocessors of the device
  double dram_gbps = 0;  // peak DRAM bandwidth of the device, GB/s (memory clock x bus width; 0: unknown)
  int max_smem;         // opt-in shared memory per block of the device, bytes
  int max_smem_per_sm;  // shared memory per multiprocessor, bytes
  int blocks_per_sm;    // cap on resident blocks per multiprocessor; <= 0: as many as fit
  bool wgmma = false;   // the sm_90a (wgmma) small-batch instances may run: built, and a 9.0 device
  // Programmatic dependent launch (sm_90+): a call may start while the previous kernel in the
  // stream finishes; the kernels wait for it before reading anything (ptx.cuh).
  bool pdl = false;
  // Split-column partition of the small-batch kernel: 0 stream-K stripes only; 1 split parts
  // where no block streams more tiles than with stripes, in clusters where they fit (sm_90+);
  // probes: 2 split parts wherever possible, in clusters where they fit; 3 the same, never in clusters.
  int split_mode = 0;
  bool clusters = false;  // thread-block clusters can be launched (sm_90+)
  // Where a column's split parts do not all fit as resident clusters: fewer parts per column
  // that do (true), or the planned parts reduced through global memory (false; probes, tests).
  bool cluster_fit = true;
  int max_split_parts = 0;  // cap on split parts per column (probes); <= 0: none
  // Rows per slice of the wgmma variant above 64 rows: 0 the planner's choice; 64 or 128 forced
  // (probes, tests).
  int wg_slice_rows = 0;
  // The wgmma variant's tile for fp16 group 128: 0 the planner's choice (narrow_tile_where_it_pays
  // in marlin_gemm.cu); 128 the 128-column tile wherever it can run, 256 never (probes, tests)
  int wg_tile_n = 0;
  // fp16 group 128 at 9-16 rows on the wgmma variant (16-row slice): the 128-column tile held to
  // 128 registers, two blocks per SM (true: narrow_tile_where_it_pays's 16-row rule, and what
  // wg_tile_n = 128 takes there), or the 256-column plan and the one-block 128-column instance
  // under wg_tile_n = 128 (false; probes)
  bool wg16_narrow_two = true;
  // fp16 group 128 on the wgmma variant's 16-row slices: the run-time-group instance (true) or the
  // group-sum one (false); see g128_as_runtime_group in marlin_gemm.cu
  bool g128_runtime_group = true;
  // zero points (fp16, bf16) and bf16 symmetric INT4 in groups of 128, and 4-bit groups of 64 / 32
  // (one-block plans), on the 8-row mma.sync slice: the raw group-sum instances (true) or the
  // run-time-group ones that dequantize and scale every weight (false; probes, tests)
  bool group_sums = true;
  // zero points (fp16, bf16) in groups of 128 on the wgmma slices: the instances with the group
  // size fixed at 128 (true; fixed_g128_instance in marlin_gemm.cu), or
  // the run-time-group ones that groups of 64 / 32 run (false; probes, tests)
  bool fmt_fixed_g128 = true;
  // the 8-row mma.sync instances built for one block per SM (no 128-register bound: the base
  // format's 256-column ones and the group-sum ones of the others) where the plan keeps one block
  // per SM (true), or always the two-block ones (false; probes, tests)
  bool one_block_regs = true;
  // layers under 80 KB of weights per SM at 9-64 rows (wgmma): the small-batch kernel where its
  // split columns reduce in clusters (true), or always the tiled kernel (false; probes, tests)
  bool small_layer_clusters = true;
  // The warp-specialized prefill kernel (prefill/prefill_kernel.cuh; sm_90a, fp16 group 128 or per
  // column): -1 the planner's rule, 0 never, 1 wherever it can run above 64 rows (probes, tests).
  int prefill = -1;
  int prefill_split = 0;  // > 0: the prefill kernel's K split in this many parts, -1 stream-K over every tile (MARLIN_PREFILL_SPLIT; probes)
  // The K split's last part: stages more than each other part (MARLIN_PREFILL_LEAD; -1 prefill.h's
  // kPrefillSplitLead, 0 equal parts), and whether it adds the others' partials to its own when
  // they are all in (MARLIN_PREFILL_FAST_SUM=0: never; the same sum bit for bit; tests)
  int prefill_lead = -1;
  bool prefill_fast_sum = true;
  // MARLIN_PREFILL_ROWS: 128 or 256 forces the prefill kernel's tile height (probes); 0 its rule
  // (prefill.h's prefill_pick_tile_m)
  int prefill_rows = 0;
};

// What plan() decided: printed in errors and benchmarks.
struct KernelParams;  // marlin_kernel.cuh
// Launches one compiled kernel instance: grid and dynamic shared memory, PDL, cluster size.
using LaunchFn = cudaError_t (*)(const KernelParams&, int grid, int smem, cudaStream_t, bool pdl, int cluster);

struct GemmPlan {
  TileConfig tile{0, 0};
  bool small_m = false;  // the small-batch kernel (smallm_kernel.cuh) rather than marlin_kernel.cuh
  bool wgmma = false;    // its sm_90a variant (warpgroup mma; slices of up to 128 rows)
  bool prefill = false;  // the warp-specialized prefill kernel (prefill/prefill_kernel.cuh) instead of either
  bool group_sums = false;  // small_m, a format other than the base one: scales and zero points on raw group sums (SmallMShape::kFmtSums)
  bool fixed_g128 = false;  // small_m wgmma, a format other than the base one: the fixed-group-128 instance (fixed_g128_instance)
  bool one_block_regs = false;  // small_m, 8-row slice: the instance built for one block per SM (no 128-register bound)
  int m_blocks = 0;      // rows of M per slice: 16 * m_blocks, or 8 * m_blocks for small_m
  int m_slices = 0;      // slices of M
  int blocks_per_sm = 1;
  int grid = 0;          // blocks launched
  int tiles_per_block = 0;
  int smem_bytes = 0;
  int split_parts = 0;          // small_m: > 0 = each column in this many parts, one block each
  int split_first = 0;          // prefill: the tiles from this one on are split in split_parts
  int split_stages = 0;         // prefill: stages of each K-split part but the last (0: equal parts)
  bool cluster_reduce = false;  // ... one cluster per column, reduced in distributed shared memory
  bool needs_partial = false;  // some column of tiles is split over blocks, reduced through global memory
  std::size_t partial_floats = 0;
  int locks = 0;  // lock counters the kernel may touch (one per block of a stream-K plan); 0: none
  // The kernel instance the planner chose (its launch function): the launch runs exactly this one,
  // with no second look-up that could pick another (e.g. the group mode of an fp16 group-128 call).
  LaunchFn launch = nullptr;
};

// Picks the tile configuration and partition. tile_k/tile_n <= 0 means "choose from the table".
// Returns an empty string on success, else a message naming what is unsupported.
std::string plan_gemm(const GemmArgs& args, int tile_k, int tile_n, GemmPlan* plan);

// One line naming the kernel, tile and partition of a plan (MARLIN_LOG_PLAN=1 prints it per call).
std::string describe_plan(const GemmArgs& args, const GemmPlan& plan);

// Launches the planned kernel on `stream`. Returns an empty string or an error message.
std::string launch_gemm(const GemmArgs& args, const GemmPlan& plan, cudaStream_t stream);

// Whether this build contains the sm_90a (wgmma) kernels: setup.py defines MARLIN_SM90A when
// TORCH_CUDA_ARCH_LIST names 9.0a.
constexpr bool kBuiltWithSm90a =
#ifdef MARLIN_SM90A
    true;
#else
    false;
#endif

// The lock counters the kernel may use: one per block, at most this many (2 blocks per SM).
int max_locks(int sms);

// Zeroed lock counters owned by (device, stream), for calls without a workspace (stream_locks.cu):
// at least `needed` of them, or null when none is free (then the caller allocates a zeroed buffer).
// Call with `device` current.
int* stream_locks(int device, cudaStream_t stream, int needed);

}  // namespace marlin
