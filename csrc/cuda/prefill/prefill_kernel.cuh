// The prefill kernel (sm_90a): fp16 / bf16 x INT4 or INT8 for large batches (prompt processing),
// warp-specialized.
//
// It computes the same C^T = B^T A^T as the small-batch kernel, with the weights as the wgmma's A
// operand, but with the copies taken off the math warps and both operands read from shared memory:
//  - one producer thread issues, per stage, three bulk tensor copies (TMA) into shared memory: the
//    activations (256 rows x 64 of K, in the 128-byte swizzle that wgmma reads), the packed
//    weights of the block's 128 columns, and the rows of their group scales (and zero points)
//    that the stage's 64 rows of K need: one for groups of 128 or 64, two for groups of 32; they
//    land on the stage's `full` mbarrier;
//  - two consumer warpgroups (64 weight columns each) dequantize their own 64 columns of the stage
//    into fp16 / bf16 in shared memory (the 128-byte-swizzled K-major layout, 4 packed words per thread),
//    then issue wgmma m64n256k16 with both operands from shared memory. One warpgroup dequantizes
//    while the other's wgmma run, so the tensor cores always have the next stage's work queued.
// A stage's slot goes back to the producer when both consumers' wgmma have read it (`empty`).
//
// (Measured on an H100 before this layout, the same tile with one producer warpgroup doing the
// copies with cp.async and the whole dequantization: producer alone 483 us on 4096 x 12288 at
// M = 4096, the wgmma alone 492 us, both 753 us: the producer was the critical path.)
//
// A block owns one 128 x 256 tile of C^T (128 weight columns, 256 rows of M) for the whole K: no
// partial sums, no locks. Rows of M past the end are zero-filled by the tensor copy and never
// stored. The weights are the published Marlin format (docs/FORMAT.md): a thread reads one lane's
// 16-byte word of a 16 x 64 tile and dequantizes it as the mma.sync kernels do (dequant_u4 of
// dequant.cuh, with the zero points of kU4Zp), then stores each pair where the swizzled layout
// wants it. Groups (32, 64, 128: the run-time group_shift): weights scaled in the element type
// before the store (as the small-batch kernel's weight-scaled path); per column: the fp32 sums
// scaled in the epilogue.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_fp16.h>

#include <cstdint>

#include "../dequant.cuh"
#include "../marlin_kernel.cuh"
#include "../ptx.cuh"
#include "../wgmma.cuh"

namespace marlin {

// BITS: 4 or 8 (the packed weights of a stage; 8-bit ones leave room for 3 stages only)
template <int BITS = 4>
struct PrefillShape {
  static constexpr int kTileN = 128;   // weight columns per block: 2 consumer warpgroups x wgmma M = 64
  static constexpr int kTileM = 256;   // activation rows per block: the wgmma N
  static constexpr int kTileK = 64;    // K per stage: one 128-byte row of halves (one swizzle atom row)
  static constexpr int kStages = BITS == 8 ? 3 : 4;
  static constexpr int kThreads = 384;  // one producer and two consumer warpgroups
  static constexpr int kConsumers = 256;
  // bytes of one stage; every part starts on a 1024-byte boundary (the swizzle atom)
  static constexpr int kActBytes = kTileM * kTileK * 2;     // 32 KB: activations [256 m][64 k]
  static constexpr int kWBytes = kTileN * kTileK * 2;       // 16 KB: dequantized weights [128 n][64 k]
  static constexpr int kPackedBytes = kTileN * kTileK * BITS / 8;  // 4 k16 rows x 2 tiles of 512 (1024) bytes
  static constexpr int kTileWords = 16 * 64 * BITS / 32;             // int32 of one packed 16 x 64 tile
  // the group rows of the stage: scales (up to two rows of 128, 256 bytes each), then zero points
  static constexpr int kScaleRowBytes = kTileN * 2;
  static constexpr int kZeroOffset = 512;
  static constexpr int kScaleBytes = 1024;
  static constexpr int kStageBytes = kActBytes + kWBytes + kPackedBytes + kScaleBytes;
  static constexpr int kBarrierBytes = 2 * kStages * 8;     // full[] and empty[] mbarriers
  static constexpr int kSmemBytes = kStages * kStageBytes + kBarrierBytes + 1024;  // + alignment slack
  static_assert(kStageBytes % 1024 == 0, "stages must keep the 1024-byte alignment");
  // the epilogue stages each consumer warpgroup's 64 x 256 fp16 tile in one stage's activations
  static_assert(kStages >= 2 && kTileM * 64 * 2 <= kActBytes, "epilogue staging does not fit");
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

// T: half or nv_bfloat16; W: the weight type (kU4, kU4Zp: zero points, grouped only; kU8);
// GROUPED: group scales (else per column).
template <typename T, int W, bool GROUPED>
__global__ void __launch_bounds__(PrefillShape<>::kThreads, 1) marlin_prefill_kernel(const __grid_constant__ PrefillParams pp) {
#if !MARLIN_HAS_WGMMA
  __trap();  // built for another target than sm_90a: never launched (planner)
#else
  using S = PrefillShape<W == kU8 ? 8 : 4>;
  constexpr bool ZP = W == kU4Zp;
  const KernelParams& p = pp.p;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S::kStages * S::kStageBytes);
  uint64_t* empty = full + S::kStages;

  const int tid = threadIdx.x;
  const int m_tiles = (p.m + S::kTileM - 1) / S::kTileM;
  // consecutive blocks share a column tile (its weights stay in L2) and walk down M
  const int m0 = (blockIdx.x % m_tiles) * S::kTileM;
  const int n0 = (blockIdx.x / m_tiles) * S::kTileN;
  const int k_tiles = p.k / S::kTileK;
  static_assert(GROUPED || !ZP, "zero points come in groups here (per-column ones run on the tiled kernel)");
  // log2 of the group size in rows of K (5, 6, 7); the stage's first group row and its row count
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

  if (tid < 128) {
    // ---------------- producer: one thread issues every stage's tensor copies
    if (tid != 0) return;
    const int group_rows = GROUPED ? max(1, S::kTileK >> group_log2) : 0;
    const int bytes = S::kActBytes + S::kPackedBytes + group_rows * S::kScaleRowBytes * (ZP ? 2 : 1);
    for (int kt = 0; kt < k_tiles; kt++) {
      const int slot = kt % S::kStages;
      if (kt >= S::kStages) mbar_wait(&empty[slot], (kt / S::kStages - 1) & 1);  // both consumers are done with it
      uint8_t* st = smem + slot * S::kStageBytes;
      mbar_arrive_expect_tx(&full[slot], bytes);
      tma_load_2d(st, &pp.act, kt * S::kTileK, m0, &full[slot]);
      // the block's two 16 x 64 tiles of 4 k16 rows: one box of [4][256 words] (4-bit), or one per
      // tile (8-bit: a box row is at most 256 elements)
      const int wx = 2 * S::kTileWords * (n0 / S::kTileN);
      tma_load_2d(st + S::kActBytes + S::kWBytes, &pp.wq, wx, 4 * kt, &full[slot]);
      if constexpr (W == kU8)
        tma_load_2d(st + S::kActBytes + S::kWBytes + S::kPackedBytes / 2, &pp.wq, wx + S::kTileWords, 4 * kt, &full[slot]);
      uint8_t* groups = st + S::kActBytes + S::kWBytes + S::kPackedBytes;
      if constexpr (GROUPED) tma_load_2d(groups, &pp.sc, n0, (kt * S::kTileK) >> group_log2, &full[slot]);
      if constexpr (ZP) tma_load_2d(groups + S::kZeroOffset, &pp.zp, n0, (kt * S::kTileK) >> group_log2, &full[slot]);
    }
    return;
  }

  // ---------------- consumer warpgroups: dequantize their 64 columns, then wgmma
  const int cw = (tid - 128) / 128;  // weight columns 64 cw .. 64 cw + 63 of the block
  const int wq = (tid % 128) / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  // Dequantization of stage kt: warp wq takes k16 row wq of tile cw, lane (g, c) its int4 (4 words
  // j); word j gives the fp16 pairs of rows 16 j + g and + 8, K rows 2c, 2c+1 (lo[0], hi[0]) and
  // 2c+8, 2c+9 (lo[1], hi[1]), i.e. 16-byte chunks 2 wq and 2 wq + 1 of those rows. (8-bit: the
  // lane's two int4, words 2 j for row 16 j + g and 2 j + 1 for row 16 j + 8 + g.) Its K rows
  // 16 wq .. 16 wq + 15 of the stage lie in the stage's group row (16 wq) >> group_log2.
  const int group_offset = ((16 * wq) >> group_log2) * S::kScaleRowBytes + (cw * 8 + g) * 16;
  auto dequant_stage = [&](uint8_t* st) {
    // one 32-bit word (and one scale pair) at a time, next to the 128 accumulators
    const int word_int4 = W == kU8 ? cw * 256 + wq * 64 + 2 * lane : wq * 64 + cw * 32 + lane;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(st + S::kActBytes + S::kWBytes + word_int4 * 16);
    const uint8_t* groups = st + S::kActBytes + S::kWBytes + S::kPackedBytes + group_offset;
    const uint32_t* scales = reinterpret_cast<const uint32_t*>(groups);
    const uint32_t* zeros = reinterpret_cast<const uint32_t*>(groups + S::kZeroOffset);
    uint8_t* wsm = st + S::kActBytes;
#pragma unroll
    for (int j = 0; j < 4; j++) {
      uint32_t lo[2], hi[2];
      // word j of the scales (zero points): rows 16 j + g (low half) and 16 j + 8 + g (high half)
      if constexpr (W == kU8) {
        dequant_u8<T>(words[2 * j], lo);
        dequant_u8<T>(words[2 * j + 1], hi);
      } else if constexpr (ZP)
        dequant_u4<T, true>(words[j], lo, hi, u4_zero_pair<T>(zeros[j]));
      else
        dequant_u4<T, false>(words[j], lo, hi, U4Zero{0, 0});
      if constexpr (GROUPED) {
        const uint32_t s2 = scales[j];  // one 32-bit load, split in registers
        const T* pair = reinterpret_cast<const T*>(&s2);
        scale_frag_t<T>(lo, pair[0]);
        scale_frag_t<T>(hi, pair[1]);
      }
      const int row = cw * 64 + 16 * j + g;
      *reinterpret_cast<uint32_t*>(wsm + sw128(row, 2 * wq) + 4 * c) = lo[0];
      *reinterpret_cast<uint32_t*>(wsm + sw128(row, 2 * wq + 1) + 4 * c) = lo[1];
      *reinterpret_cast<uint32_t*>(wsm + sw128(row + 8, 2 * wq) + 4 * c) = hi[0];
      *reinterpret_cast<uint32_t*>(wsm + sw128(row + 8, 2 * wq + 1) + 4 * c) = hi[1];
    }
  };

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; i++) acc[i] = 0.f;
  for (int kt = 0; kt < k_tiles; kt++) {
    const int slot = kt % S::kStages;
    uint8_t* st = smem + slot * S::kStageBytes;
    mbar_wait(&full[slot], (kt / S::kStages) & 1);
    dequant_stage(st);
    fence_proxy_async_smem();  // the stores above are read by wgmma (the async proxy) ...
    named_barrier(1 + cw, 128);  // ... after every warp of this warpgroup made them
    const uint32_t sa = smem_addr(st);
    const uint32_t a_addr = sa + S::kActBytes + cw * 64 * 128;  // this warpgroup's 64 rows of weights
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < S::kTileK / 16; ks++)
      wgmma_m64n256k16_ss<kIsBf16<T>>(acc, smem_desc_sw128(a_addr + 32 * ks), smem_desc_sw128(sa + 32 * ks));
    wgmma_commit();
    // Wait for this stage's wgmma before dequantizing the next: the other warpgroup's wgmma keep
    // the tensor cores busy meanwhile. (Keeping one in flight, wait<1>, made ptxas serialize the
    // wgmma, C7515: the dequantization's registers next to 128 accumulators in flight.)
    wgmma_wait<0>();
    mbar_arrive(&empty[slot]);
  }
#pragma unroll
  for (int i = 0; i < 128; i++) fence_operand(acc[i]);

  // ---------------- epilogue: T through shared memory, then 16-byte stores along N
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
  named_barrier(3, S::kConsumers);  // both consumers are past the ring: its slots 0 and 1 are free
  uint8_t* stage_c = smem + cw * S::kStageBytes;  // [256 m][64 n] of T, rows of 128 bytes, swizzled
  const int nl = 16 * wq + g;                      // column in the warpgroup's 64
#pragma unroll
  for (int t8 = 0; t8 < 32; t8++) {
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int m = 8 * t8 + 2 * c + (e & 1);
      const int n = nl + 8 * (e >> 1);
      const float v = acc[4 * t8 + e] * (e >> 1 ? s_hi : s_lo);
      *reinterpret_cast<T*>(stage_c + sw128(m, n / 8) + (n % 8) * 2) = Elem<T>::from_float(v);
    }
  }
  named_barrier(1 + cw, 128);
  T* cout = reinterpret_cast<T*>(p.c);
  const int t = tid % 128, chunk = t % 8;
#pragma unroll
  for (int i = 0; i < 16; i++) {
    const int r = t / 8 + 16 * i;
    if (m0 + r < p.m)
      *reinterpret_cast<int4*>(cout + static_cast<long long>(m0 + r) * p.n + n0 + 64 * cw + 8 * chunk) =
          *reinterpret_cast<const int4*>(stage_c + sw128(r, chunk));
  }
#endif
}

}  // namespace marlin
