// Element types and weight formats of both kernels, in one place: the fp16 / bf16 traits, the
// dequantization of each weight format into mma fragments, and the scaling of a fragment.
// The kernels are templated on the element type T (half or nv_bfloat16) and the weight type W;
// every format-dependent instruction lives here (marlin/packing.py is the layout they follow).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "ptx.cuh"

namespace marlin {

// What the packed words of b_q hold (docs/FORMAT.md):
//  kU4:   8 unsigned nibbles per int32, w = (u - 8) * s (symmetric INT4, today's format)
//  kU4Zp: the same nibbles, w = (u - z) * s with a zero point z per group and column
//  kU8:   4 unsigned bytes per int32, w = (u - 128) * s (symmetric 8-bit)
enum WType : int { kU4 = 0, kU4Zp = 1, kU8 = 2 };

template <typename T>
struct Elem;

template <>
struct Elem<half> {
  using T2 = half2;
  __device__ __forceinline__ static T2 floats2(float a, float b) { return __floats2half2_rn(a, b); }
  __device__ __forceinline__ static float2 to_float2(T2 v) { return __half22float2(v); }
  __device__ __forceinline__ static half from_float(float a) { return __float2half_rn(a); }
  __device__ __forceinline__ static float to_float(half a) { return __half2float(a); }
};

template <>
struct Elem<nv_bfloat16> {
  using T2 = nv_bfloat162;
  __device__ __forceinline__ static T2 floats2(float a, float b) { return __floats2bfloat162_rn(a, b); }
  __device__ __forceinline__ static float2 to_float2(T2 v) { return __bfloat1622float2(v); }
  __device__ __forceinline__ static nv_bfloat16 from_float(float a) { return __float2bfloat16_rn(a); }
  __device__ __forceinline__ static float to_float(nv_bfloat16 a) { return __bfloat162float(a); }
};

template <typename T>
constexpr bool kIsBf16 = std::is_same<T, nv_bfloat16>::value;

template <typename T>
__device__ __forceinline__ typename Elem<T>::T2& as_t2(uint32_t& x) {
  return *reinterpret_cast<typename Elem<T>::T2*>(&x);
}
template <typename T>
__device__ __forceinline__ uint32_t as_u32(typename Elem<T>::T2 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}

// The constants that turn a nibble's magic-number value into u - z (kU4Zp), for the two columns
// of a 16x16 block at once: `zpair` holds the zero points of columns g (low half) and 8 + g (high
// half), as stored (one 32-bit word of the lane's zero points). Two instructions per block; the
// dequantization takes each column's half with a broadcast that folds into its operand. Exact:
// integers below 2^11 in fp16, below 2^8 in bf16.
//  fp16: low nibbles give 1024 + u, subtract 1024 + z; high nibbles give 1024 + 16 u, times 1/16
//        then add -(64 + z).
//  bf16: every nibble is shifted down to the low bits and gives 128 + u; subtract 128 + z.
struct U4Zero {
  uint32_t sub;  // {1024 + z_lo, 1024 + z_hi} or {128 + z_lo, 128 + z_hi}
  uint32_t add;  // fp16 only: {-(64 + z_lo), -(64 + z_hi)}
};

// A pair of 16-bit constants as T2 (bit patterns, so that no conversion is left to run).
template <typename T>
__device__ __forceinline__ typename Elem<T>::T2 const2(uint32_t bits) {
  return *reinterpret_cast<const typename Elem<T>::T2*>(&bits);
}

template <typename T>
__device__ __forceinline__ U4Zero u4_zero_pair(uint32_t zpair) {
  U4Zero out;
  if constexpr (kIsBf16<T>) {
    out.sub = as_u32<T>(__hadd2(as_t2<T>(zpair), const2<T>(0x43004300)));  // + 128
    out.add = 0;
  } else {
    out.sub = as_u32<T>(__hadd2(as_t2<T>(zpair), const2<T>(0x64006400)));                             // + 1024
    out.add = as_u32<T>(__hfma2(as_t2<T>(zpair), const2<T>(0xbc00bc00), const2<T>(0xd400d400)));  // * -1 - 64
  }
  return out;
}

// Eight 4-bit weights of one int32 as bf16 128 + u, in dequant_u4's fragment order: 0x4300 is bf16
// 128 (7 mantissa bits), so OR-ing a nibble into the low mantissa bits gives 128 + u exactly. A
// nibble at bits 4..7 would reach the exponent, so all four are shifted down: 4 LOP3 and 3 shifts.
// The offset (128 + 8, or 128 + z) is taken off by the caller: one HSUB2 per pair (dequant_u4), or
// once per group on fp32 sums (the small-batch kernel's raw path, SmallMShape::kFmtSums).
__device__ __forceinline__ void dequant_u4_biased_bf16(uint32_t w, uint32_t (&lo)[2], uint32_t (&hi)[2]) {
  constexpr uint32_t kLowMask = 0x000f000f;
  constexpr uint32_t kAndOr = (0xf0 & 0xcc) | 0xaa;  // lop3 truth table of (a & b) | c
  constexpr uint32_t kExp = 0x43004300;
  lo[0] = lop3<kAndOr>(w, kLowMask, kExp);
  lo[1] = lop3<kAndOr>(w >> 4, kLowMask, kExp);
  hi[0] = lop3<kAndOr>(w >> 8, kLowMask, kExp);
  hi[1] = lop3<kAndOr>(w >> 12, kLowMask, kExp);
}

// Eight 4-bit weights of one int32 (nibbles in 64207531 order) into the two mma B fragments of a
// 16x16 block: lo = column g (K rows 2c, 2c+1 | 2c+8, 2c+9), hi = column 8 + g. ZP: subtract the
// columns' zero points (z from u4_zero_pair) instead of the symmetric 8.
// fp16 without zero points is dequant_int4x8 of ptx.cuh, unchanged.
template <typename T, bool ZP>
__device__ __forceinline__ void dequant_u4(uint32_t w, uint32_t (&lo)[2], uint32_t (&hi)[2], U4Zero z) {
  constexpr uint32_t kLowMask = 0x000f000f;
  constexpr uint32_t kAndOr = (0xf0 & 0xcc) | 0xaa;  // lop3 truth table of (a & b) | c
  if constexpr (kIsBf16<T>) {
    dequant_u4_biased_bf16(w, lo, hi);
    nv_bfloat162 s_lo = const2<T>(0x43084308), s_hi = s_lo;  // symmetric: 136 = 128 + 8
    if constexpr (ZP) {
      s_lo = __low2bfloat162(as_t2<T>(z.sub));
      s_hi = __high2bfloat162(as_t2<T>(z.sub));
    }
    lo[0] = as_u32<T>(__hsub2(as_t2<T>(lo[0]), s_lo));
    lo[1] = as_u32<T>(__hsub2(as_t2<T>(lo[1]), s_lo));
    hi[0] = as_u32<T>(__hsub2(as_t2<T>(hi[0]), s_hi));
    hi[1] = as_u32<T>(__hsub2(as_t2<T>(hi[1]), s_hi));
  } else if constexpr (!ZP) {
    dequant_int4x8(w, lo, hi);
  } else {
    constexpr uint32_t kHighMask = 0x00f000f0;
    constexpr uint32_t kExp = 0x64006400;
    const uint32_t mul = 0x2c002c00;  // {1/16, 1/16}
    const uint32_t w_hi = w >> 8;
    uint32_t t0 = lop3<kAndOr>(w, kLowMask, kExp);
    uint32_t t1 = lop3<kAndOr>(w, kHighMask, kExp);
    uint32_t t2 = lop3<kAndOr>(w_hi, kLowMask, kExp);
    uint32_t t3 = lop3<kAndOr>(w_hi, kHighMask, kExp);
    const half2 m = *reinterpret_cast<const half2*>(&mul);
    const half2 sub = as_t2<T>(z.sub), add = as_t2<T>(z.add);
    lo[0] = as_u32<T>(__hsub2(as_t2<T>(t0), __low2half2(sub)));
    lo[1] = as_u32<T>(__hfma2(as_t2<T>(t1), m, __low2half2(add)));
    hi[0] = as_u32<T>(__hsub2(as_t2<T>(t2), __high2half2(sub)));
    hi[1] = as_u32<T>(__hfma2(as_t2<T>(t3), m, __high2half2(add)));
  }
}

// Four 8-bit weights of one int32 into one column's B fragment (f[0] = K rows 2c, 2c+1; f[1] =
// rows 2c+8, 2c+9), u - 128. The bytes hold fragment elements (e0, e2, e1, e3) (packing.py's
// INTERLEAVE_8), so that one byte permute gives each pair.
//  fp16: the permute puts bytes 0, 2 (then 1, 3) under the exponent 0x64: 1024 + u, exact.
//  bf16: 128 + u would not be exact above 256 (7 mantissa bits), so each byte goes under the
//        fp32 exponent of 2^23, 2^23 + 128 is subtracted exactly, and the pair is converted.
template <typename T>
__device__ __forceinline__ void dequant_u8(uint32_t w, uint32_t (&f)[2]) {
  if constexpr (kIsBf16<T>) {
    constexpr uint32_t kF32Exp = 0x4B000000;  // 2^23; bytes 4..6 of the permute source are zero
    float v[4];
#pragma unroll
    for (int b = 0; b < 4; b++) v[b] = __uint_as_float(__byte_perm(w, kF32Exp, 0x7650 + b)) - 8388736.f;  // 2^23 + 128
    f[0] = as_u32<T>(__floats2bfloat162_rn(v[0], v[2]));
    f[1] = as_u32<T>(__floats2bfloat162_rn(v[1], v[3]));
  } else {
    const uint32_t sub = 0x64806480;  // {1152, 1152} = 1024 + 128
    uint32_t t0 = __byte_perm(w, 0x64646464, 0x5250);
    uint32_t t1 = __byte_perm(w, 0x64646464, 0x5351);
    f[0] = as_u32<T>(__hsub2(as_t2<T>(t0), *reinterpret_cast<const half2*>(&sub)));
    f[1] = as_u32<T>(__hsub2(as_t2<T>(t1), *reinterpret_cast<const half2*>(&sub)));
  }
}

// A fragment pair times one scale (both halves of each register).
template <typename T>
__device__ __forceinline__ void scale_frag_t(uint32_t (&f)[2], T s) {
  if constexpr (kIsBf16<T>) {
    const nv_bfloat162 s2 = __bfloat162bfloat162(s);
    as_t2<T>(f[0]) = __hmul2(as_t2<T>(f[0]), s2);
    as_t2<T>(f[1]) = __hmul2(as_t2<T>(f[1]), s2);
  } else {
    scale_frag(f, s);
  }
}

}  // namespace marlin
