// Hopper warpgroup MMA (wgmma, sm_90a only) for the small-batch kernel's sm_90a variant.
// Compiled for any target, but the instructions exist only in sm_90a code: elsewhere each
// wrapper traps, and the planner (marlin_gemm.cu) never launches a wgmma instance unless the
// build included sm_90a (MARLIN_SM90A) and the device is compute capability 9.0.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MARLIN_HAS_WGMMA 1
#else
#define MARLIN_HAS_WGMMA 0
#endif

namespace marlin {

// Orders this thread's register writes (A fragments, zeroed accumulators) before the wgmma
// that reads them.
__device__ __forceinline__ void wgmma_fence() {
#if MARLIN_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if MARLIN_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Waits until at most N committed groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if MARLIN_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Shared memory written by the generic proxy (cp.async, st.shared) and then read by wgmma (the
// async proxy) needs this fence in every writing thread before the barrier.
__device__ __forceinline__ void fence_proxy_async_smem() {
#if MARLIN_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Keeps the compiler from moving accesses of an accumulator across a wgmma wait: the value
// "changes" here as far as it knows.
__device__ __forceinline__ void fence_operand(float& x) { asm volatile("" : "+f"(x)::"memory"); }
// The same for a wgmma register operand: pins its computation before the wgmma fence that
// follows (else the compiler may sink it past the fence, and ptxas then injects another).
__device__ __forceinline__ void fence_operand(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }

// Matrix descriptor of a K-major operand in the 128-byte swizzle layout: rows of 64 halves
// (128 bytes), 8-row atoms of 1024 bytes (1024-byte aligned), the 16-byte chunk c of row r
// stored at c ^ (r % 8). Start address >> 4 in bits 0-13, leading offset (unused for swizzled
// K-major) in 16-29, stride between 8-row atoms (1024 bytes >> 4) in 32-45, mode 1 = 128 B in
// 62-63. A k16 step inside the atom moves the start address by 32 bytes.
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t smem_byte_addr) {
  return static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// D[64 x N] (+)= A[64 x 16] * B[16 x N]: A from registers (each warp of the warpgroup holds 16
// rows, in the mma.m16n8k16 A-fragment order), B by descriptor, fp32 accumulators in the
// m16n8 C-fragment order per n8 tile (d[4 t + e] is tile t's element e). ACCUMULATE = false
// overwrites D (scale-d = 0, an immediate: a predicate computed in the asm would be a register
// written after the wgmma fence). BF16: bf16 A and B instead of fp16 (the same fragment order
// and shared-memory layout: both are 16-bit). One WgmmaRS specialisation per N: the accumulator
// list is part of the instruction; the macro in each only spells the operand type twice.
template <int N>
struct WgmmaRS;

template <>
struct WgmmaRS<16> {
  template <bool ACCUMULATE, bool BF16 = false>
  __device__ __forceinline__ static void run(float (&d)[8], const uint32_t (&a)[4], uint64_t b_desc) {
#if MARLIN_HAS_WGMMA
#define MARLIN_WGMMA_RS_16(TY)                                                      \
    asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, %13, 1, 1, 0;\n" \
 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(ACCUMULATE ? 1 : 0))
    if constexpr (BF16)
      MARLIN_WGMMA_RS_16("bf16");
    else
      MARLIN_WGMMA_RS_16("f16");
#undef MARLIN_WGMMA_RS_16
#else
    __trap();
#endif
  }
};

template <>
struct WgmmaRS<32> {
  template <bool ACCUMULATE, bool BF16 = false>
  __device__ __forceinline__ static void run(float (&d)[16], const uint32_t (&a)[4], uint64_t b_desc) {
#if MARLIN_HAS_WGMMA
#define MARLIN_WGMMA_RS_32(TY)                                                      \
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, %21, 1, 1, 0;\n" \
 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(ACCUMULATE ? 1 : 0))
    if constexpr (BF16)
      MARLIN_WGMMA_RS_32("bf16");
    else
      MARLIN_WGMMA_RS_32("f16");
#undef MARLIN_WGMMA_RS_32
#else
    __trap();
#endif
  }
};

template <>
struct WgmmaRS<64> {
  template <bool ACCUMULATE, bool BF16 = false>
  __device__ __forceinline__ static void run(float (&d)[32], const uint32_t (&a)[4], uint64_t b_desc) {
#if MARLIN_HAS_WGMMA
#define MARLIN_WGMMA_RS_64(TY)                                                      \
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, %37, 1, 1, 0;\n" \
 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(ACCUMULATE ? 1 : 0))
    if constexpr (BF16)
      MARLIN_WGMMA_RS_64("bf16");
    else
      MARLIN_WGMMA_RS_64("f16");
#undef MARLIN_WGMMA_RS_64
#else
    __trap();
#endif
  }
};

template <>
struct WgmmaRS<128> {
  template <bool ACCUMULATE, bool BF16 = false>
  __device__ __forceinline__ static void run(float (&d)[64], const uint32_t (&a)[4], uint64_t b_desc) {
#if MARLIN_HAS_WGMMA
#define MARLIN_WGMMA_RS_128(TY)                                                      \
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, %69, 1, 1, 0;\n" \
 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(ACCUMULATE ? 1 : 0))
    if constexpr (BF16)
      MARLIN_WGMMA_RS_128("bf16");
    else
      MARLIN_WGMMA_RS_128("f16");
#undef MARLIN_WGMMA_RS_128
#else
    __trap();
#endif
  }
};

template <int N, bool ACCUMULATE, bool BF16 = false>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b_desc) {
  WgmmaRS<N>::template run<ACCUMULATE, BF16>(d, a, b_desc);
}


// The 128 fp32 accumulators of an m64n256 wgmma as asm output operands (d[0] .. d[127]).
#define MARLIN_WGMMA_D128 \
      "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
      "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
      "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
      "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
      "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
      "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
      "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
      "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// D[64 x 256] += A[64 x 16] * B[16 x 256]: A from registers (each warp of the warpgroup holds 16
// rows in the mma.m16n8k16 A-fragment order, as for wgmma_m64k16_rs), B by descriptor (K-major,
// 128-byte swizzle: smem_desc_sw128), fp16 (BF16: bf16) in, fp32 accumulators in the m16n8
// C-fragment order per n8 tile. Always accumulates: the caller zeroes d first. The prefill kernel
// issues it with the dequantized weights as A, straight from the registers they were made in.
template <bool BF16 = false>
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t b_desc) {
#if MARLIN_HAS_WGMMA
#define MARLIN_WGMMA_RS_256(TY)                                                                         \
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, 1, 1, 1, 0;\n" \
      : MARLIN_WGMMA_D128 \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc))
  if constexpr (BF16)
    MARLIN_WGMMA_RS_256("bf16");
  else
    MARLIN_WGMMA_RS_256("f16");
#undef MARLIN_WGMMA_RS_256
#else
  __trap();
#endif
}

// Sparse (2:4) wgmma, fp16 (BF16: bf16): D[64 x N] += A[64 x 32] * B[32 x N] where A is 2:4
// along K and given compressed (64 x 16) from registers, in the same per-warp fragment order as
// the dense m64k16 A above (= mma.sp.m16n8k32's sparse fragment), B (32 rows of K) by
// descriptor, and e the metadata register. Per warp the metadata layout is that of
// mma.sp.m16n8k32 with a 16-bit type (as CUTLASS's ELayout_64x32 for its sparse GMMA atoms
// spells it; fp16 and bf16 alike): lanes with lane % 4 = 0, 1 supply it under selector 0,
// lane % 4 = c covering K rows 16 c .. 16 c + 15, the low 16 bits row g and the high 16 bits row
// g + 8 of the warp's 16 rows. Always accumulates (scale-d = 1: the caller zeroes D once). The
// macro in each specialisation only spells the operand type twice.
template <int N>
struct WgmmaSpRS;

template <>
struct WgmmaSpRS<16> {
  template <int SEL, bool BF16>
  __device__ __forceinline__ static void run(float (&d)[8], const uint32_t (&a)[4], uint64_t b_desc, uint32_t e) {
#if MARLIN_HAS_WGMMA
#define MARLIN_WGMMA_SP_16(TY)                                                                                            \
  asm volatile("wgmma.mma_async.sp.sync.aligned.m64n16k32.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, %13, %14, 1, 1, 1, 0;\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])   \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(e), "n"(SEL))
    if constexpr (BF16)
      MARLIN_WGMMA_SP_16("bf16");
    else
      MARLIN_WGMMA_SP_16("f16");
#undef MARLIN_WGMMA_SP_16
#else
    __trap();
#endif
  }
};

template <>
struct WgmmaSpRS<32> {
  template <int SEL, bool BF16>
  __device__ __forceinline__ static void run(float (&d)[16], const uint32_t (&a)[4], uint64_t b_desc, uint32_t e) {
#if MARLIN_HAS_WGMMA
#define MARLIN_WGMMA_SP_32(TY)                                                                                            \
  asm volatile("wgmma.mma_async.sp.sync.aligned.m64n32k32.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, %21, %22, 1, 1, 1, 0;\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(e), "n"(SEL))
    if constexpr (BF16)
      MARLIN_WGMMA_SP_32("bf16");
    else
      MARLIN_WGMMA_SP_32("f16");
#undef MARLIN_WGMMA_SP_32
#else
    __trap();
#endif
  }
};

template <>
struct WgmmaSpRS<64> {
  template <int SEL, bool BF16>
  __device__ __forceinline__ static void run(float (&d)[32], const uint32_t (&a)[4], uint64_t b_desc, uint32_t e) {
#if MARLIN_HAS_WGMMA
#define MARLIN_WGMMA_SP_64(TY)                                                                                            \
  asm volatile("wgmma.mma_async.sp.sync.aligned.m64n64k32.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, %37, %38, 1, 1, 1, 0;\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                 "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(e), "n"(SEL))
    if constexpr (BF16)
      MARLIN_WGMMA_SP_64("bf16");
    else
      MARLIN_WGMMA_SP_64("f16");
#undef MARLIN_WGMMA_SP_64
#else
    __trap();
#endif
  }
};

template <>
struct WgmmaSpRS<128> {
  template <int SEL, bool BF16>
  __device__ __forceinline__ static void run(float (&d)[64], const uint32_t (&a)[4], uint64_t b_desc, uint32_t e) {
#if MARLIN_HAS_WGMMA
#define MARLIN_WGMMA_SP_128(TY)                                                                                           \
  asm volatile("wgmma.mma_async.sp.sync.aligned.m64n128k32.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, %69, %70, 1, 1, 1, 0;\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(e), "n"(SEL))
    if constexpr (BF16)
      MARLIN_WGMMA_SP_128("bf16");
    else
      MARLIN_WGMMA_SP_128("f16");
#undef MARLIN_WGMMA_SP_128
#else
    __trap();
#endif
  }
};

// The same sparse product with N = 256 and fp32 accumulators d[128] (the prefill kernel's 2:4
// instances: A the weights' compressed values from registers, B 256 activation rows by descriptor).
template <bool BF16 = false>
__device__ __forceinline__ void wgmma_sp_m64n256k32_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t b_desc, uint32_t e) {
#if MARLIN_HAS_WGMMA
#define MARLIN_WGMMA_SP_256(TY)                                                                         \
  asm volatile("wgmma.mma_async.sp.sync.aligned.m64n256k32.f32." TY "." TY " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, %133, 0, 1, 1, 1, 0;\n" \
      : MARLIN_WGMMA_D128 \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(e))
  if constexpr (BF16)
    MARLIN_WGMMA_SP_256("bf16");
  else
    MARLIN_WGMMA_SP_256("f16");
#undef MARLIN_WGMMA_SP_256
#else
  __trap();
#endif
}

template <int N, bool BF16 = false, int SEL = 0>
__device__ __forceinline__ void wgmma_sp_m64k32_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b_desc, uint32_t e) {
  WgmmaSpRS<N>::template run<SEL, BF16>(d, a, b_desc, e);
}

}  // namespace marlin
