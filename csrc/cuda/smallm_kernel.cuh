// The small-batch MARLIN kernel (slices of 8, 16 or 32 rows of A): computes C^T = dequant(B)^T A^T.
//
// Why a second kernel: in marlin_kernel.cuh the batch sits in the 16-row slot of
// mma.m16n8k16, so at M = 1 fifteen of its sixteen rows multiply zeros, every 8 weights cost
// two mma, and the group scale costs four HMUL2. Here the weights fill the 16-row slot (the
// operand swap the paper uses for Sparse-MARLIN) and the batch is the 8-wide n of the mma:
//  * The packed format needs no change: the 8 nibbles a lane holds for a 16x16 block (columns
//    g and g + 8, rows of K 2c, 2c+1, 2c+8, 2c+9) are exactly its A fragment of the transposed
//    block (rows of the fragment = columns of N). Only the register order differs.
//  * One mma per 8 weights for M <= 8 (half as many), two for M <= 16.
//  * Scales (SmallMShape::kGroupSums / kScaleWeights / kRaw): at M <= 8 the group scale acts on
//    fp32 group sums (each stage is one 128-row group), and per-column scales on the column's
//    fp32 sum. There the weights enter the mma as raw fp16 subnormals (nibble * 2^-24, no
//    arithmetic), and one more mma per k16 step removes the +8 offset. For larger slices with
//    group scales, the weights are dequantized with the magic-number trick and scaled in fp16
//    (fewer registers: two blocks per SM at 16 rows).
//  * Tiles of 256 or 512 columns (NW chunks x 64): each 16-byte activation chunk read from L2 feeds
//    2-4x more weights than the tiled kernel's 128-column tile. The wgmma variant also has a
//    128-column tile for fp16 group 128 (NW == 2), for layers whose 256-column columns are too
//    few to fill the device without many short parts per column.
//  * The pipeline runs over the block's whole stripe: the loads of the next column are already
//    in flight while a column is reduced and written (no refill at column boundaries). The
//    stage loop stays unrolled (static shared-memory offsets); after a column's epilogue it
//    resumes at the next slot of the ring. A fetch cursor moves the global pointers by constants
//    inside a column; the tile's position (two divisions) is recomputed only at column changes.
// Two partitions of the tiles over the blocks (the planner picks, marlin_gemm.cu):
//  * stream-K stripes of tiles_per_block tiles. Split columns are reduced as in marlin_kernel.cuh
//    (fp32 partial per block, one acquire-release arrival on the column's counter, the last to
//    arrive adds the partials in block order and leaves the counter at zero), but by all 256
//    threads, 4 columns each: with 8 partial loads in registers in flight at once, or, for the
//    wgmma instances at a block's last column, copied into the idle pipeline's shared memory
//    with cp.async first (26-51 copies in flight per thread; finish_column).
//  * split_parts > 0: each column in that many nearly equal parts, one per block, so that no
//    block stops streaming at a column end in mid-stripe. Reduced through global memory as above,
//    or (cluster_reduce, sm_90+) the parts of a column form one thread-block cluster: each block
//    leaves its fp32 partial in its own shared memory and, after a cluster barrier, adds the
//    partials of its 1/parts of the tile from all blocks through distributed shared memory, in
//    rank order. That skips the partial store, fence, counter and partial loads through L2.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "dequant.cuh"
#include "k_half_sums.cuh"
#include "marlin_kernel.cuh"  // KernelParams, kThreads, kWarps
#include "ptx.cuh"
#include "wgmma.cuh"

namespace marlin {

// MB: n8 tiles of the batch per slice (slice = 8 MB rows of A); NW: 64-column chunks of the tile
// along N, one warp each; the other kWarps / NW warps split the 8 k16 blocks of a stage, except
// at MB == 16 (WG), where they split each chunk's four 16-column blocks instead (two per warp:
// 128 accumulators per thread, as at MB == 8).
// WG (sm_90a): the mma of a k16 step is one wgmma per 16 columns of each warp, issued by the
// warpgroup (4 warps = 64 rows of the transposed product, batch = its N of 8 MB), with the
// activations read by the tensor cores straight from shared memory (128-byte swizzle) and the
// dequantized weights from registers. One instruction replaces MB mma.sync, which is what made
// the mma.sync kernel issue-bound from 16 rows on, and slices of 64 or 128 rows become possible.
// Each weight is dequantized once per slice, so for large M the 128-row slice halves that work
// and gives each wgmma twice the N.
// ET, W: element type and weight format (dequant.cuh). RG: grouped with the group size taken at
// run time (KernelParams::group_shift; 32, 64 or 128 rows, so a 128-row stage holds 1, 2 or 4
// scale rows, read per k16 step): 1 with the scales on the weights, kRgSums (2) on raw group
// sums. The base format (fp16, symmetric INT4, group 128 fixed or per
// column) keeps the raw-subnormal and group-sum paths below; every other format dequantizes
// fully and scales the weights (or, per column, the fp32 sums), with mma.sync or wgmma (bf16:
// the wgmma of bf16 operands), on the 256-column tile only.
// RG values: 0 the group size fixed by the instance (128 rows, or per column; for the other formats
// the group-sum instances and, on wgmma, zero points in groups of 128), 1 at run time with the
// scales on the weights, kRgSumsMode at run time on raw group sums.
constexpr int kRgSumsMode = 2;

template <int MB, int NW, int STAGES, bool GROUPED, bool WG = false, typename ET = half, int W = kU4, int RG = 0>
struct SmallMShape {
  static constexpr bool kWG = WG;
  static constexpr bool kBase = std::is_same<ET, half>::value && W == kU4 && !RG;
  // How the group scale is applied: at MB == 1 to fp32 group sums (one FFMA per accumulator per
  // group, 16 extra registers); from MB == 2 on to the dequantized fp16 weights (4 HMUL2 per 8
  // weights, shared by MB mma), which keeps MB == 2 within 128 registers (two blocks per SM).
  // WG: group sums at MB == 2 only. Reading them needs a full wgmma drain at every group's end,
  // which cost more than the 4 HMUL2 it saves at MB == 4 (H200: 70B gate_up M=32 134 vs 98 us).
  // fp16 INT4 with zero points in groups of 128 on the 8-row mma.sync slice (kZpSums) takes the
  // base format's raw path too: (u - z) s summed over a group is s (sum u a - z sum a), so the
  // correction mma sums the activations (the -1 matrix instead of -8) and the group's end adds z
  // times that sum per column before the scale. The zero point then costs one FFMA per sum and
  // group instead of a full dequantization with a per-column constant at every k16 step.
  // bf16 does the same, symmetric or with zero points, but without subnormals (a
  // bf16 nibble times 2^-133 would make fp32 subnormal products): each nibble under the exponent
  // of 128 gives 128 + u exactly (dequant_u4_biased_bf16: 7 instructions per 8 weights, against
  // 15 with the subtraction and the scale multiply), and the correction mma adds -136 sum a
  // (symmetric) or -sum a (zero points: times 128 + z at the group's end).
  // RG == kRgSums: the same with the group size at run time (groups of 64 / 32). A warp's four k16
  // steps of a stage (two K warps per 128-row stage) are one group of 64, or two of 32: the sums
  // are restarted at the stage's first step and scaled at its end, and with groups of 32 also
  // scaled and restarted after its second step.
  // kFmtSums: these group-sum paths of the other formats (4-bit, grouped, 8-row mma.sync slice,
  // group 128 fixed or kRgSums); kZpSums: those with zero points.
  static constexpr bool kRgSums = RG == kRgSumsMode;
  static constexpr bool kFmtSums = !kBase && W != kU8 && GROUPED && (!RG || kRgSums) && !WG && MB == 1;
  static constexpr bool kZpSums = kFmtSums && W == kU4Zp;
  // (Not on the 128-column wgmma tile: its warps hold half a chunk each, which needs scaled weights.)
  static constexpr bool kGroupSums = (kBase && GROUPED && (WG ? MB == 2 && NW != 2 : MB == 1)) || kFmtSums;
  static constexpr bool kScaleWeights = GROUPED && !kGroupSums;
  // Where scales act on fp32 sums, the weights enter the mma as raw subnormals (see
  // unpack_int4x8_subnormal): 5 instructions per 8 weights instead of 9. The sums are then
  // 2^-24 sum (q + 8) a; a second mma per k16 step against a constant matrix adds the
  // -8 * 2^-24 sum a, and the 2^24 goes into the fp32 scale.
  // With WG the activations cannot be scaled in registers (the wgmma reads them from shared
  // memory): each thread divides the K rows 8..15 of the chunks it copied in shared memory, once
  // per stage, when they have landed (kPrescale).
  // WG from MB == 4 per column: plain dequantization, scales on the fp32 result (measured: the
  // raw path's correction wgmma and prescale made per column 30% slower than group 128 there).
  static constexpr bool kRaw = (kBase && !kScaleWeights && !(WG && MB >= 4)) || kFmtSums;
  // fp16's raw weights are subnormals (x 2^-24, K rows 8..15 stored x 16); bf16's are 128 + u.
  static constexpr bool kSubnormal = kRaw && !kIsBf16<ET>;
  // The correction matrix of the raw path. fp16: subnormal pairs for K rows 0..7 and 8..15
  // (whose activations are / 16): -8 * 2^-24 and -128 * 2^-24 (symmetric: the +8 offset), or
  // -2^-24 and -16 * 2^-24 (kZpSums: the activations' sum, scaled by each column's z later).
  // bf16: -136 (symmetric: 128 + 8) or -1 (zero points: scaled by each column's 128 + z later).
  static constexpr uint32_t kCorrLo = kIsBf16<ET> ? (kZpSums ? 0xBF80BF80u : 0xC308C308u) : kZpSums ? 0x80018001u : 0x80088008u;
  static constexpr uint32_t kCorrHi = kIsBf16<ET> ? kCorrLo : kZpSums ? 0x80108010u : 0x80808080u;
  static constexpr bool kPrescale = WG && kRaw;
  // Stages loaded ahead of the one computed. Each stage's last step refills a slot of the ring.
  // mma.sync: before the stage barrier, the slot of the previous stage (every warp has read it
  // into registers before the previous barrier). WG: a wgmma reads its activations from shared
  // memory until its wait, so the slot of the previous stage may still be in use when the
  // barrier is reached. Early refill (before the barrier) takes the slot before that and keeps
  // one stage less in flight. Late refill (kLateRefill: after the barrier and after the step's
  // wgmma is issued) takes the previous stage's slot: each warpgroup's first step of a stage
  // waits for the previous stage's last wgmma, and the barrier orders that before either
  // warpgroup's refill. Late refill measured 10-28% faster at 128 rows with group scales (4
  // stages, 2 -> 3 in flight; H200, "Session 7" in benchmarks/NOTES.md) and ~3% at 16 rows with
  // group sums, but 4-6% slower at 32 rows, where the copies then delay the next short wgmma.
  // With 3 stages (8-bit weights from 64 rows on, smallm_instances.cuh) early refill would keep a
  // single stage in flight, issued and waited for in the same step: late refill there too.
  static constexpr bool kLateRefill = WG && (MB == 16 || kGroupSums || STAGES == 3);
  static constexpr int kAhead = WG && !kLateRefill ? STAGES - 2 : STAGES - 1;
  // WG: the wgmma descriptors in uniform registers. The K warp index wk (the only per-warp term of
  // a step's shared-memory descriptor) is read from lane 0, so that the compiler knows it is
  // warp-uniform: it then adds each step's constant with one uniform instruction, where a
  // descriptor in ordinary registers costs two R2UR per wgmma (16-row slice: 8 of ~70
  // instructions per k16 step; 5% of the 16-row instance's instructions, 10-20 fewer registers).
  // Not where it made ptxas spill more at the 255-register bound (ptxas -v, sm_90a): the 512-column
  // tile but for its 16-row group-128 instance, the 128-row slice on 256 columns, 8-bit weights on
  // the 64-row slice.
  static constexpr bool kUniformDesc =
      WG && (NW == 8 ? MB == 2 && GROUPED : MB <= 4 || NW == 2 || (MB == 8 && W != kU8));
  // 16-column blocks of its chunk per warp: half a chunk at MB == 16 (accumulators) and on the
  // 128-column wgmma tile (NW == 2: the eight warps are 2 chunks x 2 halves x 2 K halves, so that
  // each warpgroup still covers one K half)
  static constexpr int kJW = WG && (MB == 16 || NW == 2) ? 2 : 4;
  static constexpr int kJSplit = 4 / kJW;             // warps per 64-column chunk
  static constexpr int kKW = kWarps / NW / kJSplit;   // warps along K: 1 or 2
  static constexpr int kTK = 8;            // k16 blocks per stage: 128 rows of K, one scale group
  static constexpr int kSub = kTK / kKW;   // k16 steps per warp per stage
  static constexpr int kRows = 8 * MB;     // rows of A per slice
  static constexpr int kTileN = 64 * NW;

  // shared memory per stage, in int4 (16 bytes)
  static constexpr int kARowInt4 = kTK * 2;          // 128 halves of one row of A
  static constexpr int kAStage = kRows * kARowInt4;
  static constexpr int kBLane = W == kU8 ? 2 : 1;      // int4 of packed weights per lane and 16 x 64 block
  static constexpr int kChunkInt4 = 32 * kBLane;       // one 16 x 64 block of packed weights
  static constexpr int kBStage = kTK * NW * kChunkInt4;  // 8 k16 rows x NW chunks
  // one row of 64 NW scales (kSRow int4), kSRows of them (RG); WG pads its slot so that every
  // stage starts on a 1024-byte swizzle atom. Zero points (kU4Zp) follow in the same layout.
  static constexpr int kSRow = GROUPED ? NW * 8 : 0;
  static constexpr int kSRows = RG ? 4 : 1;
  static constexpr int kSStage = WG && GROUPED ? (kSRows * kSRow + 63) / 64 * 64 : kSRows * kSRow;
  static constexpr bool kZeros = W == kU4Zp;
  static constexpr int kZStage = kZeros ? kSStage : 0;
  // Zero points: the dequantization constants of a lane's zero points (u4_zero_pair, two
  // instructions per 16x16 block) made once per group and kept in registers (2 per block) on the
  // wgmma slices of 16-64 rows, remade at every k16 step elsewhere. Kept per group they spill on
  // the 128-row wgmma slices (0 -> 64 bytes) and the 16-row mma.sync one (at its 128-register
  // bound: 0 -> 36), and on the 8-row mma.sync slice they cost 2-7% at M = 1-8 (H100, A/B of
  // both builds: the group test's early exit splits the unrolled k16 steps, benchmarks/NOTES.md
  // 2026-11-26), while at 16-64 rows they save 1-4%.
  static constexpr bool kZeroConstPerGroup = kZeros && WG && MB <= 8;
  static constexpr int kStageInt4 = kAStage + kBStage + kSStage + kZStage;
  static constexpr int kPipeInt4 = STAGES * kStageInt4;
  // accumulators per thread: kJW row blocks of 16 columns of N x MB n8 tiles x 4
  static constexpr int kAccFloats = kJW * MB * 4;
  // end-of-column reduction of the K warps: the upper KW - 1 warp rows store theirs
  static constexpr int kRedInt4 = (kKW - 1) * NW * kJSplit * 32 * (kAccFloats / 4);
  // WG: + 1 KB to align the dynamic shared memory to the 1024-byte swizzle atom
  static constexpr int kSmemBytes = (kPipeInt4 + kRedInt4) * 16 + (WG ? 1024 : 0);
  // fp32 values of one block's partial tile (rows of the slice x columns of the tile)
  static constexpr int kPartialFloats = kRows * kTileN;

  static_assert(WG ? (MB == 2 || MB == 4 || MB == 8 || MB == 16) : (MB == 1 || MB == 2 || MB == 4),
                "MB must be 1, 2 or 4 (2, 4, 8 or 16 with WG)");
  static_assert(kKW >= 1 && kWarps == NW * kJSplit * kKW, "MB == 16 needs the 128- or 256-column tile");
  static_assert(kAhead >= 1, "the pipeline needs a stage in flight");
  static_assert(!WG || kStageInt4 % 64 == 0, "WG stages must keep the 1024-byte alignment");
  static_assert(kWarps % NW == 0 && kTK % kKW == 0, "warps must split the tile evenly");
  static_assert(kKW <= 2, "the column epilogue reduces at most two K warps");
  static_assert(kJW == 4 || (WG && !kGroupSums), "a warp with half a chunk needs the wgmma, weight-scaled path");
  static_assert((STAGES * kSub) % 2 == 0, "register double buffer needs an even sub-step count");
  static_assert(kBStage % kThreads == 0, "B stage must split evenly over threads");
  static_assert(kThreads % (NW * kChunkInt4) == 0, "a round of B copies must cover whole k16 rows");
  static_assert(kBase || NW == 4 || (NW == 2 && WG), "other formats: the 256-column tile, and with wgmma the 128-column one");
  static_assert(NW != 2 || (WG && GROUPED), "the 128-column tile: wgmma, group scales only");
  // N a multiple of 64 only (the other formats; 8-row mma.sync slices, 16- and 32-row wgmma
  // ones): the last tile of N may hold fewer than NW chunks of 64 columns. Their copies re-read
  // chunk 0 of the tile (in bounds, no branch in the copy loop) and their results are not stored.
  // Not in the base instances, where the tile divides N (planner), nor where registers are at
  // their bound: there the checks made the 16-row mma.sync (128 registers) and the 64- and
  // 128-row wgmma instances (255) spill 8-32 more bytes inside the main loop.
  static constexpr bool kPartialN = !kBase && (MB == 1 || (WG && MB <= 4));
  static_assert(kBase || kFmtSums || !GROUPED || RG || WG,
                "other formats on mma.sync take their group size at run time (wgmma: also fixed at 128)");
  static_assert(!kRgSums || (GROUPED && !WG && MB == 1 && (W == kU4 || W == kU4Zp) && kSub == 4),
                "run-time group sums: 4-bit weights on the 8-row mma.sync slice, four k16 steps per warp and stage");
  static_assert(!kZeros || GROUPED, "per-column zero points run on the tiled kernel");
  static_assert(kSStage <= kThreads, "one copy per thread loads a stage's scales (and zero points)");
};

// Component-wise a += b (the split-column reductions add fp32 partials four columns at a time).
__device__ __forceinline__ void add4(float4& a, const float4& b) {
  a.x += b.x;
  a.y += b.y;
  a.z += b.z;
  a.w += b.w;
}

// MB <= 2 fits in 128 registers, so two blocks can share an SM (more warps to hide latency).
// WG instances keep group sums and double-buffered A fragments: one block, up to 255 registers.
// MINB (the kernel's last parameter) overrides it: the 8-row group-sum instances of the other
// formats, and the base format's 256-column ones, also come with MINB = 1 for the plans that keep
// one block per SM anyway (most layers at 1-8 rows; marlin_gemm.cu's one_block_regs_pay), where
// the 128-register bound only makes ptxas recompute shared-memory addresses at every stage (fp16
// zero points: ~300 -> ~250 instructions per warp and stage, fp16 group 128 ~235 -> ~227).
template <int MB, bool WG>
constexpr int kSmallMMinBlocksPerSm = !WG && MB <= 2 ? 2 : 1;

template <int MB, int NW, int STAGES, bool GROUPED, bool WG, typename ET = half, int W = kU4, int RG = 0,
          int MINB = kSmallMMinBlocksPerSm<MB, WG>>
__global__ void __launch_bounds__(kThreads, MINB) marlin_smallm_kernel(const KernelParams p) {
  using S = SmallMShape<MB, NW, STAGES, GROUPED, WG, ET, W, RG>;
  using E = Elem<ET>;
  using T2 = typename E::T2;
  constexpr bool kBf16 = kIsBf16<ET>;
  constexpr int KW = S::kKW, SUB = S::kSub;
#if !MARLIN_HAS_WGMMA
  // A wgmma instance built for another target than sm_90a is never launched (planner): a trap
  // stub, so that the default multi-target build does not compile its body for every target.
  if constexpr (WG) {
    __trap();
    return;
  }
#endif
  extern __shared__ int4 smem_raw[];
  int4* smem = smem_raw;
  if constexpr (WG) smem += ((1024 - (smem_addr(smem_raw) & 1023)) & 1023) / 16;

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int wn = warp % NW;                     // which 64 columns of the tile
  const int jh = (warp / NW) % S::kJSplit;      // which kJW of the chunk's 16-column blocks
  const int warp_k = warp / (NW * S::kJSplit);  // which half of a stage's k16 blocks (KW == 2)
  const int wk = S::kUniformDesc ? __shfl_sync(0xffffffffu, warp_k, 0) : warp_k;  // see kUniformDesc
  const int jcol = jh * S::kJW * 16;            // the warp's first column in its chunk
  const int g = lane / 4, c4 = lane % 4;

  const int k_tiles = p.k / (16 * S::kTK);
  // kPartialN: chunk c (0..NW-1) of tile nt exists where (nt NW + c) 64 < p.n
  const int n_tiles = S::kPartialN ? (p.n + S::kTileN - 1) / S::kTileN : p.n / S::kTileN;
  const int total = p.m_slices * n_tiles * k_tiles;
  const int T = p.tiles_per_block;
  const int parts = p.split_parts;
  int start, n_mine;  // first stripe tile and how many (a stripe of the tile order: column-major in K)
  if (parts > 0) {    // part blockIdx.x % parts of column blockIdx.x / parts; never empty (planner)
    const int col = blockIdx.x / parts, part = blockIdx.x - col * parts;
    const int kt0 = part * k_tiles / parts;
    start = col * k_tiles + kt0;
    n_mine = (part + 1) * k_tiles / parts - kt0;
  } else {
    start = blockIdx.x * T;
    n_mine = min(start + T, total) - start;
    if (n_mine <= 0) return;
  }
  const long long b_row_int4 = p.n / 2 * S::kBLane;  // one packed row (16 rows of K)

  // ---- static per-thread offsets of the copies in a stage
  constexpr int kALoads = (S::kAStage + kThreads - 1) / kThreads;
  constexpr int kBLoads = S::kBStage / kThreads;
  constexpr bool kAFull = kALoads * kThreads == S::kAStage;  // else the last round is partial
  int a_sh_wr[kALoads], a_row[kALoads];
  int a_col = 0;
#pragma unroll
  for (int l = 0; l < kALoads; l++) {
    const int idx = tid + l * kThreads;
    a_row[l] = idx / S::kARowInt4;
    a_col = idx % S::kARowInt4;  // the same for every l (kThreads is a multiple of a row)
    if constexpr (WG)  // [64-half block of K][row][8 chunks], 128-byte swizzle
      a_sh_wr[l] = (a_col / 8) * (S::kRows * 8) + a_row[l] * 8 + ((a_col % 8) ^ (a_row[l] % 8));
    else
      a_sh_wr[l] = a_row[l] * S::kARowInt4 + (a_col ^ (a_row[l] % 8));
  }
  static_assert(kThreads % S::kARowInt4 == 0, "A copies must keep their column across rounds");
  // so copy l of a thread is row a_row[0] + l * kARowStep. Up to 4 copies keep a source pointer
  // each (fewest instructions per stage); the 8 of a 128-row slice share one pointer and a row
  // step, which frees the registers whose spills made that slice 20% slower (H200, "Session 6";
  // the shared pointer made 32-64-row slices 2-4% slower).
  constexpr int kARowStep = kThreads / S::kARowInt4;
  constexpr bool kAOnePtr = kALoads > 4;
  const long long a_step = kARowStep * p.lda_int4;
  // B: copy l of a thread reads k16 row kb0 + l * 8 / NW of the tile, at 16-byte column b_off
  const int b_kb0 = tid / (NW * S::kChunkInt4), b_off = tid % (NW * S::kChunkInt4);
  const long long b_step = static_cast<long long>(kThreads / (NW * S::kChunkInt4)) * b_row_int4;

  // ldmatrix sources. Matrix mat = lane / 8 of an x4 load is (rows 0-7, k 0-7), (rows 0-7,
  // k 8-15), (rows 8-15, k 0-7), (rows 8-15, k 8-15) of a 16-row pair of n8 tiles; an x2 load (MB
  // == 1) uses the first two. Chunk 2 kb + mat % 2 of a row is stored at (2 kb) ^ (mat % 2 ^ row % 8):
  // a per-lane base and XOR key, and one XOR per load with the compile-time 2 kb.
  constexpr int kLdPairs = MB == 1 ? 1 : MB / 2;
  const int ld_row = MB == 1 ? lane % 8 : 8 * ((lane / 8) / 2) + lane % 8;  // + 16 q
  const int ld_key = ((lane / 8) % 2) ^ (ld_row % 8);
  const int ld_base = ld_row * S::kARowInt4;
  auto act_sh_rd = [&](int kb, int q) { return ld_base + 16 * q * S::kARowInt4 + ((2 * kb) ^ ld_key); };

  // ---- registers
  constexpr int JW = S::kJW;
  float tot[JW][MB][4];                        // the column's result so far
  float grp[S::kGroupSums ? JW : 1][MB][4];    // this group's mma sums (kGroupSums only)
  float corr[MB][4];                           // kRaw: the correction mma's sums (kCorrLo / kCorrHi times the activations)
  uint32_t act[2][MB][2];                      // activation B fragments, double buffered
  uint32_t afrag[2][JW][4];                    // WG: dequantized A fragments, double buffered
  alignas(16) uint32_t wq[2][JW * S::kBLane];  // packed weights (8 nibbles / 2 x 4 bytes per block), double buffered
  alignas(16) uint32_t s_cur[JW];              // this lane's scale pairs of the current group
  alignas(16) uint32_t z_cur[JW] = {};         // kZeros: its zero-point pairs, as s_cur
  U4Zero z_const[S::kZeroConstPerGroup ? JW : 1] = {};  // their dequantization constants (see the shape)
  // kRaw, mma.sync: the correction matrix's A fragment. As a known constant ptxas rematerialises it
  // at every k16 step (two FADD from uniform registers and two moves per step: ~16 of the 8-row
  // slice's ~195 instructions per warp and stage), so the instances without the 128-register bound
  // (MINB == 1) make it once from zeros that the compilers cannot see: four different sizes, never
  // negative, shifted right by 31 (an empty asm does not stop ptxas, and one zero for all four lets
  // it keep two registers and copy them into the fragment at every use). Under the bound the four
  // registers cost spills (the 512-column tile: 24 -> 44 bytes), and the constant stays.
  auto opaque_zero = [&](int size) { return MINB == 1 ? static_cast<uint32_t>(size) >> 31 : 0u; };
  const uint32_t corr_frag[4] = {S::kCorrLo | opaque_zero(p.m), S::kCorrLo | opaque_zero(p.n), S::kCorrHi | opaque_zero(p.k),
                                 S::kCorrHi | opaque_zero(p.m_slices)};

  // A lane's 16-byte word in shared memory holds one 32-bit entry per 16-column block of its
  // 64-column chunk (packed weights, scale pairs); a warp with kJW == 2 blocks reads its half.
  auto read_blocks = [&](const int4* at, uint32_t(&dst)[JW]) {
    if constexpr (JW == 4) {
      *reinterpret_cast<int4*>(dst) = *at;
    } else {
      const uint2 v = reinterpret_cast<const uint2*>(at)[jh];
      dst[0] = v.x, dst[1] = v.y;
    }
  };

  auto zero = [](auto& acc) {
#pragma unroll
    for (int j = 0; j < JW; j++)
#pragma unroll
      for (int b = 0; b < MB; b++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][b][e] = 0.f;
  };

  // The column a stripe tile belongs to, and where in it (two divisions: used only at the start
  // and at column changes).
  struct Where {
    int col, kt, nt, row0, rows;
  };
  auto where = [&](int i) {
    Where w;
    const int id = start + i;
    w.col = id / k_tiles;
    w.kt = id - w.col * k_tiles;
    const int slice = w.col / n_tiles;
    w.nt = w.col - slice * n_tiles;
    w.row0 = slice * S::kRows;
    w.rows = min(S::kRows, p.m - w.row0);
    return w;
  };

  // Fetch cursor: the sources of the next tile to load. Within a column each tile moves the
  // pointers by a constant; only a new column needs the divisions of where().
  int f_i = 0;     // stripe index of the next tile to load
  int f_left = 0;  // tiles left in its column, counting it
  const int4* f_a[kAOnePtr ? 1 : kALoads];  // the copies' sources (kAOnePtr: copy 0's)
  bool f_a_ok[kAOnePtr ? 1 : kALoads];       // the copy's row exists (else zero-filled)
  int f_a_rows = 0;  // kAOnePtr: rows of the slice from a_row[0] on (copy l exists if l * kARowStep < this)
  const int4* f_b;
  const int4* f_s = nullptr;
  auto seek = [&](int i) {
    const Where w = where(i);
    f_left = k_tiles - w.kt;
    if constexpr (kAOnePtr) {
      f_a_rows = w.rows - a_row[0];
      f_a[0] = p.a + (w.row0 + a_row[0]) * p.lda_int4 + w.kt * S::kARowInt4 + a_col;
    } else {
#pragma unroll
      for (int l = 0; l < kALoads; l++) {
        f_a_ok[l] = a_row[l] < w.rows && (kAFull || tid + l * kThreads < S::kAStage);
        f_a[l] = p.a + (w.row0 + (f_a_ok[l] ? a_row[l] : 0)) * p.lda_int4 + w.kt * S::kARowInt4 + a_col;
      }
    }
    // a copy of a chunk past N (kPartialN) reads the same offset of chunk 0
    int b_col = b_off;
    if constexpr (S::kPartialN) {
      if ((w.nt * NW + b_off / S::kChunkInt4) * 64 >= p.n) b_col = b_off % S::kChunkInt4;
    }
    f_b = p.b + (static_cast<long long>(w.kt) * S::kTK + b_kb0) * b_row_int4 + w.nt * NW * S::kChunkInt4 + b_col;
    if constexpr (RG) {  // thread tid < (8 >> shift) kSRow copies row tid / kSRow of the tile's scale rows
      int s_col = tid % S::kSRow;
      if constexpr (S::kPartialN) {
        if ((w.nt * NW + s_col / 8) * 64 >= p.n) s_col %= 8;
      }
      f_s = p.s + (static_cast<long long>(w.kt) * (S::kTK >> p.group_shift) + tid / S::kSRow) * (p.n / 8) +
            w.nt * S::kSRow + s_col;
    }
    else if constexpr (GROUPED) {  // thread tid < kSRow copies the tile's scale row
      int s_col = tid;
      if constexpr (S::kPartialN) {
        if ((w.nt * NW + s_col / 8) * 64 >= p.n) s_col %= 8;
      }
      f_s = p.s + static_cast<long long>(w.kt) * (p.n / 8) + w.nt * S::kSRow + s_col;
    }
  };

  auto fetch_stage = [&](int stage) {
    if (f_i < n_mine) {
      int4* sh = smem + stage * S::kStageInt4;
#pragma unroll
      for (int l = 0; l < kALoads; l++) {
        if constexpr (kAOnePtr) {  // rows past the slice's end: zero-filled, nothing read (source p.a)
          const bool ok = l * kARowStep < f_a_rows;
          if (kAFull || tid + l * kThreads < S::kAStage) cp_async16_zfill(sh + a_sh_wr[l], ok ? f_a[0] + l * a_step : p.a, ok);
        } else {
          if (kAFull || tid + l * kThreads < S::kAStage) cp_async16_zfill(sh + a_sh_wr[l], f_a[l], f_a_ok[l]);
        }
      }
      int4* sh_b = sh + S::kAStage + tid;
#pragma unroll
      for (int l = 0; l < kBLoads; l++) cp_async16_evict_first(sh_b + l * kThreads, f_b + l * b_step);
      if constexpr (RG) {
        if (tid < (S::kTK >> p.group_shift) * S::kSRow) {
          cp_async16(sh + S::kAStage + S::kBStage + tid, f_s);
          if constexpr (S::kZeros) cp_async16(sh + S::kAStage + S::kBStage + S::kSStage + tid, p.z + (f_s - p.s));
        }
      } else if constexpr (GROUPED) {
        if (tid < S::kSRow) {
          cp_async16(sh + S::kAStage + S::kBStage + tid, f_s);
          if constexpr (S::kZeros) cp_async16(sh + S::kAStage + S::kBStage + S::kSStage + tid, p.z + (f_s - p.s));
        }
      }
      f_i++;
      if (--f_left == 0) {
        if (f_i < n_mine) seek(f_i);
      } else {
#pragma unroll
        for (int l = 0; l < (kAOnePtr ? 1 : kALoads); l++) f_a[l] += S::kARowInt4;
        f_b += S::kTK * b_row_int4;
        if constexpr (RG)
          f_s += (S::kTK >> p.group_shift) * (p.n / 8);
        else if constexpr (GROUPED)
          f_s += p.n / 8;
      }
    }
    cp_async_commit();
  };

  // Waits for the stage in `slot` (the next to be computed) and makes it visible to all warps.
  // PENDING: copy groups that may still be in flight (the stages committed after it).
  auto wait_stage = [&](int slot, auto pending) {
    cp_async_wait<decltype(pending)::value>();
    if constexpr (S::kPrescale) {
      // odd 16-byte chunks of a row are K rows 8..15 of their k16 block: / 16 (exact in fp16
      // but for values below 2^-10, i.e. far inside fp16 matmul's own rounding)
      if (a_col % 2 == 1) {
        const half2 sixteenth = __float2half2_rn(1.f / 16.f);
#pragma unroll
        for (int l = 0; l < kALoads; l++) {
          if (kAFull || tid + l * kThreads < S::kAStage) {
            int4* ptr = smem + slot * S::kStageInt4 + a_sh_wr[l];
            int4 v = *ptr;
            half2* h = reinterpret_cast<half2*>(&v);
            h[0] = __hmul2(h[0], sixteenth);
            h[1] = __hmul2(h[1], sixteenth);
            h[2] = __hmul2(h[2], sixteenth);
            h[3] = __hmul2(h[3], sixteenth);
            *ptr = v;
          }
        }
      }
    }
    if constexpr (WG) fence_proxy_async_smem();  // cp.async and the stores above wrote what wgmma reads
    __syncthreads();
  };

  auto fetch_regs = [&](int buf, int stage, int u) {
    const int4* sh = smem + stage * S::kStageInt4;
    if constexpr (WG) {
      // activations: read by the wgmma itself
    } else if constexpr (MB == 1) {
      ldmatrix_x2(act[buf][0], sh + act_sh_rd(wk * SUB + u, 0));
    } else {
#pragma unroll
      for (int q = 0; q < kLdPairs; q++) {
        uint32_t r[4];
        ldmatrix_x4(r, sh + act_sh_rd(wk * SUB + u, q));
        act[buf][2 * q][0] = r[0];
        act[buf][2 * q][1] = r[1];
        act[buf][2 * q + 1][0] = r[2];
        act[buf][2 * q + 1][1] = r[3];
      }
    }
    if constexpr (S::kBLane == 2) {  // 8-bit: the lane's two int4, words 2j (column g) and 2j + 1 (8 + g)
      const int4* at = sh + S::kAStage + ((wk * SUB + u) * NW + wn) * S::kChunkInt4 + 2 * lane;
      if constexpr (JW == 4) {
        reinterpret_cast<int4*>(wq[buf])[0] = at[0];
        reinterpret_cast<int4*>(wq[buf])[1] = at[1];
      } else {  // half a chunk per warp (WG, MB == 16): blocks 2 jh and 2 jh + 1, one int4
        reinterpret_cast<int4*>(wq[buf])[0] = at[jh];
      }
    } else {
      read_blocks(sh + S::kAStage + ((wk * SUB + u) * NW + wn) * 32 + lane, wq[buf]);
    }
    if constexpr (S::kSubnormal && !WG) {  // rows 8..15 of K meet weights stored x16: divide them by 16 here
      const half2 sixteenth = __float2half2_rn(1.f / 16.f);
#pragma unroll
      for (int b = 0; b < MB; b++) {
        half2 v = *reinterpret_cast<half2*>(&act[buf][b][1]);
        v = __hmul2(v, sixteenth);
        act[buf][b][1] = *reinterpret_cast<uint32_t*>(&v);
      }
    }
  };

  // The A fragment of the warp's transposed 16x16 block j from its 8 nibbles: rows g (lo) and
  // g + 8 (hi) of N, raw subnormals (kRaw) or dequantized, times the group scales of columns
  // jcol + 16 j + g (lo) and jcol + 16 j + 8 + g (hi) where kScaleWeights.
  auto weight_frag = [&](int buf, int j, uint32_t (&a)[4]) {
    uint32_t lo[2], hi[2];
    if constexpr (S::kSubnormal) {
      unpack_int4x8_subnormal(wq[buf][j], lo, hi);
    } else if constexpr (S::kRaw) {
      dequant_u4_biased_bf16(wq[buf][j], lo, hi);
    } else if constexpr (W == kU8) {
      dequant_u8<ET>(wq[buf][2 * j], lo);
      dequant_u8<ET>(wq[buf][2 * j + 1], hi);
    } else if constexpr (W == kU4Zp) {
      dequant_u4<ET, true>(wq[buf][j], lo, hi, S::kZeroConstPerGroup ? z_const[j] : u4_zero_pair<ET>(z_cur[j]));
    } else if constexpr (kBf16) {
      dequant_u4<ET, false>(wq[buf][j], lo, hi, U4Zero{0, 0});
    } else {
      dequant_int4x8(wq[buf][j], lo, hi);
    }
    if constexpr (S::kScaleWeights && !S::kBase) {
      const ET* sc = reinterpret_cast<const ET*>(s_cur);
      scale_frag_t<ET>(lo, sc[2 * j]);
      scale_frag_t<ET>(hi, sc[2 * j + 1]);
    } else if constexpr (S::kScaleWeights) {
      const half2 pair = reinterpret_cast<const half2*>(s_cur)[j];
      const half2 s_lo = __low2half2(pair), s_hi = __high2half2(pair);
      half2* l2 = reinterpret_cast<half2*>(lo);
      half2* h2 = reinterpret_cast<half2*>(hi);
      l2[0] = __hmul2(l2[0], s_lo);
      l2[1] = __hmul2(l2[1], s_lo);
      h2[0] = __hmul2(h2[0], s_hi);
      h2[1] = __hmul2(h2[1], s_hi);
    }
    a[0] = lo[0];
    a[1] = hi[0];
    a[2] = lo[1];
    a[3] = hi[1];
  };

  // WG: the warpgroup's wgmma for k16 step u of `stage`, one per 16 columns j of each warp (the
  // four warps' j-th blocks are the 64 rows of the product). Kept one group deep: the wait
  // after the commit ends the previous step's group, whose A registers are refilled next.
  // kRaw: as in compute(), plus one wgmma against the constant -8 matrix into corr (all 64 rows
  // of it alike); with group sums the stage's first step starts grp and corr (scale-d = 0).
  const uint64_t desc_base = smem_desc_sw128(smem_addr(smem));  // + offset >> 4 stays in bits 0-13
  auto compute_wg = [&](int buf, int stage, int u) {
    if constexpr (WG) {  // not instantiated for the mma.sync instances (no wgmma of their width)
#pragma unroll
      for (int j = 0; j < JW; j++) weight_frag(buf, j, afrag[buf][j]);
      // k16 block kb of the stage: 64-half block kb / 4, 32 bytes per step in it. kUniformDesc:
      // warp-uniform, the constant added in uniform registers at each step. Else the base goes
      // through an empty asm so that the compiler adds the constant here instead of keeping one
      // 64-bit descriptor per (stage, step) alive in registers.
      const int kb = wk * SUB + u;
      uint32_t desc_lo = static_cast<uint32_t>(desc_base);
      if constexpr (!S::kUniformDesc) fence_operand(desc_lo);
      desc_lo += (stage * S::kStageInt4 * 16 + (kb / 4) * (S::kRows * 128) + (kb % 4) * 32) >> 4;
      const uint64_t desc = (desc_base & ~0xFFFFFFFFull) | desc_lo;
      const bool restart = S::kGroupSums && u == 0;  // compile-time once unrolled
      uint32_t wg_corr[4] = {S::kCorrLo, S::kCorrLo, S::kCorrHi, S::kCorrHi};  // see compute()
      constexpr int N = 8 * MB;
#pragma unroll
      for (int j = 0; j < JW; j++)
#pragma unroll
        for (int r = 0; r < 4; r++) fence_operand(afrag[buf][j][r]);
#pragma unroll
      for (int r = 0; r < 4; r++) fence_operand(wg_corr[r]);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < JW; j++) {
        if constexpr (S::kGroupSums) {
          if (restart)
            wgmma_m64k16_rs<N, false>(reinterpret_cast<float(&)[4 * MB]>(grp[j]), afrag[buf][j], desc);
          else
            wgmma_m64k16_rs<N, true>(reinterpret_cast<float(&)[4 * MB]>(grp[j]), afrag[buf][j], desc);
        } else {
          wgmma_m64k16_rs<N, true, kBf16>(reinterpret_cast<float(&)[4 * MB]>(tot[j]), afrag[buf][j], desc);
        }
      }
      if constexpr (S::kRaw) {
        if (restart)
          wgmma_m64k16_rs<N, false>(reinterpret_cast<float(&)[4 * MB]>(corr), wg_corr, desc);
        else
          wgmma_m64k16_rs<N, true>(reinterpret_cast<float(&)[4 * MB]>(corr), wg_corr, desc);
      }
      wgmma_commit();
      wgmma_wait<1>();
    }
  };

  // `first`: the stage's first k16 step of this warp, which starts the group's sums in grp
  auto compute = [&](int buf, bool first) {
#pragma unroll
    for (int j = 0; j < JW; j++) {
      uint32_t a[4];
      weight_frag(buf, j, a);
#pragma unroll
      for (int b = 0; b < MB; b++) {
        if constexpr (S::kGroupSums) {
          if (first)
            mma_16816_first<kBf16>(a, act[buf][b], grp[j][b]);
          else
            mma_16816<kBf16>(a, act[buf][b], grp[j][b]);
        } else
          mma_16816<kBf16>(a, act[buf][b], tot[j][b]);
      }
    }
    if constexpr (S::kRaw) {
      // fp16: -8 * 2^-24 on K rows 0..7 and -128 * 2^-24 on rows 8..15 (whose activations are
      // / 16): both exact fp16 subnormals, the same for every row of N (kZpSums: -1 and -16 times
      // 2^-24). bf16: -136 or -1 on every row (exact).
#pragma unroll
      for (int b = 0; b < MB; b++) {
        if (S::kGroupSums && first)
          mma_16816_first<kBf16>(corr_frag, act[buf][b], corr[b]);
        else
          mma_16816<kBf16>(corr_frag, act[buf][b], corr[b]);
      }
    }
  };

  // The lane's 8 scales of the group in `stage` are one int4 (b_scales permutation: position
  // 8 g + 2 j is column 16 j + g, 8 g + 2 j + 1 is 16 j + 8 + g); kJW == 2 reads its half. Read
  // at sub-step 0: after the barrier that made the stage visible, before the one after which the
  // slot is refilled.
  const int s_sh_rd = S::kAStage + S::kBStage + wn * 8 + g;
  // RG: the k16 step's own scale row of the stage (read at every step; kept across steps it
  // costs the 64- and 128-row instances 120+ bytes of spills). Zero points (kZeroConstPerGroup):
  // read and made into dequantization constants where a group starts (and at a stage's first
  // step), not at every k16 step.
  auto load_scales = [&](int stage, int u) {
    if constexpr (RG) {
      const int kb = wk * SUB + u;
      const int at = stage * S::kStageInt4 + s_sh_rd + (kb >> p.group_shift) * S::kSRow;
      read_blocks(smem + at, s_cur);
      if constexpr (S::kZeroConstPerGroup) {
        if (u != 0 && (kb & ((1 << p.group_shift) - 1)) != 0) return;  // same group as the step before
        read_blocks(smem + at + S::kSStage, z_cur);
#pragma unroll
        for (int j = 0; j < JW; j++) z_const[j] = u4_zero_pair<ET>(z_cur[j]);
      } else if constexpr (S::kZeros) {
        read_blocks(smem + at + S::kSStage, z_cur);
      }
    } else if constexpr (GROUPED) {
      read_blocks(smem + stage * S::kStageInt4 + s_sh_rd, s_cur);
      if constexpr (S::kZeros) read_blocks(smem + stage * S::kStageInt4 + s_sh_rd + S::kSStage, z_cur);
      if constexpr (S::kZeroConstPerGroup) {
#pragma unroll
        for (int j = 0; j < JW; j++) z_const[j] = u4_zero_pair<ET>(z_cur[j]);
      }
    }
  };

  // WG: waits for every wgmma in flight, then pins the accumulators `acc` and (kRaw) corr that
  // they wrote, so that the compiler reads them only after the wait. (Pinning an unused corr
  // would keep its 4 MB registers alive.)
  auto wgmma_drain = [&](auto& acc) {
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < JW; j++)
#pragma unroll
      for (int b = 0; b < MB; b++)
#pragma unroll
        for (int e = 0; e < 4; e++) fence_operand(acc[j][b][e]);
    if constexpr (S::kRaw) {
#pragma unroll
      for (int b = 0; b < MB; b++)
#pragma unroll
        for (int e = 0; e < 4; e++) fence_operand(corr[b][e]);
    }
  };

  // tot += scale * grp at the end of each group (grp is restarted by the next group's first mma)
  auto apply_group = [&]() {
    if constexpr (S::kGroupSums) {
      if constexpr (WG) wgmma_drain(grp);  // the group's last wgmma must land before grp and corr are read
      const ET* sc = reinterpret_cast<const ET*>(s_cur);
      // fp16's raw sums carry 2^-24: it stays in tot until combine_column (one multiply per column
      // instead of two per 16 columns at every group's end)
#pragma unroll
      for (int j = 0; j < JW; j++) {
        const float s_lo = E::to_float(sc[2 * j]), s_hi = E::to_float(sc[2 * j + 1]);
        if constexpr (S::kZpSums) {  // corr is -sum a (fp16: x 2^-24): each column's z (bf16: 128 + z) times it
          const ET* zc = reinterpret_cast<const ET*>(z_cur);
          float z_lo = E::to_float(zc[2 * j]), z_hi = E::to_float(zc[2 * j + 1]);
          if constexpr (!S::kSubnormal) z_lo += 128.f, z_hi += 128.f;  // bf16's raw weights are 128 + u
#pragma unroll
          for (int b = 0; b < MB; b++) {
            tot[j][b][0] = fmaf(s_lo, fmaf(z_lo, corr[b][0], grp[j][b][0]), tot[j][b][0]);
            tot[j][b][1] = fmaf(s_lo, fmaf(z_lo, corr[b][1], grp[j][b][1]), tot[j][b][1]);
            tot[j][b][2] = fmaf(s_hi, fmaf(z_hi, corr[b][2], grp[j][b][2]), tot[j][b][2]);
            tot[j][b][3] = fmaf(s_hi, fmaf(z_hi, corr[b][3], grp[j][b][3]), tot[j][b][3]);
          }
        } else {
#pragma unroll
          for (int b = 0; b < MB; b++) {
            tot[j][b][0] = fmaf(s_lo, grp[j][b][0] + corr[b][0], tot[j][b][0]);
            tot[j][b][1] = fmaf(s_lo, grp[j][b][1] + corr[b][1], tot[j][b][1]);
            tot[j][b][2] = fmaf(s_hi, grp[j][b][2] + corr[b][2], tot[j][b][2]);
            tot[j][b][3] = fmaf(s_hi, grp[j][b][3] + corr[b][3], tot[j][b][3]);
          }
        }
      }
    }
  };

  // Chunk x of a reduced column (4 fp32 sums of row x / kRowChunks of the slice, tile columns
  // 4 (x % kRowChunks) + 0..3) to C: per-column scales applied, rounded to fp16.
  constexpr int kRowChunks = S::kTileN / 4;
  // 16-byte slots per thread in the pipeline's shared memory (finish_column's staged reduction)
  constexpr int kStagedSlots = S::kPipeInt4 / kThreads;
  static_assert(kStagedSlots >= 8, "the staged reduction must hold 8 parts of a chunk per thread");
  auto store_chunk = [&](const Where& w, int x, float4 v) {
    const int r = x / kRowChunks, cc = 4 * (x % kRowChunks);
    const long long c_col = static_cast<long long>(w.nt) * S::kTileN + cc;
    if constexpr (S::kPartialN) {
      if (c_col >= p.n) return;  // a chunk past N
    }
    if constexpr (!GROUPED) {
      const T2* sc = reinterpret_cast<const T2*>(reinterpret_cast<const ET*>(p.s) + c_col);
      const float2 s01 = E::to_float2(sc[0]), s23 = E::to_float2(sc[1]);
      v.x *= s01.x;
      v.y *= s01.y;
      v.z *= s23.x;
      v.w *= s23.y;
    }
    T2 out[2] = {E::floats2(v.x, v.y), E::floats2(v.z, v.w)};
    *reinterpret_cast<uint2*>(static_cast<ET*>(p.c) + static_cast<long long>(w.row0 + r) * p.n + c_col) = *reinterpret_cast<uint2*>(out);
  };

  // The column's sums of this block: the last wgmma landed, the raw per-column sum corrected, the
  // K warps added (into the wk == 0 warps' tot).
  auto combine_column = [&]() {
    if constexpr (WG) wgmma_drain(tot);  // the column's last wgmma group must land before tot and corr are read
    if constexpr (S::kRaw && !S::kGroupSums) {  // per column: the whole column is one raw sum
#pragma unroll
      for (int j = 0; j < JW; j++)
#pragma unroll
        for (int b = 0; b < MB; b++)
#pragma unroll
          for (int e = 0; e < 4; e++) tot[j][b][e] = (tot[j][b][e] + corr[b][e]) * 16777216.f;
#pragma unroll
      for (int b = 0; b < MB; b++)
#pragma unroll
        for (int e = 0; e < 4; e++) corr[b][e] = 0.f;
    } else if constexpr (S::kGroupSums && S::kSubnormal) {  // apply_group left the raw sums' 2^-24 in tot
#pragma unroll
      for (int j = 0; j < JW; j++)
#pragma unroll
        for (int b = 0; b < MB; b++)
#pragma unroll
          for (int e = 0; e < 4; e++) tot[j][b][e] *= 16777216.f;
    }
    if constexpr (KW == 2) {
      float4* red = reinterpret_cast<float4*>(smem + S::kPipeInt4) + (wn + NW * jh) * (S::kAccFloats / 4) * 32 + lane;
      add_upper_k_half(red, tot, wk == 1);
    }
  };

  // (wk == 0 warps) The column sums as a [rows][stride] fp32 partial tile at `base`, only the
  // element rows 8 b + e % 2 below `lim` (the slice's rows - 2 c4, as in finish_column);
  // `put(address, value)` is the store (shared memory, or global past L1).
  auto store_partial = [&](int lim, float* base, int stride, auto put) {
    float* mine = base + 2 * c4 * stride + wn * 64 + jcol + g;
#pragma unroll
    for (int b = 0; b < MB; b++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        if (8 * b + e % 2 < lim) {
#pragma unroll
          for (int j = 0; j < JW; j++) put(mine + (8 * b + e % 2) * stride + 16 * j + 8 * (e / 2), tot[j][b][e]);
        }
      }
  };

  // Cluster partition: the block's (only) column is reduced with the other blocks of its cluster.
  // The partial goes to this block's shared memory as [rows][kTileN + 4] fp32 (the padding
  // spreads the rows 2 c4 of a warp's stores over the banks), over the drained pipeline stages.
  constexpr int kPartStride = S::kTileN + 4;
  static_assert(S::kRows * kPartStride * 4 <= S::kPipeInt4 * 16, "the partial must fit the pipeline's shared memory");
  auto reduce_in_cluster = [&](const Where& w) {
    combine_column();
    float* part_sm = reinterpret_cast<float*>(smem);
    cp_async_wait<0>();
    __syncthreads();  // every warp has finished reading the stages that the partial overwrites
    if (wk == 0) store_partial(w.rows - 2 * c4, part_sm, kPartStride, [](float* at, float v) { *at = v; });
    cluster_sync();  // all partials of the column are in place
    // This block's share of the tile's float4 chunks; each is the sum of the parts in rank order
    // (deterministic), with the loads from all parts in flight at once.
    constexpr int kMaxParts = 8;
    const int rank = blockIdx.x % parts;
    const int chunks = w.rows * kRowChunks;
    const int hi = (rank + 1) * chunks / parts;
    const uint32_t base = smem_addr(part_sm);
    uint32_t from[kMaxParts];
#pragma unroll
    for (int q = 0; q < kMaxParts; q++) from[q] = q < parts ? cluster_map(base, q) : 0;
    for (int x = rank * chunks / parts + tid; x < hi; x += kThreads) {
      const uint32_t off = ((x / kRowChunks) * kPartStride + 4 * (x % kRowChunks)) * 4;
      float4 v[kMaxParts];
#pragma unroll
      for (int q = 0; q < kMaxParts; q++)
        if (q < parts) v[q] = ld_cluster_f4(from[q] + off);
      float4 sum = v[0];
#pragma unroll
      for (int q = 1; q < kMaxParts; q++)
        if (q < parts) add4(sum, v[q]);
      store_chunk(w, x, sum);
    }
    cluster_sync();  // the other blocks have read this block's partial: its shared memory may go
  };

  // ---- end of a column of a stream-K stripe: add the K warps, reduce with the other blocks, write C.
  // `block_done`: the block's last column, after which its pipeline's shared memory is idle.
  auto finish_column = [&](const Where& w, bool block_done) {
    combine_column();
    // Lane's element (j, b, e) is C[row 8 b + 2 c4 + e % 2][tile column 64 wn + jcol + g + 16 j + 8 (e / 2)]:
    // one base per lane plus compile-time offsets, and a row limit instead of per-element tests.
    const int lim = w.rows - 2 * c4;  // element rows 8 b + e % 2 below this exist
    // the blocks of the column: split parts, or the stripes that touch it
    const int first_block = parts > 0 ? blockIdx.x - blockIdx.x % parts : (w.col * k_tiles) / T;
    const int last_block = parts > 0 ? first_block + parts - 1 : (w.col * k_tiles + k_tiles - 1) / T;
    const int n_parts = last_block - first_block + 1;
    const int col0 = w.nt * S::kTileN + wn * 64 + jcol + g;
    if (n_parts == 1) {
      if (wk == 0 && (!S::kPartialN || (w.nt * NW + wn) * 64 < p.n)) {
        float s_lo[JW], s_hi[JW];
#pragma unroll
        for (int j = 0; j < JW; j++) {
          s_lo[j] = s_hi[j] = 1.f;
          if constexpr (!GROUPED) {  // per-column scales, natural order, applied to the fp32 sum
            const ET* sc = reinterpret_cast<const ET*>(p.s) + col0;
            s_lo[j] = E::to_float(sc[16 * j]);
            s_hi[j] = E::to_float(sc[16 * j + 8]);
          }
        }
        ET* c_lane = static_cast<ET*>(p.c) + static_cast<long long>(w.row0 + 2 * c4) * p.n + col0;
#pragma unroll
        for (int b = 0; b < MB; b++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            if (8 * b + e % 2 < lim) {
              ET* row = c_lane + static_cast<long long>(8 * b + e % 2) * p.n;
#pragma unroll
              for (int j = 0; j < JW; j++) row[16 * j + 8 * (e / 2)] = E::from_float(tot[j][b][e] * (e < 2 ? s_lo[j] : s_hi[j]));
            }
          }
      }
      zero(tot);
      return;
    }

    // Split column. Slots hold [rows][kTileN] fp32. Block b uses slot 2b for the column its stripe
    // starts in and 2b+1 for the one it ends in; every block after the column's first starts in it
    // (split parts: every block of the column).
    const long long col_start = static_cast<long long>(w.col) * k_tiles;
    auto slot_of = [&](int block) {
      const bool starts_here = parts > 0 || static_cast<long long>(block) * T >= col_start;
      return reinterpret_cast<float*>(p.partial) + static_cast<long long>(2 * block + (starts_here ? 0 : 1)) * S::kPartialFloats;
    };
    if (wk == 0) store_partial(lim, slot_of(blockIdx.x), S::kTileN, [](float* at, float v) { __stcg(at, v); });
    zero(tot);
    if (!last_to_arrive(p.locks + first_block, n_parts)) return;

    const int chunks = w.rows * kRowChunks;
    auto chunk_off = [&](int x) { return (x / kRowChunks) * S::kTileN + 4 * (x % kRowChunks); };

    // WG, the block's last column (every column of split parts): the pipeline's shared memory
    // is idle, so each thread copies the parts of its chunks there with cp.async, kStagedSlots
    // 16-byte copies in flight at once instead of the 8 loads its registers hold below, then
    // adds them in block order. The last arriver's read was latency-bound: 8 loads x 256
    // threads = 32 KB per L2 round trip, 256 KB at 16 rows x 512 columns x 8 parts (benchmarks/NOTES.md).
    // (Not in the mma.sync instances: their partials are 1-8 rows at M <= 8 on Hopper, and the
    // extra code made the 128-register ones spill.)
    if (S::kWG && block_done && n_parts <= kStagedSlots) {
      float4* mine = reinterpret_cast<float4*>(smem) + tid;  // slot e of this thread: mine[e * kThreads]
      const int per_pass = kStagedSlots / n_parts;             // chunks per thread per pass
      for (int x0 = tid; x0 < chunks; x0 += per_pass * kThreads) {
        for (int u = 0; u < per_pass && x0 + u * kThreads < chunks; u++) {
          const int off = chunk_off(x0 + u * kThreads);
          for (int q = 0; q < n_parts; q++)
            cp_async16(mine + (u * n_parts + q) * kThreads, slot_of(first_block + q) + off);
        }
        cp_async_commit();
        cp_async_wait<0>();
        asm volatile("" ::: "memory");  // each thread reads only its own copies; keeps the reads after the wait
        for (int u = 0; u < per_pass && x0 + u * kThreads < chunks; u++) {
          const float4* v = mine + u * n_parts * kThreads;
          float4 sum = v[0];
          for (int q = 1; q < n_parts; q++) add4(sum, v[q * kThreads]);
          store_chunk(w, x0 + u * kThreads, sum);
        }
        asm volatile("" ::: "memory");  // and before the next pass's copies into the same slots
      }
      return;
    }

    // The last to arrive adds the parts in block order, 4 columns per thread and step, then
    // scales and writes 4 halves of C per chunk. Each thread keeps 8 loads in flight: kU = 2
    // chunks x kPB = 4 parts at a time. (One chunk x 8 parts kept only 2 loads in flight where
    // a column has 2 parts, typical from 32 rows on: H200, 70B qkv / 7B gate_up / ideal at
    // M = 32-64 went 5-11% faster; more chunks at once spilled registers.)
    constexpr int kU = 2, kPB = 4;
    for (int x0 = tid; x0 < chunks; x0 += kU * kThreads) {
      float4 sum[kU];
#pragma unroll
      for (int u = 0; u < kU; u++) sum[u] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
      for (int blk = first_block; blk <= last_block; blk += kPB) {
        float4 v[kU][kPB];
#pragma unroll
        for (int u = 0; u < kU; u++) {
          const int x = x0 + u * kThreads;
          const int off = chunk_off(x);
#pragma unroll
          for (int q = 0; q < kPB; q++)
            if (x < chunks && blk + q <= last_block) v[u][q] = __ldcg(reinterpret_cast<const float4*>(slot_of(blk + q) + off));
        }
#pragma unroll
        for (int u = 0; u < kU; u++)
#pragma unroll
          for (int q = 0; q < kPB; q++)
            if (x0 + u * kThreads < chunks && blk + q <= last_block) add4(sum[u], v[u][q]);
      }
#pragma unroll
      for (int u = 0; u < kU; u++) {
        const int x = x0 + u * kThreads;
        if (x >= chunks) break;
        store_chunk(w, x, sum[u]);
      }
    }
  };


  // ---- main loop over the stripe, one tile (= one 128-row group) per stage
  zero(tot);
#pragma unroll
  for (int b = 0; b < MB; b++)
#pragma unroll
    for (int e = 0; e < 4; e++) corr[b][e] = 0.f;
  seek(0);
  // Programmatic dependent launch: the previous kernel of the stream may still be running until
  // here; A, the locks and C may be its inputs or outputs. (Fetching the first weights before
  // the wait measured no clear gain, and would be wrong after a kernel that writes them.)
  // Until then (programmatic launch), only hints for L2: the weight rows and scales of the first
  // stages, so that the copies issued after the wait find them there instead of in DRAM.
  if (p.prefetch) {
    const Where w0 = where(0);
    const int ahead = min(S::kAhead, min(n_mine, k_tiles - w0.kt));  // tiles of the first column
    const int4* b0 = p.b + static_cast<long long>(w0.kt) * S::kTK * b_row_int4 + w0.nt * NW * S::kChunkInt4;
    constexpr int kLinesPerRow = NW * S::kChunkInt4 / 8;  // 128-byte lines of one packed row of the tile
    for (int l = tid; l < S::kTK * ahead * kLinesPerRow; l += kThreads) {
      if constexpr (S::kPartialN) {
        if ((w0.nt * NW + (l % kLinesPerRow) * 8 / S::kChunkInt4) * 64 >= p.n) continue;
      }
      prefetch_l2(b0 + (l / kLinesPerRow) * b_row_int4 + (l % kLinesPerRow) * 8);
    }
    if constexpr (GROUPED && !RG) {
      constexpr int kLinesPerScaleRow = S::kSRow / 8;
      if (tid < ahead * kLinesPerScaleRow)
        prefetch_l2(p.s + static_cast<long long>(w0.kt + tid / kLinesPerScaleRow) * (p.n / 8) + w0.nt * S::kSRow +
                    (tid % kLinesPerScaleRow) * 8);
    }
  }
  grid_dependency_wait();
#pragma unroll
  for (int s = 0; s < S::kAhead; s++) fetch_stage(s);
  grid_launch_dependents();
  wait_stage(0, std::integral_constant<int, S::kAhead - 1>{});
  fetch_regs(0, 0, 0);

  int i = 0;       // next tile of the stripe to compute
  int phase = 0;   // its slot in the ring of stages
  Where cur = where(0);
  int col_end = min(n_mine, k_tiles - cur.kt);  // stripe index where the current column stops
  while (i < n_mine) {
#pragma unroll
    for (int stage = 0; stage < STAGES; stage++) {
      if (stage < phase) continue;  // resuming mid-ring after a column epilogue
#pragma unroll
      for (int u = 0; u < SUB; u++) {
        const int buf = (stage * SUB + u) % 2;
        if (u == 0 || RG) load_scales(stage, u);
        // the refill at the stage's last step: before its barrier, or after the barrier and
        // the step's wgmma (kLateRefill; see kAhead)
        const int refill = (stage + S::kAhead) % STAGES;
        if (u == SUB - 1) {
          if constexpr (!S::kLateRefill) fetch_stage(refill);
          wait_stage((stage + 1) % STAGES, std::integral_constant<int, S::kAhead - (S::kLateRefill ? 2 : 1)>{});
          fetch_regs(buf ^ 1, (stage + 1) % STAGES, 0);
        } else {
          fetch_regs(buf ^ 1, stage, u + 1);
        }
        if constexpr (WG)
          compute_wg(buf, stage, u);
        else
          compute(buf, u == 0);
        if constexpr (S::kRgSums) {  // groups of 32: the first of the warp's two groups ends here
          if (u == 1 && p.group_shift == 1) {
            apply_group();
            zero(grp);
#pragma unroll
            for (int b = 0; b < MB; b++)
#pragma unroll
              for (int e = 0; e < 4; e++) corr[b][e] = 0.f;
          }
        }
        if constexpr (S::kLateRefill) {
          if (u == SUB - 1) fetch_stage(refill);
        }
      }
      apply_group();
      i++;
      phase = (stage + 1) % STAGES;
      if (i == col_end) break;
    }
    if (i == col_end) {
      if (p.cluster_reduce) break;  // the block's only column: reduced in its cluster below
      finish_column(cur, i == n_mine);
      if (i < n_mine) {
        cur = where(i);
        col_end = min(n_mine, i + k_tiles);
      }
    }
  }
  if (p.cluster_reduce) reduce_in_cluster(cur);
  cp_async_wait<0>();
}

}  // namespace marlin
