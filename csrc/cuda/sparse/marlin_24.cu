// Plan and launch of the 2:4-sparse kernel (marlin_24_kernel.cuh): slice size, K split, grid.
#include <algorithm>
#include <atomic>

#include "../launch_attr.cuh"
#include "marlin_24.h"
#include "marlin_24_kernel.cuh"

namespace marlin {
namespace sparse24 {
namespace {

constexpr int kStages = 4;

// One compiled instance: its launch, shared memory, threads, and (once per device) its resident
// blocks per SM and resident clusters.
struct Instance {
  int smem;
  int threads;
  int (*blocks_per_sm)(int smem);
  int (*max_clusters)(int cluster, int smem);
  cudaError_t (*launch)(const Params& p, int grid, int smem, cudaStream_t stream, bool pdl, int cluster);
};

template <int MB, int NW, int MS>
SmemAttrCache& cache() {
  static SmemAttrCache c;
  return c;
}

// Resident blocks per SM (registers and shared memory), at least 1; 0 if the queries failed.
template <int MB, int NW, int MS>
int blocks_per_sm(int smem) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices];  // 0: not yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (device >= 0 && device < kMaxDevices && known[device].load() > 0) return known[device].load();
  auto kernel = marlin_24_kernel<MB, NW, MS, kStages>;
  int blocks = 0;
  if (cache<MB, NW, MS>().ensure(reinterpret_cast<const void*>(kernel), smem) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, Shape<MB, NW, MS>::kThreads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  blocks = std::max(blocks, 1);
  if (device >= 0 && device < kMaxDevices) known[device].store(blocks);
  return blocks;
}

template <int MB, int NW, int MS>
int max_clusters(int cluster, int smem) {
  return cache<MB, NW, MS>().max_clusters(marlin_24_kernel<MB, NW, MS, kStages>, cluster, Shape<MB, NW, MS>::kThreads, smem);
}

template <int MB, int NW, int MS>
cudaError_t launch(const Params& p, int grid, int smem, cudaStream_t stream, bool pdl, int cluster) {
  return launch_kernel(marlin_24_kernel<MB, NW, MS, kStages>, cache<MB, NW, MS>(), p, grid, Shape<MB, NW, MS>::kThreads, smem,
                       stream, pdl, cluster);
}

template <int MB, int NW, int MS>
Instance make() {
  return Instance{kStages * Shape<MB, NW, MS>::kStageInt4 * 16, Shape<MB, NW, MS>::kThreads, &blocks_per_sm<MB, NW, MS>,
                  &max_clusters<MB, NW, MS>, &launch<MB, NW, MS>};
}

// The compiled instances: MB 1, 2, 4 x NW 2, 4; at MB 4 also two warp slices (64-row block
// slices), and four on the 128-column tile (128 rows, 8 warps; four would exceed the registers
// of an SM on the 256-column tile).
Instance find(int mb, int nw, int ms) {
#define MARLIN_24_TRY(MB, NW, MS) \
  if (mb == MB && nw == NW && ms == MS) return make<MB, NW, MS>();
  MARLIN_24_TRY(1, 4, 1)
  MARLIN_24_TRY(2, 4, 1)
  MARLIN_24_TRY(4, 4, 1)
  MARLIN_24_TRY(4, 4, 2)
  MARLIN_24_TRY(1, 2, 1)
  MARLIN_24_TRY(2, 2, 1)
  MARLIN_24_TRY(4, 2, 1)
  MARLIN_24_TRY(4, 2, 2)
  MARLIN_24_TRY(4, 2, 4)
#undef MARLIN_24_TRY
  return make<4, 2, 1>();  // not reached: plan_24 asks only for the ones above
}

// The first kernel's K split (legacy plan): parts so that the blocks fill the resident slots in
// whole waves, the fewest on a tie; each part at least 2 stages; only where the tiles fit the
// arrival counters.
int legacy_parts(long long base, int k_tiles, long long slots, int sms) {
  int best = 1;
  double best_fill = 0.0;
  for (int parts = 1; parts <= (base <= 2LL * sms ? std::min(16, k_tiles) : 1); parts++) {
    if (parts > 1 && k_tiles / parts < 2) break;
    const long long blocks = base * parts;
    const long long waves = (blocks + slots - 1) / slots;
    double fill = static_cast<double>(blocks) / static_cast<double>(waves * slots);
    if (blocks < sms) fill *= 0.5;
    if (fill > best_fill + 0.02) best = parts, best_fill = fill;
  }
  return best;
}

// Estimated time of a plan, in units of one SM streaming one 256-column stage (48 bytes per
// column: values and metadata) at its full share of the memory bandwidth (a prediction; see
// benchmarks/NOTES.md for what it gave). Streaming: the waves, times the blocks each SM holds in
// a wave, times the stages of the longest part; one block alone on an SM is assumed to reach 0.8
// of the SM's share (its 3 stages in flight barely cover the memory latency). Reduction:
// through global memory the last block of a tile reads every part's fp32 partial (rows x tile
// columns x 4 bytes each) at about the rate it streams weights; in a cluster each block reads
// 1/parts of that from distributed shared memory, plus about half a stage for the barriers.
double plan_cost(long long tiles, int parts, int k_tiles, int sms, long long slots, int rows, bool cluster, int nw) {
  const long long blocks = tiles * parts;
  const long long waves = (blocks + slots - 1) / slots;
  const long long per_sm = (std::min(blocks, slots) + sms - 1) / sms;
  double t = static_cast<double>(waves * per_sm) * ((k_tiles + parts - 1) / parts) / (per_sm == 1 ? 0.8 : 1.0);
  if (parts > 1) {
    const double read = static_cast<double>(rows) * 4.0 / 48.0;  // one part's partial, in stages
    t += cluster ? 0.5 * read + 0.5 : read * parts;
  }
  return t * nw / 4.0;
}

}  // namespace

std::string plan_24(const Args24& args, Plan24* plan) {
  if (args.n % 128 != 0) return "marlin.gemm_2_4: N = " + std::to_string(args.n) + " is not a multiple of 128";
  // rows per warp slice: the smallest of 8, 16, 32 that holds M; above 32 rows two warp slices
  // per block (64 rows), so that a stage's weights are read once for both
  plan->mb = args.m <= 8 ? 1 : args.m <= 16 ? 2 : 4;
  plan->ms = args.m > 32 && !args.legacy ? 2 : 1;
  if (args.force_ms > 0 && plan->mb == 4 && !args.legacy) plan->ms = args.force_ms;
  const int rows = 8 * plan->mb * plan->ms;
  plan->slices = (args.m + rows - 1) / rows;
  const int k_tiles = args.k / kStageK;
  const bool clusters = args.clusters && !args.clusters_off && !args.legacy;
  double best_t = 0.0;
  plan->nw = 0;
  // tile: 256 columns (legacy: wherever N allows) or 128 (more tiles where there are few)
  for (int nw : {4, 2}) {
    if (args.n % (64 * nw) != 0 || (args.force_tile_n > 0 && args.force_tile_n != 64 * nw)) continue;
    if (plan->ms == 4 && nw == 4) continue;  // not compiled (see find)
    if (args.legacy && plan->nw != 0) break;
    const Instance inst = find(plan->mb, nw, plan->ms);
    if (inst.smem > args.max_smem)
      return "marlin.gemm_2_4: the kernel needs " + std::to_string(inst.smem) + " bytes of shared memory per block, the device allows " +
             std::to_string(args.max_smem);
    const long long tiles = static_cast<long long>(args.n / (64 * nw)) * plan->slices;
    if (tiles > (1LL << 30))
      return "marlin.gemm_2_4: M = " + std::to_string(args.m) + " x N = " + std::to_string(args.n) + " makes too many tiles (split the batch)";
    const int per_sm = inst.blocks_per_sm(inst.smem);
    if (per_sm == 0) return "marlin.gemm_2_4: could not set up the kernel instance (cudaFuncSetAttribute / occupancy query failed)";
    const long long slots = static_cast<long long>(args.sms) * per_sm;
    const bool locks_ok = tiles <= 2LL * args.sms;  // max_locks: 2 arrival counters per SM
    if (args.legacy) {
      plan->nw = nw, plan->parts = legacy_parts(tiles, k_tiles, slots, args.sms), plan->cluster_reduce = false;
      break;
    }
    // among 1..16 parts (8 in clusters), each at least 2 stages, the cheapest by plan_cost
    for (int parts = 1; parts <= std::max(1, std::min(16, k_tiles / 2)); parts++) {
      if (args.force_parts > 0 && parts != std::min(args.force_parts, std::max(1, std::min(16, k_tiles / 2)))) continue;
      if (tiles * parts > 0x7fffffffLL) break;
      bool cluster = false;
      long long cslots = slots;
      if (parts > 1 && clusters && parts <= kMaxClusterParts) {
        const int n_clusters = inst.max_clusters(parts, inst.smem);
        if (n_clusters > 0) cluster = true, cslots = std::min(slots, static_cast<long long>(n_clusters) * parts);
      }
      if (parts > 1 && !cluster && !locks_ok) continue;
      const double t = plan_cost(tiles, parts, k_tiles, args.sms, cslots, rows, cluster, nw);
      if (plan->nw == 0 || t < best_t * 0.98)
        best_t = t, plan->nw = nw, plan->parts = parts, plan->cluster_reduce = cluster;
    }
  }
  if (plan->nw == 0) return "marlin.gemm_2_4: no plan for " + std::to_string(args.n) + " columns (check MARLIN_2_4_PARTS and MARLIN_2_4_TILE_N)";
  plan->smem = find(plan->mb, plan->nw, plan->ms).smem;
  const long long tiles = static_cast<long long>(args.n / (64 * plan->nw)) * plan->slices;
  plan->grid = static_cast<int>(tiles * plan->parts);
  const bool global = plan->parts > 1 && !plan->cluster_reduce;
  plan->partial_floats = global ? static_cast<long long>(plan->parts) * args.m * args.n : 0;
  plan->locks = global ? static_cast<int>(tiles) : 0;
  return "";
}

std::string describe_24(const Args24& args, const Plan24& plan) {
  return "m=" + std::to_string(args.m) + " n=" + std::to_string(args.n) + " k=" + std::to_string(args.k) +
         " groups=" + std::to_string(args.groups) + " slice_rows=" + std::to_string(8 * plan.mb * plan.ms) +
         " mb=" + std::to_string(plan.mb) + " ms=" + std::to_string(plan.ms) + " tile_n=" + std::to_string(64 * plan.nw) +
         " parts=" + std::to_string(plan.parts) + " cluster=" + (plan.cluster_reduce ? "1" : "0") +
         " grid=" + std::to_string(plan.grid) + " pdl=" + (args.pdl && !args.legacy ? "1" : "0") + (args.legacy ? " legacy" : "");
}

cudaError_t launch_24(const Args24& args, const Plan24& plan, cudaStream_t stream) {
  Params p;
  p.a = static_cast<const int4*>(args.a);
  p.b_q = static_cast<const int4*>(args.b_q);
  p.b_meta = static_cast<const int4*>(args.b_meta);
  p.s = static_cast<const int4*>(args.s);
  p.c = static_cast<half*>(args.c);
  p.partial = args.partial;
  p.m = args.m;
  p.n = args.n;
  p.k = args.k;
  p.lda_int4 = args.lda / 8;
  p.groups = args.groups;
  p.parts = plan.parts;
  p.cluster_reduce = plan.cluster_reduce;
  p.locks = args.locks;
  const Instance inst = find(plan.mb, plan.nw, plan.ms);
  return inst.launch(p, plan.grid, plan.smem, stream, args.pdl && !args.legacy, plan.cluster_reduce ? plan.parts : 1);
}

}  // namespace sparse24
}  // namespace marlin
