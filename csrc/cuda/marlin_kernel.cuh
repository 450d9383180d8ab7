// The dense MARLIN kernel: C[M, N] = A[M, K] @ dequant(B), A / scales / C in fp16 or bf16 (ET),
// B in one of the weight formats of dequant.cuh (W: INT4 symmetric or with zero points, 8-bit).
//
// Design (paper section 3), in the order the data flows:
//  * Work unit: a tile of (16 * TK) rows of K by (16 * TN) columns of N of B, for one slice of
//    16 * TM rows of A. A "column" is the stack of K tiles that produce one (slice, N-tile) of C.
//  * Striped partition: the columns' tiles are numbered column by column; block b takes the
//    contiguous range [b T, (b + 1) T), so a stripe may end in one column and go on at the top
//    of the next. Columns shared by several blocks are reduced in fp32: each block stores its
//    partial in its own slot of `partial`, the last to arrive (an acquire-release atomic
//    counter per column, reset to zero by that block) adds the slots in block order and writes
//    C. The paper orders the blocks with a lock and reduces serially; on Hopper that chain of
//    global round trips dominated small layers (benchmarks/NOTES.md), and this keeps the result
//    deterministic.
//  * Pipeline: STAGES shared-memory stages filled with cp.async (weights with L2 evict-first),
//    and the next k16 sub-step's operands loaded into registers while the current one runs.
//    The stage loop is unrolled so that every shared-memory address is static.
//  * Warps: NG = TN / 4 warp columns of 64 N each, KW = 8 / NG warps along K; each warp does
//    every KW-th k16 block of a stage. At the end of a column the KW partial results are added
//    in shared memory.
//  * Math: activations stored XOR-swizzled and read with ldmatrix (no bank conflicts); one
//    16-byte read per lane gives 8 nibbles for each of 4 16x16 blocks, dequantized two at a
//    time by lop3 + magic-number subtraction, scaled by the group scale (fp16), and fed to
//    mma.m16n8k16 with fp32 accumulators. Per-column scales are applied to the fp32 result.
//  * Groups: GROUP_BLOCKS = 8 is group size 128 (one scale row per stage, fixed at compile time);
//    0 takes the group size at run time (p.group_shift: 32, 64 or 128 rows), with as many scale
//    (and zero-point) rows per stage as its groups; -1 is per column.
//  * PARTIAL_N: N need only be a multiple of 64: the last column of tiles may hold fewer 64-column
//    chunks (n_chunks); the copies of its missing chunks re-read chunk 0 of the tile instead (no
//    branch in the copy loop), their warps compute on those, and nothing of them is written. The
//    fp16 base instances are built without it (the per-thread redirect cost them registers, and
//    spills, at 128 registers); the planner sends their partial tiles to instances with it.
//  * Zero points (W == kU4Zp) are stored like the scales and ride along with them: per group,
//    each lane turns its 8 zero points into the constants the magic-number dequantization
//    subtracts (dequant.cuh), so (u - z) is exact before the scale multiplies it.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "dequant.cuh"
#include "ptx.cuh"

namespace marlin {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct KernelParams {
  const int4* a;       // fp16 [m, k]
  const int4* b;       // packed weights, int32 [k / 16, 2 n]
  const int4* s;       // scales [groups, n], element type
  const int4* z;       // zero points [groups, n], element type, same layout as s (kU4Zp only; else null)
  void* c;             // T [m, n]
  float4* partial;     // fp32 reduction slots
  int* locks;          // one counter per block, zero on entry and on exit
  int m, n, k;
  long long lda_int4;  // row stride of a in 16-byte units
  int m_slices;
  int tiles_per_block;
  bool prefetch;  // launched as a programmatic dependent: hint L2 before waiting (smallm_kernel.cuh)
  // smallm_kernel.cuh only: 0 = stream-K stripes of tiles_per_block; else each column in this many
  // parts, one per block; cluster_reduce: the parts of a column are one thread-block cluster
  // (sm_90+) and add their partials through distributed shared memory
  int split_parts;
  int split_first;  // prefill_kernel.cuh only: its tiles from this one on are split in split_parts
  int split_stages;  // prefill_kernel.cuh only: stages of each K-split part but the last (0: equal parts)
  bool fast_sum;     // prefill_kernel.cuh only: the K split's last part may add the others' partials itself
  bool cluster_reduce;
  int group_shift;  // GROUP_BLOCKS == 0: log2 of the group size in k16 blocks (1, 2 or 3)
};

template <int TM, int TK, int TN, int STAGES, int GROUP_BLOCKS, int W = kU4>
struct KernelShape {
  static constexpr int kNG = TN / 4;         // warp columns (64 N each)
  static constexpr int kKW = kWarps / kNG;   // warps along K
  static constexpr int kSub = TK / kKW;      // k16 sub-steps per warp per stage
  static constexpr bool kGrouped = GROUP_BLOCKS >= 0;
  // int4 of packed weights per lane and 16 x 64 block: 8-bit weights take twice the 4-bit
  static constexpr int kBLane = W == kU8 ? 2 : 1;
  static constexpr int kChunkInt4 = 32 * kBLane;  // one 16 x 64 block of packed weights
  // scale rows per stage: one at a fixed group of 128 rows; at run-time group sizes as many as
  // the smallest group (32 rows) needs
  static constexpr int kSRows = GROUP_BLOCKS == 0 ? (TK >= 2 ? TK / 2 : 1) : 1;
  static constexpr bool kZeros = W == kU4Zp && kGrouped;  // zero-point rows next to the scales

  // shared memory per stage, in int4 (16 bytes)
  static constexpr int kARowInt4 = TK * 2;           // one row of the A stage: 16 TK halves
  static constexpr int kAStage = 16 * TM * kARowInt4;
  static constexpr int kBStage = TK * TN / 4 * kChunkInt4;  // TK x (TN / 4) chunks
  static constexpr int kSRowInt4 = TN * 2;                  // one scale row of 16 TN halves
  static constexpr int kSStage = kGrouped ? kSRows * kSRowInt4 : 0;
  static constexpr int kZStage = kZeros ? kSStage : 0;
  static constexpr int kStageInt4 = kAStage + kBStage + kSStage + kZStage;
  static constexpr int kPipeInt4 = STAGES * kStageInt4;

  // end-of-column reduction among the KW warps of a warp column: floats per thread
  static constexpr int kAccFloats = TM * 8 * 4;
  static constexpr int kRedInt4 = (kKW / 2) * kNG * 32 * (kAccFloats / 4);
  // output staging: (16 TM) rows of 16 TN halves plus 8 halves of padding
  static constexpr int kCRowHalves = 16 * TN + 8;
  static constexpr int kCInt4 = 16 * TM * kCRowHalves / 8;

  static constexpr int kSmemInt4 =
      kPipeInt4 > kRedInt4 ? (kPipeInt4 > kCInt4 ? kPipeInt4 : kCInt4) : (kRedInt4 > kCInt4 ? kRedInt4 : kCInt4);
  static constexpr int kSmemBytes = kSmemInt4 * 16;
  // fp32 values of one block's partial tile; `partial` holds 2 per block
  static constexpr int kPartialFloats = 16 * TM * 16 * TN;

  static_assert(TN % 4 == 0 && kWarps % kNG == 0, "TN must split into whole warp columns");
  static_assert(TK % kKW == 0 && kSub >= 1, "TK must split over the K warps");
  static_assert((STAGES * kSub) % 2 == 0, "register double buffer needs an even sub-step count");
  static_assert(kARowInt4 >= 8, "XOR swizzle needs 8 int4 per A row");
  static_assert(GROUP_BLOCKS <= 0 || GROUP_BLOCKS % TK == 0, "a stage must not straddle scale groups");
  static_assert(kSStage + kZStage <= kThreads, "one copy per thread loads a stage's scales and zero points");
  static_assert((kKW & (kKW - 1)) == 0, "K warps must be a power of two for the tree reduction");
};

// Small-batch instances fit in 128 registers, so two blocks can share a multiprocessor (more
// warps to hide latency); larger ones need the whole register file.
template <int TM>
constexpr int kMinBlocksPerSm = TM == 1 ? 2 : 1;

template <typename ET, int W, int TM, int TK, int TN, int STAGES, int GROUP_BLOCKS, bool PARTIAL_N>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm<TM>) marlin_gemm_kernel(const KernelParams p) {
  using S = KernelShape<TM, TK, TN, STAGES, GROUP_BLOCKS, W>;
  using E = Elem<ET>;
  using T2 = typename E::T2;
  constexpr int NG = S::kNG, KW = S::kKW, SUB = S::kSub;
  constexpr bool kBf16 = kIsBf16<ET>;
  extern __shared__ int4 smem[];
  ET* const c_out = static_cast<ET*>(p.c);

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int wn = warp % NG;  // which 64-column group of the tile
  const int wk = warp / NG;  // which k16 blocks of a stage (wk, wk + KW, ...)

  const int k_tiles = p.k / (16 * TK);
  const int n_tiles = (p.n + 16 * TN - 1) / (16 * TN);  // the last may be partial (N % 64 == 0)
  const int total = p.m_slices * n_tiles * k_tiles;
  const int T = p.tiles_per_block;
  int pos = blockIdx.x * T;
  // Programmatic dependent launch: nothing of the previous kernel is read before this (A, the
  // locks and C may be its outputs or inputs); from here the next kernel may be scheduled.
  // (Letting it be scheduled only from the first column's epilogue on measured up to 28% slower
  // at M = 16 on an H200: 70B o 24.4 against 18.7 us.)
  grid_dependency_wait();
  grid_launch_dependents();
  const int end = min(pos + T, total);

  const int b_row_int4 = p.n / 2 * S::kBLane;  // one packed row (16 rows of K): 2 n int32 (4 n for 8-bit)

  // ---- static shared-memory offsets, computed once (the paper precomputes them in registers)
  // cp.async targets of this thread in a stage
  constexpr int kALoads = (S::kAStage + kThreads - 1) / kThreads;
  constexpr int kBLoads = S::kBStage / kThreads;
  static_assert(S::kBStage % kThreads == 0, "B stage must split evenly over threads");
  int a_sh_wr[kALoads], a_row[kALoads], a_col[kALoads];
#pragma unroll
  for (int i = 0; i < kALoads; i++) {
    const int idx = tid + i * kThreads;
    a_row[i] = idx / S::kARowInt4;
    a_col[i] = idx % S::kARowInt4;
    a_sh_wr[i] = a_row[i] * S::kARowInt4 + (a_col[i] ^ (a_row[i] % 8));
  }
  // ldmatrix source of this lane for m-block i, sub-step u
  int a_sh_rd[SUB][TM];
#pragma unroll
  for (int u = 0; u < SUB; u++) {
#pragma unroll
    for (int i = 0; i < TM; i++) {
      const int row = 16 * i + lane % 16;
      const int col = 2 * (wk + KW * u) + lane / 16;
      a_sh_rd[u][i] = row * S::kARowInt4 + (col ^ (row % 8));
    }
  }

  // ---- registers
  float acc[TM][8][4];
  uint32_t a_frag[2][TM][4];
  int4 b_frag[2][S::kBLane];
  int4 s_frag[2];
  int4 z_frag[2];  // kZeros: the zero points of the lane's 8 columns, as s_frag
  int4 z_col;      // per-column zero points (kU4Zp, GROUP_BLOCKS == -1): the segment's, as s_frag

  auto zero_acc = [&]() {
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
      for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
  };

  // Walk over this block's segments: each is the part of one column it owns.
  while (pos < end) {
    const int col = pos / k_tiles;
    const int kt0 = pos % k_tiles;
    const int iters = min(k_tiles - kt0, end - pos);
    const int m_slice = col / n_tiles;
    const int nt = col % n_tiles;
    const int row0 = m_slice * 16 * TM;
    const int rows = min(16 * TM, p.m - row0);

    // blocks that share this column, in stripe order; the bottom one reduces first
    const int first_block = (col * k_tiles) / T;
    const int last_block = (col * k_tiles + k_tiles - 1) / T;
    const int n_parts = last_block - first_block + 1;

    // global sources for tile t of this segment
    const int4* a_src[kALoads];
    bool a_ok[kALoads];
#pragma unroll
    for (int i = 0; i < kALoads; i++) {
      const bool in_stage = (kALoads * kThreads == S::kAStage) || (tid + i * kThreads < S::kAStage);
      a_ok[i] = in_stage && a_row[i] < rows;
      const int r = a_ok[i] ? a_row[i] : 0;
      a_src[i] = p.a + (row0 + r) * p.lda_int4 + kt0 * S::kARowInt4 + a_col[i];
    }
    // 64-column chunks of N in this tile (NG but in a last, partial tile). A thread's B copies all
    // fall in the same chunk (kThreads is a multiple of a stage row), its scale copy in chunk
    // (its int4 within the scale row) / 8.
    int n_chunks = NG, b_fix = 0, s_fix = 0;
    if constexpr (PARTIAL_N) {
      n_chunks = min(NG, p.n / 64 - nt * NG);
      const int b_chunk = (tid % (NG * S::kChunkInt4)) / S::kChunkInt4, s_chunk = (tid % S::kSRowInt4) / 8;
      b_fix = b_chunk < n_chunks ? 0 : -b_chunk * S::kChunkInt4;  // redirect to chunk 0
      s_fix = s_chunk < n_chunks ? 0 : -s_chunk * 8;
    }
    static_assert(kThreads % (NG * S::kChunkInt4) == 0, "a thread's B copies must stay in one chunk");
    const int4* b_src = p.b + static_cast<long long>(kt0) * TK * b_row_int4 + nt * NG * S::kChunkInt4 + b_fix;
    const int4* s_src = nullptr;
    if constexpr (S::kGrouped) s_src = p.s + nt * TN * 2 + s_fix;
    if constexpr (W == kU4Zp && !S::kGrouped) {
      // per-column zero points, natural order: the lane's columns g + 8 m of its 64 (as s_frag)
      const ET* zc = reinterpret_cast<const ET*>(p.z) + nt * 16 * TN + wn * 64 + lane / 4;
      ET* zf = reinterpret_cast<ET*>(&z_col);
      z_col = make_int4(0, 0, 0, 0);  // stays for a chunk past N in a partial tile
      if (wn < n_chunks) {
#pragma unroll
        for (int m8 = 0; m8 < 8; m8++) zf[m8] = zc[8 * m8];
      }
    }

    auto fetch_stage = [&](int stage, int t) {
      if (t < iters) {
        int4* sh = smem + stage * S::kStageInt4;
#pragma unroll
        for (int i = 0; i < kALoads; i++) {
          if ((kALoads * kThreads == S::kAStage) || (tid + i * kThreads < S::kAStage))
            cp_async16_zfill(sh + a_sh_wr[i], a_src[i] + t * S::kARowInt4, a_ok[i]);
        }
        int4* sh_b = sh + S::kAStage;
        const int4* src = b_src + static_cast<long long>(t) * TK * b_row_int4;
#pragma unroll
        for (int i = 0; i < kBLoads; i++) {
          const int idx = tid + i * kThreads;
          const int kb = idx / (NG * S::kChunkInt4);
          const int off = idx % (NG * S::kChunkInt4);
          cp_async16_evict_first(sh_b + idx, src + kb * b_row_int4 + off);
        }
        if constexpr (GROUP_BLOCKS > 0) {
          if (tid < TN * 2) {
            const int group = ((kt0 + t) * TK) / GROUP_BLOCKS;
            cp_async16(sh + S::kAStage + S::kBStage + tid, s_src + static_cast<long long>(group) * (p.n / 8) + tid);
            if constexpr (S::kZeros)
              cp_async16(sh + S::kAStage + S::kBStage + S::kSStage + tid,
                         p.z + (s_src - p.s) + static_cast<long long>(group) * (p.n / 8) + tid);
          }
        } else if constexpr (GROUP_BLOCKS == 0) {
          // the stage's groups: TK >> shift rows (one where a group spans several stages)
          const int shift = p.group_shift;
          const int s_rows = TK >> shift > 0 ? TK >> shift : 1;
          if (tid < s_rows * S::kSRowInt4) {
            const int row = tid / S::kSRowInt4, col = tid % S::kSRowInt4;
            const long long at = static_cast<long long>((((kt0 + t) * TK) >> shift) + row) * (p.n / 8) + col;
            cp_async16(sh + S::kAStage + S::kBStage + tid, s_src + at);
            if constexpr (S::kZeros) cp_async16(sh + S::kAStage + S::kBStage + S::kSStage + tid, p.z + (s_src - p.s) + at);
          }
        }
      }
      cp_async_commit();
    };

    auto wait_stage = [&]() {
      cp_async_wait<STAGES - 2>();
      __syncthreads();
    };

    auto fetch_regs = [&](int buf, int stage, int u) {
      const int4* sh = smem + stage * S::kStageInt4;
#pragma unroll
      for (int i = 0; i < TM; i++) ldmatrix_x4(a_frag[buf][i], sh + a_sh_rd[u][i]);
      const int kb = wk + KW * u;
#pragma unroll
      for (int h = 0; h < S::kBLane; h++) b_frag[buf][h] = sh[S::kAStage + (kb * NG + wn) * S::kChunkInt4 + lane * S::kBLane + h];
      if constexpr (S::kGrouped) {
        // the k16 block's group row in the stage (always 0 for a fixed group of 128)
        const int s_row = GROUP_BLOCKS == 0 ? kb >> p.group_shift : 0;
        const int at = S::kAStage + S::kBStage + s_row * S::kSRowInt4 + wn * 8 + lane / 4;
        s_frag[buf] = sh[at];
        if constexpr (S::kZeros) z_frag[buf] = sh[at + S::kSStage];
      }
    };

    auto compute = [&](int buf) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(&b_frag[buf][0]);
      const ET* sc = reinterpret_cast<const ET*>(&s_frag[buf]);
      const ET* zc = reinterpret_cast<const ET*>(S::kZeros ? &z_frag[buf] : &z_col);
#pragma unroll
      for (int j = 0; j < 4; j++) {
        uint32_t lo[2], hi[2];
        if constexpr (W == kU8) {
          dequant_u8<ET>(w[2 * j], lo);
          dequant_u8<ET>(w[2 * j + 1], hi);
        } else if constexpr (W == kU4Zp) {
          dequant_u4<ET, true>(w[j], lo, hi, u4_zero_pair<ET>(reinterpret_cast<const uint32_t*>(zc)[j]));
        } else {
          dequant_u4<ET, false>(w[j], lo, hi, U4Zero{0, 0});
        }
        if constexpr (S::kGrouped) {
          scale_frag_t<ET>(lo, sc[2 * j]);
          scale_frag_t<ET>(hi, sc[2 * j + 1]);
        }
#pragma unroll
        for (int i = 0; i < TM; i++) {
          mma_16816<kBf16>(a_frag[buf][i], lo, acc[i][2 * j]);
          mma_16816<kBf16>(a_frag[buf][i], hi, acc[i][2 * j + 1]);
        }
      }
    };

    // ---- main loop
    zero_acc();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) fetch_stage(s, s);
    wait_stage();
    fetch_regs(0, 0, 0);

    int t = 0;
    while (t < iters) {
#pragma unroll
      for (int stage = 0; stage < STAGES; stage++) {
#pragma unroll
        for (int u = 0; u < SUB; u++) {
          const int buf = (stage * SUB + u) % 2;
          if (u == SUB - 1) {
            fetch_stage((stage + STAGES - 1) % STAGES, t + STAGES - 1);
            wait_stage();
            fetch_regs(buf ^ 1, (stage + 1) % STAGES, 0);
          } else {
            fetch_regs(buf ^ 1, stage, u + 1);
          }
          compute(buf);
        }
        t++;
        if (t == iters) break;
      }
    }
    cp_async_wait<0>();
    __syncthreads();

    // ---- reduce the KW warps of each warp column into warp row wk == 0 (tree, in smem)
    if constexpr (KW > 1) {
      float4* red = reinterpret_cast<float4*>(smem);
      constexpr int kAcc4 = S::kAccFloats / 4;
#pragma unroll
      for (int half_kw = KW / 2; half_kw >= 1; half_kw /= 2) {
        if (wk >= half_kw && wk < 2 * half_kw) {
          float4* dst = red + ((wk - half_kw) * NG + wn) * kAcc4 * 32 + lane;
#pragma unroll
          for (int i = 0; i < TM; i++)
#pragma unroll
            for (int j = 0; j < 8; j++)
              dst[(i * 8 + j) * 32] = make_float4(acc[i][j][0], acc[i][j][1], acc[i][j][2], acc[i][j][3]);
        }
        __syncthreads();
        if (wk < half_kw) {
          const float4* src = red + (wk * NG + wn) * kAcc4 * 32 + lane;
#pragma unroll
          for (int i = 0; i < TM; i++)
#pragma unroll
            for (int j = 0; j < 8; j++) {
              const float4 v = src[(i * 8 + j) * 32];
              acc[i][j][0] += v.x;
              acc[i][j][1] += v.y;
              acc[i][j][2] += v.z;
              acc[i][j][3] += v.w;
            }
        }
        __syncthreads();
      }
    }

    // ---- fp32 reduction with the other blocks of this column. Every block stores its partial
    // in its own slot; the last to arrive (counted in the column's lock) adds all slots in
    // block order, so the result does not depend on who finished last, and nobody spins.
    bool writes_c = n_parts == 1;
    if (n_parts > 1) {
      float4* slot_base = p.partial + wn * 32 + lane;
      auto slot_of = [&](int block) {  // a block's first column uses slot 2b, a later one 2b+1
        const bool first_col = (block * T) / k_tiles == col;  // block * T < total < 2^31
        return slot_base + static_cast<long long>(2 * block + (first_col ? 0 : 1)) * (S::kPartialFloats / 4);
      };
      if (wk == 0) {
        float4* mine = slot_of(blockIdx.x);
#pragma unroll
        for (int i = 0; i < TM; i++)
#pragma unroll
          for (int j = 0; j < 8; j++)
            __stcg(mine + (i * 8 + j) * NG * 32, make_float4(acc[i][j][0], acc[i][j][1], acc[i][j][2], acc[i][j][3]));
      }
      writes_c = last_to_arrive(p.locks + first_block, n_parts);
      if (writes_c && wk == 0) {
#pragma unroll
        for (int i = 0; i < TM; i++)
#pragma unroll
          for (int j = 0; j < 8; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
        for (int b = first_block; b <= last_block; b++) {
          const float4* part = slot_of(b);
#pragma unroll
          for (int i = 0; i < TM; i++)
#pragma unroll
            for (int j = 0; j < 8; j++) {
              const float4 v = __ldcg(part + (i * 8 + j) * NG * 32);
              acc[i][j][0] += v.x;
              acc[i][j][1] += v.y;
              acc[i][j][2] += v.z;
              acc[i][j][3] += v.w;
            }
        }
      }
    }

    // ---- one block per column writes C: scale, round to ET, stage, 16-byte stores
    if (writes_c) {
      if constexpr (PARTIAL_N) n_chunks = min(NG, p.n / 64 - nt * NG);  // recomputed, not kept live over the main loop
      ET* c_sh = reinterpret_cast<ET*>(smem);
      if (wk == 0) {
        const int g = lane / 4, c4 = lane % 4;
#pragma unroll
        for (int j = 0; j < 8; j++) {
          const int col_in_tile = wn * 64 + 8 * j + 2 * c4;
          float s0 = 1.f, s1 = 1.f;
          if (!S::kGrouped && (!PARTIAL_N || wn < n_chunks)) {
            const float2 sv = E::to_float2(*reinterpret_cast<const T2*>(reinterpret_cast<const ET*>(p.s) + nt * 16 * TN + col_in_tile));
            s0 = sv.x;
            s1 = sv.y;
          }
#pragma unroll
          for (int i = 0; i < TM; i++) {
            const int r = 16 * i + g;
            *reinterpret_cast<T2*>(c_sh + r * S::kCRowHalves + col_in_tile) = E::floats2(acc[i][j][0] * s0, acc[i][j][1] * s1);
            *reinterpret_cast<T2*>(c_sh + (r + 8) * S::kCRowHalves + col_in_tile) =
                E::floats2(acc[i][j][2] * s0, acc[i][j][3] * s1);
          }
        }
      }
      __syncthreads();
      constexpr int kRowInt4 = 2 * TN;  // 16 TN halves
      for (int idx = tid; idx < rows * kRowInt4; idx += kThreads) {
        const int r = idx / kRowInt4;
        const int cc = idx % kRowInt4;
        if (PARTIAL_N && cc / 8 >= n_chunks) continue;  // past N in a partial tile
        const int4 v = *reinterpret_cast<const int4*>(c_sh + r * S::kCRowHalves + cc * 8);
        *reinterpret_cast<int4*>(c_out + static_cast<long long>(row0 + r) * p.n + nt * 16 * TN + cc * 8) = v;
      }
      __syncthreads();
    }

    pos += iters;
  }
}

}  // namespace marlin
