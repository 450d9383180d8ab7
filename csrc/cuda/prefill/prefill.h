// The prefill kernel's launch entry points (prefill_kernel.cuh), for the planner (marlin_gemm.cu).
#pragma once

#include <cuda_runtime.h>

namespace marlin {

struct KernelParams;

// What the planner needs of the kernel: its tile and shared memory (prefill_kernel.cuh's PrefillShape).
constexpr int kPrefillTileN = 128;
constexpr int kPrefillTileM = 256;
constexpr int kPrefillTileK = 64;
// Every instance also comes with tiles of 128 activation rows (the wgmma N): for 65-255 rows,
// where a 256-row tile is half empty, and for layers whose 256-row tiles leave SMs idle
// (prefill_pick_tile_m).
constexpr int kPrefillTileMShort = 128;
int prefill_smem_bytes(int bits, int tile_m = kPrefillTileM);  // bits of the packed weights: 4 or 8
int prefill_24_smem_bytes(int tile_m);   // the 2:4 instances' (tile_m: 256 or 128)

// Whether the kernel pays for an M x N product on `sms` SMs (N a multiple of the tile): from 256
// rows where its 128 x 256 output tiles keep the SMs busy, tiles / (rounds x SMs) >= 0.6,
// rounds = ceil(tiles / SMs) (a split last round counting 1 / its parts). A block owns each of its tiles for the whole K (at most one block
// per SM, persistent), so few tiles leave SMs idle. Measured on an H100 against the wgmma variant
// in one process (benchmarks/NOTES.md, 2026-11-27 (night); probe_prefill, eight layers, M =
// 256-4096): faster (1.12-1.44x) at every point with a fill of 0.65 or more, even (0.94-1.01x) at
// 0.61 (70B qkv at 256 and 512 rows), slower at 0.48 and below (0.49-0.81x: 32 or 64 column tiles
// at 256 and 512 rows); on the 135168-deep ideal layer 1.10-1.28x at 256-4096 rows. From 256
// rows: at 128 a 256-row tile is half empty and the decode kernels are far ahead.
// min_fill: 0.64 for the dense kernels' alternative (the wgmma variant); the 2:4 planner passes
// kPrefill24MinFill, since its own alternative is slower (NOTES.md, 2:4 on the prefill kernel:
// at a fill of 0.61, 70B qkv at 256 and 512 rows, the prefill kernel was 1.8x the older 2:4
// path; at 0.48 even; at 0.24 slower).
constexpr double kPrefillMinFill = 0.6;
constexpr double kPrefill24MinFill = 0.5;
// The fill counts a last round split in K (prefill_schedule) as 1 / its parts of a round. tile_m:
// the tile's rows (kPrefillTileMShort: from 65 rows instead of 256). With 128-row tiles at 96-192
// rows against what ran there before (the decode kernels; H100, seven layers, NOTES.md "128-row
// tiles"): dense group 128 0.96-1.23x (median 1.08), per column 0.96-1.27x (1.11), 2:4 0.94-1.71x (1.38).
bool prefill_pays(long long m, long long n, long long k, int sms, double min_fill, int tile_m = kPrefillTileM);

// The tile height of an M x N x K call on `sms` SMs: `forced` (MARLIN_PREFILL_ROWS, 128 or 256)
// where set (0: the rule); 128 below 256 rows; from 256 rows the height whose persistent schedule
// (prefill_schedule, with its K split) takes less time in a model of whole rounds: a unit costs a
// fixed number of stage times plus one per 64-deep stage, a 128-row stage a fraction of a 256-row
// one (it loads and dequantizes the same weights for half the MMAs), the last part of a split tile
// its lead (kPrefillSplitLead (1 - 1/parts) stages) and a chain of stage times for the others'
// partials, a stream-K block kPrefillSplitStages for its cut tiles. Fitted per kind of call:
// the fixed cost and the 128-row stage to an H100 probe (benchmarks/NOTES.md, "128-row tiles";
// seven layers at 256 and 512 rows): group scales (and 2:4) a fixed 4 and 0.6 per 128-row stage,
// per column (no group scales to apply) 0 and 0.56; the split's chain, once the last part summed
// the others' partials in registers, to an H200 probe of both heights forced (NOTES.md, 2026-11-28
// fifteenth; six layers at 256-1664 rows): 4 stage times with group scales, 12 per column, 10 for
// 2:4 (whose half-empty 256-row tiles at 384 rows cost 1.32x). Group scales and per column then
// pick the faster height at every probed point that differs by more than 2%: 128 on 7B o (256-640
// rows), at 320 and 384 rows, per column also at 576 and 640; 256 on the wide and deep ones (70B
// down, 70B gate_up) and at 512 rows. 2:4 misses 5120 x 5120 at 256 and 576 rows (by 12%, 19%).
enum class PrefillRoundModel { kGroupScales, kPerColumn, kSparse24 };
int prefill_pick_tile_m(long long m, long long n, long long k, int sms, int forced, PrefillRoundModel model);

// K split (dense and 2:4 instances): where the last round of the persistent schedule has at most
// half the SMs' worth of tiles (every tile, if there is only that round), those tiles run in
// parts = min(4, SMs / tiles left, stages / 16) units each, one per idle SM, their fp32 partials
// added by the tile's last unit (prefill_kernel.cuh). Only that round: a split spread over
// several rounds lost to the partials' traffic. H100 probe (benchmarks/NOTES.md, "K in parts"),
// against FP16, unsplit -> parts: 7B down at 256 rows (32 tiles) 0.45 -> 1.18x (4 parts), at 512
// (64) 0.61 -> 0.93x (2), 7B o at 256 0.43 -> 0.83x (4), 70B o / 70B down at 256 (64 tiles)
// 0.57 / 0.60 -> 0.93 / 1.00x (2); spread over 2-3 rounds instead: 7B o at 512 in 4 parts
// 0.56x, 70B qkv at 512 in 4 parts 0.63x. forced_parts > 0 (MARLIN_PREFILL_SPLIT; probes):
// every tile in that many parts; 1: none; kPrefillStreamK (below): every tile in one stream-K range.
constexpr int kPrefillMaxParts = 4;
constexpr int kPrefillMinPartStages = 16;
// Stream-K (parts = kPrefillStreamK): where the only round of 128-row tiles is more than half
// full (fewer tiles than SMs, more than half as many), the tiles' stages as one range, each block
// of a grid of one per SM taking an equal share (a piece of one or two tiles), the pieces of a cut
// tile summed by its last arriver as the split's parts are. Taken where a share plus a split
// tile's partials (kPrefillSplitStages stage times: stored, arrived at, summed) is under kPrefillStreamKShare
// of a whole tile's stages, and a share is at least kPrefillMinPartStages. H200 probe (NOTES.md,
// 2026-11-28 tenth), against main's plans: 70B qkv at 96 / 128 rows 1.09 / 0.91x -> 1.30 / 1.10x
// of FP16 (80 tiles had left 52 SMs idle), 7B down at 257 / 384 rows 0.51 / 0.79x -> 0.77 /
// 0.85x (g128; 2:4 0.55 / 0.82x -> 0.79 / 1.11x). Not on 256-row tiles: 70B qkv at 256 rows ran
// 7-9% slower per column and 2:4 on 80 of them stream-K than on 160 128-row tiles in parts.
// forced_parts kPrefillStreamK (MARLIN_PREFILL_SPLIT=-1; probes, tests): every tile in the range,
// either height.
constexpr int kPrefillStreamK = -1;
constexpr double kPrefillSplitStages = 16.0;
constexpr double kPrefillStreamKShare = 0.9;
// In a K split the last part takes kPrefillSplitLead stages more than each of the others, so that
// they have stored their partials and arrived by the time it ends; it then adds theirs to its own
// accumulators without storing its own or arriving (prefill_kernel.cuh). The others' store and
// arrival take about as long as 6 stages of either tile height (H200, per-unit timer stamps,
// benchmarks/NOTES.md 2026-11-28 thirteenth): with a lead of 4 the last part mostly found them
// still storing, with 10 its own extra stages cost more than the shortcut saved at four parts.
constexpr int kPrefillSplitLead = 6;

// The persistent grid of an M x N x K call and its K split, for the dense and the 2:4 planners:
// units = whole tiles before split_first, then `parts` units per tile; lock counters (one per
// split tile, at most marlin_gemm.h's max_locks, else no split) and fp32 partials to allocate.
struct PrefillSchedule {
  int grid = 0;
  int parts = 1;             // 1: no split; kPrefillStreamK: every tile in one stream-K range (split_first 0)
  int split_first = 0;       // the first split tile (the tile count if none)
  int split_stages = 0;      // stages of each part but the last (0: equal parts; stream-K: 0)
  long long partial_floats = 0;
  int locks = 0;
};
// lead: the split's last part's extra stages (< 0: kPrefillSplitLead; 0: equal parts).
PrefillSchedule prefill_schedule(long long m, long long n, long long k, int sms, int forced_parts,
                                 int tile_m = kPrefillTileM, int lead = -1);

// BF16: bf16 activations, scales and output (else fp16). W: the weight type (dequant.cuh's WType:
// kU4, kU4Zp with zero points per group, GROUPED only, or kU8). GROUPED: scales in groups of 32, 64
// or 128 along K (p.group_shift); else per column. TILE_M: activation rows per tile (256 or 128;
// prefill.cu, prefill_m128.cu). cluster is ignored (1).
template <bool BF16, int W, bool GROUPED, int TILE_M>
cudaError_t launch_prefill(const KernelParams& p, int grid, int smem, cudaStream_t stream, bool pdl, int cluster);

// The 2:4 instances (prefill_24.cu, prefill_24_m128.cu): p.b is marlin.gemm_2_4's b_q, b_meta its
// metadata; 4-bit weights (W: kU4, or kU4Zp with zero points in groups), group scales (GROUPED)
// or per column; TILE_M activation rows per tile (256 or 128).
template <bool BF16, int W, bool GROUPED, int TILE_M>
cudaError_t launch_prefill_24(const KernelParams& p, const void* b_meta, int grid, int smem, cudaStream_t stream, bool pdl);

}  // namespace marlin
