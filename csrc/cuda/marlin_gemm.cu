// Tile table, partition planning and the dispatch from a runtime configuration to one
// instantiated kernel. No torch headers: the host wrapper is gemm_cuda.cpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "marlin_gemm.h"
#include "marlin_instances.cuh"

namespace marlin {

namespace {


// Priority-ordered tile table: small batches want more blocks along K (more parallel streams of
// weights per column), larger ones want wide N tiles so that each A tile is reused 256 times.
constexpr TileConfig kSmallBatchTiles[] = {{128, 128}, {64, 256}};
constexpr TileConfig kLargeBatchTiles[] = {{64, 256}, {128, 128}};

// What the planner needs to know of one compiled kernel instance.
struct Instance {
  int blocks_per_sm;  // what its register budget allows
  int smem_bytes;
  int partial_floats;  // per split column
  cudaError_t (*launch)(const KernelParams&, int grid, int smem, cudaStream_t);
};

template <int TM, int TK, int TN, int G>
Instance make_instance() {
  using S = KernelShape<TM, TK, TN, kStages, G>;
  return Instance{kMinBlocksPerSm<TM>, S::kSmemBytes, S::kPartialFloats, &launch_instance<TM, TK, TN, G>};
}

// The instances that are compiled: m_blocks 1..4 x the two tiles x (group 128, per column).
bool find_instance(int m_blocks, TileConfig tile, bool grouped, Instance* out) {
#define MARLIN_TRY(TM, TK, TN)                                                                         \
  if (m_blocks == TM && tile.tile_k == 16 * TK && tile.tile_n == 16 * TN) {                            \
    *out = grouped ? make_instance<TM, TK, TN, kGroupBlocks128>() : make_instance<TM, TK, TN, -1>(); \
    return true;                                                                                       \
  }
#define MARLIN_TRY_TILES(TM) \
  MARLIN_TRY(TM, 8, 8)       \
  MARLIN_TRY(TM, 4, 16)
  MARLIN_TRY_TILES(1)
  MARLIN_TRY_TILES(2)
  MARLIN_TRY_TILES(3)
  MARLIN_TRY_TILES(4)
#undef MARLIN_TRY_TILES
#undef MARLIN_TRY
  return false;
}

std::string describe(const GemmArgs& a, TileConfig tile, int m_blocks) {
  // std::to_string, not ostream: see the note on message formatting in csrc/gemm_checks.h
  return "m=" + std::to_string(a.m) + " n=" + std::to_string(a.n) + " k=" + std::to_string(a.k) +
         " groups=" + std::to_string(a.groups) + " tile_k=" + std::to_string(tile.tile_k) +
         " tile_n=" + std::to_string(tile.tile_n) + " m_blocks=" + std::to_string(m_blocks);
}

}  // namespace

int max_locks(int sms) { return 2 * std::max(sms, 1); }

std::string plan_gemm(const GemmArgs& args, int tile_k, int tile_n, GemmPlan* plan) {
  const bool grouped = args.groups > 1;
  plan->m_blocks = std::min(4, (args.m + 15) / 16);
  plan->m_slices = (args.m + 16 * plan->m_blocks - 1) / (16 * plan->m_blocks);

  const bool forced = tile_k > 0 || tile_n > 0;
  const TileConfig* table = args.m <= 16 ? kSmallBatchTiles : kLargeBatchTiles;
  const int table_len = 2;
  std::string why;
  bool found = false;
  for (int i = 0; i < (forced ? 1 : table_len) && !found; i++) {
    const TileConfig t = forced ? TileConfig{tile_k, tile_n} : table[i];
    Instance inst;
    if (!find_instance(plan->m_blocks, t, grouped, &inst)) {
      why = "no kernel instance for tile_k=" + std::to_string(t.tile_k) + " tile_n=" + std::to_string(t.tile_n) +
            " (available: 128x128, 64x256)";
      continue;
    }
    if (args.k % t.tile_k != 0 || args.n % t.tile_n != 0) {
      why = "k=" + std::to_string(args.k) + " n=" + std::to_string(args.n) + " do not divide into tile_k=" +
            std::to_string(t.tile_k) + " x tile_n=" + std::to_string(t.tile_n);
      continue;
    }
    if (inst.smem_bytes > args.max_smem) {
      why = "tile needs " + std::to_string(inst.smem_bytes) + " bytes of shared memory, the device allows " +
            std::to_string(args.max_smem);
      continue;
    }
    plan->tile = t;
    plan->blocks_per_sm = std::min(inst.blocks_per_sm, std::max(1, args.max_smem_per_sm / std::max(1, inst.smem_bytes)));
    if (args.blocks_per_sm > 0) plan->blocks_per_sm = std::min(plan->blocks_per_sm, args.blocks_per_sm);
    plan->smem_bytes = inst.smem_bytes;
    plan->partial_floats = inst.partial_floats;
    found = true;
  }
  if (!found) return "marlin.gemm: no tile configuration fits (" + why + "); " + describe(args, TileConfig{tile_k, tile_n}, plan->m_blocks);

  const int k_tiles = args.k / plan->tile.tile_k;
  const int n_tiles = args.n / plan->tile.tile_n;
  const long long total = static_cast<long long>(plan->m_slices) * n_tiles * k_tiles;
  if (total >= (1LL << 31)) return "marlin.gemm: problem too large for 32-bit tile indices; " + describe(args, plan->tile, plan->m_blocks);
  // Two blocks per SM (where registers and shared memory allow) hide more latency on large
  // layers, but double the split columns and reductions; measured on an H200 it pays only when a
  // single block per SM would stream at least kTilesFor2PerSm tiles (benchmarks/NOTES.md).
  constexpr long long kTilesFor2PerSm = 64;
  if (plan->blocks_per_sm > 1 && total < kTilesFor2PerSm * args.sms) plan->blocks_per_sm = 1;
  const int blocks = static_cast<int>(std::min<long long>(static_cast<long long>(args.sms) * plan->blocks_per_sm, total));
  plan->tiles_per_block = static_cast<int>((total + blocks - 1) / blocks);
  plan->grid = static_cast<int>((total + plan->tiles_per_block - 1) / plan->tiles_per_block);
  // A column is split unless every stripe is a whole number of columns.
  plan->needs_partial = plan->tiles_per_block % k_tiles != 0;
  plan->partial_floats = plan->needs_partial ? plan->partial_floats * 2 * plan->grid : 0;
  return "";
}

std::string launch_gemm(const GemmArgs& args, const GemmPlan& plan, cudaStream_t stream) {
  KernelParams p;
  p.a = static_cast<const int4*>(args.a);
  p.b = static_cast<const int4*>(args.b_q);
  p.s = static_cast<const int4*>(args.scales);
  p.c = static_cast<half*>(args.c);
  p.partial = reinterpret_cast<float4*>(args.partial);
  p.locks = args.locks;
  p.m = args.m;
  p.n = args.n;
  p.k = args.k;
  p.lda_int4 = args.lda / 8;
  p.m_slices = plan.m_slices;
  p.tiles_per_block = plan.tiles_per_block;

  Instance inst;
  if (!find_instance(plan.m_blocks, plan.tile, args.groups > 1, &inst)) return "marlin.gemm: internal error, planned configuration has no kernel; " + describe(args, plan.tile, plan.m_blocks);
  const cudaError_t err = inst.launch(p, plan.grid, plan.smem_bytes, stream);
  if (err != cudaSuccess) {
    return std::string("marlin.gemm: kernel launch failed: ") + cudaGetErrorString(err) + "; " +
           describe(args, plan.tile, plan.m_blocks);
  }
  return "";
}

}  // namespace marlin
