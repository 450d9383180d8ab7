// The prefill kernel (sm_90a): fp16 / bf16 x INT4 or INT8 for large batches (prompt processing),
// warp-specialized and persistent.
//
// It computes the same C^T = B^T A^T as the small-batch kernel, with the weights as the wgmma's A
// operand (from registers) and the activations as its B operand (from shared memory):
//  - one producer thread issues, per stage, the bulk tensor copies (TMA) into shared memory: the
//    activations (256 rows x 64 of K, in the 128-byte swizzle that wgmma reads), the packed
//    weights of the block's 128 columns, and the rows of their group scales (and zero points)
//    that the stage's 64 rows of K need: one for groups of 128 or 64, two for groups of 32; they
//    land on the stage's `full` mbarrier;
//  - two consumer warpgroups (64 weight columns each): each warp reads its 16 columns' packed
//    words of the stage from shared memory and dequantizes them straight into wgmma A fragments
//    (the published format puts a lane's word in the mma fragment order), then issues wgmma
//    m64n256k16 with A from those registers. The next stage is dequantized into a second set of
//    fragments while this one's wgmma run, so each warpgroup keeps the tensor cores fed on its
//    own; the two warpgroups run independently.
// A stage's slot goes back to the producer when both consumers' wgmma have read it (`empty`).
//
// Persistent: the grid is at most one block per SM; a block takes tiles blockIdx.x, + gridDim.x,
// ... The producer runs on into the next tile's stages while the consumers store the last one
// (the epilogue has its own shared memory), so a tile's first stages are already there when its
// main loop starts.
//
// (History, benchmarks/NOTES.md: an earlier version wrote the dequantized weights to shared
// memory and read both operands from there; the per-stage proxy fence and warpgroup barrier
// between dequantization and wgmma were its top stall.)
//
// A block owns each of its 128 x 256 tiles of C^T (128 weight columns, 256 rows of M; every
// instance also comes with 128-row tiles, TILE_M: the wgmma N = 128 and half the accumulators)
// for the whole K, but for a split last round (below). Rows of M past the end are zero-filled by
// the tensor copy and never stored. The weights are the published Marlin format (docs/FORMAT.md): a lane's word of a
// 16 x 64 tile dequantizes (dequant_u4 / dequant_u8 of dequant.cuh, with the zero points of kU4Zp)
// into the A fragment of 16 weight columns and one k16 step. Groups (32, 64, 128: the run-time
// group_shift): fragments scaled in the element type before the wgmma (as the small-batch
// kernel's weight-scaled path); per column: the fp32 sums scaled in the epilogue.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../dequant.cuh"
#include "../marlin_kernel.cuh"
#include "../ptx.cuh"
#include "../wgmma.cuh"

namespace marlin {

// BITS: 4 or 8 (the packed weights of a stage; 8-bit ones leave room for 4 stages, 4-bit for 5).
// SPARSE: 2:4 weights (marlin/sparse.py's format, 4-bit): a stage holds the compressed values and
// the metadata of its two 32-row strips, and each wgmma step is a sparse k32 one.
// TILE_M: activation rows per tile, 256 or 128 (the wgmma N; 128: for 65-255 rows, where a
// 256-row tile would be half empty; half the accumulators and activation bytes per stage, so
// the ring has room for more stages to cover the copies' latency behind half the math).
template <int BITS = 4, bool SPARSE = false, int TILE_M = 256>
struct PrefillShape {
  static constexpr int kTileN = 128;   // weight columns per block: 2 consumer warpgroups x wgmma M = 64
  static constexpr int kTileM = TILE_M;  // activation rows per block: the wgmma N
  static constexpr int kTileK = 64;    // K per stage: one 128-byte row of halves (one swizzle atom row)
  static constexpr int kStages = TILE_M == 128 ? (BITS == 8 ? 7 : 8) : (BITS == 8 ? 4 : 5);
  static constexpr int kAcc = TILE_M / 2;  // fp32 accumulators per consumer thread (m64 x TILE_M per warpgroup)
  static constexpr int kPartialF4 = kTileN * kTileM / 4;  // float4 of one tile's fp32 partial (K split)
  static constexpr int kThreads = 384;  // one producer and two consumer warpgroups
  static constexpr int kConsumers = 256;
  // registers per thread after the hand-over (setmaxnreg; 128 x 40 + 256 x 232 <= 64 K): the
  // consumers hold 128 accumulators and two stages of A fragments
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  // bytes of one stage; every part starts on a 1024-byte boundary (the swizzle atom)
  static constexpr int kActBytes = kTileM * kTileK * 2;            // activations [TILE_M m][64 k]: 32 (16) KB
  // dense: 4 k16 rows x 2 tiles of 512 (1024) bytes; 2:4: 2 strips x 2 chunks of 512 bytes
  static constexpr int kPackedBytes = kTileN * kTileK * BITS / 8 / (SPARSE ? 2 : 1);
  static constexpr int kTileWords = 16 * 64 * BITS / 32;           // int32 of one packed 16 x 64 tile (dense)
  static constexpr int kMetaBytes = SPARSE ? 1024 : 0;             // 2:4: 2 strips x 2 chunks of 256 bytes
  // wgmma steps per stage and the rows of K each covers: dense k16, 2:4 k32
  static constexpr int kSteps = SPARSE ? 2 : 4;
  static constexpr int kStepK = kTileK / kSteps;
  // bytes between one step's packed words and the next's: a k16 row (dense: [k16 row][tile][64
  // int4] 4-bit, [tile][k16 row][64 int4] 8-bit) or a strip (2:4: [strip][chunk][32 int4]) of 64 int4
  static constexpr int kStepBytes = 1024;
  // the group rows of the stage: scales (up to two rows of 128, 256 bytes each), then zero points
  static constexpr int kScaleRowBytes = kTileN * 2;
  static constexpr int kZeroOffset = 512;
  static constexpr int kScaleBytes = 1024;
  static constexpr int kStageBytes = kActBytes + kPackedBytes + kMetaBytes + kScaleBytes;
  // the epilogue's staging, one buffer per consumer warpgroup: [128 m][64 n] of T (half a tile's
  // rows at a time), 128-byte rows, swizzled
  static constexpr int kEpiBytes = 128 * 64 * 2;
  static constexpr int kBarrierBytes = 2 * kStages * 8 + 16;  // full[] and empty[] mbarriers, the split's flag
  static constexpr int kSmemBytes = kStages * kStageBytes + 2 * kEpiBytes + kBarrierBytes + 1024;  // + alignment slack
  static_assert(kTileK == 64, "a stage holds one group row for groups of 64 and 128, two for 32 (dequant_stage)");
  static_assert(kStageBytes % 1024 == 0 && kEpiBytes % 1024 == 0 && kPackedBytes % 1024 == 0,
                "parts must keep the 1024-byte alignment");
  static_assert(!SPARSE || BITS == 4, "2:4 weights are 4-bit");
  static_assert(TILE_M == 256 || TILE_M == 128, "tiles of 256 or 128 activation rows");
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm_90 block may have");
};

// The kernel's arguments: the common ones and the tensor maps of its copies (made on the
// host per call, prefill.cu). Passed as a __grid_constant__ so that the maps stay in parameter space.
struct PrefillParams {
  KernelParams p;
  CUtensorMap act;  // a: T [m, k], box 64 x 256, 128-byte swizzle, rows past m read as 0
  CUtensorMap wq;   // b_q: int32 [k / 16, 2 n] (8-bit: 4 n), box 256 x 4: two 4-bit (one 8-bit) 16 x 64
                    // tiles of 4 k16 rows
  CUtensorMap sc;   // b_scales: T [groups, n], box 128 x max(1, 64 / group) (grouped only)
  CUtensorMap zp;   // b_zeros: as b_scales (zero points only)
  CUtensorMap meta;  // 2:4 only: b_meta int32 [k / 32, n], box 128 x 2 (the block's two chunks, two strips)
};

#if MARLIN_HAS_WGMMA
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// This thread's arrival, plus `bytes` of asynchronous copies that must land before the phase ends.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// Blocks until the phase of `bar` with the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n"
      "  .reg .pred done;\n"
      "  wait_%=:\n"
      "  mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "  @!done bra wait_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// A 2-D tensor copy (TMA) of the box at (x, y) of `map` into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_addr(bar))
      : "memory");
}
// A barrier among `count` threads (a multiple of 32) under id 1..15; 0 is __syncthreads.
__device__ __forceinline__ void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
#endif

// Byte offset of the 16-byte chunk `chunk` of row `row` in a 128-byte-swizzled K-major tile.
__device__ __forceinline__ int sw128(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

// Hands registers between the warpgroups of a block (sm_90a): the whole warpgroup executes it.
template <int REGS>
__device__ __forceinline__ void regs_dec() {
#if MARLIN_HAS_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}
template <int REGS>
__device__ __forceinline__ void regs_inc() {
#if MARLIN_HAS_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}

// T: half or nv_bfloat16; W: the weight type (kU4, kU4Zp: zero points, grouped only; kU8);
// GROUPED: group scales (else per column); SPARSE: 2:4 weights (b_q of marlin.gemm_2_4, and
// pp.meta), 4-bit.
template <typename T, int W, bool GROUPED, bool SPARSE = false, int TILE_M = 256>
__global__ void __launch_bounds__(PrefillShape<>::kThreads, 1) marlin_prefill_kernel(const __grid_constant__ PrefillParams pp) {
#if !MARLIN_HAS_WGMMA
  __trap();  // built for another target than sm_90a: never launched (planner)
#else
  using S = PrefillShape<W == kU8 ? 8 : 4, SPARSE, TILE_M>;
  constexpr bool ZP = W == kU4Zp;
  static_assert(GROUPED || !ZP, "zero points come in groups here (per-column ones run on the tiled kernel)");
  const KernelParams& p = pp.p;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* epi = smem + S::kStages * S::kStageBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(epi + 2 * S::kEpiBytes);
  uint64_t* empty = full + S::kStages;

  const int tid = threadIdx.x;
  const int m_tiles = (p.m + S::kTileM - 1) / S::kTileM;
  const int tiles = m_tiles * (p.n / S::kTileN);
  const int k_tiles = p.k / S::kTileK;
  // K split (p.split_parts > 1): the tiles from p.split_first on (the last, partial round of a
  // persistent schedule, or every tile) in `parts` units each, part j taking stages
  // [j * k_tiles / parts, (j + 1) * k_tiles / parts); the tile's last unit to arrive adds the
  // parts' fp32 partials (p.partial) in part order and stores C. Tiles before split_first are
  // one unit each: unit u < split_first is tile u. A block takes units blockIdx.x, + gridDim.x, ...
  // Stream-K (p.split_parts < 0; the planner gives it every tile): the tiles are one range of
  // R = tiles x k_tiles stages, block b taking stages [b R / G, (b + 1) R / G) (G = gridDim.x),
  // one piece of each tile that range touches: unit j G + b is block b's j-th piece (empty past
  // its last), so the blocks walk the same strided units as above. A tile cut into pieces is
  // summed by its last piece to arrive, as the K split's parts are. Its lock counter is that of
  // the block f holding its first stage (no block holds the first stage of two cut tiles: a cut
  // tile runs past the end of that block's range), and its parts' partials are slots 2 f + j
  // (the next cut tile's first block is f + parts - 1 or later, so 2 f + parts - 1 is below its
  // first slot; the last slot is under 2 G). All of it in 32 bits: the planner keeps R G < 2^31.
  // A unit's values (unit_at) are derived afresh per unit from the few kernel-wide ones below,
  // so nothing stream-K-specific stays live across the consumers' stage loop: with more values
  // live there ptxas re-derived the shared-memory base inside the loop (S2UR before the first
  // wgmma of every stage pair), 3% slower at 4096 rows.
  const bool stream_k = p.split_parts < 0;
  const int parts = stream_k ? 1 : max(1, p.split_parts);
  const int split_first = parts > 1 ? p.split_first : tiles;
  const int grid = gridDim.x;
  const int sk_stages = tiles * k_tiles;  // stream-K: R
  // stream-K: pieces per block, the most tiles a block's range (at most ceil(R / G) stages) touches
  const int sk_pieces = ((sk_stages + grid - 1) / grid + k_tiles - 2) / k_tiles + 1;
  const int units = stream_k ? sk_pieces * grid : split_first + (tiles - split_first) * parts;
  auto sk_start = [&](int b) { return sk_stages * b / grid; };               // block b's first stage
  auto sk_block_of = [&](int st) { return ((st + 1) * grid - 1) / sk_stages; };  // the block holding stage st
  // a unit: its tile's origin, its stages [kt0, kt1) (empty: a stream-K block's piece past its
  // last), and for a cut tile its lock counter (split_tile; < 0: a whole tile) and its part
  struct Unit {
    int m0, n0, kt0, kt1, split_tile, part;
  };
  auto unit_at = [&](int u) {
    Unit w{0, 0, 0, k_tiles, -1, 0};
    int tile = u;
    if (stream_k) {
      const int b = u % grid, j = u / grid;
      const int s0 = sk_start(b), s1 = sk_start(b + 1);
      const int start = j == 0 ? s0 : (s0 / k_tiles + j) * k_tiles;
      tile = start / k_tiles;
      const int t0 = tile * k_tiles;  // the tile's first stage in the range
      w.kt0 = start - t0, w.kt1 = start < s1 ? min(s1, t0 + k_tiles) - t0 : w.kt0;
      if (start < s1 && (w.kt0 > 0 || w.kt1 < k_tiles)) {
        const int first = sk_block_of(t0);
        w.split_tile = first, w.part = b - first;
      }
    } else if (u >= split_first) {
      w.split_tile = (u - split_first) / parts, w.part = (u - split_first) % parts;
      tile = split_first + w.split_tile;
      if (p.split_stages > 0)
        w.kt0 = w.part * p.split_stages, w.kt1 = w.part == parts - 1 ? k_tiles : w.kt0 + p.split_stages;
      else
        w.kt0 = w.part * k_tiles / parts, w.kt1 = (w.part + 1) * k_tiles / parts;
    }
    w.m0 = (tile % m_tiles) * S::kTileM;
    w.n0 = (tile / m_tiles) * S::kTileN;
    return w;
  };
  // the part count of the cut tile of unit w
  auto unit_parts = [&](const Unit& w) {
    if (!stream_k) return parts;
    const int tile = (w.n0 / S::kTileN) * m_tiles + w.m0 / S::kTileM;
    return sk_block_of(tile * k_tiles + k_tiles - 1) - w.split_tile + 1;
  };
  // log2 of the group size in rows of K (5, 6, 7)
  const int group_log2 = p.group_shift + 4;

  if (tid == 0) {
    for (int s = 0; s < S::kStages; s++) {
      mbar_init(&full[s], 1);  // the producer's arrival; the copies' bytes complete the phase
      mbar_init(&empty[s], S::kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the copy engine
  }
  __syncthreads();
  grid_dependency_wait();  // PDL: nothing the previous kernel may write is read before this

  // Tiles of the block: blockIdx.x, + gridDim.x, ... Consecutive tiles share a column tile (its
  // weights stay in L2) and walk down M. `it` counts the block's stages over all its tiles: the
  // ring slot and its phase follow from it, in the producer and the consumers alike.
  if (tid < 128) {
    // ---------------- producer: one thread issues every stage's tensor copies
    regs_dec<S::kProducerRegs>();
    if (tid != 0) return;
    const int group_rows = GROUPED ? max(1, S::kTileK >> group_log2) : 0;
    const int bytes = S::kActBytes + S::kPackedBytes + S::kMetaBytes + group_rows * S::kScaleRowBytes * (ZP ? 2 : 1);
    int it = 0;
    for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
      const Unit w = unit_at(unit);
      const int m0 = w.m0, n0 = w.n0;
      // the block's two 16 x 64 tiles of 4 k16 rows: one box of [4][256 words] (4-bit), or one per
      // tile (8-bit: a box row is at most 256 elements); 2:4: the two chunks' values of 2 strips,
      // a box of [2][256 words], and their metadata, [2][128 words]
      const int wx = 2 * S::kTileWords * (n0 / S::kTileN);
      for (int kt = w.kt0; kt < w.kt1; kt++, it++) {
        const int wy = SPARSE ? 2 * kt : 4 * kt;  // the stage's first row of b_q (and b_meta)
        const int slot = it % S::kStages;
        if (it >= S::kStages) mbar_wait(&empty[slot], (it / S::kStages - 1) & 1);  // both consumers are done with it
        uint8_t* st = smem + slot * S::kStageBytes;
        mbar_arrive_expect_tx(&full[slot], bytes);
        tma_load_2d(st, &pp.act, kt * S::kTileK, m0, &full[slot]);
        tma_load_2d(st + S::kActBytes, &pp.wq, wx, wy, &full[slot]);
        if constexpr (W == kU8)
          tma_load_2d(st + S::kActBytes + S::kPackedBytes / 2, &pp.wq, wx + S::kTileWords, wy, &full[slot]);
        if constexpr (SPARSE) tma_load_2d(st + S::kActBytes + S::kPackedBytes, &pp.meta, wx / 2, wy, &full[slot]);
        uint8_t* groups = st + S::kActBytes + S::kPackedBytes + S::kMetaBytes;
        if constexpr (GROUPED) tma_load_2d(groups, &pp.sc, n0, (kt * S::kTileK) >> group_log2, &full[slot]);
        if constexpr (ZP) tma_load_2d(groups + S::kZeroOffset, &pp.zp, n0, (kt * S::kTileK) >> group_log2, &full[slot]);
      }
    }
    return;
  }

  // ---------------- consumer warpgroups: dequantize their 64 columns into A fragments, then wgmma
  regs_inc<S::kConsumerRegs>();
  const int cw = (tid - 128) / 128;  // weight columns 64 cw .. 64 cw + 63 of the block
  const int wq = (tid % 128) / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  // Warp wq's wgmma rows are the weight columns 64 cw + 16 wq .. + 15. For k16 step ks of a stage,
  // lane (g, c) of the packed 16 x 64 tile cw holds an int4 (4-bit: words j = 0..3, word j for
  // columns 16 j + g and 16 j + 8 + g; 8-bit: two int4, words 2 j and 2 j + 1); its word wq is
  // this lane's A fragment: rows g, g + 8 (lo, hi), K rows 2c, 2c + 1 and 2c + 8, 2c + 9 of the
  // step. Scales (zero points): the u32 wq of the lane's 16-byte chunk cw * 8 + g of the step's
  // group row (16 ks) >> group_log2 holds those of columns g (low half) and g + 8 (high half).
  // 2:4 (the same words per strip, as 16 x 16 compressed values of 16 columns by 32 rows of K):
  // the metadata word of block wq is word wq % 2 of the 8 bytes of lane (wq < 2 ? lane : lane ^ 2)
  // of the chunk's strip row (selector 0: lanes with c = 0, 1 supply it; marlin_24_kernel.cuh).
  const int word_offset = W == kU8 ? (cw * 256 + 2 * lane) * 16 + 8 * wq : (cw * 32 + lane) * 16 + 4 * wq;
  constexpr int ks_stride = S::kStepBytes;  // bytes per k16 row (dense) or strip (2:4) of the block
  const int meta_offset = cw * 256 + (lane ^ (wq & 2)) * 8 + 4 * (wq & 1);
  const int group_offset = (cw * 8 + g) * 16 + 4 * wq;
  auto dequant_stage = [&](const uint8_t* st, uint32_t (&f)[S::kSteps][4], uint32_t (&e)[S::kSteps]) {
    const uint8_t* packed = st + S::kActBytes;
    const uint8_t* groups = st + S::kActBytes + S::kPackedBytes + S::kMetaBytes + group_offset;
#pragma unroll
    for (int ks = 0; ks < S::kSteps; ks++) {
      uint32_t lo[2], hi[2];
      // the step's group row: (kStepK ks) >> group_log2, which is 0 for groups of 64 and 128 (one
      // row per 64-deep stage); spelled so that the compiler sees that the steps share at most two
      // rows and loads each scale (zero-point) word and makes each zero-point constant once
      const int grow = group_log2 == 5 ? ((S::kStepK * ks) >> 5) * S::kScaleRowBytes : 0;
      if constexpr (SPARSE)
        e[ks] = *reinterpret_cast<const uint32_t*>(packed + S::kPackedBytes + ks * 512 + meta_offset);
      if constexpr (W == kU8) {
        const uint2 w2 = *reinterpret_cast<const uint2*>(packed + word_offset + ks * ks_stride);
        dequant_u8<T>(w2.x, lo);
        dequant_u8<T>(w2.y, hi);
      } else {
        const uint32_t w = *reinterpret_cast<const uint32_t*>(packed + word_offset + ks * ks_stride);
        if constexpr (ZP)
          dequant_u4<T, true>(w, lo, hi, u4_zero_pair<T>(*reinterpret_cast<const uint32_t*>(groups + S::kZeroOffset + grow)));
        else
          dequant_u4<T, false>(w, lo, hi, U4Zero{0, 0});
      }
      if constexpr (GROUPED) {
        const uint32_t s2 = *reinterpret_cast<const uint32_t*>(groups + grow);  // one load, split in registers
        const T* pair = reinterpret_cast<const T*>(&s2);
        scale_frag_t<T>(lo, pair[0]);
        scale_frag_t<T>(hi, pair[1]);
      }
      f[ks][0] = lo[0];
      f[ks][1] = hi[0];
      f[ks][2] = lo[1];
      f[ks][3] = hi[1];
    }
  };

  float acc[S::kAcc];
  uint32_t frag[2][S::kSteps][4];  // A fragments of two stages: one in the wgmma, one being made
  uint32_t meta[2][S::kSteps];     // 2:4: their metadata words
  // Stage `it` (the kt-th of the tile) from fragments frag[B]: issue its wgmma, make the next
  // stage's fragments in frag[B ^ 1] meanwhile (if the tile has one), then wait for the wgmma and
  // give the slot back. B is a template constant so that the fragments stay in fixed registers.
  auto step = [&](auto b, int it, bool next) {
    constexpr int B = decltype(b)::value;
    const int slot = it % S::kStages;
    const uint32_t sa = smem_addr(smem + slot * S::kStageBytes);
#pragma unroll
    for (int ks = 0; ks < S::kSteps; ks++) {
#pragma unroll
      for (int r = 0; r < 4; r++) fence_operand(frag[B][ks][r]);
      if constexpr (SPARSE) fence_operand(meta[B][ks]);
    }
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < S::kSteps; ks++) {
      // step ks: its rows of K are 2 x kStepK bytes into the activations' 128-byte rows
      const uint64_t desc = smem_desc_sw128(sa + 2 * S::kStepK * ks);
      if constexpr (SPARSE && TILE_M == 256)
        wgmma_sp_m64n256k32_rs<kIsBf16<T>>(acc, frag[B][ks], desc, meta[B][ks]);
      else if constexpr (SPARSE)
        wgmma_sp_m64k32_rs<128, kIsBf16<T>>(acc, frag[B][ks], desc, meta[B][ks]);
      else if constexpr (TILE_M == 256)
        wgmma_m64n256k16_rs<kIsBf16<T>>(acc, frag[B][ks], desc);
      else
        wgmma_m64k16_rs<128, true, kIsBf16<T>>(acc, frag[B][ks], desc);
    }
    wgmma_commit();
    if (next) {
      const int nslot = (it + 1) % S::kStages;
      mbar_wait(&full[nslot], ((it + 1) / S::kStages) & 1);
      dequant_stage(smem + nslot * S::kStageBytes, frag[B ^ 1], meta[B ^ 1]);
    }
    wgmma_wait<0>();
    mbar_arrive(&empty[slot]);
  };

  T* cout = reinterpret_cast<T*>(p.c);
  uint8_t* stage_c = epi + cw * S::kEpiBytes;  // [128 m][64 n] of T, rows of 128 bytes, swizzled
  int* last_flag = reinterpret_cast<int*>(empty + S::kStages);
  const int ct = tid - 128;  // consumer thread 0..255
  int it = 0;
  for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const Unit w = unit_at(unit);
    if (w.kt0 == w.kt1) continue;  // a stream-K block's piece past its last (the producer skips it too)
    const int m0 = w.m0, n0 = w.n0;
    const int n_k = w.kt1 - w.kt0;  // stages of this unit, >= 1
#pragma unroll
    for (int i = 0; i < S::kAcc; i++) acc[i] = 0.f;
    mbar_wait(&full[it % S::kStages], (it / S::kStages) & 1);
    dequant_stage(smem + (it % S::kStages) * S::kStageBytes, frag[0], meta[0]);
    int kt = 0;
    for (; kt + 2 <= n_k; kt += 2, it += 2) {
      step(std::integral_constant<int, 0>{}, it, true);
      step(std::integral_constant<int, 1>{}, it + 1, kt + 2 < n_k);
    }
    if (kt < n_k) {
      step(std::integral_constant<int, 0>{}, it, false);
      it++;
    }
#pragma unroll
    for (int i = 0; i < S::kAcc; i++) fence_operand(acc[i]);

    if (w.split_tile >= 0) {
      // This unit's partial, float4 i of consumer thread ct at [i][ct] (a warp's stores are 512
      // contiguous bytes), past L1; then the tile's arrival counter. The last to arrive adds
      // every part's partial in a fixed order (the last part's first, then the others in part
      // order): the sum does not depend on which unit came last. The K split's last part (more
      // stages than the others when p.split_stages > 0, so that they are done before it) looks
      // at the counter first: if every other part has arrived, it is the last, and adds theirs
      // to its own accumulators, the same sum bit for bit, without storing its partial or
      // arriving: the store and the release are off the tile's critical path.
      float4* const tile_partial = reinterpret_cast<float4*>(p.partial) +
                                   static_cast<long long>(stream_k ? 2 * w.split_tile : w.split_tile * parts) * S::kPartialF4;
      const int tile_parts = unit_parts(w);
      bool others_in = false;
      if (!stream_k && p.fast_sum && w.part == parts - 1) {
        if (ct == 0) {
          const int seen = load_acquire_gpu(p.locks + w.split_tile);
          if (seen == parts - 1) p.locks[w.split_tile] = 0;  // nobody else arrives: left at zero
          *last_flag = seen;
        }
        named_barrier(3, S::kConsumers);  // after thread 0's acquire
        others_in = *last_flag == parts - 1;
      }
      if (!others_in) {
        float4* const mine = tile_partial + w.part * S::kPartialF4;
#pragma unroll
        for (int i = 0; i < S::kAcc / 4; i++) __stcg(mine + i * 256 + ct, make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]));
        named_barrier(3, S::kConsumers);  // every consumer thread's share is stored
        if (ct == 0) {
          const int arrived = arrive_acq_rel_gpu(p.locks + w.split_tile);  // publishes the shares (release)
          if (arrived == tile_parts - 1) p.locks[w.split_tile] = 0;       // left at zero for the next call
          *last_flag = arrived;
        }
        named_barrier(3, S::kConsumers);  // after thread 0's acquire: the other units' partials are visible
        if (*last_flag != tile_parts - 1) continue;
        if (w.part != tile_parts - 1) {  // the sum starts from the last part's partial
#pragma unroll
          for (int i = 0; i < S::kAcc / 4; i++) {
            const float4 v = __ldcg(tile_partial + (tile_parts - 1) * S::kPartialF4 + i * 256 + ct);
            acc[4 * i] = v.x, acc[4 * i + 1] = v.y, acc[4 * i + 2] = v.z, acc[4 * i + 3] = v.w;
          }
        }
      }
      // The sum: the last part's partial, then parts 0, 1, ... in order, whoever adds them. One
      // part at a time, each thread's 16 (32) float4 loads of a part in flight together: a loop
      // over the parts inside the one over a thread's float4 made every load wait for the one
      // before it, 16 L2 round trips (3 us) for a single partial (per-unit timer stamps).
      for (int j = 0; j < tile_parts - 1; j++) {
#pragma unroll
        for (int i = 0; i < S::kAcc / 4; i++) {
          const float4 v = __ldcg(tile_partial + j * S::kPartialF4 + i * 256 + ct);
          acc[4 * i] += v.x, acc[4 * i + 1] += v.y, acc[4 * i + 2] += v.z, acc[4 * i + 3] += v.w;
        }
      }
    }

    // ---------------- epilogue: T through shared memory, then 16-byte stores along N, 128 rows
    // at a time (TILE_M / 128 halves); the producer meanwhile fills the ring with the next tile's
    // first stages
    const int n_lo = n0 + 64 * cw + 16 * wq + g;  // this thread's two weight columns: n_lo, n_lo + 8
    float s_lo, s_hi;
    if constexpr (GROUPED) {
      // 1, but from a kernel argument (p.m >= 0): converting the accumulators without a multiply
      // made ptxas serialize every wgmma of the kernel (C7514, "non wgmma instructions reading
      // accumulator registers"); with one it does not.
      s_lo = s_hi = __int_as_float(0x3f800000 | (p.m >> 31));
    } else {
      const T* sc = reinterpret_cast<const T*>(p.s);
      s_lo = Elem<T>::to_float(sc[n_lo]), s_hi = Elem<T>::to_float(sc[n_lo + 8]);
    }
    const int nl = 16 * wq + g;  // column in the warpgroup's 64
    const int t = tid % 128, chunk = t % 8;
#pragma unroll
    for (int h = 0; h < S::kTileM / 128; h++) {
      named_barrier(1 + cw, 128);  // the buffer's previous rows are stored
#pragma unroll
      for (int t8 = 0; t8 < 16; t8++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int m = 8 * t8 + 2 * c + (e & 1);
          const int n = nl + 8 * (e >> 1);
          const float v = acc[4 * (16 * h + t8) + e] * (e >> 1 ? s_hi : s_lo);
          *reinterpret_cast<T*>(stage_c + sw128(m, n / 8) + (n % 8) * 2) = Elem<T>::from_float(v);
        }
      }
      named_barrier(1 + cw, 128);
#pragma unroll
      for (int i = 0; i < 8; i++) {
        const int r = t / 8 + 16 * i;
        const int row = m0 + 128 * h + r;
        if (row < p.m)
          *reinterpret_cast<int4*>(cout + static_cast<long long>(row) * p.n + n0 + 64 * cw + 8 * chunk) =
              *reinterpret_cast<const int4*>(stage_c + sw128(r, chunk));
      }
    }
  }
#endif
}

}  // namespace marlin
