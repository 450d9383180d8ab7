// Plan and launch of the 2:4-sparse kernel (marlin_24_kernel.cuh): slice size, K split, grid.
#include <algorithm>
#include <atomic>

#include "../dequant.cuh"
#include "../marlin_kernel.cuh"  // KernelParams, for the prefill kernel's launch
#include "../prefill/prefill.h"
#include "marlin_24.h"
#include "marlin_24_launch.h"

namespace marlin {
namespace sparse24 {
namespace {

// Fill of the GPU's resident block slots by `blocks` blocks in whole waves (a block streams its
// weights at about the same rate wherever it runs, so a partial last wave leaves SMs idle);
// below one block per SM, halved (fewer blocks than SMs is worse than any full wave).
double fill(long long blocks, long long slots, int sms) {
  const long long waves = (blocks + slots - 1) / slots;
  const double f = static_cast<double>(blocks) / static_cast<double>(waves * slots);
  return blocks < sms ? 0.5 * f : f;
}

// At 1-16 rows (mma.sync kernel, 256-column tile: the conditions are where plan_24 uses it) each
// block's weight stream is capped by its SM, so a grid that fits the resident slots runs as fast
// as its busiest SM: score it by how evenly the SMs hold its blocks, not by how many slots it
// fills. H100 (NOTES.md, 2026-11-27 night, forced parts at M = 1 / 8): 70B o 4 parts
// (128 blocks) 13.6 / 15.7 us against 12 (384, the slots' best fill) 15.7 / 18.9; 7B gate_up 3
// parts (258) 17.6 / 19.7 against 9 (774) 19.9 / 21.6; 7B down 8 parts (128) 10.5 / 12.4 against
// 16 / 13 (256 / 208) 11.3 / 15.8.
double balance(long long blocks, long long slots, int sms) {
  if (blocks > slots) return fill(blocks, slots, sms);
  const long long per_sm = (blocks + sms - 1) / sms;
  return static_cast<double>(blocks) / static_cast<double>(per_sm * sms);
}

// How many clusters of `parts` blocks the GPU can place with one block on each SM: the clusters
// of that size resident at once when each block asks for more than half an SM's shared memory.
// A property of the GPCs (H200: 66, 39, 30, about 22, 17, about 15, 15 for 2-8 blocks; its 132
// SMs do not all take clusters of 8 at one block each), asked once per device and size. 0 where
// the query fails (no cluster plan is then scored by placement).
int spread_clusters(const Instance& inst, int parts, int max_smem) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices][kMaxClusterParts + 1];  // count + 1; 0: not asked yet
  int dev = 0;
  if (parts < 2 || parts > kMaxClusterParts || cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return 0;
  const int k = known[dev][parts].load(std::memory_order_acquire);
  if (k > 0) return k - 1;
  const int n = inst.max_clusters(parts, std::min(max_smem, max_smem / 2 + 1024));
  known[dev][parts].store(n + 1, std::memory_order_release);
  return n;
}

// A plan's time in microseconds, as a sum of what sets it where the blocks' streams are short
// (few rows, or the FINE kernels' heavier stages): `stage` for each stage of a part, `shared_stage`
// more for each stage and each block on the busiest SM, `block` for each block there, and for the
// reduction through global memory (fence, arrival counter, the last block's reads) `global_sum`
// plus `global_rows` x rows x parts / k-tiles. Fitted by least squares on forced plans (probe_2_4,
// NOTES.md 2026-11-29 (eighteenth)); only the differences between plans of one call matter.
struct PlanCost {
  double stage, shared_stage, block, global_sum, global_rows;
  double operator()(long long stages, long long per_sm, bool global, int rows, int parts, int k_tiles) const {
    const double s = static_cast<double>(stages), b = static_cast<double>(per_sm);
    return stage * s + shared_stage * s * b + block * b +
           (global ? global_sum + global_rows * rows * parts / static_cast<double>(k_tiles) : 0.0);
  }
};
// group 128 / per column at 1-3 rows: 607 plans on 18 layers, then 72 more on six long-K ones;
// each layer left out of the fit in turn, its pick was within 5.2% of its best plan (2048 x 4096
// at 2 rows; 0.4% on average; benchmarks/fit_plan_cost_24.py)
constexpr PlanCost kLatencyCost{0.16, 0.34, 0.17, 1.03, 0.0};
// the FINE kernels (groups of 64 / 32, zero points) at 1-16 rows: 345 plans (group 64) on 13
// layers, timed on the loops without format branches; left-out layers' picks within 8.1% of the
// best (28672 x 4096 at 16 rows; 0.8% on average), where the constants fitted on the loops before
// lost 3.3% on average and up to 19% (13824 x 5120 at 16 rows)
constexpr PlanCost kFineCost{0.27, 0.36, 1.11, 0.47, 1.83};

// log2 of the 32-row strips per scale group: 2 for group 128 and per column (one scale row per
// stage), 1 for group 64, 0 for group 32 (gemm_2_4_checks.h admits no other group count).
int strip_shift(const Args24& args) {
  const int strips = args.groups > 1 ? std::max(1, std::min(kStrips, args.k / args.groups / 32)) : kStrips;
  return strips == 4 ? 2 : strips == 2 ? 1 : 0;
}

}  // namespace

// K parts and tile width, as measured on an H100 (benchmarks/NOTES.md, "kernel v2"): the parts
// that fill the resident slots best in whole waves (the fewest on a tie; each part at least 2
// stages), on the 256-column tile wherever N allows. Since the last block of a tile reads every
// part's fp32 partial (the tile's rows of it), parts are limited to parts^2 x rows <= 16 x
// k-tiles: without that limit 7B qkv at M = 32-64 took 11 parts and ran 1.7x slower than with
// 2-4; with 32 instead of 16, 70B o at M = 16 took 11 parts (27.6 us) where 8 took 21.9.
// The parts of a tile are reduced in a thread-block cluster (sm_90+, at most 8 parts, all
// clusters resident) from 16 rows on, where that measured faster than the global reduction
// (70B o M = 16-128: 8 parts 10-17% faster); below 16 rows it measured 0-40% slower.
// The wgmma instances above 16 rows take the most parts (at most 8, each at least 4 stages, all
// reduced in clusters) whose blocks still run in one wave of the resident (cluster) slots. Under
// the limit above their 64-row slices got 2 parts where they run 2 blocks per SM (7B qkv M = 64:
// 96 blocks on 132 SMs); the fill rule without it took 7-8 parts on the layers with many tiles,
// where 1-2 were faster (H100, forced parts: 70B gate_up M = 32 / 64 / 128 7 parts 137 / 209 /
// 478 us, 2 parts 105 / 156 / 315; 7B qkv M = 32 8 parts 22.2, 4 parts 17.5; 70B o M = 32 / 64
// 7 parts (one wave) 20.5 / 28.8, 4 parts 29.4 / 41.4, 8 (two waves of clusters) 30.6 / 42.7).
// The prefill kernel's 2:4 instances (sm_90a) above 64 rows, by the dense kernel's rule with a
// lower fill (prefill_pays, kPrefill24MinFill): the same 128-column tiles of 256 or 128 rows, persistent blocks, the sparse wgmma with its A operand
// (the compressed values) from registers. Every format but per-column zero points; not under the
// knobs that force a plan of the kernel below (they measure that kernel).
// The prefill kernel's tile height for this call (prefill_pick_tile_m's rule with the 2:4 model, in
// every format: 2:4 per column has not been probed apart; or MARLIN_PREFILL_ROWS: Args24::prefill_rows),
// or 0 where the kernel cannot take the call or does not pay (the planner asks once).
int prefill_tile_m(const Args24& args) {
  if (!args.wgmma || args.prefill == 0 || args.legacy || args.m <= 64) return 0;
  if (args.force_parts || args.force_tile_n || args.force_ms || args.force_stages || args.force_kw || args.wgmma_force ||
      args.cluster_mode != -1)
    return 0;
  if (args.n % kPrefillTileN != 0 || args.k % kPrefillTileK != 0 || (args.z != nullptr && args.groups == 1)) return 0;
  const int tile_m = prefill_pick_tile_m(args.m, args.n, args.k, args.sms, args.prefill_rows, PrefillRoundModel::kSparse24);
  if (prefill_24_smem_bytes(tile_m) > args.max_smem) return 0;
  return args.prefill == 1 || prefill_pays(args.m, args.n, args.k, args.sms, kPrefill24MinFill, tile_m) ? tile_m : 0;
}

// The 2:4 prefill instances of one tile height: [bf16][zero points][grouped]; per-column zero
// points never come here (prefill_tile_m refuses them).
template <int TILE_M>
struct Prefill24Instances {
  using Launch = cudaError_t (*)(const KernelParams&, const void*, int, int, cudaStream_t, bool);
  static constexpr Launch table[2][2][2] = {
      {{&launch_prefill_24<false, kU4, false, TILE_M>, &launch_prefill_24<false, kU4, true, TILE_M>},
       {nullptr, &launch_prefill_24<false, kU4Zp, true, TILE_M>}},
      {{&launch_prefill_24<true, kU4, false, TILE_M>, &launch_prefill_24<true, kU4, true, TILE_M>},
       {nullptr, &launch_prefill_24<true, kU4Zp, true, TILE_M>}}};
};

namespace {

// The stages of the ring of a plan's instance (marlin_24_instances.cuh): 3 for the late-refill
// wgmma's one 64-row warp slice (88 KB, so that 2 blocks share an SM); 3 for its 16-row slice where
// `wg_three` (the one-wave rule, or MARLIN_2_4_STAGES=3); 3 for the mma.sync 8- and 16-row slices of
// the 256-column tile where `mma_three` (the three-part rule at 1-8 rows, or MARLIN_2_4_STAGES=3); else
// kStages.
int ring_stages(const Plan24& p, bool wg_three, bool mma_three) {
  if (p.wg == 2 && p.kw == 1 && p.ms == 1 && p.mb == 8) return 3;
  if (p.wg == 2 && p.kw == 1 && p.mb == 2 && wg_three) return 3;
  if (!p.wg && p.nw == 4 && p.ms == 1 && p.mb <= 2 && mma_three) return 3;
  return kStages;
}

}  // namespace

std::string plan_24(const Args24& args, Plan24* plan) {
  if (args.n % 64 != 0) return "marlin.gemm_2_4: N = " + std::to_string(args.n) + " is not a multiple of 64";
  *plan = Plan24{};
  const int prefill_rows = prefill_tile_m(args);
  if (prefill_rows > 0) {
    plan->prefill = true;
    // the dense instances' schedule and K split of a last round of few tiles, the same kernel
    plan->tile_m = prefill_rows;
    const PrefillSchedule ps = prefill_schedule(args.m, args.n, args.k, args.sms, args.prefill_split, plan->tile_m, args.prefill_lead);
    plan->grid = ps.grid;
    plan->smem = prefill_24_smem_bytes(plan->tile_m);
    plan->parts = ps.parts;
    plan->split_first = ps.split_first;
    plan->split_stages = ps.split_stages;
    plan->partial_floats = ps.partial_floats;
    plan->locks = ps.locks;
    plan->strip_shift = strip_shift(args);
    plan->fine = plan->strip_shift < 2 || args.z != nullptr;
    return "";
  }
  // rows per warp slice: the smallest of 8, 16, 32 that holds M. One warp slice per block: two
  // (64-row block slices, each stage's weights read once for both) measured 8-10% faster on the
  // ideal layer at M = 64-128 but 20-40% slower on 70B o / gate_up / down (H100, NOTES.md).
  // The sparse wgmma (sm_90a) on the 256-column tile: warp slices of 16, 32 or 64 rows (the
  // smallest that holds M), one per block; above 16 rows, and at 9-16 rows where N >= 8192 (32
  // column tiles or more). H100 probes (NOTES.md, "the sparse wgmma"): faster than the mma.sync
  // kernel at 17-128 rows on the 8 Llama-2 layers and the ideal one wherever its K parts were
  // well chosen (the rule below came after), but for 7B down at 32-64 rows (2-10% slower); at
  // 9-16 rows 2-18% faster on the layers with N >= 8192, 0-6% slower at N = 4096 (7B o, down).
  // MARLIN_2_4_WGMMA=1 takes it wherever it can run.
  const bool wg_rule = args.wgmma_force || args.m > 16 || args.n >= 8192;
  const bool wg = args.wgmma && wg_rule && !args.legacy && args.m > 8 && args.n % 256 == 0 &&
                  (args.force_tile_n == 0 || args.force_tile_n == 256) && args.force_ms != 4;
  // late refill by default: on the H100 it was within 7% of early refill at 16-32 and 128 rows,
  // and 1.46-1.57x faster at 64 on 70B gate_up and the ideal layer (163 vs 257 us, 1189 vs 1736:
  // 3 stages, 2 blocks per SM)
  plan->wg = wg ? (args.wg_late ? 2 : 1) : 0;
  plan->kw = 1;
  if (plan->wg) {
    plan->mb = args.m <= 16 ? 2 : args.m <= 32 ? 4 : 8;
    // 64-row block slices above 64 rows too: two 64-row warp slices per block (each stage's
    // weights read once for 128 rows, but 1 block per SM) measured 0-20% slower than 64-row
    // slices at 2 blocks per SM on all 8 layers at M = 128 (H100, the same part rule;
    // MARLIN_2_4_WARP_SLICES=2 takes them)
    plan->ms = plan->mb == 8 && args.force_ms == 2 ? 2 : 1;
    // one or two K warpgroups per block: partition() below
  } else {
    plan->mb = args.m <= 8 ? 1 : args.m <= 16 ? 2 : 4;
    plan->ms = 1;
    if (args.force_ms > 0 && plan->mb == 4 && !args.legacy) plan->ms = args.force_ms;
  }
  if (args.n % 128 != 0) plan->ms = 1;  // the 64-column tile (below) has one warp slice
  const int rows = 8 * plan->mb * plan->ms;
  const int rows_used = std::min(rows, args.m);  // rows of a slice's partial that are read
  plan->slices = (args.m + rows - 1) / rows;
  const int k_tiles = args.k / kStageK;
  // 256-column tiles where N allows, else 128; N % 128 == 64 (a tensor-parallel shard of a
  // 128-multiple width, e.g. 11008 / 4 = 2752) takes one-warp 64-column tiles, one warp slice
  plan->nw = args.n % 256 == 0 && plan->ms != 4 ? 4 : args.n % 128 == 0 ? 2 : 1;
  if (args.force_tile_n > 0 && !plan->wg) {
    plan->nw = args.force_tile_n / 64;
    if ((plan->nw != 1 && plan->nw != 2 && plan->nw != 4) || args.n % args.force_tile_n != 0 ||
        (plan->ms == 4 && plan->nw == 4) || (plan->ms != 1 && plan->nw == 1))
      return "marlin.gemm_2_4: MARLIN_2_4_TILE_N = " + std::to_string(args.force_tile_n) + " cannot run N = " +
             std::to_string(args.n) + " with " + std::to_string(rows) +
             "-row slices (64, 128 or 256 dividing N; 128 for 128-row slices, 64 for one warp slice)";
  }
  // the FINE kernels (scales, and zero points, read per strip): groups of 64 or 32, or zero points
  // at any group size
  plan->strip_shift = strip_shift(args);
  plan->fine = plan->strip_shift < 2 || args.z != nullptr;
  const long long tiles = static_cast<long long>(args.n / (64 * plan->nw)) * plan->slices;
  if (tiles > (1LL << 30))
    return "marlin.gemm_2_4: M = " + std::to_string(args.m) + " x N = " + std::to_string(args.n) + " makes too many tiles (split the batch)";
  const bool locks_ok = tiles <= 2LL * args.sms;  // max_locks: 2 arrival counters per SM
  // K parts in clusters from 16-row slices on, where the placement rule below does not decide (it
  // weighs clusters against the global reduction for the even-SM plans on few column tiles, at
  // any row count): at 16 rows and more everywhere; at 9-15 rows (the 16-row slice, partly used)
  // where each part streams at most kShortPartStages stages. H200 (probe_2_4, NOTES.md
  // 2026-11-29), 12 rows, the 16-row plan in clusters against the parts through global memory:
  // 7B o 7.8 against 11.6 us, 7B qkv 12.2 against 17.3, 70B o 14.7 against 19.4, 5120 x 5120 and
  // 4096 x 6144 10-13% faster; but 7B down (11 stages a part) and 14336 x 4096 (14) 6% and 13%
  // slower, as at 1-8 rows, where the clusters lost wherever parts were long.
  // The FINE kernels on the sparse wgmma's 16-row slice keep clusters up to kShortPartStagesFine
  // stages a part. H200 (probe_2_4, NOTES.md 2026-11-29 (twentieth, twenty-first)), groups of 64 /
  // 32 and zero points at 9-12 rows, parts through global memory (the 8-stage line) against the
  // 16-row plan in clusters: 70B o (7 parts of 10 stages) 17.1-17.8 against 14.3-14.8 us, 5120 x
  // 15360 (4 of 10) 17.2-17.8 against 14.6-14.7, 14336 x 8192 (8 of 14) 21.2-22.0 against 20.5-21.0,
  // 70B qkv 17.9-18.7 against 17.3-17.6; 70B down (28-32 stages a part) 34.6-36.2 against 35.9-36.3.
  constexpr int kShortPartStages = 8, kShortPartStagesFine = 16;
  const int short_part = plan->wg && plan->fine ? kShortPartStagesFine : kShortPartStages;
  const bool clusters = !args.legacy && args.clusters && args.cluster_mode != 0 && (rows >= 16 || args.cluster_mode == 1);
  auto cluster_pays = [&](int parts) { return rows_used >= 16 || args.cluster_mode == 1 || k_tiles <= short_part * parts; };
  // the part limit below counts a 16-row slice's 16 rows at 9-15 rows too (its plan is then 16 rows')
  const int limit_rows = rows == 16 ? 16 : rows_used;
  const int max_parts = std::max(1, std::min(16, k_tiles / 2));
  const bool wg_parts = plan->wg && rows_used > 16 && clusters;  // the wgmma instances' part limit (above)
  // The same one-wave rule at 9-16 rows on layers of more than sms / 2 column tiles with K up to
  // kWaveMaxKTiles stages (the fill rule there took 7-8 parts in 4-6 waves), all parts in clusters
  // (at 9-15 rows too), on the 3-stage 16-row instance where that holds more parts in one wave:
  // always for the FINE kernels (their strip rows cost the 4-stage instance its third block on an
  // H200 SM; 3 stages keep 3), for group 128 / per column where one wave of the 4-stage instance
  // holds only one part (the 3-stage one runs 4 blocks per SM). H200 (probe_2_4, NOTES.md 2026-11-29
  // (twentieth)), 9-16 rows, group 128, the fill rule's plan against this one: 70B gate_up 65-69
  // us (7-8 parts) against 54-55 (3 stages, 2 parts), 5120 x 55296 41-45 against 36, 3584 x 37888
  // 23-24 against 22-23, 4096 x 28672 19-22 against 18-19; group 64: 70B gate_up 79-91 against
  // 67-69, 8192 x 49152 61-72 against 50-51, 7B gate_up 18-22 against 16. Long K (the ideal layer,
  // K = 135168) keeps the fill rule, whose deeper parts were measured there.
  constexpr int kWaveMaxKTiles = 128;
  const bool wg_wave = plan->wg == 2 && plan->mb == 2 && plan->ms == 1 && rows_used <= 16 && clusters &&
                       args.cluster_mode == -1 && 2 * tiles > args.sms && k_tiles <= kWaveMaxKTiles;
  const bool one_wave = wg_parts || wg_wave;
  // balance() above, for the group-128 / per-column kernels only: the FINE kernels (slower per
  // block: a scale row per strip) lost 13-50% with it on the large layers (H100, NOTES.md; on few
  // column tiles they are costed instead, below). Up to 16 rows on the mma.sync kernel (N < 8192
  // there): 7B down at 12 / 16 rows 8 parts (128 blocks) 15.3 / 17.0 us against the fill rule's 10 /
  // 9 parts through global memory 20.0 / 21.0. Not on the sparse wgmma at 9-16 rows: one block per
  // SM left it 1.1-1.5x slower on 70B o / qkv / down and the ideal layer (it runs 3 blocks per SM
  // and needs them to hide its loads). Only on the 256-column tile (four warps): the one-warp
  // 64-column tile of N % 128 = 64 needs several blocks per SM (4096 x 2752 at 9-16 rows: 3 parts,
  // 129 blocks, 11.0-14.5 us; 8 parts 7.6-11.2).
  const bool wide_tile = !plan->wg && plan->nw == 4 && rows_used <= 16 && !args.legacy;  // mma.sync, 256 columns, 1-16 rows
  const bool even_sms = wide_tile && !plan->fine;
  // Long K under balance(): one block per SM leaves too few bytes in flight on the H200 (4.8 TB/s
  // over 132 SMs). Where every part still streams kLongPartStages stages or more, balance() ties are
  // broken towards more parts, up to kLongBlocksPerSm blocks on every SM (the split end then costs
  // under 1% of a part). H200 (probe_2_4, NOTES.md): the ideal layer (135168 x 33792, 132 tiles) at
  // M = 1 / 4 / 8: 1 part 646 / 683 / 720 us, 3 parts 510 / 503 / 542; 70B down (224 stages a
  // column, 32 tiles) at 1-8 rows: 4 parts 33.4-36.1 us, 8 (28 stages each) 30.5-34.9.
  constexpr int kLongPartStages = 24, kLongBlocksPerSm = 3;
  // Placement (wide_tile plans, at most sms / 2 column tiles, no knob): the clusters of a tile's
  // parts and the global reduction both compete for every part count. The hardware puts a cluster's
  // blocks one per SM only while the clusters fit the GPCs that way (spread_clusters); beyond that
  // it stacks them on the same SMs, so a cluster plan scores by the blocks on its busiest SM. H200,
  // 16 column tiles (benchmarks/cluster_placement.cu, NOTES.md 2026-11-29 (seventeenth)): 6 parts
  // land one block per SM, 7 and 8 two (7B down at 16 rows: 6 parts 14.8 us, 7 17.8, 8 16.3). Group
  // 128 / per column from 4 rows on: the global reduction's last block reads every part's rows, a
  // cost that grows with the rows and with parts per stage of K: its score loses kGlobalSumCost x
  // rows x parts / k-tiles. Fitted on the H200 at 4-16 rows (the same notes): 7B down, 14336 x 4096,
  // 11008 x 5120, 28672 x 4096 (long K: global at 12-16 rows, 8 parts), 7B o, 5120 x 5120, 4096 x
  // 6144 (short K: clusters of 4-6 from 4 rows on, 7-20% faster than the rule before). A cluster
  // sums its parts in shared memory, so the part limit above (set by that last block's reads) binds
  // only the global plans here: 7B o at 12 / 16 rows takes 6 parts in clusters, 8.1 / 8.5 us where
  // the 5 that the limit allowed took 8.5 / 8.6 (forced, NOTES.md, eighteenth). More than sms / 2
  // column tiles: the rule above (clusters from 16 rows).
  constexpr double kGlobalSumCost = 0.3;
  constexpr int kPlacedMinRows = 4;
  // At 1-3 rows a block's time is mostly latency, not its SM's share of the stream; and the FINE
  // kernels (a scale row per strip) are slower per block at every row count. There every plan of
  // one wave is costed (PlanCost above: kLatencyCost, kFineCost) and the cheapest wins. H200
  // (NOTES.md, eighteenth): 5120 x 15360 at 1 row 4 parts in clusters 13.2 us where the fill rule
  // took 13 parts in two waves (17.7); 5120 x 5120 5 in clusters 7.4 (8.8); group 64 on 7B down at
  // 16 rows 8 parts global 19.5 (9, 23.4), 4096 x 6144 at 16 rows 8 in clusters 11.0 (5, 14.0).
  // At 1-3 rows (group 128 / per column) a global plan stacks blocks on an SM only where its parts
  // are long (kLongPartStages): 70B down at 1 / 3 rows 12 parts (3 blocks on an SM, 19 stages)
  // 31.9 / 33.6 us against 8 (2, 28) 30.4 / 31.2; 14336 x 4096 16 parts (2, 7 stages) 12.1 / 12.8
  // against 8 (1) 11.5 / 12.3.
  // 1-8 rows on the 256-column tile (mma.sync), group 128 or per column, on more than sms / 2 column
  // tiles with K up to kWaveMaxKTiles stages: three K parts through global memory on the 3-stage
  // instance (4 blocks per SM), not balance()'s 7-11 parts (6-12 blocks on every SM): there fewer,
  // longer streams with fewer partial sums were faster. H200 (probe_2_4, NOTES.md 2026-11-29
  // (thirtieth)), 1 / 4 / 8 rows, this plan against the fill rule's: 13B gate_up (108 tiles)
  // 21.5 / 22.3 / 24.0 against 25.2 / 27.0 / 27.3 us, 8192 x 28672 (112) 31.0 / 32.6 / 34.7
  // against 34.8 / 36.8 / 40.5, 70B gate_up (224) 2-3% faster, 7B gate_up (86) 1-3%; on the
  // 4-stage instance 1-8% slower than on 3 stages; Falcon-180B up (232 tiles, 116 stages) level.
  // Two parts were 25% slower than three on 70B gate_up; long K (the ideal layer, 1056 stages)
  // keeps the fill rule's deeper parts, measured there. MARLIN_2_4_WAVE8=0 keeps the fill rule.
  constexpr int kWave8Parts = 3;
  const bool forced_plan = args.force_parts || args.force_tile_n || args.force_ms || args.force_stages || args.cluster_mode != -1;
  const bool wave8 = args.wave8 && !forced_plan && args.force_kw == 0 && !args.wgmma_force && !plan->wg && plan->mb == 1 &&
                     plan->nw == 4 && plan->ms == 1 && !plan->fine && !args.legacy && 2 * tiles > args.sms &&
                     k_tiles <= kWaveMaxKTiles && locks_ok && max_parts >= kWave8Parts;
  const bool placed = wide_tile && 2 * tiles <= args.sms && args.clusters && args.cluster_mode == -1 && args.force_parts == 0;
  const bool costed = placed && (plan->fine || rows_used < kPlacedMinRows);

  // The instance of `kw` K warpgroups per block and its K parts (the rule above); an empty string,
  // or why the shape cannot run.
  auto partition = [&](int kw, bool three_stages) -> std::string {
    plan->kw = kw;
    plan->stages = ring_stages(*plan, args.force_stages == 3 || three_stages, args.force_stages == 3 || wave8);
    const Instance inst = find_instance(args.bf16, plan->fine, plan->mb, plan->nw, plan->ms, plan->stages, plan->wg, plan->kw);
    // groups of 64 or 32, or zero points: a scale row and a zero-point row per strip and stage after
    // the ring, without zero points one row of 8s (marlin_24_kernel.cuh, StageScales)
    const int fine_rows = plan->stages * kStrips + (args.z != nullptr ? plan->stages * kStrips : 1);
    plan->smem = inst.smem + (plan->fine ? fine_rows * inst.scale_row_bytes : 0);
    if (plan->smem > args.max_smem)
      return "marlin.gemm_2_4: the kernel needs " + std::to_string(plan->smem) + " bytes of shared memory per block, the device allows " +
             std::to_string(args.max_smem);
    const int per_sm = inst.blocks_per_sm(plan->smem);
    if (per_sm == 0) return "marlin.gemm_2_4: could not set up the kernel instance (cudaFuncSetAttribute / occupancy query failed)";
    const long long slots = static_cast<long long>(args.sms) * per_sm;
    int best = 1;
    bool best_cluster = false;
    double best_fill = -1.0, best_raw = -1.0, best_cost = -1.0;
    for (int parts = 1; parts <= max_parts; parts++) {
      const int forced = args.force_parts > 0 ? std::min(args.force_parts, max_parts) : wave8 ? kWave8Parts : 0;
      const bool over = one_wave ? parts > kMaxClusterParts || 4 * parts > k_tiles
                                 : static_cast<long long>(parts) * parts * limit_rows > 16LL * k_tiles;
      if (forced > 0 && parts != forced) continue;
      if (tiles * parts > 0x7fffffffLL) break;
      if (placed) {  // no knob: forced == 0
        const long long blocks = tiles * parts;
        // the blocks on the busiest SM of the cluster plan (0: no cluster plan)
        long long cluster_sm = 0;
        if (parts > 1 && parts <= kMaxClusterParts && inst.max_clusters(parts, plan->smem) >= tiles) {
          const int spread = spread_clusters(inst, parts, args.max_smem);
          if (spread > 0) cluster_sm = tiles <= spread ? 1 : (tiles + spread - 1) / spread;
        }
        const bool global_ok = parts == 1 || (locks_ok && !over);
        if (costed) {
          if (blocks > slots) break;  // one wave
          const long long stages = (k_tiles + parts - 1) / parts;
          const PlanCost& model = plan->fine ? kFineCost : kLatencyCost;
          auto take = [&](long long per_sm, bool cluster) {
            const bool global = parts > 1 && !cluster;
            // global plans that stack blocks on an SM ran slower than the model has them: more
            // than two (FINE, group 64: 70B down at 1-4 rows 12 parts 34.5-37.4 us, 8 parts
            // 31.6-33.5), and at 1-3 rows with group 128 two where the parts are short
            if (global && (per_sm > 2 || (!plan->fine && per_sm == 2 && stages < kLongPartStages))) return;
            const double cost = model(stages, per_sm, global, rows_used, parts, k_tiles);
            if (best_cost < 0.0 || cost < best_cost) best = parts, best_cluster = cluster, best_cost = cost;
          };
          if (cluster_sm > 0) take(cluster_sm, true);
          if (global_ok) take((blocks + args.sms - 1) / args.sms, false);
          continue;
        }
        const double raw = balance(blocks, slots, args.sms);
        auto consider = [&](double f, bool cluster) {
          const bool deeper = !cluster && parts > best && raw >= best_raw - 0.02 &&
                              k_tiles >= static_cast<long long>(parts) * kLongPartStages &&
                              blocks <= static_cast<long long>(kLongBlocksPerSm) * args.sms;
          if (f > best_fill + 0.02 || deeper) best = parts, best_cluster = cluster, best_fill = f, best_raw = raw;
        };
        if (cluster_sm > 0) consider(static_cast<double>(blocks) / static_cast<double>(cluster_sm * args.sms), true);
        if (global_ok) consider(parts == 1 ? raw : raw * (1.0 - kGlobalSumCost * rows_used * parts / k_tiles), false);
        continue;
      }
      if (forced == 0 && !args.legacy && parts > 1 && over) continue;
      bool cluster = false;
      long long cslots = slots;
      if (parts > 1 && clusters && parts <= kMaxClusterParts && (wg_wave || cluster_pays(parts))) {
        const int n_clusters = inst.max_clusters(parts, plan->smem);
        if (n_clusters > 0) cluster = true, cslots = std::min(slots, static_cast<long long>(n_clusters) * parts);
      }
      if (parts > 1 && !cluster && (!locks_ok || (one_wave && forced == 0))) continue;
      const double f = even_sms ? balance(tiles * parts, cslots, args.sms) : fill(tiles * parts, cslots, args.sms);
      const bool deeper = even_sms && parts > best && f >= best_fill - 0.02 &&
                          k_tiles >= static_cast<long long>(parts) * kLongPartStages &&
                          tiles * parts <= static_cast<long long>(kLongBlocksPerSm) * args.sms;
      const bool take = forced > 0 || (one_wave ? parts == 1 || tiles * parts <= cslots : f > best_fill + 0.02 || deeper);
      if (take) best = parts, best_cluster = cluster, best_fill = f;
    }
    if (args.force_parts > 0 && best != std::min(args.force_parts, max_parts))
      return "marlin.gemm_2_4: MARLIN_2_4_PARTS = " + std::to_string(args.force_parts) + " cannot run this shape (" +
             std::to_string(tiles) + " tiles: more than the arrival counters and no cluster)";
    plan->parts = best;
    plan->cluster_reduce = best > 1 && best_cluster;
    return "";
  };

  // two K warpgroups per block (late refill, one warp slice): MARLIN_2_4_KW=2, and by default
  // where one warpgroup's K parts stop at the cluster limit (kMaxClusterParts) although more
  // would still fit the resident slots: few column tiles, whose blocks then leave SMs short of
  // warps. H200 (probe_2_4, NOTES.md 2026-11-29), 17-64 rows, 8 parts of one warpgroup against
  // two warpgroups: 7B o 9.4-13.4 against 8.9-11.6 us, 7B down 17.8-23.7 against 14.6-19.4,
  // 14336 x 4096, 5120 x 5120 and 4096 x 6144 too; where the slots stop the parts first (7B qkv
  // 4 parts, 70B o 7, 70B qkv 5) two warpgroups ran 5-30% slower.
  const bool kw2_ok = plan->wg == 2 && plan->ms == 1;
  const int kw = kw2_ok && args.force_kw == 2 ? 2 : 1;
  std::string why = partition(kw, wg_wave && plan->fine);
  if (!why.empty()) return why;
  if (wg_wave && kw == 1 && !plan->fine && plan->parts == 1 && args.force_stages == 0) {  // the 3-stage instance's wave
    const Plan24 four = *plan;
    why = partition(1, true);
    if (!why.empty()) return why;
    if (plan->parts == 1) *plan = four;  // one part either way: the 4-stage instance
  }
  if (kw2_ok && args.force_kw == 0 && !forced_plan && wg_parts && plan->parts == kMaxClusterParts && plan->cluster_reduce) {
    why = partition(2, false);
    if (!why.empty()) return why;
  }
  plan->grid = static_cast<int>(tiles * plan->parts);
  const bool global = plan->parts > 1 && !plan->cluster_reduce;
  plan->partial_floats = global ? static_cast<long long>(plan->parts) * args.m * args.n : 0;
  plan->locks = global ? static_cast<int>(tiles) : 0;
  return "";
}

std::string describe_24(const Args24& args, const Plan24& plan) {
  if (plan.prefill)
    return "m=" + std::to_string(args.m) + " n=" + std::to_string(args.n) + " k=" + std::to_string(args.k) +
           " groups=" + std::to_string(args.groups) + " kernel=prefill_wgmma tile_m=" + std::to_string(plan.tile_m) +
           " grid=" + std::to_string(plan.grid) +
           " parts=" + std::to_string(plan.parts) + " split_first=" + std::to_string(plan.split_first) + " split_stages=" + std::to_string(plan.split_stages) +
           " zeros=" + (args.z != nullptr ? "1" : "0");
  return "m=" + std::to_string(args.m) + " n=" + std::to_string(args.n) + " k=" + std::to_string(args.k) +
         " groups=" + std::to_string(args.groups) + " slice_rows=" + std::to_string(8 * plan.mb * plan.ms) +
         " mb=" + std::to_string(plan.mb) + " ms=" + std::to_string(plan.ms) + " stages=" + std::to_string(plan.stages) + " tile_n=" + std::to_string(64 * plan.nw) +
         " parts=" + std::to_string(plan.parts) + " cluster=" + (plan.cluster_reduce ? "1" : "0") +
         " grid=" + std::to_string(plan.grid) + " pdl=" + (args.pdl && !args.legacy ? "1" : "0") + " wgmma=" + std::to_string(plan.wg) + " kw=" + std::to_string(plan.kw) +
         " fine=" + (plan.fine ? "1" : "0") + (args.legacy ? " legacy" : "");
}

cudaError_t launch_24(const Args24& args, const Plan24& plan, cudaStream_t stream) {
  if (plan.prefill) {
    KernelParams kp{};
    kp.a = static_cast<const int4*>(args.a);
    kp.b = static_cast<const int4*>(args.b_q);
    kp.s = static_cast<const int4*>(args.s);
    kp.z = static_cast<const int4*>(args.z);
    kp.c = args.c;
    kp.m = args.m;
    kp.n = args.n;
    kp.k = args.k;
    kp.lda_int4 = args.lda / 8;
    kp.split_parts = plan.parts;
    kp.split_first = plan.split_first;
    kp.split_stages = plan.split_stages;
    kp.fast_sum = args.prefill_fast_sum;
    kp.partial = reinterpret_cast<float4*>(args.partial);
    kp.locks = args.locks;
    // log2 of the group size in k16 blocks (as gemm's): group = K / groups of 32, 64 or 128 rows
    int group_shift = 3;
    if (args.groups > 1)
      for (group_shift = 1; (16 << group_shift) < args.k / args.groups; group_shift++) {
      }
    kp.group_shift = group_shift;
    const auto& instances = plan.tile_m == kPrefillTileMShort ? Prefill24Instances<kPrefillTileMShort>::table
                                                              : Prefill24Instances<kPrefillTileM>::table;
    const auto launch = instances[args.bf16][args.z != nullptr][args.groups > 1];
    return launch(kp, args.b_meta, plan.grid, plan.smem, stream, args.pdl);
  }
  Params p;
  p.a = static_cast<const int4*>(args.a);
  p.b_q = static_cast<const int4*>(args.b_q);
  p.b_meta = static_cast<const int4*>(args.b_meta);
  p.s = static_cast<const int4*>(args.s);
  p.c = args.c;
  p.partial = args.partial;
  p.m = args.m;
  p.n = args.n;
  p.k = args.k;
  p.lda_int4 = args.lda / 8;
  p.groups = args.groups;
  p.strip_shift = plan.strip_shift;
  p.z = static_cast<const int4*>(args.z);
  p.parts = plan.parts;
  p.cluster_reduce = plan.cluster_reduce;
  p.locks = args.locks;
  const Instance inst = find_instance(args.bf16, plan.fine, plan.mb, plan.nw, plan.ms, plan.stages, plan.wg, plan.kw);
  return inst.launch(p, plan.grid, plan.smem, stream, args.pdl && !args.legacy, plan.cluster_reduce ? plan.parts : 1);
}

}  // namespace sparse24
}  // namespace marlin
