// The 2:4-sparse MARLIN kernel (Sparse-MARLIN): C^T = dequant(B)^T A^T on the sparse tensor cores.
//
// mma.sp.m16n8k32 takes its sparse operand on the left, so the weights are the 16-row operand
// (16 columns of N by 32 rows of K, stored as 16 x 16 compressed values plus 2-bit positions) and
// a slice of 8 MB rows of A is the 8-wide n of the instruction, as in the small-batch kernel
// (smallm_kernel.cuh). The format (marlin/sparse.py) makes the reuse direct:
//  * A lane's 16 bytes of a packed strip tile are its four A fragments (one per 16-column block)
//    exactly as in the dense small-batch kernel, decoded by the same dequant_u4 (dequant.cuh).
//  * A lane's 8 bytes of b_meta are the metadata registers of blocks 2 (c / 2) and 2 (c / 2) + 1
//    (made for selector j / 2). This kernel reads its own and lane ^ 2's 8 bytes and issues every
//    instruction with selector 0, so that it relies only on selector 0's documented lane pair.
//  * The activations of a k32 step are one ldmatrix.x4 per n8 tile (4 x 8 columns of K).
// Structure:
//  * Block = NW x MS warps, tile = 64 NW columns of N (one 64-column chunk per warp) by a slice
//    of 8 MB MS rows of A: warp (wn, ws) computes chunk wn for rows 8 MB ws .. 8 MB (ws + 1) - 1.
//    With MS = 2 every weight of a stage is read from memory once for 64 rows (the MS warps of a
//    chunk each dequantize it from shared memory, which is cheaper than streaming it again).
//  * Stage = 128 rows of the original K (4 strips), STAGES-deep cp.async ring for the
//    activations, values, metadata and group scales of a stage: one scale row (group 128) in the
//    stage itself; for groups of 64 or 32 rows, and with zero points, one scale (and zero-point)
//    row per strip in an area after the ring (StageScales below, the FINE kernels), so that
//    group 128 keeps its shared memory and occupancy.
//  * Grid (1-D) = row slices x column tiles x K parts, the parts of a tile consecutive (block
//    index (slice * n_tiles + tile) * parts + part). Each block sums its K range in fp32 (group
//    scales applied to fp32 group sums; groups of 64 or 32, and the WG loop, apply them to the
//    dequantized weights instead). With one part it writes C (per-column scales applied).
//    With several, either (cluster_reduce, sm_90+) the parts of a tile are one thread-block
//    cluster: each block leaves its fp32 partial in its own shared memory and adds 1/parts of
//    the tile from all of them through distributed shared memory, in rank order; or each writes
//    its fp32 partial past L1 and the last block of the tile to arrive (last_to_arrive, ptx.cuh:
//    one acquire-release counter per tile, left at zero) adds the partials in part order. Either
//    way the result does not depend on the arrival order.
//  * WG instances (sm_90a, Shape and main_loop_wg below): the same stages, partition and
//    epilogue, with the sparse wgmma instead of mma.sp in the main loop.
//  * Programmatic dependent launch (sm_90+, pdl in the launch): nothing is read or written before
//    grid_dependency_wait(), and the next kernel of the stream may be scheduled once the first
//    stages are in flight.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "../dequant.cuh"
#include "../k_half_sums.cuh"
#include "../ptx.cuh"
#include "../wgmma.cuh"
#include "marlin_24_launch.h"

namespace marlin {
namespace sparse24 {



// MB: n8 tiles per warp slice (8 MB rows of A); NW: 64-column chunks per tile; MS: warp slices
// per block slice; KW: warpgroups along K (WG only). One warp per chunk, warp slice and K half.
// WG (sm_90a): the sparse wgmma (wgmma.mma_async.sp) instead of mma.sp. The NW = 4 warps of a
// warp slice are one warpgroup: for each 32-row strip and 16-column block j, one
// m64 n(8 MB) k32 instruction takes every warp's block j (its 16 columns are rows 16 w .. of the
// instruction's 64) with the weights dequantized in registers and the metadata word exactly as
// for mma.sp (the per-warp layouts are the same), and reads the slice's activations from shared
// memory by descriptor. One instruction replaces MB mma.sp per warp, which is what made the
// mma.sync kernel issue-bound from 16 rows on. The activations of a stage are then stored as two
// 64-half blocks of K, [row][8 chunks] each with the 128-byte swizzle (wgmma.cuh), and a stage
// is padded to 1 KB so that every stage starts on a swizzle atom.
// KW = 2 (WG, one warp slice): two warpgroups on the same rows, each taking two of a stage's
// four strips (the dense wgmma instances' two K warpgroups, smallm_kernel.cuh): twice the warps
// to dequantize and issue per block, the upper warpgroup's sums added into the lower's through
// the drained pipeline's shared memory before the epilogue.
template <int MB, int NW, int MS, bool WG = false, int KW = 1>
struct Shape {
  static_assert(!WG || (NW == 4 && (MB == 2 || MB == 4 || MB == 8) && (MS == 1 || MS == 2)),
                "WG: one warpgroup (NW = 4) per warp slice of 16, 32 or 64 rows, one or two slices");
  static_assert(KW == 1 || (WG && KW == 2 && MS == 1), "two K warpgroups: WG instances with one warp slice");
  static constexpr int kThreads = 32 * NW * MS * KW;
  static constexpr int kTileN = 64 * NW;
  static constexpr int kWarpRows = 8 * MB;
  static constexpr int kRows = kWarpRows * MS;            // rows of A per block slice
  static constexpr int kAStage = kRows * (kStageK / 8);  // int4: 16 per row
  static constexpr int kBStage = kStrips * NW * 32;      // int4: a lane's 16 bytes per chunk and strip
  static constexpr int kMStage = kStrips * NW * 16;      // int4: a lane's 8 bytes per chunk and strip
  static constexpr int kSStage = NW * 8;                 // int4: one scale row (the tile's 64 NW columns)
  static constexpr int kStageInt4 = (kAStage + kBStage + kMStage + kSStage + (WG ? 63 : 0)) / (WG ? 64 : 1) * (WG ? 64 : 1);
  // cluster reduction: the block's fp32 partial [kRows][kPartStride] over the drained pipeline
  // (the padding spreads the rows 2 c4 of a warp's stores over the banks)
  static constexpr int kPartStride = kTileN + 4;
  static constexpr int kPartBytes = kRows * kPartStride * 4;
  // KW = 2: the upper warpgroup's sums (16 MB floats per thread) over the drained pipeline
  static constexpr int kRedBytes = (KW - 1) * NW * 32 * 16 * MB * 4;
  // WG: + 1 KB to align the dynamic shared memory to the 1024-byte swizzle atom
  template <int STAGES>
  static constexpr int smem_bytes() {
    return STAGES * kStageInt4 * 16 + (WG ? 1024 : 0);
  }
};

// lo, hi (the B fragments of a 16x16 block: columns g and 8 + g) times the scales of those two
// columns, the low and high half of s; the broadcasts fold into the multiplications' operands
// (built as separate pairs first, they took a PRMT each).
template <typename ET>
__device__ __forceinline__ void scale_by_pair(uint32_t (&lo)[2], uint32_t (&hi)[2], uint32_t s) {
  typename Elem<ET>::T2 s_lo, s_hi;
  if constexpr (kIsBf16<ET>)
    s_lo = __low2bfloat162(as_t2<ET>(s)), s_hi = __high2bfloat162(as_t2<ET>(s));
  else
    s_lo = __low2half2(as_t2<ET>(s)), s_hi = __high2half2(as_t2<ET>(s));
  lo[0] = as_u32<ET>(__hmul2(as_t2<ET>(lo[0]), s_lo));
  lo[1] = as_u32<ET>(__hmul2(as_t2<ET>(lo[1]), s_lo));
  hi[0] = as_u32<ET>(__hmul2(as_t2<ET>(hi[0]), s_hi));
  hi[1] = as_u32<ET>(__hmul2(as_t2<ET>(hi[1]), s_hi));
}

// The fine loops' scales and zero points (groups of 64 or 32 rows, or zero points at any group
// size): one row per strip, the row of the strip's group (group 64 copies each row twice, group
// 128 four times), kStrips scale rows per ring slot in the area after the STAGES-deep ring, then
// the zero-point rows. Per strip rather than per group, so that the loops address a strip's rows
// at a constant offset and keep no group size in registers (the 64-row wgmma instances are at
// their register limit). shift: log2 of the strips per group (2: group 128, 1: group 64, 0: group
// 32).
// The loops read both rows of every strip unconditionally: where a kind of row is not streamed
// its rows are written once before the loop (per column: scale rows of 1, the zero-point row
// permuted into every slot; without zero points: one row of 8s, zero_stride 0). A branch on the
// format around each strip's scale and zero-point code split the unrolled stage into a chain of
// small basic blocks, which kept ptxas from hoisting the next strip's shared loads (sm_90a, MB 1:
// 25 branches and 588 instructions per stage against 335 for group 128).
template <int MB, int NW, int MS, bool WG, int KW, int STAGES>
struct StageScales {
  using S = Shape<MB, NW, MS, WG, KW>;
  int4* smem;  // the ring's start
  int shift;
  int zero_stride;  // int4 from one strip's zero-point row to the next: kSStage, or 0 (one row of 8s)
  __device__ __forceinline__ int4* strip_row(int slot, int u) const {
    return smem + STAGES * S::kStageInt4 + (slot * kStrips + u) * S::kSStage;
  }
  __device__ __forceinline__ int4* zero_row(int slot, int u) const {
    return smem + STAGES * S::kStageInt4 + STAGES * kStrips * S::kSStage + (slot * kStrips + u) * zero_stride;
  }
  // The lane's scales (word j: the pair of fragment rows g and g + 8 of block j, for
  // scale_by_pair) and zero-point constants (u4_zero_pair) of strip u (idx = wn * 8 + g: the
  // b_scales permutation puts column 16 j + g at position 8 g + 2 j and 16 j + 8 + g at
  // 8 g + 2 j + 1; the pair (z_lo, z_hi) of block j is word j of the zero-point row's int4).
  template <typename ET>
  __device__ __forceinline__ void strip_params(int slot, int u, int idx, uint32_t (&sw)[4], U4Zero (&z)[4]) const {
    const int4 sv = strip_row(slot, u)[idx];
    const int4 zv = zero_row(slot, u)[idx];
    sw[0] = static_cast<uint32_t>(sv.x), sw[1] = static_cast<uint32_t>(sv.y);
    sw[2] = static_cast<uint32_t>(sv.z), sw[3] = static_cast<uint32_t>(sv.w);
    z[0] = u4_zero_pair<ET>(static_cast<uint32_t>(zv.x)), z[1] = u4_zero_pair<ET>(static_cast<uint32_t>(zv.y));
    z[2] = u4_zero_pair<ET>(static_cast<uint32_t>(zv.z)), z[3] = u4_zero_pair<ET>(static_cast<uint32_t>(zv.w));
  }
  // The rows the fetch does not stream, written once before the loop (the caller's barrier makes
  // them visible): per column (!grouped), every scale row 1 and every zero-point row the one row
  // of p.z in the grouped permutation; without zero points, the one row of 8s.
  template <typename ET>
  __device__ __forceinline__ void write_constant_rows(const Params& p, int nt, int tid, bool grouped, bool zeros) const {
    constexpr int kThreads = S::kThreads;
    static_assert(kThreads % S::kSStage == 0, "each thread keeps one int4 of a row");
    const int o = tid % S::kSStage;
    if (!grouped) {
      const uint32_t one = kIsBf16<ET> ? 0x3F803F80u : 0x3C003C00u;
      for (int x = tid; x < STAGES * kStrips * S::kSStage; x += kThreads) strip_row(0, 0)[x] = make_int4(one, one, one, one);
    }
    if (zeros && !grouped) {
      // one row in natural column order (b_scales' layout for one group, packing.permute_scales),
      // read in the grouped permutation (position 8 i + j of a 64-column chunk is column i + 8 j):
      // the thread's int4 o of the row (chunk o / 8, positions 8 (o % 8) + j)
      const ET* zc = reinterpret_cast<const ET*>(p.z) + nt * S::kTileN;
      alignas(16) ET v[8];
#pragma unroll
      for (int j = 0; j < 8; j++) v[j] = zc[(o / 8) * 64 + o % 8 + 8 * j];
      for (int x = tid; x < STAGES * kStrips * S::kSStage; x += kThreads) zero_row(0, 0)[x] = *reinterpret_cast<const int4*>(v);
    }
    if (!zeros && tid < S::kSStage) {
      const uint32_t eight = kIsBf16<ET> ? 0x41004100u : 0x48004800u;
      zero_row(0, 0)[tid] = make_int4(eight, eight, eight, eight);
    }
  }
};

// D += A * B on the sparse tensor cores: A 16 x 32 (2:4, compressed to 16 x 16 in a), B 32 x 8,
// fp16 (BF16: bf16) in, metadata e from the lane pair chosen by SEL (the same layout for both
// 16-bit types). The format always stores a group's two positions
// in increasing order, which is what ::ordered_metadata requires (ptxas advises it over plain .sp
// on sm_90; CUDA 12.5 and later know it).
#if defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 5))
#define MARLIN_MMA_SP "mma.sp::ordered_metadata"
#else
#define MARLIN_MMA_SP "mma.sp"
#endif
template <int SEL, bool BF16>
__device__ __forceinline__ void mma_sp_16832(const uint32_t (&a)[4], const uint32_t (&b)[4], uint32_t e, float (&d)[4]) {
#define MARLIN_MMA_SP_ACC(TY)                                                                                      \
  asm volatile(MARLIN_MMA_SP ".sync.aligned.m16n8k32.row.col.f32." TY "." TY ".f32 "                                \
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, %13;\n"            \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                   \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e), \
                 "n"(SEL))
  if constexpr (BF16)
    MARLIN_MMA_SP_ACC("bf16");
  else
    MARLIN_MMA_SP_ACC("f16");
#undef MARLIN_MMA_SP_ACC
}

// D = A * B (no accumulator input: the first product of a group's sum, which saves zeroing it).
template <int SEL, bool BF16>
__device__ __forceinline__ void mma_sp_16832_first(const uint32_t (&a)[4], const uint32_t (&b)[4], uint32_t e, float (&d)[4]) {
#define MARLIN_MMA_SP_FIRST(TY)                                                                                    \
  asm volatile(MARLIN_MMA_SP ".sync.aligned.m16n8k32.row.col.f32." TY "." TY ".f32 "                                \
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%14, %14, %14, %14}, %12, %13;\n"        \
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                                   \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e), \
                 "n"(SEL), "f"(0.f))
  if constexpr (BF16)
    MARLIN_MMA_SP_FIRST("bf16");
  else
    MARLIN_MMA_SP_FIRST("f16");
#undef MARLIN_MMA_SP_FIRST
}

// WG main loop (sm_90a; see Shape): the block's stages kt0 .. kt0 + n_k - 1 into tot, the group
// scales applied to the dequantized fp16 weights (as the dense wgmma instances do from 32 rows
// on: a group-sum path would have to wait for every wgmma at each group's end), per-column scales
// left to the epilogue. Each 32-row strip is one wgmma group per block j (4 instructions), kept
// one group deep: the wait after a strip's commit ends the previous strip's group, whose A
// fragments and metadata registers (double buffered) are refilled next.
// Ring: a wgmma reads its activations from shared memory until its wait, so at a barrier before
// stage i's first strip the last group of stage i - 1 may still run in some warp.
//  * early refill (LATE = false): the barrier before stage i's first strip; the refill after it
//    takes the slot of stage i - 2 (every group of that stage has ended in every warp), so
//    STAGES - 2 stages are in flight ahead of the one computed.
//  * late refill (LATE = true): the barrier that makes stage i + 1 visible comes before stage i's
//    last strip is issued, after every warp's wait at strip 0 has ended stage i - 1's last
//    group; the refill after that barrier (and that strip's issue) takes stage i - 1's slot, so
//    STAGES - 1 stages are in flight with one barrier per stage as well (the dense wgmma
//    instances' late refill, smallm_kernel.cuh).
// KW = 2: warpgroup wk takes strips 2 wk and 2 wk + 1 of each stage (the same 64-half block of
// K); "a stage's last strip" below is then each warpgroup's second, and every warp still waits at
// its first strip of stage i for its own last group of stage i - 1.
// FINE (groups of 64 or 32 rows, or zero points): each strip's scales and zero points from its
// StageScales rows (a separate instantiation, so that the plain loop keeps its code and registers).
template <int MB, int NW, int MS, int STAGES, bool LATE, int KW, bool FINE, typename ET, typename Fetch>
__device__ __forceinline__ void main_loop_wg(const int4* smem, Fetch& fetch, float (&tot)[4][MB][4], int kt0, int n_k, int wn,
                                             int wrow0, int wk, int lane, int g, bool grouped,
                                             const StageScales<MB, NW, MS, true, KW, STAGES>& scales) {
  using S = Shape<MB, NW, MS, true, KW>;
  constexpr int kAhead = LATE ? STAGES - 1 : STAGES - 2;
  constexpr int kLocal = kStrips / KW;  // strips per warpgroup and stage
  static_assert(kLocal >= 2 && kLocal % 2 == 0, "the A fragments' double buffer alternates within a stage");
#pragma unroll
  for (int s = 0; s < kAhead; s++) {
    if (s < n_k) fetch(kt0 + s, s);
    cp_async_commit();
  }
  grid_launch_dependents();
  if constexpr (LATE) {  // stage 0 visible to all (later stages: at the previous stage's last strip)
    cp_async_wait<kAhead - 1>();
    fence_proxy_async_smem();
    __syncthreads();
  }
  // the descriptor's low word moves with the stage, strip and warp slice; its high word is fixed
  // (start address >> 4 stays within bits 0-13 for any offset inside 227 KB)
  // per warp, fixed over the loop: the warp slice's rows and the warpgroup's 64-half block of K
  // in the activations (in the descriptor's base), the warp's first (strip, chunk) in the weights
  // and metadata
  const uint64_t desc0 = smem_desc_sw128(smem_addr(smem) + wrow0 * 128 + wk * (kLocal / 2) * S::kRows * 128);
  const uint64_t desc_hi = desc0 & ~0xFFFFFFFFull;
  const int strip_chunk = wk * kLocal * NW + wn;
  uint32_t afrag[2][4][4];  // [buffer][block j][register]
  uint32_t meta[2][4];      // [buffer][block j]
  for (int i = 0; i < n_k; i++) {
    if constexpr (!LATE) {
      cp_async_wait<kAhead - 1>();
      fence_proxy_async_smem();  // cp.async wrote what the wgmma reads
      __syncthreads();           // stage i landed for every thread; stage i - 2's wgmma ended in every warp
      if (i + kAhead < n_k) fetch(kt0 + i + kAhead, (i + kAhead) % STAGES);
      cp_async_commit();
    }

    const int slot = i % STAGES;
    const int4* sb = smem + slot * S::kStageInt4 + S::kAStage;
    const int4* sm = sb + S::kBStage;
    // the lane's group scales (b_scales permutation: position 8 g + 2 j is column 16 j + g, + 1 is
    // column 16 j + 8 + g, i.e. fragment rows g and g + 8 of block j), of the group of the
    // warpgroup's first strip of the stage
    using T2 = typename Elem<ET>::T2;
    T2 s_lo[4], s_hi[4];
    U4Zero zz[4];    // FINE: the strip's zero-point constants
    uint32_t sw[4];  // FINE: the strip's scale pairs
    if constexpr (!FINE) {
      if (grouped) {
        const int4 sv = sm[S::kMStage + wn * 8 + g];
        const ET* sc = reinterpret_cast<const ET*>(&sv);
#pragma unroll
        for (int j = 0; j < 4; j++) s_lo[j] = T2{sc[2 * j], sc[2 * j]}, s_hi[j] = T2{sc[2 * j + 1], sc[2 * j + 1]};
      }
    }
    uint32_t desc_lo = static_cast<uint32_t>(desc0);
    fence_operand(desc_lo);  // add the offsets here, not one 64-bit descriptor per strip kept alive
    desc_lo += static_cast<uint32_t>(slot * S::kStageInt4 * 16) >> 4;
#pragma unroll
    for (int l = 0; l < kLocal; l++) {
      const int buf = l % 2;
      if constexpr (FINE) scales.template strip_params<ET>(slot, wk * kLocal + l, wn * 8 + g, sw, zz);
      const int4 wq4 = sb[(l * NW + strip_chunk) * 32 + lane];
      // metadata as in the mma.sync loop: the lane's words (blocks 0, 1) and lane ^ 2's (2, 3), selector 0
      const uint2* mrow = reinterpret_cast<const uint2*>(sm + (l * NW + strip_chunk) * 16);
      const uint2 mw = mrow[lane], mw2 = mrow[lane ^ 2];
      meta[buf][0] = mw.x, meta[buf][1] = mw.y, meta[buf][2] = mw2.x, meta[buf][3] = mw2.y;
      const uint32_t wq[4] = {static_cast<uint32_t>(wq4.x), static_cast<uint32_t>(wq4.y), static_cast<uint32_t>(wq4.z),
                              static_cast<uint32_t>(wq4.w)};
#pragma unroll
      for (int j = 0; j < 4; j++) {
        uint32_t lo[2], hi[2];
        if constexpr (FINE)
          dequant_u4<ET, true>(wq[j], lo, hi, zz[j]);  // u - z (z = 8 without zero points)
        else
          dequant_u4<ET, false>(wq[j], lo, hi, U4Zero{});
        if constexpr (FINE) {
          scale_by_pair<ET>(lo, hi, sw[j]);  // per column: scale rows of 1
        } else if (grouped) {
          lo[0] = as_u32<ET>(__hmul2(as_t2<ET>(lo[0]), s_lo[j]));
          lo[1] = as_u32<ET>(__hmul2(as_t2<ET>(lo[1]), s_lo[j]));
          hi[0] = as_u32<ET>(__hmul2(as_t2<ET>(hi[0]), s_hi[j]));
          hi[1] = as_u32<ET>(__hmul2(as_t2<ET>(hi[1]), s_hi[j]));
        }
        afrag[buf][j][0] = lo[0];
        afrag[buf][j][1] = hi[0];
        afrag[buf][j][2] = lo[1];
        afrag[buf][j][3] = hi[1];
      }
#pragma unroll
      for (int j = 0; j < 4; j++) {
#pragma unroll
        for (int r = 0; r < 4; r++) fence_operand(afrag[buf][j][r]);
        fence_operand(meta[buf][j]);
      }
      // strip u = kLocal wk + l: 64-half block u / 2 of the stage, 64 bytes per strip inside it
      const uint64_t desc = desc_hi | (desc_lo + (((l / 2) * S::kRows * 128 + (l % 2) * 64) >> 4));
      if (LATE && l == kLocal - 1) {
        // stage i + 1 landed (committed after it: the kAhead - 2 later stages), visible to all;
        // every warp has waited for stage i - 1's last group (at strip 0 of this stage)
        cp_async_wait<(LATE ? kAhead - 2 : 0)>();
        fence_proxy_async_smem();
        __syncthreads();
      }
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < 4; j++)
        wgmma_sp_m64k32_rs<8 * MB, kIsBf16<ET>>(reinterpret_cast<float(&)[4 * MB]>(tot[j]), afrag[buf][j], desc, meta[buf][j]);
      wgmma_commit();
      wgmma_wait<1>();
      if (LATE && l == kLocal - 1) {  // stage i + kAhead into stage i - 1's slot
        if (i + kAhead < n_k) fetch(kt0 + i + kAhead, (i + kAhead) % STAGES);
        cp_async_commit();
      }
    }
  }
  // every group has landed before the epilogue reads tot (the empty asm pins the reads after it)
  wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < 4; j++)
#pragma unroll
    for (int b = 0; b < MB; b++)
#pragma unroll
      for (int e = 0; e < 4; e++) fence_operand(tot[j][b][e]);
}

// WG: 0 the mma.sync loop, 1 the wgmma loop with early refill, 2 with late refill (main_loop_wg).
// ET: the element type of a, s and c (half or nv_bfloat16).
// FINE: the kernel of fine plans (groups of 64 or 32 rows, or zero points; see the main loop
// below), a separate kernel so that the plain one keeps its registers, code and speed.
template <int MB, int NW, int MS, int STAGES, int WG = 0, int KW = 1, typename ET = half, bool FINE = false>
__global__ void __launch_bounds__(32 * NW * MS * KW) marlin_24_kernel(const Params p) {
  using E = Elem<ET>;
  constexpr bool kBf16 = kIsBf16<ET>;
  ET* const c_out = static_cast<ET*>(p.c);
  const ET* const s_in = reinterpret_cast<const ET*>(p.s);
  using S = Shape<MB, NW, MS, WG != 0, KW>;
  constexpr int kThreads = S::kThreads;
  static_assert(S::kPartBytes <= STAGES * S::kStageInt4 * 16, "the cluster partial must fit the pipeline's shared memory");
  static_assert(S::kRedBytes <= STAGES * S::kStageInt4 * 16, "the K warpgroups' sums must fit the pipeline's shared memory");
  static_assert(!WG || STAGES >= 3, "the wgmma loop needs at least 3 stages");
  static_assert(kStrips * S::kSStage <= S::kThreads, "a stage's scale rows take one 16-byte copy per thread");
#if !MARLIN_HAS_WGMMA
  // A wgmma instance built for another target than sm_90a is never launched (plan_24): a trap stub.
  if constexpr (WG) {
    __trap();
    return;
  }
#endif
  extern __shared__ int4 smem_raw[];
  int4* smem = smem_raw;
  if constexpr (WG) smem += ((1024 - (smem_addr(smem_raw) & 1023)) & 1023) / 16;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  // chunk, warp slice and K warpgroup of this warp
  // (constants where the instance has one warp per chunk: a run-time 0 there cost registers)
  const int wn = MS * KW == 1 ? warp : warp % NW, ws = MS == 1 ? 0 : (warp / NW) % MS;
  const int wk = KW == 1 ? 0 : warp / (NW * MS);
  const int g = lane / 4, c4 = lane % 4;

  const int n_tiles = p.n / S::kTileN;
  const int part = blockIdx.x % p.parts;     // K part (= cluster rank with cluster_reduce)
  const int col = blockIdx.x / p.parts;      // slice * n_tiles + column tile
  const int nt = col % n_tiles;
  const int row0 = (col / n_tiles) * S::kRows;  // first row of the block slice
  const int rows = min(S::kRows, p.m - row0);
  const int wrow0 = ws * S::kWarpRows;        // the warp's first row in the slice
  const int k_tiles = p.k / kStageK;
  const int kt0 = part * k_tiles / p.parts, kt1 = (part + 1) * k_tiles / p.parts;
  const int n_k = kt1 - kt0;
  const bool grouped = p.groups > 1;
  const bool zeros = p.z != nullptr;
  // the fine kernels' per-strip rows (strip_shift: log2 of the strips per scale group)
  const StageScales<MB, NW, MS, WG != 0, KW, STAGES> scales{smem, p.strip_shift, zeros ? S::kSStage : 0};

  const long long bq_row = p.n / 2;  // int4 per row of b_q (one strip)
  const long long bm_row = p.n / 4;  // int4 per row of b_meta

  // One stage: rows of A x 128 halves (16-byte chunk ch of row r at r * 16 + (ch ^ r % 8)), the
  // tile's values and metadata of 4 strips, and (grouped) the tile's 64 NW scales: the stage's
  // group row, or (fine) the row of each strip's group into StageScales (one int4 per thread).
  auto fetch = [&](int kt, int slot) {
    int4* sh = smem + slot * S::kStageInt4;
    // the copies as loops of compile-time trip counts over this thread's int4 (the thread's
    // chunk, strip offset and column are the same in every iteration, since kThreads is a
    // multiple of each area's row): no remainder paths, no per-iteration divisions
#pragma unroll
    for (int i = 0; i < (S::kAStage + kThreads - 1) / kThreads; i++) {
      const int r = tid / 16 + i * (kThreads / 16), ch = tid % 16;
      if (S::kAStage % kThreads != 0 && r >= S::kRows) break;
      const bool ok = r < rows;
      const int4* src = ok ? p.a + (row0 + r) * p.lda_int4 + kt * (kStageK / 8) + ch : p.a;
      // WG: [64-half block of K][row][8 chunks], 128-byte swizzle (the wgmma's B operand)
      const int at = WG ? (ch / 8) * (S::kRows * 8) + r * 8 + ((ch % 8) ^ (r % 8)) : r * 16 + (ch ^ (r % 8));
      cp_async16_zfill(sh + at, src, ok);
    }
    int4* sb = sh + S::kAStage;
#pragma unroll
    for (int i = 0; i < (S::kBStage + kThreads - 1) / kThreads; i++) {
      const int x = tid + i * kThreads;
      const int st = tid / (NW * 32) + i * (kThreads / (NW * 32)), o = tid % (NW * 32);
      if (S::kBStage % kThreads != 0 && st >= kStrips) break;
      cp_async16_evict_first(sb + x, p.b_q + (static_cast<long long>(kt) * kStrips + st) * bq_row + nt * NW * 32 + o);
    }
    int4* sm = sb + S::kBStage;
#pragma unroll
    for (int i = 0; i < (S::kMStage + kThreads - 1) / kThreads; i++) {
      const int x = tid + i * kThreads;
      const int st = tid / (NW * 16) + i * (kThreads / (NW * 16)), o = tid % (NW * 16);
      if (S::kMStage % kThreads != 0 && st >= kStrips) break;
      cp_async16_evict_first(sm + x, p.b_meta + (static_cast<long long>(kt) * kStrips + st) * bm_row + nt * NW * 16 + o);
    }
    if constexpr (FINE) {
      // grouped: the scale row (and zero-point row) of each strip's group, one int4 of each per
      // thread (per column the zero-point rows never change: written once before the loop, below)
      constexpr int kStripRows = kStrips * S::kSStage;  // int4 of a stage's per-strip rows of one kind
      if (grouped && tid < kStripRows) {
        const int u = tid / S::kSStage, o = tid % S::kSStage;
        const long long src = static_cast<long long>((kt * kStrips + u) >> scales.shift) * (p.n / 8) + nt * NW * 8 + o;
        cp_async16(scales.strip_row(slot, u) + o, p.s + src);
        if (zeros) cp_async16(scales.zero_row(slot, u) + o, p.z + src);
      }
    } else if (grouped && tid < S::kSStage) {
      cp_async16(sm + S::kMStage + tid, p.s + static_cast<long long>(kt) * (p.n / 8) + nt * NW * 8 + tid);
    }
  };

  float tot[4][MB][4];  // [16-column block j][n8 tile b][fragment element]
  float grp[4][MB][4];
#pragma unroll
  for (int j = 0; j < 4; j++)
#pragma unroll
    for (int b = 0; b < MB; b++)
#pragma unroll
      for (int e = 0; e < 4; e++) tot[j][b][e] = 0.f;

  // ldmatrix.x4 for n8 tile b, k32 step u: matrix q = lane / 8 is 16-byte chunk 4 u + q of rows
  // wrow0 + 8 b .. + 7; lane supplies row wrow0 + 8 b + lane % 8.
  const int ld_row = lane % 8, ld_q = lane / 8;

  // Programmatic dependent launch: the previous kernel of the stream may still be running until
  // here (A, the locks and C may be its inputs or outputs).
  grid_dependency_wait();
  if constexpr (FINE) {
    scales.template write_constant_rows<ET>(p, nt, tid, grouped, zeros);
    __syncthreads();  // the loops' first reads follow barriers of one warpgroup only
  }
  // The main loop: one scale row per stage (group 128, per column), or (FINE) each strip's scale
  // and zero-point rows applied to the dequantized weights.
  if constexpr (WG) {
    main_loop_wg<MB, NW, MS, STAGES, WG == 2, KW, FINE, ET>(smem, fetch, tot, kt0, n_k, wn, wrow0, wk, lane, g, grouped,
                                                              scales);
  } else {
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < n_k) fetch(kt0 + s, s);
    cp_async_commit();
  }
  grid_launch_dependents();
  for (int i = 0; i < n_k; i++) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage i landed for every thread; every warp is done with stage i - 1's slot
    if (i + STAGES - 1 < n_k) fetch(kt0 + i + STAGES - 1, (i + STAGES - 1) % STAGES);
    cp_async_commit();

    const int slot = i % STAGES;
    const int4* sh = smem + slot * S::kStageInt4;
    const int4* sb = sh + S::kAStage;
    const int4* sm = sb + S::kBStage;
    // the group sums times the group's scale (or 1 per column) into tot; the lane's 8 scales are
    // one int4 (b_scales permutation: position 8 g + 2 j is column 16 j + g, + 1 is 16 j + 8 + g)
    // the stage's group sums times the group's scale (or 1 per column) into tot; the lane's 8
    // scales are one int4 (b_scales permutation: position 8 g + 2 j is column 16 j + g, + 1 is
    // 16 j + 8 + g)
    auto add_group = [&]() {
      float s_lo[4], s_hi[4];
      if (grouped) {
        const int4 sv = sm[S::kMStage + wn * 8 + g];
        const ET* sc = reinterpret_cast<const ET*>(&sv);
#pragma unroll
        for (int j = 0; j < 4; j++) s_lo[j] = E::to_float(sc[2 * j]), s_hi[j] = E::to_float(sc[2 * j + 1]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; j++) s_lo[j] = s_hi[j] = 1.f;
      }
#pragma unroll
      for (int j = 0; j < 4; j++)
#pragma unroll
        for (int b = 0; b < MB; b++) {
          tot[j][b][0] = fmaf(s_lo[j], grp[j][b][0], tot[j][b][0]);
          tot[j][b][1] = fmaf(s_lo[j], grp[j][b][1], tot[j][b][1]);
          tot[j][b][2] = fmaf(s_hi[j], grp[j][b][2], tot[j][b][2]);
          tot[j][b][3] = fmaf(s_hi[j], grp[j][b][3], tot[j][b][3]);
        }
    };
#pragma unroll
    for (int u = 0; u < kStrips; u++) {
      uint32_t act[MB][4];
#pragma unroll
      for (int b = 0; b < MB; b++) {
        const int r = wrow0 + 8 * b + ld_row;
        ldmatrix_x4(act[b], sh + r * 16 + ((4 * u + ld_q) ^ (r % 8)));
      }
      const int4 wq4 = sb[(u * NW + wn) * 32 + lane];
      // metadata: the lane's own words (blocks 0, 1) and its partner's, lane ^ 2 (blocks 2, 3).
      // Every instruction takes selector 0 (lanes c = 0, 1 supply it), whose lane assignment the
      // PTX ISA spells out; blocks 2 and 3 come from the words the format gives lanes c = 2, 3.
      const uint2* mrow = reinterpret_cast<const uint2*>(sm + (u * NW + wn) * 16);
      const uint2 mw = mrow[lane], mw2 = mrow[lane ^ 2];
      const uint32_t wq[4] = {static_cast<uint32_t>(wq4.x), static_cast<uint32_t>(wq4.y), static_cast<uint32_t>(wq4.z),
                              static_cast<uint32_t>(wq4.w)};
      // fine: the strip's zero points in the dequantization and its group scales on the
      // dequantized weights (as the wgmma loop applies them), the products summed straight into
      // tot: no group sums, no group size in the loop
      uint32_t sw[4];
      U4Zero zz[4];
      if constexpr (FINE) scales.template strip_params<ET>(slot, u, wn * 8 + g, sw, zz);
#pragma unroll
      for (int j = 0; j < 4; j++) {
        uint32_t lo[2], hi[2];
        if constexpr (FINE)
          dequant_u4<ET, true>(wq[j], lo, hi, zz[j]);  // u - z (z = 8 without zero points)
        else
          dequant_u4<ET, false>(wq[j], lo, hi, U4Zero{});
        if constexpr (FINE) scale_by_pair<ET>(lo, hi, sw[j]);  // per column: scale rows of 1
        const uint32_t a[4] = {lo[0], hi[0], lo[1], hi[1]};
        const uint32_t e = j == 0 ? mw.x : j == 1 ? mw.y : j == 2 ? mw2.x : mw2.y;
#pragma unroll
        for (int b = 0; b < MB; b++) {
          if constexpr (FINE)
            mma_sp_16832<0, kBf16>(a, act[b], e, tot[j][b]);
          else if (u == 0)  // the stage's first strip starts the group's sums
            mma_sp_16832_first<0, kBf16>(a, act[b], e, grp[j][b]);
          else
            mma_sp_16832<0, kBf16>(a, act[b], e, grp[j][b]);
        }
      }
    }
    if constexpr (!FINE) add_group();  // the stage's group
  }
  }  // mma.sync main loop
  cp_async_wait<0>();
  if constexpr (KW == 2) {
    // the upper warpgroup's sums into the lower one's; from here on only wk == 0 holds the block's
    // sums (the epilogue's stores skip wk == 1, its barriers and shared loops keep every thread)
    __syncthreads();  // every warp's last wgmma has ended: the pipeline's shared memory is free
    add_upper_k_half(reinterpret_cast<float4*>(smem) + wn * (4 * MB) * 32 + lane, tot, wk == 1);
  }

  // Element (j, b, e) is C[slice row wrow0 + 8 b + 2 c4 + e % 2][column 64 wn + 16 j + g + 8 (e / 2)]
  // of the tile; rows of the slice below `lim` exist.
  const int col0 = nt * S::kTileN + wn * 64 + g;
  const int lim = rows - wrow0 - 2 * c4;  // element rows 8 b + e % 2 below this exist
  if (p.parts == 1) {
    if (wk != 0) return;
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const int col_lo = col0 + 16 * j, col_hi = col_lo + 8;
      float sc_lo = 1.f, sc_hi = 1.f;
      if (!grouped) {  // per-column scales on the final fp32 sum
        sc_lo = E::to_float(s_in[col_lo]);
        sc_hi = E::to_float(s_in[col_hi]);
      }
#pragma unroll
      for (int b = 0; b < MB; b++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          if (8 * b + e % 2 < lim)
            c_out[static_cast<long long>(row0 + wrow0 + 8 * b + 2 * c4 + e % 2) * p.n + (e < 2 ? col_lo : col_hi)] =
                E::from_float(tot[j][b][e] * (e < 2 ? sc_lo : sc_hi));
        }
    }
    return;
  }

  // Sum of the tile's parts for float4 chunk x (row x / kChunks of the slice, tile columns
  // 4 (x % kChunks) .. + 3), per-column scales applied, to C.
  constexpr int kChunks = S::kTileN / 4;
  auto store_chunk = [&](int x, float4 sum) {
    const int r = x / kChunks, cc = nt * S::kTileN + 4 * (x % kChunks);
    if (!grouped) {
      const ET* sc = s_in + cc;
      sum.x *= E::to_float(sc[0]);
      sum.y *= E::to_float(sc[1]);
      sum.z *= E::to_float(sc[2]);
      sum.w *= E::to_float(sc[3]);
    }
    typename E::T2 out[2] = {E::floats2(sum.x, sum.y), E::floats2(sum.z, sum.w)};
    *reinterpret_cast<uint2*>(c_out + static_cast<long long>(row0 + r) * p.n + cc) = *reinterpret_cast<uint2*>(out);
  };
  const int chunks = rows * kChunks;

  if (p.cluster_reduce) {
    // The block's partial [rows][kPartStride] in its own shared memory, over the drained stages
    // (every warp is past its last read of them after this barrier).
    float* part_sm = reinterpret_cast<float*>(smem);
    __syncthreads();
    float* mine = part_sm + (wrow0 + 2 * c4) * S::kPartStride + wn * 64 + g;
    if (wk == 0) {
#pragma unroll
      for (int j = 0; j < 4; j++)
#pragma unroll
        for (int b = 0; b < MB; b++)
#pragma unroll
          for (int e = 0; e < 4; e++)
            if (8 * b + e % 2 < lim) mine[(8 * b + e % 2) * S::kPartStride + 16 * j + 8 * (e / 2)] = tot[j][b][e];
    }
    cluster_sync();  // every part of the tile is in place
    // This block's 1/parts of the chunks, each the sum of the parts in rank order, all parts'
    // loads in flight at once.
    const uint32_t base = smem_addr(part_sm);
    uint32_t from[kMaxClusterParts];
#pragma unroll
    for (int q = 0; q < kMaxClusterParts; q++) from[q] = q < p.parts ? cluster_map(base, q) : 0;
    const int hi = (part + 1) * chunks / p.parts;
    for (int x = part * chunks / p.parts + tid; x < hi; x += kThreads) {
      const uint32_t off = ((x / kChunks) * S::kPartStride + 4 * (x % kChunks)) * 4;
      float4 v[kMaxClusterParts];
#pragma unroll
      for (int q = 0; q < kMaxClusterParts; q++)
        if (q < p.parts) v[q] = ld_cluster_f4(from[q] + off);
      float4 sum = v[0];
#pragma unroll
      for (int q = 1; q < kMaxClusterParts; q++)
        if (q < p.parts) sum.x += v[q].x, sum.y += v[q].y, sum.z += v[q].z, sum.w += v[q].w;
      store_chunk(x, sum);
    }
    cluster_sync();  // the other blocks have read this block's partial before it exits
    return;
  }

  // K split through global memory: this block's fp32 partial (past L1), then the last block of
  // the tile adds all parts.
  float* mine = p.partial + static_cast<long long>(part) * p.m * p.n + static_cast<long long>(row0 + wrow0 + 2 * c4) * p.n + col0;
  if (wk == 0) {
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int b = 0; b < MB; b++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          if (8 * b + e % 2 < lim) __stcg(mine + static_cast<long long>(8 * b + e % 2) * p.n + 16 * j + 8 * (e / 2), tot[j][b][e]);
  }
  if (!last_to_arrive(p.locks + col, p.parts)) return;
  // kPB parts' loads of kXB chunks in flight at once (a loop of dependent load-add pairs made the
  // last block's reduction latency-bound; one chunk per round left 4 L2 round trips in a row at
  // 8 rows, 512 chunks over 128 threads), each chunk's parts added in part order. Two chunks on
  // the 8-row mma.sync slices of group 128 / per column and on the wgmma instances (H200: 3-9%
  // faster at 4-8 rows); one elsewhere: on the 16- and 32-row mma.sync slices two made ptxas
  // schedule the loop worse (8 parts through global memory: 2-3 us slower at 9-16 rows), and on
  // the FINE 8-row slices their registers (80 -> 168) slowed the stage loop by 1-10% at 1-8 rows
  // (NOTES.md 2026-11-29).
  constexpr int kPB = 8, kXB = (MB == 1 && !FINE) || WG != 0 ? 2 : 1;
  const long long plane = static_cast<long long>(p.m) * p.n;
  for (int x0 = tid; x0 < chunks; x0 += kXB * kThreads) {
    long long at[kXB];
    float4 sum[kXB];
#pragma unroll
    for (int i = 0; i < kXB; i++) {
      const int x = x0 + i * kThreads;
      at[i] = static_cast<long long>(row0 + x / kChunks) * p.n + nt * S::kTileN + 4 * (x % kChunks);
      if (x < chunks) sum[i] = __ldcg(reinterpret_cast<const float4*>(p.partial + at[i]));
    }
#pragma unroll 1
    for (int q0 = 1; q0 < p.parts; q0 += kPB) {
      float4 v[kXB][kPB];
#pragma unroll
      for (int i = 0; i < kXB; i++)
#pragma unroll
        for (int q = 0; q < kPB; q++)
          if (x0 + i * kThreads < chunks && q0 + q < p.parts)
            v[i][q] = __ldcg(reinterpret_cast<const float4*>(p.partial + (q0 + q) * plane + at[i]));
#pragma unroll
      for (int i = 0; i < kXB; i++)
#pragma unroll
        for (int q = 0; q < kPB; q++)
          if (x0 + i * kThreads < chunks && q0 + q < p.parts)
            sum[i].x += v[i][q].x, sum[i].y += v[i][q].y, sum[i].z += v[i][q].z, sum[i].w += v[i][q].w;
    }
#pragma unroll
    for (int i = 0; i < kXB; i++)
      if (x0 + i * kThreads < chunks) store_chunk(x0 + i * kThreads, sum[i]);
  }
}

}  // namespace sparse24
}  // namespace marlin
